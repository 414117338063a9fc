//! Linear layers on tensor cores: Y = X·Wᵀ with X `[M, K]`, W `[N, K]` (the
//! `nn.Linear` layout), bf16 in and out, f32 accumulation, and fused epilogues:
//! plain, residual add, and SwiGLU over interleaved gate/up weights.

use crate::error::{Error, Result};
use crate::runtime::{Arch, Gpu};
use crate::tensor::Tensor;
use crate::tensor_map::Bf16Box;
use abi::epilogue;
use half::bf16;

/// Kernel versions, side by side (llm.c style); `Auto` picks per shape.
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
    /// 0.1014 split everywhere, session 7).
    SkinnyK128Fill,
    /// `SkinnyK128SplitK` finished by each tile's last block (no finalize launch).
    /// MLP t16 0.1091 ms against 0.1014 with `gemm_finalize` (session 7).
    SkinnyK128SplitKFixup,
    /// `SkinnyK128Fill` with `SkinnyK128SplitKFixup` where it splits: no finalize
    /// launch at all in the decode MLP. MLP t16 0.0961 ms against `SkinnyK128Fill`'s
    /// 0.0934; t1 equal (session 7): the down GEMM's fixup is the slower end.
    SkinnyK128FillFixup,
    /// Decode GEMV-style kernel: 16 columns per block over the whole K, split over
    /// its 8 warps and summed in shared memory; weights straight to registers, no
    /// workspace or partial sums.
    Gemv,
}

/// One compiled tile configuration (must match `kernels/src/gemm.rs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TileConfig {
    pub kernel: &'static str,
    pub bm: usize,
    pub bn: usize,
    pub threads: u32,
    pub stages: usize,
    pub split_k: bool,
    /// Extra dynamic shared memory the kernel uses to align its ring (and, for
    /// TMA, to hold its barriers; for the GEMV, its warps' sums).
    pub align_slack: usize,
    /// Loads through TMA tensor maps (`GemmTmaArgs`) on a 1-D grid of tiles.
    pub tma: bool,
    /// At most one block per SM, each looping over tiles.
    pub persistent: bool,
    /// Split-K finished in-kernel by each tile's last block (per-tile counters
    /// after the f32 workspace) instead of by `gemm_finalize`.
    pub fixup: bool,
    /// Stream-K on a 1-D grid (implies the fixup).
    pub stream_k: bool,
    /// Stream-K: blocks launched per SM (as many as fit at once).
    pub resident_per_sm: usize,
    /// K elements per staged tile (the kernel's BK).
    pub bk: usize,
}

const K_TILE: usize = 64;
const V1: TileConfig = TileConfig {
    kernel: "gemm_bf16_v1",
    bm: 128,
    bn: 128,
    threads: 128,
    stages: 3,
    split_k: false,
    align_slack: 0,
    tma: false,
    persistent: false,
    fixup: false,
    stream_k: false,
    resident_per_sm: 3,
    bk: K_TILE,
};
const V2: TileConfig = TileConfig { kernel: "gemm_bf16_v2", bm: 128, bn: 256, threads: 256, ..V1 };
const SKINNY: TileConfig = TileConfig { kernel: "gemm_bf16_skinny", bm: 16, bn: 128, stages: 4, ..V1 };
const SKINNY_SPLIT: TileConfig = TileConfig { kernel: "gemm_bf16_skinny_splitk", split_k: true, ..SKINNY };
const SKINNY_SPLIT_FIXUP: TileConfig =
    TileConfig { kernel: "gemm_bf16_skinny_splitk_fixup", fixup: true, ..SKINNY_SPLIT };
const SKINNY_STREAMK: TileConfig =
    TileConfig { kernel: "gemm_bf16_skinny_streamk", fixup: true, stream_k: true, ..SKINNY_SPLIT };
const SKINNY_STREAMK_PIPELINED: TileConfig = TileConfig { kernel: "gemm_bf16_skinny_streamk_v2", ..SKINNY_STREAMK };
/// 16×64 tiles, 6 stages (61 KB): three blocks per SM.
const SKINNY64_STREAMK: TileConfig =
    TileConfig { kernel: "gemm_bf16_skinny64_streamk", bn: 64, stages: 6, ..SKINNY_STREAMK };
