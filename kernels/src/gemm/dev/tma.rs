//! The Hopper GEMM with one block per output tile (`GemmVersion::Tma`): the
//! shipped kernel's protocol without the persistent walk.

use crate::gemm::tma::{gemm_tma, TileWalk};
use crate::gpu::thread::block_idx_x;
use abi::GemmTmaArgs;

/// Block `b` computes tile `b` only.
pub(crate) struct OneTilePerBlock;

impl TileWalk for OneTilePerBlock {
    #[inline(always)]
    fn walk(_: usize, _: usize) -> (usize, usize, usize) {
        (block_idx_x() as usize, 1, block_idx_x() as usize + 1)
    }
    const MORE_TILES: bool = false;
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma(a: GemmTmaArgs) {
    gemm_tma::<OneTilePerBlock>(a)
}
crate::launch_bounds!(gemm_bf16_tma: GemmTmaArgs, 384, 1);
