//! The Hopper GEMM (sm_90a): Y = X·Wᵀ on `wgmma`, fed by TMA, warp-specialized.
//!
//! A block computes a 128×256 output tile with three warpgroups. Warpgroup 0 is
//! the producer: one thread walks K, and for each 64-deep K tile waits until a
//! ring stage is free, then has the copy engine load the X and W boxes into it
//! (128-byte swizzled, out-of-bounds rows and columns read as zeros). Warpgroups
//! 1 and 2 are consumers, 64 rows each: they wait for a stage to fill, issue four
//! m64n256k16 `wgmma` on it, and release the stage once the *previous* group of
//! `wgmma` has retired, so the tensor cores always have the next group queued.
//! Two barriers per stage carry the hand-off: `full` (producer → consumers,
//! completed by the copy engine's byte count) and `empty` (consumers → producer).
//! Epilogues as in the mma.sync kernels. Shipped persistent: one block per SM
//! walking the tiles (the `dev` entry takes one block per tile). The tile and ring
//! sizes are `abi::gemm::tma`'s, which the host's boxes and shared memory follow.

use super::store_pair;
use crate::gpu::mem::red_add_f32x2;
use crate::gpu::shared::dynamic_shared_base;
use crate::gpu::thread::{block_idx_x, grid_dim_x, sync_threads_unaligned, thread_idx_x};
use crate::gpu::tma::{self, Barrier};
use crate::gpu::wgmma;
use abi::gemm::tma::{ALIGN_SLACK, BARRIER_BYTES, BK, BM, BN, CONSUMERS, STAGES, THREADS};
use abi::GemmTmaArgs;

const _: () = assert!(ALIGN_SLACK == 1024 && BARRIER_BYTES == 16 * STAGES && THREADS == 384);
const X_BYTES: u32 = (BM * BK * 2) as u32;

/// A consumer warpgroup's share of the output tile: 64 rows × `BN` columns on
/// m64n`BN`k16 `wgmma`, `ACC` f32 accumulators per thread; and the ring depth
/// its stages allow.
pub(crate) trait WideTile<const ACC: usize> {
    const BN: usize;
    const STAGES: usize;
    fn mma(acc: &mut [f32; ACC], desc_a: u64, desc_b: u64, accumulate: bool);
}

/// The shipped 128×256 tile (`abi::gemm::tma`).
pub(crate) struct Cols256;

impl WideTile<128> for Cols256 {
    const BN: usize = BN;
    const STAGES: usize = STAGES;
    #[inline(always)]
    fn mma(acc: &mut [f32; 128], desc_a: u64, desc_b: u64, accumulate: bool) {
        wgmma::mma_m64n256k16(acc, desc_a, desc_b, accumulate);
    }
}
/// Consecutive blocks walk down this many tile rows before moving right, so a
/// wave of blocks shares X rows and W columns in L2.
const GROUP_M: usize = 8;

/// (tile row, tile column) of block `id`: grouped raster order.
#[inline(always)]
fn tile_of(id: usize, m_tiles: usize, n_tiles: usize) -> (usize, usize) {
    let per_group = GROUP_M * n_tiles;
    let first_m = (id / per_group) * GROUP_M;
    let rows = (m_tiles - first_m).min(GROUP_M);
    let within = id % per_group;
    (first_m + within % rows, within / rows)
}

/// Which work units a block computes: output tiles, or with `SPLIT` (tile, K
/// slice) pairs whose sums meet in the workspace.
pub(crate) trait TileWalk {
    /// This block's units: (first, step, end) of the `units`.
    fn walk(units: usize) -> (usize, usize, usize);
    /// Whether a block may go on to another unit: its producer may then be
    /// waiting for the current unit's last stage.
    const MORE_TILES: bool;
    /// K split in slices of `k_split` (the launch's workspace takes the sums).
    const SPLIT: bool = false;
}

/// One block per SM walking the tiles `block, block + grid, …`: the producer
/// streams the next tile's K tiles into the ring while the consumers run this
/// tile's epilogue, and no block pays the ring's fill latency more than once.
pub(crate) struct Persistent;

impl TileWalk for Persistent {
    #[inline(always)]
    fn walk(units: usize) -> (usize, usize, usize) {
        (block_idx_x() as usize, grid_dim_x() as usize, units)
    }
    const MORE_TILES: bool = true;
}

