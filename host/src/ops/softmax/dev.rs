//! Softmax kernel versions side by side, for the tests and benchmarks that pick
//! what [`softmax`](super::softmax) ships.

use super::{launch, Rows, SoftmaxPlan, SoftmaxType, PREFERRED_THREADS};
use crate::error::{Error, Result};
use crate::kernels::dev as k;
use crate::ops::{pick_resident, RowEntry};
use crate::runtime::{Gpu, Kernel};
use crate::tensor::Tensor;
use abi::SoftmaxArgs;
use half::bf16;

/// Which kernel version to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SoftmaxVersion {
    /// The shipped choice for the shape (with [`softmax_tuned`]'s block size, v2
    /// where v1 would need a whole-SM block).
    Auto,
    /// One row per block, loaded straight into registers.
    V1,
    /// Persistent blocks, next row prefetched by cp.async (16-byte rows only).
    V2,
    /// Two passes with a running max and sum (any length).
    Online,
}

/// The element types' v2 kernels.
pub trait SoftmaxDevType: SoftmaxType {
    /// v2 over 16-byte packs, fewest packs per thread first.
    const V2_VEC: &'static [RowEntry<SoftmaxArgs>];
}

const fn e(kernel: Kernel<SoftmaxArgs>, vpt: u32) -> RowEntry<SoftmaxArgs> {
    RowEntry { kernel, vpt }
}

impl SoftmaxDevType for f32 {
    const V2_VEC: &'static [RowEntry<SoftmaxArgs>] =
        &[e(k::SOFTMAX_V2_F32X4_R1, 1), e(k::SOFTMAX_V2_F32X4_R2, 2), e(k::SOFTMAX_V2_F32X4_R4, 4)];
}

impl SoftmaxDevType for bf16 {
    const V2_VEC: &'static [RowEntry<SoftmaxArgs>] = &[
        e(k::SOFTMAX_V2_BF16X8_R1, 1),
        e(k::SOFTMAX_V2_BF16X8_R2, 2),
        e(k::SOFTMAX_V2_BF16X8_R4, 4),
        e(k::SOFTMAX_V2_BF16X8_R8, 8),
    ];
}

/// Auto takes v2 only when v1 would need a block this large: then one block fills
/// an SM and nothing else loads while it reduces, which v2's prefetch fixes.
/// Measured on the H200 (docs/PERF.md), v1 wins everywhere it has a block of at
/// most 512 threads, and v1 with 1024 threads (f32, 32768 columns) still reached
/// 94% of copy. At [`PREFERRED_THREADS`] it never applies: v2's tables hold no
/// row that v1 needs 1024 threads for, so the shipped Auto is v1 or online.
const V2_FROM_THREADS: u32 = 1024;

/// A version's plan: the launch, and v2's extras.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VersionPlan {
    pub plan: SoftmaxPlan,
    /// Dynamic shared memory (v2's staging buffer).
    pub smem: u32,
    /// Grid sized to what fits on the GPU at once (v2), instead of one block per row.
    pub persistent: bool,
}

/// [`plan_tuned`] at the shipped block size.
pub fn plan_with<T: SoftmaxDevType>(
    x_shape: &[usize],
    y_shape: &[usize],
    version: SoftmaxVersion,
) -> Result<VersionPlan> {
    plan_tuned::<T>(x_shape, y_shape, version, PREFERRED_THREADS)
}

/// Chooses `version`'s kernel with `preferred_threads` as the resident kernels'
/// block size. Pure: no GPU needed.
pub fn plan_tuned<T: SoftmaxDevType>(
    x_shape: &[usize],
    y_shape: &[usize],
    version: SoftmaxVersion,
    preferred_threads: u32,
) -> Result<VersionPlan> {
    let r = Rows::check::<T>(x_shape, y_shape)?;
    let plain = |plan: SoftmaxPlan| VersionPlan { plan, smem: 0, persistent: false };
    let v2 = || {
        let picked = if r.vector { pick_resident(T::V2_VEC, r.npacks, preferred_threads) } else { None };
        picked.map(|(entry, threads)| VersionPlan {
            plan: r.plan(entry.kernel, threads),
            smem: threads * entry.vpt * 16,
            persistent: true,
        })
    };
    Ok(match version {
        SoftmaxVersion::Online => plain(r.online::<T>()),
        SoftmaxVersion::V1 => r.resident::<T>(preferred_threads).map(plain).ok_or_else(|| too_long("v1", r.cols))?,
        SoftmaxVersion::V2 if !r.vector => {
            return Err(Error::Alignment(format!(
                "softmax v2 needs rows of whole 16-byte packs; {} columns of {}",
                r.cols,
                T::NAME
            )))
        }
        SoftmaxVersion::V2 => v2().ok_or_else(|| too_long("v2", r.cols))?,
        SoftmaxVersion::Auto => match (r.resident::<T>(preferred_threads), v2()) {
            (Some(v1), Some(v2)) if v1.threads >= V2_FROM_THREADS => v2,
            (Some(v1), _) => plain(v1),
            (None, Some(v2)) => v2,
            (None, None) => plain(r.online::<T>()),
        },
    })
}

