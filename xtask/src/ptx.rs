//! `cargo xtask build-ptx`: the shipped and dev PTX modules of each architecture,
//! the architectures built in parallel, then the ptxas gate over all of them.

use crate::fingerprint::kernels_fingerprint;
use crate::modules::{self, ptx_dir, Module, ARCHES};
use crate::{link, ptxas, root, toolchain, Result};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

fn fingerprint_path() -> PathBuf {
    ptx_dir().join("fingerprint")
}

/// Builds every module unless the sources are unchanged, then runs the ptxas gate.
/// With nothing rebuilt, the gate's summary line is all it prints unless `verbose`.
pub fn build_all(verbose: bool) -> Result<()> {
    let kernels = root().join("kernels");
    let fingerprint = kernels_fingerprint(&kernels).map_err(|e| format!("reading kernels/: {e}"))?;
    let outputs: Vec<PathBuf> = modules::all().map(Module::ptx).collect();
    let current = std::fs::read_to_string(fingerprint_path()).unwrap_or_default();
    if current.trim() == format!("{fingerprint:016x}") && outputs.iter().all(|p| p.exists()) {
        if verbose {
            eprintln!("xtask: PTX up to date ({})", ptx_dir().display());
        }
        return ptxas::check_all(verbose);
    }
    toolchain::ensure_ptx_toolchain()?;
    let start = Instant::now();
    std::fs::create_dir_all(ptx_dir()).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(fingerprint_path());
    let linker = std::env::current_exe().map_err(|e| e.to_string())?;
    let children: Vec<_> = ARCHES
        .iter()
        .map(|&(arch, features)| {
            // Kernels index per-thread register arrays in const-bounded loops; they must
            // unroll fully or the arrays fall to local memory.
            let mut flags =
                format!("-C target-cpu={arch} -C linker={} -C llvm-args=-unroll-threshold=4000", linker.display());
            if !features.is_empty() {
                flags += &format!(" -C target-feature={features}");
            }
            // The shipped and dev builds of one arch share a target dir (one `core`
            // build) and so run one after the other; the arches run in parallel.
            std::thread::Builder::new()
                .name(arch.to_string())
                .spawn(move || -> Result<()> {
                    for dev in [false, true] {
                        let mut cmd = kernels_build(arch, &flags, dev);
                        let out = cmd.output().map_err(|e| format!("cannot start cargo: {e}"))?;
                        let module = Module { arch, dev };
                        let stem = module.stem();
                        if !out.status.success() {
                            return Err(format!(
                                "kernels build for {stem} failed:\n{}{}",
                                String::from_utf8_lossy(&out.stdout),
                                String::from_utf8_lossy(&out.stderr)
                            ));
                        }
                        print_compiler_warnings(&stem, &String::from_utf8_lossy(&out.stderr));
                        let built =
                            root().join("target/kernels").join(arch).join("nvptx64-nvidia-cuda/release/kernels.ptx");
                        std::fs::copy(&built, module.ptx()).map_err(|e| format!("{}: {e}", built.display()))?;
                    }
                    Ok(())
                })
                .map_err(|e| format!("cannot start a build thread: {e}"))
        })
        .collect::<Result<Vec<_>>>()?;
    for child in children {
        child.join().map_err(|_| "a kernels build thread panicked".to_string())??;
    }
    eprintln!("xtask: built {} PTX modules in {:.1} s", outputs.len(), start.elapsed().as_secs_f64());
    ptxas::check_all(verbose)?;
    std::fs::write(fingerprint_path(), format!("{fingerprint:016x}\n")).map_err(|e| e.to_string())
}

/// `cargo build` of kernels/ for `arch`, with the `dev` versions or without.
fn kernels_build(arch: &str, flags: &str, dev: bool) -> Command {
    let mut cmd = Command::new(toolchain::CARGO);
    cmd.current_dir(root().join("kernels"))
        .args(["build", "--release", "--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core"])
        .arg("--target-dir")
        .arg(root().join("target").join("kernels").join(arch))
        .env("RUSTC", toolchain::RUSTC)
        .env("RUSTC_BOOTSTRAP", "1")
        .env("RUSTFLAGS", flags)
        .env(link::LINK_MODE_ENV, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if dev {
        cmd.args(["--features", "dev"]);
    }
    // Variables set by the outer (rustup) cargo must not leak into the nvptx build.
    for var in [
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "RUSTUP_TOOLCHAIN",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_BUILD_TARGET",
        "CARGO_MANIFEST_DIR",
        "CARGO_PKG_NAME",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// The kernel builds' output is captured (two run in parallel); still show the
/// compiler's warnings about our code. The one about the `ptxN` target feature
/// being unstable is expected and dropped.
fn print_compiler_warnings(arch: &str, stderr: &str) {
    let mut block: Vec<&str> = Vec::new();
    let flush = |block: &mut Vec<&str>| {
        let text = block.join("\n");
        let expected = text.contains("-Ctarget-feature") || text.contains("generated");
        if !block.is_empty() && !expected {
            eprintln!("xtask: {arch}: {text}");
        }
        block.clear();
    };
    for line in stderr.lines() {
        if line.starts_with("warning") {
            flush(&mut block);
            block.push(line);
        } else if line.trim().is_empty() {
            flush(&mut block);
        } else if !block.is_empty() {
            block.push(line);
        }
    }
    flush(&mut block);
}
