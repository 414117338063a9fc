//! RMSNorm kernel versions side by side, for the tests and benchmarks that pick
//! what [`rms_norm`](super::rms_norm) and [`add_rms_norm`](super::add_rms_norm) ship.

use super::{launch, RmsNormPlan, Rows, VEC};
use crate::error::Result;
use crate::kernels::dev as k;
use crate::ops::{row_grid, RowEntry};
use crate::runtime::{Gpu, Kernel};
use crate::tensor::Tensor;
use abi::RmsNormArgs;
use half::bf16;

/// Kernel versions for 16-byte rows, kept side by side. Rows that are not whole
/// packs, or too long for a version's table, take the shipped kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmsNormVersion {
    /// The row held in registers (shipped).
    V1,
    /// Weights loaded before the row reduction.
    V2,
    /// V1 re-unpacking the row for the output (fewer registers); measured no faster.
    V3,
    /// V1 on a grid of resident blocks that load their next row before reducing
    /// the current one; measured slower.
    V4,
    /// V1 with streaming loads (read-only path, no L1 allocation, 256-byte L2
    /// prefetch): +0.9% over V1 on the plain norm, within run spread (docs/PERF.md).
    V5,
    /// One warp per row (threads/32 independent rows per block, no block barrier),
    /// streaming loads as V5. Rows too long for one warp (over 4096 bf16) or not a
    /// multiple of 8 take V1's kernels. Measured 2-3% slower than V1 plain at
    /// 4096 columns, 18% slower fused (16 warps per SM at 121 registers).
    V6,
}

/// The shipped version.
pub const SHIPPED: RmsNormVersion = RmsNormVersion::V1;

const fn e(kernel: Kernel<RmsNormArgs>, vpt: u32) -> RowEntry<RmsNormArgs> {
    RowEntry { kernel, vpt }
}

/// v2: weights loaded before the row reduction (more registers, less latency).
const VEC_V2: &[RowEntry<RmsNormArgs>] = &[
    e(k::RMSNORM_V2_BF16X8_R1, 1),
    e(k::RMSNORM_V2_BF16X8_R2, 2),
    e(k::RMSNORM_V2_BF16X8_R4, 4),
    e(k::RMSNORM_V2_BF16X8_R8, 8),
];
const VEC_V3: &[RowEntry<RmsNormArgs>] = &[
    e(k::RMSNORM_V3_BF16X8_R1, 1),
    e(k::RMSNORM_V3_BF16X8_R2, 2),
    e(k::RMSNORM_V3_BF16X8_R4, 4),
    e(k::RMSNORM_V3_BF16X8_R8, 8),
];
/// v4: a grid of resident blocks, each loading its next row before reducing this one.
const VEC_V4: &[RowEntry<RmsNormArgs>] = &[
    e(k::RMSNORM_V4_BF16X8_R1, 1),
    e(k::RMSNORM_V4_BF16X8_R2, 2),
    e(k::RMSNORM_V4_BF16X8_R4, 4),
    e(k::RMSNORM_V4_BF16X8_R8, 8),
];
/// v5: v1 with x (and the residual) read through the read-only path, no L1
/// allocation and a 256-byte L2 prefetch hint.
const VEC_V5: &[RowEntry<RmsNormArgs>] = &[
    e(k::RMSNORM_V5_BF16X8_R1, 1),
    e(k::RMSNORM_V5_BF16X8_R2, 2),
    e(k::RMSNORM_V5_BF16X8_R4, 4),
    e(k::RMSNORM_V5_BF16X8_R8, 8),
];
/// v6: one warp per row; `vpt` is packs per lane (a row of up to 32·vpt packs).
const WARP_V6: &[RowEntry<RmsNormArgs>] = &[
    e(k::RMSNORM_V6_BF16X8_W1, 1),
    e(k::RMSNORM_V6_BF16X8_W2, 2),
    e(k::RMSNORM_V6_BF16X8_W4, 4),
    e(k::RMSNORM_V6_BF16X8_W8, 8),
    e(k::RMSNORM_V6_BF16X8_W16, 16),
];

/// A version's plan: the launch, and what sized its grid.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VersionPlan {
    pub plan: RmsNormPlan,
    /// Launch only as many blocks as fit on the GPU at once (V4; the kernel loops
    /// over rows).
    pub resident_grid: bool,
    /// Rows one block handles at a time: 1, or one per warp (V6).
    pub rows_per_block: u32,
}

