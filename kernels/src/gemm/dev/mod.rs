//! GEMM versions kept for comparison (`GemmVersion` on the host's dev API):
//! tile shapes and schedules the shipped tile choice does not take, the
//! split-K forms finished in-kernel (`_fixup`), the pipelined stream-K, the
//! Hopper GEMM with one block per tile or in clusters of two sharing W by
//! multicast, the first `wgmma` experiment and the
//! decode GEMV. The entries shipped on one architecture only (`gemm/mod.rs`)
//! are in the other's dev module too, by their `cfg`.

pub mod gemv;
mod stream_k_pipelined;
#[cfg(target_feature = "sm_90a")]
pub mod tma;
#[cfg(target_feature = "sm_90a")]
pub mod tma_multicast;
#[cfg(target_feature = "sm_90a")]
pub mod wgmma_exp;

use super::mma::{gemm, Acc, KPolicy, SplitK, WholeK};
use super::stream_k::{finish_split_tile, gemm_stream_k};
use super::MmaTile;
use crate::gpu::thread::{block_idx_x, block_idx_y, grid_dim_x, grid_dim_z};
use abi::gemm as tiles;
use abi::GemmArgs;
use stream_k_pipelined::gemm_stream_k_pipelined;

/// [`SplitK`] whose last block per tile applies the epilogue (counted per tile
/// after the workspace's sums): no `gemm_finalize` launch. Measured no faster
/// than split-K with the finalize (docs/PERF.md).
pub(crate) struct SplitKFixup;

impl KPolicy for SplitKFixup {
    #[inline(always)]
    fn k_range(a: GemmArgs, k: usize) -> (usize, usize) {
        SplitK::k_range(a, k)
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
        SplitK::finish::<BM, BN, WARPS_N, WMT, WNT, THREADS>(a, m0, n0, acc);
        let tile = (block_idx_y() * grid_dim_x() + block_idx_x()) as usize;
        finish_split_tile::<BM, BN, THREADS>(a, m0, n0, tile, 1, grid_dim_z());
    }
}

mma_entries! {
    gemm_bf16_v2 => gemm(tiles::PREFILL_128X256, WholeK) @ 256;
    gemm_bf16_rows64 => gemm(tiles::ROWS_64X128, WholeK) @ 128;
    gemm_bf16_skinny => gemm(tiles::SKINNY_16X128, WholeK) @ 128;
    gemm_bf16_skinny_splitk_fixup => gemm(tiles::SKINNY_16X128, SplitKFixup) @ 128;
    gemm_bf16_skinny_streamk_v2 => gemm_stream_k_pipelined(tiles::SKINNY_16X128) @ 128;
    gemm_bf16_skinny64 => gemm(tiles::SKINNY_16X64, WholeK) @ 128;
    gemm_bf16_skinny64_splitk => gemm(tiles::SKINNY_16X64, SplitK) @ 128;
    // Narrower stream-K tiles for decode: a partial tile costs 16×64 or 16×32 f32
    // of reductions instead of 16×128, and more, smaller blocks share each SM.
    gemm_bf16_skinny64_streamk => gemm_stream_k(tiles::SKINNY_16X64) @ 128;
    gemm_bf16_skinny32_streamk => gemm_stream_k(tiles::SKINNY_16X32) @ 64;
    gemm_bf16_skinny_k128_splitk_fixup => gemm(tiles::SKINNY_16X128_K128, SplitKFixup) @ 128;
    gemm_bf16_skinny_k128_streamk => gemm_stream_k(tiles::SKINNY_16X128_K128) @ 128;
}
