//! The GEMM versions kept for comparison (llm.c style, side by side): every
//! compiled tile configuration by name, for tests and benchmarks.

use super::plan::{
    check, size, whole_k_if_filled, Entry, GemmPlan, Schedule, Tiles, ROWS64_SPLIT, SKINNY_K128, SKINNY_K128_SPLIT,
    SKINNY_SPLIT, SKINNY_STREAMK, TMA_PERSISTENT, TMA_PERSISTENT_N128, TMA_PERSISTENT_N192, TMA_PERSISTENT_N224,
    TMA_ROWS64, TMA_ROWS64_SPLIT, TMA_SPLIT_TAIL, TMA_SPLIT_TAIL_N192, V1_SPLIT,
};
use super::{auto_tiles, run, Epilogue, Overlap};
use crate::error::{Error, Result};
use crate::kernels::dev as k;
use crate::runtime::{Arch, Gpu};
use crate::tensor::Tensor;
use abi::gemm as shapes;
use half::bf16;

/// Kernel versions, side by side; `Auto` is the shipped choice per shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmVersion {
    Auto,
    /// 128×128 tiles, 4 warps.
    V1,
    /// 128×256 tiles, 8 warps.
    V2,
    /// 16×128 tiles for a few tokens, no split.
    Skinny,
    /// 16×128 tiles with split-K over the SMs, then `gemm_finalize`.
    SkinnySplitK,
    /// 16×64 tiles, 6-stage ring.
    Skinny64,
    /// 16×64 tiles with split-K.
    Skinny64SplitK,
    /// 128×128 tiles with split-K (few column blocks, long K).
    V1SplitK,
    /// sm_90a only, superseded by `Tma`: 64×128 tiles on `wgmma`, one warpgroup
    /// loading its own tiles by cp.async.
    WgmmaExperimental,
    /// sm_90a only: 128×256 tiles, TMA producer warpgroup, two `wgmma` consumers.
    Tma,
    /// `Tma` with one block per SM looping over tiles (the next tile loads during
    /// this one's epilogue).
    TmaPersistent,
    /// `SkinnySplitK` whose last split block per tile applies the epilogue: no
    /// finalize launch. Measured no faster than `SkinnySplitK` (docs/PERF.md).
    SkinnySplitKFixup,
    /// 16×128 tiles, stream-K: a 1-D grid of resident blocks, each taking an
    /// equal contiguous share of the (tile, K tile) iterations; partial tiles
    /// meet in the workspace, finished in-kernel.
    SkinnyStreamK,
    /// `SkinnyStreamK` with one cp.async ring over the block's whole range: the
    /// next tile's stages load while a finished tile's partials are written.
    SkinnyStreamKPipelined,
    /// Stream-K on 16×64 tiles (half the partial sums per tile boundary of
    /// 16×128), 6 stages, three blocks per SM.
    Skinny64StreamK,
    /// Stream-K on 16×32 tiles, two warps per block, 8 stages, four blocks per SM.
    Skinny32StreamK,
    /// 64×128 tiles (4 warps of 64×32), 4 stages, for 17 to 64 tokens: the
    /// weights stream once for all rows.
    Rows64,
    /// `Rows64` with split-K, then `gemm_finalize`.
    Rows64SplitK,
    /// 16×128 split-K tiles 128 deep in K: each weight row streams 256 contiguous
    /// bytes per stage (3 stages, two blocks per SM).
    SkinnyK128SplitK,
    /// Stream-K on the 128-deep 16×128 tiles.
    SkinnyK128StreamK,
    /// The 128-deep 16×128 tiles without a split: no workspace, no finalize.
    SkinnyK128,
    /// `SkinnyK128` where the tiles alone fill at least 80% of one wave of
    /// resident blocks (decode gate/up: 224 tiles for 264 slots), else
    /// `SkinnyK128SplitK` (down, QKV, O): the gate/up finalize and its partial
    /// sums go. Auto at 1–16 tokens on sm_90a (H200 MLP t16 0.0934 ms against
    /// 0.1014 split everywhere).
    SkinnyK128Fill,
    /// `SkinnyK128SplitK` finished by each tile's last block (no finalize launch).
    /// MLP t16 0.1091 ms against 0.1014 with `gemm_finalize`.
    SkinnyK128SplitKFixup,
    /// `SkinnyK128Fill` with `SkinnyK128SplitKFixup` where it splits: no finalize
    /// launch at all in the decode MLP. MLP t16 0.0961 ms against `SkinnyK128Fill`'s
    /// 0.0934; t1 equal: the down GEMM's fixup is the slower end.
    SkinnyK128FillFixup,
    /// sm_90a only: 64×128 tiles for 17 to 64 tokens, one `wgmma` warpgroup fed
    /// by a TMA producer warp, two blocks per SM, whole K.
    TmaRows64,
    /// `TmaRows64` with split-K, then `gemm_finalize`.
    TmaRows64SplitK,
    /// sm_90a only: `TmaPersistent` over (tile, K slice) units, enough to give
    /// every SM one, then `gemm_finalize`: for shapes whose 128×256 tiles alone
    /// leave SMs idle (M = 512, N = 4096: 64 tiles).
    TmaPersistentSplitK,
    /// sm_90a only: the persistent TMA kernel on 128×128 tiles (each consumer
    /// 64 × 128, a 6-stage ring): twice the tiles of `TmaPersistent`, for
    /// serving sizes whose 128×256 tiles leave SMs idle (M = 512, O: 64 tiles).
    TmaPersistentN128,
    /// sm_90a only: `TmaPersistent`'s walk over 128×256 tiles, with the last
    /// partial round's tiles each cut along K into equal slices, one a block,
    /// so no SM idles there. A slice's block stores its accumulators in its
    /// slot of the split tail's scratch (plain stores, no atomic adds); the
    /// last, counted per consumer warp, adds the others into its registers,
    /// or from 4 slices every slice's block, once all are in, sums a share.
    TmaSplitTail,
    /// sm_90a only: the persistent TMA kernel on 128×192 tiles (each consumer
    /// 64 × 192, a 5-stage ring): N = 6144 is 32 column tiles, so M = 512
    /// makes 128 tiles for 132 SMs where 128×256 makes 96.
    TmaPersistentN192,
    /// sm_90a only: the persistent TMA kernel on 128×224 tiles (each consumer
    /// 64 × 224, a 5-stage ring): N = 28672 (gate/up) is 128 column tiles, so
    /// M = 128 fills 128 of 132 SMs where 128×256 tiles fill 112.
    TmaPersistentN224,
    /// `TmaSplitTail`'s walk on `TmaPersistentN192`'s 128×192 tiles.
    TmaSplitTailN192,
    /// `TmaSplitTailN192` on twice as many blocks as SMs: each tail tile in
    /// twice the K slices, the second wave's taken by SMs as they free up, so
    /// SMs that stream at different rates even out (a static slice a block
    /// spread the MLP t128 down projection's SMs from −18% to +24%). The last
    /// slice in sums the whole tile (`TmaSplitTailN192Whole`'s kernel): shares
    /// would wait for blocks of the second wave that start only as others end.
    TmaSplitTailN192Waves,
    /// `TmaSplitTail` whose last slice in sums the whole tile at every slice
    /// count, where the shipped one sums it in shares from 4 slices.
    TmaSplitTailWhole,
    /// `TmaSplitTailWhole` on `TmaPersistentN192`'s 128×192 tiles.
    TmaSplitTailN192Whole,
    /// `TmaSplitTail` whose slices' blocks, summing in shares, give up waiting
    /// for the tile's others at once: the last one in sums what they left, the
    /// path of a launch whose blocks are not all resident.
    TmaSplitTailGiveUp,
    /// `TmaSplitTail` with each block stamping its timeline into the scratch
    /// ([`split_tail_stamps`]): where a split tail's time goes, block by block.
    TmaSplitTailStamped,
    /// `TmaSplitTailN192`, stamped.
    TmaSplitTailN192Stamped,
    /// `TmaSplitTailN192Waves`, stamped.
    TmaSplitTailN192WavesStamped,
    /// sm_90a only: `TmaPersistent`'s tiles in clusters of two blocks on
    /// vertically adjacent tiles, each loading half of their W box into both
    /// (TMA multicast): L2 feeds a third fewer bytes a K tile.
    TmaMulticast,
    /// `TmaRows64` where its tiles fill 80% of a wave, else `TmaRows64SplitK`:
    /// Auto at 17–64 tokens on sm_90a.
    TmaRows64Fill,
    /// sm_90a only: `TmaPersistent` on a ring of three stages, each consumer
    /// warpgroup packing its 64 × 256 outputs into shared memory by
    /// `stmatrix` and its first thread storing them by TMA, a 64-column box at
    /// a time, while the warpgroup starts its next tile; the residual comes
    /// into the staging by TMA before the main loop ends.
    TmaStore,
    /// Decode GEMV-style kernel: 16 columns per block over the whole K, split over
    /// its 8 warps and summed in shared memory; weights straight to registers, no
    /// workspace or partial sums.
    Gemv,
}

