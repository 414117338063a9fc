//! Tensor-core GEMM, Y = X·Wᵀ (both operands K-contiguous), with fused epilogues.
//!
//! v1: 128×128 block tile, 4 warps of 64×64, 64-deep K tiles staged by cp.async
//! through a 3-stage ring of swizzled shared-memory tiles, ldmatrix → mma.sync
//! m16n8k16, f32 accumulators in registers. The epilogue (plain, residual add or
//! SwiGLU) runs on the accumulators, so gate/up activations never reach HBM.
//! Loading and compute are separate steps, ready for a TMA + wgmma variant.

use crate::gpu::bf16::{f32_to_bf16, pack_bf16x2, unpack_bf16x2};
use crate::gpu::math::{ex2, rcp, LOG2_E};
use crate::gpu::mem::{cp_async_commit, cp_async_wait};
use crate::gpu::mma::{ldmatrix_x4, mma_bf16_16816, FragA, FragC};
use crate::gpu::shared::dynamic_shared_base;
use crate::gpu::thread::{block_idx_x, block_idx_y, sync_threads, thread_idx_x};
use crate::gpu::tile::SmemTile;
pub use abi::{epilogue, GemmArgs};

const BM: usize = 128;
const BN: usize = 128;
const BK: usize = 64;
const STAGES: usize = 3;
const THREADS: usize = 128;
/// Warp tile 64×64: 4 m16 tiles × 8 n8 tiles.
const WM_TILES: usize = 4;
const WN_TILES: usize = 8;

/// Dynamic shared memory of one block.
pub const SMEM_BYTES: usize = STAGES * (BM + BN) * BK * 2;

#[inline(always)]
fn silu(g: f32) -> f32 {
    g * rcp(1.0 + ex2(-g * LOG2_E))
}

#[inline(always)]
unsafe fn gemm_v1(a: GemmArgs) {
    let tid = thread_idx_x() as usize;
    let (warp, lane) = (tid / 32, tid % 32);
    let (wm, wn) = (warp / 2, warp % 2);
    let n0 = block_idx_x() as usize * BN;
    let m0 = block_idx_y() as usize * BM;
    let (m, n, k) = (a.m as usize, a.n as usize, a.k as usize);
    let row_bytes = k * 2;
    let x_src = (a.x as *const u8).add(m0 * row_bytes);
    let w_src = (a.w as *const u8).add(n0 * row_bytes);
    let k_tiles = k.div_ceil(BK);

    let smem = dynamic_shared_base();
    let stage_bytes = SmemTile::<BM, BK>::BYTES + SmemTile::<BN, BK>::BYTES;
    let x_tile = |s: usize| SmemTile::<BM, BK>::at(smem + s as u32 * stage_bytes);
    let w_tile = |s: usize| SmemTile::<BN, BK>::at(smem + s as u32 * stage_bytes + SmemTile::<BM, BK>::BYTES);
    // K-tail chunks past k are zero-filled, so they add nothing to the dot products.
    let load = |kt: usize, s: usize| {
        let k0 = kt * BK;
        load_tile_k::<BM>(x_tile(s), x_src.add(k0 * 2), row_bytes, m - m0, k - k0, tid);
        load_tile_k::<BN>(w_tile(s), w_src.add(k0 * 2), row_bytes, n.saturating_sub(n0), k - k0, tid);
    };

    for s in 0..STAGES - 1 {
        if s < k_tiles {
            load(s, s);
        }
        cp_async_commit();
    }

    let mut acc: [[FragC; WN_TILES]; WM_TILES] = [[[0.0; 4]; WN_TILES]; WM_TILES];
    for kt in 0..k_tiles {
        cp_async_wait::<{ STAGES as u32 - 2 }>();
        sync_threads();
        // The stage refilled here was read in iteration kt-1; the barrier above
        // guarantees every warp is done with it.
        let next = kt + STAGES - 1;
        if next < k_tiles {
            load(next, next % STAGES);
        }
        cp_async_commit();

        let (xt, wt) = (x_tile(kt % STAGES), w_tile(kt % STAGES));
        for kk in 0..BK / 16 {
            let mut af: [FragA; WM_TILES] = [[0; 4]; WM_TILES];
            for (mt, f) in af.iter_mut().enumerate() {
                *f = ldmatrix_x4(xt.chunk_addr(wm * 64 + mt * 16 + lane % 16, 2 * kk + lane / 16));
            }
            for np in 0..WN_TILES / 2 {
                let b = ldmatrix_x4(wt.chunk_addr(wn * 64 + np * 16 + lane % 8 + 8 * (lane / 16), 2 * kk + (lane / 8) % 2));
                for (mt, f) in af.iter().enumerate() {
                    mma_bf16_16816(&mut acc[mt][2 * np], f, b[0], b[1]);
                    mma_bf16_16816(&mut acc[mt][2 * np + 1], f, b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait::<0>();

    let out = a.out as *mut u8;
    for (mt, row_frags) in acc.iter().enumerate() {
        for h in 0..2 {
            let row = m0 + wm * 64 + mt * 16 + lane / 4 + 8 * h;
            if row >= m {
                continue;
            }
            for (nt, frag) in row_frags.iter().enumerate() {
                let col = n0 + wn * 64 + nt * 8 + 2 * (lane % 4);
                if col >= n {
                    continue;
                }
                // n is even (host-checked), so col + 1 < n as well.
                let (v0, v1) = (frag[2 * h], frag[2 * h + 1]);
                match a.epilogue {
                    epilogue::SWIGLU => {
                        let h_val = silu(v0) * v1;
                        *(out.add((row * (n / 2) + col / 2) * 2) as *mut u16) = f32_to_bf16(h_val);
                    }
                    epilogue::RESIDUAL => {
                        let off = (row * n + col) * 2;
                        let (r0, r1) = unpack_bf16x2(*((a.residual as *const u8).add(off) as *const u32));
                        *(out.add(off) as *mut u32) = pack_bf16x2(r0 + v0, r1 + v1);
                    }
                    _ => *(out.add((row * n + col) * 2) as *mut u32) = pack_bf16x2(v0, v1),
                }
            }
        }
    }
}

/// Loads a ROWS × BK tile whose rows are `row_bytes` apart; rows past `valid_rows`
/// and 8-element chunks past `valid_k` are zero-filled.
#[inline(always)]
unsafe fn load_tile_k<const ROWS: usize>(
    tile: SmemTile<ROWS, BK>,
    src: *const u8,
    row_bytes: usize,
    valid_rows: usize,
    valid_k: usize,
    tid: usize,
) {
    let chunks = BK / 8;
    for i in 0..(ROWS * chunks) / THREADS {
        let id = i * THREADS + tid;
        let (row, chunk) = (id / chunks, id % chunks);
        let ok = row < valid_rows && chunk * 8 < valid_k;
        let p = if ok { src.add(row * row_bytes + chunk * 16) } else { src };
        crate::gpu::mem::cp_async_16_zfill(tile.chunk_addr(row, chunk), p, if ok { 16 } else { 0 });
    }
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_v1(args: GemmArgs) {
    gemm_v1(args)
}
crate::launch_bounds!(gemm_bf16_v1, 128);
