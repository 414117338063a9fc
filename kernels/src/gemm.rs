//! Tensor-core GEMM, Y = X·Wᵀ (both operands K-contiguous), with fused epilogues.
//!
//! One generic kernel, instantiated per tile shape (llm.c-style versions side by side):
//! - `gemm_bf16_v1`: 128×128 block, 4 warps of 64×64, 3-stage ring (prefill).
//! - `gemm_bf16_v2`: 128×256 block, 8 warps of 64×64, 3-stage ring (prefill).
//! - `gemm_bf16_skinny`: 16×128 block, 4 warps of 16×32, 4-stage ring, for decode
//!   (M ≤ 64); `skinny64`: 16×64, 6 stages, twice the blocks and more bytes in
//!   flight. `_splitk` variants split K over `blockIdx.z` so a few tokens, or a
//!   narrow N, still spread over every SM. `rows64`: 64×128 blocks for 17 to 64
//!   tokens (each weight tile read once for all of them).
//!
//! K tiles (64 deep) stream by cp.async into XOR-swizzled shared tiles while
//! earlier ones feed ldmatrix → mma.sync m16n8k16 into f32 registers. The epilogue
//! (plain, residual add or SwiGLU) runs on the accumulators, so gate/up
//! activations never reach HBM. With split-K the blocks add f32 partials into a
//! workspace and `gemm_finalize` applies the epilogue, or (`_fixup`) the last
//! block of each tile does, counted per tile, with no second launch. The Hopper
//! path (TMA + wgmma) is `gemm_tma.rs`.

use crate::gpu::bf16::{f32_to_bf16, pack_bf16x2, unpack_bf16x2};
use crate::gpu::math::{ex2, rcp, LOG2_E};
use crate::gpu::mem::{
    block_completes_count, cp_async_16_zfill, cp_async_commit, cp_async_wait, cp_async_wait_n, ld_global_cg_f32x2,
    red_add_f32x2,
};
use crate::gpu::mma::{ldmatrix_x4, mma_bf16_16816, FragA, FragC};
use crate::gpu::shared::dynamic_shared_base;
use crate::gpu::thread::{
    block_dim_x, block_idx_x, block_idx_y, block_idx_z, grid_dim_x, grid_dim_y, grid_dim_z, launch_dependents, sync_threads,
    thread_idx_x, wait_for_prior_grids,
};
use crate::gpu::tile::SmemTile;
pub use abi::{epilogue, GemmArgs};

/// K elements per staged tile of the prefill and 16-row entries (`k128` entries: 128).
const BK64: usize = 64;

#[inline(always)]
fn silu(g: f32) -> f32 {
    g * rcp(1.0 + ex2(-g * LOG2_E))
}

/// Writes one pair of results (columns col, col+1 of `row`) through the epilogue.
/// Takes the parameter block by value: a reference would force the kernel's
/// parameters into local memory.
#[inline(always)]
pub(crate) unsafe fn store_pair(a: GemmArgs, row: usize, col: usize, v0: f32, v1: f32) {
    let (n, out) = (a.n as usize, a.out as *mut u8);
    match a.epilogue {
        epilogue::SWIGLU => {
            *(out.add((row * (n / 2) + col / 2) * 2) as *mut u16) = f32_to_bf16(silu(v0) * v1);
        }
        epilogue::RESIDUAL => {
            let off = (row * n + col) * 2;
            let (r0, r1) = unpack_bf16x2(*((a.residual as *const u8).add(off) as *const u32));
            *(out.add(off) as *mut u32) = pack_bf16x2(r0 + v0, r1 + v1);
        }
        _ => *(out.add((row * n + col) * 2) as *mut u32) = pack_bf16x2(v0, v1),
    }
}

type Acc<const WMT: usize, const WNT: usize> = [[FragC; WNT]; WMT];

/// The STAGES-deep ring of (X, W) BK-deep K tiles in dynamic shared memory.
#[derive(Clone, Copy)]
struct Ring<const BM: usize, const BN: usize, const BK: usize> {
    base: u32,
}

impl<const BM: usize, const BN: usize, const BK: usize> Ring<BM, BN, BK> {
    const STAGE_BYTES: u32 = SmemTile::<BM, BK>::BYTES + SmemTile::<BN, BK>::BYTES;

    #[inline(always)]
    fn in_dynamic_shared() -> Self {
        Ring { base: dynamic_shared_base() }
    }