const V2: Tiles = Tiles::mma(k::GEMM_BF16_V2, shapes::PREFILL_128X256, Schedule::Tiles, 3);
const ROWS64: Tiles = Tiles::mma(k::GEMM_BF16_ROWS64, shapes::ROWS_64X128, Schedule::Tiles, 2);
const SKINNY: Tiles = Tiles::mma(k::GEMM_BF16_SKINNY, shapes::SKINNY_16X128, Schedule::Tiles, 3);
const SKINNY_SPLIT_FIXUP: Tiles =
    Tiles::mma(k::GEMM_BF16_SKINNY_SPLITK_FIXUP, shapes::SKINNY_16X128, Schedule::SplitKFixup, 3);
const SKINNY_STREAMK_PIPELINED: Tiles =
    Tiles::mma(k::GEMM_BF16_SKINNY_STREAMK_V2, shapes::SKINNY_16X128, Schedule::StreamK, 3);
const SKINNY64: Tiles = Tiles::mma(k::GEMM_BF16_SKINNY64, shapes::SKINNY_16X64, Schedule::Tiles, 3);
const SKINNY64_SPLIT: Tiles = Tiles::mma(k::GEMM_BF16_SKINNY64_SPLITK, shapes::SKINNY_16X64, Schedule::SplitK, 3);
/// 61 KB: three blocks per SM.
const SKINNY64_STREAMK: Tiles = Tiles::mma(k::GEMM_BF16_SKINNY64_STREAMK, shapes::SKINNY_16X64, Schedule::StreamK, 3);
/// 48 KB: four blocks per SM.
const SKINNY32_STREAMK: Tiles = Tiles::mma(k::GEMM_BF16_SKINNY32_STREAMK, shapes::SKINNY_16X32, Schedule::StreamK, 4);
const SKINNY_K128_SPLIT_FIXUP: Tiles =
    Tiles::mma(k::GEMM_BF16_SKINNY_K128_SPLITK_FIXUP, shapes::SKINNY_16X128_K128, Schedule::SplitKFixup, 2);
