//! One decoder block on the GPU: its weights, and the launches of its forward
//! pass over tokens whose KV slots the caller has placed (a `Step`). The
//! standalone [`Layer`](super::Layer) and the whole model run the same block.

use super::step_io::{CachedKeys, DecodeTail};
use super::{LayerConfig, LayerWeights};
use crate::error::{Error, Result};
use crate::ops::decode::{gather_rows, DecodeBatch, PagedKvCache, SeqId};
use crate::ops::gemm::{linear_split_sums, split_sums_finished};
use crate::ops::rmsnorm::add_rms_norm_split_sums;
use crate::ops::rope::{rope_kv_write, RopeTable, TokenSlots};
use crate::ops::{
    flash_attention, linear_ex, rms_norm, AttentionOptions, Epilogue, KvLayer, MlpScratch, SwiGluMlp, VarlenBatch,
};
#[cfg(feature = "dev")]
use crate::ops::{DecodeVersion, GemmVersion};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use crate::tp::{AllReduce, DeviceSums};
use half::bf16;
use std::cell::{RefCell, RefMut};
use std::collections::HashMap;

/// One stage of a phase, timed on its own (see [`Layer::prefill_profiled`](super::Layer::prefill_profiled)).
#[derive(Clone, Debug)]
pub struct Stage {
    pub name: &'static str,
    pub ms: f64,
    /// Bytes the stage must move through HBM at least (weights, activations, KV).
    pub bytes: f64,
    pub flops: f64,
    pub launches: u64,
}

/// How a block runs its decode step: the shipped choices by default; the
/// other settings exist for side-by-side timing.
#[derive(Clone, Copy, Debug)]
pub struct StepOptions {
    /// How decode attention merges its splits.
    #[cfg(feature = "dev")]
    pub decode_version: DecodeVersion,
    /// Decode: the QKV and O projections' split-K sums finished by the RoPE and
    /// the RMSNorm kernels (true) instead of by `gemm_finalize` launches of their own.
    pub fuse_split_finishes: bool,
    /// The prefill's four projections on this GEMM version (`Auto`: the shipped plans).
    #[cfg(feature = "dev")]
    pub prefill_gemm: GemmVersion,
}

impl Default for StepOptions {
    fn default() -> Self {
        StepOptions {
            #[cfg(feature = "dev")]
            decode_version: DecodeVersion::Auto,
            fuse_split_finishes: true,
            #[cfg(feature = "dev")]
            prefill_gemm: GemmVersion::Auto,
        }
    }
}

/// With `dev`, a prefill's GEMM version other than `Auto` (`StepOptions::prefill_gemm`).
#[cfg(feature = "dev")]
fn prefill_gemm(opts: StepOptions, phase: Phase) -> Option<GemmVersion> {
    (phase == Phase::Prefill && opts.prefill_gemm != GemmVersion::Auto).then_some(opts.prefill_gemm)
}

/// `linear_ex`, on the prefill's GEMM version where one is set (`dev`).
///
/// # Safety
/// As `linear_ex`.
#[allow(clippy::too_many_arguments)]
unsafe fn step_linear(
    gpu: &Gpu,
    opts: StepOptions,
    phase: Phase,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    residual: Option<&Tensor<bf16>>,
    out: &mut Tensor<bf16>,
    ep: Epilogue,
) -> Result<()> {
    #[cfg(feature = "dev")]
    if let Some(v) = prefill_gemm(opts, phase) {
        return crate::ops::linear_ex_with(gpu, x, w, residual, out, ep, v, crate::ops::Overlap::ResidentWeights);
    }
    let _ = (opts, phase);
    linear_ex(gpu, x, w, residual, out, ep, crate::ops::Overlap::ResidentWeights)
}

/// Where a step's tokens go: `lens[i]` new tokens of the batch's sequence i,
/// from position `starts[i]`, their cache slots in `batch` and `slots`; `varlen`
/// is the prompt layout for prefill, `None` for decode.
pub(crate) struct Step<'a> {
    pub lens: &'a [usize],
    pub starts: &'a [usize],
    pub batch: &'a DecodeBatch<'a>,
    pub slots: &'a TokenSlots<'a>,
    pub varlen: Option<&'a VarlenBatch<'a>>,
    /// A mixed step (with `varlen`): the last rows are running sequences' next
    /// tokens, whose attention over their cache replaces the varlen pass's.
    pub tail: Option<&'a DecodeTail<'a>>,
    /// A prefill (with `varlen`) whose prompts continue earlier chunks: the
    /// varlen pass's keys, gathered from the cache after the RoPE launch.
    pub keys: Option<&'a CachedKeys<'a>>,
}

