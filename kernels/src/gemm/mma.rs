//! The mma.sync GEMM machinery shared by every tile shape: the cp.async ring of
//! (X, W) K tiles, the ldmatrix → mma.sync m16n8k16 inner step, and the stores
//! of a block's accumulators (through the epilogue, or into the split-K
//! workspace). One generic kernel, [`gemm`], instantiated per tile shape and
//! K policy by the entries in `gemm/mod.rs` and `gemm/dev`.

use super::store_pair;
use crate::gpu::mem::{cp_async_16_zfill, cp_async_commit, cp_async_wait, cp_async_wait_n, red_add_f32x2};
use crate::gpu::mma::{ldmatrix_x4, mma_bf16_16816, FragA, FragC};
use crate::gpu::shared::dynamic_shared_base;
use crate::gpu::thread::{
    block_idx_x, block_idx_y, block_idx_z, launch_dependents, sync_threads, thread_idx_x, wait_for_prior_grids,
};
use crate::gpu::tile::SmemTile;
use abi::GemmArgs;

pub(crate) type Acc<const WMT: usize, const WNT: usize> = [[FragC; WNT]; WMT];

/// The STAGES-deep ring of (X, W) BK-deep K tiles in dynamic shared memory.
#[derive(Clone, Copy)]
pub(crate) struct Ring<const BM: usize, const BN: usize, const BK: usize> {
    base: u32,
}

impl<const BM: usize, const BN: usize, const BK: usize> Ring<BM, BN, BK> {
    const STAGE_BYTES: u32 = SmemTile::<BM, BK>::BYTES + SmemTile::<BN, BK>::BYTES;

    #[inline(always)]
    pub(crate) fn in_dynamic_shared() -> Self {
        Ring { base: dynamic_shared_base() }
    }

    #[inline(always)]
    pub(crate) fn x(self, s: usize) -> SmemTile<BM, BK> {
        unsafe { SmemTile::at(self.base + s as u32 * Self::STAGE_BYTES) }
    }

    #[inline(always)]
    pub(crate) fn w(self, s: usize) -> SmemTile<BN, BK> {
        unsafe { SmemTile::at(self.base + s as u32 * Self::STAGE_BYTES + SmemTile::<BM, BK>::BYTES) }
    }
}

/// Fills the first STAGES − 1 stages of a ring over `count` K tiles, one commit
/// group per stage. The weights go first: they do not depend on earlier kernels,
/// so with a programmatic launch they stream in while the previous kernel
/// finishes; X only once it has. (Group 0 then holds every prologue weight stage:
/// only the first wait is longer.)
#[inline(always)]
pub(crate) unsafe fn fill_ring<const STAGES: usize>(
    count: usize,
    load_w: impl Fn(usize, usize),
    load_x: impl Fn(usize, usize),
) {
    for s in 0..STAGES - 1 {
        if s < count {
            load_w(s, s);
        }
    }
    wait_for_prior_grids();
    for s in 0..STAGES - 1 {
        if s < count {
            load_x(s, s);
        }
        cp_async_commit();
    }
}

/// How a block covers K and where its sums go: a named policy, so each entry
/// compiles only its own path.
pub(crate) trait KPolicy {
    /// This block's K elements `k_begin..k_end` of `k`.
    fn k_range(a: GemmArgs, k: usize) -> (usize, usize);

    /// Hands on the block's sums over its K range for output tile (m0, n0).
    unsafe fn finish<
        const BM: usize,
        const BN: usize,
        const WARPS_N: usize,
        const WMT: usize,
        const WNT: usize,
        const THREADS: usize,
    >(
        a: GemmArgs,
        m0: usize,
        n0: usize,
        acc: &Acc<WMT, WNT>,
    );
}

/// One block per output tile over the whole of K: the epilogue in-kernel.
pub(crate) struct WholeK;

impl KPolicy for WholeK {
    #[inline(always)]
    fn k_range(_: GemmArgs, k: usize) -> (usize, usize) {
        (0, k)
    }

    #[inline(always)]
    unsafe fn finish<
        const BM: usize,
        const BN: usize,
        const WARPS_N: usize,
        const WMT: usize,
        const WNT: usize,
        const THREADS: usize,
    >(
        a: GemmArgs,
        m0: usize,
        n0: usize,
        acc: &Acc<WMT, WNT>,
    ) {
        store_tile::<WARPS_N, WMT, WNT>(a, m0, n0, acc);
    }
}

/// K split over `blockIdx.z` in slices of `k_split`: each block adds its partial
/// tile into the f32 workspace, and `gemm_finalize` (or a fused consumer)
/// applies the epilogue.
pub(crate) struct SplitK;

