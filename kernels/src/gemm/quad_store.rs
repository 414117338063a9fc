//! The wgmma tiles' epilogue in 16-byte stores.
//!
//! In a `wgmma` accumulator fragment the four lanes of a quad share a row and
//! hold its pairs two columns apart, so a pair at a time is a 4-byte store whose
//! warp touches eight rows: eight L1 wavefronts for 128 bytes. A 4×4 transpose
//! of words across the quad gives each lane eight consecutive outputs instead:
//! one 16-byte store, a quarter of the stores and wavefronts. The epilogue's
//! arithmetic is `store_pair`'s, pair for pair, so results are bit-identical.

use super::tma::ThreadPairs;
use super::{add_residual_bf16x2, epilogue, store_pair, swiglu_bf16, GemmArgs};
use crate::gpu::bf16::pack_bf16x2;
use crate::gpu::mem::{ld_global_v4, st_global_v4};
use crate::gpu::thread::thread_idx_x;
use crate::gpu::warp::shuffle_xor_u32;

/// Lane `q` of a quad ends with word `q` of each of the quad's lanes, in lane
/// order: two butterfly exchanges (lanes 2 apart, then 1 apart), each swapping
/// the off-diagonal 2×2 blocks. Every lane of the warp must take part.
#[inline(always)]
pub(crate) fn quad_transpose([w0, w1, w2, w3]: [u32; 4], q: usize) -> [u32; 4] {
    // Named words, not an indexed array: a lane-dependent index would put the
    // array in local memory.
    let high = q & 2 != 0;
    let (x0, x1) = (shuffle_xor_u32(if high { w0 } else { w2 }, 2), shuffle_xor_u32(if high { w1 } else { w3 }, 2));
    let (w0, w2) = if high { (x0, w2) } else { (w0, x0) };
    let (w1, w3) = if high { (x1, w3) } else { (w1, x1) };
    let high = q & 1 != 0;
    let (x0, x2) = (shuffle_xor_u32(if high { w0 } else { w1 }, 1), shuffle_xor_u32(if high { w2 } else { w3 }, 1));
    let (w0, w1) = if high { (x0, w1) } else { (w0, x0) };
    let (w2, w3) = if high { (x2, w3) } else { (w2, x2) };
    [w0, w1, w2, w3]
}

/// Writes a consumer warpgroup's 64-row tile of `ACC` accumulators a thread
/// through the launch's epilogue. Rows and columns outside `[m, n]` are not
/// written. Where the output's rows are not 16-byte aligned (N not a multiple
/// of 8, or of 16 for SwiGLU, whose output is half as wide), a pair at a time.
#[inline(always)]
pub(crate) unsafe fn store_tile<const ACC: usize>(g: GemmArgs, t: &ThreadPairs, acc: &[f32; ACC]) {
    let q = thread_idx_x() as usize % 4;
    let swiglu = g.epilogue == epilogue::SWIGLU;
    let residual = g.epilogue == epilogue::RESIDUAL;
    let width = if swiglu { 16 } else { 8 };
    if t.n % width != 0 || (g.out | g.residual) % 16 != 0 {
        t.each::<ACC>(|row, col, i| store_pair(g, row, col, acc[i], acc[i + 1]));
        return;
    }
    // Output columns: SwiGLU writes one per pair. A group is 32 of them, 8 a
    // lane: 4 pairs' worth of j (8 columns each) or, for SwiGLU, 8.
    let tile_col = t.col0 - 2 * q;
    let (n_out, col_out) = if swiglu { (t.n / 2, tile_col / 2) } else { (t.n, tile_col) };
    let out = g.out as *mut u8;
    for h in 0..2 {
        let row = t.row0 + 8 * h;
        // Lanes outside the tile still shuffle: only their loads and stores are skipped.
        let row_inside = row < t.m;
        let first = row * n_out + col_out + 8 * q;
        let inside = |grp: usize| row_inside && col_out + 32 * grp + 8 * q < n_out;
        let pair = |j: usize| (acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        if swiglu {
            for grp in 0..ACC / 32 {
                let out_of = |jj: usize| {
                    let (gate, up) = pair(8 * grp + jj);
                    swiglu_bf16(gate, up) as u32
                };
                let word = |i: usize| out_of(2 * i) | out_of(2 * i + 1) << 16;
                // Lane q gets its quad's outputs of pairs 2q and 2q + 1 of the group.
                let w = quad_transpose([word(0), word(1), word(2), word(3)], q);
                let lo = |a: u32, b: u32| (a & 0xffff) | b << 16;
                let hi = |a: u32, b: u32| a >> 16 | (b & 0xffff_0000);
                let v = [lo(w[0], w[1]), lo(w[2], w[3]), hi(w[0], w[1]), hi(w[2], w[3])];
                if inside(grp) {
                    st_global_v4(out.add((first + 32 * grp) * 2), v);
                }
            }
            // A tile width that 32 output pairs a quad do not divide (224: 28
            // pairs a lane) writes its last pairs one at a time.
            for j in ACC / 32 * 8..ACC / 4 {
                let col = t.col0 + 8 * j;
                if row_inside && col < t.n {
                    store_pair(g, row, col, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                }
            }
        } else {
            for grp in 0..ACC / 16 {
                let at = (first + 32 * grp) * 2;
                let words = if residual {
                    // The residual's 16 bytes at this lane's outputs, back into
                    // the fragment's order, so each pair adds as `store_pair` does.
                    let r = if inside(grp) { ld_global_v4((g.residual as *const u8).add(at)) } else { [0; 4] };
                    let r = quad_transpose(r, q);
                    let word = |jj: usize| {
                        let (v0, v1) = pair(4 * grp + jj);
                        add_residual_bf16x2(v0, v1, r[jj])
                    };
                    [word(0), word(1), word(2), word(3)]
                } else {
                    let word = |jj: usize| {
                        let (v0, v1) = pair(4 * grp + jj);
                        pack_bf16x2(v0, v1)
                    };
                    [word(0), word(1), word(2), word(3)]
                };
                let v = quad_transpose(words, q);
                if inside(grp) {
                    st_global_v4(out.add(at), v);
                }
            }
        }
    }
}
