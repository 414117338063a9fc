//! The GEMM's checks and tile choice, pure (no GPU): which compiled tile
//! configuration runs a shape, and its grid, shared memory, K split and workspace.

use super::Epilogue;
use crate::error::{Error, Result};
use crate::kernels;
use crate::runtime::{Arch, Kernel};
use abi::gemm::{self as shapes, MmaTile};
use abi::{GemmArgs, GemmTmaArgs};

/// An entry point with the parameter block it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// The mma.sync entries (and the dev `wgmma` and GEMV ones).
    Mma(Kernel<GemmArgs>),
    /// The Hopper entries that load through TMA tensor maps over X and W.
    Tma(Kernel<GemmTmaArgs>),
}

impl Entry {
    pub fn name(self) -> &'static str {
        match self {
            Entry::Mma(k) => k.name(),
            Entry::Tma(k) => k.name(),
        }
    }
}

/// How a kernel's blocks cover the output and K, and who applies the epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// A (column tile, row tile) grid, each block over the whole of K.
    Tiles,
    /// A (column tile, row tile, K slice) grid adding f32 partial tiles into the
    /// workspace; `gemm_finalize`, or a fused consumer, applies the epilogue.
    SplitK,
    /// [`Schedule::SplitK`] whose last block per tile applies the epilogue.
    #[cfg(feature = "dev")]
    SplitKFixup,
    /// A 1-D grid of resident blocks, each an equal share of the (tile, K tile)
    /// iterations; partial tiles meet in the workspace, finished in-kernel.
    StreamK,
    /// TMA: a 1-D grid of one block per tile.
    #[cfg(feature = "dev")]
    TmaTiles,
    /// TMA: at most one block per SM, each walking the tiles.
    TmaPersistent,
    /// TMA: at most one block per SM, each walking (tile, K slice) units; the
    /// sums meet in the workspace, finished as [`Schedule::SplitK`]'s.
    #[cfg(feature = "dev")]
    TmaPersistentSplit,
    /// TMA: clusters of two blocks on vertically adjacent tiles, each loading
    /// half of their shared W box into both (multicast), walking pairs of tiles.
    #[cfg(feature = "dev")]
    TmaMulticast,
    /// TMA: one block per SM walking whole tiles, then a K slice of one of
    /// the last round's tiles; slices meet in the split tail's scratch, each
    /// consumer warp's rows finished in-kernel by its last contributor.
    TmaSplitTail,
    /// [`Schedule::TmaSplitTail`]'s kernel on twice as many blocks as SMs:
    /// each tail tile cut into twice the slices, the second wave's going to
    /// SMs as they free up, so the block scheduler evens out SMs that stream
    /// at different rates.
    #[cfg(feature = "dev")]
    TmaSplitTailWaves,
}

impl Schedule {
    /// Blocks a split-tail launch takes per SM (None: not a split tail).
    fn split_tail_waves(self) -> Option<usize> {
        match self {
            Schedule::TmaSplitTail => Some(1),
            #[cfg(feature = "dev")]
            Schedule::TmaSplitTailWaves => Some(2),
            _ => None,
        }
    }
}

/// One compiled tile configuration and what launching it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    pub entry: Entry,
    pub bm: usize,
    pub bn: usize,
    /// K elements per staged tile: K slices are multiples of it.
    pub bk: usize,
    pub threads: u32,
    /// Dynamic shared memory per block.
    pub smem: usize,
    pub schedule: Schedule,
    /// Blocks one SM holds at once, for sizing split-K and stream-K grids.
    pub resident_per_sm: usize,
    /// Whether the kernel waits for the previous one before it reads X
    /// (`wait_for_prior_grids`), so it may be launched to overlap it.
    pub waits: bool,
    /// The kernel stores the output by TMA through a map over it (plain
    /// epilogue only).
    pub stores_by_tma: bool,
}

impl Tiles {
    /// An mma.sync entry of tile shape `t`.
    pub(crate) const fn mma(entry: Kernel<GemmArgs>, t: MmaTile, schedule: Schedule, resident_per_sm: usize) -> Tiles {
        Tiles {
            entry: Entry::Mma(entry),
            bm: t.bm,
            bn: t.bn,
            bk: t.bk,
            threads: t.threads as u32,
            smem: t.smem_bytes(),
            schedule,
            resident_per_sm,
            waits: true,
            stores_by_tma: false,
        }
    }

