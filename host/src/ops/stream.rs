//! Memory ceilings: [`stream_sum`] reads a bf16 tensor once (the sum is its
//! by-product), so it moves only the bytes a read-dominated kernel must read. The
//! decode kernels' weight and KV-cache streams are measured against it; a device
//! copy of the same bytes also writes as many.

use crate::error::{Error, Result};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;

pub const KERNELS: &[(&str, u32)] = &[("stream_sum_bf16", THREADS)];
const THREADS: u32 = 256;
/// Blocks per SM: 2048 threads × 4 loads of 16 bytes = 128 KB in flight per SM.
const BLOCKS_PER_SM: u32 = 8;

/// out[0] += Σ x (f32 sums, one atomic add per block). `x` holds a multiple of 8
/// elements (16-byte vectors); `out` is one f32, which the caller zeroes.
pub fn stream_sum(gpu: &Gpu, x: &Tensor<bf16>, out: &mut Tensor<f32>) -> Result<()> {
    let n = x.shape().iter().product::<usize>();
    if n == 0 {
        return Err(Error::Empty("stream_sum: empty input".into()));
    }
    if n % 8 != 0 {
        return Err(Error::Alignment(format!("stream_sum: {n} elements is not a multiple of 8")));
    }
    if out.shape().iter().product::<usize>() != 1 {
        return Err(Error::Shape(format!("stream_sum: out must hold one f32, not {:?}", out.shape())));
    }
    let args = abi::StreamArgs { src: x.device_ptr(), n_vec: (n / 8) as u64, out: out.device_ptr() };
    let grid = (gpu.info().sm_count * BLOCKS_PER_SM).min((n / 8).div_ceil(THREADS as usize) as u32).max(1);
    // SAFETY: x holds n / 8 whole 16-byte vectors; out is one f32.
    unsafe { gpu.launch(crate::kernels::STREAM_SUM_BF16, (grid, 1, 1), THREADS, 0, &args) }
}
