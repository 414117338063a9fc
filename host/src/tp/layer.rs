//! One tensor-parallel rank's decoder layer: its slice of the weights (whole
//! heads of Q, K, V and O, whole FFN columns), its own KV cache of its KV heads,
//! and the group's all-reduce after the O and down projections (captured into
//! the decode graph with the rest of the step).
//!
//! Every rank holds the whole residual stream. After the O projection: where it
//! splits K (the decode step), the group sums its f32 partial sums in place in
//! the workspace, and every rank finishes them with the residual and the MLP's
//! RMSNorm in one launch, as the unsharded step does; elsewhere (prefill) the
//! first rank's GEMM adds the residual, the others' add zeros, the group sums
//! the bf16 outputs, and the norm follows. After the down projection, the
//! latter. Nothing overlaps an all-reduce: the kernels on each side of it
//! write or read what it sums.

use super::{AllReduce, ShardPlan};
use crate::error::{Error, Result};
use crate::layer::block::Phase;
use crate::layer::{DecodeGraph, GraphInput, Layer, LayerConfig, LayerWeights, Stage};
use crate::ops::SeqId;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;
use std::marker::PhantomData;

/// One all-reduce of a step: how many elements, f32 or bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reduction {
    pub elements: usize,
    pub f32_sums: bool,
}

impl Reduction {
    pub fn bytes(&self) -> usize {
        self.elements * if self.f32_sums { 4 } else { 2 }
    }
}

pub struct TpLayer<'g> {
    layer: Layer,
    plan: ShardPlan,
    group: &'g dyn AllReduce,
}

/// A decode step captured with its group's all-reduces: it replays only while
/// the group (its communicator) lives.
pub struct TpDecodeGraph<'g> {
    graph: DecodeGraph,
    _group: PhantomData<&'g ()>,
}

impl TpDecodeGraph<'_> {
    pub fn sequences(&self) -> &[SeqId] {
        self.graph.sequences()
    }

    /// As [`DecodeGraph::input`].
    pub fn input(&mut self) -> GraphInput<'_> {
        self.graph.input()
    }

    /// As [`DecodeGraph::output`].
    pub fn output(&self) -> &Tensor<bf16> {
        self.graph.output()
    }
}

