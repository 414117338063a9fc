//! Host side of the project: loads the Rust-built PTX through `cust`, owns device
//! tensors, and launches the kernels through typed wrappers that validate every
//! argument before any launch. CPU references (f64 accumulation) live in
//! [`reference`](mod@reference); seeded inputs in [`data`], error and time measures in [`metrics`].
//! The versions kept for comparison are behind the `dev` feature.

pub mod data;
pub mod error;
pub mod kernels;
mod launch_ex;
pub mod layer;
pub mod metrics;
pub mod model;
pub mod ops;
pub mod reference;
pub mod runtime;
pub mod tensor;
pub mod tensor_map;
pub mod tp;

pub use error::{Error, Result};
pub use half::bf16;
pub use runtime::{Arch, Gpu, Kernel, KernelInfo};
pub use tensor::{DType, DynTensor, Tensor};

/// The embedded PTX modules, one per architecture: what the driver compiles
/// where no [`cubin`] of the module runs.
pub mod ptx {
    /// Hopper (H100/H200): may use sm_90a-only instructions.
    pub const SM_90A: &str = include_str!(concat!(env!("OUT_DIR"), "/sm_90a.ptx"));
    /// The portable path for sm_80 and newer.
    pub const SM_80: &str = include_str!(concat!(env!("OUT_DIR"), "/sm_80.ptx"));
    /// The versions kept for comparison (and the shipped ones), for sm_90a.
    #[cfg(feature = "dev")]
    pub const SM_90A_DEV: &str = include_str!(concat!(env!("OUT_DIR"), "/sm_90a-dev.ptx"));
    /// The versions kept for comparison (and the shipped ones), for sm_80.
    #[cfg(feature = "dev")]
    pub const SM_80_DEV: &str = include_str!(concat!(env!("OUT_DIR"), "/sm_80-dev.ptx"));
}

/// The same modules assembled by ptxas: a device of the module's architecture
/// (and, for sm_80, any later 8.x) loads them as they are, where the PTX costs a
/// JIT compile of every kernel on a machine whose driver cache is cold.
pub mod cubin {
    pub const SM_90A: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sm_90a.cubin"));
    pub const SM_80: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sm_80.cubin"));
    #[cfg(feature = "dev")]
    pub const SM_90A_DEV: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sm_90a-dev.cubin"));
    #[cfg(feature = "dev")]
    pub const SM_80_DEV: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sm_80-dev.cubin"));
}