    pub fn name(&self) -> &'static str {
        self.entry.name()
    }

    /// Partial sums go through the f32 workspace.
    pub fn uses_workspace(&self) -> bool {
        self.leaves_sums() || self.counts_tiles()
    }

    /// The kernel leaves the `[m, n]` sums in the workspace for `gemm_finalize`
    /// (or a fused consumer) to finish.
    pub fn leaves_sums(&self) -> bool {
        match self.schedule {
            Schedule::SplitK => true,
            #[cfg(feature = "dev")]
            Schedule::TmaPersistentSplit => true,
            _ => false,
        }
    }

    /// Partial tiles are finished in-kernel, counted per tile after the sums.
    pub fn counts_tiles(&self) -> bool {
        match self.schedule {
            Schedule::StreamK => true,
            #[cfg(feature = "dev")]
            Schedule::SplitKFixup => true,
            _ => false,
        }
    }
}

/// 128×128 tiles, whole K: prefill where the tiles fill the SMs.
pub const V1: Tiles = Tiles::mma(kernels::GEMM_BF16_V1, shapes::PREFILL_128X128, Schedule::Tiles, 3);
/// 128×128 tiles, split K: few column blocks, long K.
pub const V1_SPLIT: Tiles = Tiles::mma(kernels::GEMM_BF16_V1_SPLITK, shapes::PREFILL_128X128, Schedule::SplitK, 3);
/// 64×128 tiles, split K (96 KB: two blocks per SM): 17 to 64 tokens.
pub const ROWS64_SPLIT: Tiles = Tiles::mma(kernels::GEMM_BF16_ROWS64_SPLITK, shapes::ROWS_64X128, Schedule::SplitK, 2);
/// 16×128 tiles, split K: 1 to 16 tokens off Hopper.
pub const SKINNY_SPLIT: Tiles =
    Tiles::mma(kernels::GEMM_BF16_SKINNY_SPLITK, shapes::SKINNY_16X128, Schedule::SplitK, 3);
/// 16×128 tiles, stream-K: one token off Hopper where split-K leaves a wave part idle.
pub const SKINNY_STREAMK: Tiles =
    Tiles::mma(kernels::GEMM_BF16_SKINNY_STREAMK, shapes::SKINNY_16X128, Schedule::StreamK, 3);
/// 16×128 tiles 128 deep in K (108 KB: two blocks per SM), whole K.
pub const SKINNY_K128: Tiles =
    Tiles::mma(kernels::GEMM_BF16_SKINNY_K128, shapes::SKINNY_16X128_K128, Schedule::Tiles, 2);
/// [`SKINNY_K128`] with split K.
pub const SKINNY_K128_SPLIT: Tiles =
    Tiles::mma(kernels::GEMM_BF16_SKINNY_K128_SPLITK, shapes::SKINNY_16X128_K128, Schedule::SplitK, 2);
/// sm_90a: 128×256 tiles by TMA + wgmma, one block per SM walking them. Waits
/// for the previous kernel before it reads X or stores, so it may overlap it.
pub const TMA_PERSISTENT: Tiles = Tiles {
    entry: Entry::Tma(kernels::GEMM_BF16_TMA_PERSISTENT),
    bm: shapes::tma::BM,
    bn: shapes::tma::BN,
    bk: shapes::tma::BK,
    threads: shapes::tma::THREADS as u32,
    smem: shapes::tma::SMEM_BYTES,
    schedule: Schedule::TmaPersistent,
    resident_per_sm: 1,
    waits: true,
    stores_by_tma: false,
};

/// sm_90a: [`TMA_PERSISTENT`]'s kernel on 128×128 tiles, twice the tiles where
/// 128×256 ones leave SMs idle.
pub const TMA_PERSISTENT_N128: Tiles = Tiles {
    entry: Entry::Tma(kernels::GEMM_BF16_TMA_PERSISTENT_N128),
    bn: shapes::tma_n128::BN,
    smem: shapes::tma_n128::SMEM_BYTES,
    ..TMA_PERSISTENT
};

/// sm_90a: [`TMA_PERSISTENT`]'s kernel on 128×192 tiles (N = 6144 is 32 column
/// tiles where 256 makes 24).
pub const TMA_PERSISTENT_N192: Tiles = Tiles {
    entry: Entry::Tma(kernels::GEMM_BF16_TMA_PERSISTENT_N192),
    bn: shapes::tma_n192::BN,
    smem: shapes::tma_n192::SMEM_BYTES,
    ..TMA_PERSISTENT
};

/// sm_90a: [`TMA_PERSISTENT`]'s kernel on 128×224 tiles (N = 28672 is 128
/// column tiles where 256 makes 112).
pub const TMA_PERSISTENT_N224: Tiles = Tiles {
    entry: Entry::Tma(kernels::GEMM_BF16_TMA_PERSISTENT_N224),
    bn: shapes::tma_n224::BN,
    smem: shapes::tma_n224::SMEM_BYTES,
    ..TMA_PERSISTENT
};