/// The block's output tiles of `T`'s width, in the order `W` walks them.
#[inline(always)]
pub(crate) unsafe fn gemm_tma<W: TileWalk, const ACC: usize, T: WideTile<ACC>>(a: GemmTmaArgs) {
    // The launch's shared memory: `stages` ring stages, the slack, then 16 bytes
    // of barriers a stage (`abi::gemm::tma*::SMEM_BYTES`).
    const { assert!(ACC * 2 == T::BN) };
    let (bn, stages) = (T::BN, T::STAGES);
    let stage_bytes = ((BM + bn) * BK * 2) as u32;
    let g = a.gemm;
    let tid = thread_idx_x() as usize;
    let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
    let (m_tiles, n_tiles) = (m.div_ceil(BM), n.div_ceil(bn));
    let k_tiles = k.div_ceil(BK);
    // K tiles per slice, and slices per tile (one without a split).
    let per_split = if W::SPLIT { (g.k_split as usize / BK).max(1) } else { k_tiles };
    let splits = if W::SPLIT { k_tiles.div_ceil(per_split) } else { 1 };
    let (first_tile, tile_step, tiles) = W::walk(m_tiles * n_tiles * splits);
    // Unit `u`: its output tile and its K tiles.
    let unit = |u: usize| {
        let (tile, z) = (u / splits, u % splits);
        let (tm, tn) = tile_of(tile, m_tiles, n_tiles);
        (tm, tn, z * per_split, k_tiles.min((z + 1) * per_split))
    };

    // The 128-byte swizzle is defined on 1024-byte atoms: align the ring (the
    // launch adds 1024 bytes of slack); the barriers follow it.
    let ring = (dynamic_shared_base() + 1023) & !1023;
    let x_at = |s: usize| ring + s as u32 * stage_bytes;
    let w_at = |s: usize| x_at(s) + X_BYTES;
    let bars = ring + stages as u32 * stage_bytes;
    let full = |s: usize| Barrier(bars + 8 * s as u32);
    let empty = |s: usize| Barrier(bars + 8 * (stages + s) as u32);

    if tid == 0 {
        for s in 0..stages {
            full(s).init(1);
            empty(s).init(CONSUMERS as u32);
        }
        tma::fence_barrier_init();
    }
    // The role split below tests `tid == 0` again, so LLVM threads the branch
    // through this barrier: it must tolerate lanes arriving from two copies.
    sync_threads_unaligned();

    let warpgroup = tid / 128;
    if warpgroup == 0 {
        // The split walk's unit arithmetic and workspace adds need more than the
        // 168 registers a thread gets at 384: the producer hands its spares over.
        if W::SPLIT {
            wgmma::setmaxnreg_dec::<40>();
        }
        if tid == 0 {
            tma::prefetch_map(a.map_x);
            tma::prefetch_map(a.map_w);
            // `it` counts K tiles across all of this block's output tiles: it
            // names the ring stage and the barrier phase.
            let mut it = 0;
            let mut tile = first_tile;
            while tile < tiles {
                let (tm, tn, kt0, kt1) = unit(tile);
                for kt in kt0..kt1 {
                    let s = it % stages;
                    if it >= stages {
                        // Phase (it / stages - 1) of `empty`: the consumers' release
                        // of this stage's previous K tile.
                        empty(s).wait(((it / stages) as u32 - 1) & 1);
                    }
                    full(s).arrive_expect_tx(stage_bytes);
                    let k0 = (kt * BK) as i32;
                    tma::load_2d(x_at(s), a.map_x, k0, (tm * BM) as i32, full(s));
                    tma::load_2d(w_at(s), a.map_w, k0, (tn * bn) as i32, full(s));
                    it += 1;
                }
                tile += tile_step;
            }
        }
        return;
    }

    if W::SPLIT {
        wgmma::setmaxnreg_inc::<232>();
    }
    let c = warpgroup - 1;
    let (warp, lane) = ((tid % 128) / 32, tid % 32);
    let mut acc = [0.0f32; ACC];
    let mut it = 0;
    let mut tile = first_tile;
    while tile < tiles {
        let (tm, tn, kt0, kt1) = unit(tile);
        for kt in kt0..kt1 {
            let s = it % stages;
            full(s).wait((it / stages) as u32 & 1);
            wgmma::fence();
            for kk in 0..BK / 16 {
                // This consumer's 64 rows of X start 64 rows (8 KiB) into the box;
                // one k16 step is 32 bytes along the swizzled rows.
                let da = wgmma::desc_k_major_sw128(x_at(s) + (c * 64 * 128 + kk * 32) as u32);
                let db = wgmma::desc_k_major_sw128(w_at(s) + (kk * 32) as u32);
                T::mma(&mut acc, da, db, kt > kt0 || kk > 0);
            }
            wgmma::commit_group();
            // Keep this K tile's group in flight; the previous one has now read its stage.
            wgmma::wait_group::<1>();
            if kt > kt0 && tid % 128 == 0 {
                empty((it - 1) % stages).arrive();
            }
            it += 1;
        }
        wgmma::wait_group::<0>();
        // The tile's last stage is free too: the producer may be waiting for it
        // to load the next tile.
        if W::MORE_TILES && tid % 128 == 0 {
            empty((it - 1) % stages).arrive();
        }

        for h in 0..2 {
            let row = tm * BM + c * 64 + warp * 16 + lane / 4 + 8 * h;
            if row >= m {
                continue;
            }
            for j in 0..bn / 8 {
                let col = tn * bn + j * 8 + 2 * (lane % 4);
                if col >= n {
                    continue;
                }
                let (v0, v1) = (acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                if W::SPLIT {
                    // col and n are even: the pair is 8-byte aligned.
                    red_add_f32x2((g.workspace as *mut f32).add(row * n + col), v0, v1);
                } else {
                    store_pair(g, row, col, v0, v1);
                }
            }
        }
        tile += tile_step;
    }
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_persistent(a: GemmTmaArgs) {
    gemm_tma::<Persistent, 128, Cols256>(a)
}
crate::launch_bounds!(gemm_bf16_tma_persistent: GemmTmaArgs, 384, 1);

/// 128×128 tiles (`abi::gemm::tma_n128`): each consumer 64 × 128 on
/// m64n128k16, a ring of more stages in the same shared memory; twice the
/// tiles of 128×256 where those leave SMs idle.
struct Cols128;

impl WideTile<64> for Cols128 {
    const BN: usize = abi::gemm::tma_n128::BN;
    const STAGES: usize = abi::gemm::tma_n128::STAGES;
    #[inline(always)]
    fn mma(acc: &mut [f32; 64], desc_a: u64, desc_b: u64, accumulate: bool) {
        wgmma::mma_m64n128k16(acc, desc_a, desc_b, accumulate);
    }
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_persistent_n128(a: GemmTmaArgs) {
    gemm_tma::<Persistent, 64, Cols128>(a)
}
crate::launch_bounds!(gemm_bf16_tma_persistent_n128: GemmTmaArgs, 384, 1);
