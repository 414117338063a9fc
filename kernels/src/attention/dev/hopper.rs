//! FlashAttention forward for Hopper (sm_90a), the first version kept for
//! comparison: the GEMM's producer/consumer structure applied to attention.
//!
//! A block takes 128 query rows of one head with two warpgroups of 64 rows each.
//! Thread 0 also drives the copy engine: it loads the Q tile once and streams K
//! and V tiles of 128 keys through a two-stage ring by TMA (3-D tensor maps over
//! [tokens, heads, D], boxes of 64 columns, 128-byte swizzled), with `full` and
//! `empty` mbarriers per stage; it refills a stage once every warp has released it.
//! S = Q·Kᵀ runs as m64n128k16 `wgmma` straight from shared memory; the online
//! softmax works on the accumulators in registers (their layout is mma.sync's C
//! fragment, so the shared `tile_ops` steps apply); O += P·V runs on mma.sync
//! with P from registers and V through `ldmatrix.trans`. The two warpgroups
//! overlap only partly: warp 0 refills a stage once both have released it, so
//! they run close to lockstep (a separate producer would decouple them, at the
//! cost of the register cap below).
//! Causal, varlen and GQA as in `flash_v2`. No separate producer warp: with 256
//! threads ptxas may give each thread 255 registers (with 288 or 384 threads it
//! allots 168, and the hd128 accumulators spill).

use crate::attention::hopper_tile::{Keys128, QueryTile, TileSmem, BM, BN, HALF_COLS};
use crate::attention::tile_ops::{finish_row, lse, online_softmax, p_frag, v_frags};
use crate::gpu::bf16::pack_bf16x2;
use crate::gpu::mma::{mma_bf16_16816, FragA, FragC};
use crate::gpu::thread::{sync_threads_unaligned, thread_idx_x};
use crate::gpu::tile::SmemTile;
use crate::gpu::tma;
use crate::gpu::warp::sync_warp;
use crate::gpu::wgmma;
use abi::attention::{dev::HOPPER_LOCKSTEP as HOPPER, HOPPER_BARRIER_BYTES, KV_STAGES};
use abi::FlashTmaArgs;

const STAGES: usize = KV_STAGES;
const CONSUMERS: usize = 2;
/// Warps that release each stage (every consumer warp reads V through ldmatrix).
const RELEASERS: u32 = (CONSUMERS * 4) as u32;

// One warpgroup per consumer, and `launch_bounds!` below takes a literal; the
// shipped kernel's tiles.
const _: () = assert!(HOPPER.threads as usize == CONSUMERS * 128 && HOPPER.threads == 256);
const _: () = assert!(HOPPER.rows == BM && HOPPER.keys == BN);
// `q_full`, then `full` and `empty` per stage, 8 bytes each.
const _: () = assert!(8 * (1 + 2 * STAGES) <= HOPPER_BARRIER_BYTES);