const SKINNY_K128_STREAMK: Tiles =
    Tiles::mma(k::GEMM_BF16_SKINNY_K128_STREAMK, shapes::SKINNY_16X128_K128, Schedule::StreamK, 2);
/// 16 columns of 16 rows per block over the whole of K; its warps' sums meet in
/// shared memory.
const GEMV: Tiles = Tiles {
    entry: Entry::Mma(k::GEMV_BF16_N16),
    bm: shapes::gemv::ROWS,
    bn: shapes::gemv::COLS,
    bk: shapes::gemv::K_CHUNK,
    threads: shapes::gemv::THREADS as u32,
    smem: shapes::gemv::SMEM_BYTES,
    schedule: Schedule::Tiles,
    resident_per_sm: 3,
    waits: true,
    stores_by_tma: false,
};
/// sm_90a only. It has no wait for the previous kernel: plain stream order.
const WGMMA_EXP: Tiles = Tiles {
    entry: Entry::Mma(k::GEMM_BF16_WGMMA_EXP),
    bm: shapes::wgmma_exp::BM,
    bn: shapes::wgmma_exp::BN,
    bk: shapes::wgmma_exp::BK,
    threads: shapes::wgmma_exp::THREADS as u32,
    smem: shapes::wgmma_exp::SMEM_BYTES,
    schedule: Schedule::Tiles,
    resident_per_sm: 1,
    waits: false,
    stores_by_tma: false,
};
/// sm_90a only: [`TMA_PERSISTENT`]'s kernel with one block per tile.
const TMA: Tiles = Tiles { entry: Entry::Tma(k::GEMM_BF16_TMA), schedule: Schedule::TmaTiles, ..TMA_PERSISTENT };
/// The split tails, each block stamping its timeline.
const TMA_SPLIT_TAIL_STAMPED: Tiles =
    Tiles { entry: Entry::Tma(k::GEMM_BF16_TMA_SPLIT_TAIL_STAMPED), ..TMA_SPLIT_TAIL };
const TMA_SPLIT_TAIL_N192_STAMPED: Tiles =
    Tiles { entry: Entry::Tma(k::GEMM_BF16_TMA_SPLIT_TAIL_N192_STAMPED), ..TMA_SPLIT_TAIL_N192 };
/// The 128×192 split tail whose last slice in sums the whole tile.
const TMA_SPLIT_TAIL_N192_WHOLE: Tiles =
    Tiles { entry: Entry::Tma(k::GEMM_BF16_TMA_SPLIT_TAIL_N192_WHOLE), ..TMA_SPLIT_TAIL_N192 };