impl KPolicy for SplitK {
    #[inline(always)]
    fn k_range(a: GemmArgs, k: usize) -> (usize, usize) {
        let split = a.k_split as usize;
        (block_idx_z() as usize * split, k.min((block_idx_z() as usize + 1) * split))
    }

    #[inline(always)]
    unsafe fn finish<
        const BM: usize,
        const BN: usize,
        const WARPS_N: usize,
        const WMT: usize,
        const WNT: usize,
        const THREADS: usize,
    >(
        a: GemmArgs,
        m0: usize,
        n0: usize,
        acc: &Acc<WMT, WNT>,
    ) {
        add_partial::<WARPS_N, WMT, WNT>(a, m0, n0, acc);
    }
}

/// Block tile BM × BN from WARPS_M × WARPS_N warps, each WMT m16 tiles × WNT n8
/// tiles; K covered as policy `K` says.
#[inline(always)]
pub(crate) unsafe fn gemm<
    const BM: usize,
    const BN: usize,
    const WARPS_N: usize,
    const WMT: usize,
    const WNT: usize,
    const STAGES: usize,
    const THREADS: usize,
    const BK: usize,
    K: KPolicy,
>(
    a: GemmArgs,
) {
    // The next kernel may start its own prologue as soon as SMs free up.
    launch_dependents();
    let n0 = block_idx_x() as usize * BN;
    let m0 = block_idx_y() as usize * BM;
    let k = a.k as usize;
    let (k_begin, k_end) = K::k_range(a, k);
    let acc = mainloop::<BM, BN, WARPS_N, WMT, WNT, STAGES, THREADS, BK>(a, m0, n0, k_begin, k_end);
    K::finish::<BM, BN, WARPS_N, WMT, WNT, THREADS>(a, m0, n0, &acc);
}

/// The tile's sums over K elements `k_begin..k_end`: K tiles stream by cp.async
/// through a STAGES-deep ring while earlier ones feed ldmatrix → mma.sync.
#[inline(always)]
pub(crate) unsafe fn mainloop<
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
    m0: usize,
    n0: usize,
    k_begin: usize,
    k_end: usize,
) -> Acc<WMT, WNT> {
    let tid = thread_idx_x() as usize;
    let (m, n, k) = (a.m as usize, a.n as usize, a.k as usize);
    let row_bytes = k * 2;
    let x_src = (a.x as *const u8).add(m0 * row_bytes + k_begin * 2);
    let w_src = (a.w as *const u8).add(n0 * row_bytes + k_begin * 2);
    let k_tiles = (k_end - k_begin).div_ceil(BK);

    let ring = Ring::<BM, BN, BK>::in_dynamic_shared();
    let (x_tile, w_tile) = (|s| ring.x(s), |s| ring.w(s));
    // Rows past m/n and 8-element chunks past the slice's end are zero-filled, so
    // they add nothing to the dot products.
    let load_x = |kt: usize, s: usize| {
        let (k0, valid_k) = (kt * BK, k_end - k_begin - kt * BK);
        load_tile_k::<BM, BK, THREADS>(x_tile(s), x_src.add(k0 * 2), row_bytes, m - m0, valid_k, tid);
    };
    let load_w = |kt: usize, s: usize| {
        let (k0, valid_k) = (kt * BK, k_end - k_begin - kt * BK);
        load_tile_k::<BN, BK, THREADS>(w_tile(s), w_src.add(k0 * 2), row_bytes, n - n0, valid_k, tid);
    };
    let load = |kt: usize, s: usize| {
        load_x(kt, s);
        load_w(kt, s);
    };

    fill_ring::<STAGES>(k_tiles, load_w, load_x);

    let mut acc: Acc<WMT, WNT> = [[[0.0; 4]; WNT]; WMT];
    for kt in 0..k_tiles {
        cp_async_wait_n(STAGES - 2);
        sync_threads();
        // The stage refilled here was read in iteration kt-1; the barrier above
        // guarantees every warp is done with it.
        let next = kt + STAGES - 1;
        if next < k_tiles {
            load(next, next % STAGES);
        }
        cp_async_commit();

        mma_k_tile::<BM, BN, WARPS_N, WMT, WNT, BK>(x_tile(kt % STAGES), w_tile(kt % STAGES), &mut acc);
    }
    cp_async_wait::<0>();
    acc
}

/// acc += this warp's share of X·Wᵀ over one staged BK-deep K tile.
#[inline(always)]
pub(crate) unsafe fn mma_k_tile<
    const BM: usize,
    const BN: usize,
    const WARPS_N: usize,
    const WMT: usize,
    const WNT: usize,
    const BK: usize,
