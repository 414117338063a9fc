//! The PTX modules: which files `build-ptx` writes and `ptxas` checks. Both read
//! the list from here, so neither needs the other for it.

use crate::root;
use std::path::PathBuf;

/// (target-cpu, extra target features). sm_90a unlocks wgmma/setmaxnreg (PTX 8.0), vector f32
/// reductions (PTX 8.1) and the tensormap proxy fence (PTX 8.3).
pub const ARCHES: &[(&str, &str)] = &[("sm_90a", "+ptx83"), ("sm_80", "")];

/// One module: `<arch>.ptx` is shipped; `<arch>-dev.ptx` adds the versions kept for
/// comparison (the kernels' `dev` feature), and only tests and benches load it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Module {
    pub arch: &'static str,
    pub dev: bool,
}

impl Module {
    pub fn stem(self) -> String {
        if self.dev {
            format!("{}-dev", self.arch)
        } else {
            self.arch.to_string()
        }
    }

    pub fn ptx(self) -> PathBuf {
        ptx_dir().join(format!("{}.ptx", self.stem()))
    }

    /// The module assembled by ptxas for its arch, which the host embeds so a
    /// device of that arch loads machine code instead of JIT-compiling the PTX.
    pub fn cubin(self) -> PathBuf {
        ptx_dir().join(format!("{}.cubin", self.stem()))
    }

    /// The saved `ptxas -v` output for this module.
    pub fn ptxas_report(self) -> PathBuf {
        ptx_dir().join(format!("{}.ptxas.txt", self.stem()))
    }
}

pub fn ptx_dir() -> PathBuf {
    root().join("target").join("ptx")
}

/// Every module, shipped before dev for each arch.
pub fn all() -> impl Iterator<Item = Module> {
    ARCHES.iter().flat_map(|&(arch, _)| [Module { arch, dev: false }, Module { arch, dev: true }])
}
