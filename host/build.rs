//! Embeds the PTX built by `cargo xtask build-ptx`, and refuses PTX that is older
//! than the kernel sources: a stale kernel can never be loaded silently. A refusal
//! is one `cargo::error` line naming the command to run, not a panic's report.

use std::path::{Path, PathBuf};

include!("../xtask/src/fingerprint.rs");

const ARCHES: [&str; 2] = ["sm_90a", "sm_80"];

fn main() {
    if let Err(message) = embed() {
        println!("cargo::error={message}");
    }
}

fn embed() -> Result<(), String> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().unwrap();
    let ptx_dir = root.join("target/ptx");
    for watched in ["kernels/src", "kernels/Cargo.toml", "abi/src", "target/ptx/fingerprint"] {
        println!("cargo:rerun-if-changed={}", root.join(watched).display());
    }
    let want = kernels_fingerprint(&root.join("kernels")).map_err(|e| format!("reading kernels/ sources: {e}"))?;
    let have = std::fs::read_to_string(ptx_dir.join("fingerprint")).unwrap_or_default();
    let dev = std::env::var_os("CARGO_FEATURE_DEV").is_some();
    let stems: Vec<String> =
        ARCHES.iter().flat_map(|a| [a.to_string()].into_iter().chain(dev.then(|| format!("{a}-dev")))).collect();
    let missing: Vec<&String> = stems.iter().filter(|s| !ptx_dir.join(format!("{s}.ptx")).exists()).collect();
    if let Some(first) = missing.first() {
        return Err(format!("target/ptx/{first}.ptx is missing: run `cargo xtask build-ptx`"));
    }
    if have.trim() != format!("{want:016x}") {
        return Err("target/ptx is older than kernels/ or abi/: run `cargo xtask build-ptx`".into());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    for stem in &stems {
        copy(&ptx_dir.join(format!("{stem}.ptx")), &out.join(format!("{stem}.ptx")))?;
    }
    Ok(())
}

fn copy(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::copy(from, to).map(|_| ()).map_err(|e| format!("copy {}: {e}", from.display()))
}
