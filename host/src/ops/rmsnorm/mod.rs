//! RMSNorm over bf16 rows (f32 math), plain or fused with the residual add, and
//! the decode step's form that also finishes a split-K projection.
//!
//! Rows that fit on chip are held in registers (one row per block, the packs a
//! thread holds chosen per row length); longer rows take the streaming kernel,
//! which reads the row twice. Rows whose length is not a multiple of 8 use
//! 1-element packs. [`plan`] validates and sizes a call without a GPU. With
//! feature `dev`, `dev` adds the versions kept for comparison.

#[cfg(feature = "dev")]
pub mod dev;

use super::{pick_resident, row_grid, rows_cols, same_shape, RowEntry};
use crate::error::{Error, Result};
use crate::kernels as k;
use crate::runtime::{Gpu, Kernel};
use crate::tensor::Tensor;
use abi::RmsNormArgs;
use half::bf16;

const fn e(kernel: Kernel<RmsNormArgs>, vpt: u32) -> RowEntry<RmsNormArgs> {
    RowEntry { kernel, vpt }
}

/// The row in registers over 16-byte packs, fewest packs per thread first.
const VEC: &[RowEntry<RmsNormArgs>] =
    &[e(k::RMSNORM_BF16X8_R1, 1), e(k::RMSNORM_BF16X8_R2, 2), e(k::RMSNORM_BF16X8_R4, 4), e(k::RMSNORM_BF16X8_R8, 8)];
/// The same over single elements, for rows that are not whole 16-byte packs.
const SCALAR: &[RowEntry<RmsNormArgs>] =
    &[e(k::RMSNORM_BF16X1_R1, 1), e(k::RMSNORM_BF16X1_R2, 2), e(k::RMSNORM_BF16X1_R4, 4)];
/// Rows too long for one block's registers: read twice.
const STREAM_VEC: Kernel<RmsNormArgs> = k::RMSNORM_BF16X8_STREAM;
const STREAM_SCALAR: Kernel<RmsNormArgs> = k::RMSNORM_BF16X1_STREAM;
/// Elements per 16-byte pack.
const LANES: usize = 8;
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

/// A validated launch: which kernel, how many blocks of how many threads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormPlan {
    pub kernel: Kernel<RmsNormArgs>,
    pub threads: u32,
    /// Blocks; past one per row (or row group), each block loops over rows.
    pub grid: u32,
    pub rows: u32,
    pub cols: u32,
}

/// A validated call's rows, and how one row splits into packs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rows {
    pub rows: u32,
    pub cols: u32,
    /// Whether rows are whole 16-byte packs (then every row starts 16-byte
    /// aligned: cudaMalloc'd buffers are 256-byte aligned).
    pub vector: bool,
    /// Packs per row: 16-byte packs if `vector`, else elements.
    pub npacks: usize,
}

impl Rows {
    /// Checks every argument: x, y (and residual, sum output) of one shape with at
    /// least one element, rows and columns within what the kernels address, a
    /// weight of one row's length, and a finite eps ≥ 0.
    pub fn check(
        x: &[usize],
        weight: &[usize],
        y: &[usize],
        residual: Option<(&[usize], &[usize])>,
        eps: f32,
    ) -> Result<Rows> {
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
        Ok(Rows { rows, cols, vector, npacks })
    }

    pub fn plan(&self, kernel: Kernel<RmsNormArgs>, threads: u32) -> RmsNormPlan {
        RmsNormPlan { kernel, threads, grid: row_grid(self.rows), rows: self.rows, cols: self.cols }
    }

    /// A kernel of `vec_table` (of the shipped scalar table, for rows that are not
    /// whole packs) with the row on chip, else the streaming kernel.
    pub fn on_chip_or_streamed(&self, vec_table: &[RowEntry<RmsNormArgs>], preferred_threads: u32) -> RmsNormPlan {
        let (table, stream) = if self.vector { (vec_table, STREAM_VEC) } else { (SCALAR, STREAM_SCALAR) };
        match pick_resident(table, self.npacks, preferred_threads) {
            Some((entry, threads)) => self.plan(entry.kernel, threads),
            None => self.plan(stream, stream.max_threads()),
        }
    }
}

