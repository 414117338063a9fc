//! Row softmax over the last dimension, f32 or bf16 in and out, f32 math.
//!
//! Rows that fit on chip are held in registers (v2 streams the next row into
//! shared memory meanwhile); longer rows take the online kernel, which reads the
//! row twice. Rows whose length is not a multiple of 16 bytes use 1-element packs.

use super::{pick_resident, row_grid, rows_cols, same_shape, RowEntry};
use crate::error::{Error, Result};
use crate::runtime::Gpu;
use crate::tensor::{DType, DynTensor, Tensor};
use half::bf16;

/// Which kernel version to run (for benchmarking versions side by side).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SoftmaxVersion {
    /// The shipped choice for the shape.
    Auto,
    /// One row per block, loaded straight into registers.
    V1,
    /// Persistent blocks, next row prefetched by cp.async (16-byte rows only).
    V2,
    /// Two passes with a running max and sum (any length).
    Online,
}

/// Element types softmax runs on, with their kernel tables.
pub trait SoftmaxType: DType {
    const V1_VEC: &'static [RowEntry];
    const V2_VEC: &'static [RowEntry];
    const V1_SCALAR: &'static [RowEntry];
    const ONLINE_VEC: &'static str;
    const ONLINE_SCALAR: &'static str;
    /// Elements per 16-byte pack.
    const LANES: usize;
}

const fn e(name: &'static str, vpt: u32, max_threads: u32) -> RowEntry {
    RowEntry { name, vpt, max_threads }
}

impl SoftmaxType for f32 {
    const V1_VEC: &'static [RowEntry] = &[
        e("softmax_v1_f32x4_r1", 1, 1024),
        e("softmax_v1_f32x4_r2", 2, 1024),
        e("softmax_v1_f32x4_r4", 4, 1024),
        e("softmax_v1_f32x4_r8", 8, 1024),
    ];
    const V2_VEC: &'static [RowEntry] =
        &[e("softmax_v2_f32x4_r1", 1, 1024), e("softmax_v2_f32x4_r2", 2, 1024), e("softmax_v2_f32x4_r4", 4, 1024)];
    const V1_SCALAR: &'static [RowEntry] = &[
        e("softmax_v1_f32x1_r1", 1, 1024),
        e("softmax_v1_f32x1_r2", 2, 1024),
        e("softmax_v1_f32x1_r4", 4, 1024),
        e("softmax_v1_f32x1_r8", 8, 1024),
    ];
    const ONLINE_VEC: &'static str = "softmax_online_f32x4";
    const ONLINE_SCALAR: &'static str = "softmax_online_f32x1";
    const LANES: usize = 4;
}

impl SoftmaxType for bf16 {
    const V1_VEC: &'static [RowEntry] = &[
        e("softmax_v1_bf16x8_r1", 1, 1024),
        e("softmax_v1_bf16x8_r2", 2, 1024),
        e("softmax_v1_bf16x8_r4", 4, 1024),
        e("softmax_v1_bf16x8_r8", 8, 512),
    ];
    const V2_VEC: &'static [RowEntry] = &[
        e("softmax_v2_bf16x8_r1", 1, 1024),
        e("softmax_v2_bf16x8_r2", 2, 1024),
        e("softmax_v2_bf16x8_r4", 4, 1024),
        e("softmax_v2_bf16x8_r8", 8, 512),
    ];
    const V1_SCALAR: &'static [RowEntry] = &[
        e("softmax_v1_bf16x1_r1", 1, 1024),
        e("softmax_v1_bf16x1_r2", 2, 1024),
        e("softmax_v1_bf16x1_r4", 4, 1024),
        e("softmax_v1_bf16x1_r8", 8, 1024),
    ];
    const ONLINE_VEC: &'static str = "softmax_online_bf16x8";
    const ONLINE_SCALAR: &'static str = "softmax_online_bf16x1";
    const LANES: usize = 8;
}

/// Block size the resident kernels aim for: small enough for several blocks per SM.
pub const PREFERRED_THREADS: u32 = 128;
/// Auto takes v2 only when v1 would need a block this large: then one block fills
/// an SM and nothing else loads while it reduces, which v2's prefetch fixes.
/// Measured on the H200 (docs/PERF.md), v1 wins everywhere it has a block of at
/// most 512 threads, and v1 with 1024 threads (f32, 32768 columns) still reached
/// 94% of copy, so in practice Auto is v1.
const V2_FROM_THREADS: u32 = 1024;
const ONLINE_THREADS: u32 = 1024;

