//! The kernel versions kept for comparison (feature `dev`), side by side with
//! the shipped choice (llm.c style).

use super::batch::{BatchDims, VarlenBatch};
use super::launch::{launch, Operands};
use super::plan::{
    check, consumers, shipped_kernel, shipped_plan, sized, AttentionOptions, Consumers, FlashKernel, FlashPlan,
    HeadDim, Shapes, Walk,
};
use crate::error::{Error, Result};
use crate::kernels::{self, dev};
use crate::runtime::{Arch, Gpu, Kernel};
use crate::tensor::Tensor;
use abi::attention::{self as tiles, Tile};
use half::bf16;

/// Kernel versions, for benchmarking and testing side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashVersion {
    /// The shipped choice ([`super::flash_attention`]): [`FlashVersion::HopperWs`] on
    /// sm_90a; elsewhere the fastest configuration that does not spill (V2Bn32 at
    /// head dim 64, V2Bn16 at 128).
    Auto,
    /// 64 query rows per block, 16 per warp, Q in registers.
    V1,
    /// 128 query rows per block, 32 per warp, 64-key tiles.
    V2,
    /// As V2 with 32-key tiles.
    V2Bn32,
    /// As V2 with 16-key tiles (head dim 128 only).
    V2Bn16,
    /// sm_90a only: 128 query rows, 128-key tiles by TMA, thread 0 of a consumer
    /// also the producer, S = Q·Kᵀ on `wgmma`, P·V on mma.sync.
    Hopper,
    /// sm_90a only (shipped there): `Hopper`'s tiles with a producer warpgroup
    /// (registers handed to the consumers by `setmaxnreg`) and P·V on `wgmma`, P
    /// from registers: `HopperOneTile`, `HopperStrided` or `HopperCounter` as
    /// `plan::walk` says, its consumers as `plan::consumers` says.
    HopperWs,
    /// sm_90a only: `HopperWs` whose reference max moves only past 2^8 (a warp
    /// whose rows did not move skips O's rescale).
    HopperWsLazy,
    /// sm_90a only: `HopperWs` with each row's max and sum over four partials
    /// (a quarter of the softmax's dependent chain).
    HopperWsSplit,
    /// sm_90a only: `HopperWs`'s kernel on one tile per block, the grid's; at
    /// head dim 64 with Q in registers. Its consumers run free (the shipped
    /// kernel takes turns on this walk at head dim 128 with a causal mask from
    /// 4096 queries, and at 256, where it takes this walk with one).
    HopperOneTile,
    /// sm_90a only: `HopperOneTile` with at most one block per SM, block `b`
    /// taking tiles `b`, `b + grid`, … of the walk (longest first within
    /// L2-sized sections), its producer loading the next tile under the last
    /// one's epilogue.
    /// Its consumers run free (the shipped kernel takes `HopperLatePvTurns` on
    /// this walk at head dim 128 from 2048 queries, `HopperIssueTurns` at 256).
    HopperStrided,
    /// sm_90a only: `HopperWs` with the consumers taking turns on named
    /// barriers at the exponentials of their softmax: at head dim 128 the
    /// walk the shipped kernel takes (there with a causal mask and from 4096
    /// queries the shipped kernel itself), at 64 its counter walk where it
    /// takes that (the shipped kernel there below 2048 queries without a mask
    /// and 8192 with one, where it runs two consumers), else one tile per
    /// block; at 256 on the shipped 128-key tiles, one tile per block or the
    /// strided walk (there where `plan::walk` says the counter).
    HopperTurns,
    /// sm_90a only: `HopperWs` with a quarter of the softmax's exponentials
    /// on the FMA pipe (a polynomial) instead of the SFU: the strided walk at
    /// head dim 128 where the shipped kernel takes it, one tile per block
    /// otherwise.
    HopperFmaEx2,
    /// sm_90a only, head dim 64: the shipped kernel's three consumer
    /// warpgroups over 192 query rows, free on one tile per block at every
    /// length (the shipped kernel runs them on the counter walk, in turns,
    /// where it takes that walk).
    HopperM192,
    /// sm_90a only, head dims 64 and 128: `HopperWs` with three K/V stages
    /// instead of two, on the walk `plan::walk` picks, with two consumers run
    /// as the shipped pair runs there for long sequences (at 64: free, free, in
    /// turns on one tile, the strided and the counter walk; at 128: free, P·V
    /// late in turns, in turns at the exponentials).
    HopperStages3,
    /// sm_90a only: `HopperWs` with 176-key tiles (head dims 64 and 128).
    HopperN176,
    /// sm_90a only, head dim 256: `HopperWs` on the strided walk with 80-key
    /// tiles instead of 64 (FlashAttention-3's there).
    HopperN80,
    /// sm_90a only, head dim 256: the shipped kernel with 64-key tiles in two
    /// stages (its tiles on the counter walk) instead of 128-key tiles in one
    /// stage of K and one of V, one tile per block or the strided walk as
    /// `plan::walk` says (the strided walk where it says the counter). The
    /// other dev versions at head dim 256 take 64-key tiles too, so their rows
    /// stand beside this one's, not Auto's; `HopperTurns` and
    /// `HopperIssueTurns` take the shipped 128-key tiles.
    HopperN64,
    /// sm_90a only, head dim 256: the shipped kernel's 128-key tiles on the
    /// counter walk whatever `plan::walk` says (the shipped kernel keeps 64-key
    /// tiles there).
    HopperN128Counter,
    /// sm_90a only: `HopperPersistent` with 176-key tiles and Q read from
    /// shared memory (head dim 64; at 128 its consumers spill).
    HopperPersistentN176,
    /// sm_90a only (shipped at head dims 128 and 256 where `plan::walk` says):
    /// `HopperStrided` with each block taking its next tile from the GPU's
    /// counter as it finishes the last, its index handed to the consumers with
    /// the Q load. Its two consumers run free (at head dim 64 the shipped
    /// kernel's take turns on this walk, or three run there: a dev entry holds
    /// the free pair).
    HopperPersistent,
    /// sm_90a only: `HopperPersistent` with `HopperWsLazy`'s rescale, Q read
    /// from shared memory.
    HopperPersistentLazy,
    /// sm_90a only: the shipped kernel on the counter walk whatever
    /// `plan::walk` picks, its consumers as `plan::consumers` picks there.
    HopperCounter,
    /// sm_90a only, head dims 64 and 128: the shipped kernel on the walk
    /// `plan::walk` picks (two consumers, free, but at head dim 64 on the
    /// counter walk in turns, as shipped below 2048 queries), each consumer
    /// warpgroup staging its 64 rows of O in shared memory for a TMA store its
    /// first thread issues (rows that reach past their sequence by 16-byte
    /// stores).
    HopperTmaStores,
    /// sm_90a only: the shipped kernel on the walk `plan::walk` picks (at head
    /// dim 256 one tile per block: on the walks its consumers spill), with
    /// FlashAttention-3's in-warpgroup pipeline: S(j) and P(j−1)·V(j−1) issued
    /// together, S(j)'s softmax under that P·V, K and V released on barriers
    /// of their own.
    HopperLatePv,
    /// sm_90a only: `HopperLatePv` with the consumers taking turns at issuing
    /// each key tile's GEMMs (FlashAttention-3's ping-pong), on the walk
    /// `plan::walk` picks (at head dim 128 on the strided walk the shipped
    /// kernel's entry, which it takes without a mask from 2048 queries); at 256
    /// on 64-key tiles in two stages, its consumers at 240 registers, one tile
    /// per block or the strided walk (there where it says the counter).
    HopperLatePvTurns,
    /// sm_90a only: `HopperWs` with P·V in order and the consumers taking turns
    /// at issuing each GEMM (FlashAttention-3's ping-pong without the late
    /// P·V), on the walk `plan::walk` picks; at 256 on the shipped 128-key
    /// tiles, off the counter walk the shipped kernel's entries.
    HopperIssueTurns,
}

