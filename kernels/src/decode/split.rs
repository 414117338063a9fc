//! The split kernel of decode attention (Flash-Decoding over the paged cache):
//! each block takes one KV head of one sequence and a chunk of its tokens, so
//! even batch 1 fills the GPU. The (new query token, query head) pairs that share
//! the KV head — G heads × q_len tokens, q_len > 1 for speculative decoding —
//! form the rows of m16 tiles, one tile per block: every K/V tile is read once
//! per 16 rows, not once per query head. Key tiles stream through shared memory
//! by cp.async (two stages), following the page table row by row; S = Q·Kᵀ and
//! O += P·V run on mma.sync as in the prefill kernel.
//!
//! One-warp blocks (`decode_split_*`) write their partial (O/ℓ, LSE) for
//! `decode_merge`, which combines the splits exactly by their LSEs. The 4-warp
//! blocks (`decode_wide_*`) give each warp a quarter of the block's keys, combine
//! the warps in shared memory, and merge the splits in the same launch: the
//! block that completes a tile's split count merges the tile.

use super::merge::{merge_columns, merge_tile_block};
use crate::attention::tile_ops::{finish_row, lse, online_softmax, pv_tile, qk_tile, KvRing};
use crate::gpu::bf16::pack_bf16x2;
use crate::gpu::math::{lg2, rcp_exact};
use crate::gpu::mem::{cp_async_commit, cp_async_wait, st_global_v4};
use crate::gpu::mma::{ldmatrix_x4, FragA, FragC};
use crate::gpu::shared::{dynamic_shared_base, ld_shared_v4, st_shared_v2, SharedWord};
use crate::gpu::thread::{
    block_idx_x, block_idx_y, block_idx_z, grid_dim_x, launch_dependents, sync_threads, thread_idx_x,
    wait_for_prior_grids,
};
use crate::gpu::warp::{shuffle_u32, sync_warp};
use abi::decode::{KEY_TILE as BN, ROW_TILE as ROWS, STAGES, WARP_THREADS as THREADS, WIDE_WARPS};
use abi::DecodeArgs;

const N_TILES: usize = BN / 8;
const _: () = assert!(BN == THREADS, "the loader gives each lane one key row");
const _: () = assert!(STAGES == 2, "the split loop keeps two K/V stages in flight");

/// One block's share of the split-KV work. `SPEC = false` is the common decode
/// step (one new query per sequence, G ≤ 16): the group's heads are the tile's
/// rows, one tile per KV head, and only the ragged last key tile is masked: the
/// code generation of the kernel before speculative decoding (hd128: 168
/// registers). `SPEC = true` takes any q_len ≤ 8 and any G: rows are (token,
/// head) pairs tiled by 16 across blocks, each with its own causal limit.
/// `WARPS = 1` writes the block's partial for `decode_merge`; with more warps
/// each takes its share of the block's keys, and [`finish_wide`] combines them
/// and merges the splits in this launch.
#[inline(always)]
unsafe fn decode_split<
    const D: usize,
    const KSTEPS: usize,
    const DTILES: usize,
    const SPEC: bool,
    const WARPS: usize,
