//! Checks a call's shapes against its batch and sizes the launch. Pure: no GPU.

use super::batch::BatchDims;
use crate::error::{Error, Result};
use crate::kernels;
use crate::runtime::{Arch, Kernel};
use abi::attention::{Tile, HOPPER, HOPPER_HD256, HOPPER_HD256_N128, HOPPER_M192, V2_HD128, V2_HD64};

/// Most query heads: one grid x-slice each, and the tensor maps' head dimension
/// stays below 2^16.
pub const MAX_HEADS: usize = 65535;
/// Most query tiles of one sequence (the grid's y dimension).
const MAX_QUERY_TILES: usize = 65535;
/// Most tiles a persistent kernel walks: its 32-bit tile index, stepped by the
/// grid, stays below 2^32.
const MAX_WALKED_TILES: u64 = 1 << 31;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionOptions {
    pub causal: bool,
    /// Softmax scale; `None` means 1/√head_dim.
    pub scale: Option<f32>,
}

impl Default for AttentionOptions {
    fn default() -> Self {
        AttentionOptions { causal: true, scale: None }
    }
}

/// The shapes of a call's tensors, as [`plan`] checks them.
#[derive(Clone, Copy, Debug)]
pub struct Shapes<'a> {
    pub q: &'a [usize],
    pub k: &'a [usize],
    pub v: &'a [usize],
    pub o: &'a [usize],
    pub lse: &'a [usize],
}

/// The head dims the kernels are built for (256: on sm_90a only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadDim {
    D64,
    D128,
    D256,
}

impl HeadDim {
    pub fn elements(self) -> usize {
        match self {
            HeadDim::D64 => 64,
            HeadDim::D128 => 128,
            HeadDim::D256 => 256,
        }
    }
}

/// A call that passed every check: what the launch needs besides the kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Problem {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: HeadDim,
    pub causal: bool,
    pub scale: f32,
}

/// The entry a plan launches, by the parameter block it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKernel {
    /// The mma.sync kernels: Q, K, V through cp.async.
    Mma(Kernel<abi::FlashArgs>),
    /// The Hopper kernels: Q, K, V through TMA tensor maps.
    Tma(Kernel<abi::FlashTmaArgs>),
    /// A Hopper kernel on at most one block per SM, each walking the tile grid.
    TmaPersistent(Kernel<abi::FlashTmaArgs>),
}

impl FlashKernel {
    pub fn name(self) -> &'static str {
        match self {
            FlashKernel::Mma(k) => k.name(),
            FlashKernel::Tma(k) | FlashKernel::TmaPersistent(k) => k.name(),
        }
    }

    pub fn max_threads(self) -> u32 {
        match self {
            FlashKernel::Mma(k) => k.max_threads(),
            FlashKernel::Tma(k) | FlashKernel::TmaPersistent(k) => k.max_threads(),
        }
    }
}

/// One launch, fully sized.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashPlan {
    pub kernel: FlashKernel,
    pub tile: Tile,
    pub problem: Problem,
    /// (heads, query tiles of the longest sequence, sequences).
    pub grid: (u32, u32, u32),
    pub threads: u32,
    /// Dynamic shared memory in bytes.
    pub smem: u32,
    /// The kernel stages O in shared memory and stores it by TMA (it takes a
    /// map over O).
    pub stages_o: bool,
}

/// K and V bytes one section of a walking kernel holds: most of the H200's
/// 50 MB L2, the rest left to Q, O and the tiles in flight.
const L2_SECTION_BYTES: u64 = 32 << 20;

impl FlashPlan {
    /// Tiles in the grid (heads × query tiles × sequences).
    pub fn tiles(&self) -> u64 {
        self.grid.0 as u64 * self.grid.1 as u64 * self.grid.2 as u64
    }

    /// (sequence, head) pairs per section of a walking kernel: the query heads
    /// of as many KV heads as fit in 32 MiB (most of the L2) at the batch's mean
    /// key length, so that every query tile reading a K/V head runs while it is
    /// in L2. At least 1, at most every pair.
    pub fn section_pairs(&self, batch: BatchDims) -> u32 {
        let p = &self.problem;
        let mean_keys = (batch.total_k as u64).div_ceil(batch.sequences.max(1) as u64).max(1);
        let kv_head_bytes = mean_keys * p.head_dim.elements() as u64 * 2 * 2;
        let kv_heads = (L2_SECTION_BYTES / kv_head_bytes).max(1);
        let pairs = self.grid.0 as u64 * self.grid.2 as u64;
        (kv_heads * (p.heads / p.kv_heads) as u64).min(pairs).max(1) as u32
    }
}

