//! The first Hopper GEMM (sm_90a), Y = X·Wᵀ with `wgmma`, kept for comparison as
//! `GemmVersion::WgmmaExperimental` (tested on the H200 in `tests/gemm`); superseded
//! by the TMA + warp-specialized kernels of `gemm/tma.rs`.
//!
//! One warpgroup per block, a 64×128 output tile, 64-deep K tiles staged by
//! cp.async into 128-byte-swizzled tiles (4-stage ring) and consumed by
//! m64n128k16 `wgmma` straight from shared memory through matrix descriptors.
//! Epilogues as in the mma.sync kernels.

use crate::gemm::mma::load_tile_k;
use crate::gemm::{store_pair, GemmArgs};
use crate::gpu::mem::{cp_async_commit, cp_async_wait_n};
use crate::gpu::shared::dynamic_shared_base;
use crate::gpu::thread::{block_idx_x, block_idx_y, sync_threads, thread_idx_x};
use crate::gpu::tile::SmemTile;
use crate::gpu::wgmma;
use abi::gemm::wgmma_exp::{BK, BM, BN, STAGES, THREADS};

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_wgmma_exp(a: GemmArgs) {
    let tid = thread_idx_x() as usize;
    let (warp, lane) = (tid / 32, tid % 32);
    let n0 = block_idx_x() as usize * BN;
    let m0 = block_idx_y() as usize * BM;
    let (m, n, k) = (a.m as usize, a.n as usize, a.k as usize);
    let row_bytes = k * 2;
    let x_src = (a.x as *const u8).add(m0 * row_bytes);
    let w_src = (a.w as *const u8).add(n0 * row_bytes);
    let k_tiles = k.div_ceil(BK);

    // The swizzle is defined on 1024-byte atoms: align the ring (the launch adds
    // 1024 bytes of slack).
    let smem = (dynamic_shared_base() + 1023) & !1023;
    let stage_bytes = SmemTile::<BM, BK>::BYTES + SmemTile::<BN, BK>::BYTES;
    let x_tile = |s: usize| SmemTile::<BM, BK>::at(smem + s as u32 * stage_bytes);
    let w_tile = |s: usize| SmemTile::<BN, BK>::at(smem + s as u32 * stage_bytes + SmemTile::<BM, BK>::BYTES);
    let x_addr = |s: usize| smem + s as u32 * stage_bytes;
    let w_addr = |s: usize| smem + s as u32 * stage_bytes + SmemTile::<BM, BK>::BYTES;
    let load = |kt: usize, s: usize| {
        let k0 = kt * BK;
        load_tile_k::<BM, BK, THREADS>(x_tile(s), x_src.add(k0 * 2), row_bytes, m - m0, k - k0, tid);
        load_tile_k::<BN, BK, THREADS>(w_tile(s), w_src.add(k0 * 2), row_bytes, n - n0, k - k0, tid);
    };

    for s in 0..STAGES - 1 {
        if s < k_tiles {
            load(s, s);
        }
        cp_async_commit();
    }
    let mut acc = [0.0f32; 64];
    for kt in 0..k_tiles {
        cp_async_wait_n(STAGES - 2);
        // cp.async wrote through the generic proxy; wgmma reads through the async one.
        wgmma::fence_proxy_async_shared();
        sync_threads();
        let next = kt + STAGES - 1;
        if next < k_tiles {
            load(next, next % STAGES);
        }
        cp_async_commit();

        let s = kt % STAGES;
        wgmma::fence();
        for kk in 0..BK / 16 {
            let da = wgmma::desc_k_major_sw128(x_addr(s) + (kk * 32) as u32);
            let db = wgmma::desc_k_major_sw128(w_addr(s) + (kk * 32) as u32);
            wgmma::mma_m64n128k16(&mut acc, da, db, kt > 0 || kk > 0);
        }
        wgmma::commit_group();
        // The stage must be fully read before a later iteration refills it.
        wgmma::wait_group::<0>();
    }
    cp_async_wait_n(0);

    for h in 0..2 {
        let row = m0 + warp * 16 + lane / 4 + 8 * h;
        if row >= m {
            continue;
        }
        for j in 0..BN / 8 {
            let col = n0 + j * 8 + 2 * (lane % 4);
            if col < n {
                store_pair(a, row, col, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            }
        }
    }
}
const _: () = assert!(THREADS == 128);
crate::launch_bounds!(gemm_bf16_wgmma_exp: GemmArgs, 128);