/// sm_90a: [`TMA_PERSISTENT`]'s walk, the tiles of its last partial round
/// each split along K, one slice a block, the slices summed through its scratch
/// by the last to finish, or from 4 slices in shares by all of them: no SM
/// idles in that round. Its blocks, at most one an SM, are meant to be resident
/// at once: a block summing in shares waits for the tile's other slices (at
/// most 200 µs, then it leaves its shares to the last one in).
pub const TMA_SPLIT_TAIL: Tiles =
    Tiles { entry: Entry::Tma(kernels::GEMM_BF16_TMA_SPLIT_TAIL), schedule: Schedule::TmaSplitTail, ..TMA_PERSISTENT };

/// sm_90a: [`TMA_SPLIT_TAIL`]'s walk on 128×192 tiles, for widths whose
/// 256-column tiles leave a round part empty (N = 6144: 32 columns, not 24).
pub const TMA_SPLIT_TAIL_N192: Tiles = Tiles {
    entry: Entry::Tma(kernels::GEMM_BF16_TMA_SPLIT_TAIL_N192),
    bn: shapes::tma_n192::BN,
    smem: shapes::tma_n192::SMEM_BYTES,
    ..TMA_SPLIT_TAIL
};

/// sm_90a, 17 to 64 tokens: 64×128 tiles by TMA + wgmma (one consumer
/// warpgroup, two blocks per SM), whole K. Waits for the previous kernel
/// before it reads X, so it may overlap it.
pub const TMA_ROWS64: Tiles = Tiles {
    entry: Entry::Tma(kernels::GEMM_BF16_TMA_ROWS64),
    bm: shapes::tma_rows64::BM,
    bn: shapes::tma_rows64::BN,
    bk: shapes::tma_rows64::BK,
    threads: shapes::tma_rows64::THREADS as u32,
    smem: shapes::tma_rows64::SMEM_BYTES,
    schedule: Schedule::Tiles,
    resident_per_sm: 2,
    waits: true,
    stores_by_tma: false,
};
/// [`TMA_ROWS64`] with split K (the kernel adds into the workspace it is given).
pub const TMA_ROWS64_SPLIT: Tiles = Tiles { schedule: Schedule::SplitK, ..TMA_ROWS64 };

/// Up to this many tokens, decode tiles (16 or 64 rows) waste less than a 128-row one.
const SKINNY_MAX_M: usize = 64;
/// Split-K aims for this many blocks per SM.
const SPLIT_TARGET_PER_SM: usize = 3;

/// A GEMM's launch, sized.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmPlan {
    pub tiles: Tiles,
    pub epilogue: Epilogue,
    pub grid: (u32, u32, u32),
    pub smem: u32,
    /// K elements per split (K itself without split-K).
    pub k_split: u32,
    pub m: u32,
    pub n: u32,
    pub k: u32,
}

impl GemmPlan {
    /// Blocks per cluster the launch takes (1: no clusters).
    pub fn cluster(&self) -> u32 {
        match self.tiles.schedule {
            #[cfg(feature = "dev")]
            Schedule::TmaMulticast => 2,
            _ => 1,
        }
    }

    /// Rows of W's TMA box: a cluster's blocks each load their share of the tile's.
    pub fn w_box_rows(&self) -> u32 {
        self.tiles.bn as u32 / self.cluster()
    }

    /// f32 of the split tail's scratch the launch needs (0: none).
    pub fn split_tail_scratch_len(&self) -> usize {
        match self.tiles.schedule.split_tail_waves() {
            Some(_) => shapes::tma::split_tail_scratch_len(self.grid.0 as usize),
            None => 0,
        }
    }

    /// f32 of split-K workspace the launch needs (0: none).
    pub fn workspace_len(&self) -> usize {
        let (m, n) = (self.m as usize, self.n as usize);
        if !self.tiles.uses_workspace() {
            return 0;
        }
        let counted = if self.tiles.counts_tiles() { m.div_ceil(self.tiles.bm) * n.div_ceil(self.tiles.bn) } else { 0 };
        shapes::workspace_len(m, n, counted)
    }

    /// `gemm_finalize`'s grid, where the kernel leaves its sums: column pairs along
    /// x, rows along y (the kernel strides rows past 65535).
    pub fn finalize_grid(&self) -> Option<(u32, u32, u32)> {
        let threads = shapes::FINALIZE_THREADS as u32;
        self.tiles.leaves_sums().then(|| ((self.n / 2).div_ceil(threads), self.m.min(65535), 1))
    }
}

