//! RMSNorm over bf16 rows (f32 math), plain or fused with the residual add.

use super::{pick_resident, row_grid, rows_cols, same_shape, RowEntry};
use crate::error::{Error, Result};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;

const fn e(name: &'static str, vpt: u32, max_threads: u32) -> RowEntry {
    RowEntry { name, vpt, max_threads }
}

const VEC: &[RowEntry] = &[
    e("rmsnorm_bf16x8_r1", 1, 1024),
    e("rmsnorm_bf16x8_r2", 2, 1024),
    e("rmsnorm_bf16x8_r4", 4, 512),
    e("rmsnorm_bf16x8_r8", 8, 256),
];
const VEC_V3: &[RowEntry] = &[
    e("rmsnorm_v3_bf16x8_r1", 1, 1024),
    e("rmsnorm_v3_bf16x8_r2", 2, 1024),
    e("rmsnorm_v3_bf16x8_r4", 4, 512),
    e("rmsnorm_v3_bf16x8_r8", 8, 256),
];
/// v4: a grid of resident blocks, each loading its next row before reducing this one.
const VEC_V4: &[RowEntry] = &[
    e("rmsnorm_v4_bf16x8_r1", 1, 1024),
    e("rmsnorm_v4_bf16x8_r2", 2, 1024),
    e("rmsnorm_v4_bf16x8_r4", 4, 512),
    e("rmsnorm_v4_bf16x8_r8", 8, 256),
];
/// v5: v1 with x (and the residual) read through the read-only path, no L1
/// allocation and a 256-byte L2 prefetch hint.
const VEC_V5: &[RowEntry] = &[
    e("rmsnorm_v5_bf16x8_r1", 1, 1024),
    e("rmsnorm_v5_bf16x8_r2", 2, 1024),
    e("rmsnorm_v5_bf16x8_r4", 4, 512),
    e("rmsnorm_v5_bf16x8_r8", 8, 256),
];
/// v2: weights loaded before the row reduction (more registers, less latency).
const VEC_V2: &[RowEntry] = &[
    e("rmsnorm_v2_bf16x8_r1", 1, 1024),
    e("rmsnorm_v2_bf16x8_r2", 2, 1024),
    e("rmsnorm_v2_bf16x8_r4", 4, 512),
    e("rmsnorm_v2_bf16x8_r8", 8, 256),
];
/// v6: one warp per row; `vpt` is packs per lane (a row of up to 32·vpt packs).
const WARP_V6: &[RowEntry] = &[
    e("rmsnorm_v6_bf16x8_w1", 1, 1024),
    e("rmsnorm_v6_bf16x8_w2", 2, 1024),
    e("rmsnorm_v6_bf16x8_w4", 4, 1024),
    e("rmsnorm_v6_bf16x8_w8", 8, 512),
    e("rmsnorm_v6_bf16x8_w16", 16, 256),
];
const SCALAR: &[RowEntry] =
    &[e("rmsnorm_bf16x1_r1", 1, 1024), e("rmsnorm_bf16x1_r2", 2, 1024), e("rmsnorm_bf16x1_r4", 4, 512)];
const STREAM_VEC: &str = "rmsnorm_bf16x8_stream";
const STREAM_SCALAR: &str = "rmsnorm_bf16x1_stream";
const STREAM_THREADS: u32 = 512;
/// Small blocks: many rows in flight per SM (measured best for the plain norm).
pub const PREFERRED_THREADS: u32 = 128;
/// The fused form moves twice the bytes per row; 256 threads measured best there.
pub const PREFERRED_THREADS_FUSED: u32 = 256;

/// The shipped block-size preference for the plain or fused form.
pub fn preferred_threads(fused: bool) -> u32 {
    if fused {
        PREFERRED_THREADS_FUSED
    } else {
        PREFERRED_THREADS
    }
}
/// Kernel versions for 16-byte rows, kept side by side.
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
const LANES: usize = 8;