/// A validated launch: which kernel, how many threads, how much shared memory.
#[derive(Clone, Debug, PartialEq)]
pub struct SoftmaxPlan {
    pub kernel: &'static str,
    pub threads: u32,
    /// Dynamic shared memory (v2's staging buffer).
    pub smem: u32,
    /// Grid sized to what fits on the GPU at once (v2), instead of one block per row.
    pub persistent: bool,
    pub rows: u32,
    pub cols: u32,
}

/// Chooses the kernel for `shape` (rows over the last dimension). Pure: no GPU needed.
pub fn plan<T: SoftmaxType>(x_shape: &[usize], y_shape: &[usize], version: SoftmaxVersion) -> Result<SoftmaxPlan> {
    plan_tuned::<T>(x_shape, y_shape, version, PREFERRED_THREADS)
}

/// [`plan`] with the preferred block size as a knob, for tuning runs.
pub fn plan_tuned<T: SoftmaxType>(
    x_shape: &[usize],
    y_shape: &[usize],
    version: SoftmaxVersion,
    preferred_threads: u32,
) -> Result<SoftmaxPlan> {
    same_shape("softmax", "output", x_shape, y_shape)?;
    let (rows, cols) = rows_cols("softmax", x_shape)?;
    // cudaMalloc'd buffers are 256-byte aligned, so 16-byte rows need only this.
    let vector = (cols as usize).is_multiple_of(T::LANES);
    let npacks = if vector { cols as usize / T::LANES } else { cols as usize };
    let resident = |table: &[RowEntry]| pick_resident(table, npacks, preferred_threads);
    let online = |kernel| SoftmaxPlan { kernel, threads: ONLINE_THREADS, smem: 0, persistent: false, rows, cols };
    let v1 = |(entry, threads): (RowEntry, u32)| SoftmaxPlan {
        kernel: entry.name,
        threads,
        smem: 0,
        persistent: false,
        rows,
        cols,
    };
    let v2 = |(entry, threads): (RowEntry, u32)| SoftmaxPlan {
        kernel: entry.name,
        threads,
        smem: threads * entry.vpt * 16,
        persistent: true,
        rows,
        cols,
    };
    let online_kernel = if vector { T::ONLINE_VEC } else { T::ONLINE_SCALAR };
    let v1_table = if vector { T::V1_VEC } else { T::V1_SCALAR };
    Ok(match version {
        SoftmaxVersion::Online => online(online_kernel),
        SoftmaxVersion::V1 => resident(v1_table).map(v1).ok_or_else(|| too_long("v1", cols))?,
        SoftmaxVersion::V2 if !vector => {
            return Err(Error::Alignment(format!(
                "softmax v2 needs rows of whole 16-byte packs; {cols} columns of {}",
                T::NAME
            )))
        }
        SoftmaxVersion::V2 => resident(T::V2_VEC).map(v2).ok_or_else(|| too_long("v2", cols))?,
        SoftmaxVersion::Auto => match (resident(v1_table), vector.then(|| resident(T::V2_VEC)).flatten()) {
            (Some(r1), Some(r2)) if r1.1 >= V2_FROM_THREADS => v2(r2),
            (Some(r1), _) => v1(r1),
            (None, Some(r2)) => v2(r2),
            (None, None) => online(online_kernel),
        },
    })
}

/// Every softmax kernel for `T`, with launch bounds.
pub fn kernel_table<T: SoftmaxType>() -> Vec<RowEntry> {
    let mut all: Vec<RowEntry> = [T::V1_VEC, T::V2_VEC, T::V1_SCALAR].concat();
    all.push(e(T::ONLINE_VEC, 1, ONLINE_THREADS));
    all.push(e(T::ONLINE_SCALAR, 1, ONLINE_THREADS));
    all
}

fn too_long(version: &str, cols: u32) -> Error {
    Error::TooLarge(format!("softmax {version}: rows of {cols} do not fit on chip; use Auto or Online"))
}

/// y = softmax(x) over the last dimension.
pub fn softmax<T: SoftmaxType>(gpu: &Gpu, x: &Tensor<T>, y: &mut Tensor<T>) -> Result<()> {
    softmax_with(gpu, x, y, SoftmaxVersion::Auto)
}

