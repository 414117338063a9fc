//! The dev entries' in-launch merges: one-warp blocks streaming the partials
//! through their idle K/V ring ([`merge_tile`], `decode_fused_*`), and a
//! cluster's blocks reading each other's shared memory ([`merge_cluster`],
//! `decode_cluster_hd128`).

use crate::decode::merge::last_split_block;
#[cfg(target_feature = "sm_90a")]
use crate::decode::merge::{merge_columns, store_merged_quad};
use crate::gpu::bf16::pack_bf16x2;
use crate::gpu::math::{ex2, fma, lg2, rcp_exact};
use crate::gpu::mem::{cp_async_16, cp_async_commit, cp_async_wait, ld_global_cg_f32};
use crate::gpu::shared::{dynamic_shared_base, ld_shared_v2, ld_shared_v4};
use crate::gpu::thread::sync_threads;
use crate::gpu::warp::{shuffle_f32, shuffle_u32, warp_reduce_max};
use abi::decode::{KEY_TILE as BN, ROW_TILE as ROWS, WARP_THREADS as THREADS};
use abi::DecodeArgs;

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
    let mut i = rank + ranks * crate::gpu::thread::thread_idx_x() as usize;
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
