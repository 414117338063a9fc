//! The row held in registers: each block takes a row (grid-strided), `VPT` packs
//! per thread, one block reduction for the sum of squares.

use super::RmsNormArgs;
use crate::gpu::math::rsqrt;
use crate::gpu::pack::Pack;
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, thread_idx_x};
use crate::gpu::warp::block_reduce;

#[inline(always)]
pub unsafe fn resident<P: Pack, const VPT: usize>(a: RmsNormArgs) {
    let t = thread_idx_x() as usize;
    let nthreads = block_dim_x() as usize;
    let npacks = a.cols as usize / P::LANES;
    let pack_bytes = P::LANES * P::ELEM_BYTES;
    let num_warps = (nthreads as u32).div_ceil(32);
    let (scratch_a, scratch_b) =
        (crate::shared_array!(rmsnorm_scratch_a: [f32; 32]), crate::shared_array!(rmsnorm_scratch_b: [f32; 32]));
    let valid = |j: usize| j * nthreads + t < npacks;
    let offset = |j: usize| (j * nthreads + t) * pack_bytes;
    let fused = a.residual != 0;
    let load_row = |row: u32, v: &mut [P; VPT]| {
        let x = (a.x as *const u8).add(row as usize * a.in_row_stride as usize * P::ELEM_BYTES);
        for (j, p) in v.iter_mut().enumerate() {
            if valid(j) {
                *p = P::load(x.add(offset(j)));
            }
        }
    };
    let mut row = block_idx_x();
    let mut use_b = false;
    let mut v: [P; VPT] = core::mem::MaybeUninit::uninit().assume_init();
    while row < a.rows {
        let in_off = row as usize * a.in_row_stride as usize * P::ELEM_BYTES;
        load_row(row, &mut v);
        let next_row = row + grid_dim_x();
        if fused {
            let r = (a.residual as *const u8).add(in_off);
            let s_out = (a.sum_out as *mut u8).add(in_off);
            for (j, p) in v.iter_mut().enumerate() {
                if valid(j) {
                    let rp = P::load(r.add(offset(j)));
                    // Round the sum to bf16 first: the stored residual and the
                    // normalized value must agree.
                    *p = P::from_fn(|l| p.get(l) + rp.get(l));
                    p.store(s_out.add(offset(j)));
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
                let wp = P::load((a.weight as *const u8).add(offset(j)));
                P::from_fn(|l| p.get(l) * inv_rms * wp.get(l)).store(y.add(offset(j)));
            }
        }
        row = next_row;
    }
}
