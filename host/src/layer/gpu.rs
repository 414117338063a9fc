//! The decoder layer on the GPU: weights and the paged KV cache resident in HBM,
//! prefill of new prompts (any lengths, packed) and decode steps over any set of
//! live sequences (they may join and leave between steps).
//!
//! Prefill: RMSNorm → QKV GEMM → RoPE + KV write → FlashAttention (causal, varlen)
//! → O GEMM + residual → MLP (RMSNorm → gate/up GEMM with SwiGLU → down GEMM +
//! residual). Decode: the same with split-KV attention over the paged cache.

use super::{LayerConfig, LayerWeights};
use crate::error::{Error, Result};
use crate::ops::decode::{BatchBuffers, DecodeBatch};
use crate::ops::gemm::{linear_split_sums, split_sums_finished};
use crate::ops::rmsnorm::add_rms_norm_split_sums;
use crate::ops::rope::{rope_kv_write, RopeTable, SlotBuffers, TokenSlots};
#[cfg(feature = "dev")]
use crate::ops::DecodeVersion;
use crate::ops::{
    flash_attention, linear_ex, rms_norm, AttentionOptions, Epilogue, MlpScratch, PagedKvCache, SeqId, SwiGluMlp,
    VarlenBatch,
};
use crate::runtime::{Gpu, GraphExec};
use crate::tensor::Tensor;
use half::bf16;
use std::cell::RefCell;
use std::collections::HashMap;

/// One stage of a phase, timed on its own (see [`Layer::prefill_profiled`]).
#[derive(Clone, Debug)]
pub struct Stage {
    pub name: &'static str,
    pub ms: f64,
    /// Bytes the stage must move through HBM at least (weights, activations, KV).
    pub bytes: f64,
    pub flops: f64,
    pub launches: u64,
}

/// Activations for one token count, kept between calls.
struct Scratch {
    normed: Tensor<bf16>,
    qkv: Tensor<bf16>,
    q: Tensor<bf16>,
    k: Tensor<bf16>,
    v: Tensor<bf16>,
    o: Tensor<bf16>,
    /// Prefill LSE `[heads, tokens]`; decode LSE `[tokens, heads]`.
    lse: Tensor<f32>,
    lse_decode: Tensor<f32>,
    h1: Tensor<bf16>,
    mlp: MlpScratch,
}

impl Scratch {
    fn bytes(&self) -> usize {
        [&self.normed, &self.qkv, &self.q, &self.k, &self.v, &self.o, &self.h1]
            .iter()
            .map(|t| t.size_bytes())
            .sum::<usize>()
            + self.lse.size_bytes()
            + self.lse_decode.size_bytes()
            + self.mlp.bytes()
    }
}

