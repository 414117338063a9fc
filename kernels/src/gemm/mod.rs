//! Tensor-core GEMM, Y = X·Wᵀ (both operands K-contiguous), with fused epilogues.
//!
//! The shipped entries are the ones `linear`'s tile choice can launch (host
//! `ops::gemm::plan`); the tile shapes are named in `abi::gemm`, which the host
//! sizes its grids by:
//! - `gemm_bf16_v1` (`PREFILL_128X128`) and its split-K form: prefill off Hopper.
//! - `gemm_bf16_rows64_splitk` (`ROWS_64X128`): 17 to 64 tokens off Hopper.
//! - sm_90a: `gemm_bf16_skinny_k128` and its split-K form (`SKINNY_16X128_K128`)
//!   for 1 to 16 tokens; past that, by the host's cost model, `gemm_bf16_tma_rows64`
//!   ([`tma_rows64`], whole or split K) or `gemm_bf16_tma_persistent`, its
//!   128×128, 128×192 and 128×224 forms (`gemm_bf16_tma_persistent_n128`,
//!   `_n192`, `_n224`) and its walk with the last round's tiles split along K,
//!   `gemm_bf16_tma_split_tail`, also on 128×192 tiles,
//!   `gemm_bf16_tma_split_tail_n192` ([`tma`]).
//! - elsewhere: `gemm_bf16_skinny_splitk` and `gemm_bf16_skinny_streamk`
//!   (`SKINNY_16X128`) for 1 to 16 tokens.
//! - `gemm_finalize`: split-K's second step.
//!
//! The mma.sync kernels ([`mma`]): K tiles stream by cp.async into XOR-swizzled
//! shared tiles while earlier ones feed ldmatrix → mma.sync m16n8k16 into f32
//! registers. The epilogue (plain, residual add or SwiGLU) runs on the
//! accumulators, so gate/up activations never reach HBM. With split-K the blocks
//! add f32 partials into a workspace and `gemm_finalize` applies the epilogue;
//! stream-K blocks finish partial tiles themselves, the last one counted per tile.
//! Other tile shapes and schedules, kept for comparison, are in `dev`.

use crate::gpu::bf16::{f32_to_bf16, pack_bf16x2, unpack_bf16x2};
use crate::gpu::math::{ex2, rcp, LOG2_E};
use crate::gpu::mem::ld_global_cg_f32x2;
use crate::gpu::thread::{
    block_dim_x, block_idx_x, block_idx_y, grid_dim_y, launch_dependents, thread_idx_x, wait_for_prior_grids,
};
use abi::gemm::{self as tiles, MmaTile};
pub use abi::{epilogue, GemmArgs};
use mma::{gemm, SplitK, WholeK};
#[cfg(any(not(target_feature = "sm_90a"), feature = "dev"))]
use stream_k::gemm_stream_k;

