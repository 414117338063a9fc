//! Stream-K over 1-D grids of resident blocks (decode): the (tile, K tile)
//! iterations, tile-major, are cut into one equal contiguous range per block, so
//! every block streams the same number of weight bytes whatever the tile count.
//! Partial tiles meet in the f32 workspace; the last contributor to each, counted
//! per tile in the u32s after the sums (`abi::gemm::workspace_len`), applies the
//! epilogue and leaves the workspace zero.

use super::mma::{add_partial, mainloop, store_tile};
use super::store_pair;
use crate::gpu::mem::{block_completes_count, ld_global_cg_f32x2};
use crate::gpu::thread::{block_idx_x, grid_dim_x, launch_dependents, sync_threads, thread_idx_x};
use abi::GemmArgs;

/// One block's contiguous share `begin..end` of a stream-K grid's (tile, K tile)
/// iterations, tile-major over `tiles_n` column tiles of `k_tiles` K tiles each.
pub(crate) struct StreamKShare {
    pub tiles_n: usize,
    pub k_tiles: usize,
    pub begin: usize,
    pub end: usize,
}

impl StreamKShare {
    #[inline(always)]
    pub(crate) fn of<const BM: usize, const BN: usize, const BK: usize>(a: GemmArgs) -> Self {
        let (tiles_n, k_tiles) = ((a.n as usize).div_ceil(BN), (a.k as usize).div_ceil(BK));
        let total = tiles_n * (a.m as usize).div_ceil(BM) * k_tiles;
        let (b, g) = (block_idx_x() as usize, grid_dim_x() as usize);
        StreamKShare { tiles_n, k_tiles, begin: total * b / g, end: total * (b + 1) / g }
    }
}

/// Stream-K: no second, mostly idle wave of blocks. A block whose range covers a
/// whole tile stores it; partial tiles meet in the workspace and the last
/// contributor, counted in K tiles, applies the epilogue.
#[inline(always)]
pub(crate) unsafe fn gemm_stream_k<
    const BM: usize,
    const BN: usize,
    const WARPS_N: usize,
    const WMT: usize,
    const WNT: usize,
    const STAGES: usize,
    const THREADS: usize,
    const BK: usize,
>(
    a: GemmArgs,
) {
    launch_dependents();
    let k = a.k as usize;
    let StreamKShare { tiles_n, k_tiles, begin, end } = StreamKShare::of::<BM, BN, BK>(a);
    let mut it = begin;
    while it < end {
        let tile = it / k_tiles;
        let (kt0, kt1) = (it % k_tiles, k_tiles.min(it % k_tiles + end - it));
        let (m0, n0) = (tile / tiles_n * BM, tile % tiles_n * BN);
        // The previous segment's last stages may still be read by other warps.
        sync_threads();
        let acc = mainloop::<BM, BN, WARPS_N, WMT, WNT, STAGES, THREADS, BK>(a, m0, n0, kt0 * BK, k.min(kt1 * BK));
        if kt0 == 0 && kt1 == k_tiles {
            store_tile::<WARPS_N, WMT, WNT>(a, m0, n0, &acc);
        } else {
            add_partial::<WARPS_N, WMT, WNT>(a, m0, n0, &acc);
            finish_split_tile::<BM, BN, THREADS>(a, m0, n0, tile, (kt1 - kt0) as u32, k_tiles as u32);
        }
        it += kt1 - kt0;
    }
}

/// Split-K without a second launch: each block adds its share (`part` of the
/// tile's `whole`, counted per tile in the u32s after the f32 workspace); the one
/// that completes the count applies the epilogue to the tile's sums and zeroes
/// them and the counter for the next GEMM.
#[inline(always)]
pub(crate) unsafe fn finish_split_tile<const BM: usize, const BN: usize, const THREADS: usize>(
    a: GemmArgs,
    m0: usize,
    n0: usize,
    tile: usize,
    part: u32,
    whole: u32,
) {
    let tid = thread_idx_x() as usize;
    let (m, n) = (a.m as usize, a.n as usize);
    let ws = a.workspace as *mut f32;
    let counter = (ws.add(m * n) as *mut u32).add(tile);
    if !block_completes_count(counter, part, whole) {
        return;
    }
    let pairs = BM * BN / 2;
    let mut i = tid;
    while i < pairs {
        let (row, col) = (m0 + i / (BN / 2), n0 + 2 * (i % (BN / 2)));
        if row < m && col < n {
            let p = ws.add(row * n + col);
            let (v0, v1) = ld_global_cg_f32x2(p);
            *p = 0.0;
            *p.add(1) = 0.0;
            store_pair(a, row, col, v0, v1);
        }
        i += THREADS;
    }
    if tid == 0 {
        *counter = 0;
    }
}
