//! Memory ceilings (feature `dev`): [`stream_sum`] reads a bf16 tensor once (the
//! sum is its by-product), so it moves only the bytes a read-dominated kernel
//! must read. The decode kernels' weight and KV-cache streams are measured
//! against it; a device copy of the same bytes also writes as many. No shipped
//! op launches it.

use crate::error::{Error, Result};
use crate::kernels::dev::STREAM_SUM_BF16;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;

/// Blocks per SM: 2048 threads × 4 loads of 16 bytes = 128 KB in flight per SM.
const BLOCKS_PER_SM: u32 = 8;
/// Elements per 16-byte vector.
const LANES: usize = 8;

/// A validated [`stream_sum`]: 16-byte vectors to read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StreamPlan {
    pub vectors: u64,
    pub threads: u32,
}

/// Checks `stream_sum`'s shapes: a non-empty input of whole 16-byte vectors, and
/// one f32 out. Pure: no GPU needed.
pub fn plan(x: &[usize], out: &[usize]) -> Result<StreamPlan> {
    let n = x.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let Some(n) = n else { return Err(Error::TooLarge(format!("stream_sum: shape {x:?} overflows usize"))) };
    if n == 0 {
        return Err(Error::Empty("stream_sum: empty input".into()));
    }
    if !n.is_multiple_of(LANES) {
        return Err(Error::Alignment(format!("stream_sum: {n} elements is not a multiple of {LANES}")));
    }
    if out.iter().product::<usize>() != 1 {
        return Err(Error::Shape(format!("stream_sum: out must hold one f32, not {out:?}")));
    }
    Ok(StreamPlan { vectors: (n / LANES) as u64, threads: STREAM_SUM_BF16.max_threads() })
}

/// `out[0] += Σ x` (f32 sums, one atomic add per block). `x` holds a multiple of 8
/// elements (16-byte vectors); `out` is one f32, which the caller zeroes.
pub fn stream_sum(gpu: &Gpu, x: &Tensor<bf16>, out: &mut Tensor<f32>) -> Result<()> {
    let p = plan(x.shape(), out.shape())?;
    let args = abi::StreamArgs { src: x.device_ptr(), n_vec: p.vectors, out: out.device_ptr() };
    let blocks_needed = p.vectors.div_ceil(p.threads as u64).min(u32::MAX as u64) as u32;
    let grid = (gpu.info().sm_count * BLOCKS_PER_SM).min(blocks_needed).max(1);
    // SAFETY: x owns `vectors` whole 16-byte vectors (its numel, checked by the
    // plan) and out one f32; the kernel grid-strides over exactly those.
    unsafe { gpu.launch(STREAM_SUM_BF16, (grid, 1, 1), p.threads, 0, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_whole_vectors_and_one_output() {
        assert_eq!(plan(&[16], &[1]).unwrap().vectors, 2);
        assert_eq!(plan(&[3, 8], &[]).unwrap().vectors, 3);
        assert!(matches!(plan(&[0, 8], &[1]), Err(Error::Empty(_))));
        assert!(matches!(plan(&[12], &[1]), Err(Error::Alignment(_))));
        assert!(matches!(plan(&[16], &[2]), Err(Error::Shape(_))));
        assert!(matches!(plan(&[usize::MAX, 16], &[1]), Err(Error::TooLarge(_))));
    }
}
