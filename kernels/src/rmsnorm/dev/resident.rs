//! The shipped resident kernel's variants (v2–v5), one named [`Variant`] each:
//! the same row-in-registers loop with one change of schedule or load path.

use crate::gpu::math::rsqrt;
use crate::gpu::pack::Pack;
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, thread_idx_x};
use crate::gpu::warp::block_reduce;
use crate::rmsnorm::RmsNormArgs;

/// What a variant changes in the resident loop; every switch off is the shipped v1.
pub trait Variant {
    /// Load the weights before the row reduction (v2).
    const PREFETCH_WEIGHT: bool = false;
    /// Unpack the row again for the output instead of keeping f32 copies (v3).
    const REPACK: bool = false;
    /// Load the next row before reducing this one (v4, on a resident grid).
    const PIPELINE: bool = false;
    /// Read x and the residual with streaming loads (v5).
    const STREAM: bool = false;
}

/// v2: weights loaded before the row reduction.
pub struct PrefetchWeight;
impl Variant for PrefetchWeight {
    const PREFETCH_WEIGHT: bool = true;
}

/// v3: the row re-unpacked for the output.
pub struct Repack;
impl Variant for Repack {
    const REPACK: bool = true;
}

/// v4: the next row's loads in flight during this row's reduction.
pub struct Pipeline;
impl Variant for Pipeline {
    const PIPELINE: bool = true;
}

/// v5: x and the residual through the streaming load path.
pub struct StreamLoads;
impl Variant for StreamLoads {
    const STREAM: bool = true;
}

#[inline(always)]
pub unsafe fn resident<V: Variant, P: Pack, const VPT: usize>(a: RmsNormArgs) {
    let t = thread_idx_x() as usize;
    let nthreads = block_dim_x() as usize;
    let npacks = a.cols as usize / P::LANES;
    let pack_bytes = P::LANES * P::ELEM_BYTES;
    let num_warps = (nthreads as u32).div_ceil(32);
    let (scratch_a, scratch_b) =
        (crate::shared_array!(rmsnorm_dev_scratch_a: [f32; 32]), crate::shared_array!(rmsnorm_dev_scratch_b: [f32; 32]));
    let valid = |j: usize| j * nthreads + t < npacks;
    let offset = |j: usize| (j * nthreads + t) * pack_bytes;
    let fused = a.residual != 0;
    let load_row = |row: u32, v: &mut [P; VPT]| {
        let x = (a.x as *const u8).add(row as usize * a.in_row_stride as usize * P::ELEM_BYTES);
        for (j, p) in v.iter_mut().enumerate() {
            if valid(j) {
                // v5: x and the residual are read once: no L1 allocation, 256-byte
                // L2 prefetch.
                *p = if V::STREAM { P::load_stream(x.add(offset(j))) } else { P::load(x.add(offset(j))) };
            }
        }
    };
    let mut row = block_idx_x();
    let mut use_b = false;
    let mut v: [P; VPT] = core::mem::MaybeUninit::uninit().assume_init();
    if V::PIPELINE && row < a.rows {
        load_row(row, &mut v);
    }
    while row < a.rows {
        let in_off = row as usize * a.in_row_stride as usize * P::ELEM_BYTES;
        if !V::PIPELINE {
            load_row(row, &mut v);
        }
        // v4 (a grid of resident blocks): the next row's loads leave before this
        // row's reduction and stores, so the block always has bytes in flight.
        let next_row = row + grid_dim_x();
        let mut next: [P; VPT] = core::mem::MaybeUninit::uninit().assume_init();
        if V::PIPELINE && next_row < a.rows {
            load_row(next_row, &mut next);
        }
        if fused {
            let r = (a.residual as *const u8).add(in_off);
            let s_out = (a.sum_out as *mut u8).add(in_off);
            for (j, p) in v.iter_mut().enumerate() {
                if valid(j) {
                    let rp = if V::STREAM { P::load_stream(r.add(offset(j))) } else { P::load(r.add(offset(j))) };
                    // Round the sum to bf16 first: the stored residual and the
                    // normalized value must agree.
                    *p = P::from_fn(|l| p.get(l) + rp.get(l));
                    p.store(s_out.add(offset(j)));
                }
            }
        }
        // v2 loads the weights before the reduction, so their latency hides behind
        // the barrier instead of following it (at the cost of registers).
        let mut w: [P; VPT] = core::mem::MaybeUninit::uninit().assume_init();
        if V::PREFETCH_WEIGHT {
            for (j, wp) in w.iter_mut().enumerate() {
                if valid(j) {
                    *wp = P::load((a.weight as *const u8).add(offset(j)));
                }
            }
        }
        let mut ss = 0.0f32;
        for (j, p) in v.iter().enumerate() {
            if valid(j) {
                for l in 0..P::LANES {
                    ss += p.get(l) * p.get(l);
                }
            }
        }
        // Alternate scratch arrays between rows: one barrier per reduction suffices.
        ss = block_reduce(ss, 0.0, |a, b| a + b, if use_b { scratch_b } else { scratch_a }, num_warps);
        use_b = !use_b;
        let inv_rms = rsqrt(ss / a.cols as f32 + a.eps);
        let y = (a.y as *mut u8).add(row as usize * a.y_row_stride as usize * P::ELEM_BYTES);
        for (j, p) in v.iter().enumerate() {
            if valid(j) {
                // v3: unpack again here rather than keep the f32 copies from the sum
                // of squares alive (80 → 50 registers at r4: more rows in flight).
                let p = &if V::REPACK { p.opaque() } else { *p };
                let wp = if V::PREFETCH_WEIGHT { w[j] } else { P::load((a.weight as *const u8).add(offset(j))) };
                P::from_fn(|l| p.get(l) * inv_rms * wp.get(l)).store(y.add(offset(j)));
            }
        }
        if V::PIPELINE {
            v = next;
        }
        row = next_row;
    }
}