/// Checks a GEMM's tensors against each other and the epilogue; returns (m, n, k).
pub(crate) fn check(
    x: &[usize],
    w: &[usize],
    out: &[usize],
    residual: Option<&[usize]>,
    ep: Epilogue,
) -> Result<(usize, usize, usize)> {
    let op = "linear";
    let [m, k] = *x else { return Err(Error::Shape(format!("{op}: x must be [tokens, d_in], got {x:?}"))) };
    let [n, kw] = *w else { return Err(Error::Shape(format!("{op}: w must be [d_out, d_in], got {w:?}"))) };
    if k != kw {
        return Err(Error::Shape(format!("{op}: x has d_in {k}, w has {kw}")));
    }
    if m == 0 || n == 0 || k == 0 {
        return Err(Error::Empty(format!("{op}: x {x:?}, w {w:?}")));
    }
    if k % 8 != 0 {
        return Err(Error::Alignment(format!("{op}: d_in {k} must be a multiple of 8 (16-byte rows)")));
    }
    if n % 2 != 0 {
        return Err(Error::Alignment(format!("{op}: d_out {n} must be even (paired bf16 stores)")));
    }
    let out_cols = if ep == Epilogue::SwiGlu { n / 2 } else { n };
    super::super::same_shape(op, "output", &[m, out_cols], out)?;
    match (ep, residual) {
        (Epilogue::Residual, Some(r)) => super::super::same_shape(op, "residual", &[m, n], r)?,
        (Epilogue::Residual, None) => {
            return Err(Error::InvalidArgument(format!("{op}: residual epilogue needs a residual")))
        }
        (_, Some(_)) => {
            return Err(Error::InvalidArgument(format!("{op}: a residual is read only by the residual epilogue")))
        }
        _ => {}
    }
    let limit = u32::MAX as usize / 2;
    if m > 65535 * 16 || n > limit || k > limit || m.checked_mul(k).is_none_or(|e| e > isize::MAX as usize / 2) {
        return Err(Error::TooLarge(format!("{op}: [{m}, {k}] × [{n}, {k}]")));
    }
    Ok((m, n, k))
}

/// Validates a GEMM and its epilogue's tensors and picks the shipped tile
/// configuration for a GPU with `sm_count` SMs of `arch`. Pure: no GPU needed.
pub fn plan(
    x: &[usize],
    w: &[usize],
    out: &[usize],
    residual: Option<&[usize]>,
    ep: Epilogue,
    sm_count: usize,
    arch: Arch,
) -> Result<GemmPlan> {
    let (m, n, k) = check(x, w, out, residual, ep)?;
    size(auto_tiles(m, n, k, sm_count, arch), ep, m, n, k, sm_count)
}

/// `[m, n, k]` shapes whose shipped plans on 132 SMs take every tile
/// configuration (the plan's unit tests pin which): decode down (split-K); 213
/// column tiles (Hopper: 128-deep tiles unsplit; one token elsewhere: stream-K);
/// 64 tokens (64-row tiles: split, and on Hopper 213 tiles unsplit); prefill
/// (Hopper: the persistent TMA kernel on tiles 128, 192, 224 and 256 wide, more
/// tiles than SMs, and K shorter than one box; the last round split along K
/// where few tiles take a long K, 192 and 256 wide). The GPU tests run them.
pub const SHAPES_OF_EVERY_CONFIGURATION: [(usize, usize, usize); 15] = [
    (1, 4096, 14336),
    (1, 27264, 136),
    (2, 27264, 200),
    (16, 27264, 136),
    (64, 2050, 4104),
    (37, 27264, 200),
    (1100, 4100, 328),
    (4093, 1026, 8),
    (4096, 640, 136),
    (300, 256, 1032),
    (129, 4096, 14336),
    (4093, 8200, 8),
    (4093, 3000, 8),
    (513, 28672, 8),
    (2049, 256, 14336),
];

/// The shipped tile choice for an `[m, k] × [n, k]` GEMM.
pub fn auto_tiles(m: usize, n: usize, k: usize, sm_count: usize, arch: Arch) -> Tiles {
    let skinny = SKINNY_SPLIT;
    match arch {
        // Decode, Hopper: 16×128 tiles 128 deep in K (256 contiguous bytes per
        // weight row and stage), split only where the tiles leave a wave idle.
        // H200, MLP by events: t1 0.0890 ms and t16 0.0934 against 0.0905 and
        // 0.1014 with every GEMM split; ncu t16 gate/up 58.4 µs with no finalize
        // (split: 59.3 + 11.1). Its 108 KB of stages exceed the 99 KB per block
        // of sm_86/89/120.
        Arch::Sm90a if m <= skinny.bm => whole_k_if_filled(m, n, sm_count, SKINNY_K128, SKINNY_K128_SPLIT),
        // Elsewhere 16×128 tiles 64 deep. One token: stream-K's grid is always one
        // full wave, but its blocks drain their ring at each tile boundary: where a
        // split-K grid fills one wave as well, split-K wins (t1 down GEMM by ncu:
        // 29.6 against 34.5 µs); where it does not (gate/up: 224 tiles, 1.13
        // waves), stream-K (59.4 against 62.3 µs). At 16 tokens split-K.
        _ if m == 1
            && split_fill(n.div_ceil(skinny.bn), k.div_ceil(skinny.bk), sm_count, skinny.resident_per_sm).1 < 0.9 =>
        {
            SKINNY_STREAMK
        }
        _ if m <= skinny.bm => skinny,
        // Past 16 tokens on Hopper, TMA + wgmma: 64-row tiles (whole or split K) or
        // the persistent 128×256 kernel, by cost model (`cost.rs`). 16-row tiles
        // would stream each weight tile once per 16 rows.
        Arch::Sm90a => super::cost::hopper_tiles(m, n, k, sm_count),
        // 17 to 64 tokens elsewhere: 64-row mma.sync tiles.
        _ if m <= SKINNY_MAX_M => ROWS64_SPLIT,
        // Split only when the tiles alone leave SMs idle: the split costs a
        // finalize launch and a round trip through the f32 workspace.
        _ if n.div_ceil(V1.bn) * m.div_ceil(V1.bm) >= sm_count => V1,
        _ => V1_SPLIT,
    }
}