impl<'a> Step<'a> {
    /// A decode step: `lens[i]` tokens of the batch's sequence i from `starts[i]`.
    pub fn decode(
        lens: &'a [usize],
        starts: &'a [usize],
        batch: &'a DecodeBatch<'a>,
        slots: &'a TokenSlots<'a>,
    ) -> Step<'a> {
        Step { lens, starts, batch, slots, varlen: None, tail: None, keys: None }
    }
}

/// How a block meets its neighbours in a stack (decode): its attention RMSNorm
/// may already be in the scratch (`input_normed`), formed by the launch that
/// finished the block before; and its down projection's sums may be left for
/// the next block's RMSNorm launch to finish (`defer_down`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Chain {
    pub input_normed: bool,
    pub defer_down: bool,
}

/// A block output not yet written: the down projection's split-K sums, for
/// [`Block::finish_deferred`].
#[must_use]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deferred {
    sums: u64,
    tokens: usize,
}

/// Which phase a call runs (for the stage table).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Prefill,
    Decode,
}

/// A decode step's tokens per sequence: 1 to the decode kernel's `MAX_Q_LEN`.
pub(crate) fn check_tokens_each(op: &str, k: usize) -> Result<()> {
    let most = crate::ops::decode::MAX_Q_LEN;
    if k == 0 || k > most {
        return Err(Error::InvalidArgument(format!("{op}: {k} tokens a sequence (1 to {most})")));
    }
    Ok(())
}

/// A step's sequences and their new-token counts: as many of each, none empty.
pub(crate) fn check_lens(op: &str, seqs: &[SeqId], lens: &[usize]) -> Result<()> {
    if seqs.is_empty() || seqs.len() != lens.len() || lens.contains(&0) {
        return Err(Error::InvalidArgument(format!("{op}: {} sequences with lengths {lens:?}", seqs.len())));
    }
    Ok(())
}

/// Checks a step's sequences against `cache` (distinct, each holding a prompt
/// for decode, staying within `max_pos` positions) and grows them; returns each
/// one's length before. A prefill's sequence may hold tokens already: its new
/// ones are the next chunk of its prompt. On an error nothing changes.
pub(crate) fn admit(
    cache: &mut PagedKvCache,
    max_pos: usize,
    phase: Phase,
    seqs: &[SeqId],
    lens: &[usize],
) -> Result<Vec<usize>> {
    let op = if phase == Phase::Prefill { "prefill" } else { "decode" };
    check_lens(op, seqs, lens)?;
    let mut starts = Vec::with_capacity(seqs.len());
    for (i, &s) in seqs.iter().enumerate() {
        let len = cache.alloc().len(s)?;
        if seqs[..i].contains(&s) {
            return Err(Error::InvalidArgument(format!("{op}: {s:?} appears twice")));
        }
        if phase == Phase::Decode && len == 0 {
            return Err(Error::InvalidArgument(format!("{op}: {s:?} has no prompt yet")));
        }
        if len + lens[i] > max_pos {
            return Err(Error::TooLarge(format!("{op}: {s:?} would pass {max_pos} positions")));
        }
        starts.push(len);
    }
    cache.grow_all(seqs, lens)?;
    Ok(starts)
}