/// 16×32 tiles on two warps, 8 stages (48 KB): four blocks per SM.
const SKINNY32_STREAMK: TileConfig = TileConfig {
    kernel: "gemm_bf16_skinny32_streamk",
    bn: 32,
    threads: 64,
    stages: 8,
    resident_per_sm: 4,
    ..SKINNY_STREAMK
};
/// No ring (stages 0): 8 warps × 2 n8 tiles × 32 lanes × 16 bytes of sums.
const GEMV: TileConfig =
    TileConfig { kernel: "gemv_bf16_n16", bm: 16, bn: 16, threads: 256, stages: 0, align_slack: 8 * 2 * 32 * 16, ..V1 };
const SKINNY64: TileConfig = TileConfig { kernel: "gemm_bf16_skinny64", bm: 16, bn: 64, stages: 6, ..V1 };
const SKINNY64_SPLIT: TileConfig = TileConfig { kernel: "gemm_bf16_skinny64_splitk", split_k: true, ..SKINNY64 };
/// 16×128 tiles 128 deep in K (256 contiguous bytes per weight row and stage), 3
/// stages (108 KB): two blocks per SM.
const SKINNY_K128: TileConfig =
    TileConfig { kernel: "gemm_bf16_skinny_k128", stages: 3, resident_per_sm: 2, bk: 128, ..SKINNY };
const SKINNY_K128_SPLIT: TileConfig =
    TileConfig { kernel: "gemm_bf16_skinny_k128_splitk", split_k: true, ..SKINNY_K128 };
const SKINNY_K128_SPLIT_FIXUP: TileConfig =
    TileConfig { kernel: "gemm_bf16_skinny_k128_splitk_fixup", fixup: true, ..SKINNY_K128_SPLIT };
const SKINNY_K128_STREAMK: TileConfig =
    TileConfig { kernel: "gemm_bf16_skinny_k128_streamk", fixup: true, stream_k: true, ..SKINNY_K128_SPLIT };
/// 64×128 tiles, 4 stages (96 KB): two blocks per SM.
const ROWS64: TileConfig =
    TileConfig { kernel: "gemm_bf16_rows64", bm: 64, bn: 128, stages: 4, resident_per_sm: 2, ..V1 };
const ROWS64_SPLIT: TileConfig = TileConfig { kernel: "gemm_bf16_rows64_splitk", split_k: true, ..ROWS64 };
const V1_SPLIT: TileConfig = TileConfig { kernel: "gemm_bf16_v1_splitk", split_k: true, ..V1 };
/// In the sm_90a module only (not in `kernel_table`, which lists kernels of both).
pub const WGMMA_EXP: TileConfig =
    TileConfig { kernel: "gemm_bf16_wgmma_exp", bm: 64, bn: 128, stages: 4, align_slack: 1024, ..V1 };
/// In the sm_90a module only. 1024 bytes align the ring, 64 hold 2 × 4 barriers.
pub const TMA: TileConfig = TileConfig {
    kernel: "gemm_bf16_tma",
    bm: 128,
    bn: 256,
    threads: 384,
    stages: 4,
    align_slack: 1024 + 64,
    tma: true,
    ..V1
};
pub const TMA_PERSISTENT: TileConfig = TileConfig { kernel: "gemm_bf16_tma_persistent", persistent: true, ..TMA };
pub const FINALIZE: &str = "gemm_finalize";
const FINALIZE_THREADS: u32 = 256;
/// Up to this many tokens, decode tiles (16 or 64 rows) waste less than a 128-row one.
const SKINNY_MAX_M: usize = 64;
/// Split-K aims for this many blocks per SM.
const SPLIT_TARGET_PER_SM: usize = 3;

