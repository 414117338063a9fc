//! The decoder layer on the GPU: weights and the paged KV cache resident in HBM,
//! prefill of prompts (any lengths, packed; whole or in chunks) and decode steps
//! over any set of live sequences (they may join and leave between steps).
//!
//! Prefill: RMSNorm → QKV GEMM → RoPE + KV write → FlashAttention (causal, varlen)
//! → O GEMM + residual → MLP (RMSNorm → gate/up GEMM with SwiGLU → down GEMM +
//! residual); a chunk after earlier ones gathers its sequence's keys from the
//! cache before the attention. Decode: the same with split-KV attention over the
//! paged cache.

use super::block::{check_lens, Block, Chain, Phase, ScratchSet, Stage, Step, StepOptions};
use super::step_io::{with_mixed_step, GraphWords, StepBuffers};
use super::{LayerConfig, LayerWeights};
use crate::error::{Error, Result};
use crate::ops::decode::DecodeBatch;
use crate::ops::rope::{RopeTable, TokenSlots};
#[cfg(feature = "dev")]
use crate::ops::DecodeVersion;
use crate::ops::{PagedKvCache, SeqId};
use crate::runtime::{Gpu, GraphExec};
use crate::tensor::Tensor;
use crate::tp::AllReduce;
use half::bf16;
use std::cell::RefCell;

pub struct Layer {
    /// Declared first, dropped first: its drop waits for queued steps, which
    /// may still read the weights, cache and scratch freed after it.
    step_bufs: RefCell<StepBuffers>,
    block: Block,
    rope: RopeTable,
    /// Private, and never replaced: captured decode graphs hold its pools'
    /// addresses (sequences change only through the layer's methods).
    cache: PagedKvCache,
    scratch: ScratchSet,
    /// Tells this layer's decode graphs from other layers'.
    id: u64,
    /// How decode attention merges its splits (a graph keeps the one it was captured with).
    #[cfg(feature = "dev")]
    pub decode_version: DecodeVersion,
    /// Decode: the QKV and O projections' split-K sums finished by the RoPE and
    /// the RMSNorm kernels (true, the default) instead of by `gemm_finalize`
    /// launches of their own (kept for side-by-side timing).
    pub fuse_split_finishes: bool,
    /// The prefill's QKV, O, gate/up and down GEMMs on this version (`Auto`,
    /// the default: the shipped plans), for side-by-side timing.
    #[cfg(feature = "dev")]
    pub prefill_gemm: crate::ops::GemmVersion,
}

static NEXT_LAYER_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A decode step of a fixed set of sequences captured as a CUDA graph: every
/// launch keeps its pointers and grid, so the page tables, lengths and token slots
/// live in fixed buffers refreshed before each replay, the tokens go through fixed
/// input and output tensors, and split-KV attention is planned for the longest
/// sequence the layer allows. Capture again after the set of sequences changes.
///
/// The graph holds device addresses of the buffers in `io` (its own, freed only
/// after `exec`) and of the layer's weights, scratch, RoPE table, cache pools and
/// split-KV partials and counters, none of which the layer frees or replaces
/// while it lives (its scratch and the cache's partials only grow, keeping what
/// they outgrow); the graph replays only through [`Layer::decode_graph`] or
/// [`Layer::replay_decode`] on the layer that captured it, which is then alive.
pub struct DecodeGraph {
    // Declared first, dropped first: the buffers in `io` outlive the graph.
    exec: GraphExec,
    layer: u64,
    /// Captured with a tensor-parallel group's all-reduces (replays only through
    /// [`TpLayer`](crate::tp::TpLayer)).
    sharded: bool,
    io: GraphIo,
}

/// The fixed buffers a captured decode step reads and writes.
struct GraphIo {
    seqs: Vec<SeqId>,
    plan_len: usize,
    words: GraphWords,
    x: Tensor<bf16>,
    out: Tensor<bf16>,
}

/// What a step reads from a graph's fixed buffers, borrowed from them.
struct Staged<'a> {
    batch: DecodeBatch<'a>,
    slots: TokenSlots<'a>,
    x: &'a Tensor<bf16>,
    out: &'a mut Tensor<bf16>,
}