/// [`admit`] for a mixed step: `prompts` (`lens` tokens each, after any chunks
/// they hold) then `running` (one token each); on an error nothing changes.
pub(crate) fn admit_mixed(
    cache: &mut PagedKvCache,
    max_pos: usize,
    prompts: &[SeqId],
    lens: &[usize],
    running: &[SeqId],
) -> Result<Vec<usize>> {
    if let Some(s) = running.iter().find(|s| prompts.contains(s)) {
        return Err(Error::InvalidArgument(format!("mixed step: {s:?} is both a prompt and running")));
    }
    // Either side may be empty (`admit` refuses an empty list), not both.
    let mut starts =
        if prompts.is_empty() { Vec::new() } else { admit(cache, max_pos, Phase::Prefill, prompts, lens)? };
    if running.is_empty() {
        return Ok(starts);
    }
    match admit(cache, max_pos, Phase::Decode, running, &vec![1; running.len()]) {
        Ok(more) => starts.extend(more),
        Err(err) => {
            for (&p, &len) in prompts.iter().zip(&starts) {
                cache.shrink_to(p, len);
            }
            return Err(err);
        }
    }
    Ok(starts)
}

/// The token counts that share buffers: `t` rounded up to the next count of
/// the form m·2^k with m in 4..8 (at least 16), so buffers made for one count
/// serve the counts up to a quarter below it, and prompts of new lengths reuse
/// them instead of allocating (and synchronizing) each time.
pub(crate) fn token_bucket(t: usize) -> usize {
    if t <= 16 {
        return 16;
    }
    // The step: a quarter of the power of two at or below t − 1.
    let step = 1usize << (usize::BITS - 1 - (t - 1).leading_zeros() - 2);
    (t - 1) / step * step + step
}

/// Activations for a bucket of token counts ([`token_bucket`]), kept between
/// calls, shaped for the count at hand by [`Scratch::fit`].
pub(crate) struct Scratch {
    /// The most tokens the allocations hold.
    capacity: usize,
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
    /// `[t, d]` zeros: the residual of a tensor-parallel rank other than the
    /// first (the residual stream is added once over the group), made on first use.
    zeros: Option<Tensor<bf16>>,
}

impl Scratch {
    fn new(gpu: &Gpu, c: &LayerConfig, mlp: &SwiGluMlp, capacity: usize) -> Result<Scratch> {
        let (d, hd, h, kv, z) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads, bf16::ZERO);
        let t = capacity;
        Ok(Scratch {
            capacity,
            normed: Tensor::filled(gpu, &[t, d], z)?,
            qkv: Tensor::filled(gpu, &[t, (h + 2 * kv) * hd], z)?,
            q: Tensor::filled(gpu, &[t, h, hd], z)?,
            k: Tensor::filled(gpu, &[t, kv, hd], z)?,
            v: Tensor::filled(gpu, &[t, kv, hd], z)?,
            o: Tensor::filled(gpu, &[t, h, hd], z)?,
            lse: Tensor::filled(gpu, &[h, t], 0.0f32)?,
            lse_decode: Tensor::filled(gpu, &[t, h], 0.0f32)?,
            h1: Tensor::filled(gpu, &[t, d], z)?,
            mlp: MlpScratch::new(gpu, mlp, t)?,
            zeros: None,
        })
    }

    /// Every buffer shaped for `t` tokens, at most the capacity.
    fn fit(&mut self, c: &LayerConfig, t: usize) -> Result<()> {
        let (d, hd, h, kv) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads);
        self.normed.refit(&[t, d])?;
        self.qkv.refit(&[t, (h + 2 * kv) * hd])?;
        self.q.refit(&[t, h, hd])?;
        self.k.refit(&[t, kv, hd])?;
        self.v.refit(&[t, kv, hd])?;
        self.o.refit(&[t, h, hd])?;
        self.lse.refit(&[h, t])?;
        self.lse_decode.refit(&[t, h])?;
        self.h1.refit(&[t, d])?;
        self.mlp.fit(t)?;
        if let Some(z) = &mut self.zeros {
            z.refit(&[t, d])?;
        }
        Ok(())
    }

    fn bytes(&self) -> usize {
        [&self.normed, &self.qkv, &self.q, &self.k, &self.v, &self.o, &self.h1]
            .iter()
            .map(|t| t.capacity_bytes())
            .sum::<usize>()
            + self.lse.capacity_bytes()
            + self.lse_decode.capacity_bytes()
            + self.mlp.bytes()
            + self.zeros.as_ref().map_or(0, |z| z.capacity_bytes())
    }
}

/// Scratch per bucket of token counts, shared by every block of one config
/// that runs in order on one stream. An entry stays while a captured graph may
/// hold its addresses: the layer never frees one, the model only buckets no
/// decode step used.
#[derive(Default)]
pub(crate) struct ScratchSet(RefCell<HashMap<usize, Scratch>>);

