//! Embeds the PTX built by `cargo xtask build-ptx`, and refuses PTX that is older
//! than the kernel sources: a stale kernel can never be loaded silently.

use std::path::{Path, PathBuf};

include!("../xtask/src/fingerprint.rs");

const ARCHES: [&str; 2] = ["sm_90a", "sm_80"];

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().unwrap();
    let ptx_dir = root.join("target/ptx");
    for watched in ["kernels/src", "kernels/Cargo.toml", "abi/src", "target/ptx/fingerprint"] {
        println!("cargo:rerun-if-changed={}", root.join(watched).display());
    }
    let want = kernels_fingerprint(&root.join("kernels")).expect("reading kernels/ sources");
    let have = std::fs::read_to_string(ptx_dir.join("fingerprint")).unwrap_or_default();
    let dev = std::env::var_os("CARGO_FEATURE_DEV").is_some();
    let stems: Vec<String> =
        ARCHES.iter().flat_map(|a| [a.to_string()].into_iter().chain(dev.then(|| format!("{a}-dev")))).collect();
    let missing: Vec<&String> = stems.iter().filter(|s| !ptx_dir.join(format!("{s}.ptx")).exists()).collect();
    if have.trim() != format!("{want:016x}") || !missing.is_empty() {
        panic!(
            "\n\nThe kernels' PTX is missing or older than kernels/ (stale).\n\
             Run `cargo xtask build-ptx` (or `cargo xtask test` / `cargo xtask demo`, which build it first).\n\n"
        );
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    for stem in &stems {
        copy(&ptx_dir.join(format!("{stem}.ptx")), &out.join(format!("{stem}.ptx")));
    }
}

fn copy(from: &Path, to: &Path) {
    std::fs::copy(from, to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
}
