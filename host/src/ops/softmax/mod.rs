//! Row softmax over the last dimension, f32 or bf16 in and out, f32 math.
//!
//! Rows that fit on chip are held in registers (`v1`: one row per block, the
//! packs a thread holds chosen per row length); longer rows take the online
//! kernel, which reads the row twice. Rows whose length is not a multiple of 16
//! bytes use 1-element packs. [`plan`] validates and sizes a call without a GPU;
//! [`softmax`] launches it. With feature `dev`, `dev` adds the versions kept for
//! comparison.

#[cfg(feature = "dev")]
pub mod dev;

use super::{pick_resident, row_grid, rows_cols, same_shape, RowEntry};
use crate::error::{Error, Result};
use crate::kernels as k;
use crate::runtime::{Gpu, Kernel};
use crate::tensor::{DType, DynTensor, Tensor};
use abi::SoftmaxArgs;
use half::bf16;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// Element types softmax runs on, with their kernels (sealed: each table must
/// hold kernels of that element size).
pub trait SoftmaxType: DType + sealed::Sealed {
    /// v1 over 16-byte packs, fewest packs per thread first.
    const V1_VEC: &'static [RowEntry<SoftmaxArgs>];
    /// v1 over single elements, for rows that are not whole 16-byte packs.
    const V1_SCALAR: &'static [RowEntry<SoftmaxArgs>];
    /// The online kernel over 16-byte packs, and over single elements.
    const ONLINE_VEC: Kernel<SoftmaxArgs>;
    const ONLINE_SCALAR: Kernel<SoftmaxArgs>;
    /// Elements per 16-byte pack.
    const LANES: usize;
}

const fn e(kernel: Kernel<SoftmaxArgs>, vpt: u32) -> RowEntry<SoftmaxArgs> {
    RowEntry { kernel, vpt }
}

impl SoftmaxType for f32 {
    const V1_VEC: &'static [RowEntry<SoftmaxArgs>] = &[
        e(k::SOFTMAX_V1_F32X4_R1, 1),
        e(k::SOFTMAX_V1_F32X4_R2, 2),
        e(k::SOFTMAX_V1_F32X4_R4, 4),
        e(k::SOFTMAX_V1_F32X4_R8, 8),
    ];
    const V1_SCALAR: &'static [RowEntry<SoftmaxArgs>] = &[
        e(k::SOFTMAX_V1_F32X1_R1, 1),
        e(k::SOFTMAX_V1_F32X1_R2, 2),
        e(k::SOFTMAX_V1_F32X1_R4, 4),
        e(k::SOFTMAX_V1_F32X1_R8, 8),
    ];
    const ONLINE_VEC: Kernel<SoftmaxArgs> = k::SOFTMAX_ONLINE_F32X4;
    const ONLINE_SCALAR: Kernel<SoftmaxArgs> = k::SOFTMAX_ONLINE_F32X1;
    const LANES: usize = 4;
}

impl SoftmaxType for bf16 {
    const V1_VEC: &'static [RowEntry<SoftmaxArgs>] = &[
        e(k::SOFTMAX_V1_BF16X8_R1, 1),
        e(k::SOFTMAX_V1_BF16X8_R2, 2),
        e(k::SOFTMAX_V1_BF16X8_R4, 4),
        e(k::SOFTMAX_V1_BF16X8_R8, 8),
    ];
    const V1_SCALAR: &'static [RowEntry<SoftmaxArgs>] = &[
        e(k::SOFTMAX_V1_BF16X1_R1, 1),
        e(k::SOFTMAX_V1_BF16X1_R2, 2),
        e(k::SOFTMAX_V1_BF16X1_R4, 4),
        e(k::SOFTMAX_V1_BF16X1_R8, 8),
    ];
    const ONLINE_VEC: Kernel<SoftmaxArgs> = k::SOFTMAX_ONLINE_BF16X8;
    const ONLINE_SCALAR: Kernel<SoftmaxArgs> = k::SOFTMAX_ONLINE_BF16X1;
    const LANES: usize = 8;
}

/// Block size the resident kernels aim for: small enough for several blocks per SM.
pub const PREFERRED_THREADS: u32 = 128;

/// A validated launch: which kernel, how many blocks of how many threads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoftmaxPlan {
    pub kernel: Kernel<SoftmaxArgs>,
    pub threads: u32,
    /// Blocks; past one per row, each block loops over rows.
    pub grid: u32,
    pub rows: u32,
    pub cols: u32,
}

/// A validated call's rows, and how one row splits into packs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rows {
    pub rows: u32,
    pub cols: u32,
    /// Whether rows are whole 16-byte packs (cudaMalloc'd buffers are 256-byte
    /// aligned, so then every row starts 16-byte aligned).
    pub vector: bool,
    /// Packs per row: 16-byte packs if `vector`, else elements.
    pub npacks: usize,
}

impl Rows {
    /// Checks every argument softmax takes: equal shapes, at least one element,
    /// rows and columns within what the kernels address.
    pub fn check<T: SoftmaxType>(x: &[usize], y: &[usize]) -> Result<Rows> {
        same_shape("softmax", "output", x, y)?;
        let (rows, cols) = rows_cols("softmax", x)?;
        let vector = (cols as usize).is_multiple_of(T::LANES);
        let npacks = if vector { cols as usize / T::LANES } else { cols as usize };
        Ok(Rows { rows, cols, vector, npacks })
    }

    pub fn plan(&self, kernel: Kernel<SoftmaxArgs>, threads: u32) -> SoftmaxPlan {
        SoftmaxPlan { kernel, threads, grid: row_grid(self.rows), rows: self.rows, cols: self.cols }
    }