>(
    a: DecodeArgs,
) {
    // Launched to overlap the kernel before it (RoPE + KV write in the layer):
    // only the step's page table and lengths (uploaded before any kernel of the
    // step started) are read before that one has finished.
    launch_dependents();
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
    let group = a.group as usize;
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
    // With WARPS > 1 each warp takes its own 1/WARPS of the block's chunk (the
    // host makes the chunk a whole number of WARPS key tiles).
    let sub = a.chunk as usize / WARPS;
    let first = split * a.chunk as usize + warp * sub;
    let page_size = a.page_size as usize;
    // Token t's page index and row within it: shift and mask for power-of-two
    // pages, u32 division otherwise (token positions fit u32: lengths are u32).
    // Four divisions were ~80 of the b1 L4096 kernel's ~340 setup instructions.
    let page_pos = |t: usize| {
        let (t, ps) = (t as u32, a.page_size);
        if a.page_shift != abi::NO_PAGE_SHIFT {
            ((t >> a.page_shift) as usize, (t & (ps - 1)) as usize)
        } else {
            ((t / ps) as usize, (t % ps) as usize)
        }
    };
    let max_pages = a.max_pages as usize;
    let pages = (a.page_table as *const u32).add(b * max_pages);
    // The page-table entries of this lane's rows in tiles 0 and 1 load with the
    // sequence's length, not after it (they do not depend on it; rows past it are
    // never loaded), so the first K/V loads need not wait for it. Measured: no
    // change (b1 L4096 wide kernel 11.23 µs by ncu before and after).
    // Not in the hd64 4-warp entry: at the 128 registers ptxas gives it, the two
    // early values cost a 4-byte spill.
    let early_page = |j: usize| {
        let p = page_pos(first + j * BN + lane).0;
        if D == 64 && WARPS > 1 {
            None
        } else if p < max_pages {
            Some(crate::gpu::mem::ld_global_u32_early(pages.add(p)))
        } else {
            Some(0)
        }
    };
    let (early0, early1) = (early_page(0), early_page(1));
    let len = *(a.seq_lens as *const u32).add(b) as usize;
    wait_for_prior_grids();
    let t_begin = first.min(len);
    let t_end = len.min(t_begin + sub);
    let n_tiles = (t_end - t_begin).div_ceil(BN);

    let kv_row_bytes = n_kv * D * 2;
    // Byte offset of row `row` of page `page`, for this KV head in either pool.
    let row_off_in = |page: u32, row: usize| (page as usize * page_size + row) * kv_row_bytes + kv_head * D * 2;

    let ring_base = dynamic_shared_base() + warp as u32 * ring_bytes::<D>();
    let ring = KvRing::<ROWS, BN, D>::at(ring_base);
    let (q_tile, k_tile, v_tile) = (ring.q(), |s| ring.k(s), |s| ring.v(s));
    // Forced inline: left to LLVM, this loader became a `.func` called per tile
    // with a 296-byte stack frame at head dim 128.
    // Each lane walks the page table for one key row per tile (BN == THREADS) and
    // the row offsets travel by shuffle: one division and one page-table load
    // per lane per tile instead of one per 16-byte chunk.
    let load_kv = #[inline(always)]
    |j: usize, s: usize, early: Option<u32>| {
        let t0 = t_begin + j * BN;
        let rows = t_end - t0;
        // In 16-byte units: one shuffle per chunk (the host keeps pools below 64 GiB).
        // (Tiles are loaded only when t_begin = first: tile j's rows start at first + j·BN.)
        let mine = if lane < rows {
            let (page_idx, row) = page_pos(t0 + lane);
            let page = early.unwrap_or_else(|| *pages.add(page_idx));
            (row_off_in(page, row) / 16) as u32
        } else {
            0
        };
        let row_off16 = |r: usize| shuffle_u32(mine, r as u32);
        let (kp, vp) = (a.k_pool as *const u8, a.v_pool as *const u8);
        k_tile(s).load_row_pairs_async::<THREADS>(&v_tile(s), kp, vp, row_off16, rows, lane);
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
        load_kv(0, 0, early0);
    }
    cp_async_commit();
    // Tile 1 goes out with tile 0, not once tile 0 has landed: a block of few
    // tiles (b1 L4096: 2 per block) would otherwise wait two load latencies in turn.
    if n_tiles > 1 {
        load_kv(1, 1, early1);
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
                load_kv(j + 1, stage ^ 1, None);
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
        finish_wide::<D, DTILES, WARPS>(
            &a,
            &o,
            &m,
            &l,
            ring_base,
            split,
            q_rows,
            &q_row,
            b * grid_dim_x() as usize + bx,
        );
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
}

/// One warp's shared memory: its Q tile and two (K, V) stages ([`KvRing`]'s
/// layout), as the host sizes it.
const fn ring_bytes<const D: usize>() -> u32 {
    const { assert!(KvRing::<ROWS, BN, D>::BYTES as usize == abi::decode::ring_bytes(D, STAGES)) };
    KvRing::<ROWS, BN, D>::BYTES
}

/// The barrier of one split's loop: the block when it is one warp (the plain
/// entries: code unchanged), else the warp, whose tiles are its own.
#[inline(always)]
pub(super) fn sync_group<const WARPS: usize>() {
    if WARPS == 1 {
        sync_threads();
    } else {
        sync_warp();
    }
}

/// End of a WARPS-warp block ([`decode_split`] with `WARPS > 1`, always fused).
/// Each warp leaves its rows' O/ℓ (f32) and LSE in its own ring (its loads are
/// done); after the block barrier every thread combines columns of the warps'
/// rows with weights exp(lse_w − max), as `decode_merge` does for splits. With
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
    let ring_bytes = ring_bytes::<D>();
    // Rows 16 bytes apart from a bank multiple: the quad-strided 8-byte stores
    // below hit 32 distinct banks per half warp (D × 4 alone: 8-way conflicts).
    let row_stride = D * 4 + 16;
    let lse_at = |base: u32, row: usize| base + (ROWS * row_stride + row * 4) as u32;
    const {
        assert!(ROWS * (D * 4 + 16) + ROWS * 4 <= (ROWS + 2 * STAGES * BN) * D * 2, "O/ℓ and LSE fit in a warp's ring")
    };
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
    // Four adjacent columns per thread: one 16-byte shared load per warp, and the
    // warps' weights computed once per four columns, not per column.
    let mut i = tid;
    while i < q_rows * D / 4 {
        let (row, col) = (i / (D / 4), 4 * (i % (D / 4)));
        // The warps are merged as splits are: weights exp(lse_w − max).
        let (top, acc, wsum) = merge_columns(
            0,
            WARPS,
            |w| f32::ld_shared(lse_at(warp_base(w), row)),
            |w| ld_shared_v4(warp_base(w) + (row * row_stride + col * 4) as u32).map(f32::from_bits),
        );
        let (value, row_lse) = if wsum > 0.0 {
            let inv = rcp_exact(wsum);
            (acc.map(|x| x * inv), top + lg2(wsum) * core::f32::consts::LN_2)
        } else {
            ([0.0; 4], f32::NEG_INFINITY)
        };
        if splits == 1 {
            let (lo, hi) = (pack_bf16x2(value[0], value[1]), pack_bf16x2(value[2], value[3]));
            *((a.out as *mut u8).add((q_row(row) * D + col) * 2) as *mut u64) = lo as u64 | (hi as u64) << 32;
            if col == 0 {
                *(a.lse as *mut f32).add(q_row(row)) = row_lse;
            }
        } else {
            let slot = q_row(row) * splits + split;
            st_global_v4((a.o_partial as *mut f32).add(slot * D + col) as *mut u8, value.map(f32::to_bits));
            if col == 0 {
                *(a.lse_partial as *mut f32).add(slot) = row_lse;
            }
        }
        i += WARPS * THREADS;
    }
    if splits <= 1 {
        return;
    }
    merge_tile_block::<D, WARPS>(a, tile, q_rows, q_row);
}

