//! The PTX toolchain comes from Debian packages (and ptxas from PyPI). Missing pieces
//! are installed when we are root; otherwise the exact command is printed.

use crate::Result;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const RUSTC: &str = "/usr/bin/rustc";
pub const CARGO: &str = "/usr/bin/cargo";
const RUST_SRC: &str = "/usr/lib/rustlib/src/rust/library/Cargo.lock";
const LLVM_BIN: &str = "/usr/lib/llvm-22/bin";
pub const PTXAS_WHEEL: &str = "nvidia-cuda-nvcc==13.0.88";

/// A Debian package and the file that shows it is installed.
struct Need {
    package: &'static str,
    file: &'static str,
}

const NEEDS: &[Need] = &[
    Need { package: "rustc-web", file: RUSTC },
    Need { package: "cargo-web", file: CARGO },
    Need { package: "rust-web-src", file: RUST_SRC },
    Need { package: "llvm-22", file: "/usr/lib/llvm-22/bin/llc" },
];

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0\n")).unwrap_or(false)
}

/// Makes sure the Debian toolchain for nvptx64 is present.
pub fn ensure_ptx_toolchain() -> Result<()> {
    let missing: Vec<&str> = NEEDS.iter().filter(|n| !Path::new(n.file).exists()).map(|n| n.package).collect();
    if !missing.is_empty() {
        let install = format!("apt-get install -y {}", missing.join(" "));
        if !is_root() {
            return Err(format!(
                "missing Debian packages: {}\nrun: sudo apt-get update && sudo {install}",
                missing.join(" ")
            ));
        }
        eprintln!("xtask: installing Debian packages: {}", missing.join(" "));
        crate::run_status(Command::new("apt-get").arg("update").arg("-q"))?;
        crate::run_status(Command::new("sh").arg("-c").arg(format!("DEBIAN_FRONTEND=noninteractive {install} -q")))?;
    }
    let cpus = Command::new(RUSTC)
        .args(["--print", "target-cpus", "--target", "nvptx64-nvidia-cuda"])
        .output()
        .map_err(|e| format!("cannot run {RUSTC}: {e}"))?;
    if !String::from_utf8_lossy(&cpus.stdout).contains("sm_90a") {
        return Err(format!("{RUSTC} does not know sm_90a; rustc-web 1.96 or newer is needed"));
    }
    Ok(())
}

/// An LLVM 22 tool by name (the unversioned ones on PATH are too old for this bitcode).
pub fn llvm_tool(name: &str) -> Result<PathBuf> {
    let path = Path::new(LLVM_BIN).join(name);
    if path.exists() {
        Ok(path)
    } else {
        Err(format!("{} not found: install the Debian package llvm-22", path.display()))
    }
}

/// Finds ptxas: $PTXAS, then the PyPI wheel, then PATH. Installs the wheel if allowed.
pub fn ptxas() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PTXAS") {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = ptxas_from_wheel() {
        return Ok(p);
    }
    if let Ok(out) = Command::new("sh").arg("-c").arg("command -v ptxas").output() {
        let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !p.is_empty() {
            return Ok(PathBuf::from(p));
        }
    }
    let install = format!("python3 -m pip install {PTXAS_WHEEL}");
    eprintln!("xtask: installing ptxas from PyPI: {install}");
    let ok = Command::new("python3")
        .args(["-m", "pip", "install", "-q", PTXAS_WHEEL])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    match (ok, ptxas_from_wheel()) {
        (true, Some(p)) => Ok(p),
        _ => Err(format!("ptxas not found; run: {install}")),
    }
}

fn ptxas_from_wheel() -> Option<PathBuf> {
    from_wheel("ptxas")
}

/// A CUDA 13 tool installed by its PyPI wheel (nvidia/cu13/bin on Python's path).
pub fn from_wheel(tool: &str) -> Option<PathBuf> {
    let script = format!(
        "import sys, os\nfor p in sys.path:\n    f = os.path.join(p, 'nvidia', 'cu13', 'bin', '{tool}')\n    if os.path.isfile(f):\n        print(f); break\n"
    );
    let out = Command::new("python3").arg("-c").arg(script).output().ok()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!p.is_empty()).then(|| PathBuf::from(p))
}