impl ScratchSet {
    /// The scratch of `t`'s bucket, allocated on first use, shaped for `t` tokens.
    pub fn get(&self, gpu: &Gpu, block: &Block, t: usize) -> Result<RefMut<'_, Scratch>> {
        let mut map = self.0.borrow_mut();
        let bucket = token_bucket(t);
        if let std::collections::hash_map::Entry::Vacant(e) = map.entry(bucket) {
            e.insert(Scratch::new(gpu, &block.cfg, &block.mlp, bucket)?);
        }
        let mut s = RefMut::map(map, |m| m.get_mut(&bucket).expect("inserted above"));
        s.fit(&block.cfg, t)?;
        Ok(s)
    }

    pub fn bytes(&self) -> usize {
        self.0.borrow().values().map(Scratch::bytes).sum()
    }

    /// Frees the scratch of every bucket but `keep`'s. The caller makes sure
    /// no queued work and no captured graph still uses those.
    pub fn keep_buckets(&self, keep: &std::collections::HashSet<usize>) {
        self.0.borrow_mut().retain(|b, _| keep.contains(b));
    }
}

/// A decoder block's weights, resident in HBM.
pub(crate) struct Block {
    cfg: LayerConfig,
    attn_norm: Tensor<bf16>,
    /// `[(n_heads + 2·n_kv_heads)·head_dim, d]`: q, k, v projections stacked.
    w_qkv: Tensor<bf16>,
    w_o: Tensor<bf16>,
    mlp: SwiGluMlp,
    /// `[(n_heads + 2·n_kv_heads)·head_dim]`: the Q, K and V biases (Qwen2), added by the RoPE kernel.
    qkv_bias: Option<Tensor<bf16>>,
}

