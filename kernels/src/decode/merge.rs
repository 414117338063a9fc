//! Merging the split-KV partials of decode attention exactly by their LSEs:
//! `decode_merge` (its own launch, after the one-warp split kernel), and the
//! in-kernel merge of the `wide` entries — the block that completes a tile's
//! split count merges the tile ([`merge_tile_block`]).

use crate::gpu::bf16::{f32_to_bf16, pack_bf16x2};
use crate::gpu::math::{ex2, fma, lg2, rcp_exact};
use crate::gpu::mem::{block_completes_count, ld_global_cg_f32, ld_global_cg_f32x4};
use crate::gpu::thread::{
    block_idx_x, block_idx_y, launch_dependents, sync_threads, thread_idx_x, wait_for_prior_grids,
};
use abi::decode::WARP_THREADS as THREADS;
use abi::DecodeArgs;

/// Takes this block's ticket on the tile's split counter once its partial is
/// written: true in every thread of the block that completes the count, whose
/// thread 0 has zeroed the counter for the next launch (or graph replay).
#[inline(always)]
pub(super) unsafe fn last_split_block(a: &DecodeArgs, tile: usize) -> bool {
    let counter = (a.counters as *mut u32).add(tile);
    if !block_completes_count(counter, 1, a.splits) {
        return false;
    }
    if thread_idx_x() == 0 {
        counter.write_volatile(0);
    }
    true
}

/// The fused merge of a WARPS-warp block: after its partial is written it takes
/// a ticket on the tile's counter; the block that completes the count merges
/// every (row, column) of the tile over all splits, one column per thread at a
/// time with every split's loads in flight ([`merge_columns`]), and zeroes the
/// counter for the next launch.
#[inline(always)]
pub(super) unsafe fn merge_tile_block<const D: usize, const WARPS: usize>(
    a: &DecodeArgs,
    tile: usize,
    q_rows: usize,
    q_row: &impl Fn(usize) -> usize,
) {
    let tid = thread_idx_x() as usize;
    let splits = a.splits as usize;
    if !last_split_block(a, tile) {
        return;
    }
    // Four adjacent columns per thread (one 16-byte load per split): at b1 each
    // thread has one item, so the whole merge is one L2 round trip.
    let mut i = tid;
    while i < q_rows * D / 4 {
        let (row, col) = (i / (D / 4), 4 * (i % (D / 4)));
        let r = q_row(row);
        let lse = (a.lse_partial as *const f32).add(r * splits);
        let o = (a.o_partial as *const f32).add(r * splits * D + col);
        // L2, not L1: other blocks wrote these during this launch.
        let (mx, acc, wsum) =
            merge_columns(0, splits, |s| ld_global_cg_f32(lse.add(s)), |s| ld_global_cg_f32x4(o.add(s * D)));
        store_merged_quad::<D>(a, r, col, mx, acc, wsum);
        i += WARPS * THREADS;
    }
}

/// Four merged columns of query row `r` as bf16 and, at column 0, the row's LSE;
/// a row no split saw (wsum = 0) gets 0 and −∞.
#[inline(always)]
pub(super) unsafe fn store_merged_quad<const D: usize>(
    a: &DecodeArgs,
    r: usize,
    col: usize,
    mx: f32,
    acc: [f32; 4],
    wsum: f32,
) {
    let inv = if wsum > 0.0 { rcp_exact(wsum) } else { 0.0 };
    let dst = (a.out as *mut u8).add((r * D + col) * 2);
    let (lo, hi) = (pack_bf16x2(acc[0] * inv, acc[1] * inv), pack_bf16x2(acc[2] * inv, acc[3] * inv));
    *(dst as *mut u64) = lo as u64 | (hi as u64) << 32;
    if col == 0 {
        let total = if wsum > 0.0 { mx + lg2(wsum) * core::f32::consts::LN_2 } else { f32::NEG_INFINITY };
        *(a.lse as *mut f32).add(r) = total;
    }
}

/// Splits whose partials one merging thread loads before using any: one memory
/// round trip per batch.
const MERGE_BATCH: usize = abi::decode::merge::BATCH;
const MERGE_GROUPS: usize = abi::decode::merge::MAX_GROUPS;
use abi::decode::merge::groups as merge_groups;
/// Largest head dim [`decode_merge`] takes (its shared sums).
const MERGE_MAX_D: usize = abi::decode::merge::MAX_HEAD_DIM;