impl<'g> TpLayer<'g> {
    /// This rank's slice of `w`, a whole layer of `cfg`, uploaded; a cache of
    /// `cache_tokens` tokens of its KV heads in pages of `page_size`; positions
    /// up to `max_pos`. The rank and world are the group's.
    pub fn new(
        gpu: &Gpu,
        cfg: &LayerConfig,
        w: &LayerWeights,
        group: &'g dyn AllReduce,
        cache_tokens: usize,
        page_size: usize,
        max_pos: usize,
    ) -> Result<TpLayer<'g>> {
        let plan = ShardPlan::new(cfg, group.world(), group.rank())?;
        let shard = w.shard(cfg, &plan)?;
        TpLayer::from_shard(gpu, cfg, plan, &shard, group, cache_tokens, page_size, max_pos)
    }

    /// A rank whose slice is already cut (`shard`, a layer of
    /// `plan.shard_config(cfg)`: from [`LayerWeights::shard_from_checkpoint`],
    /// which reads only the slice).
    #[allow(clippy::too_many_arguments)]
    pub fn from_shard(
        gpu: &Gpu,
        cfg: &LayerConfig,
        plan: ShardPlan,
        shard: &LayerWeights,
        group: &'g dyn AllReduce,
        cache_tokens: usize,
        page_size: usize,
        max_pos: usize,
    ) -> Result<TpLayer<'g>> {
        if (plan.world, plan.rank) != (group.world(), group.rank()) {
            return Err(Error::InvalidArgument(format!(
                "tensor parallelism: a plan for rank {} of {} in a group where this is rank {} of {}",
                plan.rank,
                plan.world,
                group.rank(),
                group.world()
            )));
        }
        if plan != ShardPlan::new(cfg, plan.world, plan.rank)? {
            return Err(Error::InvalidArgument(format!("shard plan {plan:?} is not of this layer's dimensions")));
        }
        let layer = Layer::new(gpu, &plan.shard_config(cfg), shard, cache_tokens, page_size, max_pos)?;
        Ok(TpLayer { layer, plan, group })
    }

    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// The rank's own layer (its slice's config, cache and byte counts).
    pub fn layer(&self) -> &Layer {
        &self.layer
    }

    /// As [`Layer::fuse_split_finishes`]. It decides whether a decode step's
    /// first all-reduce sums f32 or bf16: every rank of the group must set the
    /// same, on GPUs of one kind (the GEMM plan, which depends on the SM count,
    /// decides it too), or the ranks' collectives would not match.
    pub fn set_fuse_split_finishes(&mut self, on: bool) {
        self.layer.fuse_split_finishes = on;
    }

    /// A decode step's two all-reduces over `tokens` tokens: the first sums
    /// f32 split-K sums where the O projection leaves them, else bf16; the
    /// second the MLP's bf16 output.
    pub fn decode_all_reduces(&self, gpu: &Gpu, tokens: usize) -> Result<[Reduction; 2]> {
        let elements = tokens * self.layer.config().d_model;
        let f32_sums = self.layer.decode_reduces_sums(gpu, tokens)?;
        Ok([Reduction { elements, f32_sums }, Reduction { elements, f32_sums: false }])
    }

    pub fn add_sequence(&mut self) -> SeqId {
        self.layer.add_sequence()
    }

    pub fn release(&mut self, seq: SeqId) -> Result<()> {
        self.layer.release(seq)
    }

    pub fn truncate(&mut self, gpu: &Gpu, seq: SeqId, len: usize) -> Result<()> {
        self.layer.truncate(gpu, seq, len)
    }

    pub fn fork(&mut self, gpu: &Gpu, seq: SeqId) -> Result<SeqId> {
        self.layer.fork(gpu, seq)
    }

    /// [`Layer::prefill`] on this rank; every rank of the group makes the same
    /// call with the same `x`, and gets the same `out`.
    pub fn prefill(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        lens: &[usize],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<()> {
        self.layer.run(gpu, Phase::Prefill, seqs, lens, x, out, None, Some(self.group))
    }

    /// [`prefill`](Self::prefill), each stage (the all-reduces included) timed on its own.
    pub fn prefill_profiled(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        lens: &[usize],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<Vec<Stage>> {
        let mut stages = Vec::new();
        self.layer.run(gpu, Phase::Prefill, seqs, lens, x, out, Some(&mut stages), Some(self.group))?;
        Ok(stages)
    }

    /// [`Layer::decode`] on this rank (every rank makes the same call).
    pub fn decode(&mut self, gpu: &Gpu, seqs: &[SeqId], x: &Tensor<bf16>, out: &mut Tensor<bf16>) -> Result<()> {
        let ones = vec![1; seqs.len()];
        self.layer.run(gpu, Phase::Decode, seqs, &ones, x, out, None, Some(self.group))
    }

    /// [`decode`](Self::decode), each stage timed on its own.
    pub fn decode_profiled(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<Vec<Stage>> {
        let (ones, mut stages) = (vec![1; seqs.len()], Vec::new());
        self.layer.run(gpu, Phase::Decode, seqs, &ones, x, out, Some(&mut stages), Some(self.group))?;
        Ok(stages)
    }

    /// [`Layer::capture_decode`] on this rank, the all-reduces in the graph.
    pub fn capture_decode(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<TpDecodeGraph<'g>> {
        let graph = self.layer.capture_decode_in(gpu, seqs, x, out, Some(self.group))?;
        Ok(TpDecodeGraph { graph, _group: PhantomData })
    }

    /// [`Layer::decode_graph`] of a graph this rank captured.
    pub fn decode_graph(
        &mut self,
        gpu: &Gpu,
        g: &mut TpDecodeGraph<'g>,
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<()> {
        self.layer.decode_graph_in(gpu, &mut g.graph, Some((x, out)), true)
    }

    /// [`Layer::replay_decode`] of a graph this rank captured.
    pub fn replay_decode(&mut self, gpu: &Gpu, g: &mut TpDecodeGraph<'g>) -> Result<()> {
        self.layer.decode_graph_in(gpu, &mut g.graph, None, true)
    }
}