/// [`TMA_PERSISTENT`]'s tiles in clusters of two sharing each W box by multicast.
const TMA_MULTICAST: Tiles =
    Tiles { entry: Entry::Tma(k::GEMM_BF16_TMA_MULTICAST), schedule: Schedule::TmaMulticast, ..TMA_PERSISTENT };
/// sm_90a only: [`TMA_PERSISTENT`]'s walk on a ring of three stages, each
/// consumer warpgroup's outputs staged in shared memory and stored by TMA.
const TMA_STORE: Tiles = Tiles {
    entry: Entry::Tma(k::GEMM_BF16_TMA_STORE),
    smem: shapes::tma_store::SMEM_BYTES,
    stores_by_tma: true,
    ..TMA_PERSISTENT
};
/// sm_90a only: [`TMA_PERSISTENT`]'s walk over (tile, K slice) units.
pub(crate) const TMA_PERSISTENT_SPLIT: Tiles = Tiles {
    entry: Entry::Tma(k::GEMM_BF16_TMA_PERSISTENT_SPLITK),
    schedule: Schedule::TmaPersistentSplit,
    ..TMA_PERSISTENT
};

/// The tiles of `version` for an `[m, k] × [n, k]` GEMM.
fn tiles_of(version: GemmVersion, m: usize, n: usize, k: usize, sm_count: usize, arch: Arch) -> Result<Tiles> {
    use GemmVersion::*;
    Ok(match version {
        Auto => auto_tiles(m, n, k, sm_count, arch),
        V1 => super::plan::V1,
        V2 => self::V2,
        Skinny => SKINNY,
        SkinnySplitK => SKINNY_SPLIT,
        SkinnySplitKFixup => SKINNY_SPLIT_FIXUP,
        SkinnyStreamK => SKINNY_STREAMK,
        SkinnyStreamKPipelined => SKINNY_STREAMK_PIPELINED,
        Skinny64StreamK => SKINNY64_STREAMK,
        Skinny32StreamK => SKINNY32_STREAMK,
        Gemv => GEMV,
        SkinnyK128SplitK => SKINNY_K128_SPLIT,
        SkinnyK128StreamK => SKINNY_K128_STREAMK,
        SkinnyK128 => SKINNY_K128,
        SkinnyK128SplitKFixup => SKINNY_K128_SPLIT_FIXUP,
        SkinnyK128Fill => whole_k_if_filled(m, n, sm_count, SKINNY_K128, SKINNY_K128_SPLIT),
        SkinnyK128FillFixup => whole_k_if_filled(m, n, sm_count, SKINNY_K128, SKINNY_K128_SPLIT_FIXUP),
        Rows64 => ROWS64,
        Rows64SplitK => ROWS64_SPLIT,
        Skinny64 => SKINNY64,
        Skinny64SplitK => SKINNY64_SPLIT,
        V1SplitK => V1_SPLIT,
        WgmmaExperimental
        | Tma
        | TmaPersistent
        | TmaPersistentSplitK
        | TmaSplitTail
        | TmaPersistentN128
        | TmaPersistentN192
        | TmaPersistentN224
        | TmaSplitTailN192
        | TmaSplitTailStamped
        | TmaSplitTailN192Stamped
        | TmaSplitTailN192Waves
        | TmaSplitTailN192WavesStamped
        | TmaSplitTailWhole
        | TmaSplitTailN192Whole
        | TmaSplitTailGiveUp
        | TmaMulticast
        | TmaRows64
        | TmaRows64SplitK
        | TmaRows64Fill
        | TmaStore
            if arch != Arch::Sm90a =>
        {
            return Err(Error::InvalidArgument(format!("linear: {version:?} runs on sm_90a (H100/H200) only")))
        }
        WgmmaExperimental => WGMMA_EXP,
        Tma => self::TMA,
        TmaPersistent => TMA_PERSISTENT,
        TmaPersistentSplitK => TMA_PERSISTENT_SPLIT,
        TmaSplitTail => TMA_SPLIT_TAIL,
        TmaPersistentN192 => TMA_PERSISTENT_N192,
        TmaPersistentN224 => TMA_PERSISTENT_N224,
        TmaSplitTailN192 => TMA_SPLIT_TAIL_N192,
        TmaSplitTailStamped => TMA_SPLIT_TAIL_STAMPED,
        TmaSplitTailN192Stamped => TMA_SPLIT_TAIL_N192_STAMPED,
        TmaSplitTailN192Waves => Tiles { schedule: Schedule::TmaSplitTailWaves, ..TMA_SPLIT_TAIL_N192_WHOLE },
        TmaSplitTailN192WavesStamped => Tiles { schedule: Schedule::TmaSplitTailWaves, ..TMA_SPLIT_TAIL_N192_STAMPED },
        TmaSplitTailWhole => Tiles { entry: Entry::Tma(k::GEMM_BF16_TMA_SPLIT_TAIL_WHOLE), ..TMA_SPLIT_TAIL },
        TmaSplitTailN192Whole => TMA_SPLIT_TAIL_N192_WHOLE,
        TmaSplitTailGiveUp => Tiles { entry: Entry::Tma(k::GEMM_BF16_TMA_SPLIT_TAIL_GIVE_UP), ..TMA_SPLIT_TAIL },
        TmaMulticast => TMA_MULTICAST,
        TmaPersistentN128 => TMA_PERSISTENT_N128,
        TmaRows64 => TMA_ROWS64,
        TmaRows64SplitK => TMA_ROWS64_SPLIT,
        TmaRows64Fill => whole_k_if_filled(m, n, sm_count, TMA_ROWS64, TMA_ROWS64_SPLIT),
        TmaStore => TMA_STORE,
    })
}