impl GraphIo {
    /// Fills the fixed buffers for a step of the graph's sequences, grown already
    /// from lengths `starts` (page tables, lengths, token slots checked against
    /// them and the RoPE table's `max_pos`): every replay reads what was checked
    /// here. The input tokens are the graph's own `x`, written by the caller.
    fn stage<'a>(
        &'a mut self,
        gpu: &Gpu,
        cache: &PagedKvCache,
        starts: &[usize],
        max_pos: usize,
    ) -> Result<Staged<'a>> {
        let (batch, slots) = self.words.stage(gpu, cache, &self.seqs, starts, self.plan_len)?;
        slots.check("decode step", &batch, max_pos)?;
        Ok(Staged { batch, slots, x: &self.x, out: &mut self.out })
    }
}

/// A captured decode graph's own input, `[sequences, d]`: what its next replay
/// reads. It is written only through these methods, so the buffer whose
/// address the graph holds is never replaced, freed or reshaped.
pub struct GraphInput<'a>(&'a mut Tensor<bf16>);

impl GraphInput<'_> {
    /// Copies `src` (same shape) in, on the stream: after the replays queued
    /// before, ahead of the next.
    pub fn copy_from(&mut self, gpu: &Gpu, src: &Tensor<bf16>) -> Result<()> {
        copy_async(gpu, self.0, src)
    }

    /// Uploads `data` (`sequences × d` elements, row-major), waiting for
    /// queued work first.
    pub fn copy_from_host(&mut self, gpu: &Gpu, data: &[bf16]) -> Result<()> {
        self.0.copy_from_host(gpu, data)
    }

    pub fn tensor(&self) -> &Tensor<bf16> {
        self.0
    }
}

impl Drop for DecodeGraph {
    fn drop(&mut self) {
        // A replay may still be running on the buffers about to be freed.
        let _ = cust::context::CurrentContext::synchronize();
    }
}

impl DecodeGraph {
    pub fn sequences(&self) -> &[SeqId] {
        &self.io.seqs
    }

    /// The input that [`Layer::replay_decode`] reads, to be written in place.
    pub fn input(&mut self) -> GraphInput<'_> {
        GraphInput(&mut self.io.x)
    }

    /// What the last step wrote, `[sequences, d]` (stream-ordered: reads
    /// queued after a replay see it).
    pub fn output(&self) -> &Tensor<bf16> {
        &self.io.out
    }
}

/// Stream-ordered device-to-device copy of a whole tensor.
fn copy_async(gpu: &Gpu, dst: &Tensor<bf16>, src: &Tensor<bf16>) -> Result<()> {
    crate::ops::same_shape("copy", "destination", src.shape(), dst.shape())?;
    // SAFETY: same shape and dtype, so the same number of bytes on both sides.
    let status = unsafe {
        cust::sys::cuMemcpyDtoDAsync_v2(dst.device_ptr(), src.device_ptr(), src.size_bytes(), gpu.stream().as_inner())
    };
    crate::error::check("cuMemcpyDtoDAsync", status)
}