type TmaKernel = Kernel<abi::FlashTmaArgs>;

/// A dev version built on the shipped kernel's three walks at head dims 64 and
/// 128 (`[one tile, strided, counter]` entries) and on one tile per block at
/// 256: the entry of `walk`.
fn on_walks(
    head_dim: HeadDim,
    walk: Walk,
    hd64: [TmaKernel; 3],
    hd128: [TmaKernel; 3],
    hd256: TmaKernel,
) -> (FlashKernel, Tile) {
    match head_dim {
        HeadDim::D256 => (FlashKernel::Tma(hd256), tiles::HOPPER_HD256),
        _ => (entry_on_walk(head_dim, walk, hd64, hd128), tiles::HOPPER),
    }
}

/// A dev version at head dim 256 on `tile`: its entry of one tile per block
/// there, else of the strided walk (it has none on the counter).
fn one_tile_or_strided(walk: Walk, one_tile: TmaKernel, strided: TmaKernel, tile: Tile) -> (FlashKernel, Tile) {
    let kernel = match walk {
        Walk::OneTile => FlashKernel::Tma(one_tile),
        Walk::Strided | Walk::Counter => FlashKernel::TmaPersistent(strided),
    };
    (kernel, tile)
}

/// Of a dev version's `[one tile, strided, counter]` entries at head dims 64
/// and 128, the one of `walk` at `head_dim` (128 for any but 64).
fn entry_on_walk(head_dim: HeadDim, walk: Walk, hd64: [TmaKernel; 3], hd128: [TmaKernel; 3]) -> FlashKernel {
    let entries = if head_dim == HeadDim::D64 { hd64 } else { hd128 };
    match walk {
        Walk::OneTile => FlashKernel::Tma(entries[0]),
        Walk::Strided => FlashKernel::TmaPersistent(entries[1]),
        Walk::Counter => FlashKernel::TmaPersistent(entries[2]),
    }
}

impl FlashVersion {
    /// Whether this version's kernels exist on sm_90a only (TMA and `wgmma`).
    pub fn hopper_only(self) -> bool {
        use FlashVersion::*;
        // Every version but the portable mma.sync ones (and `Auto`, resolved per arch).
        !matches!(self, Auto | V1 | V2 | V2Bn32 | V2Bn16)
    }

    /// The concrete version `Auto` stands for on `arch` (on sm_80 it depends on the
    /// head dim; `Auto` is kept there).
    pub fn resolve(self, arch: Arch) -> FlashVersion {
        match (self, arch) {
            (FlashVersion::Auto, Arch::Sm90a) => FlashVersion::HopperWs,
            _ => self,
        }
    }

