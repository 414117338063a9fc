//! Hopper's GEMM for 17 to 64 tokens (sm_90a): Y = X·Wᵀ on `wgmma`, fed by TMA.
//!
//! Decode at batch 64 is bound by streaming W: a 64×128 output tile per block
//! holds every token, so each weight tile crosses HBM once. Warp 4 produces:
//! for each 64-deep K tile of the block's K range it waits for a free ring stage
//! and has the copy engine load the X and W boxes into it. Warps 0–3, one
//! warpgroup, consume with m64n128k16 `wgmma`, releasing a stage once the group
//! after it is queued. With a programmatic launch the first stages' weight boxes
//! load while the previous kernel finishes; X only once it has. The sums go
//! through the epilogue when the launch has no workspace, else they are added
//! into it (split K over `blockIdx.z`) for `gemm_finalize` or a fused consumer.

use super::quad_store::store_tile;
use super::tma::{Ring, ThreadPairs};
use crate::gpu::mem::red_add_f32x2;
use crate::gpu::thread::{
    block_idx_x, block_idx_y, block_idx_z, launch_dependents, sync_threads_unaligned, thread_idx_x,
    wait_for_prior_grids,
};
use crate::gpu::tma;
use crate::gpu::wgmma;
use abi::gemm::tma_rows64::{ALIGN_SLACK, BARRIER_BYTES, BK, BM, BN, STAGES, THREADS};
use abi::GemmTmaArgs;

const _: () = assert!(ALIGN_SLACK == 1024 && BARRIER_BYTES == 16 * STAGES && THREADS == 160);
const X_BYTES: u32 = (BM * BK * 2) as u32;
const STAGE_BYTES: u32 = ((BM + BN) * BK * 2) as u32;
const PRODUCER: usize = 128;

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_rows64(a: GemmTmaArgs) {
    // The next kernel may start its own prologue as soon as SMs free up.
    launch_dependents();
    let g = a.gemm;
    let tid = thread_idx_x() as usize;
    let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
    let (n0, m0) = (block_idx_x() as usize * BN, block_idx_y() as usize * BM);
    let split = if g.workspace == 0 { k } else { g.k_split as usize };
    let k_begin = block_idx_z() as usize * split;
    let k_tiles = (k.min(k_begin + split) - k_begin).div_ceil(BK);

    let ring = Ring::new(STAGES, STAGE_BYTES, X_BYTES);
    if tid == 0 {
        ring.init(1);
    }
    // The role split below tests `tid` again: LLVM may thread the branch through
    // this barrier, so it must tolerate lanes arriving from two copies.
    sync_threads_unaligned();

    if tid >= PRODUCER {
        if tid == PRODUCER {
            tma::acquire_map(a.map_x);
            tma::acquire_map(a.map_w);
            let k0 = |kt: usize| (k_begin + kt * BK) as i32;
            let first = k_tiles.min(STAGES);
            // Weights are resident: they may load before the previous kernel ends.
            for s in 0..first {
                ring.full(s).arrive_expect_tx(STAGE_BYTES);
                tma::load_2d(ring.w(s), a.map_w, k0(s), n0 as i32, ring.full(s));
            }
            wait_for_prior_grids();
            for s in 0..first {
                tma::load_2d(ring.x(s), a.map_x, k0(s), m0 as i32, ring.full(s));
            }
            for kt in STAGES..k_tiles {
                let s = kt % STAGES;
                // Phase (kt / STAGES - 1) of `empty`: the release of this stage's previous K tile.
                ring.empty(s).wait(((kt / STAGES) as u32 - 1) & 1);
                ring.full(s).arrive_expect_tx(STAGE_BYTES);
                tma::load_2d(ring.w(s), a.map_w, k0(kt), n0 as i32, ring.full(s));
                tma::load_2d(ring.x(s), a.map_x, k0(kt), m0 as i32, ring.full(s));
            }
        }
        return;
    }

    let (warp, lane) = (tid / 32, tid % 32);
    let mut acc = [0.0f32; 64];
    for kt in 0..k_tiles {
        let s = kt % STAGES;
        ring.full(s).wait((kt / STAGES) as u32 & 1);
        wgmma::fence();
        for kk in 0..BK / 16 {
            // One k16 step is 32 bytes along the swizzled rows.
            let da = wgmma::desc_k_major_sw128(ring.x(s) + (kk * 32) as u32);
            let db = wgmma::desc_k_major_sw128(ring.w(s) + (kk * 32) as u32);
            wgmma::mma_m64n128k16(&mut acc, da, db, kt > 0 || kk > 0);
        }
        wgmma::commit_group();
        // Keep this K tile's group in flight; the previous one has now read its stage.
        wgmma::wait_group::<1>();
        if kt > 0 && tid == 0 {
            ring.empty((kt - 1) % STAGES).arrive();
        }
    }
    wgmma::wait_group::<0>();
    // The output, the residual and the workspace are earlier kernels' too.
    wait_for_prior_grids();

    let ws = g.workspace as *mut f32;
    let pairs = ThreadPairs { row0: m0 + warp * 16 + lane / 4, col0: n0 + 2 * (lane % 4), m, n };
    if ws.is_null() {
        store_tile(g, &pairs, &acc);
        return;
    }
    // col and n are even: every pair is 8-byte aligned.
    pairs.each::<64>(|row, col, i| red_add_f32x2(ws.add(row * n + col), acc[i], acc[i + 1]));
}
crate::launch_bounds!(gemm_bf16_tma_rows64: GemmTmaArgs, 160, 2);