/// mma.sync entries, each one named tile shape (`abi::gemm`) under one schedule:
/// `name => kernel(TILE[, K policy]) @ block size;`. The block size is written
/// out for the PTX's launch bound and checked against the tile's.
macro_rules! mma_entries {
    ($($(#[$attr:meta])* $name:ident => $body:ident($tile:path $(, $policy:ty)?) @ $th:literal;)*) => {$(
        $(#[$attr])*
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(args: GemmArgs) {
            const T: MmaTile = $tile;
            const { assert!(T.is_consistent() && T.threads == $th, "tile shape and block size disagree") };
            $body::<
                { T.bm },
                { T.bn },
                { T.warps_n },
                { T.m16_per_warp() },
                { T.n8_per_warp() },
                { T.stages },
                { T.threads },
                { T.bk }
                $(, $policy)?
            >(args)
        }
        $(#[$attr])*
        crate::launch_bounds!($name: GemmArgs, $th);
    )*};
}

pub mod mma;
#[cfg(any(not(target_feature = "sm_90a"), feature = "dev"))]
pub mod stream_k;
#[cfg(target_feature = "sm_90a")]
pub(crate) mod quad_store;
#[cfg(target_feature = "sm_90a")]
pub mod tma;
#[cfg(target_feature = "sm_90a")]
pub mod tma_rows64;
#[cfg(target_feature = "sm_90a")]
pub(crate) mod tma_store;

#[cfg(feature = "dev")]
pub mod dev;

mma_entries! {
    // Prefill off Hopper (dev versions on it).
    #[cfg(any(not(target_feature = "sm_90a"), feature = "dev"))]
    gemm_bf16_v1 => gemm(tiles::PREFILL_128X128, WholeK) @ 128;
    #[cfg(any(not(target_feature = "sm_90a"), feature = "dev"))]
    gemm_bf16_v1_splitk => gemm(tiles::PREFILL_128X128, SplitK) @ 128;
    // 17 to 64 tokens off Hopper (a dev version on it): one 64-row block per
    // weight tile, so W streams from HBM once, not once per 16 rows.
    #[cfg(any(not(target_feature = "sm_90a"), feature = "dev"))]
    gemm_bf16_rows64_splitk => gemm(tiles::ROWS_64X128, SplitK) @ 128;
    // 1 to 16 tokens on Hopper. 128-deep K tiles: each weight row is read 256
    // contiguous bytes at a time instead of 128 (the decode attention's 256-byte
    // rows stream at 4.1–4.3 TB/s, 128-byte ones at 3.8–3.9). Off Hopper, dev
    // versions: 108 KB of stages exceed the 99 KB per block of sm_86/89/120.
    #[cfg(any(target_feature = "sm_90a", feature = "dev"))]
    gemm_bf16_skinny_k128 => gemm(tiles::SKINNY_16X128_K128, WholeK) @ 128;
    #[cfg(any(target_feature = "sm_90a", feature = "dev"))]
    gemm_bf16_skinny_k128_splitk => gemm(tiles::SKINNY_16X128_K128, SplitK) @ 128;
    // 1 to 16 tokens elsewhere (dev versions on Hopper).
    #[cfg(any(not(target_feature = "sm_90a"), feature = "dev"))]
    gemm_bf16_skinny_splitk => gemm(tiles::SKINNY_16X128, SplitK) @ 128;
    #[cfg(any(not(target_feature = "sm_90a"), feature = "dev"))]
    gemm_bf16_skinny_streamk => gemm_stream_k(tiles::SKINNY_16X128) @ 128;
}

#[inline(always)]
pub(crate) fn silu(g: f32) -> f32 {
    g * rcp(1.0 + ex2(-g * LOG2_E))
}

/// SwiGLU's output for one (gate, up) pair, in bf16.
#[inline(always)]
pub(crate) fn swiglu_bf16(gate: f32, up: f32) -> u16 {
    f32_to_bf16(silu(gate) * up)
}

/// A pair of results plus their residual pair `r` (two bf16), packed as bf16.
#[inline(always)]
pub(crate) fn add_residual_bf16x2(v0: f32, v1: f32, r: u32) -> u32 {
    let (r0, r1) = unpack_bf16x2(r);
    pack_bf16x2(r0 + v0, r1 + v1)
}

/// Writes one pair of results (columns col, col+1 of `row`) through the epilogue.
/// Takes the parameter block by value: a reference would force the kernel's
/// parameters into local memory.
#[inline(always)]
pub(crate) unsafe fn store_pair(a: GemmArgs, row: usize, col: usize, v0: f32, v1: f32) {
    store_pair_with(a, row, col, v0, v1, || residual_pair(a, row, col));
}

/// The residual pair (two bf16) at `row`, `col`; only under the residual epilogue.
#[inline(always)]
unsafe fn residual_pair(a: GemmArgs, row: usize, col: usize) -> u32 {
    *((a.residual as *const u8).add((row * a.n as usize + col) * 2) as *const u32)
}

/// [`store_pair`] taking the residual pair from `residual` (called only under
/// the residual epilogue): a caller may load it ahead, with its other loads.
#[inline(always)]
unsafe fn store_pair_with(a: GemmArgs, row: usize, col: usize, v0: f32, v1: f32, residual: impl FnOnce() -> u32) {
    let (n, out) = (a.n as usize, a.out as *mut u8);
    match a.epilogue {
        epilogue::SWIGLU => {
            *(out.add((row * (n / 2) + col / 2) * 2) as *mut u16) = swiglu_bf16(v0, v1);
        }
        epilogue::RESIDUAL => {
            *(out.add((row * n + col) * 2) as *mut u32) = add_residual_bf16x2(v0, v1, residual());
        }
        _ => *(out.add((row * n + col) * 2) as *mut u32) = pack_bf16x2(v0, v1),
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
        // Both loads before any store: the compiler cannot move the residual's
        // load above a store that might alias it, which would cost a second round trip.
        let (v0, v1) = ld_global_cg_f32x2(p);
        let r = if a.epilogue == epilogue::RESIDUAL { residual_pair(a, row, col) } else { 0 };
        // n is even: every pair is 8-byte aligned.
        *(p as *mut u64) = 0;
        store_pair_with(a, row, col, v0, v1, || r);
        row += grid_dim_y() as usize;
    }
}
const _: () = assert!(abi::gemm::FINALIZE_THREADS == 256);
crate::launch_bounds!(gemm_finalize: GemmArgs, 256);