    /// The entry and its tiling for `arch` and `head_dim`, where the shipped
    /// kernel would take `walk` (the versions with walks of their own follow it).
    fn kernel(self, arch: Arch, head_dim: HeadDim, walk: Walk) -> Result<(FlashKernel, Tile)> {
        use FlashKernel::{Mma, TmaPersistent};
        use FlashVersion::*;
        use HeadDim::{D128, D256, D64};
        Ok(match (self, head_dim) {
            (Auto, _) => unreachable!("Auto plans through shipped_plan"),
            (V1, D64) => (Mma(dev::FLASH_FWD_HD64), tiles::dev::V1),
            (V1, D128) => (Mma(dev::FLASH_FWD_HD128), tiles::dev::V1),
            (V2, D64) => (Mma(dev::FLASH_FWD_V2_HD64), tiles::dev::V2_BN64),
            (V2, D128) => (Mma(dev::FLASH_FWD_V2_HD128), tiles::dev::V2_BN64),
            (V2Bn32, D64) => (Mma(kernels::FLASH_FWD_V2_HD64_BN32), tiles::V2_HD64),
            (V2Bn32, D128) => (Mma(dev::FLASH_FWD_V2_HD128_BN32), tiles::dev::V2_BN32),
            (V2Bn16, D128) => (Mma(kernels::FLASH_FWD_V2_HD128_BN16), tiles::V2_HD128),
            (V2Bn16, D64) => {
                return Err(Error::InvalidArgument("flash_attention: V2Bn16 has no kernel for head_dim 64".into()))
            }
            _ if self.hopper_only() && arch != Arch::Sm90a => {
                return Err(Error::InvalidArgument(format!(
                    "flash_attention: {self:?} runs on sm_90a (H100/H200) only"
                )))
            }
            (HopperWs, _) => unreachable!("HopperWs on sm_90a plans through shipped_plan"),
            (HopperCounter, _) => unreachable!("HopperCounter on sm_90a plans as the shipped kernel on its walk"),
            (HopperWsLazy, D64) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_LAZY_HD64), tiles::HOPPER),
            (HopperWsLazy, D128) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_LAZY_HD128), tiles::HOPPER),
            (HopperWsLazy, D256) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_LAZY_HD256), tiles::HOPPER_HD256),
            (HopperWsSplit, D64) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_SPLIT_HD64), tiles::HOPPER),
            (HopperWsSplit, D128) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_SPLIT_HD128), tiles::HOPPER),
            (HopperWsSplit, D256) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_SPLIT_HD256), tiles::HOPPER_HD256),
            // The shipped kernels: one tile per block, the strided and the counter
            // walk (at head dim 64 the free counter entry is dev: the shipped one takes turns).
            // At head dim 256 the free consumers off the counter walk are dev.
            (HopperOneTile, D256) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_FREE_HD256), tiles::HOPPER_HD256_N128),
            (HopperStrided, D256) => (TmaPersistent(dev::FLASH_FWD_HOPPER_FREE_WALK_HD256), tiles::HOPPER_HD256_N128),
            (HopperOneTile, _) => shipped_kernel(Arch::Sm90a, head_dim, Walk::OneTile, Consumers::Free)?,
            (HopperStrided, _) => shipped_kernel(Arch::Sm90a, head_dim, Walk::Strided, Consumers::Free)?,
            (HopperPersistent, D64) => (TmaPersistent(dev::FLASH_FWD_HOPPER_FREE_COUNTER_HD64), tiles::HOPPER),
            (HopperPersistent, _) => shipped_kernel(Arch::Sm90a, head_dim, Walk::Counter, Consumers::Free)?,
            (HopperTurns, D64) => match walk {
                Walk::Counter => shipped_kernel(Arch::Sm90a, head_dim, walk, Consumers::InTurns)?,
                _ => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_TURNS_HD64), tiles::HOPPER),
            },
            (HopperTurns, D128) => match walk {
                Walk::Strided => (TmaPersistent(dev::FLASH_FWD_HOPPER_TURNS_WALK_HD128), tiles::HOPPER),
                _ => shipped_kernel(Arch::Sm90a, head_dim, walk, Consumers::InTurns)?,
            },
            (HopperTurns, D256) => one_tile_or_strided(
                walk,
                dev::FLASH_FWD_HOPPER_TURNS_HD256,
                dev::FLASH_FWD_HOPPER_TURNS_WALK_HD256,
                tiles::HOPPER_HD256_N128,
            ),
            (HopperFmaEx2, D64) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_FMA_EX2_HD64), tiles::HOPPER),
            (HopperFmaEx2, D128) if walk == Walk::Strided => {
                (TmaPersistent(dev::FLASH_FWD_HOPPER_FMA_EX2_WALK_HD128), tiles::HOPPER)
            }
            (HopperFmaEx2, D128) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_FMA_EX2_HD128), tiles::HOPPER),
            (HopperFmaEx2, D256) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_FMA_EX2_HD256), tiles::HOPPER_HD256),
            (HopperM192, D64) => shipped_kernel(Arch::Sm90a, head_dim, Walk::OneTile, Consumers::Three)?,
            (HopperM192, D128) => {
                return Err(Error::InvalidArgument("flash_attention: HopperM192 has no kernel for head_dim 128".into()))
            }
            (HopperStages3, D64 | D128) => {
                let kernel = entry_on_walk(
                    head_dim,
                    walk,
                    [
                        dev::FLASH_FWD_HOPPER_STAGES3_HD64,
                        dev::FLASH_FWD_HOPPER_STAGES3_WALK_HD64,
                        dev::FLASH_FWD_HOPPER_STAGES3_COUNTER_HD64,
                    ],
                    [
                        dev::FLASH_FWD_HOPPER_STAGES3_HD128,
                        dev::FLASH_FWD_HOPPER_STAGES3_WALK_HD128,
                        dev::FLASH_FWD_HOPPER_STAGES3_COUNTER_HD128,
                    ],
                );
                (kernel, tiles::dev::HOPPER_STAGES3)
            }
            (HopperN176, D64) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_N176_HD64), tiles::dev::HOPPER_N176),
            (HopperN176, D128) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_N176_HD128), tiles::dev::HOPPER_N176),
            (HopperPersistentN176, D64) => {
                (TmaPersistent(dev::FLASH_FWD_HOPPER_PERSISTENT_N176_HD64), tiles::dev::HOPPER_N176)
            }
            (HopperPersistentN176, D128) => {
                return Err(Error::InvalidArgument(
                    "flash_attention: HopperPersistentN176 has no kernel for head_dim 128".into(),
                ))
            }
            (HopperPersistentLazy, D64) => (TmaPersistent(dev::FLASH_FWD_HOPPER_PERSISTENT_LAZY_HD64), tiles::HOPPER),
            (HopperPersistentLazy, D128) => (TmaPersistent(dev::FLASH_FWD_HOPPER_PERSISTENT_LAZY_HD128), tiles::HOPPER),
            (HopperPersistentLazy, D256) => {
                (TmaPersistent(dev::FLASH_FWD_HOPPER_PERSISTENT_LAZY_HD256), tiles::HOPPER_HD256)
            }
            (HopperTmaStores, D64 | D128) => {
                let kernel = entry_on_walk(
                    head_dim,
                    walk,
                    [
                        dev::FLASH_FWD_HOPPER_TMA_STORE_HD64,
                        dev::FLASH_FWD_HOPPER_TMA_STORE_WALK_HD64,
                        dev::FLASH_FWD_HOPPER_TMA_STORE_COUNTER_HD64,
                    ],
                    [
                        dev::FLASH_FWD_HOPPER_TMA_STORE_HD128,
                        dev::FLASH_FWD_HOPPER_TMA_STORE_WALK_HD128,
                        dev::FLASH_FWD_HOPPER_TMA_STORE_COUNTER_HD128,
                    ],
                );
                (kernel, tiles::HOPPER)
            }
            (HopperLatePv, _) => on_walks(
                head_dim,
                walk,
                [
                    dev::FLASH_FWD_HOPPER_LATE_PV_HD64,
                    dev::FLASH_FWD_HOPPER_LATE_PV_WALK_HD64,
                    dev::FLASH_FWD_HOPPER_LATE_PV_COUNTER_HD64,
                ],
                [
                    dev::FLASH_FWD_HOPPER_LATE_PV_HD128,
                    dev::FLASH_FWD_HOPPER_LATE_PV_WALK_HD128,
                    dev::FLASH_FWD_HOPPER_LATE_PV_COUNTER_HD128,
                ],
                dev::FLASH_FWD_HOPPER_LATE_PV_HD256,
            ),
            (HopperIssueTurns, D256) => match walk {
                Walk::Counter => {
                    (TmaPersistent(dev::FLASH_FWD_HOPPER_ISSUE_TURNS_COUNTER_HD256), tiles::HOPPER_HD256_N128)
                }
                _ => shipped_kernel(Arch::Sm90a, head_dim, walk, Consumers::IssueInTurns)?,
            },
            (HopperIssueTurns, D64 | D128) => {
                let kernel = entry_on_walk(
                    head_dim,
                    walk,
                    [
                        dev::FLASH_FWD_HOPPER_ISSUE_TURNS_HD64,
                        dev::FLASH_FWD_HOPPER_ISSUE_TURNS_WALK_HD64,
                        dev::FLASH_FWD_HOPPER_ISSUE_TURNS_COUNTER_HD64,
                    ],
                    [
                        dev::FLASH_FWD_HOPPER_ISSUE_TURNS_HD128,
                        dev::FLASH_FWD_HOPPER_ISSUE_TURNS_WALK_HD128,
                        dev::FLASH_FWD_HOPPER_ISSUE_TURNS_COUNTER_HD128,
                    ],
                );
                (kernel, tiles::HOPPER)
            }
            (HopperLatePvTurns, D256) => one_tile_or_strided(
                walk,
                dev::FLASH_FWD_HOPPER_LATE_PV_TURNS_HD256,
                dev::FLASH_FWD_HOPPER_LATE_PV_TURNS_WALK_HD256,
                tiles::HOPPER_HD256,
            ),
            (HopperLatePvTurns, D64 | D128) => {
                let kernel = match (head_dim, walk) {
                    (D64, Walk::Counter) => TmaPersistent(dev::FLASH_FWD_HOPPER_LATE_PV_TURNS_COUNTER_HD64),
                    (D64, _) => FlashKernel::Tma(dev::FLASH_FWD_HOPPER_LATE_PV_TURNS_HD64),
                    (_, Walk::OneTile) => FlashKernel::Tma(dev::FLASH_FWD_HOPPER_LATE_PV_TURNS_HD128),
                    (_, Walk::Strided) => {
                        return shipped_kernel(Arch::Sm90a, head_dim, walk, Consumers::LatePvInTurns);
                    }
                    (_, Walk::Counter) => TmaPersistent(dev::FLASH_FWD_HOPPER_LATE_PV_TURNS_COUNTER_HD128),
                };
                (kernel, tiles::HOPPER)
            }
            (HopperN80, D256) => (TmaPersistent(dev::FLASH_FWD_HOPPER_N80_WALK_HD256), tiles::dev::HOPPER_N80),
            (HopperN64, D256) => one_tile_or_strided(
                walk,
                dev::FLASH_FWD_HOPPER_N64_HD256,
                dev::FLASH_FWD_HOPPER_N64_WALK_HD256,
                tiles::HOPPER_HD256,
            ),
            (HopperN128Counter, D256) => {
                (TmaPersistent(dev::FLASH_FWD_HOPPER_N128_COUNTER_HD256), tiles::HOPPER_HD256_N128)
            }
            (HopperN128Counter, _) => {
                return Err(Error::InvalidArgument(
                    "flash_attention: HopperN128Counter has kernels for head_dim 256 only".into(),
                ))
            }
            (HopperN64, _) => {
                return Err(Error::InvalidArgument(
                    "flash_attention: HopperN64 has kernels for head_dim 256 only".into(),
                ))
            }
            (HopperN80, _) => {
                return Err(Error::InvalidArgument(
                    "flash_attention: HopperN80 has kernels for head_dim 256 only".into(),
                ))
            }
            (_, D256) => {
                return Err(Error::InvalidArgument(format!(
                    "flash_attention: {self:?} has no kernel for head_dim 256 (HopperWs on sm_90a has)"
                )))
            }
            (Hopper, D64) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_HD64), tiles::dev::HOPPER_LOCKSTEP),
            (Hopper, D128) => (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_HD128), tiles::dev::HOPPER_LOCKSTEP),
        })
    }
}

