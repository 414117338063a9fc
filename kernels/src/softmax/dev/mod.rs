//! Softmax versions kept for comparison with the shipped ones (feature `dev`):
//! - `v2`: a persistent block that holds one row in registers while `cp.async`
//!   already streams the next row into shared memory. Measured slower than v1
//!   except where v1 needs 1024-thread blocks (docs/PERF.md), which `softmax`'s
//!   preferred block size never asks for. (No f32 r8 entry: at 1024 threads it
//!   needs more than 64 registers and spills.)

mod v2;

use super::SoftmaxArgs;
use crate::gpu::pack::{Bf16x8, F32x4};

entries! {
    softmax_v2_f32x4_r1 => v2::<F32x4, 1> @ 1024;
    softmax_v2_f32x4_r2 => v2::<F32x4, 2> @ 1024;
    softmax_v2_f32x4_r4 => v2::<F32x4, 4> @ 1024;
    softmax_v2_bf16x8_r1 => v2::<Bf16x8, 1> @ 1024;
    softmax_v2_bf16x8_r2 => v2::<Bf16x8, 2> @ 1024;
    softmax_v2_bf16x8_r4 => v2::<Bf16x8, 4> @ 1024;
    softmax_v2_bf16x8_r8 => v2::<Bf16x8, 8> @ 512;
}
