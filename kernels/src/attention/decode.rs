//! Decode attention over a paged KV cache (Flash-Decoding): each block takes one
//! KV head of one sequence and a chunk of its tokens, so even batch 1 fills the
//! GPU. The (new query token, query head) pairs that share the KV head — G heads
//! × q_len tokens, q_len > 1 for speculative decoding — form the rows of m16
//! tiles, one tile per block: every K/V tile is read once per 16 rows, not once
//! per query head. Key tiles
//! stream through shared memory by cp.async (two stages), following the page
//! table row by row; S = Q·Kᵀ and O += P·V run on mma.sync as in the prefill
//! kernel. Each block writes its partial (O/ℓ, LSE); `decode_merge` combines the
//! splits exactly by their LSEs.

use super::tile_ops::{finish_row, lse, online_softmax, pv_tile, qk_tile, KvRing};
use super::DecodeArgs;
use crate::gpu::math::{ex2, lg2};
use crate::gpu::mem::{cp_async_commit, cp_async_wait};
use crate::gpu::mma::{ldmatrix_x4, FragA, FragC};
use crate::gpu::shared::dynamic_shared_base;
use crate::gpu::thread::{block_idx_x, block_idx_y, block_idx_z, sync_threads, thread_idx_x};
use crate::gpu::warp::shuffle_u32;
pub use abi::KvAppendArgs;

/// Keys per tile; one warp per block.
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
#[inline(always)]
unsafe fn decode_split<const D: usize, const KSTEPS: usize, const DTILES: usize, const SPEC: bool>(a: DecodeArgs) {
    let lane = thread_idx_x() as usize;
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
    let t_begin = (split * a.chunk as usize).min(len);
    let t_end = len.min(t_begin + a.chunk as usize);
    let n_tiles = (t_end - t_begin).div_ceil(BN);

    let page_size = a.page_size as usize;
    let pages = (a.page_table as *const u32).add(b * a.max_pages as usize);
    let kv_row_bytes = n_kv * D * 2;
    // Byte offset of token t's row for this KV head in either pool.
    let token_off = |t: usize| {
        let page = *pages.add(t / page_size) as usize;
        (page * page_size + t % page_size) * kv_row_bytes + kv_head * D * 2
    };

    let ring = KvRing::<ROWS, BN, D>::at(dynamic_shared_base());
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
    sync_threads();

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
        sync_threads();

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
        sync_threads();
    }

    let splits = a.splits as usize;
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
}

/// Splits whose partials [`decode_merge`] loads before using any: one memory round
/// trip per batch.
const MERGE_BATCH: usize = 16;

/// Merges the splits of one (query token, head): weights exp(lse_s − max) make the
/// combination exact. One block of D threads per (head, sequence · q_len + token).
/// The partials are read in batches of [`MERGE_BATCH`] splits, every load of a batch
/// issued before the first is used. The loop this replaces loaded split s's O only
/// once its LSE was known: one L2 round trip per split in turn (64 at b1 L4096, an
/// estimated ~12 µs; b1 L4096 measured 25.0 → 18.6 µs in a graph). Sums still run in split order over the same
/// terms, so the result is bit for bit the same.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn decode_merge(a: DecodeArgs) {
    let d = thread_idx_x() as usize;
    let head_dim = crate::gpu::thread::block_dim_x() as usize;
    let (h, bq) = (block_idx_x() as usize, block_idx_y() as usize);
    let splits = a.splits as usize;
    let row = bq * a.n_heads as usize + h;
    let lse = (a.lse_partial as *const f32).add(row * splits);
    let o = (a.o_partial as *const f32).add(row * splits * head_dim + d);
    let mut mx = f32::NEG_INFINITY;
    for s in 0..splits {
        mx = mx.max(*lse.add(s));
    }
    let (mut acc, mut wsum) = (0.0f32, 0.0f32);
    if mx != f32::NEG_INFINITY {
        let mut s0 = 0;
        while s0 < splits {
            // Past the last split the loads repeat it (cached) and are not used.
            let mut ls = [0.0f32; MERGE_BATCH];
            let mut ov = [0.0f32; MERGE_BATCH];
            for u in 0..MERGE_BATCH {
                let s = (s0 + u).min(splits - 1);
                ls[u] = *lse.add(s);
                ov[u] = *o.add(s * head_dim);
            }
            for u in 0..MERGE_BATCH {
                if s0 + u < splits && ls[u] != f32::NEG_INFINITY {
                    let w = ex2((ls[u] - mx) * core::f32::consts::LOG2_E);
                    wsum += w;
                    acc += w * ov[u];
                }
            }
            s0 += MERGE_BATCH;
        }
    }
    let out = if wsum > 0.0 { acc / wsum } else { 0.0 };
    *((a.out as *mut u8).add((row * head_dim + d) * 2) as *mut u16) = crate::gpu::bf16::f32_to_bf16(out);
    if d == 0 {
        let total = if wsum > 0.0 { mx + lg2(wsum) * core::f32::consts::LN_2 } else { f32::NEG_INFINITY };
        *(a.lse as *mut f32).add(row) = total;
    }
}
crate::launch_bounds!(decode_merge, 128);

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
    ($($name:ident => <$d:literal, $ks:literal, $dt:literal, $spec:literal>;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(args: DecodeArgs) {
            decode_split::<$d, $ks, $dt, $spec>(args)
        }
        crate::launch_bounds!($name, 32);
    )*};
}

// The host takes the plain entries for q_len = 1 with G ≤ 16, the spec ones
// otherwise (speculative decoding, or groups wider than one m16 tile).
entries! {
    decode_split_hd64 => <64, 4, 8, false>;
    decode_split_hd128 => <128, 8, 16, false>;
    decode_split_spec_hd64 => <64, 4, 8, true>;
    decode_split_spec_hd128 => <128, 8, 16, true>;
}