/// [`super::plan`] with an explicit kernel version.
pub fn plan_with(
    arch: Arch,
    shapes: Shapes,
    batch: BatchDims,
    opts: AttentionOptions,
    version: FlashVersion,
) -> Result<FlashPlan> {
    let problem = check(shapes, batch, opts)?;
    if version == FlashVersion::Auto || (version == FlashVersion::HopperWs && arch == Arch::Sm90a) {
        return shipped_plan(arch, problem, batch);
    }
    plan_with_walk(arch, shapes, batch, opts, version, super::plan::walk(problem.head_dim, problem.causal, batch.max_q))
}

/// [`plan_with`] on `walk` instead of the one `plan::walk` picks, for the
/// shipped kernel (`Auto`, `HopperWs`) and the versions that follow its walk
/// (`HopperTmaStores`, `HopperTurns`, …): their entries on
/// every walk, tested whether or not the shipped choice reaches them. The
/// versions of one walk (`HopperOneTile`, `HopperStrided`,
/// `HopperPersistent`, `HopperCounter`, `HopperM192`), and every version off
/// sm_90a, keep theirs.
pub fn plan_with_walk(
    arch: Arch,
    shapes: Shapes,
    batch: BatchDims,
    opts: AttentionOptions,
    version: FlashVersion,
    walk: Walk,
) -> Result<FlashPlan> {
    let problem = check(shapes, batch, opts)?;
    // The shipped kernel on the counter walk, whichever walk was asked for.
    let (version, walk) = match version {
        FlashVersion::HopperCounter if arch == Arch::Sm90a => (FlashVersion::Auto, Walk::Counter),
        _ => (version, walk),
    };
    let shipped = version == FlashVersion::Auto || version == FlashVersion::HopperWs;
    let (kernel, tile) = match arch {
        Arch::Sm90a if shipped => {
            let turns = consumers(problem.head_dim, problem.causal, batch.max_q, walk);
            shipped_kernel(arch, problem.head_dim, walk, turns)?
        }
        _ if version == FlashVersion::Auto => return shipped_plan(arch, problem, batch),
        _ => version.kernel(arch, problem.head_dim, walk)?,
    };
    let p = sized(problem, batch, kernel, tile)?;
    Ok(match version {
        FlashVersion::HopperTmaStores => {
            let smem = abi::attention::hopper_smem_staged_o(tile, problem.head_dim.elements());
            FlashPlan { smem: smem as u32, stages_o: true, ..p }
        }
        _ => p,
    })
}

