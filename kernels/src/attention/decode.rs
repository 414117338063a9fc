//! Decode attention over a paged KV cache (Flash-Decoding): each block takes one
//! KV head of one sequence and a chunk of its tokens, so even batch 1 fills the
//! GPU. The (new query token, query head) pairs that share the KV head — G heads
//! × q_len tokens, q_len > 1 for speculative decoding — form the rows of m16
//! tiles, one tile per block: every K/V tile is read once per 16 rows, not once
//! per query head. Key tiles
//! stream through shared memory by cp.async (two stages), following the page
//! table row by row; S = Q·Kᵀ and O += P·V run on mma.sync as in the prefill
//! kernel. Each block writes its partial (O/ℓ, LSE); `decode_merge` combines the
//! splits exactly by their LSEs. The `decode_fused_*` entries merge in the same
//! launch instead: the block that completes a tile's split count merges the tile.

use super::tile_ops::{finish_row, lse, online_softmax, pv_tile, qk_tile, KvRing};
use super::DecodeArgs;
use crate::gpu::bf16::{f32_to_bf16, pack_bf16x2};
use crate::gpu::math::{ex2, fma, lg2, rcp_exact};
use crate::gpu::mem::{
    atom_add_u32, cp_async_16, cp_async_commit, cp_async_wait, fence_gpu, ld_global_cg_f32, ld_global_cg_f32x4,
};
use crate::gpu::mma::{ldmatrix_x4, FragA, FragC};
use crate::gpu::shared::{dynamic_shared_base, ld_shared_v2, ld_shared_v4, st_shared_v2, SharedWord};
use crate::gpu::thread::{
    block_idx_x, block_idx_y, block_idx_z, grid_dim_x, launch_dependents, sync_threads, thread_idx_x,
    wait_for_prior_grids,
};
use crate::gpu::warp::{shuffle_f32, shuffle_u32, sync_warp, warp_reduce_max};
pub use abi::KvAppendArgs;

/// Keys per tile; one warp per split (per block, or per quarter of a `wide` block).
const BN: usize = 32;
const THREADS: usize = 32;
const N_TILES: usize = BN / 8;
const ROWS: usize = 16;
const _: () = assert!(BN == THREADS, "the loader gives each lane one key row");

/// One block's share of the split-KV work. `SPEC = false` is the common decode
/// step (one new query per sequence, G ≤ 16): the group's heads are the tile's
/// rows, one tile per KV head, and only the ragged last key tile is masked: the
/// code generation of the kernel before speculative decoding (hd128: 168
/// registers). `SPEC = true` takes any q_len ≤ 8 and any G: rows are (token,
/// head) pairs tiled by 16 across blocks, each with its own causal limit.
/// `FUSED` also finishes the output in this launch: with one split each block
/// writes its rows' final O and LSE; with more, the last block of the tile's
/// splits merges them ([`merge_tile`]).
#[inline(always)]
unsafe fn decode_split<
    const D: usize,
    const KSTEPS: usize,
    const DTILES: usize,
    const SPEC: bool,
    const FUSED: bool,
    const WARPS: usize,