/// Split-K's split count for `blocks` tiles of `k_tiles` K tiles, and how well
/// the grid fills its last wave of `per_sm` (at most [`SPLIT_TARGET_PER_SM`]) blocks per SM. Blocks
/// do equal work, so the most splits that still fit one wave, if that wave is
/// ≥ 90% full (the t1 down GEMM: 32 tiles × 12 = 384 of 396, where 13 splits
/// made 1.05 waves); otherwise enough blocks to cover every SM a few times.
/// Each block still streams at least two K tiles.
fn split_fill(blocks: usize, k_tiles: usize, sm_count: usize, per_sm: usize) -> (usize, f64) {
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

/// Every GEMM kernel with its block size (for the PTX consistency test).
pub fn kernel_table() -> Vec<(&'static str, u32)> {
    let mut all: Vec<_> = [
        V1,
        V2,
        SKINNY,
        SKINNY_SPLIT,
        SKINNY_SPLIT_FIXUP,
        SKINNY_STREAMK,
        SKINNY_STREAMK_PIPELINED,
        SKINNY64_STREAMK,
        SKINNY32_STREAMK,
        GEMV,
        ROWS64,
        ROWS64_SPLIT,
        SKINNY_K128,
        SKINNY_K128_SPLIT,
        SKINNY_K128_SPLIT_FIXUP,
        SKINNY_K128_STREAMK,
        SKINNY64,
        SKINNY64_SPLIT,
        V1_SPLIT,
    ]
    .iter()
    .map(|c| (c.kernel, c.threads))
    .collect();
    all.push((FINALIZE, FINALIZE_THREADS));
    all
}

/// Whether a GEMM may overlap the kernel before it in the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlap {
    /// Plain stream order.
    None,
    /// `w` is resident (no kernel writes it): on Hopper the GEMM is launched as a
    /// programmatic dependent of the previous kernel, and its first weight tiles
    /// load while that kernel finishes; X is read only after it has completed.
    ResidentWeights,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    Plain,
    Residual,
    SwiGlu,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GemmPlan {
    pub tiles: TileConfig,
    pub grid: (u32, u32, u32),
    pub smem: u32,
    /// K elements per split (K itself without split-K).
    pub k_split: u32,
    pub m: u32,
    pub n: u32,
    pub k: u32,
}

/// Validates a GEMM and its epilogue's tensors and picks the tile configuration
/// for a GPU with `sm_count` SMs. Pure: no GPU needed.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    x: &[usize],
    w: &[usize],
    out: &[usize],
    residual: Option<&[usize]>,
    ep: Epilogue,
    version: GemmVersion,
    sm_count: usize,
    arch: Arch,
) -> Result<GemmPlan> {
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
    super::same_shape(op, "output", &[m, out_cols], out)?;
    match (ep, residual) {
        (Epilogue::Residual, Some(r)) => super::same_shape(op, "residual", &[m, n], r)?,
        (Epilogue::Residual, None) => {
            return Err(Error::InvalidArgument(format!("{op}: residual epilogue needs a residual")))
        }
        _ => {}
    }
    let limit = u32::MAX as usize / 2;
    if m > 65535 * 16 || n > limit || k > limit || m.checked_mul(k).is_none_or(|e| e > isize::MAX as usize / 2) {
        return Err(Error::TooLarge(format!("{op}: [{m}, {k}] × [{n}, {k}]")));
    }
    let tiles = match version {
        GemmVersion::V1 => V1,
        GemmVersion::V2 => V2,
        GemmVersion::Skinny => SKINNY,
        GemmVersion::SkinnySplitK => SKINNY_SPLIT,
        GemmVersion::SkinnySplitKFixup => SKINNY_SPLIT_FIXUP,
        GemmVersion::SkinnyStreamK => SKINNY_STREAMK,
        GemmVersion::SkinnyStreamKPipelined => SKINNY_STREAMK_PIPELINED,
        GemmVersion::Skinny64StreamK => SKINNY64_STREAMK,
        GemmVersion::Skinny32StreamK => SKINNY32_STREAMK,
        GemmVersion::Gemv => GEMV,
        GemmVersion::SkinnyK128SplitK => SKINNY_K128_SPLIT,
        GemmVersion::SkinnyK128StreamK => SKINNY_K128_STREAMK,
        GemmVersion::SkinnyK128 => SKINNY_K128,
        GemmVersion::SkinnyK128SplitKFixup => SKINNY_K128_SPLIT_FIXUP,
        GemmVersion::SkinnyK128Fill => k128_fill(m, n, sm_count, SKINNY_K128_SPLIT),
        GemmVersion::SkinnyK128FillFixup => k128_fill(m, n, sm_count, SKINNY_K128_SPLIT_FIXUP),
        GemmVersion::Rows64 => ROWS64,
        GemmVersion::Rows64SplitK => ROWS64_SPLIT,
        GemmVersion::Skinny64 => SKINNY64,
        GemmVersion::Skinny64SplitK => SKINNY64_SPLIT,
        GemmVersion::V1SplitK => V1_SPLIT,
        GemmVersion::WgmmaExperimental | GemmVersion::Tma | GemmVersion::TmaPersistent if arch != Arch::Sm90a => {
            return Err(Error::InvalidArgument(format!("{op}: {version:?} runs on sm_90a (H100/H200) only")))
        }
        GemmVersion::WgmmaExperimental => WGMMA_EXP,
        GemmVersion::Tma => TMA,
        GemmVersion::TmaPersistent => TMA_PERSISTENT,
        // Decode, Hopper: 16×128 tiles 128 deep in K (256 contiguous bytes per
        // weight row and stage), split only where the tiles leave a wave idle
        // (`SkinnyK128Fill`). H200, MLP by events (session 7, one run): t1 0.0890
        // ms and t16 0.0934 against 0.0905 and 0.1014 with every GEMM split; ncu
        // t16 gate/up 58.4 µs with no finalize (split: 59.3 + 11.1). Its 108 KB of
        // stages exceed the 99 KB per block of sm_86/89/120.
        GemmVersion::Auto if m <= SKINNY.bm && arch == Arch::Sm90a => k128_fill(m, n, sm_count, SKINNY_K128_SPLIT),
        // Elsewhere 16×128 tiles 64 deep. One token: stream-K's grid is always one
        // full wave, but its blocks drain their ring at each tile boundary: where a
        // split-K grid fills one wave as well, split-K wins (t1 down GEMM by ncu:
        // 29.6 against 34.5 µs); where it does not (gate/up: 224 tiles, 1.13
        // waves), stream-K (59.4 against 62.3 µs). At 16 tokens split-K.
        GemmVersion::Auto
            if m == 1
                && split_fill(n.div_ceil(SKINNY.bn), k.div_ceil(SKINNY.bk), sm_count, SKINNY.resident_per_sm).1
                    < 0.9 =>
        {
            SKINNY_STREAMK
        }
        GemmVersion::Auto if m <= SKINNY.bm => SKINNY_SPLIT,
        // 17 to 64 tokens: 16-row tiles would stream each weight tile once per
        // 16 rows (the layer's decode step at b64 moved its weights at 1.2 TB/s).
        GemmVersion::Auto if m <= SKINNY_MAX_M => ROWS64_SPLIT,
        // Split only when the tiles alone leave SMs idle: the split costs a
        // finalize launch and a round trip through the f32 workspace.
        // Hopper, enough 128×256 tiles to fill the SMs: TMA + wgmma.
        GemmVersion::Auto if arch == Arch::Sm90a && n.div_ceil(TMA.bn) * m.div_ceil(TMA.bm) >= sm_count => {
            TMA_PERSISTENT
        }
        GemmVersion::Auto => {
            if n.div_ceil(128) * m.div_ceil(128) >= sm_count {
                V1
            } else {
                V1_SPLIT
            }
        }
    };
    let blocks = n.div_ceil(tiles.bn) * m.div_ceil(tiles.bm);
    let k_tiles = k.div_ceil(tiles.bk);
    let (mut splits, mut k_split) = (1, k);
    if tiles.split_k && !tiles.stream_k {
        k_split = k_tiles.div_ceil(split_fill(blocks, k_tiles, sm_count, tiles.resident_per_sm).0) * tiles.bk;
        splits = k.div_ceil(k_split);
    }
    if splits > 65535 || m.div_ceil(tiles.bm) > 65535 {
        return Err(Error::TooLarge(format!("{op}: grid for [{m}, {k}] × [{n}, {k}]")));
    }
    let grid = if tiles.stream_k {
        // Resident blocks only: a second wave would bring the tail back.
        let iterations = blocks * k_tiles;
        ((tiles.resident_per_sm * sm_count.max(1)).min(iterations) as u32, 1, 1)
    } else if tiles.persistent {
        ((n.div_ceil(tiles.bn) * m.div_ceil(tiles.bm)).min(sm_count.max(1)) as u32, 1, 1)
    } else if tiles.tma {
        ((n.div_ceil(tiles.bn) * m.div_ceil(tiles.bm)) as u32, 1, 1)
    } else {
        (n.div_ceil(tiles.bn) as u32, m.div_ceil(tiles.bm) as u32, splits as u32)
    };
    Ok(GemmPlan {
        tiles,
        grid,
        smem: (tiles.stages * (tiles.bm + tiles.bn) * tiles.bk * 2 + tiles.align_slack) as u32,
        k_split: k_split as u32,
        m: m as u32,
        n: n as u32,
        k: k as u32,
    })
}