/// Every RMSNorm kernel, with launch bounds.
pub fn kernel_table() -> Vec<RowEntry> {
    let mut all = [VEC, VEC_V2, VEC_V3, VEC_V4, VEC_V5, WARP_V6, SCALAR].concat();
    all.push(e(STREAM_VEC, 1, STREAM_THREADS));
    all.push(e(STREAM_SCALAR, 1, STREAM_THREADS));
    all.push(e(SPLIT_SUMS, SPLIT_SUMS_VPT as u32, SPLIT_SUMS_THREADS as u32));
    all
}

#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormPlan {
    pub kernel: &'static str,
    pub threads: u32,
    pub rows: u32,
    pub cols: u32,
    /// Launch only as many blocks as fit on the GPU at once (the kernel loops over rows).
    pub resident_grid: bool,
    /// Rows one block handles at a time: 1, or one per warp (V6).
    pub rows_per_block: u32,
}

/// Validates shapes and eps and picks the kernel. Pure: no GPU needed.
pub fn plan(
    x: &[usize],
    weight: &[usize],
    y: &[usize],
    residual: Option<(&[usize], &[usize])>,
    eps: f32,
) -> Result<RmsNormPlan> {
    plan_tuned(x, weight, y, residual, eps, preferred_threads(residual.is_some()), SHIPPED)
}

/// [`plan`] with the preferred block size as a knob, for tuning runs.
pub fn plan_tuned(
    x: &[usize],
    weight: &[usize],
    y: &[usize],
    residual: Option<(&[usize], &[usize])>,
    eps: f32,
    preferred_threads: u32,
    version: RmsNormVersion,
) -> Result<RmsNormPlan> {
    let (rows, cols) = rows_cols("rms_norm", x)?;
    same_shape("rms_norm", "weight", &[cols as usize], weight)?;
    same_shape("rms_norm", "output", x, y)?;
    if let Some((r, s)) = residual {
        same_shape("rms_norm", "residual", x, r)?;
        same_shape("rms_norm", "sum output", x, s)?;
    }
    if !eps.is_finite() || eps < 0.0 {
        return Err(Error::InvalidArgument(format!("rms_norm: eps must be finite and >= 0, got {eps}")));
    }
    let vector = (cols as usize).is_multiple_of(LANES);
    let npacks = if vector { cols as usize / LANES } else { cols as usize };
    if vector && version == RmsNormVersion::V6 {
        if let Some(entry) = WARP_V6.iter().find(|e| e.vpt as usize * 32 >= npacks) {
            // No more warps than rows: one row gets one warp, not an idle block.
            let warps = (preferred_threads / 32).clamp(1, entry.max_threads / 32).min(rows);
            return Ok(RmsNormPlan {
                kernel: entry.name,
                threads: warps * 32,
                rows,
                cols,
                resident_grid: false,
                rows_per_block: warps,
            });
        }
    }
    let (table, stream) = match (vector, version) {
        (true, RmsNormVersion::V1 | RmsNormVersion::V6) => (VEC, STREAM_VEC),
        (true, RmsNormVersion::V2) => (VEC_V2, STREAM_VEC),
        (true, RmsNormVersion::V3) => (VEC_V3, STREAM_VEC),
        (true, RmsNormVersion::V4) => (VEC_V4, STREAM_VEC),
        (true, RmsNormVersion::V5) => (VEC_V5, STREAM_VEC),
        (false, _) => (SCALAR, STREAM_SCALAR),
    };
    Ok(match pick_resident(table, npacks, preferred_threads) {
        Some((entry, threads)) => RmsNormPlan {
            kernel: entry.name,
            threads,
            rows,
            cols,
            resident_grid: version == RmsNormVersion::V4,
            rows_per_block: 1,
        },
        None => {
            RmsNormPlan { kernel: stream, threads: STREAM_THREADS, rows, cols, resident_grid: false, rows_per_block: 1 }
        }
    })
}

