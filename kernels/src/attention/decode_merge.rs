//! Merging the split-KV partials of decode attention exactly by their LSEs:
//! `decode_merge` (its own launch, after the split kernel), and the in-kernel
//! merges of the fused entries — the last block of a tile's splits merges them
//! ([`merge_tile`] for one-warp blocks, [`merge_tile_block`] for the `wide` ones).

use super::decode::{BN, ROWS, THREADS};
use super::DecodeArgs;
use crate::gpu::bf16::{f32_to_bf16, pack_bf16x2};
use crate::gpu::math::{ex2, fma, lg2, rcp_exact};
use crate::gpu::mem::{
    block_completes_count, cp_async_16, cp_async_commit, cp_async_wait, ld_global_cg_f32, ld_global_cg_f32x4,
};
use crate::gpu::shared::{dynamic_shared_base, ld_shared_v2, ld_shared_v4};
use crate::gpu::thread::{block_idx_x, block_idx_y, launch_dependents, sync_threads, thread_idx_x, wait_for_prior_grids};
use crate::gpu::warp::{shuffle_f32, shuffle_u32, warp_reduce_max};

/// Takes this block's ticket on the tile's split counter once its partial is
/// written: true in every thread of the block that completes the count, whose
/// thread 0 has zeroed the counter for the next launch (or graph replay).
#[inline(always)]
unsafe fn last_split_block(a: &DecodeArgs, tile: usize) -> bool {
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
unsafe fn store_merged_quad<const D: usize>(a: &DecodeArgs, r: usize, col: usize, mx: f32, acc: [f32; 4], wsum: f32) {
    let inv = if wsum > 0.0 { rcp_exact(wsum) } else { 0.0 };
    let dst = (a.out as *mut u8).add((r * D + col) * 2);
    let (lo, hi) = (pack_bf16x2(acc[0] * inv, acc[1] * inv), pack_bf16x2(acc[2] * inv, acc[3] * inv));
    *(dst as *mut u64) = lo as u64 | (hi as u64) << 32;
    if col == 0 {
        let total = if wsum > 0.0 { mx + lg2(wsum) * core::f32::consts::LN_2 } else { f32::NEG_INFINITY };
        *(a.lse as *mut f32).add(r) = total;
    }
}

/// The merge of a cluster of split blocks (`decode_cluster_*`, sm_90): every
/// block has left its partial (q_rows × D f32 at `part`, then ROWS LSEs) in its
/// own shared memory; after a cluster barrier each block merges every
/// ranks-th 4-column group straight from the others' shared memory. No global
/// partials, fence or counter: two cluster barriers replace the round trips
/// through L2 of [`merge_tile_block`].
#[cfg(target_feature = "sm_90a")]
#[inline(always)]
pub(super) unsafe fn merge_cluster<const D: usize, const WARPS: usize>(
    a: &DecodeArgs,
    part: u32,
    q_rows: usize,
    q_row: &impl Fn(usize) -> usize,
) {
    use crate::gpu::cluster::{
        cluster_rank, cluster_size, cluster_sync, ld_shared_cluster_f32, ld_shared_cluster_f32x4, map_shared_rank,
    };
    cluster_sync();
    let (rank, ranks) = (cluster_rank() as usize, cluster_size() as usize);
    let lse_at = part + (ROWS * D * 4) as u32;
    let mut i = rank + ranks * thread_idx_x() as usize;
    while i < q_rows * D / 4 {
        let (row, col) = (i / (D / 4), 4 * (i % (D / 4)));
        let (mx, acc, wsum) = merge_columns(
            0,
            ranks,
            |s| ld_shared_cluster_f32(map_shared_rank(lse_at + (row * 4) as u32, s as u32)),
            |s| ld_shared_cluster_f32x4(map_shared_rank(part + ((row * D + col) * 4) as u32, s as u32)),
        );
        store_merged_quad::<D>(a, q_row(row), col, mx, acc, wsum);
        i += ranks * WARPS * THREADS;
    }
    // The other blocks' shared memory must outlive this block's reads of it.
    cluster_sync();
}

/// Partial rows (one split of one query row, D f32) per batch of the fused merge:
/// one per lane, whose LSE and weight that lane loads and computes.
const MERGE_ITEMS: usize = THREADS;
/// Most f32 columns of a row one lane merges (head dim 128 / 32 lanes).
const MAX_LANE_COLS: usize = 4;

/// Takes a ticket on the tile's counter after this block's partial is written;
/// the block that completes the count of `splits` merges the tile's `q_rows`
/// rows over every split with [`decode_merge`]'s exact weights exp(lse_s − max)
/// (summed in split order with FMAs, so the last f32 bits may differ from it),
/// writes `out` and `lse`, and zeroes the counter for the next launch (or graph
/// replay).
///
/// The merge streams the partials from L2 with cp.async through the (now idle)
/// K/V ring, two batches of [`MERGE_ITEMS`] partial rows in flight: one warp
/// reads `q_rows × splits × D` f32 (128 KB at b1 L4096), so loads must overlap
/// rather than cost one L2 round trip each. Each lane owns D/32 columns.
#[inline(always)]
pub(super) unsafe fn merge_tile<const D: usize>(
    a: &DecodeArgs,
    tile: usize,
    q_rows: usize,
    q_row: &impl Fn(usize) -> usize,
    lane: usize,
) {
    // Two stages of MERGE_ITEMS f32 rows fit in the ring (a Q tile, two K/V stages).
    const { assert!(2 * MERGE_ITEMS * D * 4 <= (ROWS + 4 * BN) * D * 2) };
    let cols = D / THREADS;
    let splits = a.splits as usize;
    if !last_split_block(a, tile) {
        return;
    }

    let (o_part, lse_part) = (a.o_partial as *const f32, a.lse_partial as *const f32);
    let items = q_rows * splits;
    let batches = items.div_ceil(MERGE_ITEMS);
    let ring = dynamic_shared_base();
    let stage_addr = |n: usize| ring + ((n % 2) * MERGE_ITEMS * D * 4) as u32;
    // Starts batch n's copies; returns the lane's item's LSE and row (items past
    // the end repeat the last one and are never used).
    let issue = #[inline(always)]
    |n: usize| {
        // u32: a 64-bit division is a long software routine.
        let item = (n * MERGE_ITEMS + lane).min(items - 1) as u32;
        let (row, split) = ((item / splits as u32) as usize, (item % splits as u32) as usize);
        let slot = q_row(row) * splits + split;
        // 16-byte chunks: a partial row is D/4 of them, so a pass of the warp
        // moves 32 / (D/4) rows.
        let (chunks, per_pass) = (D / 4, THREADS / (D / 4));
        let (chunk, sub) = (lane % chunks, lane / chunks);
        for k in 0..MERGE_ITEMS / per_pass {
            let v = k * per_pass + sub;
            let src_slot = shuffle_u32(slot as u32, v as u32) as usize;
            if n * MERGE_ITEMS + v < items {
                let src = o_part.add(src_slot * D + chunk * 4) as *const u8;
                cp_async_16(stage_addr(n) + (v * D * 4 + chunk * 16) as u32, src);
            }
        }
        (ld_global_cg_f32(lse_part.add(slot)), row)
    };
    let mut cur = issue(0);
    cp_async_commit();
    let mut next = if batches > 1 { issue(1) } else { (f32::NEG_INFINITY, 0) };
    cp_async_commit();

    // Each row's max LSE, while the copies fly; lane r keeps row r's.
    let mut row_max_mine = f32::NEG_INFINITY;
    {
        let mut mx = [f32::NEG_INFINITY; ROWS];
        let mut s0 = 0;
        while s0 < splits {
            let s = s0 + lane;
            for (r, m) in mx.iter_mut().enumerate() {
                if r < q_rows && s < splits {
                    *m = m.max(ld_global_cg_f32(lse_part.add(q_row(r) * splits + s)));
                }
            }
            s0 += THREADS;
        }
        for (r, &m) in mx.iter().enumerate() {
            if r < q_rows {
                let m = warp_reduce_max(m);
                if lane == r {
                    row_max_mine = m;
                }
            }
        }
    }

    // Rows in order: (row, split) walk the items; a row is written once its
    // last split is in.
    let (mut row, mut split) = (0usize, 0usize);
    let mut acc = [0.0f32; MAX_LANE_COLS];
    let mut wsum = 0.0f32;
    for n in 0..batches {
        cp_async_wait::<1>();
        sync_threads();
        let (lse_mine, row_mine) = cur;
        let row_max = shuffle_f32(row_max_mine, row_mine as u32);
        let w_mine =
            if lse_mine != f32::NEG_INFINITY { ex2((lse_mine - row_max) * core::f32::consts::LOG2_E) } else { 0.0 };
        let stage = stage_addr(n) + (lane * cols * 4) as u32;
        let in_batch = (items - n * MERGE_ITEMS).min(MERGE_ITEMS);
        let mut v = 0;
        while v < in_batch {
            let end = in_batch.min(v + splits - split);
            split += end - v;
            while v < end {
                let w = shuffle_f32(w_mine, v as u32);
                let addr = stage + (v * D * 4) as u32;
                let vals = if cols == 4 {
                    ld_shared_v4(addr)
                } else {
                    let [x, y] = ld_shared_v2(addr);
                    [x, y, 0, 0]
                };
                for (c, x) in acc.iter_mut().enumerate().take(cols) {
                    *x = fma(w, f32::from_bits(vals[c]), *x);
                }
                wsum += w;
                v += 1;
            }
            if split == splits {
                let row_max = shuffle_f32(row_max_mine, row as u32);
                store_merged_row::<D>(a, q_row(row), &acc, wsum, row_max, lane);
                (row, split, acc, wsum) = (row + 1, 0, [0.0; MAX_LANE_COLS], 0.0);
            }
        }
        // The stage is refilled below (batch n + 2) only once every lane read it.
        sync_threads();
        cur = next;
        if n + 2 < batches {
            next = issue(n + 2);
        }
        cp_async_commit();
    }
}

/// One merged row: the lane's D/32 columns as bf16, and (lane 0) the LSE; a row
/// no split saw (wsum = 0) gets 0 and −∞.
#[inline(always)]
unsafe fn store_merged_row<const D: usize>(
    a: &DecodeArgs,
    q_row: usize,
    acc: &[f32; MAX_LANE_COLS],
    wsum: f32,
    row_max: f32,
    lane: usize,
) {
    let cols = D / THREADS;
    let inv = if wsum > 0.0 { rcp_exact(wsum) } else { 0.0 };
    let dst = (a.out as *mut u8).add((q_row * D + lane * cols) * 2);
    let lo = pack_bf16x2(acc[0] * inv, acc[1] * inv);
    if cols == 4 {
        let hi = pack_bf16x2(acc[2] * inv, acc[3] * inv);
        *(dst as *mut u64) = lo as u64 | (hi as u64) << 32;
    } else {
        *(dst as *mut u32) = lo;
    }
    if lane == 0 {
        let total = if wsum > 0.0 { row_max + lg2(wsum) * core::f32::consts::LN_2 } else { f32::NEG_INFINITY };
        *(a.lse as *mut f32).add(q_row) = total;
    }
}

/// Splits whose partials one merging thread loads before using any: one memory
/// round trip per batch.
const MERGE_BATCH: usize = abi::decode_merge::BATCH;
const MERGE_GROUPS: usize = abi::decode_merge::MAX_GROUPS;
use abi::decode_merge::groups as merge_groups;
/// Largest head dim [`decode_merge`] takes (its shared sums).
const MERGE_MAX_D: usize = 128;

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

