//! Decode versions kept for comparison (llm.c style, side by side): the
//! one-warp split kernel merging in the launch (`Fused`), eight one-stage warps
//! (`Wide8`), and thread-block clusters merging through distributed shared
//! memory (`Cluster`, sm_90a), next to the shipped `Wide` and `TwoLaunch`.

use super::plan::{self, Geometry, Plan, Schedule};
use super::{DecodeBatch, KvLayer};
use crate::error::Result;
use crate::kernels::dev as k;
use crate::runtime::{Arch, Gpu, Kernel};
use crate::tensor::Tensor;
use abi::decode::dev::{WIDE8_STAGES, WIDE8_WARPS};
use abi::decode::{KEY_TILE, STAGES, WIDE_WARPS};
use half::bf16;

/// How the split-KV partials are merged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeVersion {
    /// The shipped choice ([`decode_attention`](super::decode_attention)):
    /// [`DecodeVersion::Wide`] where it applies (one query per sequence, G ≤ 16,
    /// its shared memory fits), else [`DecodeVersion::TwoLaunch`]. H200: b1 L4096
    /// 11.1–11.5 µs in a graph against 11.8–12.0, b16 L4096 3.72–3.95 TB/s
    /// against 3.51, b64 4.19–4.24 against 4.06–4.12; with the wave-cost split
    /// rule b1 L131072 4078 GB/s against two-launch's 3757.
    Auto,
    /// The split kernel writes partials; `decode_merge` combines them.
    TwoLaunch,
    /// One launch: the last block of each split group merges the group's partials
    /// (one split: each block writes the output directly).
    Fused,
    /// One launch of 4-warp blocks: each warp takes a quarter of the block's keys
    /// and the warps combine in shared memory, so a quarter of the partials reach
    /// the fused merge, which the last block does with all its threads. For small
    /// batches (b1 L4096: 16 partials per KV head instead of 64). One query per
    /// sequence with G ≤ 16 only; other shapes take `Fused`. With one block per
    /// SM, splits by [`choose_splits_waves`](super::choose_splits_waves).
    Wide,
    /// `Wide` whose blocks of one KV head (2 to 16 splits) run as one thread-block
    /// cluster and merge through distributed shared memory after a cluster
    /// barrier: no partials in global memory, no fence, no counter (sm_90, head
    /// dim 128, where all the clusters fit at once; elsewhere `Wide`).
    Cluster,
    /// `Wide` with 8 warps of one K/V stage each in the same shared memory as
    /// 4 of two: two warps per scheduler, and half the key tiles per warp (one
    /// at b1 L4096). Measured: equal at b1 L4096, 3–5% slower at b16 (ncu: 8.6
    /// cycles per issued instruction against 5.0, 24% more instructions). Kept
    /// for the record, not Auto.
    Wide8,
}

impl DecodeVersion {
    /// The concrete version for a call, given whether the wide blocks apply to it.
    pub fn resolve(self, wide_applies: bool) -> DecodeVersion {
        match self {
            DecodeVersion::Auto | DecodeVersion::Wide if wide_applies => DecodeVersion::Wide,
            DecodeVersion::Cluster if wide_applies => DecodeVersion::Cluster,
            DecodeVersion::Wide8 if wide_applies => DecodeVersion::Wide8,
            DecodeVersion::Auto => DecodeVersion::TwoLaunch,
            DecodeVersion::Wide | DecodeVersion::Cluster | DecodeVersion::Wide8 => DecodeVersion::Fused,
            v => v,
        }
    }
}