/// The shipped launch of `shapes` over `batch` on `arch`: the Hopper kernels on
/// sm_90a, the mma.sync kernels with spill-free tiles elsewhere.
pub fn plan(arch: Arch, shapes: Shapes, batch: BatchDims, opts: AttentionOptions) -> Result<FlashPlan> {
    shipped_plan(arch, check(shapes, batch, opts)?, batch)
}

/// The shipped kernel sized for a checked problem: the walk [`walk`] picks,
/// where its tile index reaches the grid, else one tile per block.
pub(crate) fn shipped_plan(arch: Arch, problem: Problem, batch: BatchDims) -> Result<FlashPlan> {
    let walk = walk(problem.head_dim, problem.causal, batch.max_q);
    let on = |walk| consumers(problem.head_dim, problem.causal, batch.max_q, walk);
    let (kernel, tile) = shipped_kernel(arch, problem.head_dim, walk, on(walk))?;
    match sized(problem, batch, kernel, tile) {
        Err(Error::TooLarge(_)) if walk != Walk::OneTile => {
            let (kernel, tile) = shipped_kernel(arch, problem.head_dim, Walk::OneTile, on(Walk::OneTile))?;
            sized(problem, batch, kernel, tile)
        }
        plan => plan,
    }
}

/// How the sm_90a kernel's blocks take their query tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Walk {
    /// One tile per block, the grid's; the block scheduler hands them out.
    OneTile,
    /// At most one block per SM, block b taking walk tiles b, b + grid, …
    /// (longest first within L2-sized sections).
    Strided,
    /// The walk's order, each block taking its next tile from the GPU's tile
    /// counter as it finishes the last: the longest tiles first, and no SM
    /// idle while another still has a share to run.
    Counter,
}

/// The sm_90a walk, as measured side by side (interleaved): the counter
/// wherever tiles differ in length or are short (causal up to 8192 queries
/// at head dims 64 and 128, 2048 at 256; head dim 64 up to 4096 without a
/// mask); the strided walk over equal tiles at head dims 128 and 256 (the
/// counter's fetches cost ≈ 1%); one tile per block on long sequences, where
/// the block scheduler balances as well and the last tiles are short anyway.
pub(crate) fn walk(head_dim: HeadDim, causal: bool, max_q: usize) -> Walk {
    match (head_dim, causal) {
        (HeadDim::D64, false) if max_q <= 4096 => Walk::Counter,
        (HeadDim::D64 | HeadDim::D128, true) if max_q <= 8192 => Walk::Counter,
        (HeadDim::D256, true) if max_q <= 2048 => Walk::Counter,
        (HeadDim::D128 | HeadDim::D256, false) => Walk::Strided,
        _ => Walk::OneTile,
    }
}

/// How the sm_90a kernel's consumer warpgroups share the SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Consumers {
    /// Each issues as soon as its tiles land; the warp schedulers interleave them.
    Free,
    /// They take turns at the exponentials of their softmax, so one's SFU work
    /// runs under the other's GEMMs and they stay half a tile apart.
    InTurns,
    /// Each issues P·V one tile late, S(j)'s softmax under P(j−1)·V(j−1), and
    /// they take turns at issuing each tile's pair of GEMMs (FlashAttention-3's
    /// schedule).
    LatePvInTurns,
    /// They take turns at issuing each GEMM, P·V in order (head dim 256,
    /// whose registers cannot hold the late P·V's): one's softmax runs under
    /// the other's S and P·V.
    IssueInTurns,
    /// Three of them over 192-row query tiles (head dim 64, 512 threads): a
    /// third warpgroup's GEMMs run while the other two's softmax holds the
    /// SFU. In turns at the exponentials, a ring of three, on the counter walk;
    /// free on one tile per block.
    Three,
}