/// `whole` (no split) where its tiles alone fill at least 80% of one wave of
/// resident blocks (decode gate/up: 224 tiles for 264 slots): no finalize
/// launch and no f32 partial sums; else `split`.
pub(crate) fn whole_k_if_filled(m: usize, n: usize, sm_count: usize, whole: Tiles, split: Tiles) -> Tiles {
    let tiles = n.div_ceil(whole.bn) * m.div_ceil(whole.bm);
    if 5 * tiles >= 4 * whole.resident_per_sm * sm_count.max(1) {
        whole
    } else {
        split
    }
}

/// Split-K's split count for `blocks` tiles of `k_tiles` K tiles, and how well
/// the grid fills its last wave of `per_sm` (at most [`SPLIT_TARGET_PER_SM`]) blocks per SM. Blocks
/// do equal work, so the most splits that still fit one wave, if that wave is
/// ≥ 90% full (the t1 down GEMM: 32 tiles × 12 = 384 of 396, where 13 splits
/// made 1.05 waves); otherwise enough blocks to cover every SM a few times.
/// Each block still streams at least two K tiles.
pub(crate) fn split_fill(blocks: usize, k_tiles: usize, sm_count: usize, per_sm: usize) -> (usize, f64) {
    let (blocks, capacity) = (blocks.max(1), per_sm.clamp(1, SPLIT_TARGET_PER_SM) * sm_count.max(1));
    let most = (k_tiles / 2).max(1);
    let one_wave = (capacity / blocks).clamp(1, most);
    let fill = |splits: usize| {
        let grid = blocks * k_tiles.div_ceil(k_tiles.div_ceil(splits));
        grid as f64 / (grid.div_ceil(capacity) * capacity) as f64
    };
    if fill(one_wave) >= 0.9 {
        return (one_wave, fill(one_wave));
    }
    let cover = capacity.div_ceil(blocks).clamp(1, most);
    (cover, fill(cover))
}