/// The 128-deep 16-row tiles without a split where they alone fill at least 80%
/// of one wave of resident blocks (decode gate/up: 224 tiles for 264 slots):
/// no finalize launch and no f32 partial sums; else `split`.
fn k128_fill(m: usize, n: usize, sm_count: usize, split: TileConfig) -> TileConfig {
    let tiles = n.div_ceil(SKINNY_K128.bn) * m.div_ceil(SKINNY_K128.bm);
    if 5 * tiles >= 4 * SKINNY_K128.resident_per_sm * sm_count.max(1) {
        SKINNY_K128
    } else {
        split
    }
}

/// Launches the plan; returns the split-K workspace address (0 without a split).
#[allow(clippy::too_many_arguments)]
fn launch(
    gpu: &Gpu,
    p: &GemmPlan,
    x: u64,
    w: u64,
    out: u64,
    residual: u64,
    ep: Epilogue,
    overlap: Overlap,
    finalize: bool,
) -> Result<u64> {
    // Split-K sums [m, n] f32; with the in-kernel fixup, then one u32 counter per tile.
    let tiles = (p.m as usize).div_ceil(p.tiles.bm) * (p.n as usize).div_ceil(p.tiles.bn);
    let counters = if p.tiles.fixup { tiles } else { 0 };
    let workspace = if p.tiles.split_k { gpu.zeroed_workspace_f32(p.m as usize * p.n as usize + counters)? } else { 0 };
    let args = abi::GemmArgs {
        x,
        w,
        out,
        residual,
        m: p.m,
        n: p.n,
        k: p.k,
        epilogue: match ep {
            Epilogue::Plain => epilogue::PLAIN,
            Epilogue::Residual => epilogue::RESIDUAL,
            Epilogue::SwiGlu => epilogue::SWIGLU,
        },
        k_split: p.k_split,
        _pad: 0,
        workspace,
    };
    if p.tiles.tma {
        let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
        let map_x = gpu.tensor_map(Bf16Box { ptr: x, rows: m, cols: k, box_rows: p.tiles.bm as u32 })?;
        let map_w = gpu.tensor_map(Bf16Box { ptr: w, rows: n, cols: k, box_rows: p.tiles.bn as u32 })?;
        let args = abi::GemmTmaArgs { gemm: args, map_x, map_w };
        // SAFETY: as below; the maps describe exactly x [m, k] and w [n, k].
        unsafe { gpu.launch(crate::kernels::lookup(p.tiles.kernel)?, p.grid, p.tiles.threads, p.smem, &args)? };
        return Ok(workspace);
    }
    // SAFETY: plan() checked every tensor against m, n, k and the epilogue; the
    // workspace holds m × n zeroed f32 (and the fixup's counters), zeroed again by
    // `gemm_finalize` or by each tile's last block.
    unsafe {
        // The mma.sync kernels load W before `wait_for_prior_grids` and everything
        // else after it (kernels/src/gemm.rs); the TMA kernels do not wait.
        if overlap == Overlap::ResidentWeights {
            gpu.launch_after(crate::kernels::lookup(p.tiles.kernel)?, p.grid, p.tiles.threads, p.smem, &args)?;
        } else {
            gpu.launch(crate::kernels::lookup(p.tiles.kernel)?, p.grid, p.tiles.threads, p.smem, &args)?;
        }
        if p.tiles.split_k && !p.tiles.fixup && finalize {
            // Column pairs along x, rows along y (the kernel strides rows past 65535).
            // It waits for the split kernel before reading: always safe to overlap.
            let grid = ((p.n / 2).div_ceil(FINALIZE_THREADS), p.m.min(65535), 1);
            gpu.launch_after(crate::kernels::GEMM_FINALIZE, grid, FINALIZE_THREADS, 0, &args)?;
        }
    }
    Ok(workspace)
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
    unsafe { linear_ex(gpu, x, w, residual, out, ep, version, Overlap::None) }
}

