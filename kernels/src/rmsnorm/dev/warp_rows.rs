//! v6: one warp per row.

use crate::gpu::math::rsqrt;
use crate::gpu::pack::Pack;
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, lane_id, warp_id, WARP_SIZE};
use crate::gpu::warp::warp_reduce_sum;
use crate::rmsnorm::RmsNormArgs;

/// v6: one warp per row, the block's warps independent: no shared memory and no
/// block barrier, so a warp that finishes its row moves on at once. Each lane
/// issues all its loads for the row before the shuffle reduction.
#[inline(always)]
pub unsafe fn warp_rows<P: Pack, const PPL: usize>(a: RmsNormArgs) {
    let lane = lane_id() as usize;
    let warps = block_dim_x() / WARP_SIZE;
    let npacks = a.cols as usize / P::LANES;
    let pack_bytes = P::LANES * P::ELEM_BYTES;
    let valid = |j: usize| j * WARP_SIZE as usize + lane < npacks;
    let offset = |j: usize| (j * WARP_SIZE as usize + lane) * pack_bytes;
    let fused = a.residual != 0;
    // Warp-uniform, so the full-mask shuffles below always see the whole warp.
    // usize: the grid-stride step must not wrap near u32::MAX rows.
    let mut row = (block_idx_x() * warps + warp_id()) as usize;
    while row < a.rows as usize {
        let in_off = row * a.in_row_stride as usize * P::ELEM_BYTES;
        let x = (a.x as *const u8).add(in_off);
        let mut v: [P; PPL] = core::mem::MaybeUninit::uninit().assume_init();
        for (j, p) in v.iter_mut().enumerate() {
            if valid(j) {
                *p = P::load_stream(x.add(offset(j)));
            }
        }
        if fused {
            let r = (a.residual as *const u8).add(in_off);
            let s_out = (a.sum_out as *mut u8).add(in_off);
            for (j, p) in v.iter_mut().enumerate() {
                if valid(j) {
                    let rp = P::load_stream(r.add(offset(j)));
                    // Round the sum to bf16 first, as `resident` does.
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
        // Butterfly: every lane gets the same bits.
        let inv_rms = rsqrt(warp_reduce_sum(ss) / a.cols as f32 + a.eps);
        let y = (a.y as *mut u8).add(row * a.y_row_stride as usize * P::ELEM_BYTES);
        for (j, p) in v.iter().enumerate() {
            if valid(j) {
                // Unpack again (as v3) rather than keep the f32 copies from the sum
                // of squares alive (w16: 255 → 121 registers; w4 spilled).
                let p = p.opaque();
                // Weights are read by every row: plain loads, kept in L1.
                let wp = P::load((a.weight as *const u8).add(offset(j)));
                P::from_fn(|l| p.get(l) * inv_rms * wp.get(l)).store(y.add(offset(j)));
            }
        }
        row += (grid_dim_x() * warps) as usize;
    }
}