/// [`decode_attention`](super::decode_attention) with an explicit merge version
/// (`Auto` is exactly `decode_attention`). Every argument is checked first.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_with<'c>(
    gpu: &Gpu,
    cache: impl Into<KvLayer<'c>>,
    batch: &DecodeBatch,
    q: &Tensor<bf16>,
    scale: Option<f32>,
    out: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
    version: DecodeVersion,
) -> Result<()> {
    let cache = cache.into();
    if version == DecodeVersion::Auto {
        return super::decode_attention(gpu, cache, batch, q, scale, out, lse);
    }
    let g = super::check(cache, batch, q, out, lse, scale)?;
    let (warps, stages) =
        if version == DecodeVersion::Wide8 { (WIDE8_WARPS, WIDE8_STAGES) } else { (WIDE_WARPS, STAGES) };
    let smem_optin = gpu.info().max_shared_per_block_optin;
    let version = version.resolve(g.one_tile() && plan::fits(g.head_dim, warps, stages, smem_optin));
    let schedule = match version {
        DecodeVersion::TwoLaunch | DecodeVersion::Auto => plan::two_launch(&g),
        DecodeVersion::Fused => fused(&g),
        DecodeVersion::Wide | DecodeVersion::Cluster => plan::wide(&g),
        DecodeVersion::Wide8 => wide8(&g),
    };
    let per_sm = gpu.occupancy(schedule.kernel, schedule.threads(), schedule.smem(g.head_dim))?.max(1);
    let sm_count = gpu.info().sm_count as usize;
    let p = plan::plan(&g, schedule, batch.plan_len(), sm_count, per_sm as usize)?;
    if version == DecodeVersion::Cluster && g.head_dim == 128 && gpu.info().arch == Arch::Sm90a {
        if let Some(p) = cluster_plan(gpu, &g, &p, batch.plan_len())? {
            return launch_cluster(gpu, cache, batch, q, out, lse, &g, &p);
        }
    }
    super::launch(gpu, cache, batch, q, out, lse, &g, &p)
}

/// One-warp blocks that merge in the launch: the plain entries for one query
/// with G ≤ 16, the spec ones otherwise.
fn fused(g: &Geometry) -> Schedule {
    let kernel = match (g.head_dim == 64, g.one_tile()) {
        (true, true) => k::DECODE_FUSED_HD64,
        (false, true) => k::DECODE_FUSED_HD128,
        (true, false) => k::DECODE_FUSED_SPEC_HD64,
        (false, false) => k::DECODE_FUSED_SPEC_HD128,
    };
    Schedule { kernel, warps: 1, stages: STAGES, fused: true }
}

/// Eight warps of one K/V stage each.
fn wide8(g: &Geometry) -> Schedule {
    let kernel = if g.head_dim == 64 { k::DECODE_WIDE8_HD64 } else { k::DECODE_WIDE8_HD128 };
    Schedule { kernel, warps: WIDE8_WARPS, stages: WIDE8_STAGES, fused: true }
}

/// [`DecodeVersion::Cluster`]'s kernel (head dim 128, sm_90a module only).
const CLUSTER_KERNEL: Kernel<abi::DecodeArgs> = k::DECODE_CLUSTER_HD128;
/// Most blocks in one cluster on Hopper (past the portable 8).
const MAX_CLUSTER: usize = 16;

/// The clustered launch of a `Wide` plan: the most splits (2 to 16, at most the
/// plan's) whose clusters all fit at once. A cluster runs inside one GPC, and on
/// the H200 only 7 clusters of 16 one-block-per-SM blocks fit, not b1 L4096's 8.
/// `None`: no cluster size fits.
fn cluster_plan(gpu: &Gpu, g: &Geometry, p: &Plan, plan_len: usize) -> Result<Option<Plan>> {
    let schedule = Schedule { kernel: CLUSTER_KERNEL, ..p.schedule };
    let unit = KEY_TILE * schedule.warps;
    let tiles = plan_len.div_ceil(unit).max(1);
    for want in (2..=p.splits.min(MAX_CLUSTER)).rev() {
        let chunk_tiles = tiles.div_ceil(want);
        let s = tiles.div_ceil(chunk_tiles);
        if s >= 2 && cluster_capacity(gpu, s)? as usize >= g.batch * g.x_blocks() {
            return Plan::new(g, schedule, s, chunk_tiles * unit).map(Some);
        }
    }
    Ok(None)
}