pub struct Layer {
    cfg: LayerConfig,
    attn_norm: Tensor<bf16>,
    /// `[(n_heads + 2·n_kv_heads)·head_dim, d]`: q, k, v projections stacked.
    w_qkv: Tensor<bf16>,
    w_o: Tensor<bf16>,
    mlp: SwiGluMlp,
    rope: RopeTable,
    /// Private, and never replaced: captured decode graphs hold its pools'
    /// addresses (sequences change only through the layer's methods).
    cache: PagedKvCache,
    scratch: RefCell<HashMap<usize, Scratch>>,
    /// Tells this layer's decode graphs from other layers'.
    id: u64,
    /// How decode attention merges its splits (a graph keeps the one it was captured with).
    #[cfg(feature = "dev")]
    pub decode_version: DecodeVersion,
    /// Decode: the QKV and O projections' split-K sums finished by the RoPE and
    /// the RMSNorm kernels (true, the default) instead of by `gemm_finalize`
    /// launches of their own (kept for side-by-side timing).
    pub fuse_split_finishes: bool,
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
/// they outgrow); the graph replays only through [`Layer::decode_graph`] on the
/// layer that captured it, which is then alive.
pub struct DecodeGraph {
    // Declared first, dropped first: the buffers in `io` outlive the graph.
    exec: GraphExec,
    layer: u64,
    io: GraphIo,
}

/// The fixed buffers a captured decode step reads and writes.
struct GraphIo {
    seqs: Vec<SeqId>,
    plan_len: usize,
    batch_bufs: BatchBuffers,
    slot_bufs: SlotBuffers,
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
    /// them and the RoPE table's `max_pos`, the input tokens `x`): every replay
    /// reads what was checked here.
    fn stage<'a>(
        &'a mut self,
        gpu: &Gpu,
        cache: &PagedKvCache,
        starts: &[usize],
        max_pos: usize,
        x: &Tensor<bf16>,
    ) -> Result<Staged<'a>> {
        let batch = cache.batch_into(gpu, &self.seqs, &mut self.batch_bufs, self.plan_len)?;
        let (slot_seq, slot_pos) = token_slots(starts, &vec![1; starts.len()]);
        let slots = TokenSlots::into_buffers(gpu, &slot_seq, &slot_pos, &mut self.slot_bufs)?;
        slots.check("decode step", &batch, max_pos)?;
        copy_async(gpu, &self.x, x)?;
        Ok(Staged { batch, slots, x: &self.x, out: &mut self.out })
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
        let (b, d) = (seqs.len(), self.cfg.d_model);
        let plan_len = self.rope.max_pos();
        let max_pages = plan_len.div_ceil(self.cache.page_size());
        let z = bf16::ZERO;
        let mut io = GraphIo {
            seqs: seqs.to_vec(),
            plan_len,
            batch_bufs: BatchBuffers::new(b, max_pages)?,
            slot_bufs: SlotBuffers::new(b)?,
            x: Tensor::filled(gpu, &[b, d], z)?,
            out: Tensor::filled(gpu, &[b, d], z)?,
        };
        // The first step, plainly, through the fixed buffers.
        let ones = vec![1; b];
        let starts = self.admit(Phase::Decode, seqs, &ones, x, out)?;
        let st = io.stage(gpu, &self.cache, &starts, self.rope.max_pos(), x)?;
        self.launch_stages(gpu, &ones, &starts, &st.batch, &st.slots, None, st.x, st.out, None)?;
        copy_async(gpu, out, st.out)?;
        gpu.synchronize()?;
        // The same launches, recorded: their arguments point at the fixed buffers.
        let exec =
            gpu.capture(|| self.launch_stages(gpu, &ones, &starts, &st.batch, &st.slots, None, st.x, st.out, None))?;
        drop(st);
        Ok(DecodeGraph { exec, layer: self.id, io })
    }

    /// One decode step of the graph's sequences: grows them, refreshes the fixed
    /// buffers, replays the graph. `x`, `out`: `[sequences, d]`.
    pub fn decode_graph(
        &mut self,
        gpu: &Gpu,
        g: &mut DecodeGraph,
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<()> {
        if g.layer != self.id {
            return Err(Error::InvalidArgument("decode_graph: the graph was captured on another layer".into()));
        }
        let ones = vec![1; g.io.seqs.len()];
        let starts = self.admit(Phase::Decode, &g.io.seqs, &ones, x, out)?;
        let step = (|| {
            g.io.stage(gpu, &self.cache, &starts, self.rope.max_pos(), x)?;
            // SAFETY: the graph is this layer's (checked above); it points into `g.io`,
            // which it owns, and into this layer's weights, cache pools, RoPE table and
            // grow-only scratch, none of which is freed or replaced while the layer lives.
            unsafe { gpu.launch_graph(&g.exec)? };
            copy_async(gpu, out, &g.io.out)
        })();
        self.undo_on_error(&g.io.seqs, &starts, step)
    }
}

/// Each token's row of the batch's page table and its position, for tokens
/// `starts[i] .. starts[i] + lens[i]` of sequence i.
fn token_slots(starts: &[usize], lens: &[usize]) -> (Vec<u32>, Vec<u32>) {
    let t: usize = lens.iter().sum();
    let (mut seq, mut pos) = (Vec::with_capacity(t), Vec::with_capacity(t));
    for (i, (&start, &n)) in starts.iter().zip(lens).enumerate() {
        seq.extend(std::iter::repeat_n(i as u32, n));
        pos.extend((start..start + n).map(|p| p as u32));
    }
    (seq, pos)
}