>(
    a: DecodeArgs,
) {
    // Launched to overlap the kernel before it (RoPE + KV write in the layer):
    // nothing is read before that one has finished.
    launch_dependents();
    wait_for_prior_grids();
    // (One-warp blocks: the plain entries keep their code.)
    let (lane, warp) = if WARPS == 1 {
        (thread_idx_x() as usize, 0)
    } else {
        (thread_idx_x() as usize % THREADS, thread_idx_x() as usize / THREADS)
    };
    let bx = block_idx_x() as usize;
    let split = block_idx_y() as usize;
    let b = block_idx_z() as usize;
    let (n_heads, n_kv) = (a.n_heads as usize, a.n_kv_heads as usize);
    let group = n_heads / n_kv;
    // The (query token, head) pairs of one KV head, token-major, 16 per block:
    // G·q_len rows share every K/V tile.
    let q_len = if SPEC { (a.q_len as usize).max(1) } else { 1 };
    let (kv_head, row0, q_rows) = if SPEC {
        let rows_total = group * q_len;
        let row_tiles = rows_total.div_ceil(ROWS);
        let row0 = bx % row_tiles * ROWS;
        (bx / row_tiles, row0, (rows_total - row0).min(ROWS))
    } else {
        (bx, 0, group)
    };
    let len = *(a.seq_lens as *const u32).add(b) as usize;
    // With WARPS > 1 each warp takes its own 1/WARPS of the block's chunk (the
    // host makes the chunk a whole number of WARPS key tiles).
    let sub = a.chunk as usize / WARPS;
    let t_begin = (split * a.chunk as usize + warp * sub).min(len);
    let t_end = len.min(t_begin + sub);
    let n_tiles = (t_end - t_begin).div_ceil(BN);

    let page_size = a.page_size as usize;
    let pages = (a.page_table as *const u32).add(b * a.max_pages as usize);
    let kv_row_bytes = n_kv * D * 2;
    // Byte offset of token t's row for this KV head in either pool.
    let token_off = |t: usize| {
        let page = *pages.add(t / page_size) as usize;
        (page * page_size + t % page_size) * kv_row_bytes + kv_head * D * 2
    };

    let ring_base = dynamic_shared_base() + warp as u32 * KvRing::<ROWS, BN, D>::BYTES;
    let ring = KvRing::<ROWS, BN, D>::at(ring_base);
    let (q_tile, k_tile, v_tile) = (ring.q(), |s| ring.k(s), |s| ring.v(s));
    // Forced inline: left to LLVM, this loader became a `.func` called per tile
    // with a 296-byte stack frame at head dim 128.
    // Each lane walks the page table for one key row per tile (BN == THREADS) and
    // the row offsets travel by shuffle: one division and one page-table load
    // per lane per tile instead of one per 16-byte chunk.
    let load_kv = #[inline(always)]
    |j: usize, s: usize| {
        let t0 = t_begin + j * BN;
        let rows = t_end - t0;
        // In 16-byte units: one shuffle per chunk (the host keeps pools below 64 GiB).
        let mine = if lane < rows { (token_off(t0 + lane) / 16) as u32 } else { 0 };
        let row_off = |r: usize| shuffle_u32(mine, r as u32) as usize * 16;
        let (kp, vp) = (a.k_pool as *const u8, a.v_pool as *const u8);
        k_tile(s).load_row_pairs_async::<THREADS>(&v_tile(s), kp, vp, row_off, rows, lane);
    };

    // Global row index (token, head) of tile row r; rows past G·q_len are zero.
    // Without SPEC the group's heads are consecutive rows of q[b].
    let q_row = |r: usize| {
        if SPEC {
            let (qi, g) = ((row0 + r) / group, (row0 + r) % group);
            (b * q_len + qi) * n_heads + kv_head * group + g
        } else {
            b * n_heads + kv_head * group + r
        }
    };
    if SPEC {
        let q = a.q as *const u8;
        q_tile.load_rows_async::<THREADS>(|r| q.add(q_row(r) * D * 2), q_rows, q, lane);
    } else {
        q_tile.load_async::<THREADS>((a.q as *const u8).add(q_row(0) * D * 2), D * 2, group, lane);
    }
    if n_tiles > 0 {
        load_kv(0, 0);
    }
    cp_async_commit();
    // Tile 1 goes out with tile 0, not once tile 0 has landed: a block of few
    // tiles (b1 L4096: 2 per block) would otherwise wait two load latencies in turn.
    if n_tiles > 1 {
        load_kv(1, 1);
    }
    cp_async_commit();
    cp_async_wait::<1>();
    sync_group::<WARPS>();

    let mut qf: [FragA; KSTEPS] = [[0; 4]; KSTEPS];
    for (kk, f) in qf.iter_mut().enumerate() {
        *f = ldmatrix_x4(q_tile.chunk_addr(lane % 16, 2 * kk + lane / 16));
    }
    let mut m = [f32::NEG_INFINITY; 2];
    let mut l = [0.0f32; 2];
    let mut o: [FragC; DTILES] = [[0.0; 4]; DTILES];

    for j in 0..n_tiles {
        let stage = j & 1;
        // Tile j + 1 goes into the stage tile j − 1 freed (tile 1 is already out).
        if j > 0 {
            if j + 1 < n_tiles {
                load_kv(j + 1, stage ^ 1);
            }
            cp_async_commit();
        }
        cp_async_wait::<1>();
        sync_group::<WARPS>();

        let kt = k_tile(stage);
        let mut s: [FragC; N_TILES] = qk_tile(&qf, kt, lane);
        let t0 = t_begin + j * BN;
        if SPEC {
            // Query token i sees keys up to len − q_len + i: only tiles reaching past
            // len − q_len (and the ragged last one) need the element test.
            if t0 + BN > t_end || t0 + BN + q_len > len + 1 {
                for (nt, frag) in s.iter_mut().enumerate() {
                    for (e, v) in frag.iter_mut().enumerate() {
                        let t = t0 + nt * 8 + 2 * (lane % 4) + e % 2;
                        let qi = ((row0 + lane / 4 + 8 * (e / 2)) / group).min(q_len - 1);
                        if t >= t_end || t + q_len > len + qi {
                            *v = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        } else if t0 + BN > t_end {
            // One query, the sequence's last position: it sees every key.
            for (nt, frag) in s.iter_mut().enumerate() {
                for (e, v) in frag.iter_mut().enumerate() {
                    if t0 + nt * 8 + 2 * (lane % 4) + e % 2 >= t_end {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
        }
        online_softmax(&mut s, &mut o, &mut m, &mut l, a.scale_log2);
        pv_tile(&s, v_tile(stage), &mut o, lane);
        sync_group::<WARPS>();
    }

    let splits = a.splits as usize;
    if WARPS > 1 {
        // The block's warps combine their rows in shared memory, then write the
        // block's partial (or, with one split, the output) and merge in-kernel.
        finish_wide::<D, DTILES, WARPS>(&a, &o, &m, &l, ring_base, split, q_rows, &q_row, b * grid_dim_x() as usize + bx);
        return;
    }
    if FUSED && splits == 1 {
        // Nothing to merge: the final bf16 O and the LSE, as `decode_merge` would.
        for h in 0..2 {
            let (total, inv) = finish_row(&l, h);
            let row = lane / 4 + 8 * h;
            if row < q_rows {
                let dst = (a.out as *mut u8).add(q_row(row) * D * 2);
                for (dt, frag) in o.iter().enumerate() {
                    let col = dt * 8 + 2 * (lane % 4);
                    *(dst.add(col * 2) as *mut u32) = pack_bf16x2(frag[2 * h] * inv, frag[2 * h + 1] * inv);
                }
                if lane % 4 == 0 {
                    *(a.lse as *mut f32).add(q_row(row)) = lse(m[h], total);
                }
            }
        }
        return;
    }
    for h in 0..2 {
        let (total, inv) = finish_row(&l, h);
        let row = lane / 4 + 8 * h;
        if row < q_rows {
            let slot = q_row(row) * splits + split;
            let dst = (a.o_partial as *mut f32).add(slot * D);
            for (dt, frag) in o.iter().enumerate() {
                let col = dt * 8 + 2 * (lane % 4);
                *dst.add(col) = frag[2 * h] * inv;
                *dst.add(col + 1) = frag[2 * h + 1] * inv;
            }
            if lane % 4 == 0 {
                *(a.lse_partial as *mut f32).add(slot) = lse(m[h], total);
            }
        }
    }
    if FUSED {
        let tile = b * grid_dim_x() as usize + bx;
        merge_tile::<D>(&a, tile, q_rows, &q_row, lane);
    }
}

/// The barrier of one split's loop: the block when it is one warp (the plain
/// entries: code unchanged), else the warp, whose tiles are its own.
#[inline(always)]
fn sync_group<const WARPS: usize>() {
    if WARPS == 1 {
        sync_threads();
    } else {
        sync_warp();
    }
}

/// End of a WARPS-warp block ([`decode_split`] with `WARPS > 1`, always fused).
/// Each warp leaves its rows' O/ℓ (f32) and LSE in its own ring (its loads are
/// done); after the block barrier every thread combines columns of the warps'
/// rows with weights exp(lse_w − max), as [`decode_merge`] does for splits. With
/// one split that is the output; otherwise the block's partial, and the block
/// that completes the tile's count of `splits` merges them all
/// ([`merge_tile_block`]): 16 partials per KV head at b1 L4096 instead of 64.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn finish_wide<const D: usize, const DTILES: usize, const WARPS: usize>(
    a: &DecodeArgs,
    o: &[FragC; DTILES],
    m: &[f32; 2],
    l: &[f32; 2],
    ring_base: u32,
    split: usize,
    q_rows: usize,
    q_row: &impl Fn(usize) -> usize,
    tile: usize,
) {
    let tid = thread_idx_x() as usize;
    let lane = tid % THREADS;
    let ring_bytes = KvRing::<ROWS, BN, D>::BYTES;
    // Rows 16 bytes apart from a bank multiple: the quad-strided 8-byte stores
    // below hit 32 distinct banks per half warp (D × 4 alone: 8-way conflicts).
    let row_stride = D * 4 + 16;
    let lse_at = |base: u32, row: usize| base + (ROWS * (D * 4 + 16) + row * 4) as u32;
    const { assert!(ROWS * (D * 4 + 16) + ROWS * 4 <= (ROWS + 4 * BN) * D * 2, "O/ℓ and LSE fit in a warp's ring") };
    // The last tile's copies and reads are over (the loop ends on a warp barrier).
    cp_async_wait::<0>();
    sync_warp();
    for h in 0..2 {
        let (total, inv) = finish_row(l, h);
        let row = lane / 4 + 8 * h;
        for (dt, frag) in o.iter().enumerate() {
            let col = dt * 8 + 2 * (lane % 4);
            let at = ring_base + (row * row_stride + col * 4) as u32;
            st_shared_v2(at, [(frag[2 * h] * inv).to_bits(), (frag[2 * h + 1] * inv).to_bits()]);
        }
        if lane % 4 == 0 {
            f32::st_shared(lse_at(ring_base, row), lse(m[h], total));
        }
    }
    sync_threads();

    let splits = a.splits as usize;
    let warp_base = |w: usize| dynamic_shared_base() + w as u32 * ring_bytes;
    let mut i = tid;
    while i < q_rows * D {
        let (row, col) = (i / D, i % D);
        let lse_w = |w: usize| f32::ld_shared(lse_at(warp_base(w), row));
        let top = (0..WARPS).fold(f32::NEG_INFINITY, |mx, w| mx.max(lse_w(w)));
        let (mut acc, mut wsum) = (0.0f32, 0.0f32);
        if top != f32::NEG_INFINITY {
            for w in 0..WARPS {
                let lw = lse_w(w);
                if lw != f32::NEG_INFINITY {
                    let e = ex2((lw - top) * core::f32::consts::LOG2_E);
                    acc = fma(e, f32::ld_shared(warp_base(w) + (row * row_stride + col * 4) as u32), acc);
                    wsum += e;
                }
            }
        }
        let (value, row_lse) = if wsum > 0.0 {
            (acc * rcp_exact(wsum), top + lg2(wsum) * core::f32::consts::LN_2)
        } else {
            (0.0, f32::NEG_INFINITY)
        };
        if splits == 1 {
            *((a.out as *mut u8).add((q_row(row) * D + col) * 2) as *mut u16) = f32_to_bf16(value);
            if col == 0 {
                *(a.lse as *mut f32).add(q_row(row)) = row_lse;
            }
        } else {
            let slot = q_row(row) * splits + split;
            *(a.o_partial as *mut f32).add(slot * D + col) = value;
            if col == 0 {
                *(a.lse_partial as *mut f32).add(slot) = row_lse;
            }
        }
        i += WARPS * THREADS;
    }
    if splits > 1 {
        merge_tile_block::<D, WARPS>(a, tile, q_rows, q_row);
    }
}

/// The fused merge of a WARPS-warp block: after its partial is written it takes
/// a ticket on the tile's counter; the block that completes the count merges
/// every (row, column) of the tile over all splits, one column per thread at a
/// time with every split's loads in flight ([`merge_columns`]), and zeroes the
/// counter for the next launch.
#[inline(always)]
unsafe fn merge_tile_block<const D: usize, const WARPS: usize>(
    a: &DecodeArgs,
    tile: usize,
    q_rows: usize,
    q_row: &impl Fn(usize) -> usize,
) {
    let tid = thread_idx_x() as usize;
    let splits = a.splits as usize;
    let counter = (a.counters as *mut u32).add(tile);
    let last = crate::shared_array!(decode_wide_last: [u32; 1]);
    // Barrier, then thread 0's release fence orders the block's partial stores
    // before its ticket; its acquire fence orders the other blocks' partials
    // before the reads below, which the second barrier passes to every thread.
    sync_threads();
    if tid == 0 {
        fence_gpu();
        let ticket = atom_add_u32(counter, 1);
        fence_gpu();
        last.store(0, (ticket as usize + 1 == splits) as u32);
        if ticket as usize + 1 == splits {
            counter.write_volatile(0);
        }
    }
    sync_threads();
    if last.load(0) == 0 {
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
        let inv = if wsum > 0.0 { rcp_exact(wsum) } else { 0.0 };
        let dst = (a.out as *mut u8).add((r * D + col) * 2);
        let (lo, hi) = (pack_bf16x2(acc[0] * inv, acc[1] * inv), pack_bf16x2(acc[2] * inv, acc[3] * inv));
        *(dst as *mut u64) = lo as u64 | (hi as u64) << 32;
        if col == 0 {
            let total = if wsum > 0.0 { mx + lg2(wsum) * core::f32::consts::LN_2 } else { f32::NEG_INFINITY };
            *(a.lse as *mut f32).add(r) = total;
        }
        i += WARPS * THREADS;
    }
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
unsafe fn merge_tile<const D: usize>(
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
    let counter = (a.counters as *mut u32).add(tile);
    // The barrier orders every lane's partial stores before lane 0's release
    // fence, which orders them before the count goes up; its acquire fence
    // orders the other blocks' partials before the reads below, which the
    // second barrier passes on to every lane.
    sync_threads();
    let mut ticket = 0;
    if lane == 0 {
        fence_gpu();
        ticket = atom_add_u32(counter, 1);
        fence_gpu();
    }
    sync_threads();
    if shuffle_u32(ticket, 0) as usize + 1 != splits {
        return;
    }
    if lane == 0 {
        counter.write_volatile(0);
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
fn merge_columns<const W: usize>(
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
crate::launch_bounds!(decode_merge, 512);

/// Writes one new token's K and V per sequence into its page, at position
/// seq_lens[b] − 1 (the host has already grown the sequence). One block per
/// sequence; each thread moves 16 bytes of K and of V.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn kv_append(a: KvAppendArgs) {
    let b = block_idx_x() as usize;
    let row_bytes = (a.n_kv_heads * a.head_dim * 2) as usize;
    let pos = *(a.seq_lens as *const u32).add(b) as usize - 1;
    let page = *(a.page_table as *const u32).add(b * a.max_pages as usize + pos / a.page_size as usize) as usize;
    let dst_off = (page * a.page_size as usize + pos % a.page_size as usize) * row_bytes;
    let mut i = thread_idx_x() as usize * 16;
    while i < row_bytes {
        let k = crate::gpu::mem::ld_global_v4((a.k_new as *const u8).add(b * row_bytes + i));
        let v = crate::gpu::mem::ld_global_v4((a.v_new as *const u8).add(b * row_bytes + i));
        crate::gpu::mem::st_global_v4((a.k_pool as *mut u8).add(dst_off + i), k);
        crate::gpu::mem::st_global_v4((a.v_pool as *mut u8).add(dst_off + i), v);
        i += crate::gpu::thread::block_dim_x() as usize * 16;
    }
}
crate::launch_bounds!(kv_append, 256);

macro_rules! entries {
    ($($name:ident => <$d:literal, $ks:literal, $dt:literal, $spec:literal, $fused:literal, $warps:literal> @ $th:literal;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(args: DecodeArgs) {
            decode_split::<$d, $ks, $dt, $spec, $fused, $warps>(args)
        }
        crate::launch_bounds!($name, $th);
    )*};
}

// The host takes the plain entries for q_len = 1 with G ≤ 16, the spec ones
// otherwise (speculative decoding, or groups wider than one m16 tile). The
// `split` entries leave the merge to `decode_merge`; the `fused` ones do it.
entries! {
    decode_split_hd64 => <64, 4, 8, false, false, 1> @ 32;
    decode_split_hd128 => <128, 8, 16, false, false, 1> @ 32;
    decode_split_spec_hd64 => <64, 4, 8, true, false, 1> @ 32;
    decode_split_spec_hd128 => <128, 8, 16, true, false, 1> @ 32;
    decode_fused_hd64 => <64, 4, 8, false, true, 1> @ 32;
    decode_fused_hd128 => <128, 8, 16, false, true, 1> @ 32;
    decode_fused_spec_hd64 => <64, 4, 8, true, true, 1> @ 32;
    decode_fused_spec_hd128 => <128, 8, 16, true, true, 1> @ 32;
    // Four warps per block, each a quarter of the block's keys, combined in
    // shared memory before the fused merge (`DecodeVersion::Wide`).
    decode_wide_hd64 => <64, 4, 8, false, true, 4> @ 128;
    decode_wide_hd128 => <128, 8, 16, false, true, 4> @ 128;
}