impl Block {
    /// Uploads host weights (Hugging Face layout).
    pub fn from_host(gpu: &Gpu, cfg: &LayerConfig, w: &LayerWeights) -> Result<Block> {
        cfg.validate()?;
        let (d, q, kv) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim());
        let qkv: Vec<bf16> = [&w.wq, &w.wk, &w.wv].iter().flat_map(|m| m.iter().copied()).collect();
        if qkv.len() != (q + 2 * kv) * d || w.wo.len() != d * q || w.attn_norm.len() != d {
            return Err(Error::Shape("layer weights do not match the config".into()));
        }
        Block::from_device(
            cfg,
            Tensor::from_host(gpu, &w.attn_norm, &[d])?,
            Tensor::from_host(gpu, &qkv, &[q + 2 * kv, d])?,
            Tensor::from_host(gpu, &w.wo, &[d, q])?,
            SwiGluMlp::new(gpu, d, cfg.d_ff, &w.w_gate, &w.w_up, &w.w_down, Some((&w.mlp_norm, cfg.eps)))?,
            None,
        )
    }

    /// A block of weights already on the GPU: `attn_norm` `[d]`, `w_qkv`
    /// `[(h + 2·kv)·hd, d]`, `w_o` `[d, h·hd]`, an MLP with its norm, and
    /// optionally the QKV biases `[(h + 2·kv)·hd]`.
    pub fn from_device(
        cfg: &LayerConfig,
        attn_norm: Tensor<bf16>,
        w_qkv: Tensor<bf16>,
        w_o: Tensor<bf16>,
        mlp: SwiGluMlp,
        qkv_bias: Option<Tensor<bf16>>,
    ) -> Result<Block> {
        cfg.validate()?;
        let (d, q, kv) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim());
        crate::ops::same_shape("block", "attn_norm", &[d], attn_norm.shape())?;
        crate::ops::same_shape("block", "w_qkv", &[q + 2 * kv, d], w_qkv.shape())?;
        crate::ops::same_shape("block", "w_o", &[d, q], w_o.shape())?;
        if mlp.dims() != (d, cfg.d_ff) || mlp.norm().is_none() {
            return Err(Error::Shape(format!("block: the MLP is not [{d} → {}] with a norm", cfg.d_ff)));
        }
        if let Some(b) = &qkv_bias {
            crate::ops::same_shape("block", "qkv_bias", &[q + 2 * kv], b.shape())?;
        }
        Ok(Block { cfg: cfg.clone(), attn_norm, w_qkv, w_o, mlp, qkv_bias })
    }

    pub fn config(&self) -> &LayerConfig {
        &self.cfg
    }

    /// Whether a decode step of `tokens` over a group leaves the O projection's
    /// split-K sums to the first all-reduce, which then sums f32, not bf16.
    pub(crate) fn decode_reduces_sums(&self, gpu: &Gpu, opts: StepOptions, tokens: usize) -> Result<bool> {
        if !opts.fuse_split_finishes || self.mlp.norm().is_none() {
            return Ok(false);
        }
        let x = [tokens, self.w_o.shape()[1]];
        Ok(crate::ops::gemm::split_sums_plan(gpu, &x, self.w_o.shape())?.tiles.leaves_sums())
    }

    /// Bytes of weights resident on the GPU (and streamed once per forward pass).
    pub fn weight_bytes(&self) -> usize {
        self.attn_norm.size_bytes()
            + self.w_qkv.size_bytes()
            + self.w_o.size_bytes()
            + self.mlp.bytes()
            + self.qkv_bias.as_ref().map_or(0, |b| b.size_bytes())
    }
    /// Queues the block's launches for tokens whose cache slots are in `batch` and
    /// `slots`; `varlen` is the prompt layout for prefill, `None` for decode. Only
    /// launches: a CUDA graph can capture it once its buffers exist.
    #[allow(clippy::too_many_arguments)]
    /// With `chain`, the input's normalization comes from the block before, and
    /// the output may be left [`Deferred`] for the block after. With `shard`,
    /// the block is one tensor-parallel rank's slice: its O and down outputs are
    /// partial sums, all-reduced over the group. Where the O projection leaves
    /// split-K sums (decode), the group sums those in f32 and every rank finishes
    /// them with the residual and the MLP norm as the unsharded step does;
    /// elsewhere the first rank alone adds the residual, the group sums the bf16
    /// outputs, and the norm follows.
    pub fn launch_stages(
        &self,
        gpu: &Gpu,
        kv_layer: KvLayer,
        rope: &RopeTable,
        scratch: &ScratchSet,
        step_opts: StepOptions,
        chain: Chain,
        step: &Step,
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
        mut stages: Option<&mut Vec<Stage>>,
        shard: Option<&dyn AllReduce>,
    ) -> Result<Option<Deferred>> {
        if shard.is_some() && (chain.input_normed || chain.defer_down) {
            return Err(Error::InvalidArgument("a tensor-parallel block runs on its own, not chained".into()));
        }
        let mut deferred = None;
        let c = &self.cfg;
        let (d, hd, h, kv) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads);
        let Step { lens, starts, batch, slots, varlen, tail, keys } = *step;
        let phase = if varlen.is_some() { Phase::Prefill } else { Phase::Decode };
        // A decode step's queries per sequence (the kernel's q_len): one count for all.
        let q_len = lens.first().copied().unwrap_or(1);
        if phase == Phase::Decode && lens.iter().any(|&n| n != q_len) {
            return Err(Error::InvalidArgument(format!("decode: tokens per sequence {lens:?} differ")));
        }
        let t: usize = lens.iter().sum();
        let mut s = scratch.get(gpu, self, t)?;
        let s = &mut *s;
        // The residual this rank adds: the stream itself on the first rank, zeros on the others.
        let first_rank = shard.is_none_or(|g| g.rank() == 0);
        if !first_rank && s.zeros.is_none() {
            s.zeros = Some(Tensor::filled_with_capacity(gpu, &[t, d], s.capacity * d, bf16::ZERO)?);
        }

        let tf = t as f64;
        let (qkv_w, o_w) = ((h + 2 * kv) * hd * d, d * h * hd);
        let kv_row = (kv * hd * 2) as f64;
        // Attention traffic and work: prefill reads q, k, v once (and a prompt
        // continuing earlier chunks gathers its keys first, then reads them);
        // decode reads each sequence's whole cache.
        let ctx: Vec<usize> = starts.iter().zip(lens).map(|(s, n)| s + n).collect();
        let prompts = lens.len() - tail.map_or(0, |t| t.batch.lens().len());
        let earlier = |i: usize| if keys.is_some() && i < prompts { starts[i] } else { 0 };
        let gathered = keys.map_or(0.0, |k| k.rows.rows() as f64 * 2.0 * kv_row * 2.0);
        let (attn_bytes, attn_flops) = match phase {
            Phase::Prefill => (
                tf * (2 * h * hd * 2) as f64
                    + gathered
                    + (0..lens.len()).map(|i| (earlier(i) + lens[i]) as f64).sum::<f64>() * 2.0 * kv_row,
                (0..lens.len()).map(|i| 2.0 * (lens[i] * (2 * earlier(i) + lens[i]) * h * hd) as f64).sum::<f64>(),
            ),
            Phase::Decode => (
                ctx.iter().map(|&n| 2.0 * n as f64 * kv_row).sum::<f64>(),
                ctx.iter().map(|&n| 4.0 * (n * h * hd * q_len) as f64).sum::<f64>(),
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
        if !chain.input_normed {
            stage("rmsnorm (attention)", 2.0 * act(d), 4.0 * tf * d as f64, &mut || {
                rms_norm(gpu, x, &self.attn_norm, c.eps, &mut s.normed)
            })?;
        }
        // Decode: the QKV split-K sums stay in the workspace and the RoPE kernel
        // finishes them (one launch less per step).
        let mut qkv_sums = None;
        stage("QKV GEMM", (qkv_w * 2) as f64 + act(d) + act((h + 2 * kv) * hd), 2.0 * tf * qkv_w as f64, &mut || {
            // SAFETY: the layer's weights are written only by synchronous uploads;
            // the sums are finished by the RoPE launch right after.
            unsafe {
                if phase == Phase::Decode && step_opts.fuse_split_finishes {
                    qkv_sums = linear_split_sums(gpu, &s.normed, &self.w_qkv, ResidentWeights)?;
                }
                if qkv_sums.is_some() {
                    return Ok(());
                }
                step_linear(gpu, step_opts, phase, &s.normed, &self.w_qkv, None, &mut s.qkv, Epilogue::Plain)
            }
        })?;
        let rope_bytes = act((h + 2 * kv) * hd) * if phase == Phase::Prefill && keys.is_none() { 2.0 } else { 1.0 }
            + act((h + 2 * kv) * hd);
        stage("RoPE + KV-cache write", rope_bytes, 6.0 * tf * ((h + kv) * hd) as f64, &mut || {
            // A continuing prompt's keys are gathered from the cache after this.
            let kv_out = if phase == Phase::Prefill && keys.is_none() { Some((&mut s.k, &mut s.v)) } else { None };
            // SAFETY: the sums, when present, are the QKV GEMM's `[t, qkv width]`
            // f32 just above, in the GPU's workspace (never freed while the GPU
            // lives), read and zeroed by this launch before any other uses them.
            unsafe {
                let bias = self.qkv_bias.as_ref();
                rope_kv_write(gpu, &s.qkv, bias, rope, kv_layer, batch, slots, &mut s.q, kv_out, qkv_sums)
            }
        })?;
        let opts = AttentionOptions { causal: true, scale: None };
        stage("attention", attn_bytes, attn_flops, &mut || {
            let mut gathered = keys.map(|c| c.bufs.borrow_mut());
            if let (Some(c), Some(kv)) = (keys, gathered.as_deref_mut()) {
                gather_rows(gpu, kv_layer, batch, &c.rows, &mut kv.0, &mut kv.1)?;
            }
            let (k, v) = gathered.as_deref().map_or((&s.k, &s.v), |kv| (&kv.0, &kv.1));
            match (varlen, tail) {
                (Some(vb), None) => flash_attention(gpu, &s.q, k, v, vb, opts, &mut s.o, &mut s.lse),
                // Mixed: the running rows went through the varlen pass as one-token
                // sequences (seeing only themselves); their rows are redone over the cache.
                (Some(vb), Some(tail)) => {
                    flash_attention(gpu, &s.q, k, v, vb, opts, &mut s.o, &mut s.lse)?;
                    let (q, o, lse) = &mut *tail.bufs.borrow_mut();
                    let rows = q.shape()[0];
                    q.copy_rows_from(gpu, 0, &s.q, t - rows, rows)?;
                    decode_attention(gpu, kv_layer, step_opts, &tail.batch, q, o, lse)?;
                    s.o.copy_rows_from(gpu, t - rows, o, 0, rows)
                }
                (None, _) => {
                    // Several tokens a sequence (a verification step): the kernel's
                    // `[batch, q_len, …]` views of the same rows.
                    let b = lens.len();
                    if q_len == 1 {
                        return decode_attention(gpu, kv_layer, step_opts, batch, &s.q, &mut s.o, &mut s.lse_decode);
                    }
                    let views = |s: &mut Scratch, q: &[usize], lse: &[usize]| -> Result<()> {
                        s.q.reshape(q)?;
                        s.o.reshape(q)?;
                        s.lse_decode.reshape(lse)
                    };
                    views(s, &[b, q_len, h, hd], &[b, q_len, h])?;
                    let r = decode_attention(gpu, kv_layer, step_opts, batch, &s.q, &mut s.o, &mut s.lse_decode);
                    views(s, &[t, h, hd], &[t, h])?;
                    r
                }
            }
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
                let fuse = phase == Phase::Decode && step_opts.fuse_split_finishes;
                let sums = match self.mlp.norm() {
                    Some(_) if fuse => linear_split_sums(gpu, &s.o, &self.w_o, ResidentWeights)?,
                    _ => None,
                };
                match (sums, self.mlp.norm()) {
                    (Some(sums), Some((w, eps))) => {
                        // Sharded, the group sums the f32 partials first; every rank
                        // then adds the residual and normalizes the same whole sum.
                        if let Some(g) = shard {
                            g.all_reduce_sums(gpu, &mut DeviceSums::new(sums, t * d))?;
                        }
                        prenormed = true;
                        let y = SwiGluMlp::normed_input(&mut s.mlp);
                        let r = add_rms_norm_split_sums(gpu, sums, x, w, eps, &mut s.h1, y);
                        if r.is_ok() {
                            split_sums_finished(gpu);
                        }
                        r
                    }
                    _ => {
                        let residual = if first_rank { x } else { s.zeros.as_ref().expect("made above") };
                        step_linear(
                            gpu,
                            step_opts,
                            phase,
                            &s.o,
                            &self.w_o,
                            Some(residual),
                            &mut s.h1,
                            Epilogue::Residual,
                        )
                    }
                }
            };
            s.o.reshape(&[t, h, hd])?;
            r
        })?;
        let reduce_bytes = |g: &dyn AllReduce| 2.0 * act(d) * (g.world() - 1) as f64 / g.world() as f64;
        // Unfused, each rank's h1 is its partial (the residual on the first rank only).
        if let Some(g) = shard.filter(|_| !prenormed) {
            stage("all-reduce (attention)", reduce_bytes(g), 0.0, &mut || g.all_reduce_sum(gpu, &mut s.h1))?;
        }
        stage(
            "MLP (RMSNorm, gate/up + SwiGLU, down + residual)",
            mlp_w + 4.0 * act(d),
            6.0 * tf * (d * c.d_ff) as f64,
            &mut || {
                if shard.is_some() {
                    if !prenormed {
                        let (w, eps) = self.mlp.norm().expect("checked by from_device");
                        rms_norm(gpu, &s.h1, w, eps, SwiGluMlp::normed_input(&mut s.mlp))?;
                    }
                    let residual = if first_rank { &s.h1 } else { s.zeros.as_ref().expect("made above") };
                    self.mlp.forward_prenormed(gpu, residual, &mut s.mlp, out)
                } else if prenormed && chain.defer_down {
                    // SAFETY: the caller finishes the sums first thing (`finish_deferred`).
                    deferred = unsafe { self.mlp.forward_prenormed_deferred(gpu, &s.h1, &mut s.mlp, out)? };
                    Ok(())
                } else if prenormed {
                    self.mlp.forward_prenormed(gpu, &s.h1, &mut s.mlp, out)
                } else {
                    #[cfg(feature = "dev")]
                    if let Some(v) = prefill_gemm(step_opts, phase) {
                        return self.mlp.forward_with(gpu, &s.h1, &mut s.mlp, out, v);
                    }
                    self.mlp.forward(gpu, &s.h1, &mut s.mlp, out)
                }
            },
        )?;
        if let Some(g) = shard {
            stage("all-reduce (MLP)", reduce_bytes(g), 0.0, &mut || g.all_reduce_sum(gpu, out))?;
        }
        Ok(deferred.map(|sums| Deferred { sums, tokens: t }))
    }

    /// Finishes a [`Deferred`] block output: `out` = the block's `h1` + the down
    /// projection's sums, and `normed` (the scratch's own normalized input when
    /// `None`, what the next block reads with `input_normed`) = RMSNorm(out) with
    /// `weight` (the next block's attention norm, or the model's final norm).
    #[allow(clippy::too_many_arguments)]
    pub fn finish_deferred(
        &self,
        gpu: &Gpu,
        scratch: &ScratchSet,
        pending: Deferred,
        weight: &Tensor<bf16>,
        eps: f32,
        out: &mut Tensor<bf16>,
        normed: Option<&mut Tensor<bf16>>,
    ) -> Result<()> {
        let mut s = scratch.get(gpu, self, pending.tokens)?;
        let s = &mut *s;
        let y = normed.unwrap_or(&mut s.normed);
        // SAFETY: the sums are this block's down projection's `[tokens, d]`, left by
        // `launch_stages` just before; this launch reads and zeroes them.
        unsafe {
            add_rms_norm_split_sums(gpu, pending.sums, &s.h1, weight, eps, out, y)?;
            split_sums_finished(gpu);
        }
        Ok(())
    }

    /// The block's addresses for the persistent decode kernel, with its layer's
    /// K and V pools; `None` without an MLP norm.
    #[cfg(feature = "dev")]
    pub(crate) fn persistent_layer(&self, (k_pool, v_pool): (u64, u64)) -> Option<abi::persistent::Layer> {
        let (w_gate_up, w_down) = self.mlp.weights();
        Some(abi::persistent::Layer {
            attn_norm: self.attn_norm.device_ptr(),
            w_qkv: self.w_qkv.device_ptr(),
            qkv_bias: self.qkv_bias.as_ref().map_or(0, |b| b.device_ptr()),
            w_o: self.w_o.device_ptr(),
            mlp_norm: self.mlp.norm()?.0.device_ptr(),
            w_gate_up: w_gate_up.device_ptr(),
            w_down: w_down.device_ptr(),
            k_pool,
            v_pool,
        })
    }

    pub fn attn_norm(&self) -> &Tensor<bf16> {
        &self.attn_norm
    }
}