/// The grid, shared memory and K split of `tiles` on a checked `[m, k] × [n, k]`.
pub(crate) fn size(
    tiles: Tiles,
    epilogue: Epilogue,
    m: usize,
    n: usize,
    k: usize,
    sm_count: usize,
) -> Result<GemmPlan> {
    let (m_tiles, n_tiles) = (m.div_ceil(tiles.bm), n.div_ceil(tiles.bn));
    let blocks = n_tiles * m_tiles;
    let k_tiles = k.div_ceil(tiles.bk);
    let (mut splits, mut k_split) = (1, k);
    let split_k = match tiles.schedule {
        Schedule::SplitK => true,
        #[cfg(feature = "dev")]
        Schedule::SplitKFixup => true,
        _ => false,
    };
    if split_k {
        k_split = k_tiles.div_ceil(split_fill(blocks, k_tiles, sm_count, tiles.resident_per_sm).0) * tiles.bk;
        splits = k.div_ceil(k_split);
    }
    #[cfg(feature = "dev")]
    if tiles.schedule == Schedule::TmaPersistentSplit {
        // The split whose walk is shortest: rounds of one unit per SM times the
        // K tiles per unit (each slice at least two K tiles).
        let sm = sm_count.max(1);
        let walk = |s: usize| (blocks * s).div_ceil(sm) * k_tiles.div_ceil(s);
        // Only where the tiles alone leave SMs idle: the sums cost a round trip.
        let most = if blocks < sm { (k_tiles / 2).max(1) } else { 1 };
        let best = (1..=most).min_by_key(|&s| (walk(s), s)).unwrap_or(1);
        let per_split = k_tiles.div_ceil(best);
        k_split = per_split * tiles.bk;
        splits = k_tiles.div_ceil(per_split);
    }
    // The split tail counts in 32 bits: its units, and a slice's first K tile
    // (slice × K tiles, fewer slices than blocks).
    let split_tail_blocks =
        tiles.schedule.split_tail_waves().map(|waves| (waves * sm_count).clamp(1, shapes::tma::SPLIT_TAIL_MAX_BLOCKS));
    if split_tail_blocks.is_some_and(|most| (blocks + most) * k_tiles > i32::MAX as usize) {
        return Err(Error::TooLarge(format!("linear: {blocks} tiles of {k_tiles} K tiles for the split tail")));
    }
    let grid = match tiles.schedule {
        _ if let Some(most) = split_tail_blocks => ((blocks * k_tiles).min(most), 1, 1),
        // Resident blocks only: a second wave would bring the tail back.
        Schedule::StreamK => ((tiles.resident_per_sm * sm_count.max(1)).min(blocks * k_tiles), 1, 1),
        Schedule::TmaPersistent => (blocks.min(sm_count.max(1)), 1, 1),
        #[cfg(feature = "dev")]
        Schedule::TmaPersistentSplit => ((blocks * splits).min(sm_count.max(1)), 1, 1),
        // Pairs of row tiles, a cluster of two blocks each, at most one block per SM.
        #[cfg(feature = "dev")]
        Schedule::TmaMulticast => (2 * (m_tiles.div_ceil(2) * n_tiles).min((sm_count / 2).max(1)), 1, 1),
        #[cfg(feature = "dev")]
        Schedule::TmaTiles => (blocks, 1, 1),
        _ => (n_tiles, m_tiles, splits),
    };
    if grid.0 > i32::MAX as usize || grid.1 > 65535 || grid.2 > 65535 {
        return Err(Error::TooLarge(format!("linear: grid {grid:?} for [{m}, {k}] × [{n}, {k}]")));
    }
    Ok(GemmPlan {
        tiles,
        epilogue,
        grid: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
        smem: tiles.smem as u32,
        k_split: k_split as u32,
        m: m as u32,
        n: n as u32,
        k: k as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(x: &[usize], w: &[usize], out: &[usize], r: Option<&[usize]>, ep: Epilogue) -> Result<GemmPlan> {
        plan(x, w, out, r, ep, 132, Arch::Sm80)
    }

    fn auto(m: usize, n: usize, k: usize, arch: Arch) -> GemmPlan {
        plan(&[m, k], &[n, k], &[m, n], None, Epilogue::Plain, 132, arch).unwrap()
    }

    #[test]
    fn split_k_fills_one_wave_where_it_can() {
        // t1/t16 down GEMM (n 4096, k 14336): 12 splits, 384 of 396 slots.
        assert_eq!(split_fill(32, 224, 132, 3).0, 12);
        // Layer QKV (n 6144, k 4096): 8 splits rather than 9 (432 blocks).
        assert_eq!(split_fill(48, 64, 132, 3).0, 8);
        // Gate/up (n 28672): one split is half a wave; two cover every SM.
        let (splits, fill) = split_fill(224, 64, 132, 3);
        assert_eq!(splits, 2);
        assert!(fill < 0.9);
    }

    #[test]
    fn decode_takes_stream_k_or_split_k_off_hopper_and_k128_tiles_on_it() {
        // One token off Hopper: stream-K on gate/up, split-K on down; on Hopper
        // 128-deep tiles, unsplit on gate/up (224 tiles), split on down.
        assert_eq!(auto(1, 28672, 4096, Arch::Sm80).tiles, SKINNY_STREAMK);
        assert_eq!(auto(1, 4096, 14336, Arch::Sm80).tiles, SKINNY_SPLIT);
        assert_eq!(auto(1, 28672, 4096, Arch::Sm90a).tiles, SKINNY_K128);
        let down = auto(1, 4096, 14336, Arch::Sm90a);
        // 112 K tiles of 128 on the down GEMM: 8 splits of 14 (two blocks per SM).
        assert_eq!(
            (down.tiles, down.grid, down.k_split, down.smem),
            (SKINNY_K128_SPLIT, (32, 1, 8), 1792, 3 * 144 * 128 * 2)
        );
        // Fill: gate/up's 224 tiles fill 85% of the 264 slots at 16 tokens, no split.
        let gu = auto(16, 28672, 4096, Arch::Sm90a);
        assert_eq!((gu.tiles, gu.grid), (SKINNY_K128, (224, 1, 1)));
        assert_eq!(gu.workspace_len(), 0);
        assert_eq!(gu.finalize_grid(), None);
        // 17 to 64 tokens: 64-row tiles, two blocks per SM (the down GEMM: 8
        // splits), by TMA + wgmma on Hopper; gate/up's 224 tiles unsplit there.
        for (arch, split) in [(Arch::Sm80, ROWS64_SPLIT), (Arch::Sm90a, TMA_ROWS64_SPLIT)] {
            let p64 = auto(64, 4096, 14336, arch);
            assert_eq!((p64.tiles, p64.grid), (split, (32, 1, 8)));
            assert_eq!(p64.workspace_len(), 64 * 4096);
            assert_eq!(p64.finalize_grid(), Some((8, 64, 1)));
        }
        let gu64 = auto(64, 28672, 4096, Arch::Sm90a);
        assert_eq!((gu64.tiles, gu64.grid, gu64.workspace_len()), (TMA_ROWS64, (224, 1, 1), 0));
        assert_eq!(auto(64, 28672, 4096, Arch::Sm80).tiles, ROWS64_SPLIT);
        // Its 97 KB ring: two blocks per SM.
        const { assert!(2 * TMA_ROWS64.smem <= 227 * 1024) };
    }

    /// The Llama-3-8B projections at 1 and 16 tokens on an H200 (`cost.rs`
    /// pins 32 to 8192): 16×128 tiles 128 deep, split where the tiles alone
    /// leave most of the 264 two-per-SM slots idle.
    #[test]
    fn decode_choices_for_the_llama_projections() {
        let (whole, split) = (SKINNY_K128, SKINNY_K128_SPLIT);
        for m in [1, 16] {
            let picks = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)].map(|(n, k)| {
                let p = auto(m, n, k, Arch::Sm90a);
                (p.tiles, p.grid)
            });
            // QKV 48 tiles × 5 splits (240 of 264 slots), O and down 32 × 8, gate/up 224 whole.
            assert_eq!(
                picks,
                [(split, (48, 1, 5)), (split, (32, 1, 8)), (whole, (224, 1, 1)), (split, (32, 1, 8))],
                "m{m}"
            );
        }
    }

    #[test]
    fn validates_shapes_and_alignment() {
        let small = p(&[3, 72], &[100, 72], &[3, 100], None, Epilogue::Plain).unwrap();
        assert_eq!((small.tiles, small.grid), (SKINNY_SPLIT, (1, 1, 1)));
        let big = p(&[2049, 4096], &[28672, 4096], &[2049, 14336], None, Epilogue::SwiGlu).unwrap();
        assert_eq!((big.tiles, big.grid), (V1, (224, 17, 1)));
        assert!(matches!(p(&[3, 70], &[100, 70], &[3, 100], None, Epilogue::Plain), Err(Error::Alignment(_))));
        assert!(matches!(p(&[3, 72], &[101, 72], &[3, 101], None, Epilogue::Plain), Err(Error::Alignment(_))));
        assert!(matches!(p(&[3, 72], &[100, 64], &[3, 100], None, Epilogue::Plain), Err(Error::Shape(_))));
        assert!(matches!(p(&[3, 72, 1], &[100, 72], &[3, 100], None, Epilogue::Plain), Err(Error::Shape(_))));
        assert!(matches!(p(&[3, 72], &[100, 72, 1], &[3, 100], None, Epilogue::Plain), Err(Error::Shape(_))));
        assert!(matches!(p(&[3, 72], &[100, 72], &[3, 100], None, Epilogue::SwiGlu), Err(Error::Shape(_))));
        assert!(matches!(p(&[3, 72], &[100, 72], &[3, 50], None, Epilogue::Plain), Err(Error::Shape(_))));
        assert!(matches!(p(&[3, 72], &[100, 72], &[3, 100], None, Epilogue::Residual), Err(Error::InvalidArgument(_))));
        let r = [3usize, 100];
        assert!(matches!(
            p(&[3, 72], &[100, 72], &[3, 100], Some(&r), Epilogue::Plain),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(p(&[3, 72], &[100, 72], &[3, 100], Some(&[3, 99]), Epilogue::Residual), Err(Error::Shape(_))));
        assert!(matches!(p(&[0, 72], &[100, 72], &[0, 100], None, Epilogue::Plain), Err(Error::Empty(_))));
        assert!(matches!(p(&[3, 0], &[100, 0], &[3, 100], None, Epilogue::Plain), Err(Error::Empty(_))));
        let huge = 65535 * 16 + 1;
        assert!(matches!(p(&[huge, 8], &[2, 8], &[huge, 2], None, Epilogue::Plain), Err(Error::TooLarge(_))));
        assert!(matches!(p(&[1, 1 << 31], &[2, 1 << 31], &[1, 2], None, Epilogue::Plain), Err(Error::TooLarge(_))));
    }

    #[test]
    fn decode_shapes_split_k_over_the_sms() {
        // Down projection: 32 column blocks, K = 14336 split 12 ways (one wave of 396).
        let d = p(&[2, 14336], &[4096, 14336], &[2, 4096], Some(&[2, 4096]), Epilogue::Residual).unwrap();
        assert_eq!((d.tiles, d.grid, d.k_split), (SKINNY_SPLIT, (32, 1, 12), 1216));
        let one = p(&[1, 14336], &[4096, 14336], &[1, 4096], Some(&[1, 4096]), Epilogue::Residual).unwrap();
        assert_eq!(one.tiles, SKINNY_SPLIT);
        let gu = p(&[16, 4096], &[28672, 4096], &[16, 14336], None, Epilogue::SwiGlu).unwrap();
        assert_eq!((gu.grid, gu.k_split), ((224, 1, 2), 2048));
        // 128 tokens, down projection: 32 blocks of 128×128, so split K.
        let d = p(&[128, 14336], &[4096, 14336], &[128, 4096], Some(&[128, 4096]), Epilogue::Residual).unwrap();
        assert_eq!((d.tiles, d.grid.2), (V1_SPLIT, 12));
    }

    #[test]
    fn stream_k_takes_resident_blocks_and_counts_its_tiles() {
        // 224 tiles × 64 K tiles over 3 blocks per SM.
        let gu = auto(1, 28672, 4096, Arch::Sm80);
        assert_eq!((gu.grid, gu.k_split), ((396, 1, 1), 4096));
        assert_eq!(gu.workspace_len(), 28672 + 224);
        assert_eq!(gu.finalize_grid(), None);
        // A tiny GEMM gets one block per iteration.
        let tiny = size(SKINNY_STREAMK, Epilogue::Plain, 1, 264, 1160, 132).unwrap();
        assert_eq!(tiny.grid, (57, 1, 1));
    }

    #[test]
    fn hopper_takes_tma_when_its_tiles_fill_the_sms() {
        // 16 × 112 tiles: 13 rounds and 76 tiles, too many to split.
        let big = auto(2048, 28672, 4096, Arch::Sm90a);
        assert_eq!((big.tiles, big.grid, big.smem), (TMA_PERSISTENT, (132, 1, 1), 4 * 384 * 64 * 2 + 1024 + 64));
        assert_eq!(big.workspace_len(), 0);
        // 17 × 112: 14 rounds and 56 tiles, each split in two, through the
        // split tail's scratch.
        let tail = auto(2049, 28672, 4096, Arch::Sm90a);
        assert_eq!((tail.tiles, tail.grid, tail.workspace_len()), (TMA_SPLIT_TAIL, (132, 1, 1), 0));
        assert!(tail.split_tail_scratch_len() > 132 * 128 * 256);
        // 16 × 2 tiles of 128×256 cannot fill 132 SMs: 16 × 4 of 128×128 fill
        // half, ahead of four K slices of the wider ones and their round trip.
        assert_eq!(auto(2048, 512, 4096, Arch::Sm90a).tiles, TMA_PERSISTENT_N128);
        // 17 tiles 256 wide: seven K slices each.
        assert_eq!(auto(2049, 256, 14336, Arch::Sm90a).tiles, TMA_SPLIT_TAIL);
        assert_eq!(auto(2048, 28672, 4096, Arch::Sm80).tiles, V1);
    }

    #[test]
    fn the_gpu_tests_large_shapes_take_every_shipped_configuration() {
        let picks = |arch| SHAPES_OF_EVERY_CONFIGURATION.map(|(m, n, k)| auto(m, n, k, arch).tiles);
        let hopper = [SKINNY_K128_SPLIT, SKINNY_K128, SKINNY_K128, SKINNY_K128, TMA_ROWS64_SPLIT, TMA_ROWS64];
        assert_eq!(picks(Arch::Sm90a)[..6], hopper);
        let (n128, n192, n224) = (TMA_PERSISTENT_N128, TMA_PERSISTENT_N192, TMA_PERSISTENT_N224);
        let prefill = [n128, n128, n128, n128, TMA_SPLIT_TAIL_N192, TMA_PERSISTENT, n192, n224, TMA_SPLIT_TAIL];
        assert_eq!(picks(Arch::Sm90a)[6..], prefill);
        let other = [SKINNY_SPLIT, SKINNY_STREAMK, SKINNY_SPLIT, SKINNY_SPLIT, ROWS64_SPLIT, ROWS64_SPLIT];
        assert_eq!(picks(Arch::Sm80)[..6], other);
        assert_eq!(picks(Arch::Sm80)[6..], [V1, V1, V1, V1_SPLIT, V1_SPLIT, V1, V1, V1, V1_SPLIT]);
    }

    #[test]
    fn every_shipped_tile_fits_99_kb_off_hopper() {
        // sm_86/89/120 give a block at most 99 KB: what Auto picks there must fit.
        for t in [V1, V1_SPLIT, ROWS64_SPLIT, SKINNY_SPLIT, SKINNY_STREAMK] {
            assert!(t.smem <= 99 * 1024, "{}", t.name());
        }
        for m in [1, 2, 16, 17, 64, 65, 4096] {
            for (n, k) in [(2, 8), (4096, 14336), (28672, 4096), (6144, 4096)] {
                assert!(auto(m, n, k, Arch::Sm80).smem <= 99 * 1024);
            }
        }
    }
}