impl Layer {
    /// Decodes one step of `seqs` plainly through fixed buffers (which warms up
    /// every buffer the step needs), then captures that step as a CUDA graph for
    /// [`decode_graph`](Self::decode_graph). `x` and `out` are this first step's.
    /// If the capture itself fails, the error comes back but the first step has
    /// been decoded (the sequences grew and `out` holds it).
    pub fn capture_decode(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<DecodeGraph> {
        self.capture_decode_in(gpu, seqs, x, out, None)
    }

    /// [`capture_decode`](Self::capture_decode), as a rank of `shard` when given.
    pub(crate) fn capture_decode_in(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
        shard: Option<&dyn AllReduce>,
    ) -> Result<DecodeGraph> {
        let (b, d) = (seqs.len(), self.config().d_model);
        let plan_len = self.rope.max_pos();
        let max_pages = plan_len.div_ceil(self.cache.page_size());
        let z = bf16::ZERO;
        let mut io = GraphIo {
            seqs: seqs.to_vec(),
            plan_len,
            words: GraphWords::new(b, max_pages)?,
            x: Tensor::filled(gpu, &[b, d], z)?,
            out: Tensor::filled(gpu, &[b, d], z)?,
        };
        // The first step, plainly, through the fixed buffers; if it fails, the
        // sequences are as they were.
        let ones = vec![1; b];
        let starts = self.admit(Phase::Decode, seqs, &ones, x, out)?;
        let st = match copy_async(gpu, &io.x, x).and_then(|()| io.stage(gpu, &self.cache, &starts, plan_len)) {
            Ok(st) => st,
            Err(err) => {
                self.shrink_back(seqs, &starts);
                return Err(err);
            }
        };
        let step = Step::decode(&ones, &starts, &st.batch, &st.slots);
        let first = self.launch_stages(gpu, &step, st.x, st.out, None, shard);
        if let Err(err) = first.and_then(|()| copy_async(gpu, out, st.out)).and_then(|()| gpu.synchronize()) {
            self.shrink_back(seqs, &starts);
            return Err(err);
        }
        // The same launches, recorded: their arguments point at the fixed buffers.
        let exec = gpu.capture(|| self.launch_stages(gpu, &step, st.x, st.out, None, shard))?;
        drop(st);
        Ok(DecodeGraph { exec, layer: self.id, sharded: shard.is_some(), io })
    }

    /// One decode step of the graph's sequences: grows them, refreshes the fixed
    /// buffers, copies `x` into the graph's input, replays the graph and copies
    /// its output to `out`. `x`, `out`: `[sequences, d]`.
    pub fn decode_graph(
        &mut self,
        gpu: &Gpu,
        g: &mut DecodeGraph,
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<()> {
        self.decode_graph_in(gpu, g, Some((x, out)), false)
    }

    /// [`decode_graph`](Self::decode_graph) in place, with no copies: the step
    /// reads [`DecodeGraph::input`] and writes [`DecodeGraph::output`].
    pub fn replay_decode(&mut self, gpu: &Gpu, g: &mut DecodeGraph) -> Result<()> {
        self.decode_graph_in(gpu, g, None, false)
    }

    /// [`decode_graph`](Self::decode_graph) (with `io`) or [`replay_decode`](Self::replay_decode)
    /// of a graph captured plainly, or (`sharded`) with a tensor-parallel group
    /// whose communicator the caller keeps alive.
    pub(crate) fn decode_graph_in(
        &mut self,
        gpu: &Gpu,
        g: &mut DecodeGraph,
        io: Option<(&Tensor<bf16>, &mut Tensor<bf16>)>,
        sharded: bool,
    ) -> Result<()> {
        if g.layer != self.id {
            return Err(Error::InvalidArgument("decode_graph: the graph was captured on another layer".into()));
        }
        if g.sharded != sharded {
            let how = if g.sharded { "with a tensor-parallel group" } else { "without one" };
            return Err(Error::InvalidArgument(format!("decode_graph: the graph was captured {how}")));
        }
        let ones = vec![1; g.io.seqs.len()];
        let (x, out) = match &io {
            Some((x, out)) => (*x, &**out),
            None => (&g.io.x, &g.io.out),
        };
        let starts = self.admit(Phase::Decode, &g.io.seqs, &ones, x, out)?;
        let step = (|| {
            g.io.stage(gpu, &self.cache, &starts, self.rope.max_pos())?;
            if let Some((x, _)) = &io {
                copy_async(gpu, &g.io.x, x)?;
            }
            // SAFETY: the graph is this layer's (checked above); it points into `g.io`,
            // which it owns, and into this layer's weights, cache pools, RoPE table and
            // grow-only scratch, none of which is freed or replaced while the layer lives.
            unsafe { gpu.launch_graph(&g.exec)? };
            match io {
                Some((_, out)) => copy_async(gpu, out, &g.io.out),
                None => Ok(()),
            }
        })();
        self.undo_on_error(&g.io.seqs, &starts, step)
    }
}

impl Layer {
    /// Uploads the weights and allocates a cache of `cache_tokens` tokens in
    /// pages of `page_size`; sequences may reach `max_pos` tokens (the RoPE table).
    pub fn new(
        gpu: &Gpu,
        cfg: &LayerConfig,
        w: &LayerWeights,
        cache_tokens: usize,
        page_size: usize,
        max_pos: usize,
    ) -> Result<Layer> {
        Ok(Layer {
            block: Block::from_host(gpu, cfg, w)?,
            rope: RopeTable::new(gpu, cfg.head_dim, cfg.rope_theta, max_pos)?,
            cache: PagedKvCache::new(
                gpu,
                cache_tokens.div_ceil(page_size.max(1)),
                page_size,
                cfg.n_kv_heads,
                cfg.head_dim,
            )?,
            scratch: ScratchSet::default(),
            step_bufs: RefCell::default(),
            id: NEXT_LAYER_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            #[cfg(feature = "dev")]
            decode_version: DecodeVersion::Auto,
            fuse_split_finishes: true,
            #[cfg(feature = "dev")]
            prefill_gemm: crate::ops::GemmVersion::Auto,
        })
    }

    pub fn config(&self) -> &LayerConfig {
        self.block.config()
    }

    /// Bytes of weights resident on the GPU (and streamed once per forward pass).
    pub fn weight_bytes(&self) -> usize {
        self.block.weight_bytes()
    }

    /// Bytes of activations held for the token counts used so far, and of the RoPE table.
    pub fn activation_bytes(&self) -> usize {
        self.scratch.bytes() + self.rope.bytes() + self.step_bufs.borrow().bytes()
    }

    /// As [`Block::decode_reduces_sums`], with this layer's options.
    pub(crate) fn decode_reduces_sums(&self, gpu: &Gpu, tokens: usize) -> Result<bool> {
        self.block.decode_reduces_sums(gpu, self.options(), tokens)
    }

    fn options(&self) -> StepOptions {
        StepOptions {
            #[cfg(feature = "dev")]
            decode_version: self.decode_version,
            fuse_split_finishes: self.fuse_split_finishes,
            #[cfg(feature = "dev")]
            prefill_gemm: self.prefill_gemm,
        }
    }

    /// The block's launches for `step` over this layer's cache, RoPE table and scratch.
    fn launch_stages(
        &self,
        gpu: &Gpu,
        step: &Step,
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
        stages: Option<&mut Vec<Stage>>,
        shard: Option<&dyn AllReduce>,
    ) -> Result<()> {
        let kv = (&self.cache).into();
        let chain = Chain::default();
        let deferred = self.block.launch_stages(
            gpu,
            kv,
            &self.rope,
            &self.scratch,
            self.options(),
            chain,
            step,
            x,
            out,
            stages,
            shard,
        )?;
        debug_assert!(deferred.is_none());
        Ok(())
    }

    /// The layer's KV cache (read-only: sequences change through the layer).
    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// A new, empty sequence.
    pub fn add_sequence(&mut self) -> SeqId {
        self.cache.add_sequence()
    }

    /// Ends a sequence; its pages return to the pool.
    pub fn release(&mut self, seq: SeqId) -> Result<()> {
        self.cache.release(seq)
    }

    /// [`PagedKvCache::truncate`]: `seq` keeps its first `len` tokens.
    pub fn truncate(&mut self, gpu: &Gpu, seq: SeqId, len: usize) -> Result<()> {
        self.cache.truncate(gpu, seq, len)
    }

    /// [`PagedKvCache::fork`]: a new sequence holding `seq`'s tokens.
    pub fn fork(&mut self, gpu: &Gpu, seq: SeqId) -> Result<SeqId> {
        self.cache.fork(gpu, seq)
    }

    /// Runs prompts through the layer: `x` packs `lens[i]` tokens of each
    /// `seqs[i]`, `[Σ lens, d]`; `out` gets the layer output. Their K and V go
    /// into the cache. A sequence may hold tokens already: its `lens[i]` are
    /// the next chunk of its prompt and attend to every earlier one (chunked
    /// prefill), as if the prompt had come whole.
    pub fn prefill(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        lens: &[usize],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<()> {
        self.run(gpu, Phase::Prefill, seqs, lens, x, out, None, None)
    }

    /// [`prefill`](Self::prefill), timing each stage on its own (synchronizing between stages).
    pub fn prefill_profiled(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        lens: &[usize],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<Vec<Stage>> {
        let mut stages = Vec::new();
        self.run(gpu, Phase::Prefill, seqs, lens, x, out, Some(&mut stages), None)?;
        Ok(stages)
    }

    /// One decode step: `x` holds one new token per sequence, `[seqs.len(), d]`.
    pub fn decode(&mut self, gpu: &Gpu, seqs: &[SeqId], x: &Tensor<bf16>, out: &mut Tensor<bf16>) -> Result<()> {
        self.run(gpu, Phase::Decode, seqs, &vec![1; seqs.len()], x, out, None, None)
    }

    /// One decode step of `k` new tokens of each sequence (speculative
    /// decoding's verification: the last accepted token and `k − 1` drafted
    /// ones): `x` holds them, `[seqs.len() · k, d]`, each sequence's in order,
    /// and `out` gets each one's output; token j of a sequence sees its cache
    /// and the step's tokens up to j. `k` is at most [`MAX_Q_LEN`]; rejected
    /// drafts go by [`truncate`](Self::truncate).
    ///
    /// [`MAX_Q_LEN`]: crate::ops::decode::MAX_Q_LEN
    pub fn decode_tokens(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        k: usize,
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<()> {
        super::block::check_tokens_each("layer decode", k)?;
        self.run(gpu, Phase::Decode, seqs, &vec![k; seqs.len()], x, out, None, None)
    }

    /// One step of new prompts and running sequences together (chunked
    /// prefill's mixed step): `x` packs `lens[i]` tokens of each `prompts[i]`
    /// (a whole prompt, or its next chunk after those it holds), then one token
    /// of each `running` sequence,
    /// `[Σ lens + running.len(), d]`; `out` gets the layer output in the same
    /// rows. The projections and the MLP read their weights once for all rows;
    /// the prompts' attention runs as a prefill's, the running rows' over their
    /// cache as a decode's.
    pub fn mixed(
        &mut self,
        gpu: &Gpu,
        prompts: &[SeqId],
        lens: &[usize],
        running: &[SeqId],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<()> {
        let op = "layer mixed step";
        let all: Vec<SeqId> = prompts.iter().chain(running).copied().collect();
        let all_lens: Vec<usize> = lens.iter().copied().chain(std::iter::repeat_n(1, running.len())).collect();
        check_lens(op, &all, &all_lens)?;
        let d = self.config().d_model;
        let t = lens.iter().sum::<usize>() + running.len();
        crate::ops::same_shape(op, "x", &[t, d], x.shape())?;
        crate::ops::same_shape(op, "out", &[t, d], out.shape())?;
        let starts = super::block::admit_mixed(&mut self.cache, self.rope.max_pos(), prompts, lens, running)?;
        let cfg = self.config();
        let mut bufs = self.step_bufs.borrow_mut();
        let step = with_mixed_step(gpu, &mut bufs, &self.cache, cfg, &all, running.len(), &starts, &all_lens, |step| {
            self.launch_stages(gpu, step, x, out, None, None)
        });
        drop(bufs);
        self.undo_on_error(&all, &starts, step)
    }

    /// [`decode`](Self::decode), timing each stage on its own.
    pub fn decode_profiled(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<Vec<Stage>> {
        let mut stages = Vec::new();
        self.run(gpu, Phase::Decode, seqs, &vec![1; seqs.len()], x, out, Some(&mut stages), None)?;
        Ok(stages)
    }

    /// A prefill or decode step, timing each stage into `stages` when given, as
    /// a rank of `shard` when given.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &mut self,
        gpu: &Gpu,
        phase: Phase,
        seqs: &[SeqId],
        lens: &[usize],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
        stages: Option<&mut Vec<Stage>>,
        shard: Option<&dyn AllReduce>,
    ) -> Result<()> {
        let starts = self.admit(phase, seqs, lens, x, out)?;
        let step = (|| {
            let mut bufs = self.step_bufs.borrow_mut();
            let staged = bufs.stage(gpu, &self.cache, seqs, &starts, lens, phase == Phase::Prefill, None)?;
            let step = staged.step(lens, &starts);
            self.launch_stages(gpu, &step, x, out, stages, shard)
        })();
        self.undo_on_error(seqs, &starts, step)
    }

    /// A step that failed after `admit` (an allocation, a launch) leaves its
    /// sequences as they were: what it queued wrote only past their lengths.
    fn undo_on_error(&mut self, seqs: &[SeqId], starts: &[usize], step: Result<()>) -> Result<()> {
        if step.is_err() {
            self.shrink_back(seqs, starts);
        }
        step
    }

    /// Sequences `seqs` back to lengths `starts` (a step that failed after they grew).
    fn shrink_back(&mut self, seqs: &[SeqId], starts: &[usize]) {
        for (&s, &len) in seqs.iter().zip(starts) {
            self.cache.shrink_to(s, len);
        }
    }

    /// Checks a call and grows its sequences; returns each sequence's length before.
    /// Nothing is launched, and on an error nothing changes (a full pool included).
    fn admit(
        &mut self,
        phase: Phase,
        seqs: &[SeqId],
        lens: &[usize],
        x: &Tensor<bf16>,
        out: &Tensor<bf16>,
    ) -> Result<Vec<usize>> {
        let d = self.config().d_model;
        let op = if phase == Phase::Prefill { "layer prefill" } else { "layer decode" };
        check_lens(op, seqs, lens)?;
        let t: usize = lens.iter().sum();
        crate::ops::same_shape(op, "x", &[t, d], x.shape())?;
        crate::ops::same_shape(op, "out", &[t, d], out.shape())?;
        super::block::admit(&mut self.cache, self.rope.max_pos(), phase, seqs, lens)
    }
}