/// [`linear_with`] with a choice of [`Overlap`] with the previous kernel.
///
/// # Safety
/// With [`Overlap::ResidentWeights`], `w` must not be written by the kernel queued
/// just before this call on the GPU's stream (nor by any still running): the GEMM
/// may read it before that kernel has finished.
#[allow(clippy::too_many_arguments)]
pub unsafe fn linear_ex(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    residual: Option<&Tensor<bf16>>,
    out: &mut Tensor<bf16>,
    ep: Epilogue,
    version: GemmVersion,
    overlap: Overlap,
) -> Result<()> {
    let p = plan(
        x.shape(),
        w.shape(),
        out.shape(),
        residual.map(|r| r.shape()),
        ep,
        version,
        gpu.info().sm_count as usize,
        gpu.info().arch,
    )?;
    let (x, w, out, r) = (x.device_ptr(), w.device_ptr(), out.device_ptr(), residual.map_or(0, |r| r.device_ptr()));
    // The TMA and wgmma kernels have no wait: they always take plain stream order.
    let waits = !p.tiles.tma && p.tiles.kernel != WGMMA_EXP.kernel;
    let overlap = if waits { overlap } else { Overlap::None };
    launch(gpu, &p, x, w, out, r, ep, overlap, true).map(|_| ())
}