/// y = x · rsqrt(mean(x²) + eps) · weight, per row of the last dimension.
pub fn rms_norm(gpu: &Gpu, x: &Tensor<bf16>, weight: &Tensor<bf16>, eps: f32, y: &mut Tensor<bf16>) -> Result<()> {
    let p = plan(x.shape(), weight.shape(), y.shape(), None, eps)?;
    launch(gpu, &p, x.device_ptr(), 0, weight.device_ptr(), y.device_ptr(), 0, eps)
}

/// s = x + residual (rounded to bf16) is written to `sum_out`, then y = RMSNorm(s):
/// the pre-norm residual step of a transformer layer in one pass.
pub fn add_rms_norm(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    residual: &Tensor<bf16>,
    weight: &Tensor<bf16>,
    eps: f32,
    sum_out: &mut Tensor<bf16>,
    y: &mut Tensor<bf16>,
) -> Result<()> {
    let p = plan(x.shape(), weight.shape(), y.shape(), Some((residual.shape(), sum_out.shape())), eps)?;
    launch(
        gpu,
        &p,
        x.device_ptr(),
        residual.device_ptr(),
        weight.device_ptr(),
        y.device_ptr(),
        sum_out.device_ptr(),
        eps,
    )
}

/// [`add_rms_norm`] whose x is a projection's split-K sums in the GEMM workspace
/// (`[rows, cols]` f32 at `sums`, from [`linear_split_sums`](super::gemm::linear_split_sums)),
/// read and zeroed: the projection's finalize and the norm in one launch.
///
/// # Safety
/// `sums` must hold rows × cols f32 that no other launch uses until this one ends.
pub(crate) unsafe fn add_rms_norm_split_sums(
    gpu: &Gpu,
    sums: u64,
    residual: &Tensor<bf16>,
    weight: &Tensor<bf16>,
    eps: f32,
    sum_out: &mut Tensor<bf16>,
    y: &mut Tensor<bf16>,
) -> Result<()> {
    let p = plan(residual.shape(), weight.shape(), y.shape(), Some((residual.shape(), sum_out.shape())), eps)?;
    let npacks = (p.cols as usize).div_ceil(8);
    if !(p.cols as usize).is_multiple_of(8) || npacks > SPLIT_SUMS_VPT * SPLIT_SUMS_THREADS {
        return Err(Error::Shape(format!(
            "add_rms_norm_split_sums: {} columns (a multiple of 8, at most {})",
            p.cols,
            8 * SPLIT_SUMS_VPT * SPLIT_SUMS_THREADS
        )));
    }
    let threads = (npacks.div_ceil(SPLIT_SUMS_VPT).next_multiple_of(32) as u32).min(SPLIT_SUMS_THREADS as u32);
    let args = abi::RmsNormArgs {
        x: sums,
        residual: residual.device_ptr(),
        weight: weight.device_ptr(),
        y: y.device_ptr(),
        sum_out: sum_out.device_ptr(),
        rows: p.rows,
        cols: p.cols,
        in_row_stride: p.cols,
        y_row_stride: p.cols,
        eps,
    };
    // SAFETY: the tensors were checked to hold rows × cols (weight: cols) bf16, the
    // caller vouches for the sums; the kernel waits for the GEMM before reading.
    unsafe { gpu.launch_after(crate::kernels::RMSNORM_SPLIT_SUMS, (p.rows.min(65535), 1, 1), threads, 0, &args) }
}

/// [`add_rms_norm_split_sums`]'s kernel, its block size and packs per thread
/// (`kernels/src/rmsnorm.rs`).
const SPLIT_SUMS: &str = "rmsnorm_split_sums";
const SPLIT_SUMS_THREADS: usize = 512;
const SPLIT_SUMS_VPT: usize = abi::SPLIT_SUMS_PACKS;