/// Validates shapes and eps and picks the kernel; `residual` holds the residual's
/// and the sum output's shapes for the fused form. Pure: no GPU needed.
pub fn plan(
    x: &[usize],
    weight: &[usize],
    y: &[usize],
    residual: Option<(&[usize], &[usize])>,
    eps: f32,
) -> Result<RmsNormPlan> {
    let rows = Rows::check(x, weight, y, residual, eps)?;
    Ok(rows.on_chip_or_streamed(VEC, preferred_threads(residual.is_some())))
}

/// y = x · rsqrt(mean(x²) + eps) · weight, per row of the last dimension.
pub fn rms_norm(gpu: &Gpu, x: &Tensor<bf16>, weight: &Tensor<bf16>, eps: f32, y: &mut Tensor<bf16>) -> Result<()> {
    let p = plan(x.shape(), weight.shape(), y.shape(), None, eps)?;
    launch(gpu, &p, x, None, weight, eps, y)
}

/// s = x + residual (rounded to bf16) is written to `sum_out`, then y = RMSNorm(s):
/// the pre-norm residual step of a transformer layer in one pass. x and residual
/// may be one tensor; `sum_out` and `y` are distinct (the borrows guarantee it).
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
    launch(gpu, &p, x, Some((residual, sum_out)), weight, eps, y)
}

/// Launches `p`, a plan made from these tensors' shapes (fused when `residual`
/// is given as (residual, sum_out)).
pub(crate) fn launch(
    gpu: &Gpu,
    p: &RmsNormPlan,
    x: &Tensor<bf16>,
    residual: Option<(&Tensor<bf16>, &mut Tensor<bf16>)>,
    weight: &Tensor<bf16>,
    eps: f32,
    y: &mut Tensor<bf16>,
) -> Result<()> {
    let elems = p.rows as usize * p.cols as usize;
    let rows_ok = |t: &Tensor<bf16>| t.numel() == elems;
    let residual_ok = residual.as_ref().is_none_or(|(r, s)| rows_ok(r) && rows_ok(s));
    if !(rows_ok(x) && rows_ok(y) && residual_ok && weight.numel() == p.cols as usize) {
        return Err(Error::Shape(format!("rms_norm: a plan for {}x{} launched on other tensors", p.rows, p.cols)));
    }
    let (r, s) = residual.map(|(r, s)| (r.device_ptr(), s.device_ptr())).unwrap_or((0, 0));
    let args = abi::RmsNormArgs {
        x: x.device_ptr(),
        residual: r,
        weight: weight.device_ptr(),
        y: y.device_ptr(),
        sum_out: s,
        rows: p.rows,
        cols: p.cols,
        in_row_stride: p.cols,
        y_row_stride: p.cols,
        eps,
    };
    // SAFETY: x, y (and residual, sum_out) each own rows × cols contiguous bf16
    // and the weight cols (checked just above); every RMSNorm kernel reads and
    // writes exactly those at row strides of cols. The written buffers (y,
    // sum_out) are `&mut` borrows, so distinct from each other and from the inputs.
    unsafe { gpu.launch(p.kernel, (p.grid, 1, 1), p.threads, 0, &args) }
}

