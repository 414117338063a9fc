//! Typed handles of every kernel entry point, generated at build time from the
//! kernels' `launch_bounds!(entry: Params, threads)` declarations in the PTX:
//! `SOFTMAX_V1_F32X4_R1` is a `Kernel<abi::SoftmaxArgs>` named
//! `softmax_v1_f32x4_r1`. [`SHIPPED`] lists the shipped module's entries;
//! with the `dev` feature, `dev` holds the versions kept for comparison.

use crate::runtime::{Kernel, KernelInfo};

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