/// The sm_90a consumers on `walk`, as measured side by side. Head dim 128: in
/// turns at the exponentials with a causal mask from 4096 queries (ahead by
/// 1–13% at 4096–16384 in three jobs, where the late P·V in turns read within
/// ±1%); the late P·V in turns on the strided walk, the one taken without a
/// mask, from 2048 queries (ahead by 2–8% at 2048–16384, behind at 512). Head
/// dim 64: in turns at the exponentials on the counter walk (ahead by 3–5% at
/// 1024–8192 queries, causal and not; on one tile per block behind by 4%),
/// and three of them from 2048 queries without a mask and from 8192 with one
/// (ahead by 4–7% on the counter walk and 22–28% on one tile per block in two
/// jobs; behind by 5–21% at 512–1024 queries, where 192-row tiles leave SMs
/// idle, and by 1–6% causal at 2048–4096). Head dim 256: in turns at issuing
/// on the strided walk, the one it takes without a mask (ahead by 4–8% at
/// 512–16384 queries), and on one tile per block, its causal walk past 2048
/// (ahead by 2–4%); free on the counter walk (causal up to 2048). Free elsewhere.
pub(crate) fn consumers(head_dim: HeadDim, causal: bool, max_q: usize, walk: Walk) -> Consumers {
    match (head_dim, causal, walk) {
        (HeadDim::D128, false, Walk::Strided) if max_q >= 2048 => Consumers::LatePvInTurns,
        (HeadDim::D256, _, Walk::OneTile | Walk::Strided) => Consumers::IssueInTurns,
        (_, _, Walk::Strided) => Consumers::Free,
        (HeadDim::D128, true, _) if max_q >= 4096 => Consumers::InTurns,
        (HeadDim::D64, false, _) if max_q >= 2048 => Consumers::Three,
        (HeadDim::D64, true, _) if max_q >= 8192 => Consumers::Three,
        (HeadDim::D64, _, Walk::Counter) => Consumers::InTurns,
        _ => Consumers::Free,
    }
}

/// The shipped entry and its tiling for `arch` and `head_dim`: on sm_90a the
/// kernel of `walk` and `consumers` (at head dim 256 128-key tiles in one
/// stage, their consumers in turns at issuing, but 64-key tiles in two on the
/// counter walk, free); elsewhere one tile per block, whatever `walk` says, and
/// `consumers` has no meaning.
pub(crate) fn shipped_kernel(
    arch: Arch,
    head_dim: HeadDim,
    walk: Walk,
    consumers: Consumers,
) -> Result<(FlashKernel, Tile)> {
    use FlashKernel::{Tma, TmaPersistent};
    use HeadDim::{D128, D256, D64};
    if arch == Arch::Sm90a && consumers != Consumers::Free {
        return match (head_dim, walk, consumers) {
            (D64, Walk::Counter, Consumers::InTurns) => {
                Ok((TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_TURNS_COUNTER_HD64), HOPPER))
            }
            (D128, Walk::OneTile, Consumers::InTurns) => Ok((Tma(kernels::FLASH_FWD_HOPPER_WS_TURNS_HD128), HOPPER)),
            (D128, Walk::Counter, Consumers::InTurns) => {
                Ok((TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_TURNS_COUNTER_HD128), HOPPER))
            }
            (D128, Walk::Strided, Consumers::LatePvInTurns) => {
                Ok((TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_LATE_PV_TURNS_WALK_HD128), HOPPER))
            }
            (D256, Walk::OneTile, Consumers::IssueInTurns) => {
                Ok((Tma(kernels::FLASH_FWD_HOPPER_WS_ISSUE_TURNS_HD256), HOPPER_HD256_N128))
            }
            (D256, Walk::Strided, Consumers::IssueInTurns) => {
                Ok((TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_ISSUE_TURNS_WALK_HD256), HOPPER_HD256_N128))
            }
            (D64, Walk::OneTile, Consumers::Three) => Ok((Tma(kernels::FLASH_FWD_HOPPER_WS_M192_HD64), HOPPER_M192)),
            (D64, Walk::Counter, Consumers::Three) => {
                Ok((TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_M192_TURNS_COUNTER_HD64), HOPPER_M192))
            }
            _ => Err(Error::InvalidArgument(format!(
                "flash_attention: no shipped kernel with consumers {consumers:?} at head dim {} on the {walk:?} walk",
                head_dim.elements()
            ))),
        };
    }
    Ok(match (arch, head_dim, walk) {
        (Arch::Sm90a, D64, Walk::OneTile) => (Tma(kernels::FLASH_FWD_HOPPER_WS_HD64), HOPPER),
        (Arch::Sm90a, D64, Walk::Strided) => (TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_WALK_HD64), HOPPER),
        (Arch::Sm90a, D64, Walk::Counter) => {
            return Err(Error::InvalidArgument(
                "flash_attention: head dim 64 on the counter walk runs with its consumers in turns".into(),
            ))
        }
        (Arch::Sm90a, D128, Walk::OneTile) => (Tma(kernels::FLASH_FWD_HOPPER_WS_HD128), HOPPER),
        (Arch::Sm90a, D128, Walk::Strided) => (TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_WALK_HD128), HOPPER),
        (Arch::Sm90a, D128, Walk::Counter) => (TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_COUNTER_HD128), HOPPER),
        (Arch::Sm90a, D256, Walk::OneTile | Walk::Strided) => {
            return Err(Error::InvalidArgument(
                "flash_attention: head dim 256 off the counter walk runs with its consumers in turns at issuing".into(),
            ))
        }
        (Arch::Sm90a, D256, Walk::Counter) => (TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_COUNTER_HD256), HOPPER_HD256),
        (Arch::Sm80, D64, _) => (FlashKernel::Mma(kernels::FLASH_FWD_V2_HD64_BN32), V2_HD64),
        (Arch::Sm80, D128, _) => (FlashKernel::Mma(kernels::FLASH_FWD_V2_HD128_BN16), V2_HD128),
        (Arch::Sm80, D256, _) => {
            return Err(Error::InvalidArgument(
                "flash_attention: head_dim 256 runs on sm_90a (H100/H200) only; the sm_80 kernels stop at 128".into(),
            ))
        }
    })
}