    #[inline(always)]
    fn x(self, s: usize) -> SmemTile<BM, BK> {
        unsafe { SmemTile::at(self.base + s as u32 * Self::STAGE_BYTES) }
    }

    #[inline(always)]
    fn w(self, s: usize) -> SmemTile<BN, BK> {
        unsafe { SmemTile::at(self.base + s as u32 * Self::STAGE_BYTES + SmemTile::<BM, BK>::BYTES) }
    }
}

/// Fills the first STAGES − 1 stages of a ring over `count` K tiles, one commit
/// group per stage. The weights go first: they do not depend on earlier kernels,
/// so with a programmatic launch they stream in while the previous kernel
/// finishes; X only once it has. (Group 0 then holds every prologue weight stage:
/// only the first wait is longer.)
#[inline(always)]
unsafe fn fill_ring<const STAGES: usize>(count: usize, load_w: impl Fn(usize, usize), load_x: impl Fn(usize, usize)) {
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

/// Block tile BM × BN from WARPS_M × WARPS_N warps, each WMT m16 tiles × WNT n8 tiles.
#[inline(always)]
unsafe fn gemm<
    const BM: usize,
    const BN: usize,
    const WARPS_N: usize,
    const WMT: usize,
    const WNT: usize,
    const STAGES: usize,
    const THREADS: usize,
    const SPLIT_K: bool,
    const FIXUP: bool,
    const BK: usize,
>(
    a: GemmArgs,
) {
    // The next kernel may start its own prologue as soon as SMs free up.
    launch_dependents();
    let n0 = block_idx_x() as usize * BN;
    let m0 = block_idx_y() as usize * BM;
    let k = a.k as usize;
    let (k_begin, k_end) = if SPLIT_K {
        let split = a.k_split as usize;
        (block_idx_z() as usize * split, k.min((block_idx_z() as usize + 1) * split))
    } else {
        (0, k)
    };
    let acc = mainloop::<BM, BN, WARPS_N, WMT, WNT, STAGES, THREADS, BK>(a, m0, n0, k_begin, k_end);
    if SPLIT_K {
        add_partial::<WARPS_N, WMT, WNT>(a, m0, n0, &acc);
    } else {
        store_tile::<WARPS_N, WMT, WNT>(a, m0, n0, &acc);
    }
    if SPLIT_K && FIXUP {
        let tile = (block_idx_y() * grid_dim_x() + block_idx_x()) as usize;
        finish_split_tile::<BM, BN, THREADS>(a, m0, n0, tile, 1, grid_dim_z());
    }
}

/// The tile's sums over K elements `k_begin..k_end`: K tiles stream by cp.async
/// through a STAGES-deep ring while earlier ones feed ldmatrix → mma.sync.
#[inline(always)]
unsafe fn mainloop<
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
unsafe fn mma_k_tile<
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
unsafe fn for_each_pair<const WARPS_N: usize, const WMT: usize, const WNT: usize>(
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
unsafe fn store_tile<const WARPS_N: usize, const WMT: usize, const WNT: usize>(
    a: GemmArgs,
    m0: usize,
    n0: usize,
    acc: &Acc<WMT, WNT>,
) {
    for_each_pair::<WARPS_N, WMT, WNT>(a, m0, n0, acc, |row, col, v0, v1| store_pair(a, row, col, v0, v1));
}

/// A partial (some of K) tile added into the f32 workspace.
#[inline(always)]
unsafe fn add_partial<const WARPS_N: usize, const WMT: usize, const WNT: usize>(
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

/// One block's contiguous share `begin..end` of a stream-K grid's (tile, K tile)
/// iterations, tile-major over `tiles_n` column tiles of `k_tiles` K tiles each.
struct StreamKShare {
    tiles_n: usize,
    k_tiles: usize,
    begin: usize,
    end: usize,
}

impl StreamKShare {
    #[inline(always)]
    fn of<const BM: usize, const BN: usize, const BK: usize>(a: GemmArgs) -> Self {
        let (tiles_n, k_tiles) = ((a.n as usize).div_ceil(BN), (a.k as usize).div_ceil(BK));
        let total = tiles_n * (a.m as usize).div_ceil(BM) * k_tiles;
        let (b, g) = (block_idx_x() as usize, grid_dim_x() as usize);
        StreamKShare { tiles_n, k_tiles, begin: total * b / g, end: total * (b + 1) / g }
    }
}

/// Stream-K over 1-D grids of resident blocks (decode): the (tile, K tile)
/// iterations, tile-major, are cut into one equal contiguous range per block, so
/// every block streams the same number of weight bytes whatever the tile count —
/// no second, mostly idle wave. A block whose range covers a whole tile stores
/// it; partial tiles meet in the workspace and the last contributor, counted in
/// K tiles, applies the epilogue.
#[inline(always)]
unsafe fn gemm_stream_k<
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

/// Stream-K as [`gemm_stream_k`], with one cp.async ring over the block's whole
/// range of (tile, K tile) iterations: the next tile's first stages are already
/// loading while this tile's partial sums go to the workspace and its counter is
/// taken, so the weight stream does not drain at every tile boundary (it did:
/// 16-row partials at 16 tokens cost more than the GEMV's bytes would).
#[inline(always)]
unsafe fn gemm_stream_k_pipelined<
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
    let tid = thread_idx_x() as usize;
    let (m, n, k) = (a.m as usize, a.n as usize, a.k as usize);
    let StreamKShare { tiles_n, k_tiles, begin, end } = StreamKShare::of::<BM, BN, BK>(a);
    let iters = end - begin;
    let row_bytes = k * 2;
    let origin = |it: usize| {
        let tile = it / k_tiles;
        (tile, tile / tiles_n * BM, tile % tiles_n * BN, it % k_tiles)
    };

    let ring = Ring::<BM, BN, BK>::in_dynamic_shared();
    let (x_tile, w_tile) = (|s| ring.x(s), |s| ring.w(s));
    let load_x = |i: usize, s: usize| {
        let (_, m0, _, kt) = origin(begin + i);
        let src = (a.x as *const u8).add(m0 * row_bytes + kt * BK * 2);
        load_tile_k::<BM, BK, THREADS>(x_tile(s), src, row_bytes, m - m0, k - kt * BK, tid);
    };
    let load_w = |i: usize, s: usize| {
        let (_, _, n0, kt) = origin(begin + i);
        let src = (a.w as *const u8).add(n0 * row_bytes + kt * BK * 2);
        load_tile_k::<BN, BK, THREADS>(w_tile(s), src, row_bytes, n - n0, k - kt * BK, tid);
    };

    fill_ring::<STAGES>(iters, load_w, load_x);

    let mut acc: Acc<WMT, WNT> = [[[0.0; 4]; WNT]; WMT];
    let mut seg_kt0 = origin(begin).3;
    for i in 0..iters {
        cp_async_wait_n(STAGES - 2);
        sync_threads();
        let next = i + STAGES - 1;
        if next < iters {
            load_x(next, next % STAGES);
            load_w(next, next % STAGES);
        }
        cp_async_commit();
        mma_k_tile::<BM, BN, WARPS_N, WMT, WNT, BK>(x_tile(i % STAGES), w_tile(i % STAGES), &mut acc);

        let (tile, m0, n0, kt) = origin(begin + i);
        if kt + 1 == k_tiles || i + 1 == iters {
            // The segment of this tile ends here; later stages keep loading.
            if seg_kt0 == 0 && kt + 1 == k_tiles {
                store_tile::<WARPS_N, WMT, WNT>(a, m0, n0, &acc);
            } else {
                add_partial::<WARPS_N, WMT, WNT>(a, m0, n0, &acc);
                finish_split_tile::<BM, BN, THREADS>(a, m0, n0, tile, (kt + 1 - seg_kt0) as u32, k_tiles as u32);
            }
            acc = [[[0.0; 4]; WNT]; WMT];
            seg_kt0 = 0;
        }
    }
    cp_async_wait::<0>();
}

/// Split-K without a second launch: each block adds its share (`part` of the
/// tile's `whole`, counted per tile in the u32s after the f32 workspace); the one
/// that completes the count applies the epilogue to the tile's sums and zeroes
/// them and the counter for the next GEMM.
#[inline(always)]
unsafe fn finish_split_tile<const BM: usize, const BN: usize, const THREADS: usize>(
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

/// Split-K second step: out = epilogue(workspace), one thread per pair of
/// columns; the workspace is zeroed behind the read, ready for the next GEMM.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_finalize(a: GemmArgs) {
    launch_dependents();
    // Launched to overlap the split kernel it finishes: nothing is read before it ends.
    wait_for_prior_grids();
    // A pair of columns per thread along x, rows along y (stride: the grid's rows):
    // no 64-bit division per pair, one 8-byte load and one 8-byte store of zeros.
    let (m, n) = (a.m as usize, a.n as usize);
    let col = 2 * (block_idx_x() * block_dim_x() + thread_idx_x()) as usize;
    if col >= n {
        return;
    }
    let ws = a.workspace as *mut f32;
    let mut row = block_idx_y() as usize;
    while row < m {
        let p = ws.add(row * n + col);
        let (v0, v1) = ld_global_cg_f32x2(p);
        // n is even: every pair is 8-byte aligned.
        *(p as *mut u64) = 0;
        store_pair(a, row, col, v0, v1);
        row += grid_dim_y() as usize;
    }
}
crate::launch_bounds!(gemm_finalize: GemmArgs, 256);

/// The number after `@` is the entry's block size; the host's table must agree.
macro_rules! entries {
    ($($name:ident => $body:ident::<$($param:tt),*> @ $th:literal;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(args: GemmArgs) {
            $body::<$($param),*>(args)
        }
        crate::launch_bounds!($name: GemmArgs, $th);
    )*};
}

// gemm: <BM, BN, WARPS_N, WMT, WNT, STAGES, THREADS, SPLIT_K, FIXUP, BK>;
// the stream-K forms: <BM, BN, WARPS_N, WMT, WNT, STAGES, THREADS, BK>.
entries! {
    gemm_bf16_v1 => gemm::<128, 128, 2, 4, 8, 3, 128, false, false, BK64> @ 128;
    gemm_bf16_v2 => gemm::<128, 256, 4, 4, 8, 3, 256, false, false, BK64> @ 256;
    gemm_bf16_v1_splitk => gemm::<128, 128, 2, 4, 8, 3, 128, true, false, BK64> @ 128;
    gemm_bf16_skinny => gemm::<16, 128, 4, 1, 4, 4, 128, false, false, BK64> @ 128;
    gemm_bf16_skinny_splitk => gemm::<16, 128, 4, 1, 4, 4, 128, true, false, BK64> @ 128;
    gemm_bf16_skinny_splitk_fixup => gemm::<16, 128, 4, 1, 4, 4, 128, true, true, BK64> @ 128;
    gemm_bf16_skinny64 => gemm::<16, 64, 4, 1, 2, 6, 128, false, false, BK64> @ 128;
    gemm_bf16_skinny64_splitk => gemm::<16, 64, 4, 1, 2, 6, 128, true, false, BK64> @ 128;
    // 17 to 64 tokens: one 64-row block per weight tile, so W streams from HBM
    // once, not once per 16 rows (decode at batch 64 read it four times).
    gemm_bf16_rows64 => gemm::<64, 128, 4, 4, 4, 4, 128, false, false, BK64> @ 128;
    gemm_bf16_rows64_splitk => gemm::<64, 128, 4, 4, 4, 4, 128, true, false, BK64> @ 128;
    gemm_bf16_skinny_streamk => gemm_stream_k::<16, 128, 4, 1, 4, 4, 128, BK64> @ 128;
    // Narrower stream-K tiles for decode: a partial tile costs 16×64 or 16×32 f32
    // of reductions instead of 16×128, and more, smaller blocks share each SM.
    gemm_bf16_skinny64_streamk => gemm_stream_k::<16, 64, 4, 1, 2, 6, 128, BK64> @ 128;
    gemm_bf16_skinny32_streamk => gemm_stream_k::<16, 32, 2, 1, 2, 8, 64, BK64> @ 64;
    gemm_bf16_skinny_streamk_v2 => gemm_stream_k_pipelined::<16, 128, 4, 1, 4, 4, 128, BK64> @ 128;
    // 128-deep K tiles: each weight row is read 256 contiguous bytes at a time
    // instead of 128 (the decode attention's 256-byte rows stream at 4.1–4.3 TB/s,
    // these GEMMs' 128-byte ones at 3.8–3.9). Three stages (108 KB): two blocks per SM.
    gemm_bf16_skinny_k128 => gemm::<16, 128, 4, 1, 4, 3, 128, false, false, 128> @ 128;
    gemm_bf16_skinny_k128_splitk => gemm::<16, 128, 4, 1, 4, 3, 128, true, false, 128> @ 128;
    gemm_bf16_skinny_k128_splitk_fixup => gemm::<16, 128, 4, 1, 4, 3, 128, true, true, 128> @ 128;
    gemm_bf16_skinny_k128_streamk => gemm_stream_k::<16, 128, 4, 1, 4, 3, 128, 128> @ 128;
}