>(
    xt: SmemTile<BM, BK>,
    wt: SmemTile<BN, BK>,
    acc: &mut Acc<WMT, WNT>,
) {
    let tid = thread_idx_x() as usize;
    let (warp, lane) = (tid / 32, tid % 32);
    let (wm, wn) = (warp / WARPS_N, warp % WARPS_N);
    for kk in 0..BK / 16 {
        let mut af: [FragA; WMT] = [[0; 4]; WMT];
        for (mt, f) in af.iter_mut().enumerate() {
            *f = ldmatrix_x4(xt.chunk_addr(wm * WMT * 16 + mt * 16 + lane % 16, 2 * kk + lane / 16));
        }
        for np in 0..WNT / 2 {
            let row = wn * WNT * 8 + np * 16 + lane % 8 + 8 * (lane / 16);
            let b = ldmatrix_x4(wt.chunk_addr(row, 2 * kk + (lane / 8) % 2));
            for (mt, f) in af.iter().enumerate() {
                mma_bf16_16816(&mut acc[mt][2 * np], f, b[0], b[1]);
                mma_bf16_16816(&mut acc[mt][2 * np + 1], f, b[2], b[3]);
            }
        }
    }
}

/// Calls `f(row, col, v0, v1)` for each in-bounds pair of this thread's accumulators.
#[inline(always)]
pub(crate) unsafe fn for_each_pair<const WARPS_N: usize, const WMT: usize, const WNT: usize>(
    a: GemmArgs,
    m0: usize,
    n0: usize,
    acc: &Acc<WMT, WNT>,
    mut f: impl FnMut(usize, usize, f32, f32),
) {
    let lane = thread_idx_x() as usize % 32;
    let warp = thread_idx_x() as usize / 32;
    let (wm, wn) = (warp / WARPS_N, warp % WARPS_N);
    let (m, n) = (a.m as usize, a.n as usize);
    for (mt, row_frags) in acc.iter().enumerate() {
        for h in 0..2 {
            let row = m0 + wm * WMT * 16 + mt * 16 + lane / 4 + 8 * h;
            if row >= m {
                continue;
            }
            for (nt, frag) in row_frags.iter().enumerate() {
                let col = n0 + wn * WNT * 8 + nt * 8 + 2 * (lane % 4);
                // n is even (host-checked), so col + 1 < n as well.
                if col < n {
                    f(row, col, frag[2 * h], frag[2 * h + 1]);
                }
            }
        }
    }
}

/// The whole-K tile through the epilogue.
#[inline(always)]
pub(crate) unsafe fn store_tile<const WARPS_N: usize, const WMT: usize, const WNT: usize>(
    a: GemmArgs,
    m0: usize,
    n0: usize,
    acc: &Acc<WMT, WNT>,
) {
    for_each_pair::<WARPS_N, WMT, WNT>(a, m0, n0, acc, |row, col, v0, v1| store_pair(a, row, col, v0, v1));
}

/// A partial (some of K) tile added into the f32 workspace.
#[inline(always)]
pub(crate) unsafe fn add_partial<const WARPS_N: usize, const WMT: usize, const WNT: usize>(
    a: GemmArgs,
    m0: usize,
    n0: usize,
    acc: &Acc<WMT, WNT>,
) {
    let (n, ws) = (a.n as usize, a.workspace as *mut f32);
    for_each_pair::<WARPS_N, WMT, WNT>(a, m0, n0, acc, |row, col, v0, v1| {
        // col is even and n is even: the pair is 8-byte aligned.
        red_add_f32x2(ws.add(row * n + col), v0, v1);
    });
}

/// Loads a ROWS × BK tile whose rows are `row_bytes` apart; rows past `valid_rows`
/// and 8-element chunks past `valid_k` are zero-filled.
#[inline(always)]
pub(crate) unsafe fn load_tile_k<const ROWS: usize, const BK: usize, const THREADS: usize>(
    tile: SmemTile<ROWS, BK>,
    src: *const u8,
    row_bytes: usize,
    valid_rows: usize,
    valid_k: usize,
    tid: usize,
) {
    let chunks = BK / 8;
    const { assert!(ROWS * (BK / 8) % THREADS == 0, "a tile must be a whole number of passes of the block") };
    for i in 0..(ROWS * chunks) / THREADS {
        let id = i * THREADS + tid;
        let (row, chunk) = (id / chunks, id % chunks);
        let ok = row < valid_rows && chunk * 8 < valid_k;
        let p = if ok { src.add(row * row_bytes + chunk * 16) } else { src };
        cp_async_16_zfill(tile.chunk_addr(row, chunk), p, if ok { 16 } else { 0 });
    }
}