/// [`plan`](super::plan) with an explicit kernel version. Pure: no GPU needed.
#[allow(clippy::too_many_arguments)]
pub fn plan_with(
    x: &[usize],
    w: &[usize],
    out: &[usize],
    residual: Option<&[usize]>,
    ep: Epilogue,
    version: GemmVersion,
    sm_count: usize,
    arch: Arch,
) -> Result<GemmPlan> {
    let (m, n, k) = check(x, w, out, residual, ep)?;
    let tiles = tiles_of(version, m, n, k, sm_count, arch)?;
    // The output's (and the residual's) maps need 16-byte rows.
    let out_cols = if ep == Epilogue::SwiGlu { n / 2 } else { n };
    if tiles.stores_by_tma && (!out_cols.is_multiple_of(8) || !n.is_multiple_of(8)) {
        return Err(Error::Alignment(format!(
            "linear: {version:?} stores rows of a multiple of 8 outputs, not {out_cols}"
        )));
    }
    size(tiles, ep, m, n, k, sm_count)
}

/// Any epilogue with an explicit kernel version (for benchmarks and tests).
pub fn linear_with(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    residual: Option<&Tensor<bf16>>,
    out: &mut Tensor<bf16>,
    ep: Epilogue,
    version: GemmVersion,
) -> Result<()> {
    // SAFETY: no overlap, plain stream order.
    unsafe { linear_ex_with(gpu, x, w, residual, out, ep, version, Overlap::None) }
}

/// [`linear_with`] with a choice of [`Overlap`] with the previous kernel.
///
/// # Safety
/// As [`linear_ex`](super::linear_ex).
#[allow(clippy::too_many_arguments)]
pub unsafe fn linear_ex_with(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    residual: Option<&Tensor<bf16>>,
    out: &mut Tensor<bf16>,
    ep: Epilogue,
    version: GemmVersion,
    overlap: Overlap,
) -> Result<()> {
    run(gpu, plan_on(gpu, x, w, residual, out, ep, version)?, x, w, residual, out, overlap)
}

/// [`plan_with`] for these tensors on `gpu`.
fn plan_on(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    residual: Option<&Tensor<bf16>>,
    out: &Tensor<bf16>,
    ep: Epilogue,
    version: GemmVersion,
) -> Result<GemmPlan> {
    let (sm_count, arch) = (gpu.info().sm_count as usize, gpu.info().arch);
    plan_with(x.shape(), w.shape(), out.shape(), residual.map(|r| r.shape()), ep, version, sm_count, arch)
}

/// One block's timeline in a stamped split-tail launch, as its first consumer
/// warp (warp 0 of consumer 0) saw it: `%globaltimer` nanoseconds at the
/// consumers' start, at its first stage's arrival, at its last unit's
/// main-loop end and after that unit's store (or hand-over). A split tile's
/// sums are counted per consumer warp, so its other warps may be summed in
/// another block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockStamps {
    pub block: usize,
    pub sm: u32,
    pub start: u64,
    pub first_data: u64,
    pub loop_end: u64,
    pub done: u64,
    /// Units (whole tiles or K slices) the block computed.
    pub units: u64,
    /// Whether the stamping warp's last unit was the last of its split tile's
    /// slices to finish, and summed the others' slots.
    pub summed: bool,
}