/// `add_rms_norm_split_sums`'s launch for these shapes (x: the residual's
/// shape): rows of whole 16-byte packs that one block holds. Pure: no GPU needed.
pub fn split_sums_plan(
    residual: &[usize],
    weight: &[usize],
    y: &[usize],
    sum_out: &[usize],
    eps: f32,
) -> Result<RmsNormPlan> {
    let r = Rows::check(residual, weight, y, Some((residual, sum_out)), eps)?;
    let kernel = k::RMSNORM_SPLIT_SUMS;
    let per_thread = abi::rmsnorm::SPLIT_SUMS_PACKS;
    let max_cols = LANES * per_thread * kernel.max_threads() as usize;
    if !r.vector || r.cols as usize > max_cols {
        return Err(Error::Shape(format!(
            "add_rms_norm_split_sums: {} columns; a multiple of {LANES}, at most {max_cols}",
            r.cols
        )));
    }
    let threads = r.npacks.div_ceil(per_thread).next_multiple_of(32) as u32;
    // The kernel loops over rows past the grid; 65535 blocks cover the decode batches.
    Ok(RmsNormPlan { kernel, threads, grid: r.rows.min(65535), rows: r.rows, cols: r.cols })
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
    let p = split_sums_plan(residual.shape(), weight.shape(), y.shape(), sum_out.shape(), eps)?;
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
    // SAFETY: the plan checked the tensors hold rows × cols (weight: cols) bf16
    // from their own shapes; the caller vouches for the sums; the kernel waits
    // for the GEMM that writes them before reading.
    unsafe { gpu.launch_after(p.kernel, (p.grid, 1, 1), p.threads, 0, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick(rows: usize, cols: usize, fused: bool) -> (&'static str, u32, u32) {
        let s = [rows, cols];
        let p = plan(&s, &[cols], &s, fused.then_some((&s[..], &s[..])), 1e-5).unwrap();
        (p.kernel.name(), p.threads, p.grid)
    }

    #[test]
    fn picks_kernels_by_row_length() {
        assert_eq!(pick(16384, 4096, false), ("rmsnorm_bf16x8_r4", 128, 16384));
        assert_eq!(pick(16384, 4096, true), ("rmsnorm_bf16x8_r2", 256, 16384));
        assert_eq!(pick(3, 4097, false), ("rmsnorm_bf16x1_stream", 512, 3));
        assert_eq!(pick(3, 1 << 16, false), ("rmsnorm_bf16x8_stream", 512, 3));
        assert_eq!(pick(3, 16392, true), ("rmsnorm_bf16x8_stream", 512, 3));
        assert_eq!(pick(1, 1, false), ("rmsnorm_bf16x1_r1", 32, 1));
        assert_eq!(pick(3 << 20, 8, false), ("rmsnorm_bf16x8_r1", 32, 1 << 20));
        assert_eq!(plan(&[1, 1], &[1], &[1, 1], None, 0.0).unwrap().kernel.name(), "rmsnorm_bf16x1_r1");
    }

    #[test]
    fn plans_stay_within_launch_bounds() {
        for cols in (1..70).chain([4095, 4096, 4097, 16383, 16384, 16385, 16392, 1 << 20]) {
            for fused in [false, true] {
                let (_, threads, _) = pick(3, cols, fused);
                let p = plan(&[3, cols], &[cols], &[3, cols], None, 1e-5).unwrap();
                assert!(threads % 32 == 0 && p.threads <= p.kernel.max_threads(), "{cols} {fused}");
            }
        }
    }

    #[test]
    fn rejects_bad_arguments() {
        let x = [4usize, 64];
        assert!(matches!(plan(&x, &[63], &x, None, 1e-5), Err(Error::Shape(_))));
        assert!(matches!(plan(&x, &[64], &[4, 32], None, 1e-5), Err(Error::Shape(_))));
        assert!(matches!(plan(&x, &[64], &x, Some((&[4, 63], &x)), 1e-5), Err(Error::Shape(_))));
        assert!(matches!(plan(&x, &[64], &x, Some((&x, &[5, 64])), 1e-5), Err(Error::Shape(_))));
        assert!(matches!(plan(&x, &[64], &x, None, f32::NAN), Err(Error::InvalidArgument(_))));
        assert!(matches!(plan(&x, &[64], &x, None, f32::INFINITY), Err(Error::InvalidArgument(_))));
        assert!(matches!(plan(&x, &[64], &x, None, -1.0), Err(Error::InvalidArgument(_))));
        assert!(matches!(plan(&[0, 64], &[64], &[0, 64], None, 1e-5), Err(Error::Empty(_))));
        let many = [super::super::MAX_ROWS + 1, 1];
        assert!(matches!(plan(&many, &[1], &many, None, 1e-5), Err(Error::TooLarge(_))));
    }

    #[test]
    fn split_sums_takes_whole_packs_up_to_one_block() {
        let split = |rows: usize, cols: usize| {
            let s = [rows, cols];
            split_sums_plan(&s, &[cols], &s, &s, 1e-5).map(|p| (p.kernel.name(), p.threads, p.grid))
        };
        assert_eq!(split(16, 4096), Ok(("rmsnorm_split_sums", 128, 16)));
        assert_eq!(split(1, 8), Ok(("rmsnorm_split_sums", 32, 1)));
        assert_eq!(split(70000, 16384), Ok(("rmsnorm_split_sums", 512, 65535)));
        assert!(matches!(split(16, 16392), Err(Error::Shape(_))));
        assert!(matches!(split(16, 4100), Err(Error::Shape(_))));
        let s = [16, 4096];
        assert!(matches!(split_sums_plan(&s, &[4096], &s, &[16, 4088], 1e-5), Err(Error::Shape(_))));
        assert!(matches!(split_sums_plan(&s, &[4096], &s, &s, f32::NAN), Err(Error::InvalidArgument(_))));
    }
}