#[allow(clippy::too_many_arguments)]
/// RMSNorm with the preferred block size as a knob, for tuning runs; fused when
/// `residual` is given as (residual, sum_out).
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
    let p = plan_tuned(x.shape(), weight.shape(), y.shape(), shapes, eps, preferred_threads, version)?;
    let (r, s) = residual.map(|(r, s)| (r.device_ptr(), s.device_ptr())).unwrap_or((0, 0));
    launch(gpu, &p, x.device_ptr(), r, weight.device_ptr(), y.device_ptr(), s, eps)
}

#[allow(clippy::too_many_arguments)]
fn launch(
    gpu: &Gpu,
    p: &RmsNormPlan,
    x: u64,
    residual: u64,
    weight: u64,
    y: u64,
    sum_out: u64,
    eps: f32,
) -> Result<()> {
    let args = abi::RmsNormArgs {
        x,
        residual,
        weight,
        y,
        sum_out,
        rows: p.rows,
        cols: p.cols,
        in_row_stride: p.cols,
        y_row_stride: p.cols,
        eps,
    };
    // Past row_grid's cap the kernels loop over rows.
    let mut grid = row_grid(p.rows.div_ceil(p.rows_per_block));
    if p.resident_grid {
        let per_sm = gpu.occupancy(crate::kernels::lookup::<abi::RmsNormArgs>(p.kernel)?, p.threads, 0)?.max(1);
        grid = grid.min(per_sm * gpu.info().sm_count);
    }
    // SAFETY: every tensor was checked to hold rows × cols (weight: cols) bf16 elements.
    unsafe { gpu.launch(crate::kernels::lookup(p.kernel)?, (grid, 1, 1), p.threads, 0, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_kernels_by_row_length() {
        let p = plan(&[16384, 4096], &[4096], &[16384, 4096], None, 1e-5).unwrap();
        assert_eq!((p.kernel, p.threads), ("rmsnorm_bf16x8_r4", 128));
        assert_eq!(plan(&[3, 4097], &[4097], &[3, 4097], None, 1e-5).unwrap().kernel, STREAM_SCALAR);
        assert_eq!(plan(&[3, 1 << 16], &[1 << 16], &[3, 1 << 16], None, 1e-5).unwrap().kernel, STREAM_VEC);
        assert_eq!(plan(&[1, 1], &[1], &[1, 1], None, 0.0).unwrap().kernel, "rmsnorm_bf16x1_r1");
    }

    #[test]
    fn v6_gives_each_row_a_warp() {
        let v6 = |rows: usize, cols: usize, threads: u32| {
            let p = plan_tuned(&[rows, cols], &[cols], &[rows, cols], None, 1e-5, threads, RmsNormVersion::V6).unwrap();
            (p.kernel, p.threads, p.rows_per_block)
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
        assert_eq!(v6(17, 4095, 128), (STREAM_SCALAR, STREAM_THREADS, 1));
        assert_eq!(v6(17, 33, 128), ("rmsnorm_bf16x1_r1", 64, 1));
    }

    #[test]
    fn rejects_bad_arguments() {
        let x = [4usize, 64];
        assert!(matches!(plan(&x, &[63], &x, None, 1e-5), Err(Error::Shape(_))));
        assert!(matches!(plan(&x, &[64], &[4, 32], None, 1e-5), Err(Error::Shape(_))));
        assert!(matches!(plan(&x, &[64], &x, Some((&[4, 63], &x)), 1e-5), Err(Error::Shape(_))));
        assert!(matches!(plan(&x, &[64], &x, Some((&x, &[5, 64])), 1e-5), Err(Error::Shape(_))));
        assert!(matches!(plan(&x, &[64], &x, None, f32::NAN), Err(Error::InvalidArgument(_))));
        assert!(matches!(plan(&x, &[64], &x, None, -1.0), Err(Error::InvalidArgument(_))));
        assert!(matches!(plan(&[0, 64], &[64], &[0, 64], None, 1e-5), Err(Error::Empty(_))));
    }
}