/// Which phase a call runs (for the stage table).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Prefill,
    Decode,
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
        cfg.validate()?;
        let (d, q, kv) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim());
        let qkv: Vec<bf16> = [&w.wq, &w.wk, &w.wv].iter().flat_map(|m| m.iter().copied()).collect();
        if qkv.len() != (q + 2 * kv) * d || w.wo.len() != d * q || w.attn_norm.len() != d {
            return Err(Error::Shape("layer weights do not match the config".into()));
        }
        Ok(Layer {
            cfg: cfg.clone(),
            attn_norm: Tensor::from_host(gpu, &w.attn_norm, &[d])?,
            w_qkv: Tensor::from_host(gpu, &qkv, &[q + 2 * kv, d])?,
            w_o: Tensor::from_host(gpu, &w.wo, &[d, q])?,
            mlp: SwiGluMlp::new(gpu, d, cfg.d_ff, &w.w_gate, &w.w_up, &w.w_down, Some((&w.mlp_norm, cfg.eps)))?,
            rope: RopeTable::new(gpu, cfg.head_dim, cfg.rope_theta, max_pos)?,
            cache: PagedKvCache::new(
                gpu,
                cache_tokens.div_ceil(page_size.max(1)),
                page_size,
                cfg.n_kv_heads,
                cfg.head_dim,
            )?,
            scratch: RefCell::new(HashMap::new()),
            id: NEXT_LAYER_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            #[cfg(feature = "dev")]
            decode_version: DecodeVersion::Auto,
            fuse_split_finishes: true,
        })
    }

    pub fn config(&self) -> &LayerConfig {
        &self.cfg
    }

    /// Bytes of weights resident on the GPU (and streamed once per forward pass).
    pub fn weight_bytes(&self) -> usize {
        self.attn_norm.size_bytes() + self.w_qkv.size_bytes() + self.w_o.size_bytes() + self.mlp.bytes()
    }

    /// Bytes of activations held for the token counts used so far, and of the RoPE table.
    pub fn activation_bytes(&self) -> usize {
        self.scratch.borrow().values().map(Scratch::bytes).sum::<usize>() + self.rope.bytes()
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

    /// Runs new prompts through the layer: `x` packs `lens[i]` tokens of each
    /// `seqs[i]` (all empty so far), `[Σ lens, d]`; `out` gets the layer output.
    /// Their K and V go into the cache.
    pub fn prefill(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        lens: &[usize],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Result<()> {
        self.run(gpu, Phase::Prefill, seqs, lens, x, out, None)
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
        self.run(gpu, Phase::Prefill, seqs, lens, x, out, Some(&mut stages))?;
        Ok(stages)
    }

    /// One decode step: `x` holds one new token per sequence, `[seqs.len(), d]`.
    pub fn decode(&mut self, gpu: &Gpu, seqs: &[SeqId], x: &Tensor<bf16>, out: &mut Tensor<bf16>) -> Result<()> {
        self.run(gpu, Phase::Decode, seqs, &vec![1; seqs.len()], x, out, None)
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
        self.run(gpu, Phase::Decode, seqs, &vec![1; seqs.len()], x, out, Some(&mut stages))?;
        Ok(stages)
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        gpu: &Gpu,
        phase: Phase,
        seqs: &[SeqId],
        lens: &[usize],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
        stages: Option<&mut Vec<Stage>>,
    ) -> Result<()> {
        let starts = self.admit(phase, seqs, lens, x, out)?;
        let step = (|| {
            let batch = self.cache.batch(gpu, seqs)?;
            let (slot_seq, slot_pos) = token_slots(&starts, lens);
            let slots = TokenSlots::new(gpu, &slot_seq, &slot_pos)?;
            let varlen = if phase == Phase::Prefill { Some(VarlenBatch::new(gpu, lens, lens)?) } else { None };
            self.launch_stages(gpu, lens, &starts, &batch, &slots, varlen.as_ref(), x, out, stages)
        })();
        self.undo_on_error(seqs, &starts, step)
    }

    /// A step that failed after `admit` (an allocation, a launch) leaves its
    /// sequences as they were: what it queued wrote only past their lengths.
    fn undo_on_error(&mut self, seqs: &[SeqId], starts: &[usize], step: Result<()>) -> Result<()> {
        if step.is_err() {
            for (&s, &len) in seqs.iter().zip(starts) {
                self.cache.shrink_to(s, len);
            }
        }
        step
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
        let d = self.cfg.d_model;
        let op = if phase == Phase::Prefill { "layer prefill" } else { "layer decode" };
        if seqs.is_empty() || seqs.len() != lens.len() || lens.contains(&0) {
            return Err(Error::InvalidArgument(format!("{op}: {} sequences with lengths {lens:?}", seqs.len())));
        }
        let t: usize = lens.iter().sum();
        crate::ops::same_shape(op, "x", &[t, d], x.shape())?;
        crate::ops::same_shape(op, "out", &[t, d], out.shape())?;
        let mut starts = Vec::with_capacity(seqs.len());
        for (i, &s) in seqs.iter().enumerate() {
            let len = self.cache.alloc().len(s)?;
            if seqs[..i].contains(&s) {
                return Err(Error::InvalidArgument(format!("{op}: {s:?} appears twice")));
            }
            if phase == Phase::Prefill && len != 0 {
                return Err(Error::InvalidArgument(format!("{op}: {s:?} already holds {len} tokens")));
            }
            if phase == Phase::Decode && len == 0 {
                return Err(Error::InvalidArgument(format!("{op}: {s:?} has no prompt yet")));
            }
            if len + lens[i] > self.rope.max_pos() {
                return Err(Error::TooLarge(format!("{op}: {s:?} would pass {} positions", self.rope.max_pos())));
            }
            starts.push(len);
        }
        self.cache.grow_all(seqs, lens)?;
        Ok(starts)
    }

    /// Decode attention over the layer's cache (with `dev`, in `decode_version`).
    fn decode_attention(
        &self,
        gpu: &Gpu,
        batch: &DecodeBatch,
        q: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
        lse: &mut Tensor<f32>,
    ) -> Result<()> {
        #[cfg(feature = "dev")]
        return crate::ops::decode_attention_with(gpu, &self.cache, batch, q, None, out, lse, self.decode_version);
        #[cfg(not(feature = "dev"))]
        crate::ops::decode_attention(gpu, &self.cache, batch, q, None, out, lse)
    }

    /// Queues the layer's launches for tokens whose cache slots are in `batch` and
    /// `slots`; `varlen` is the prompt layout for prefill, `None` for decode. Only
    /// launches: a CUDA graph can capture it once its buffers exist.
    #[allow(clippy::too_many_arguments)]
    fn launch_stages(
        &self,
        gpu: &Gpu,
        lens: &[usize],
        starts: &[usize],
        batch: &DecodeBatch,
        slots: &TokenSlots,
        varlen: Option<&VarlenBatch>,
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
        mut stages: Option<&mut Vec<Stage>>,
    ) -> Result<()> {
        let c = self.cfg.clone();
        let (d, hd, h, kv) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads);
        let phase = if varlen.is_some() { Phase::Prefill } else { Phase::Decode };
        let t: usize = lens.iter().sum();
        let mut scratch_map = self.scratch.borrow_mut();
        let s = match scratch_map.entry(t) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let z = bf16::ZERO;
                e.insert(Scratch {
                    normed: Tensor::filled(gpu, &[t, d], z)?,
                    qkv: Tensor::filled(gpu, &[t, (h + 2 * kv) * hd], z)?,
                    q: Tensor::filled(gpu, &[t, h, hd], z)?,
                    k: Tensor::filled(gpu, &[t, kv, hd], z)?,
                    v: Tensor::filled(gpu, &[t, kv, hd], z)?,
                    o: Tensor::filled(gpu, &[t, h, hd], z)?,
                    lse: Tensor::filled(gpu, &[h, t], 0.0f32)?,
                    lse_decode: Tensor::filled(gpu, &[t, h], 0.0f32)?,
                    h1: Tensor::filled(gpu, &[t, d], z)?,
                    mlp: MlpScratch::new(gpu, &self.mlp, t)?,
                })
            }
        };

        let tf = t as f64;
        let (qkv_w, o_w) = ((h + 2 * kv) * hd * d, d * h * hd);
        let kv_row = (kv * hd * 2) as f64;
        // Attention traffic and work: prefill reads q, k, v once; decode reads each
        // sequence's whole cache.
        let ctx: Vec<usize> = starts.iter().zip(lens).map(|(s, n)| s + n).collect();
        let (attn_bytes, attn_flops) = match phase {
            Phase::Prefill => (
                tf * ((2 * h * hd * 2) as f64 + 2.0 * kv_row),
                lens.iter().map(|&n| 2.0 * (n * n * h * hd) as f64).sum::<f64>(),
            ),
            Phase::Decode => (
                ctx.iter().map(|&n| 2.0 * n as f64 * kv_row).sum::<f64>(),
                ctx.iter().map(|&n| 4.0 * (n * h * hd) as f64).sum::<f64>(),
            ),
        };
        let act = |cols: usize| tf * cols as f64 * 2.0;
        let mlp_w = self.mlp.bytes() as f64;

        let mut stage = |name: &'static str, bytes: f64, flops: f64, f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
            match stages.as_deref_mut() {
                None => f(),
                Some(list) => {
                    let before = gpu.launch_count();
                    let ms = gpu.time_ms(f)? as f64;
                    list.push(Stage { name, ms, bytes, flops, launches: gpu.launch_count() - before });
                    Ok(())
                }
            }
        };
        // The projections' weights are the layer's own: each may start loading
        // them while the kernel before it finishes (Hopper).
        use crate::ops::Overlap::ResidentWeights;
        stage("rmsnorm (attention)", 2.0 * act(d), 4.0 * tf * d as f64, &mut || {
            rms_norm(gpu, x, &self.attn_norm, c.eps, &mut s.normed)
        })?;
        // Decode: the QKV split-K sums stay in the workspace and the RoPE kernel
        // finishes them (one launch less per step).
        let mut qkv_sums = None;
        stage("QKV GEMM", (qkv_w * 2) as f64 + act(d) + act((h + 2 * kv) * hd), 2.0 * tf * qkv_w as f64, &mut || {
            // SAFETY: the layer's weights are written only by synchronous uploads;
            // the sums are finished by the RoPE launch right after.
            unsafe {
                if phase == Phase::Decode && self.fuse_split_finishes {
                    qkv_sums = linear_split_sums(gpu, &s.normed, &self.w_qkv, ResidentWeights)?;
                }
                if qkv_sums.is_some() {
                    return Ok(());
                }
                linear_ex(gpu, &s.normed, &self.w_qkv, None, &mut s.qkv, Epilogue::Plain, ResidentWeights)
            }
        })?;
        let rope_bytes =
            act((h + 2 * kv) * hd) * if phase == Phase::Prefill { 2.0 } else { 1.0 } + act((h + 2 * kv) * hd);
        stage("RoPE + KV-cache write", rope_bytes, 6.0 * tf * ((h + kv) * hd) as f64, &mut || {
            let kv_out = if phase == Phase::Prefill { Some((&mut s.k, &mut s.v)) } else { None };
            // SAFETY: the sums, when present, are the QKV GEMM's `[t, qkv width]`
            // f32 just above, in the GPU's workspace (never freed while the GPU
            // lives), read and zeroed by this launch before any other uses them.
            unsafe {
                rope_kv_write(gpu, &s.qkv, None, &self.rope, &self.cache, batch, slots, &mut s.q, kv_out, qkv_sums)
            }
        })?;
        let opts = AttentionOptions { causal: true, scale: None };
        stage("attention", attn_bytes, attn_flops, &mut || match varlen {
            Some(vb) => flash_attention(gpu, &s.q, &s.k, &s.v, vb, opts, &mut s.o, &mut s.lse),
            None => self.decode_attention(gpu, batch, &s.q, &mut s.o, &mut s.lse_decode),
        })?;
        // Decode: the O projection's split-K sums are finished, with the residual
        // add, by the MLP's RMSNorm kernel (one launch less per step).
        let mut prenormed = false;
        stage("O GEMM + residual", (o_w * 2) as f64 + 2.0 * act(d) + act(h * hd), 2.0 * tf * o_w as f64, &mut || {
            s.o.reshape(&[t, h * hd])?;
            // SAFETY: as for the QKV weights; the sums are finished right after.
            let r = unsafe {
                // The RoPE launch has read and zeroed the QKV sums.
                if qkv_sums.is_some() {
                    split_sums_finished(gpu);
                }
                let fuse = phase == Phase::Decode && self.fuse_split_finishes;
                let sums = match self.mlp.norm() {
                    Some(_) if fuse => linear_split_sums(gpu, &s.o, &self.w_o, ResidentWeights)?,
                    _ => None,
                };
                match (sums, self.mlp.norm()) {
                    (Some(sums), Some((w, eps))) => {
                        prenormed = true;
                        let y = SwiGluMlp::normed_input(&mut s.mlp);
                        let r = add_rms_norm_split_sums(gpu, sums, x, w, eps, &mut s.h1, y);
                        if r.is_ok() {
                            split_sums_finished(gpu);
                        }
                        r
                    }
                    _ => linear_ex(gpu, &s.o, &self.w_o, Some(x), &mut s.h1, Epilogue::Residual, ResidentWeights),
                }
            };
            s.o.reshape(&[t, h, hd])?;
            r
        })?;
        stage(
            "MLP (RMSNorm, gate/up + SwiGLU, down + residual)",
            mlp_w + 4.0 * act(d),
            6.0 * tf * (d * c.d_ff) as f64,
            &mut || {
                if prenormed {
                    self.mlp.forward_prenormed(gpu, &s.h1, &mut s.mlp, out)
                } else {
                    self.mlp.forward(gpu, &s.h1, &mut s.mlp, out)
                }
            },
        )?;
        Ok(())
    }
}