/// Validates shapes and eps and picks `version`'s kernel, with the preferred
/// block size as a knob. Pure: no GPU needed.
pub fn plan_tuned(
    x: &[usize],
    weight: &[usize],
    y: &[usize],
    residual: Option<(&[usize], &[usize])>,
    eps: f32,
    preferred_threads: u32,
    version: RmsNormVersion,
) -> Result<VersionPlan> {
    let r = Rows::check(x, weight, y, residual, eps)?;
    if r.vector && version == RmsNormVersion::V6 {
        if let Some(entry) = WARP_V6.iter().find(|e| e.vpt as usize * 32 >= r.npacks) {
            // No more warps than rows: one row gets one warp, not an idle block.
            let warps = (preferred_threads / 32).clamp(1, entry.kernel.max_threads() / 32).min(r.rows);
            let mut plan = r.plan(entry.kernel, warps * 32);
            plan.grid = row_grid(r.rows.div_ceil(warps));
            return Ok(VersionPlan { plan, resident_grid: false, rows_per_block: warps });
        }
    }
    let table = match version {
        RmsNormVersion::V1 | RmsNormVersion::V6 => VEC,
        RmsNormVersion::V2 => VEC_V2,
        RmsNormVersion::V3 => VEC_V3,
        RmsNormVersion::V4 => VEC_V4,
        RmsNormVersion::V5 => VEC_V5,
    };
    let plan = r.on_chip_or_streamed(table, preferred_threads);
    Ok(VersionPlan { plan, resident_grid: version == RmsNormVersion::V4, rows_per_block: 1 })
}

#[allow(clippy::too_many_arguments)]
/// RMSNorm with the preferred block size and the version as knobs, for tuning
/// runs; fused when `residual` is given as (residual, sum_out).
pub fn rms_norm_tuned(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    residual: Option<(&Tensor<bf16>, &mut Tensor<bf16>)>,
    weight: &Tensor<bf16>,
    eps: f32,
    y: &mut Tensor<bf16>,
    preferred_threads: u32,
    version: RmsNormVersion,
) -> Result<()> {
    let shapes = residual.as_ref().map(|(r, s)| (r.shape(), s.shape()));
    let VersionPlan { mut plan, resident_grid, .. } =
        plan_tuned(x.shape(), weight.shape(), y.shape(), shapes, eps, preferred_threads, version)?;
    if resident_grid {
        let per_sm = gpu.occupancy(plan.kernel, plan.threads, 0)?.max(1);
        plan.grid = plan.grid.min(per_sm * gpu.info().sm_count);
    }
    launch(gpu, &plan, x, residual, weight, eps, y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::rmsnorm::{plan, PREFERRED_THREADS};

    #[test]
    fn v1_at_the_shipped_block_size_is_the_shipped_plan() {
        for cols in (1..300).chain([4095, 4096, 4097, 8192, 16384, 16392, 1 << 16]) {
            let s = [7, cols];
            for fused in [None, Some((&s[..], &s[..]))] {
                let threads = super::super::preferred_threads(fused.is_some());
                let v1 = plan_tuned(&s, &[cols], &s, fused, 1e-5, threads, SHIPPED).unwrap();
                assert_eq!(v1.plan, plan(&s, &[cols], &s, fused, 1e-5).unwrap());
            }
        }
    }

    #[test]
    fn v4_sizes_a_resident_grid() {
        let v = |cols: usize, version| {
            let s = [64, cols];
            let p = plan_tuned(&s, &[cols], &s, None, 1e-5, PREFERRED_THREADS, version).unwrap();
            (p.plan.kernel.name(), p.resident_grid)
        };
        assert_eq!(v(4096, RmsNormVersion::V4), ("rmsnorm_v4_bf16x8_r4", true));
        assert_eq!(v(4095, RmsNormVersion::V4), ("rmsnorm_bf16x1_stream", true));
        assert_eq!(v(4096, RmsNormVersion::V2), ("rmsnorm_v2_bf16x8_r4", false));
    }

    #[test]
    fn v6_gives_each_row_a_warp() {
        let v6 = |rows: usize, cols: usize, threads: u32| {
            let p = plan_tuned(&[rows, cols], &[cols], &[rows, cols], None, 1e-5, threads, RmsNormVersion::V6).unwrap();
            (p.plan.kernel.name(), p.plan.threads, p.rows_per_block)
        };
        assert_eq!(v6(16384, 4096, 128), ("rmsnorm_v6_bf16x8_w16", 128, 4));
        assert_eq!(v6(16384, 4096, 256), ("rmsnorm_v6_bf16x8_w16", 256, 8));
        // The launch bound caps the block; few rows shrink it.
        assert_eq!(v6(16384, 4096, 1024), ("rmsnorm_v6_bf16x8_w16", 256, 8));
        assert_eq!(v6(3, 4096, 256), ("rmsnorm_v6_bf16x8_w16", 96, 3));
        assert_eq!(v6(17, 8, 128), ("rmsnorm_v6_bf16x8_w1", 128, 4));
        assert_eq!(v6(17, 264, 128), ("rmsnorm_v6_bf16x8_w2", 128, 4));
        assert_eq!(v6(17, 4088, 128), ("rmsnorm_v6_bf16x8_w16", 128, 4));
        // Too long for a warp, or not 16-byte packs: V1's kernels.
        assert_eq!(v6(17, 4104, 128), ("rmsnorm_bf16x8_r8", 96, 1));
        assert_eq!(v6(17, 4095, 128), ("rmsnorm_bf16x1_stream", 512, 1));
        assert_eq!(v6(17, 33, 128), ("rmsnorm_bf16x1_r1", 64, 1));
        let p = plan_tuned(&[17, 8], &[8], &[17, 8], None, 1e-5, 128, RmsNormVersion::V6).unwrap();
        assert_eq!(p.plan.grid, 5);
    }
}
