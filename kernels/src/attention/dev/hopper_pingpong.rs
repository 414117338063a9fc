//! FlashAttention forward for Hopper (sm_90a), the shipped warp-specialized
//! kernel with FlashAttention-3's consumer schedule:
//! - **P·V one tile late.** A warpgroup issues S(j) = Q·K(j)ᵀ and then
//!   O += P(j−1)·V(j−1); the softmax of S(j) runs while that P·V is in flight,
//!   its wait anchored after the softmax (`wgmma::wait_group_after`).
//! - **Ping-pong** (`TURNS`). The two consumer warpgroups take turns issuing
//!   their GEMMs through two named barriers, so one's softmax runs under the
//!   other's GEMMs. Without turns the warp schedulers interleave them freely.
//! - **K and V on separate barriers.** K(j) is released once S(j) retires, V(j)
//!   once its (late) P·V does, so the producer refills each as early as it can.
//!   Q arrives on K's first barrier.
//! - **Masks only where needed.** The unmasked key tiles run first, then those
//!   past the sequence's end or on the causal diagonal.
//! - **O as the shipped kernel writes it**, in 16-byte stores (`QuadStores`).

use crate::attention::flash_hopper_ws::{Hd128, Hd64, PvMma, QuadStores, RowWriter, Rows, StagedO};
use crate::attention::hopper_tile::{Keys128, QueryTile, TileSmem, BM, BN, HALF_COLS};
use crate::attention::tile_ops::{p_frag, rescale, softmax_scores};
use crate::gpu::mma::FragC;
use crate::gpu::thread::{
    named_arrive, named_sync, sync_threads_unaligned,
    thread_idx_x,
};
use crate::gpu::tma::{self, Barrier};
use crate::gpu::wgmma;
use abi::attention::{HOPPER, HOPPER_BARRIER_BYTES, KV_STAGES};
use abi::FlashTmaArgs;

const STAGES: usize = KV_STAGES;
const CONSUMERS: usize = 2;
/// FlashAttention-3's split: 128 × 24 + 256 × 240 = 64512 of the SM's 65536.
const PRODUCER_REGS: u32 = 24;
const CONSUMER_REGS: u32 = 240;
/// The two consumer warpgroups' threads, which every turn barrier counts.
const TURN_THREADS: u32 = (CONSUMERS * 128) as u32;
/// Named barrier of consumer c's turn: 1 + c (0 is the block barrier).
const FIRST_TURN_BARRIER: u32 = 1;

const _: () = assert!(HOPPER.threads as usize == (1 + CONSUMERS) * 128 && HOPPER.threads == 384);
// `k_full`, `v_full`, `k_empty`, `v_empty` per stage, 8 bytes each.
const _: () = assert!(8 * 4 * STAGES <= HOPPER_BARRIER_BYTES);
const _: () = assert!(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= 384 * 168);

/// O += P·V (issued, committed): O first rescaled by P's factors `corr`, then V
/// waited for on `full` in `phase` and read N-major at `v`.
#[inline(always)]
unsafe fn pv<const DTILES: usize, P: PvMma<DTILES>>(
    o: &mut [FragC; DTILES],
    p: &[[u32; 4]; BN / 16],
    corr: [f32; 2],
    full: Barrier,
    phase: u32,
    v: u32,
    half_kv: u32,
) {
    rescale(o, corr);
    full.wait(phase);
    wgmma::fence_operands(o.as_flattened_mut());
    wgmma::fence();
    for (kk, &pk) in p.iter().enumerate() {
        P::pv(o, pk, wgmma::desc_mn_major_sw128(v + (kk * 2048) as u32, half_kv));
    }
    wgmma::commit_group();
}

