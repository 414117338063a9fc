//! Rows too long to hold on chip: pass 1 streams the row once, keeping a running
//! max m and sum s per thread (s is rescaled by exp(m_old - m_new) whenever the max
//! grows); the block then merges them. Pass 2 streams the row again and writes.
//! `UNROLL` packs are loaded before any is used, to keep loads in flight.

use super::{exp_rel, exp_rel_guarded, finish_fresh, RowPointers, RowScratch, SoftmaxArgs, SoftmaxPack};
use crate::gpu::math::{fmax_nan, rcp_exact};
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, thread_idx_x};
use crate::gpu::warp::block_reduce;

#[inline(always)]
pub unsafe fn kernel<P: SoftmaxPack, const UNROLL: usize>(a: SoftmaxArgs) {
    let t = thread_idx_x() as usize;
    let nthreads = block_dim_x() as usize;
    let npacks = a.cols as usize / P::LANES;
    let pack_bytes = P::LANES * P::ELEM_BYTES;
    let scratch = RowScratch::new();
    let num_warps = (nthreads as u32).div_ceil(32);
    let mut row = block_idx_x();
    while row < a.rows {
        let x = a.x_row::<P>(row);
        let y = a.y_row::<P>(row);
        let (mut m, mut s) = (f32::NEG_INFINITY, 0.0f32);
        let mut base = 0;
        while base < npacks {
            let mut v: [P; UNROLL] = core::mem::MaybeUninit::uninit().assume_init();
            for (u, p) in v.iter_mut().enumerate() {
                let i = base + u * nthreads + t;
                if i < npacks {
                    *p = P::load(x.add(i * pack_bytes));
                }
            }
            for (u, p) in v.iter().enumerate() {
                if base + u * nthreads + t < npacks {
                    // NaN-propagating max: once m is NaN, s stays NaN.
                    let new_m = fmax_nan(m, p.max());
                    if new_m != m {
                        s *= exp_rel_guarded(m, new_m);
                        m = new_m;
                    }
                    if m != f32::NEG_INFINITY {
                        for l in 0..P::LANES {
                            s += exp_rel_guarded(p.get(l), m);
                        }
                    }
                }
            }
            base += UNROLL * nthreads;
        }
        let m_row = block_reduce(m, f32::NEG_INFINITY, fmax_nan, scratch.max, num_warps);
        let corr = if m == m_row {
            1.0
        } else if m == f32::NEG_INFINITY {
            0.0
        } else {
            exp_rel(m, m_row)
        };
        let s_row = block_reduce(s * corr, 0.0, |a, b| a + b, scratch.sum, num_warps);
        let inv = if m_row == f32::NEG_INFINITY { 0.0 } else { rcp_exact(s_row) };
        let mut i = t;
        while i < npacks {
            let p = P::load(x.add(i * pack_bytes));
            let out = if m_row == f32::NEG_INFINITY { P::from_fn(|_| 0.0) } else { finish_fresh(p, m_row, inv) };
            out.store(y.add(i * pack_bytes));
            i += nthreads;
        }
        row += grid_dim_x();
    }
}
