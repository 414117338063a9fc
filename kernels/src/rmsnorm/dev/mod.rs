//! RMSNorm versions kept for comparison with the shipped ones (feature `dev`),
//! each measured no faster than v1 (docs/PERF.md):
//! - v2–v5 (`resident` with a named `Variant`): the shipped row-in-registers
//!   kernel with the weights loaded before the reduction (v2), the row
//!   re-unpacked for the output (v3), the next row loaded during this one's
//!   reduction on a resident grid (v4), streaming loads (v5);
//! - v6 (`warp_rows`): one warp per row, the block's warps independent.

pub mod resident;
mod warp_rows;

use super::RmsNormArgs;
use crate::gpu::pack::Bf16x8;
use resident::{resident, Pipeline, PrefetchWeight, Repack, StreamLoads};
use warp_rows::warp_rows;

entries! {
    rmsnorm_v2_bf16x8_r1 => resident::<PrefetchWeight, Bf16x8, 1> @ 1024;
    rmsnorm_v2_bf16x8_r2 => resident::<PrefetchWeight, Bf16x8, 2> @ 1024;
    rmsnorm_v2_bf16x8_r4 => resident::<PrefetchWeight, Bf16x8, 4> @ 512;
    rmsnorm_v2_bf16x8_r8 => resident::<PrefetchWeight, Bf16x8, 8> @ 256;
    rmsnorm_v3_bf16x8_r1 => resident::<Repack, Bf16x8, 1> @ 1024;
    rmsnorm_v3_bf16x8_r2 => resident::<Repack, Bf16x8, 2> @ 1024;
    rmsnorm_v3_bf16x8_r4 => resident::<Repack, Bf16x8, 4> @ 512;
    rmsnorm_v3_bf16x8_r8 => resident::<Repack, Bf16x8, 8> @ 256;
    rmsnorm_v4_bf16x8_r1 => resident::<Pipeline, Bf16x8, 1> @ 1024;
    rmsnorm_v4_bf16x8_r2 => resident::<Pipeline, Bf16x8, 2> @ 1024;
    rmsnorm_v4_bf16x8_r4 => resident::<Pipeline, Bf16x8, 4> @ 512;
    rmsnorm_v4_bf16x8_r8 => resident::<Pipeline, Bf16x8, 8> @ 256;
    rmsnorm_v5_bf16x8_r1 => resident::<StreamLoads, Bf16x8, 1> @ 1024;
    rmsnorm_v5_bf16x8_r2 => resident::<StreamLoads, Bf16x8, 2> @ 1024;
    rmsnorm_v5_bf16x8_r4 => resident::<StreamLoads, Bf16x8, 4> @ 512;
    rmsnorm_v5_bf16x8_r8 => resident::<StreamLoads, Bf16x8, 8> @ 256;
    rmsnorm_v6_bf16x8_w1 => warp_rows::<Bf16x8, 1> @ 1024;
    rmsnorm_v6_bf16x8_w2 => warp_rows::<Bf16x8, 2> @ 1024;
    rmsnorm_v6_bf16x8_w4 => warp_rows::<Bf16x8, 4> @ 1024;
    rmsnorm_v6_bf16x8_w8 => warp_rows::<Bf16x8, 8> @ 512;
    // Two blocks of 256 per SM (≤ 128 registers); three (≤ 80) spilled.
    rmsnorm_v6_bf16x8_w16 => warp_rows::<Bf16x8, 16> @ 256, 2;
}