/// `HALVES` = D/64; `DTILES` = D/8; `TURNS`: the consumers take turns.
#[inline(always)]
unsafe fn flash_hopper_pingpong<const D: usize, const HALVES: usize, const DTILES: usize, P: PvMma<DTILES>, const TURNS: bool>(
    a: FlashTmaArgs,
) {
    const {
        assert!(HALVES == D / HALF_COLS && DTILES == D / 8);
        assert!(HALVES * (BM + STAGES * 2 * BN) * HALF_COLS * 2 == HOPPER.tile_bytes(D));
    }
    let f = a.flash;
    let tid = thread_idx_x() as usize;
    let tile = QueryTile::of_block(&f, BM);
    if tile.is_past_end() {
        return;
    }
    let QueryTile { sp, head, q0, .. } = tile;
    let (q_start, k_start, len_q) = (sp.q_start, sp.k_start, sp.len_q);
    let kv_head = tile.kv_head(&f);
    let n_tiles = tile.key_tiles(BN);
    let mem = TileSmem::<HALVES, BN>::new();
    let half_kv = TileSmem::<HALVES, BN>::HALF_KV;
    let (q_at, k_at, v_at) = (|h| mem.q(h), |s, h| mem.k(s, h), |s| mem.v(s));
    let half_q = TileSmem::<HALVES, BN>::HALF_Q;
    let k_full = |s: usize| mem.barrier(s);
    let v_full = |s: usize| mem.barrier(STAGES + s);
    let k_empty = |s: usize| mem.barrier(2 * STAGES + s);
    let v_empty = |s: usize| mem.barrier(3 * STAGES + s);

    if tid == 0 {
        for s in 0..STAGES {
            k_full(s).init(1);
            v_full(s).init(1);
            k_empty(s).init(TURN_THREADS);
            v_empty(s).init(TURN_THREADS);
        }
        tma::fence_barrier_init();
    }
    sync_threads_unaligned();

    let warpgroup = tid / 128;
    if warpgroup == 0 {
        wgmma::setmaxnreg_dec::<PRODUCER_REGS>();
        if tid == 0 {
            tma::acquire_map(a.map_q);
            tma::acquire_map(a.map_k);
            tma::acquire_map(a.map_v);
            for j in 0..n_tiles {
                let s = j % STAGES;
                let (row, phase) = ((k_start + j * BN) as i32, ((j / STAGES) as u32).wrapping_sub(1) & 1);
                if j >= STAGES {
                    k_empty(s).wait(phase);
                }
                let q_bytes = if j == 0 { HALVES as u32 * half_q } else { 0 };
                k_full(s).arrive_expect_tx(q_bytes + HALVES as u32 * half_kv);
                for h in 0..HALVES {
                    let col = (h * HALF_COLS) as i32;
                    if j == 0 {
                        tma::load_3d(q_at(h), a.map_q, col, head as i32, (q_start + q0) as i32, k_full(0));
                    }
                    tma::load_3d(k_at(s, h), a.map_k, col, kv_head as i32, row, k_full(s));
                }
                if j >= STAGES {
                    v_empty(s).wait(phase);
                }
                v_full(s).arrive_expect_tx(HALVES as u32 * half_kv);
                for h in 0..HALVES {
                    let col = (h * HALF_COLS) as i32;
                    tma::load_3d(v_at(s) + h as u32 * half_kv, a.map_v, col, kv_head as i32, row, v_full(s));
                }
            }
        }
        return;
    }
    wgmma::setmaxnreg_inc::<CONSUMER_REGS>();

    let c = warpgroup - 1;
    let (warp, lane) = ((tid % 128) / 32, tid % 32);
    let row_in_seq = |h: usize| q0 + c * 64 + warp * 16 + lane / 4 + 8 * h;
    let (my_turn, their_turn) = (FIRST_TURN_BARRIER + c as u32, FIRST_TURN_BARRIER + 1 - c as u32);
    // Never written: the target of `wait_group_after`'s predicated-off stores.
    let anchor = mem.q(0);
    let mut m = [f32::NEG_INFINITY; 2];
    let mut l = [0.0f32; 2];
    let mut corr = [1.0f32; 2];
    let mut o: [FragC; DTILES] = [[0.0; 4]; DTILES];
    let mut p = [[0u32; 4]; BN / 16];
    // Consumer 0 takes the first turn.
    if TURNS && c == 1 {
        named_arrive(FIRST_TURN_BARRIER, TURN_THREADS);
    }

    // No branch between a `wgmma`'s issue and its wait (ptxas would serialize
    // them): the first tile is peeled off the loop, every consumer thread
    // arrives on the empty barriers, and masked tiles have a loop of their own.
    if n_tiles > 0 {
        k_full(0).wait(0);
        if TURNS {
            named_sync(my_turn, TURN_THREADS);
        }
        let mut acc = [0.0f32; 64];
        mem.qk::<64, Keys128>(&mut acc, 0, c);
        if TURNS {
            named_arrive(their_turn, TURN_THREADS);
        }
        wgmma::wait_group::<0>();
        wgmma::fence_operands(&mut acc);
        k_empty(0).arrive();
        let mut sf: [FragC; 16] = core::mem::transmute::<[f32; 64], [FragC; 16]>(acc);
        sp.mask_each(&mut sf, 0, row_in_seq, lane);
        corr = softmax_scores(&mut sf, &mut m, &mut l, f.scale_log2);
        p = core::array::from_fn(|kk| p_frag(&sf[2 * kk], &sf[2 * kk + 1]));
    }
    let mut step = #[inline(always)]
    |j: usize, masked: bool| {
        let (s, sv) = (j % STAGES, (j - 1) % STAGES);
        k_full(s).wait((j / STAGES) as u32 & 1);
        if TURNS {
            named_sync(my_turn, TURN_THREADS);
        }
        let mut acc = [0.0f32; 64];
        mem.qk::<64, Keys128>(&mut acc, s, c);
        pv::<DTILES, P>(&mut o, &p, corr, v_full(sv), ((j - 1) / STAGES) as u32 & 1, v_at(sv), half_kv);
        if TURNS {
            named_arrive(their_turn, TURN_THREADS);
        }

        wgmma::wait_group::<1>();
        wgmma::fence_operands(&mut acc);
        k_empty(s).arrive();
        let mut sf: [FragC; 16] = core::mem::transmute::<[f32; 64], [FragC; 16]>(acc);
        if masked {
            sp.mask_each(&mut sf, j * BN, row_in_seq, lane);
        }
        corr = softmax_scores(&mut sf, &mut m, &mut l, f.scale_log2);

        // P(j−1)·V(j−1) has retired: its P registers and V stage are free.
        wgmma::wait_group_after::<0>(l, anchor);
        wgmma::fence_operands(o.as_flattened_mut());
        wgmma::fence_operands_u32(p.as_flattened_mut());
        v_empty(sv).arrive();
        p = core::array::from_fn(|kk| p_frag(&sf[2 * kk], &sf[2 * kk + 1]));
    };
    let clear = sp.unmasked_tiles(q0, BN).clamp(1, n_tiles.max(1));
    for j in 1..clear {
        step(j, false);
    }
    for j in clear..n_tiles {
        step(j, true);
    }
    if n_tiles > 0 {
        let sv = (n_tiles - 1) % STAGES;
        pv::<DTILES, P>(&mut o, &p, corr, v_full(sv), ((n_tiles - 1) / STAGES) as u32 & 1, v_at(sv), half_kv);
        wgmma::wait_group::<0>();
        wgmma::fence_operands(o.as_flattened_mut());
    }
    // Consumer 1's last turn hand-over has no turn after it: take it, so every
    // barrier phase completes.
    if TURNS && c == 0 {
        named_sync(my_turn, TURN_THREADS);
    }

    let rows = Rows { f: &f, m: &m, l: &l, head, q_start, len_q, row_in_seq, lane, staged: StagedO::NONE };
    QuadStores::write::<D, DTILES, _>(&o, rows);
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_pingpong_hd128(a: FlashTmaArgs) {
    flash_hopper_pingpong::<128, 2, 16, Hd128, true>(a)
}
crate::launch_bounds!(flash_fwd_hopper_pingpong_hd128: FlashTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_pingpong_hd64(a: FlashTmaArgs) {
    flash_hopper_pingpong::<64, 1, 8, Hd64, true>(a)
}
crate::launch_bounds!(flash_fwd_hopper_pingpong_hd64: FlashTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_overlap_hd128(a: FlashTmaArgs) {
    flash_hopper_pingpong::<128, 2, 16, Hd128, false>(a)
}
crate::launch_bounds!(flash_fwd_hopper_overlap_hd128: FlashTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_overlap_hd64(a: FlashTmaArgs) {
    flash_hopper_pingpong::<64, 1, 8, Hd64, false>(a)
}
crate::launch_bounds!(flash_fwd_hopper_overlap_hd64: FlashTmaArgs, 384, 1);