/// Runs `x · wᵀ` (epilogue `ep`) on a stamped split tail (`version`: one of
/// the `…Stamped` versions) and returns every block's timeline, after waiting
/// for the launch.
pub fn split_tail_stamps(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    residual: Option<&Tensor<bf16>>,
    out: &mut Tensor<bf16>,
    ep: Epilogue,
    version: GemmVersion,
) -> Result<Vec<BlockStamps>> {
    use GemmVersion::{TmaSplitTailN192Stamped, TmaSplitTailN192WavesStamped, TmaSplitTailStamped};
    if !matches!(version, TmaSplitTailStamped | TmaSplitTailN192Stamped | TmaSplitTailN192WavesStamped) {
        return Err(Error::InvalidArgument(format!("split_tail_stamps: {version:?} stamps nothing")));
    }
    let p = plan_on(gpu, x, w, residual, out, ep, version)?;
    let blocks = p.grid.0 as usize;
    // The scratch the launch takes (grow-only: the same buffer then), its
    // stamps cleared first on the stream, so a block without a unit reads 0.
    let scratch = gpu.split_tail_scratch(p.split_tail_scratch_len())?;
    let at = scratch + 4 * shapes::tma::split_tail_stamps_at(blocks) as u64;
    let mut words = vec![0u64; blocks * shapes::tma::SPLIT_TAIL_STAMPS];
    // SAFETY: the stamps lie inside the scratch (`split_tail_scratch_len`).
    let status = unsafe { cust::sys::cuMemsetD32Async(at, 0, 2 * words.len(), gpu.stream().as_inner()) };
    crate::error::check("cuMemsetD32Async", status)?;
    // SAFETY: no overlap, plain stream order.
    unsafe { run(gpu, p, x, w, residual, out, Overlap::None)? };
    gpu.synchronize()?;
    // SAFETY: the scratch holds `blocks` stamp records past its slots
    // (`split_tail_scratch_len`), and the launch has finished.
    let status =
        unsafe { cust::sys::cuMemcpyDtoH_v2(words.as_mut_ptr().cast(), at, std::mem::size_of_val(&words[..])) };
    crate::error::check("cuMemcpyDtoH", status)?;
    Ok(words
        .chunks_exact(shapes::tma::SPLIT_TAIL_STAMPS)
        .enumerate()
        .map(|(block, w)| BlockStamps {
            block,
            sm: w[0] as u32,
            start: w[1],
            first_data: w[2],
            loop_end: w[3],
            done: w[4],
            units: w[5],
            summed: w[6] != 0,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(m: usize, n: usize, k: usize, v: GemmVersion, arch: Arch) -> Result<GemmPlan> {
        plan_with(&[m, k], &[n, k], &[m, n], None, Epilogue::Plain, v, 132, arch)
    }

    #[test]
    fn auto_is_the_shipped_plan() {
        for arch in [Arch::Sm80, Arch::Sm90a] {
            for (m, n, k) in
                [(1, 28672, 4096), (1, 4096, 14336), (16, 6144, 4096), (64, 4096, 14336), (2049, 28672, 4096)]
            {
                let shipped = super::super::plan(&[m, k], &[n, k], &[m, n], None, Epilogue::Plain, 132, arch).unwrap();
                assert_eq!(at(m, n, k, GemmVersion::Auto, arch).unwrap(), shipped);
            }
        }
    }

    #[test]
    fn the_tma_store_walks_as_the_persistent_kernel_with_its_staging_and_16_byte_rows() {
        let (walk, store) = (
            at(8192, 8192, 8192, GemmVersion::TmaPersistent, Arch::Sm90a).unwrap(),
            at(8192, 8192, 8192, GemmVersion::TmaStore, Arch::Sm90a).unwrap(),
        );
        assert_eq!((store.grid, store.tiles.threads), (walk.grid, walk.tiles.threads));
        // Three stages of 48 KiB, the slack, the barriers' 1024 bytes, 64 KiB of staging.
        assert_eq!(store.smem, 3 * 48 * 1024 + 1024 + 1024 + 64 * 1024);
        assert!(store.smem <= 227 * 1024 && store.tiles.stores_by_tma && !walk.tiles.stores_by_tma);
        let residual = plan_with(
            &[64, 64],
            &[64, 64],
            &[64, 64],
            Some(&[64, 64]),
            Epilogue::Residual,
            GemmVersion::TmaStore,
            132,
            Arch::Sm90a,
        );
        assert!(residual.is_ok());
        // SwiGLU's output rows are n / 2 = 12 wide: not 16-byte rows.
        let swiglu =
            plan_with(&[64, 64], &[24, 64], &[64, 12], None, Epilogue::SwiGlu, GemmVersion::TmaStore, 132, Arch::Sm90a);
        assert!(matches!(swiglu, Err(Error::Alignment(_))));
        assert!(matches!(at(64, 64, 64, GemmVersion::TmaStore, Arch::Sm80), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn k128_tiles_split_where_their_tiles_leave_a_wave_idle() {
        let k128 = at(1, 4096, 14336, GemmVersion::SkinnyK128SplitK, Arch::Sm90a).unwrap();
        assert_eq!((k128.grid, k128.k_split, k128.smem), ((32, 1, 8), 1792, 3 * 144 * 128 * 2));
        let fill = |n: usize, k: usize| {
            let p = at(16, n, k, GemmVersion::SkinnyK128Fill, Arch::Sm90a).unwrap();
            (p.tiles.name(), p.grid)
        };
        assert_eq!(fill(28672, 4096), ("gemm_bf16_skinny_k128", (224, 1, 1)));
        assert_eq!(fill(4096, 14336), ("gemm_bf16_skinny_k128_splitk", (32, 1, 8)));
        let fixup = at(16, 4096, 14336, GemmVersion::SkinnyK128FillFixup, Arch::Sm90a).unwrap();
        // Sums, then one counter per tile; no finalize launch.
        assert_eq!((fixup.tiles.name(), fixup.workspace_len()), ("gemm_bf16_skinny_k128_splitk_fixup", 16 * 4096 + 32));
        assert_eq!(fixup.finalize_grid(), None);
    }

    #[test]
    fn stream_k_takes_resident_blocks_only() {
        // 224 tiles × 64 K tiles over 3 blocks per SM; a tiny GEMM gets one block
        // per iteration.
        assert_eq!(at(1, 28672, 4096, GemmVersion::SkinnyStreamK, Arch::Sm90a).unwrap().grid, (396, 1, 1));
        assert_eq!(at(3, 264, 1160, GemmVersion::SkinnyStreamK, Arch::Sm90a).unwrap().grid, (57, 1, 1));
        // Narrow tiles: four 48 KB blocks of 16×32 per SM; 16×64 keeps three.
        let p32 = at(16, 4096, 14336, GemmVersion::Skinny32StreamK, Arch::Sm90a).unwrap();
        assert_eq!((p32.grid, p32.tiles.threads, p32.smem), ((528, 1, 1), 64, 8 * 48 * 64 * 2));
        let p64 = at(16, 4096, 14336, GemmVersion::Skinny64StreamK, Arch::Sm90a).unwrap();
        assert_eq!((p64.grid, p64.smem), ((396, 1, 1), 6 * 80 * 64 * 2));
    }

    #[test]
    fn gemv_takes_16_columns_per_block_over_all_of_k() {
        let g = at(16, 4096, 14336, GemmVersion::Gemv, Arch::Sm90a).unwrap();
        assert_eq!((g.grid, g.tiles.threads, g.smem, g.k_split), ((256, 1, 1), 256, 8192, 14336));
        let tall =
            plan_with(&[17, 72], &[100, 72], &[17, 100], None, Epilogue::Plain, GemmVersion::Gemv, 132, Arch::Sm80)
                .unwrap();
        assert_eq!(tall.grid, (7, 2, 1));
    }

    #[test]
    fn the_persistent_split_walks_one_round_where_it_can() {
        // M = 512, O: 64 tiles × 2 slices of 32 K tiles, one round on 132 SMs.
        let o = at(512, 4096, 4096, GemmVersion::TmaPersistentSplitK, Arch::Sm90a).unwrap();
        assert_eq!((o.grid, o.k_split, o.workspace_len()), ((128, 1, 1), 2048, 512 * 4096));
        assert!(o.finalize_grid().is_some());
        // Enough tiles already: no split, every tile whole.
        let big = at(2048, 28672, 4096, GemmVersion::TmaPersistentSplitK, Arch::Sm90a).unwrap();
        assert_eq!((big.grid, big.k_split), ((132, 1, 1), 4096));
    }

    #[test]
    fn tma_split_tail_takes_one_block_per_sm_and_a_counter_per_consumer_warp() {
        // M = 512, down: 4 × 16 tiles of 224 K tiles over 132 SMs; its own
        // scratch (counters for 1024 tiles, then a slot of a 128×256 tile a
        // block), not the zeroed workspace; no finalize launch.
        let d = at(512, 4096, 14336, GemmVersion::TmaSplitTail, Arch::Sm90a).unwrap();
        assert_eq!((d.grid, d.workspace_len()), ((132, 1, 1), 0));
        assert_eq!(d.split_tail_scratch_len(), 1024 * 8 + 132 * 128 * 256 + 132 * 16);
        assert_eq!(d.finalize_grid(), None);
        // Fewer K tiles than SMs: one block each.
        assert_eq!(at(3, 256, 128, GemmVersion::TmaSplitTail, Arch::Sm90a).unwrap().grid, (2, 1, 1));
    }

    #[test]
    fn the_split_tail_on_two_waves_cuts_each_tile_in_twice_the_slices() {
        // M = 128, down: 22 tiles of 128×192, 224 K tiles: 6 slices a tile on
        // 132 blocks, 12 on 264 (a slot each in the scratch), summed whole:
        // shares would wait for the second wave.
        let one = at(128, 4096, 14336, GemmVersion::TmaSplitTailN192Whole, Arch::Sm90a).unwrap();
        let two = at(128, 4096, 14336, GemmVersion::TmaSplitTailN192Waves, Arch::Sm90a).unwrap();
        assert_eq!((one.grid, two.grid), ((132, 1, 1), (264, 1, 1)));
        assert_eq!(shapes::tma::split_tail(22, 224, 132), (0, 6));
        assert_eq!(shapes::tma::split_tail(22, 224, 264), (0, 12));
        assert_eq!(two.split_tail_scratch_len(), shapes::tma::split_tail_scratch_len(264));
        assert_eq!(two.tiles.entry, one.tiles.entry);
    }

    #[test]
    fn the_128_column_tiles_give_m512_o_a_tile_per_sm() {
        // M = 512, O: 4 × 32 tiles of 128×128 (against 64 of 128×256), whole K; a
        // 6-stage ring, one block per SM.
        let o = at(512, 4096, 4096, GemmVersion::TmaPersistentN128, Arch::Sm90a).unwrap();
        assert_eq!((o.grid, o.k_split, o.workspace_len(), o.tiles.bn), ((128, 1, 1), 4096, 0, 128));
        assert_eq!(o.smem as usize, 6 * 256 * 64 * 2 + 1024 + 96);
        const { assert!(TMA_PERSISTENT_N128.smem <= 227 * 1024) };
    }

    #[test]
    fn multicast_takes_pairs_of_row_tiles_in_clusters_of_two() {
        // 32 × 32 pairs of 128×256 tiles: a cluster of two blocks per two SMs,
        // each block loading 128 of the W box's 256 rows.
        let p = at(8192, 8192, 8192, GemmVersion::TmaMulticast, Arch::Sm90a).unwrap();
        assert_eq!((p.grid, p.cluster(), p.w_box_rows()), ((132, 1, 1), 2, 128));
        // 3 row tiles × 2 columns: 2 × 2 pairs, the lower block of the second
        // row of pairs past M.
        assert_eq!(at(300, 512, 64, GemmVersion::TmaMulticast, Arch::Sm90a).unwrap().grid, (8, 1, 1));
        assert_eq!(at(300, 512, 64, GemmVersion::TmaPersistent, Arch::Sm90a).unwrap().cluster(), 1);
    }

    #[test]
    fn tiles_224_wide_put_gate_up_at_128_tokens_on_128_sms() {
        let p = at(128, 28672, 4096, GemmVersion::TmaPersistentN224, Arch::Sm90a).unwrap();
        let wide = at(128, 28672, 4096, GemmVersion::TmaPersistent, Arch::Sm90a).unwrap();
        assert_eq!((p.grid.0, wide.grid.0), (128, 112));
        assert!(p.tiles.smem <= 227 * 1024);
    }

    #[test]
    fn hopper_versions_run_on_sm90a_only() {
        let one = at(2049, 28672, 4096, GemmVersion::Tma, Arch::Sm90a).unwrap();
        assert_eq!((one.tiles.name(), one.grid), ("gemm_bf16_tma", (17 * 112, 1, 1)));
        for v in [
            GemmVersion::Tma,
            GemmVersion::TmaPersistent,
            GemmVersion::TmaPersistentSplitK,
            GemmVersion::TmaSplitTail,
            GemmVersion::TmaPersistentN128,
            GemmVersion::TmaPersistentN192,
            GemmVersion::TmaPersistentN224,
            GemmVersion::TmaSplitTailN192,
            GemmVersion::TmaSplitTailStamped,
            GemmVersion::TmaSplitTailN192Stamped,
            GemmVersion::TmaMulticast,
            GemmVersion::WgmmaExperimental,
        ] {
            assert!(matches!(at(8, 8, 64, v, Arch::Sm80), Err(Error::InvalidArgument(_))));
        }
        let wg = at(130, 260, 200, GemmVersion::WgmmaExperimental, Arch::Sm90a).unwrap();
        assert_eq!((wg.grid, wg.smem, wg.tiles.waits), ((3, 3, 1), 4 * 192 * 64 * 2 + 1024, false));
    }
}