/// [`flash_attention_with`] on `walk` ([`plan_with_walk`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_on_walk(
    gpu: &Gpu,
    q: &Tensor<bf16>,
    k: &Tensor<bf16>,
    v: &Tensor<bf16>,
    batch: &VarlenBatch,
    opts: AttentionOptions,
    o: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
    version: FlashVersion,
    walk: Walk,
) -> Result<()> {
    let plan = |arch, shapes: Shapes, dims| plan_with_walk(arch, shapes, dims, opts, version, walk);
    planned(gpu, Operands { q, k, v, batch, o, lse }, plan)
}

/// Launches `operands` as `plan` plans them for the GPU's arch, their shapes
/// and the batch's dimensions.
fn planned(
    gpu: &Gpu,
    operands: Operands,
    plan: impl FnOnce(Arch, Shapes, BatchDims) -> Result<FlashPlan>,
) -> Result<()> {
    let Operands { q, k, v, batch, o, lse } = operands;
    let shapes = Shapes { q: q.shape(), k: k.shape(), v: v.shape(), o: o.shape(), lse: lse.shape() };
    let p = plan(gpu.info().arch, shapes, batch.dims())?;
    launch(gpu, &p, Operands { q, k, v, batch, o, lse })
}

/// [`super::flash_attention`] with an explicit kernel version.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_with(
    gpu: &Gpu,
    q: &Tensor<bf16>,
    k: &Tensor<bf16>,
    v: &Tensor<bf16>,
    batch: &VarlenBatch,
    opts: AttentionOptions,
    o: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
    version: FlashVersion,
) -> Result<()> {
    let plan = |arch, shapes: Shapes, dims| plan_with(arch, shapes, dims, opts, version);
    planned(gpu, Operands { q, k, v, batch, o, lse }, plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use FlashVersion::*;

    const ALL: [FlashVersion; 27] = [
        Auto,
        V1,
        V2,
        V2Bn32,
        V2Bn16,
        Hopper,
        HopperWs,
        HopperWsLazy,
        HopperWsSplit,
        HopperOneTile,
        HopperStrided,
        HopperTurns,
        HopperFmaEx2,
        HopperM192,
        HopperStages3,
        HopperN176,
        HopperN80,
        HopperN64,
        HopperN128Counter,
        HopperPersistentN176,
        HopperPersistent,
        HopperPersistentLazy,
        HopperTmaStores,
        HopperLatePv,
        HopperIssueTurns,
        HopperLatePvTurns,
        HopperCounter,
    ];

    fn plan_for(arch: Arch, d: usize, version: FlashVersion) -> Result<FlashPlan> {
        let (q, k, lse) = ([300, 4, d], [300, 2, d], [4, 300]);
        let batch = BatchDims { total_q: 300, total_k: 300, sequences: 1, max_q: 300 };
        plan_with(arch, Shapes { q: &q, k: &k, v: &k, o: &q, lse: &lse }, batch, AttentionOptions::default(), version)
    }

    #[test]
    fn every_version_has_its_kernels() {
        for arch in [Arch::Sm80, Arch::Sm90a] {
            for d in [64, 128] {
                for v in ALL {
                    let p = match plan_for(arch, d, v) {
                        Ok(p) => p,
                        Err(Error::InvalidArgument(_)) if v == V2Bn16 && d == 64 => continue,
                        Err(Error::InvalidArgument(_)) if v == HopperPersistentN176 && d == 128 => continue,
                        Err(Error::InvalidArgument(_)) if matches!(v, HopperN80 | HopperN64 | HopperN128Counter) => {
                            continue
                        }
                        Err(Error::InvalidArgument(_)) if v == HopperM192 && d == 128 => continue,
                        Err(Error::InvalidArgument(_)) if v.hopper_only() && arch == Arch::Sm80 => continue,
                        Err(e) => panic!("{v:?} d{d} on {arch:?}: {e}"),
                    };
                    assert_eq!(p.threads, p.kernel.max_threads(), "{}", p.kernel.name());
                    assert_eq!(p.grid.1 as usize, 300usize.div_ceil(p.tile.rows));
                    let tma = matches!(p.kernel, FlashKernel::Tma(_) | FlashKernel::TmaPersistent(_));
                    assert_eq!(tma, v.resolve(arch).hopper_only(), "{v:?} on {arch:?}");
                }
            }
        }
    }

    #[test]
    fn tma_stores_stage_o_past_the_barriers_within_shared_memory() {
        for d in [64, 128] {
            let p = plan_for(Arch::Sm90a, d, HopperTmaStores).unwrap();
            // The tiles, the alignment slack, the barriers padded to 1024 bytes,
            // then 128 rows of O.
            assert_eq!(p.smem as usize, (128 + 4 * 128) * d * 2 + 1024 + 1024 + 128 * d * 2);
            assert!(p.stages_o && p.smem <= 227 * 1024);
            assert!(!plan_for(Arch::Sm90a, d, Auto).unwrap().stages_o);
        }
        assert!(matches!(plan_for(Arch::Sm90a, 256, HopperTmaStores), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn a_named_walk_takes_that_walks_entry() {
        let (q, k, lse) = ([300, 4, 64], [300, 2, 64], [4, 300]);
        let batch = BatchDims { total_q: 300, total_k: 300, sequences: 1, max_q: 300 };
        let shapes = Shapes { q: &q, k: &k, v: &k, o: &q, lse: &lse };
        let on = |version, walk| {
            plan_with_walk(Arch::Sm90a, shapes, batch, AttentionOptions::default(), version, walk).unwrap().kernel
        };
        // Walks the shipped choice never takes at head dim 64 (causal, 300 queries: the counter).
        assert_eq!(on(Auto, Walk::Strided), FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_WALK_HD64));
        assert_eq!(on(HopperWs, Walk::OneTile), FlashKernel::Tma(kernels::FLASH_FWD_HOPPER_WS_HD64));
        assert_eq!(
            on(HopperTmaStores, Walk::Strided),
            FlashKernel::TmaPersistent(dev::FLASH_FWD_HOPPER_TMA_STORE_WALK_HD64)
        );
        // The versions of one walk keep it.
        assert_eq!(on(HopperOneTile, Walk::Counter), FlashKernel::Tma(kernels::FLASH_FWD_HOPPER_WS_HD64));
        assert_eq!(
            on(HopperCounter, Walk::OneTile),
            FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_TURNS_COUNTER_HD64)
        );
        // Turns at head dim 64: the counter walk, else one tile per block.
        assert_eq!(
            on(HopperTurns, Walk::Counter),
            FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_TURNS_COUNTER_HD64)
        );
        assert_eq!(on(HopperTurns, Walk::Strided), FlashKernel::Tma(dev::FLASH_FWD_HOPPER_TURNS_HD64));
        // P·V late: every walk's own entry.
        assert_eq!(on(HopperLatePv, Walk::OneTile), FlashKernel::Tma(dev::FLASH_FWD_HOPPER_LATE_PV_HD64));
        assert_eq!(
            on(HopperLatePv, Walk::Strided),
            FlashKernel::TmaPersistent(dev::FLASH_FWD_HOPPER_LATE_PV_WALK_HD64)
        );
        assert_eq!(
            on(HopperIssueTurns, Walk::Counter),
            FlashKernel::TmaPersistent(dev::FLASH_FWD_HOPPER_ISSUE_TURNS_COUNTER_HD64)
        );
        // At head dim 256 on the shipped 128-key tiles, on each walk.
        let hd256 = HopperIssueTurns.kernel(Arch::Sm90a, HeadDim::D256, Walk::Counter).unwrap();
        let counter = FlashKernel::TmaPersistent(dev::FLASH_FWD_HOPPER_ISSUE_TURNS_COUNTER_HD256);
        assert_eq!(hd256, (counter, tiles::HOPPER_HD256_N128));
        let hd256 = HopperIssueTurns.kernel(Arch::Sm90a, HeadDim::D256, Walk::Strided).unwrap();
        let walk = FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_ISSUE_TURNS_WALK_HD256);
        assert_eq!(hd256, (walk, tiles::HOPPER_HD256_N128));
        let hd256 = HopperLatePvTurns.kernel(Arch::Sm90a, HeadDim::D256, Walk::Counter).unwrap();
        let walk = FlashKernel::TmaPersistent(dev::FLASH_FWD_HOPPER_LATE_PV_TURNS_WALK_HD256);
        assert_eq!(hd256, (walk, tiles::HOPPER_HD256));
        let hd256 = HopperTurns.kernel(Arch::Sm90a, HeadDim::D256, Walk::OneTile).unwrap();
        assert_eq!(hd256, (FlashKernel::Tma(dev::FLASH_FWD_HOPPER_TURNS_HD256), tiles::HOPPER_HD256_N128));
        // And the walk the shipped plan picks is `plan_with`'s.
        let picked = plan_for(Arch::Sm90a, 64, HopperTmaStores).unwrap();
        assert_eq!(on(HopperTmaStores, Walk::Counter), picked.kernel);
    }

    #[test]
    fn two_stages_of_64_key_tiles_fit_hd256_in_shared_memory() {
        let p = plan_for(Arch::Sm90a, 256, HopperN64).unwrap();
        // Q's 128 rows and two stages of 64-key K and V at 256 columns: 192 KiB.
        assert_eq!(p.tile.tile_bytes(256), (128 + 4 * 64) * 256 * 2);
        assert!(p.smem as usize <= 227 * 1024, "{}", p.smem);
        assert!(matches!(plan_for(Arch::Sm90a, 128, HopperN64), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn eighty_key_tiles_fit_hd256_in_shared_memory() {
        let p = plan_for(Arch::Sm90a, 256, HopperN80).unwrap();
        // Q's 128 rows and two stages of 80-key K and V at 256 columns: 224 KiB.
        assert_eq!(p.tile.tile_bytes(256), (128 + 4 * 80) * 256 * 2);
        assert!(p.smem as usize <= 227 * 1024, "{}", p.smem);
        assert!(matches!(p.kernel, FlashKernel::TmaPersistent(_)));
        assert!(matches!(plan_for(Arch::Sm90a, 128, HopperN80), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn three_consumers_take_192_rows_on_512_threads() {
        let p = plan_for(Arch::Sm90a, 64, HopperM192).unwrap();
        assert_eq!((p.tile.rows, p.threads, p.grid.1), (192, 512, 2));
        assert_eq!(p.smem, ((192 + 4 * 128) * 64 * 2 + 1024 + tiles::HOPPER_BARRIER_BYTES) as u32);
        // One tile per block on every walk, where the shipped kernel would walk by counter.
        let (q, k, lse) = ([300, 4, 64], [300, 2, 64], [4, 300]);
        let batch = BatchDims { total_q: 300, total_k: 300, sequences: 1, max_q: 300 };
        let shapes = Shapes { q: &q, k: &k, v: &k, o: &q, lse: &lse };
        let p = plan_with_walk(Arch::Sm90a, shapes, batch, AttentionOptions::default(), HopperM192, Walk::Counter);
        assert_eq!(p.unwrap().kernel, FlashKernel::Tma(kernels::FLASH_FWD_HOPPER_WS_M192_HD64));
    }

    #[test]
    fn three_stages_fit_in_shared_memory() {
        for (d, kib) in [(64, 112), (128, 224)] {
            let p = plan_for(Arch::Sm90a, d, HopperStages3).unwrap();
            // Q and three stages of 128-key K and V, plus the slack and barriers.
            let tiles_bytes = (128 + 6 * 128) * d * 2;
            assert_eq!(tiles_bytes, kib * 1024);
            assert_eq!((p.tile.stages, p.smem), (3, (tiles_bytes + 1024 + tiles::HOPPER_BARRIER_BYTES) as u32));
            assert!(p.smem <= 227 * 1024);
        }
    }

    #[test]
    fn tiles_of_176_keys_fit_in_shared_memory_at_head_dim_128() {
        let p = plan_for(Arch::Sm90a, 128, HopperN176).unwrap();
        // Q and two stages of 176-key K and V, 208 KiB, plus the slack and barriers.
        assert_eq!(
            (p.tile.keys, p.smem),
            (176, ((128 + 4 * 176) * 128 * 2 + 1024 + tiles::HOPPER_BARRIER_BYTES) as u32)
        );
        assert!(p.smem <= 227 * 1024);
    }

    #[test]
    fn head_dim_256_runs_on_the_warp_specialized_hopper_kernel_only() {
        let p = plan_for(Arch::Sm90a, 256, Auto).unwrap();
        assert_eq!(p, plan_for(Arch::Sm90a, 256, HopperWs).unwrap());
        // Causal (the default options) over 300 queries: the counter walk.
        assert_eq!(p.kernel, FlashKernel::TmaPersistent(kernels::FLASH_FWD_HOPPER_WS_COUNTER_HD256));
        // 64-key tiles: Q and two stages of K and V, 192 KiB, plus the slack and barriers.
        assert_eq!(
            (p.tile.keys, p.threads, p.smem),
            (64, 384, ((128 + 4 * 64) * 256 * 2 + 1024 + tiles::HOPPER_BARRIER_BYTES) as u32)
        );
        assert!(p.smem <= 227 * 1024);
        for (arch, v) in [
            (Arch::Sm80, Auto),
            (Arch::Sm80, HopperWs),
            (Arch::Sm90a, Hopper),
            (Arch::Sm90a, HopperM192),
            (Arch::Sm90a, HopperStages3),
            (Arch::Sm90a, HopperN176),
            (Arch::Sm90a, HopperPersistentN176),
        ] {
            assert!(matches!(plan_for(arch, 256, v), Err(Error::InvalidArgument(_))), "{v:?} on {arch:?}");
        }
    }

    #[test]
    fn auto_is_the_shipped_plan() {
        for arch in [Arch::Sm80, Arch::Sm90a] {
            for d in [64, 128] {
                let (q, k, lse) = ([300, 4, d], [300, 2, d], [4, 300]);
                let batch = BatchDims { total_q: 300, total_k: 300, sequences: 1, max_q: 300 };
                let shapes = Shapes { q: &q, k: &k, v: &k, o: &q, lse: &lse };
                let shipped = super::super::plan(arch, shapes, batch, AttentionOptions::default()).unwrap();
                assert_eq!(plan_for(arch, d, Auto).unwrap(), shipped);
            }
        }
        assert_eq!(plan_for(Arch::Sm80, 64, Auto).unwrap().kernel, plan_for(Arch::Sm80, 64, V2Bn32).unwrap().kernel);
        assert_eq!(plan_for(Arch::Sm80, 128, Auto).unwrap().kernel, plan_for(Arch::Sm80, 128, V2Bn16).unwrap().kernel);
    }

    #[test]
    fn persistent_versions_walk_the_tile_grid_with_their_one_tile_layout() {
        for d in [64, 128, 256] {
            let one_tile = plan_for(Arch::Sm90a, d, HopperOneTile).unwrap();
            assert!(matches!(one_tile.kernel, FlashKernel::Tma(_)));
            // At head dim 256 the shipped kernel takes 128-key tiles off the
            // counter walk; the versions on it, and the other rescales, 64-key ones.
            let keys64 = plan_for(Arch::Sm90a, d, if d == 256 { HopperN64 } else { HopperOneTile }).unwrap();
            for (v, like) in [(HopperStrided, &one_tile), (HopperPersistent, &keys64), (HopperPersistentLazy, &keys64)]
            {
                let p = plan_for(Arch::Sm90a, d, v).unwrap();
                assert!(matches!(p.kernel, FlashKernel::TmaPersistent(_)), "{v:?}");
                assert_eq!((p.grid, p.tile, p.smem), (like.grid, like.tile, like.smem), "{v:?} d{d}");
            }
            for v in [HopperWsLazy, HopperWsSplit] {
                let p = plan_for(Arch::Sm90a, d, v).unwrap();
                assert_eq!((p.grid, p.tile, p.smem), (keys64.grid, keys64.tile, keys64.smem), "{v:?}");
            }
        }
        // 65535 heads × 65535 one-query sequences: past the persistent kernels' tile index.
        let n = 65535;
        let (q, k, lse) = ([n, n, 128], [n, 1, 128], [n, n]);
        let batch = BatchDims { total_q: n, total_k: n, sequences: n, max_q: 1 };
        let shapes = Shapes { q: &q, k: &k, v: &k, o: &q, lse: &lse };
        let opts = AttentionOptions::default();
        for v in [HopperStrided, HopperPersistent] {
            assert!(matches!(plan_with(Arch::Sm90a, shapes, batch, opts, v), Err(Error::TooLarge(_))), "{v:?}");
        }
        for v in [Auto, HopperOneTile] {
            assert!(plan_with(Arch::Sm90a, shapes, batch, opts, v).is_ok(), "{v:?}");
        }
    }

    #[test]
    fn v1_tiles_take_64_query_rows() {
        let p = plan_for(Arch::Sm80, 128, V1).unwrap();
        assert_eq!((p.grid.1, p.smem), (5, ((64 + 4 * 64) * 128 * 2) as u32));
    }
}
