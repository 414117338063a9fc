//! Rows too long for one block's registers: streamed twice.

use super::RmsNormArgs;
use crate::gpu::math::rsqrt;
use crate::gpu::pack::Pack;
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, thread_idx_x};
use crate::gpu::warp::block_reduce;

/// Rows too long for one block's registers: pass 1 forms s (and writes it when
/// fused) while summing squares; pass 2 re-reads s, which L2 mostly still holds.
#[inline(always)]
pub unsafe fn streaming<P: Pack, const UNROLL: usize>(a: RmsNormArgs) {
    let t = thread_idx_x() as usize;
    let nthreads = block_dim_x() as usize;
    let npacks = a.cols as usize / P::LANES;
    let pack_bytes = P::LANES * P::ELEM_BYTES;
    let num_warps = (nthreads as u32).div_ceil(32);
    let (scratch_a, scratch_b) =
        (crate::shared_array!(rmsnorm_stream_a: [f32; 32]), crate::shared_array!(rmsnorm_stream_b: [f32; 32]));
    let fused = a.residual != 0;
    let mut row = block_idx_x();
    let mut use_b = false;
    while row < a.rows {
        let in_off = row as usize * a.in_row_stride as usize * P::ELEM_BYTES;
        let x = (a.x as *const u8).add(in_off);
        let s_row = if fused { (a.sum_out as *const u8).add(in_off) } else { x };
        let mut ss = 0.0f32;
        let mut base = 0;
        while base < npacks {
            let mut v: [P; UNROLL] = core::mem::MaybeUninit::uninit().assume_init();
            for (u, p) in v.iter_mut().enumerate() {
                let i = base + u * nthreads + t;
                if i < npacks {
                    *p = P::load(x.add(i * pack_bytes));
                    if fused {
                        let rp = P::load((a.residual as *const u8).add(in_off + i * pack_bytes));
                        *p = P::from_fn(|l| p.get(l) + rp.get(l));
                        p.store((a.sum_out as *mut u8).add(in_off + i * pack_bytes));
                    }
                }
            }
            for (u, p) in v.iter().enumerate() {
                if base + u * nthreads + t < npacks {
                    for l in 0..P::LANES {
                        ss += p.get(l) * p.get(l);
                    }
                }
            }
            base += UNROLL * nthreads;
        }
        // The block barrier inside the reduction also orders this block's s stores
        // before the re-reads below.
        ss = block_reduce(ss, 0.0, |a, b| a + b, if use_b { scratch_b } else { scratch_a }, num_warps);
        use_b = !use_b;
        let inv_rms = rsqrt(ss / a.cols as f32 + a.eps);
        let y = (a.y as *mut u8).add(row as usize * a.y_row_stride as usize * P::ELEM_BYTES);
        let mut i = t;
        while i < npacks {
            let p = P::load(s_row.add(i * pack_bytes));
            let w = P::load((a.weight as *const u8).add(i * pack_bytes));
            P::from_fn(|l| p.get(l) * inv_rms * w.get(l)).store(y.add(i * pack_bytes));
            i += nthreads;
        }
        row += grid_dim_x();
    }
}