/// x·wᵀ as split-K sums left in the GEMM workspace, for a kernel that finishes
/// them itself (the decode step's RoPE + KV write): where Auto's plan splits K
/// with a `gemm_finalize` launch, launches only the split kernel and returns the
/// workspace address of the `[m, n]` f32 sums. The caller's next launch must read
/// all of them and leave them zero. Elsewhere launches nothing and returns None.
///
/// # Safety
/// As [`linear_ex`]; and the workspace must be finished (read and zeroed) before
/// any other GEMM runs.
pub(crate) unsafe fn linear_split_sums(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    overlap: Overlap,
) -> Result<Option<u64>> {
    let (m, n) = (x.shape()[0], w.shape()[0]);
    let (sm_count, arch) = (gpu.info().sm_count as usize, gpu.info().arch);
    let p = plan(x.shape(), w.shape(), &[m, n], None, Epilogue::Plain, GemmVersion::Auto, sm_count, arch)?;
    if !p.tiles.split_k || p.tiles.fixup || p.tiles.stream_k || p.tiles.tma {
        return Ok(None);
    }
    launch(gpu, &p, x.device_ptr(), w.device_ptr(), 0, 0, Epilogue::Plain, overlap, false).map(Some)
}

/// out = x·wᵀ
pub fn linear(gpu: &Gpu, x: &Tensor<bf16>, w: &Tensor<bf16>, out: &mut Tensor<bf16>) -> Result<()> {
    linear_with(gpu, x, w, None, out, Epilogue::Plain, GemmVersion::Auto)
}

/// out = residual + x·wᵀ (the O and down projections).
pub fn linear_residual(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    residual: &Tensor<bf16>,
    out: &mut Tensor<bf16>,
) -> Result<()> {
    linear_with(gpu, x, w, Some(residual), out, Epilogue::Residual, GemmVersion::Auto)
}

/// out = SiLU(x·W_gateᵀ) ⊙ (x·W_upᵀ) from one GEMM over `w_gate_up`, whose rows
/// interleave gate and up (see [`interleave_gate_up`]); out is `[M, N/2]`.
pub fn linear_swiglu(gpu: &Gpu, x: &Tensor<bf16>, w_gate_up: &Tensor<bf16>, out: &mut Tensor<bf16>) -> Result<()> {
    linear_with(gpu, x, w_gate_up, None, out, Epilogue::SwiGlu, GemmVersion::Auto)
}