fn too_long(version: &str, cols: u32) -> Error {
    Error::TooLarge(format!("softmax {version}: rows of {cols} do not fit on chip; use Auto or Online"))
}

/// [`softmax`](super::softmax) with an explicit kernel version.
pub fn softmax_with<T: SoftmaxDevType>(
    gpu: &Gpu,
    x: &Tensor<T>,
    y: &mut Tensor<T>,
    version: SoftmaxVersion,
) -> Result<()> {
    softmax_tuned(gpu, x, y, version, PREFERRED_THREADS)
}

/// [`softmax_with`] with the preferred block size as a knob, for tuning runs.
pub fn softmax_tuned<T: SoftmaxDevType>(
    gpu: &Gpu,
    x: &Tensor<T>,
    y: &mut Tensor<T>,
    version: SoftmaxVersion,
    preferred_threads: u32,
) -> Result<()> {
    let VersionPlan { mut plan, smem, persistent } = plan_tuned::<T>(x.shape(), y.shape(), version, preferred_threads)?;
    if persistent {
        let per_sm = gpu.occupancy(plan.kernel, plan.threads, smem)?.max(1);
        plan.grid = plan.rows.min(per_sm * gpu.info().sm_count);
    }
    launch(gpu, &plan, smem, x, y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::softmax::plan;

    fn version<T: SoftmaxDevType>(
        rows: usize,
        cols: usize,
        v: SoftmaxVersion,
        threads: u32,
    ) -> (&'static str, u32, u32) {
        let p = plan_tuned::<T>(&[rows, cols], &[rows, cols], v, threads).unwrap();
        (p.plan.kernel.name(), p.plan.threads, p.smem)
    }

    #[test]
    fn auto_at_the_shipped_block_size_is_the_shipped_plan() {
        let cols = (1..300).chain((1..=20).flat_map(|i| [i * 2048 - 1, i * 2048, i * 2048 + 1, i * 2048 + 8]));
        for cols in cols.chain([1 << 18, (1 << 18) + 1, 1 << 20]) {
            let s = [5, cols];
            assert_eq!(plan_with::<f32>(&s, &s, SoftmaxVersion::Auto).unwrap().plan, plan::<f32>(&s, &s).unwrap());
            assert_eq!(plan_with::<bf16>(&s, &s, SoftmaxVersion::Auto).unwrap().plan, plan::<bf16>(&s, &s).unwrap());
        }
    }

    #[test]
    fn auto_takes_v2_only_for_block_filling_rows() {
        assert_eq!(version::<f32>(32768, 4096, SoftmaxVersion::Auto, 128), ("softmax_v1_f32x4_r8", 128, 0));
        // At a 1024-thread preference v1 r1 fills the SM: v2 r1 instead.
        assert_eq!(version::<f32>(32768, 4096, SoftmaxVersion::Auto, 1024), ("softmax_v2_f32x4_r1", 1024, 16384));
        assert_eq!(version::<bf16>(8, 4096, SoftmaxVersion::V2, 128), ("softmax_v2_bf16x8_r4", 128, 8192));
        assert_eq!(version::<f32>(8, 4096, SoftmaxVersion::Online, 128), ("softmax_online_f32x4", 1024, 0));
    }

    #[test]
    fn rejects_what_a_version_cannot_run() {
        let s = [1, 6];
        assert!(matches!(plan_with::<f32>(&s, &s, SoftmaxVersion::V2), Err(Error::Alignment(_))));
        let s = [1, 1 << 20];
        assert!(matches!(plan_with::<f32>(&s, &s, SoftmaxVersion::V1), Err(Error::TooLarge(_))));
        assert!(matches!(plan_with::<f32>(&s, &s, SoftmaxVersion::V2), Err(Error::TooLarge(_))));
        assert!(matches!(plan_with::<f32>(&[4, 8], &[4, 9], SoftmaxVersion::Online), Err(Error::Shape(_))));
    }
}