    /// v1 with the row held on chip, if it fits a block of v1's.
    pub fn resident<T: SoftmaxType>(&self, preferred_threads: u32) -> Option<SoftmaxPlan> {
        let table = if self.vector { T::V1_VEC } else { T::V1_SCALAR };
        pick_resident(table, self.npacks, preferred_threads).map(|(entry, threads)| self.plan(entry.kernel, threads))
    }

    /// The online kernel (any row length), at its launch bound.
    pub fn online<T: SoftmaxType>(&self) -> SoftmaxPlan {
        let kernel = if self.vector { T::ONLINE_VEC } else { T::ONLINE_SCALAR };
        self.plan(kernel, kernel.max_threads())
    }
}

/// Validates the shapes and chooses the kernel (Auto: v1 where the row fits on
/// chip, else online). Pure: no GPU needed.
pub fn plan<T: SoftmaxType>(x_shape: &[usize], y_shape: &[usize]) -> Result<SoftmaxPlan> {
    let rows = Rows::check::<T>(x_shape, y_shape)?;
    Ok(rows.resident::<T>(PREFERRED_THREADS).unwrap_or_else(|| rows.online::<T>()))
}

/// y = softmax(x) over the last dimension. `x` and `y` are distinct tensors
/// (the borrows guarantee it) of one shape.
pub fn softmax<T: SoftmaxType>(gpu: &Gpu, x: &Tensor<T>, y: &mut Tensor<T>) -> Result<()> {
    let p = plan::<T>(x.shape(), y.shape())?;
    launch(gpu, &p, 0, x, y)
}

/// Launches `p`, a plan made from `x`'s and `y`'s shapes.
pub(crate) fn launch<T: SoftmaxType>(
    gpu: &Gpu,
    p: &SoftmaxPlan,
    smem: u32,
    x: &Tensor<T>,
    y: &mut Tensor<T>,
) -> Result<()> {
    let elems = p.rows as usize * p.cols as usize;
    if x.numel() != elems || y.numel() != elems {
        return Err(Error::Shape(format!("softmax: a plan for {}x{} launched on other tensors", p.rows, p.cols)));
    }
    let args = SoftmaxArgs {
        x: x.device_ptr(),
        y: y.device_ptr(),
        rows: p.rows,
        cols: p.cols,
        x_row_stride: p.cols,
        y_row_stride: p.cols,
    };
    // SAFETY: x and y each own rows × cols contiguous elements of T (checked just
    // above), and `p.kernel` comes from T's own table, so it reads and writes
    // rows × cols elements of T's size at strides of cols; the two buffers are
    // distinct allocations (`&` and `&mut` of two tensors).
    unsafe { gpu.launch(p.kernel, (p.grid, 1, 1), p.threads, smem, &args) }
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

    fn pick<T: SoftmaxType>(rows: usize, cols: usize) -> (&'static str, u32, u32) {
        let p = plan::<T>(&[rows, cols], &[rows, cols]).unwrap();
        (p.kernel.name(), p.threads, p.grid)
    }

    #[test]
    fn holds_rows_on_chip_then_goes_online() {
        assert_eq!(pick::<f32>(32768, 4096), ("softmax_v1_f32x4_r8", 128, 32768));
        // 32768 f32 columns: v1 r8 with 1024 threads.
        assert_eq!(pick::<f32>(4096, 32768), ("softmax_v1_f32x4_r8", 1024, 4096));
        assert_eq!(pick::<bf16>(4096, 32768), ("softmax_v1_bf16x8_r8", 512, 4096));
        assert_eq!(pick::<f32>(7, 4097), ("softmax_v1_f32x1_r8", 544, 7));
        assert_eq!(pick::<f32>(2, 262145), ("softmax_online_f32x1", 1024, 2));
        assert_eq!(pick::<bf16>(2, 262144), ("softmax_online_bf16x8", 1024, 2));
        assert_eq!(pick::<f32>(2, 32772), ("softmax_online_f32x4", 1024, 2));
        assert_eq!(pick::<bf16>(1, 1), ("softmax_v1_bf16x1_r1", 32, 1));
        // More rows than row_grid's cap: the blocks loop.
        assert_eq!(pick::<bf16>(3 << 20, 8), ("softmax_v1_bf16x8_r1", 32, 1 << 20));
    }

    #[test]
    fn plans_stay_within_launch_bounds() {
        for cols in (1..70).chain([4095, 4096, 4097, 16383, 16384, 16385, 32768, 32769, 1 << 20]) {
            for p in [plan::<f32>(&[3, cols], &[3, cols]).unwrap(), plan::<bf16>(&[3, cols], &[3, cols]).unwrap()] {
                assert!(p.threads >= 32 && p.threads % 32 == 0 && p.threads <= p.kernel.max_threads(), "{p:?}");
            }
        }
    }

    #[test]
    fn rejects_bad_shapes_before_launch() {
        assert!(matches!(plan::<f32>(&[4, 8], &[4, 9]), Err(Error::Shape(_))));
        assert!(matches!(plan::<f32>(&[4, 8], &[32]), Err(Error::Shape(_))));
        assert!(matches!(plan::<f32>(&[0, 8], &[0, 8]), Err(Error::Empty(_))));
        let too_many_rows = [super::super::MAX_ROWS + 1, 1];
        assert!(matches!(plan::<bf16>(&too_many_rows, &too_many_rows), Err(Error::TooLarge(_))));
        let too_long = [1, super::super::MAX_COLS + 1];
        assert!(matches!(plan::<bf16>(&too_long, &too_long), Err(Error::TooLarge(_))));
    }
}
