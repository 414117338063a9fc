//! Memory ceilings: `stream_sum_bf16` reads a bf16 array once and sums it, so it
//! moves only the bytes a read-dominated kernel must read (a device copy also
//! writes as many). The decode kernels (weights, KV cache) are measured against it.

use crate::gpu::bf16::unpack_bf16x2;
use crate::gpu::mem::{ld_global_stream_v4, red_add_f32};
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, thread_idx_x};
use crate::gpu::warp::block_reduce;
pub use abi::StreamArgs;

/// 16-byte loads each thread has in flight per pass (written out below).
const UNROLL: usize = 4;

#[inline(always)]
fn sum8(v: [u32; 4]) -> f32 {
    let pair = |w: u32| {
        let (a, b) = unpack_bf16x2(w);
        a + b
    };
    (pair(v[0]) + pair(v[1])) + (pair(v[2]) + pair(v[3]))
}

/// Grid-stride over the vectors, UNROLL loads issued before any is used; one
/// reduction per block, then one atomic add.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn stream_sum_bf16(a: StreamArgs) {
    let stride = (grid_dim_x() * block_dim_x()) as usize;
    let n = a.n_vec as usize;
    let src = a.src as *const u8;
    let mut i = (block_idx_x() * block_dim_x() + thread_idx_x()) as usize;
    // Four independent sums: four loads in flight, none waiting on another's add.
    let (mut s0, mut s1, mut s2, mut s3) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
    while i + (UNROLL - 1) * stride < n {
        let v0 = ld_global_stream_v4(src.add(i * 16));
        let v1 = ld_global_stream_v4(src.add((i + stride) * 16));
        let v2 = ld_global_stream_v4(src.add((i + 2 * stride) * 16));
        let v3 = ld_global_stream_v4(src.add((i + 3 * stride) * 16));
        s0 += sum8(v0);
        s1 += sum8(v1);
        s2 += sum8(v2);
        s3 += sum8(v3);
        i += UNROLL * stride;
    }
    while i < n {
        s0 += sum8(ld_global_stream_v4(src.add(i * 16)));
        i += stride;
    }
    let scratch = crate::shared_array!(stream_sum_scratch: [f32; 32]);
    let total = block_reduce((s0 + s1) + (s2 + s3), 0.0, |x, y| x + y, scratch, block_dim_x() / 32);
    if thread_idx_x() == 0 {
        red_add_f32(a.out as *mut f32, total);
    }
}
crate::launch_bounds!(stream_sum_bf16: StreamArgs, 256);