/// [`softmax`] with an explicit kernel version.
pub fn softmax_with<T: SoftmaxType>(
    gpu: &Gpu,
    x: &Tensor<T>,
    y: &mut Tensor<T>,
    version: SoftmaxVersion,
) -> Result<()> {
    softmax_tuned(gpu, x, y, version, PREFERRED_THREADS)
}

/// [`softmax_with`] with the preferred block size as a knob, for tuning runs.
pub fn softmax_tuned<T: SoftmaxType>(
    gpu: &Gpu,
    x: &Tensor<T>,
    y: &mut Tensor<T>,
    version: SoftmaxVersion,
    preferred_threads: u32,
) -> Result<()> {
    let p = plan_tuned::<T>(x.shape(), y.shape(), version, preferred_threads)?;
    let grid = if p.persistent {
        let per_sm = gpu.occupancy(crate::kernels::lookup::<abi::SoftmaxArgs>(p.kernel)?, p.threads, p.smem)?.max(1);
        p.rows.min(per_sm * gpu.info().sm_count)
    } else {
        row_grid(p.rows)
    };
    let args = abi::SoftmaxArgs {
        x: x.device_ptr(),
        y: y.device_ptr(),
        rows: p.rows,
        cols: p.cols,
        x_row_stride: p.cols,
        y_row_stride: p.cols,
    };
    // SAFETY: both tensors hold rows × cols contiguous elements of T, as the plan checked.
    unsafe { gpu.launch(crate::kernels::lookup(p.kernel)?, (grid, 1, 1), p.threads, p.smem, &args) }
}

/// [`softmax`] on run-time typed tensors; mismatched dtypes are an error.
pub fn softmax_dyn(gpu: &Gpu, x: &DynTensor, y: &mut DynTensor) -> Result<()> {
    match (x, y) {
        (DynTensor::F32(x), DynTensor::F32(y)) => softmax(gpu, x, y),
        (DynTensor::Bf16(x), DynTensor::Bf16(y)) => softmax(gpu, x, y),
        (x, y) => Err(Error::DType(format!(
            "softmax: input is {} but output is {}; they must match",
            x.dtype_name(),
            y.dtype_name()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_v2_only_for_block_filling_rows() {
        let p = plan::<f32>(&[32768, 4096], &[32768, 4096], SoftmaxVersion::Auto).unwrap();
        assert_eq!((p.kernel, p.threads, p.smem, p.persistent), ("softmax_v1_f32x4_r8", 128, 0, false));
        // 32768 f32 columns exceed v2's largest f32 entry: v1 r8 with 1024 threads.
        let p = plan::<f32>(&[4096, 32768], &[4096, 32768], SoftmaxVersion::Auto).unwrap();
        assert_eq!((p.kernel, p.threads), ("softmax_v1_f32x4_r8", 1024));
        let p = plan::<bf16>(&[4096, 32768], &[4096, 32768], SoftmaxVersion::Auto).unwrap();
        assert_eq!((p.kernel, p.threads), ("softmax_v1_bf16x8_r8", 512));
        let p = plan::<f32>(&[7, 4097], &[7, 4097], SoftmaxVersion::Auto).unwrap();
        assert_eq!(p.kernel, "softmax_v1_f32x1_r8");
        let p = plan::<f32>(&[2, 262145], &[2, 262145], SoftmaxVersion::Auto).unwrap();
        assert_eq!(p.kernel, "softmax_online_f32x1");
        let p = plan::<bf16>(&[2, 262144], &[2, 262144], SoftmaxVersion::Auto).unwrap();
        assert_eq!(p.kernel, "softmax_online_bf16x8");
    }

    #[test]
    fn rejects_bad_shapes_before_launch() {
        assert!(matches!(plan::<f32>(&[4, 8], &[4, 9], SoftmaxVersion::Auto), Err(Error::Shape(_))));
        assert!(matches!(plan::<f32>(&[0, 8], &[0, 8], SoftmaxVersion::Auto), Err(Error::Empty(_))));
        assert!(matches!(plan::<f32>(&[1, 6], &[1, 6], SoftmaxVersion::V2), Err(Error::Alignment(_))));
        assert!(matches!(plan::<f32>(&[1, 1 << 20], &[1, 1 << 20], SoftmaxVersion::V1), Err(Error::TooLarge(_))));
    }
}
