//! The Hopper GEMM with one block per output tile (`GemmVersion::Tma`): the
//! shipped kernel's protocol without the persistent walk; and the persistent
//! walk over (tile, K slice) units (`GemmVersion::TmaPersistentSplitK`), for
//! shapes whose 128×256 tiles alone leave SMs idle; and the split
//! tail stamping each block's timeline (`GemmVersion::TmaSplitTailStamped`);
//! the split tail whose last slice in sums the whole tile at every slice
//! count (`GemmVersion::TmaSplitTailWhole`);
//! and the persistent walk storing its tiles by TMA (`GemmVersion::TmaStore`).

use crate::gemm::tma::{gemm_tma, Cols192, Cols256, TileWalk, WideTile};
use crate::gpu::wgmma;
use crate::gpu::thread::block_idx_x;
use abi::GemmTmaArgs;

/// Block `b` computes tile `b` only.
pub(crate) struct OneTilePerBlock;

impl TileWalk for OneTilePerBlock {
    #[inline(always)]
    fn walk(_: usize) -> (usize, usize, usize) {
        (block_idx_x() as usize, 1, block_idx_x() as usize + 1)
    }
    const MORE_TILES: bool = false;
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma(a: GemmTmaArgs) {
    gemm_tma::<OneTilePerBlock, 128, Cols256>(a)
}
crate::launch_bounds!(gemm_bf16_tma: GemmTmaArgs, 384, 1);

/// One block per SM walking (tile, K slice) units; the sums meet in the
/// workspace, finished by `gemm_finalize` or a fused consumer.
pub(crate) struct PersistentSplit;

impl TileWalk for PersistentSplit {
    const MORE_TILES: bool = true;
    const SPLIT: bool = true;
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_persistent_splitk(a: GemmTmaArgs) {
    gemm_tma::<PersistentSplit, 128, Cols256>(a)
}
crate::launch_bounds!(gemm_bf16_tma_persistent_splitk: GemmTmaArgs, 384, 1);

/// The split tail's walk, each block stamping its timeline
/// (`abi::gemm::tma::SPLIT_TAIL_STAMPS`): which blocks of a split tail run
/// long, and whether it is the same SMs every launch. The last slice in sums
/// the whole tile, which its stamps record, and which the two-wave schedule
/// needs (its second wave's blocks start only as the first's end).
pub(crate) struct PersistentSplitTailStamped;

impl TileWalk for PersistentSplitTailStamped {
    const MORE_TILES: bool = true;
    const SPLIT_TAIL: bool = true;
    const STAMPS: bool = true;
    const WHOLE_FINISH: bool = true;
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_split_tail_stamped(a: GemmTmaArgs) {
    gemm_tma::<PersistentSplitTailStamped, 128, Cols256>(a)
}
crate::launch_bounds!(gemm_bf16_tma_split_tail_stamped: GemmTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_split_tail_n192_stamped(a: GemmTmaArgs) {
    gemm_tma::<PersistentSplitTailStamped, 96, Cols192>(a)
}
crate::launch_bounds!(gemm_bf16_tma_split_tail_n192_stamped: GemmTmaArgs, 384, 1);

/// The split tail's walk, the last slice's block in summing the whole tile at
/// every slice count (`GemmVersion::TmaSplitTailWhole`): the shipped fixup
/// before shares, and the one a launch of more blocks than are resident takes.
pub(crate) struct PersistentSplitTailWhole;

impl TileWalk for PersistentSplitTailWhole {
    const MORE_TILES: bool = true;
    const SPLIT_TAIL: bool = true;
    const WHOLE_FINISH: bool = true;
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_split_tail_whole(a: GemmTmaArgs) {
    gemm_tma::<PersistentSplitTailWhole, 128, Cols256>(a)
}
crate::launch_bounds!(gemm_bf16_tma_split_tail_whole: GemmTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_split_tail_n192_whole(a: GemmTmaArgs) {
    gemm_tma::<PersistentSplitTailWhole, 96, Cols192>(a)
}
crate::launch_bounds!(gemm_bf16_tma_split_tail_n192_whole: GemmTmaArgs, 384, 1);

/// The split tail in shares, each slice's block giving up at once where the
/// tile's others are not all in (`GemmVersion::TmaSplitTailGiveUp`): the last
/// one in then claims and sums the shares left. The path a launch takes where
/// some of its blocks are not resident, run on purpose for the tests.
pub(crate) struct PersistentSplitTailGiveUp;

impl TileWalk for PersistentSplitTailGiveUp {
    const MORE_TILES: bool = true;
    const SPLIT_TAIL: bool = true;
    const SHARES_WAIT_NS: u64 = 0;
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_split_tail_give_up(a: GemmTmaArgs) {
    gemm_tma::<PersistentSplitTailGiveUp, 128, Cols256>(a)
}
crate::launch_bounds!(gemm_bf16_tma_split_tail_give_up: GemmTmaArgs, 384, 1);

/// The persistent walk, each consumer warpgroup's outputs stored by TMA from
/// a staging past the ring (`abi::gemm::tma_store`).
pub(crate) struct PersistentTmaStore;

impl TileWalk for PersistentTmaStore {
    const MORE_TILES: bool = true;
    const TMA_STORE: bool = true;
}

/// The shipped 128×256 tile on a ring of three stages, which leaves room for
/// the 64 KiB staging.
pub(crate) struct Cols256Staged;

impl WideTile<128> for Cols256Staged {
    const BN: usize = abi::gemm::tma_store::BN;
    const STAGES: usize = abi::gemm::tma_store::STAGES;
    #[inline(always)]
    fn mma(acc: &mut [f32; 128], desc_a: u64, desc_b: u64, accumulate: bool) {
        wgmma::mma_m64n256k16(acc, desc_a, desc_b, accumulate);
    }
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_store(a: GemmTmaArgs) {
    gemm_tma::<PersistentTmaStore, 128, Cols256Staged>(a)
}
crate::launch_bounds!(gemm_bf16_tma_store: GemmTmaArgs, 384, 1);