/// How many clusters of `splits` blocks of the cluster kernel (one per KV head
/// and sequence) fit on `gpu` at once; 0 off Hopper. [`DecodeVersion::Cluster`]
/// needs one per (sequence, KV head).
pub fn cluster_capacity(gpu: &Gpu, splits: usize) -> Result<u32> {
    if gpu.info().arch != Arch::Sm90a || !(1..=MAX_CLUSTER).contains(&splits) {
        return Ok(0);
    }
    let smem = (WIDE_WARPS * abi::decode::ring_bytes(128, STAGES)) as u32;
    let grid = (1, splits as u32, 1);
    gpu.max_active_clusters(CLUSTER_KERNEL, grid, grid, (WIDE_WARPS * abi::decode::WARP_THREADS) as u32, smem)
}

/// Launches a [`cluster_plan`]: a cluster per (sequence, KV head), its splits along y.
#[allow(clippy::too_many_arguments)]
fn launch_cluster(
    gpu: &Gpu,
    cache: KvLayer,
    batch: &DecodeBatch,
    q: &Tensor<bf16>,
    out: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
    g: &Geometry,
    p: &Plan,
) -> Result<()> {
    let partials = cache.partials(p.partial_floats(g.head_dim))?;
    let counters = cache.counters(p.counters)?;
    let a = super::args(cache, batch, q, out, lse, g, p, partials, counters);
    let cluster = (1, p.splits as u32, 1);
    // SAFETY: as `super::launch`; and every block of a cluster reaches its
    // barriers (the kernel has no early exit before them).
    unsafe {
        gpu.launch_cluster_after(
            p.schedule.kernel,
            p.grid,
            cluster,
            p.schedule.threads(),
            p.schedule.smem(g.head_dim),
            &a,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_resolve_where_the_wide_blocks_apply() {
        assert_eq!(DecodeVersion::Auto.resolve(true), DecodeVersion::Wide);
        assert_eq!(DecodeVersion::Auto.resolve(false), DecodeVersion::TwoLaunch);
        assert_eq!(DecodeVersion::Wide.resolve(false), DecodeVersion::Fused);
        assert_eq!(DecodeVersion::Cluster.resolve(true), DecodeVersion::Cluster);
        assert_eq!(DecodeVersion::Cluster.resolve(false), DecodeVersion::Fused);
        assert_eq!(DecodeVersion::Wide8.resolve(true), DecodeVersion::Wide8);
        assert_eq!(DecodeVersion::Wide8.resolve(false), DecodeVersion::Fused);
        assert_eq!(DecodeVersion::Fused.resolve(true), DecodeVersion::Fused);
        assert_eq!(DecodeVersion::TwoLaunch.resolve(true), DecodeVersion::TwoLaunch);
    }

    #[test]
    fn fused_and_wide8_entries_follow_the_shipped_choice() {
        let o = plan::Operands { same_cache: true, n_kv_heads: 8, head_dim: 128, batch: 1, min_len: 4 };
        let g = |q: &[usize], lse: &[usize]| plan::check("op", &o, q, q, lse, None).unwrap();
        assert_eq!(fused(&g(&[1, 32, 128], &[1, 32])).kernel, k::DECODE_FUSED_HD128);
        assert_eq!(fused(&g(&[1, 256, 128], &[1, 256])).kernel, k::DECODE_FUSED_SPEC_HD128);
        assert_eq!(fused(&g(&[1, 2, 32, 128], &[1, 2, 32])).kernel, k::DECODE_FUSED_SPEC_HD128);
        let w8 = wide8(&g(&[1, 32, 128], &[1, 32]));
        // Eight one-stage rings: 160 KB at head dim 128, against four two-stage ones' 144.
        assert_eq!((w8.kernel, w8.threads(), w8.smem(128)), (k::DECODE_WIDE8_HD128, 256, 163840));
        assert_eq!(plan::wide(&g(&[1, 32, 128], &[1, 32])).smem(128), 147456);
    }
}