/// Checks every shape and option against the batch; the plan's first step.
pub(crate) fn check(s: Shapes, batch: BatchDims, opts: AttentionOptions) -> Result<Problem> {
    let op = "flash_attention";
    let [tq, h, d] = *s.q else {
        return Err(Error::Shape(format!("{op}: q must be [tokens, heads, head_dim], got {:?}", s.q)));
    };
    let [tk, hkv, dk] = *s.k else {
        return Err(Error::Shape(format!("{op}: k must be [tokens, kv_heads, head_dim], got {:?}", s.k)));
    };
    super::super::same_shape(op, "v", s.k, s.v)?;
    super::super::same_shape(op, "output", s.q, s.o)?;
    super::super::same_shape(op, "lse", &[h, tq], s.lse)?;
    if tq != batch.total_q || tk != batch.total_k {
        return Err(Error::Shape(format!(
            "{op}: the batch holds {} queries / {} keys, the tensors {tq} / {tk}",
            batch.total_q, batch.total_k
        )));
    }
    if dk != d {
        return Err(Error::Shape(format!("{op}: q head_dim {d} but k head_dim {dk}")));
    }
    if h == 0 || hkv == 0 || tq == 0 || tk == 0 {
        return Err(Error::Empty(format!("{op}: q {:?}, k {:?}", s.q, s.k)));
    }
    if h % hkv != 0 {
        return Err(Error::Shape(format!("{op}: {h} query heads are not a multiple of {hkv} KV heads")));
    }
    if h > MAX_HEADS {
        return Err(Error::TooLarge(format!("{op}: {h} heads exceed {MAX_HEADS}")));
    }
    let head_dim = match d {
        64 => HeadDim::D64,
        128 => HeadDim::D128,
        256 => HeadDim::D256,
        _ => return Err(Error::Shape(format!("{op}: head_dim {d} is not supported (64, 128 or 256)"))),
    };
    let scale = opts.scale.unwrap_or(1.0 / (d as f32).sqrt());
    if !scale.is_finite() || scale <= 0.0 {
        return Err(Error::InvalidArgument(format!("{op}: scale must be finite and positive, got {scale}")));
    }
    Ok(Problem { heads: h, kv_heads: hkv, head_dim, causal: opts.causal, scale })
}