macro_rules! entries {
    ($($name:ident => <$d:literal, $ks:literal, $dt:literal, $spec:literal, $warps:tt> @ $th:literal;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(args: DecodeArgs) {
            decode_split::<$d, $ks, $dt, $spec, { $warps }>(args)
        }
        crate::launch_bounds!($name: DecodeArgs, $th);
        const _: () = assert!($th == $warps * THREADS, "one warp per 32 threads");
    )*};
}

// The host takes the `wide` entries for one query per sequence with G ≤ 16
// where their shared memory fits, else the `split` ones and `decode_merge`: the
// plain entries for q_len = 1 with G ≤ 16, the spec ones otherwise (speculative
// decoding, or groups wider than one m16 tile).
entries! {
    decode_split_hd64 => <64, 4, 8, false, 1> @ 32;
    decode_split_hd128 => <128, 8, 16, false, 1> @ 32;
    decode_split_spec_hd64 => <64, 4, 8, true, 1> @ 32;
    decode_split_spec_hd128 => <128, 8, 16, true, 1> @ 32;
    // Four warps per block, each a quarter of the block's keys, combined in
    // shared memory before the fused merge.
    decode_wide_hd64 => <64, 4, 8, false, WIDE_WARPS> @ 128;
    decode_wide_hd128 => <128, 8, 16, false, WIDE_WARPS> @ 128;
}
