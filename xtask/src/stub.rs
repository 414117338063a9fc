//! `-lcuda` on machines without an NVIDIA driver: a generated stand-in `libcuda.so.1`
//! whose every entry point returns CUDA_ERROR_NO_DEVICE, so GPU code sees "no device".
//! It is loaded only where no real driver is installed, never in front of one; where
//! a driver exists but no `libcuda.so` to link against, it serves the link alone.

use crate::{root, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

const CUDA_ERROR_NO_DEVICE: u32 = 100;

/// Where the stand-in goes: `.cargo/config.toml` points cust_raw's link search
/// (`CUDA_LIBRARY_PATH`) at this folder, which the repository holds (empty but for
/// a `.gitignore`), so that cust_raw's build script finds a `lib64` even in a fresh
/// clone with no CUDA installed. It lies outside target/, so cargo never puts it on
/// the library path by itself: only [`LinkEnv::apply`] does, where no driver exists.
pub fn stub_root() -> PathBuf {
    root().join(".cargo/cuda-stub")
}

/// How host cargo commands must be run to link (and, without a driver, to load) libcuda.
pub struct LinkEnv {
    /// True where `-lcuda` resolves only through the stub.
    link_stub: bool,
    /// True only where no driver exists: the stub is then also what loads at run time.
    load_stub: bool,
}

impl LinkEnv {
    pub fn apply(&self, cmd: &mut Command) {
        let lib64 = stub_root().join("lib64");
        if self.link_stub {
            // cargo's `[env]` already names the stub unless the environment sets the
            // variable itself; then the stub goes in front of what it names.
            let current = std::env::var("CUDA_LIBRARY_PATH").unwrap_or_default();
            if !current.split(':').any(|p| Path::new(p) == stub_root()) {
                let joined = [stub_root().display().to_string(), current].join(":");
                cmd.env("CUDA_LIBRARY_PATH", joined.trim_end_matches(':'));
            }
        }
        if self.load_stub {
            cmd.env("LD_LIBRARY_PATH", lib64);
        }
    }
}

pub fn real_driver_present() -> bool {
    let cache = Command::new("/sbin/ldconfig").arg("-p").output();
    let in_cache = cache.map(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so.1")).unwrap_or(false);
    in_cache
        || ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1"]
            .iter()
            .any(|p| Path::new(p).exists())
}

/// Whether `-lcuda` resolves without the stub: a `libcuda.so` where cust_raw's build
/// script looks (other than the stub folder) or in the linker's system folders.
fn real_link_lib_present() -> bool {
    let mut roots: Vec<PathBuf> = std::env::var("CUDA_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|p| !p.is_empty() && Path::new(p) != stub_root())
        .map(PathBuf::from)
        .collect();
    roots.extend(["/opt/cuda", "/usr/local/cuda"].map(PathBuf::from));
    if let Ok(dirs) = std::fs::read_dir("/usr/local") {
        roots.extend(dirs.flatten().map(|d| d.path()).filter(|p| p.to_string_lossy().contains("/cuda-")));
    }
    let in_roots = roots.iter().any(|r| {
        ["lib64", "lib64/stubs", "targets/x86_64-linux/lib", "targets/x86_64-linux/lib/stubs"]
            .iter()
            .any(|sub| r.join(sub).join("libcuda.so").exists())
    });
    in_roots
        || ["/usr/lib/x86_64-linux-gnu/libcuda.so", "/usr/lib64/libcuda.so", "/usr/lib/libcuda.so"]
            .iter()
            .any(|p| Path::new(p).exists())
}

pub fn ensure_link_env() -> Result<LinkEnv> {
    let driver = real_driver_present();
    if driver && real_link_lib_present() {
        return Ok(LinkEnv { link_stub: false, load_stub: false });
    }
    if !driver {
        eprintln!("xtask: no NVIDIA driver here; GPU tests will report themselves skipped");
    }
    // With a driver but nothing to link against, the stub serves the link only: the
    // loader asks for `libcuda.so.1`, and the real driver's is what it finds.
    build_stub()?;
    Ok(LinkEnv { link_stub: true, load_stub: !driver })
}

/// The `cu*` entry points that cust_raw declares, read from its bindings.
fn cust_raw_symbols() -> Result<Vec<String>> {
    let meta = Command::new(std::env::var("CARGO").unwrap_or("cargo".into()))
        .current_dir(root())
        .args(["metadata", "--format-version", "1"])
        .output()
        .map_err(|e| format!("cargo metadata: {e}"))?;
    let text = String::from_utf8_lossy(&meta.stdout);
    let manifest = text
        .split('"')
        .find(|s| s.contains("cust_raw-") && s.ends_with("Cargo.toml"))
        .ok_or("cust_raw not found in cargo metadata")?;
    let bindings = Path::new(manifest).parent().unwrap().join("src/cuda.rs");
    let src = std::fs::read_to_string(&bindings).map_err(|e| format!("{}: {e}", bindings.display()))?;
    let mut names: Vec<String> = src
        .split("pub fn ")
        .skip(1)
        .filter_map(|s| s.split('(').next())
        .filter(|n| n.starts_with("cu"))
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

/// Driver entry points that host declares itself (cust_raw's bindings are CUDA 11.4).
const EXTRA_SYMBOLS: &[&str] = &["cuTensorMapEncodeTiled"];

/// Writes `.cargo/cuda-stub/lib64/libcuda.so{,.1}` (git ignores them).
fn build_stub() -> Result<()> {
    let lib64 = stub_root().join("lib64");
    let lib = lib64.join("libcuda.so");
    let mut c = String::from("/* Generated by `cargo xtask stub-libcuda`: no NVIDIA driver here. */\n");
    for name in cust_raw_symbols()?.into_iter().chain(EXTRA_SYMBOLS.iter().map(|s| s.to_string())) {
        c += &format!("int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n");
    }
    let src = lib64.join("libcuda_stub.c");
    if lib.exists() && std::fs::read_to_string(&src).is_ok_and(|old| old == c) {
        return Ok(());
    }
    std::fs::create_dir_all(&lib64).map_err(|e| e.to_string())?;
    std::fs::write(&src, c).map_err(|e| e.to_string())?;
    crate::run_status(
        Command::new("cc").args(["-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o"]).arg(&lib).arg(&src),
    )?;
    let so1 = lib64.join("libcuda.so.1");
    let _ = std::fs::remove_file(&so1);
    std::fs::copy(&lib, &so1).map_err(|e| e.to_string())?;
    eprintln!("xtask: wrote stand-in {}", lib.display());
    Ok(())
}