/// The grid, block and shared memory of `kernel` with `tile` on a checked problem.
pub(crate) fn sized(problem: Problem, batch: BatchDims, kernel: FlashKernel, tile: Tile) -> Result<FlashPlan> {
    let op = "flash_attention";
    let query_tiles = batch.max_q.div_ceil(tile.rows).max(1);
    if query_tiles > MAX_QUERY_TILES {
        return Err(Error::TooLarge(format!(
            "{op}: a sequence of {} queries needs {query_tiles} tiles of {}; the grid takes {MAX_QUERY_TILES}",
            batch.max_q, tile.rows
        )));
    }
    if batch.sequences > super::batch::MAX_SEQUENCES {
        return Err(Error::TooLarge(format!("{op}: {} sequences", batch.sequences)));
    }
    let d = problem.head_dim.elements();
    let smem = match kernel {
        FlashKernel::Mma(_) => tile.tile_bytes(d),
        FlashKernel::Tma(_) | FlashKernel::TmaPersistent(_) => abi::attention::hopper_smem(tile, d),
    };
    let grid = (problem.heads as u32, query_tiles as u32, batch.sequences as u32);
    let p = FlashPlan { kernel, tile, problem, grid, threads: tile.threads, smem: smem as u32, stages_o: false };
    if matches!(kernel, FlashKernel::TmaPersistent(_)) && p.tiles() > MAX_WALKED_TILES {
        return Err(Error::TooLarge(format!(
            "{op}: {} tiles; a persistent kernel walks at most {MAX_WALKED_TILES}",
            p.tiles()
        )));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes<'a>(q: &'a [usize], k: &'a [usize], lse: &'a [usize]) -> Shapes<'a> {
        Shapes { q, k, v: k, o: q, lse }
    }

    fn one_sequence(q: &[usize], k: &[usize]) -> BatchDims {
        BatchDims { total_q: q[0], total_k: k[0], sequences: 1, max_q: q[0] }
    }

    fn plan_for(arch: Arch, q: &[usize], k: &[usize], lse: &[usize], opts: AttentionOptions) -> Result<FlashPlan> {
        plan(arch, shapes(q, k, lse), one_sequence(q, k), opts)
    }

    #[test]
    fn picks_the_shipped_kernel_per_arch() {
        let o = AttentionOptions::default();
        let p = plan_for(Arch::Sm80, &[100, 32, 128], &[100, 8, 128], &[32, 100], o).unwrap();
        assert_eq!(p.kernel, FlashKernel::Mma(kernels::FLASH_FWD_V2_HD128_BN16));
        assert_eq!((p.grid, p.threads, p.smem), ((32, 1, 1), 128, ((128 + 4 * 16) * 128 * 2)));
        assert!((p.problem.scale - 128f32.sqrt().recip()).abs() < 1e-7);
        let p = plan_for(Arch::Sm80, &[300, 4, 64], &[300, 4, 64], &[4, 300], o).unwrap();
        assert_eq!(p.kernel, FlashKernel::Mma(kernels::FLASH_FWD_V2_HD64_BN32));
        assert_eq!((p.grid, p.smem), ((4, 3, 1), (128 + 4 * 32) * 64 * 2));
        let p = plan_for(Arch::Sm90a, &[1025, 2, 128], &[1025, 1, 128], &[2, 1025], o).unwrap();
        assert_eq!(p.kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_COUNTER_HD128));
        assert_eq!(
            (p.grid, p.threads, p.smem),
            ((2, 9, 1), 384, ((128 + 4 * 128) * 128 * 2 + 1024 + abi::attention::HOPPER_BARRIER_BYTES) as u32)
        );
        let full = AttentionOptions { causal: false, scale: None };
        let p = plan_for(Arch::Sm90a, &[129, 2, 128], &[129, 1, 128], &[2, 129], full).unwrap();
        assert_eq!(p.kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_WALK_HD128));
        let p = plan_for(Arch::Sm90a, &[1, 2, 64], &[1, 1, 64], &[2, 1], o).unwrap();
        assert_eq!(p.kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_TURNS_COUNTER_HD64));
        // Head dim 256: 128-key tiles in one stage (192 KiB) off the counter
        // walk, its consumers in turns at issuing; 64-key tiles in two on it
        // (192 KiB too).
        let barriers = 1024 + abi::attention::HOPPER_BARRIER_BYTES;
        let p = plan_for(Arch::Sm90a, &[2047, 2, 256], &[2047, 2, 256], &[2, 2047], full).unwrap();
        assert_eq!(p.kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_ISSUE_TURNS_WALK_HD256));
        assert_eq!((p.tile.keys, p.smem), (128, ((128 + 2 * 128) * 256 * 2 + barriers) as u32));
        let p = plan_for(Arch::Sm90a, &[2049, 2, 256], &[2049, 2, 256], &[2, 2049], o).unwrap();
        assert_eq!(p.kernel, FlashKernel::Tma(kernels::FLASH_FWD_HOPPER_WS_ISSUE_TURNS_HD256));
        assert_eq!(p.tile.keys, 128);
        let p = plan_for(Arch::Sm90a, &[2048, 2, 256], &[2048, 2, 256], &[2, 2048], o).unwrap();
        assert_eq!(p.kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_COUNTER_HD256));
        assert_eq!((p.tile.keys, p.smem), (64, ((128 + 4 * 64) * 256 * 2 + barriers) as u32));
    }

    #[test]
    fn sm90a_walks_by_counter_where_tiles_differ_or_are_short() {
        use HeadDim::{D128, D256, D64};
        for (d, causal, max_q, walk_taken) in [
            (D64, false, 1, Walk::Counter),
            (D64, false, 4096, Walk::Counter),
            (D64, false, 4097, Walk::OneTile),
            (D64, true, 8192, Walk::Counter),
            (D64, true, 8193, Walk::OneTile),
            (D128, false, 1, Walk::Strided),
            (D128, false, 1 << 20, Walk::Strided),
            (D128, true, 8192, Walk::Counter),
            (D128, true, 8193, Walk::OneTile),
            (D256, false, 16, Walk::Strided),
            (D256, true, 2048, Walk::Counter),
            (D256, true, 2049, Walk::OneTile),
        ] {
            assert_eq!(walk(d, causal, max_q), walk_taken, "{d:?} causal {causal} max_q {max_q}");
        }
        let causal = AttentionOptions { causal: true, scale: None };
        let long = 8193;
        let p = plan_for(Arch::Sm90a, &[long, 2, 128], &[long, 1, 128], &[2, long], causal).unwrap();
        assert_eq!(p.kernel, FlashKernel::Tma(kernels::FLASH_FWD_HOPPER_WS_TURNS_HD128));
        let p = plan_for(Arch::Sm90a, &[long, 2, 64], &[long, 1, 64], &[2, long], causal).unwrap();
        assert_eq!(p.kernel, FlashKernel::Tma(kernels::FLASH_FWD_HOPPER_WS_M192_HD64));
        let p = plan_for(Arch::Sm90a, &[1000, 2, 64], &[1000, 1, 64], &[2, 1000], causal).unwrap();
        assert_eq!(p.kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_TURNS_COUNTER_HD64));
        let p = plan_for(Arch::Sm90a, &[1025, 2, 128], &[1025, 1, 128], &[2, 1025], causal).unwrap();
        assert_eq!(p.kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_COUNTER_HD128));
    }

    #[test]
    fn sm90a_consumers_as_measured_per_head_dim_mask_and_length() {
        use HeadDim::{D128, D256, D64};
        for (d, causal, max_q, taken) in [
            (D128, true, 4095, Consumers::Free),
            (D128, true, 4096, Consumers::InTurns),
            (D128, true, 1 << 20, Consumers::InTurns),
            (D128, false, 2047, Consumers::Free),
            (D128, false, 2048, Consumers::LatePvInTurns),
            (D128, false, 1 << 20, Consumers::LatePvInTurns),
            (D64, false, 2047, Consumers::InTurns),
            (D64, false, 2048, Consumers::Three),
            (D64, false, 8192, Consumers::Three),
            (D256, false, 1, Consumers::IssueInTurns),
            (D256, false, 2048, Consumers::IssueInTurns),
            (D256, false, 1 << 20, Consumers::IssueInTurns),
            (D64, true, 8191, Consumers::InTurns),
            (D64, true, 8192, Consumers::Three),
            (D64, true, 8193, Consumers::Three),
            (D256, true, 2048, Consumers::Free),
            (D256, true, 2049, Consumers::IssueInTurns),
            (D256, true, 1 << 20, Consumers::IssueInTurns),
        ] {
            let walk_taken = walk(d, causal, max_q);
            assert_eq!(consumers(d, causal, max_q, walk_taken), taken, "{d:?} causal {causal} max_q {max_q}");
        }
        assert_eq!(consumers(D128, true, 8192, Walk::Strided), Consumers::Free);
        let causal = AttentionOptions { causal: true, scale: None };
        let at = |n: usize, kv: usize| plan_for(Arch::Sm90a, &[n, 32, 128], &[n, kv, 128], &[32, n], causal).unwrap();
        assert_eq!(at(4096, 8).kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_TURNS_COUNTER_HD128));
        assert_eq!(at(4095, 8).kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_COUNTER_HD128));
        assert_eq!(at(16384, 32).kernel, FlashKernel::Tma(kernels::FLASH_FWD_HOPPER_WS_TURNS_HD128));
        let full = AttentionOptions { causal: false, scale: None };
        let at = |n: usize| plan_for(Arch::Sm90a, &[n, 16, 128], &[n, 16, 128], &[16, n], full).unwrap();
        let late_pv_turns = FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_LATE_PV_TURNS_WALK_HD128);
        assert_eq!(at(2048).kernel, late_pv_turns);
        assert_eq!(at(2047).kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_WALK_HD128));
        // Each schedule in turns has its walks only, and the portable path has no
        // consumers to share.
        let strided = shipped_kernel(Arch::Sm90a, D128, Walk::Strided, Consumers::InTurns);
        assert!(matches!(strided, Err(Error::InvalidArgument(_))));
        let counter = shipped_kernel(Arch::Sm90a, D128, Walk::Counter, Consumers::LatePvInTurns);
        assert!(matches!(counter, Err(Error::InvalidArgument(_))));
        assert!(shipped_kernel(Arch::Sm90a, D64, Walk::Strided, Consumers::LatePvInTurns).is_err());
        assert!(shipped_kernel(Arch::Sm90a, D64, Walk::OneTile, Consumers::InTurns).is_err());
        assert!(shipped_kernel(Arch::Sm90a, D64, Walk::Counter, Consumers::Free).is_err());
        let hd64 = |n: usize| plan_for(Arch::Sm90a, &[n, 32, 64], &[n, 8, 64], &[32, n], causal).unwrap().kernel;
        assert_eq!(hd64(8191), FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_TURNS_COUNTER_HD64));
        assert_eq!(hd64(8192), FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_M192_TURNS_COUNTER_HD64));
        assert_eq!(hd64(8193), FlashKernel::Tma(kernels::FLASH_FWD_HOPPER_WS_M192_HD64));
        let full = AttentionOptions { causal: false, scale: None };
        let hd64 = |n: usize| plan_for(Arch::Sm90a, &[n, 32, 64], &[n, 32, 64], &[32, n], full).unwrap();
        assert_eq!(hd64(2047).kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_TURNS_COUNTER_HD64));
        let p = hd64(2048);
        assert_eq!(p.kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_M192_TURNS_COUNTER_HD64));
        assert_eq!((p.tile.rows, p.threads), (192, 512));
        assert_eq!(p.smem, ((192 + 4 * 128) * 64 * 2 + 1024 + abi::attention::HOPPER_BARRIER_BYTES) as u32);
        assert_eq!(hd64(8192).kernel, FlashKernel::Tma(kernels::FLASH_FWD_HOPPER_WS_M192_HD64));
        assert_eq!(hd64(8192).grid, (32, 43, 1));
        let hd256 = |n: usize, o| plan_for(Arch::Sm90a, &[n, 8, 256], &[n, 8, 256], &[8, n], o).unwrap();
        let issue_turns = FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_ISSUE_TURNS_WALK_HD256);
        assert_eq!(hd256(2048, full).kernel, issue_turns);
        assert_eq!(hd256(1, full).kernel, issue_turns);
        assert_eq!(hd256(2049, causal).kernel, FlashKernel::Tma(kernels::FLASH_FWD_HOPPER_WS_ISSUE_TURNS_HD256));
        assert_eq!(hd256(2048, causal).kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_COUNTER_HD256));
        assert!(shipped_kernel(Arch::Sm90a, D256, Walk::Counter, Consumers::IssueInTurns).is_err());
        // Off the counter walk head dim 256's free consumers are dev.
        assert!(shipped_kernel(Arch::Sm90a, D256, Walk::OneTile, Consumers::Free).is_err());
        assert!(shipped_kernel(Arch::Sm90a, D256, Walk::Strided, Consumers::Free).is_err());
        let sm80 = shipped_kernel(Arch::Sm80, D128, Walk::Counter, Consumers::InTurns).unwrap();
        assert_eq!(sm80.0, FlashKernel::Mma(kernels::FLASH_FWD_V2_HD128_BN16));
    }

    #[test]
    fn sections_hold_the_kv_heads_that_fit_in_l2() {
        let o = AttentionOptions { causal: true, scale: None };
        let batch = |n, seqs| BatchDims { total_q: n * seqs, total_k: n * seqs, sequences: seqs, max_q: n };
        let at = |q: [usize; 3], k: [usize; 3], seqs| {
            let (q, k) = ([q[0] * seqs, q[1], q[2]], [k[0] * seqs, k[1], k[2]]);
            let p = plan(Arch::Sm90a, shapes(&q, &k, &[q[1], q[0]]), batch(q[0] / seqs, seqs), o).unwrap();
            p.section_pairs(batch(q[0] / seqs, seqs))
        };
        // hd128 s4096: 2 MiB of K and V per head, 16 heads in 32 MiB.
        assert_eq!(at([4096, 16, 128], [4096, 16, 128], 4), 16);
        // GQA 32/8 at s8192: 8 KV heads of 4 MiB, each read by 4 query heads.
        assert_eq!(at([8192, 32, 128], [8192, 8, 128], 2), 32);
        // Short sequences: every pair in one section.
        assert_eq!(at([100, 4, 64], [100, 4, 64], 3), 12);
        // One KV head past L2: sections of one head's queries.
        assert_eq!(at([1 << 17, 8, 128], [1 << 17, 8, 128], 1), 1);
    }

    #[test]
    fn block_sizes_match_the_launch_bounds() {
        for arch in [Arch::Sm80, Arch::Sm90a] {
            for d in [HeadDim::D64, HeadDim::D128, HeadDim::D256] {
                for walk in [Walk::OneTile, Walk::Strided, Walk::Counter] {
                    for consumers in [
                        Consumers::Free,
                        Consumers::InTurns,
                        Consumers::LatePvInTurns,
                        Consumers::IssueInTurns,
                        Consumers::Three,
                    ] {
                        let Ok((kernel, tile)) = shipped_kernel(arch, d, walk, consumers) else { continue };
                        assert_eq!(tile.threads, kernel.max_threads(), "{}", kernel.name());
                    }
                }
            }
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        let o = AttentionOptions::default();
        let shape = |r: Result<FlashPlan>| matches!(r, Err(Error::Shape(_)));
        let arch = Arch::Sm80;
        assert!(shape(plan_for(arch, &[10, 6, 128], &[10, 4, 128], &[6, 10], o)));
        assert!(shape(plan_for(arch, &[10, 4, 96], &[10, 4, 96], &[4, 10], o)));
        assert!(shape(plan_for(arch, &[10, 4, 64], &[10, 4, 64], &[4, 11], o)));
        assert!(shape(plan_for(arch, &[10, 4, 64], &[10, 4, 128], &[4, 10], o)));
        assert!(shape(plan_for(arch, &[10, 4, 64, 1], &[10, 4, 64], &[4, 10], o)));
        assert!(shape(plan_for(arch, &[10, 4, 64], &[10, 64], &[4, 10], o)));
        let (q, k, lse) = ([10, 4, 64], [10, 4, 64], [4, 10]);
        let v = [10, 2, 64];
        assert!(shape(plan(arch, Shapes { v: &v, ..shapes(&q, &k, &lse) }, one_sequence(&q, &k), o)));
        let out = [10, 4, 128];
        assert!(shape(plan(arch, Shapes { o: &out, ..shapes(&q, &k, &lse) }, one_sequence(&q, &k), o)));
        // The batch covers other token counts than the tensors hold.
        let batch = BatchDims { total_q: 9, ..one_sequence(&q, &k) };
        assert!(shape(plan(arch, shapes(&q, &k, &lse), batch, o)));
        let batch = BatchDims { total_k: 11, ..one_sequence(&q, &k) };
        assert!(shape(plan(arch, shapes(&q, &k, &lse), batch, o)));
    }

    #[test]
    fn rejects_bad_sizes_and_options() {
        let o = AttentionOptions::default();
        let arch = Arch::Sm90a;
        assert!(matches!(plan_for(arch, &[10, 0, 64], &[10, 0, 64], &[0, 10], o), Err(Error::Empty(_))));
        assert!(matches!(plan_for(arch, &[0, 4, 64], &[10, 4, 64], &[4, 0], o), Err(Error::Empty(_))));
        assert!(matches!(plan_for(arch, &[10, 4, 64], &[0, 4, 64], &[4, 10], o), Err(Error::Empty(_))));
        let h = MAX_HEADS + 1;
        assert!(matches!(plan_for(arch, &[1, h, 64], &[1, h, 64], &[h, 1], o), Err(Error::TooLarge(_))));
        for scale in [f32::NAN, f32::INFINITY, 0.0, -1.0] {
            let bad = AttentionOptions { scale: Some(scale), ..o };
            let r = plan_for(arch, &[10, 4, 64], &[10, 4, 64], &[4, 10], bad);
            assert!(matches!(r, Err(Error::InvalidArgument(_))), "scale {scale}");
        }
        // One sequence longer than the grid's query tiles: of 128 rows at head
        // dim 128, of 192 at 64.
        for (d, rows) in [(128, 128), (64, 192)] {
            let t = 65535 * rows + 1;
            let r = plan_for(arch, &[t, 1, d], &[t, 1, d], &[1, t], o);
            assert!(matches!(r, Err(Error::TooLarge(_))), "head dim {d}");
            let r = plan_for(arch, &[t - 1, 1, d], &[t - 1, 1, d], &[1, t - 1], o);
            assert_eq!(r.unwrap().grid, (1, 65535, 1), "head dim {d}");
        }
    }
}