/// (max, Σ w·o, Σ w) of W adjacent output columns over splits `s_begin..s_end`,
/// with w = exp(lse_s − max): each batch of [`MERGE_BATCH`] splits' loads is
/// issued before any is used, and the sums so far are rescaled when the max
/// grows. An empty split (LSE −∞) has weight 0.
#[inline(always)]
pub(super) fn merge_columns<const W: usize>(
    s_begin: usize,
    s_end: usize,
    lse_of: impl Fn(usize) -> f32,
    o_of: impl Fn(usize) -> [f32; W],
) -> (f32, [f32; W], f32) {
    let (mut mx, mut acc, mut wsum) = (f32::NEG_INFINITY, [0.0f32; W], 0.0f32);
    let mut s0 = s_begin;
    while s0 < s_end {
        let mut ls = [f32::NEG_INFINITY; MERGE_BATCH];
        let mut ov = [[0.0f32; W]; MERGE_BATCH];
        for u in 0..MERGE_BATCH {
            if s0 + u < s_end {
                ls[u] = lse_of(s0 + u);
                ov[u] = o_of(s0 + u);
            }
        }
        let new_mx = ls.iter().fold(mx, |m, &l| m.max(l));
        if new_mx != f32::NEG_INFINITY {
            // Sums so far were weighted against the old max: rescale them.
            let rescale = ex2((mx - new_mx) * core::f32::consts::LOG2_E);
            wsum *= rescale;
            for x in acc.iter_mut() {
                *x *= rescale;
            }
            for u in 0..MERGE_BATCH {
                if ls[u] != f32::NEG_INFINITY {
                    let w = ex2((ls[u] - new_mx) * core::f32::consts::LOG2_E);
                    wsum += w;
                    for (x, &o) in acc.iter_mut().zip(ov[u].iter()) {
                        *x = fma(w, o, *x);
                    }
                }
            }
            mx = new_mx;
        }
        s0 += MERGE_BATCH;
    }
    (mx, acc, wsum)
}

/// Merges the splits of one (query token, head): weights exp(lse_s − max) make the
/// combination exact. One block of head_dim × [`merge_groups`] threads per (head,
/// sequence · q_len + token): group g merges its contiguous share of the splits
/// for its column, every load of a [`MERGE_BATCH`] issued before the first is
/// used, then group 0 rescales the groups' sums to the common max and adds them.
/// Up to 64 splits (b1 L4096) cost one L2 round trip instead of four (one block of
/// head_dim threads walked all of them) plus a serial pass for the max.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn decode_merge(a: DecodeArgs) {
    launch_dependents();
    wait_for_prior_grids();
    let tid = thread_idx_x() as usize;
    let splits = a.splits as usize;
    let groups = merge_groups(splits);
    let head_dim = crate::gpu::thread::block_dim_x() as usize / groups;
    let (d, g) = (tid % head_dim, tid / head_dim);
    let (h, bq) = (block_idx_x() as usize, block_idx_y() as usize);
    let row = bq * a.n_heads as usize + h;
    let lse = (a.lse_partial as *const f32).add(row * splits);
    let o = (a.o_partial as *const f32).add(row * splits * head_dim + d);
    let (s_begin, s_end) = (splits * g / groups, splits * (g + 1) / groups);
    let (mx, [acc], wsum) = merge_columns(s_begin, s_end, |s| *lse.add(s), |s| [*o.add(s * head_dim)]);

    let sums = crate::shared_array!(decode_merge_sums: [f32; 512]);
    let maxes = crate::shared_array!(decode_merge_maxes: [f32; 4]);
    let weights = crate::shared_array!(decode_merge_weights: [f32; 4]);
    const { assert!(MERGE_GROUPS * MERGE_MAX_D == 512 && MERGE_GROUPS == 4) };
    sums.store(g * head_dim + d, acc);
    if d == 0 {
        maxes.store(g, mx);
        weights.store(g, wsum);
    }
    sync_threads();
    if g != 0 {
        return;
    }
    let top = (0..groups).fold(f32::NEG_INFINITY, |m, j| m.max(maxes.load(j)));
    let (mut acc, mut wsum) = (0.0f32, 0.0f32);
    if top != f32::NEG_INFINITY {
        for j in 0..groups {
            let m = maxes.load(j);
            if m != f32::NEG_INFINITY {
                let scale = ex2((m - top) * core::f32::consts::LOG2_E);
                acc = fma(scale, sums.load(j * head_dim + d), acc);
                wsum = fma(scale, weights.load(j), wsum);
            }
        }
    }
    let out = if wsum > 0.0 { acc / wsum } else { 0.0 };
    *((a.out as *mut u8).add((row * head_dim + d) * 2) as *mut u16) = f32_to_bf16(out);
    if d == 0 {
        let total = if wsum > 0.0 { top + lg2(wsum) * core::f32::consts::LN_2 } else { f32::NEG_INFINITY };
        *(a.lse as *mut f32).add(row) = total;
    }
}
crate::launch_bounds!(decode_merge: DecodeArgs, 512);