/// Rows `[gate_0, up_0, gate_1, up_1, …]` from `[ff, d]` gate and up weights, so
/// every output tile holds matching gate/up pairs for the SwiGLU epilogue.
pub fn interleave_gate_up<T: Copy>(gate: &[T], up: &[T], d: usize) -> Result<Vec<T>> {
    if gate.len() != up.len() || d == 0 || !gate.len().is_multiple_of(d) {
        return Err(Error::Shape(format!("gate ({}) and up ({}) must both be [ff, {d}]", gate.len(), up.len())));
    }
    let mut out = Vec::with_capacity(2 * gate.len());
    for (g, u) in gate.chunks(d).zip(up.chunks(d)) {
        out.extend_from_slice(g);
        out.extend_from_slice(u);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(x: &[usize], w: &[usize], out: &[usize], r: Option<&[usize]>, ep: Epilogue) -> Result<GemmPlan> {
        plan(x, w, out, r, ep, GemmVersion::Auto, 132, Arch::Sm80)
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
        // Auto at one token off Hopper: stream-K on gate/up, split-K on down; on
        // Hopper 128-deep tiles, unsplit on gate/up (224 tiles), split on down.
        let auto = |n: usize, k: usize, arch| {
            plan(&[1, k], &[n, k], &[1, n], None, Epilogue::Plain, GemmVersion::Auto, 132, arch).unwrap().tiles.kernel
        };
        assert_eq!(auto(28672, 4096, Arch::Sm80), SKINNY_STREAMK.kernel);
        assert_eq!(auto(4096, 14336, Arch::Sm80), SKINNY_SPLIT.kernel);
        assert_eq!(auto(28672, 4096, Arch::Sm90a), SKINNY_K128.kernel);
        assert_eq!(auto(4096, 14336, Arch::Sm90a), SKINNY_K128_SPLIT.kernel);
        // 17 to 64 tokens: 64-row tiles, two blocks per SM (the down GEMM: 8 splits).
        let p64 =
            plan(&[64, 14336], &[4096, 14336], &[64, 4096], None, Epilogue::Plain, GemmVersion::Auto, 132, Arch::Sm90a)
                .unwrap();
        assert_eq!((p64.tiles.kernel, p64.grid), (ROWS64_SPLIT.kernel, (32, 1, 8)));
        // 128-deep K tiles: 112 of them on the down GEMM, 8 splits of 14 (two blocks per SM).
        let k128 = plan(
            &[1, 14336],
            &[4096, 14336],
            &[1, 4096],
            None,
            Epilogue::Plain,
            GemmVersion::SkinnyK128SplitK,
            132,
            Arch::Sm90a,
        )
        .unwrap();
        assert_eq!((k128.grid, k128.k_split, k128.smem), ((32, 1, 8), 1792, 3 * 144 * 128 * 2));
        // Fill: gate/up's 224 tiles fill 85% of the 264 slots, no split; down splits.
        let fill = |n: usize, k: usize| {
            let p =
                plan(&[16, k], &[n, k], &[16, n], None, Epilogue::Plain, GemmVersion::SkinnyK128Fill, 132, Arch::Sm90a)
                    .unwrap();
            (p.tiles.kernel, p.grid)
        };
        assert_eq!(fill(28672, 4096), (SKINNY_K128.kernel, (224, 1, 1)));
        assert_eq!(fill(4096, 14336), (SKINNY_K128_SPLIT.kernel, (32, 1, 8)));
    }

    #[test]
    fn validates_shapes_and_alignment() {
        let small = p(&[3, 72], &[100, 72], &[3, 100], None, Epilogue::Plain).unwrap();
        assert_eq!((small.tiles.kernel, small.grid), ("gemm_bf16_skinny_splitk", (1, 1, 1)));
        let big = p(&[2049, 4096], &[28672, 4096], &[2049, 14336], None, Epilogue::SwiGlu).unwrap();
        assert_eq!((big.tiles.kernel, big.grid), ("gemm_bf16_v1", (224, 17, 1)));
        assert!(matches!(p(&[3, 70], &[100, 70], &[3, 100], None, Epilogue::Plain), Err(Error::Alignment(_))));
        assert!(matches!(p(&[3, 72], &[101, 72], &[3, 101], None, Epilogue::Plain), Err(Error::Alignment(_))));
        assert!(matches!(p(&[3, 72], &[100, 64], &[3, 100], None, Epilogue::Plain), Err(Error::Shape(_))));
        assert!(matches!(p(&[3, 72], &[100, 72], &[3, 100], None, Epilogue::SwiGlu), Err(Error::Shape(_))));
        assert!(matches!(p(&[3, 72], &[100, 72], &[3, 100], None, Epilogue::Residual), Err(Error::InvalidArgument(_))));
        assert!(matches!(p(&[0, 72], &[100, 72], &[0, 100], None, Epilogue::Plain), Err(Error::Empty(_))));
    }

    #[test]
    fn decode_shapes_split_k_over_the_sms() {
        // Down projection: 32 column blocks, K = 14336 split 12 ways (one wave of 396).
        let d = p(&[2, 14336], &[4096, 14336], &[2, 4096], Some(&[2, 4096]), Epilogue::Residual).unwrap();
        assert_eq!((d.tiles.kernel, d.grid, d.k_split), ("gemm_bf16_skinny_splitk", (32, 1, 12), 1216));
        let one = p(&[1, 14336], &[4096, 14336], &[1, 4096], Some(&[1, 4096]), Epilogue::Residual).unwrap();
        assert_eq!(one.tiles.kernel, "gemm_bf16_skinny_splitk");
        let gu = p(&[16, 4096], &[28672, 4096], &[16, 14336], None, Epilogue::SwiGlu).unwrap();
        assert_eq!((gu.grid, gu.k_split), ((224, 1, 2), 2048));
        // 128 tokens, down projection: 32 blocks of 128×128, so split K.
        let d = p(&[128, 14336], &[4096, 14336], &[128, 4096], Some(&[128, 4096]), Epilogue::Residual).unwrap();
        assert_eq!((d.tiles.kernel, d.grid.2), ("gemm_bf16_v1_splitk", 12));
    }

    #[test]
    fn stream_k_takes_resident_blocks_only() {
        let at = |m, n, k| {
            plan(&[m, k], &[n, k], &[m, n], None, Epilogue::Plain, GemmVersion::SkinnyStreamK, 132, Arch::Sm90a)
                .unwrap()
        };
        // 224 tiles × 64 K tiles over 3 blocks per SM; a tiny GEMM gets one block
        // per iteration.
        assert_eq!(at(1, 28672, 4096).grid, (396, 1, 1));
        assert_eq!(at(3, 264, 1160).grid, (57, 1, 1));
        // Narrow tiles: four 48 KB blocks of 16×32 per SM; 16×64 keeps three.
        let p32 = plan(
            &[16, 14336],
            &[4096, 14336],
            &[16, 4096],
            None,
            Epilogue::Plain,
            GemmVersion::Skinny32StreamK,
            132,
            Arch::Sm90a,
        )
        .unwrap();
        assert_eq!((p32.grid, p32.tiles.threads, p32.smem), ((528, 1, 1), 64, 8 * 48 * 64 * 2));
        let p64 = plan(
            &[16, 14336],
            &[4096, 14336],
            &[16, 4096],
            None,
            Epilogue::Plain,
            GemmVersion::Skinny64StreamK,
            132,
            Arch::Sm90a,
        )
        .unwrap();
        assert_eq!((p64.grid, p64.smem), ((396, 1, 1), 6 * 80 * 64 * 2));
    }

    #[test]
    fn gemv_takes_16_columns_per_block_over_all_of_k() {
        let g =
            plan(&[16, 14336], &[4096, 14336], &[16, 4096], None, Epilogue::Plain, GemmVersion::Gemv, 132, Arch::Sm90a)
                .unwrap();
        assert_eq!((g.grid, g.tiles.threads, g.smem, g.k_split), ((256, 1, 1), 256, 8192, 14336));
        let tall =
            plan(&[17, 72], &[100, 72], &[17, 100], None, Epilogue::Plain, GemmVersion::Gemv, 132, Arch::Sm80).unwrap();
        assert_eq!(tall.grid, (7, 2, 1));
    }

    #[test]
    fn hopper_takes_tma_when_its_tiles_fill_the_sms() {
        let h =
            |x: &[usize], w: &[usize], out: &[usize], v| plan(x, w, out, None, Epilogue::Plain, v, 132, Arch::Sm90a);
        let big = h(&[2049, 4096], &[28672, 4096], &[2049, 28672], GemmVersion::Auto).unwrap();
        assert_eq!((big.tiles.kernel, big.grid), ("gemm_bf16_tma_persistent", (132, 1, 1)));
        let one = h(&[2049, 4096], &[28672, 4096], &[2049, 28672], GemmVersion::Tma).unwrap();
        assert_eq!((one.tiles.kernel, one.grid), ("gemm_bf16_tma", (17 * 112, 1, 1)));
        // 16 × 2 tiles of 128×256 cannot fill 132 SMs: the split-K path instead.
        let few = h(&[2048, 4096], &[512, 4096], &[2048, 512], GemmVersion::Auto).unwrap();
        assert_eq!(few.tiles.kernel, "gemm_bf16_v1_splitk");
        let old = p(&[2048, 4096], &[28672, 4096], &[2048, 28672], None, Epilogue::Plain);
        assert!(matches!(
            plan(&[8, 64], &[8, 64], &[8, 8], None, Epilogue::Plain, GemmVersion::Tma, 132, Arch::Sm80),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(old.unwrap().tiles.kernel, "gemm_bf16_v1");
    }

    #[test]
    fn interleaves_rows() {
        assert_eq!(interleave_gate_up(&[1, 2, 3, 4], &[5, 6, 7, 8], 2).unwrap(), vec![1, 2, 5, 6, 3, 4, 7, 8]);
        assert!(interleave_gate_up(&[1, 2, 3], &[5, 6, 7, 8], 2).is_err());
    }
}