/// `HALVES` = D/64; `DTILES` = D/8.
#[inline(always)]
unsafe fn flash_hopper<const D: usize, const HALVES: usize, const DTILES: usize>(a: FlashTmaArgs) {
    const {
        assert!(HALVES == D / HALF_COLS && DTILES == D / 8);
        // The barriers sit right past the tiles; the host sizes the launch for both.
        assert!(HALVES * (BM + STAGES * 2 * BN) * HALF_COLS * 2 == HOPPER.tile_bytes(D));
    }
    let f = a.flash;
    let tid = thread_idx_x() as usize;
    let tile = QueryTile::of_block(&f, BM);
    if tile.is_past_end() {
        return;
    }
    let QueryTile { sp, head, q0, .. } = tile;
    let (q_start, k_start, len_q) = (sp.q_start as usize, sp.k_start as usize, sp.len_q as usize);
    let kv_head = tile.kv_head(&f);
    let n_tiles = tile.key_tiles(BN);
    let mem = TileSmem::<HALVES, BN>::new(STAGES);
    let half_kv = TileSmem::<HALVES, BN>::HALF_KV;
    let (q_at, k_at) = (|h| mem.q(h), |s, h| mem.k(s, h));
    let v_at = |s: usize, h: usize| mem.v(s) + h as u32 * half_kv;
    let half_q = TileSmem::<HALVES, BN>::HALF_Q;
    let q_full = mem.barrier(0);
    let full = |s: usize| mem.barrier(1 + s);
    let empty = |s: usize| mem.barrier(1 + STAGES + s);

    // Thread 0 loads K and V tile j into stage j % STAGES.
    let load_kv = |j: usize| {
        let s = j % STAGES;
        full(s).arrive_expect_tx(2 * HALVES as u32 * half_kv);
        let row = (k_start + j * BN) as i32;
        for h in 0..HALVES {
            let col = (h * HALF_COLS) as i32;
            tma::load_3d(k_at(s, h), a.map_k, col, kv_head as i32, row, full(s));
            tma::load_3d(v_at(s, h), a.map_v, col, kv_head as i32, row, full(s));
        }
    };
    if tid == 0 {
        q_full.init(1);
        for s in 0..STAGES {
            full(s).init(1);
            empty(s).init(RELEASERS);
        }
        tma::fence_barrier_init();
        // Cheap insurance: the copy engine (async proxy) is about to use them.
        wgmma::fence_proxy_async_shared();
        for map in [a.map_q, a.map_k, a.map_v] {
            tma::acquire_map(map);
        }
        q_full.arrive_expect_tx(HALVES as u32 * half_q);
        for h in 0..HALVES {
            tma::load_3d(q_at(h), a.map_q, (h * HALF_COLS) as i32, head as i32, (q_start + q0) as i32, q_full);
        }
        for j in 0..n_tiles.min(STAGES) {
            load_kv(j);
        }
    }
    // Every thread waits on barriers thread 0 initialized. The later `tid == 0`
    // branches may get this barrier duplicated into them by LLVM.
    sync_threads_unaligned();

    let c = tid / 128;
    let (warp, lane) = ((tid % 128) / 32, tid % 32);
    let row_in_seq = |h: usize| q0 + c * 64 + warp * 16 + lane / 4 + 8 * h;
    let mut m = [f32::NEG_INFINITY; 2];
    let mut l = [0.0f32; 2];
    let mut o: [FragC; DTILES] = [[0.0; 4]; DTILES];
    q_full.wait(0);

    for j in 0..n_tiles {
        let s = j % STAGES;
        full(s).wait((j / STAGES) as u32 & 1);

        // S = Q·Kᵀ for this warpgroup's 64 rows: 128 keys, D/16 k-steps.
        let mut acc = [0.0f32; 64];
        mem.qk::<64, Keys128>(&mut acc, s, c);
        wgmma::wait_group::<0>();
        // Each warp's part of the m64n128 accumulator is an m16n128 C fragment.
        let mut sf: [FragC; 16] = core::mem::transmute::<[f32; 64], [FragC; 16]>(acc);

        sp.mask(&mut sf, j * BN, BN, q0, row_in_seq, lane);
        online_softmax(&mut sf, &mut o, &mut m, &mut l, f.scale_log2);

        // O += P·V on mma.sync, V halves through ldmatrix.trans.
        for kk in 0..BN / 16 {
            let p: FragA = p_frag(&sf[2 * kk], &sf[2 * kk + 1]);
            for h in 0..HALVES {
                let vt = SmemTile::<BN, HALF_COLS>::at(v_at(s, h));
                for dp in 0..HALF_COLS / 16 {
                    let b = v_frags(vt, kk, dp, lane);
                    let t = h * (HALF_COLS / 8) + 2 * dp;
                    mma_bf16_16816(&mut o[t], &p, b[0], b[1]);
                    mma_bf16_16816(&mut o[t + 1], &p, b[2], b[3]);
                }
            }
        }
        // This warp is done with the stage: its wgmma retired and every lane's
        // ldmatrix results are consumed (the warp barrier orders them before the arrive).
        sync_warp();
        if lane == 0 {
            empty(s).arrive();
        }
        // Refill the stage with tile j + STAGES once every warp has released it. The
        // whole of warp 0 waits, so it reaches the next `.aligned` wgmma together.
        if tid / 32 == 0 && j + STAGES < n_tiles {
            empty(s).wait((j / STAGES) as u32 & 1);
            if tid == 0 {
                load_kv(j + STAGES);
            }
            sync_warp();
        }
    }

    write_rows::<D, DTILES>(&f, &o, &m, &l, head, q_start, len_q, row_in_seq, lane);
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_hd128(a: FlashTmaArgs) {
    flash_hopper::<128, 2, 16>(a)
}
crate::launch_bounds!(flash_fwd_hopper_hd128: FlashTmaArgs, 256, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_hd64(a: FlashTmaArgs) {
    flash_hopper::<64, 1, 8>(a)
}
crate::launch_bounds!(flash_fwd_hopper_hd64: FlashTmaArgs, 256, 1);

/// The epilogue of a consumer warpgroup: its rows of O divided by ℓ, in bf16,
/// and their LSE; rows past the sequence are not written.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn write_rows<const D: usize, const DTILES: usize>(
    f: &abi::FlashArgs,
    o: &[FragC; DTILES],
    m: &[f32; 2],
    l: &[f32; 2],
    head: usize,
    q_start: usize,
    len_q: usize,
    row_in_seq: impl Fn(usize) -> usize,
    lane: usize,
) {
    let o_stride = f.n_heads as usize * D * 2;
    for h in 0..2 {
        let (total, inv) = finish_row(l, h);
        let row = row_in_seq(h);
        if row < len_q {
            let token = q_start + row;
            let dst = (f.o as *mut u8).add(token * o_stride + head * D * 2);
            for (dt, frag) in o.iter().enumerate() {
                let col = dt * 8 + 2 * (lane % 4);
                *(dst.add(col * 2) as *mut u32) = pack_bf16x2(frag[2 * h] * inv, frag[2 * h + 1] * inv);
            }
            if lane % 4 == 0 {
                *(f.lse as *mut f32).add(head * f.total_q as usize + token) = lse(m[h], total);
            }
        }
    }
}