/// Decode attention over one layer's pools (with `dev`, in `opts.decode_version`).
fn decode_attention(
    gpu: &Gpu,
    kv_layer: KvLayer,
    opts: StepOptions,
    batch: &DecodeBatch,
    q: &Tensor<bf16>,
    out: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
) -> Result<()> {
    #[cfg(feature = "dev")]
    return crate::ops::decode_attention_with(gpu, kv_layer, batch, q, None, out, lse, opts.decode_version);
    #[cfg(not(feature = "dev"))]
    {
        let _ = opts;
        crate::ops::decode_attention(gpu, kv_layer, batch, q, None, out, lse)
    }
}

#[cfg(test)]
mod tests {
    use super::token_bucket;

    #[test]
    fn token_buckets_step_by_quarters_of_a_power_of_two() {
        let firsts: Vec<usize> =
            (1..=1100).map(token_bucket).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        let expect = [16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512];
        assert_eq!(&firsts[..expect.len()], &expect);
        assert_eq!(&firsts[expect.len()..], &[640, 768, 896, 1024, 1280]);
        for t in 1..100_000 {
            let b = token_bucket(t);
            // Every count fits its bucket, and wastes under a quarter of it past 16.
            assert!(b >= t && (t <= 16 || 4 * (b - t) < b), "{t} → {b}");
            // A bucket is its own bucket: the counts a decode step kept map to it.
            assert_eq!(token_bucket(b), b);
        }
        // The chunked serving steps (512 prompt tokens and up to 64 running rows) share one.
        assert!((512 + 1..=512 + 64).all(|t| token_bucket(t) == 640));
    }
}
