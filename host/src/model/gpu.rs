//! The whole decoder on the GPU: the token embedding, every block over one
//! paged KV cache, the final RMSNorm and the LM head, with sampling on the GPU.
//! Prefill takes packed prompts; decode takes one token per live sequence, plain
//! or as one CUDA graph per step ([`Model::capture_decode`]).

use super::ModelConfig;
use crate::error::{Error, Result};
use crate::layer::block::{
    admit, admit_mixed, check_lens, check_tokens_each, token_bucket, Block, Chain, Deferred, Phase, ScratchSet, Stage,
    Step, StepOptions,
};
use crate::layer::step_io::{with_mixed_step, GraphWords, StepBuffers};
use crate::ops::decode::{upload_async, DecodeBatch};
use crate::ops::rope::{RopeTable, TokenSlots};
use crate::ops::sampling::{self, SampleOutput, SamplingParams};
use crate::ops::{embedding_device_ids, linear, rms_norm, PagedKvCache, SeqId};
use crate::runtime::{Gpu, GraphExec};
use crate::tensor::Tensor;
use crate::tp::AllReduce;
use cust::memory::DeviceBuffer;
use half::bf16;
use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

#[cfg(feature = "dev")]
mod persistent;
#[cfg(feature = "dev")]
pub use persistent::PersistentDecode;

/// How much a model may hold: the longest sequence (prompt and output), the
/// KV cache's tokens over all sequences, and its page size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelOptions {
    pub max_context: usize,
    pub kv_tokens: usize,
    pub page_size: usize,
}

impl ModelOptions {
    /// Room for `batch` sequences of `max_context` tokens, in pages of 16.
    pub fn for_batch(batch: usize, max_context: usize) -> ModelOptions {
        ModelOptions { max_context, kv_tokens: batch.max(1) * max_context.next_multiple_of(16), page_size: 16 }
    }
}

/// Weights on the GPU, in the kernels' layout.
pub(crate) struct ModelWeights {
    pub embed: Tensor<bf16>,
    /// `None`: tied to `embed`.
    pub lm_head: Option<Tensor<bf16>>,
    pub final_norm: Tensor<bf16>,
    pub blocks: Vec<Block>,
}

/// Buffers of one token count: the token ids and the residual stream, ping-ponged.
struct Hidden {
    ids: DeviceBuffer<u32>,
    a: Tensor<bf16>,
    b: Tensor<bf16>,
}

/// Buffers of one logit-row count: which hidden rows go to the head, and the
/// rows gathered and normalized.
struct HeadRows {
    rows: DeviceBuffer<u32>,
    gathered: Tensor<bf16>,
    normed: Tensor<bf16>,
}

pub struct Model {
    /// Declared first, dropped first: its drop waits for queued steps, which
    /// may still read the weights, cache and buffers freed after it.
    step_bufs: RefCell<StepBuffers>,
    cfg: ModelConfig,
    w: ModelWeights,
    rope: RopeTable,
    /// Never replaced: captured graphs hold its pools' addresses.
    cache: PagedKvCache,
    scratch: ScratchSet,
    hidden: RefCell<HashMap<usize, Hidden>>,
    heads: RefCell<HashMap<usize, HeadRows>>,
    /// Odd vocabularies: the head's output per row count, one column wider.
    padded_logits: RefCell<HashMap<usize, Tensor<bf16>>>,
    /// Token counts a decode step has used: their buckets' buffers stay
    /// (captured graphs hold their addresses). Other buckets' buffers are freed
    /// by the next prefill of another bucket ([`token_bucket`]), so prompts of
    /// ever new lengths do not grow HBM, and lengths of one bucket reuse them.
    decode_counts: HashSet<usize>,
    /// The buckets of the last prefill's token count and head rows.
    last_prefill: Option<(usize, Option<usize>)>,
    id: u64,
    /// A tensor-parallel rank's group: the blocks are this rank's slices, and
    /// every step all-reduces their O and down outputs over it. Shared with the
    /// graphs captured on it: NCCL's communicator cannot be destroyed while a
    /// graph that holds its collectives lives (the destroy would wait forever).
    group: Option<Rc<dyn AllReduce>>,
}

static NEXT_MODEL_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Where a forward pass takes its token ids from.
#[derive(Clone, Copy)]
enum Ids<'a> {
    /// Uploaded into the buffer of the token count's bucket.
    Host(&'a [u32]),
    /// Already on the GPU: a sampler's output, `[tokens]`.
    Sampled(&'a SampleOutput),
}

impl Model {
    pub(crate) fn from_weights(gpu: &Gpu, cfg: &ModelConfig, w: ModelWeights, opts: ModelOptions) -> Result<Model> {
        cfg.validate()?;
        let lc = cfg.layer_config();
        if w.blocks.len() != cfg.num_hidden_layers {
            return Err(Error::Shape(format!("{} blocks for {} layers", w.blocks.len(), cfg.num_hidden_layers)));
        }
        if opts.max_context == 0 || opts.page_size == 0 || opts.kv_tokens < opts.max_context {
            return Err(Error::InvalidArgument(format!("model options {opts:?}")));
        }
        let inv_freq = cfg.rope_inv_freq();
        // The split-K workspace only grows, and captured graphs may hold each size
        // it had: take the largest any of this model's GEMMs can ask for now, so
        // a long-running server's HBM does not step up with a new prompt shape.
        let (workspace, scratch) = split_workspace_bound(cfg, gpu.info().sm_count as usize, gpu.info().arch);
        gpu.reserve_workspace(workspace)?;
        if scratch > 0 {
            gpu.split_tail_scratch(scratch)?;
        }
        Ok(Model {
            rope: RopeTable::from_inv_freq(gpu, lc.head_dim, &inv_freq, opts.max_context)?,
            cache: PagedKvCache::with_layers(
                gpu,
                cfg.num_hidden_layers,
                opts.kv_tokens.div_ceil(opts.page_size),
                opts.page_size,
                lc.n_kv_heads,
                lc.head_dim,
            )?,
            cfg: cfg.clone(),
            w,
            scratch: ScratchSet::default(),
            step_bufs: RefCell::default(),
            hidden: RefCell::new(HashMap::new()),
            heads: RefCell::new(HashMap::new()),
            padded_logits: RefCell::new(HashMap::new()),
            decode_counts: HashSet::new(),
            last_prefill: None,
            id: NEXT_MODEL_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            group: None,
        })
    }

    /// This model as a rank of `group`: its blocks hold the rank's slices (its
    /// config says how many heads and FFN columns).
    pub(crate) fn in_group(mut self, group: Box<dyn AllReduce>) -> Model {
        self.group = Some(Rc::from(group));
        self
    }

    /// The tensor-parallel group this model is a rank of, if any.
    pub fn group(&self) -> Option<&dyn AllReduce> {
        self.group.as_deref()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The longest sequence the model takes (prompt and output).
    pub fn max_context(&self) -> usize {
        self.rope.max_pos()
    }

    /// The KV cache (read-only: sequences change through the model).
    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// Bytes of weights resident on the GPU.
    pub fn weight_bytes(&self) -> usize {
        self.w.embed.size_bytes()
            + self.w.lm_head.as_ref().map_or(0, |h| h.size_bytes())
            + self.w.final_norm.size_bytes()
            + self.w.blocks.iter().map(Block::weight_bytes).sum::<usize>()
    }

    /// Bytes one decode step must read at least: every block's weights, the
    /// final norm, the LM head and one embedding row per token.
    pub fn step_weight_bytes(&self, tokens: usize) -> usize {
        let head =
            self.w.lm_head.as_ref().unwrap_or(&self.w.embed).size_bytes() / head_rows(self.vocab()) * self.vocab();
        self.w.blocks.iter().map(Block::weight_bytes).sum::<usize>()
            + self.w.final_norm.size_bytes()
            + head
            + tokens * self.cfg.hidden_size * 2
    }

    /// Bytes of activations held for the token counts used so far, and of the RoPE table.
    pub fn activation_bytes(&self) -> usize {
        let hidden: usize = self.hidden.borrow().values().map(|h| h.a.capacity_bytes() * 2 + h.ids.len() * 4).sum();
        let heads: usize =
            self.heads.borrow().values().map(|h| h.gathered.capacity_bytes() * 2 + h.rows.len() * 4).sum();
        self.scratch.bytes() + self.rope.bytes() + hidden + heads + self.step_bufs.borrow().bytes()
    }

    /// A new, empty sequence.
    pub fn add_sequence(&mut self) -> SeqId {
        self.cache.add_sequence()
    }

    /// Ends a sequence; its pages return to the pool.
    pub fn release(&mut self, seq: SeqId) -> Result<()> {
        self.cache.release(seq)
    }

    /// `seq` keeps its first `len` tokens (a rejected draft, a chunk to run
    /// again); pages it no longer uses return to the pool.
    pub fn truncate(&mut self, gpu: &Gpu, seq: SeqId, len: usize) -> Result<()> {
        self.cache.truncate(gpu, seq, len)
    }

    /// A new sequence holding `seq`'s tokens, its whole pages shared with
    /// `seq` (a prompt prefilled once for several samples, or a shared
    /// prefix); each then decodes on its own.
    pub fn fork(&mut self, gpu: &Gpu, seq: SeqId) -> Result<SeqId> {
        self.cache.fork(gpu, seq)
    }

    /// The tokens `seq` holds.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        self.cache.alloc().len(seq)
    }

    fn vocab(&self) -> usize {
        self.cfg.vocab_size
    }

    /// Runs prompts (`prompts[i]` for `seqs[i]`) through the model. A sequence
    /// may hold tokens already: its prompt is then the next chunk after them,
    /// attending to every earlier one (chunked prefill). `logits` is `[seqs,
    /// vocab]` for each prompt's last position, or `[Σ prompt lengths, vocab]`
    /// for every position.
    pub fn prefill(&mut self, gpu: &Gpu, seqs: &[SeqId], prompts: &[&[u32]], logits: &mut Tensor<bf16>) -> Result<()> {
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let ids: Vec<u32> = prompts.concat();
        self.step(gpu, Phase::Prefill, seqs, &lens, &ids, logits, None)
    }

    /// One decode step: `ids[i]` is the next token of `seqs[i]`; `logits` is
    /// `[seqs, vocab]`.
    pub fn decode(&mut self, gpu: &Gpu, seqs: &[SeqId], ids: &[u32], logits: &mut Tensor<bf16>) -> Result<()> {
        self.step(gpu, Phase::Decode, seqs, &vec![1; seqs.len()], ids, logits, None)
    }

    /// One decode step of `k` tokens of each sequence (speculative decoding's
    /// verification: the last accepted token, then `k − 1` drafted ones):
    /// `ids` holds them, each sequence's in order; `logits` is `[seqs · k,
    /// vocab]` for every token, or `[seqs, vocab]` for each sequence's last.
    /// Token j of a sequence sees its cache and the step's tokens up to j, as
    /// in a prefill; `k` is at most [`MAX_Q_LEN`]. Rejected drafts go by
    /// [`truncate`](Self::truncate).
    ///
    /// [`MAX_Q_LEN`]: crate::ops::decode::MAX_Q_LEN
    pub fn decode_tokens(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        k: usize,
        ids: &[u32],
        logits: &mut Tensor<bf16>,
    ) -> Result<()> {
        check_tokens_each("model decode", k)?;
        self.step(gpu, Phase::Decode, seqs, &vec![k; seqs.len()], ids, logits, None)
    }

    /// New prompts and running sequences in one step (chunked prefill's mixed
    /// step): `prompts[i]` for `seqs[i]` (a whole prompt, or its next chunk
    /// after those the sequence holds), and `ids[j]` the
    /// next token of `running[j]`. `logits` is `[seqs + running, vocab]`: each
    /// prompt's last position, then each running sequence's. Every weight is
    /// read once for all of them.
    pub fn mixed(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        prompts: &[&[u32]],
        running: &[SeqId],
        ids: &[u32],
        logits: &mut Tensor<bf16>,
    ) -> Result<()> {
        let op = "model mixed step";
        if prompts.len() != seqs.len() || ids.len() != running.len() {
            return Err(Error::Shape(format!(
                "{op}: {} prompts for {} sequences, {} ids for {} running",
                prompts.len(),
                seqs.len(),
                ids.len(),
                running.len()
            )));
        }
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).chain(std::iter::repeat_n(1, running.len())).collect();
        let all: Vec<SeqId> = seqs.iter().chain(running).copied().collect();
        let all_ids: Vec<u32> = prompts.concat().into_iter().chain(ids.iter().copied()).collect();
        check_lens(op, &all, &lens)?;
        let t: usize = lens.iter().sum();
        self.check_ids(op, &all_ids, t)?;
        let rows = self.logit_rows(op, &lens, logits)?;
        self.make_room(gpu, t, rows.as_ref().map(Vec::len))?;
        let starts = admit_mixed(&mut self.cache, self.rope.max_pos(), seqs, &lens[..seqs.len()], running)?;
        let cfg = self.cfg.layer_config();
        let mut bufs = self.step_bufs.borrow_mut();
        let step = with_mixed_step(gpu, &mut bufs, &self.cache, &cfg, &all, running.len(), &starts, &lens, |step| {
            self.launch_forward(gpu, step, Ids::Host(&all_ids), rows.as_deref(), logits, None)
        });
        drop(bufs);
        if step.is_err() {
            self.shrink(&all, &starts);
        }
        step
    }

    /// [`decode`](Self::decode), timing each stage on its own (synchronizing
    /// between stages), summed over the layers: the per-token ledger.
    pub fn decode_profiled(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        ids: &[u32],
        logits: &mut Tensor<bf16>,
    ) -> Result<Vec<Stage>> {
        let mut stages = Vec::new();
        self.step(gpu, Phase::Decode, seqs, &vec![1; seqs.len()], ids, logits, Some(&mut stages))?;
        let mut summed: Vec<Stage> = Vec::new();
        for st in stages {
            match summed.iter_mut().find(|s| s.name == st.name) {
                Some(s) => {
                    s.ms += st.ms;
                    s.bytes += st.bytes;
                    s.flops += st.flops;
                    s.launches += st.launches;
                }
                None => summed.push(st),
            }
        }
        Ok(summed)
    }

    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        gpu: &Gpu,
        phase: Phase,
        seqs: &[SeqId],
        lens: &[usize],
        ids: &[u32],
        logits: &mut Tensor<bf16>,
        stages: Option<&mut Vec<Stage>>,
    ) -> Result<()> {
        let op = if phase == Phase::Prefill { "model prefill" } else { "model decode" };
        check_lens(op, seqs, lens)?;
        let t: usize = lens.iter().sum();
        self.check_ids(op, ids, t)?;
        let rows = self.logit_rows(op, lens, logits)?;
        match phase {
            // One token a sequence: a count a decode graph may keep buffers for.
            Phase::Decode if t == seqs.len() => _ = self.decode_counts.insert(t),
            // Prefill, and several tokens a sequence: buffers of one such count at a time.
            _ => self.make_room(gpu, t, rows.as_ref().map(Vec::len))?,
        }
        let starts = admit(&mut self.cache, self.rope.max_pos(), phase, seqs, lens)?;
        let step = (|| {
            let mut bufs = self.step_bufs.borrow_mut();
            let staged = bufs.stage(gpu, &self.cache, seqs, &starts, lens, phase == Phase::Prefill, None)?;
            let step = staged.step(lens, &starts);
            self.launch_forward(gpu, &step, Ids::Host(ids), rows.as_deref(), logits, stages)
        })();
        if step.is_err() {
            self.shrink(seqs, &starts);
        }
        step
    }

    /// Frees every buffer no decode step uses (the last prefill's, and the eager
    /// steps' page-table and token-slot uploads), waiting for the GPU first:
    /// HBM then holds the weights, the cache, the RoPE table and the buffers of
    /// the decode counts used so far, whatever was prefilled.
    pub fn trim(&mut self, gpu: &Gpu) -> Result<()> {
        self.last_prefill = None;
        self.keep_only(gpu, None, None)?;
        // The GPU is idle (above): nothing queued reads them.
        *self.step_bufs.borrow_mut() = StepBuffers::default();
        Ok(())
    }

    /// Before a prefill of `t` tokens (`rows` head rows when only the last
    /// positions go to the head): frees what earlier prefills made for other
    /// buckets of counts, unless a decode step uses them. HBM then holds the
    /// decode counts' buffers and one prefill's, whatever the prompt lengths,
    /// and a prefill whose counts fall in the last one's buckets reallocates
    /// nothing and does not wait for the GPU.
    fn make_room(&mut self, gpu: &Gpu, t: usize, rows: Option<usize>) -> Result<()> {
        let buckets = (token_bucket(t), rows.map(token_bucket));
        if self.last_prefill.replace(buckets) == Some(buckets) {
            return Ok(());
        }
        self.keep_only(gpu, Some(t), rows)
    }

    /// Frees, once the GPU is idle, the token-count buffers that neither a
    /// decode step nor the coming pass (`t` tokens; `rows` gathered rows to the
    /// head, else all `t`) uses.
    fn keep_only(&self, gpu: &Gpu, t: Option<usize>, rows: Option<usize>) -> Result<()> {
        gpu.synchronize()?;
        // The decode counts' buckets, and the coming pass's.
        let buckets = |pass: Option<usize>| -> HashSet<usize> {
            self.decode_counts.iter().copied().chain(pass).map(token_bucket).collect()
        };
        let tokens = buckets(t);
        self.hidden.borrow_mut().retain(|b, _| tokens.contains(b));
        self.scratch.keep_buckets(&tokens);
        let head = buckets(rows.or(t));
        self.padded_logits.borrow_mut().retain(|b, _| head.contains(b));
        // Only a prefill of last positions gathers head rows.
        let rows = rows.map(token_bucket);
        self.heads.borrow_mut().retain(|&b, _| Some(b) == rows);
        Ok(())
    }

    fn check_ids(&self, op: &str, ids: &[u32], t: usize) -> Result<()> {
        if ids.len() != t {
            return Err(Error::Shape(format!("{op}: {} token ids for {t} tokens", ids.len())));
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab()) {
            return Err(Error::InvalidArgument(format!(
                "{op}: token id {bad} outside the vocabulary of {}",
                self.vocab()
            )));
        }
        Ok(())
    }

    /// Which hidden rows the head reads: `None` for all of them (`logits` has a
    /// row per token), else each sequence's last token (a row per sequence).
    fn logit_rows(&self, op: &str, lens: &[usize], logits: &Tensor<bf16>) -> Result<Option<Vec<u32>>> {
        let t: usize = lens.iter().sum();
        match logits.shape() {
            [r, v] if *v == self.vocab() && *r == t => Ok(None),
            [r, v] if *v == self.vocab() && *r == lens.len() => {
                let last = lens.iter().scan(0usize, |end, &n| {
                    *end += n;
                    Some(*end as u32 - 1)
                });
                Ok(Some(last.collect()))
            }
            other => Err(Error::Shape(format!(
                "{op}: logits {other:?}; expected [{}, {v}] or [{t}, {v}]",
                lens.len(),
                v = self.vocab()
            ))),
        }
    }

    /// Queues a forward pass: embedding, every block, final norm, LM head. Only
    /// launches (and stream-ordered uploads when `ids` is `Host` or `rows` given).
    fn launch_forward(
        &self,
        gpu: &Gpu,
        step: &Step,
        ids: Ids,
        rows: Option<&[u32]>,
        logits: &mut Tensor<bf16>,
        mut stages: Option<&mut Vec<Stage>>,
    ) -> Result<()> {
        let t: usize = step.lens.iter().sum();
        let d = self.cfg.hidden_size;
        let mut hidden = self.hidden.borrow_mut();
        let bucket = token_bucket(t);
        if let Entry::Vacant(slot) = hidden.entry(bucket) {
            let z = bf16::ZERO;
            // SAFETY: u32 has no invalid bit patterns; ids are uploaded before any read.
            let ids =
                unsafe { DeviceBuffer::<u32>::uninitialized(bucket) }.map_err(crate::error::cuda("cuMemAlloc"))?;
            let (a, b) = (Tensor::filled(gpu, &[bucket, d], z)?, Tensor::filled(gpu, &[bucket, d], z)?);
            slot.insert(Hidden { ids, a, b });
        }
        let h = hidden.get_mut(&bucket).expect("inserted above");
        h.a.refit(&[t, d])?;
        h.b.refit(&[t, d])?;
        let ids_ptr = match ids {
            Ids::Host(ids) => {
                upload_async(gpu, &h.ids, ids)?;
                h.ids.as_device_ptr().as_raw()
            }
            Ids::Sampled(out) if out.batch() == t => out.tokens_ptr(),
            Ids::Sampled(out) => return Err(Error::Shape(format!("{} sampled ids for {t} tokens", out.batch()))),
        };
        let row_bytes = (t * d * 2) as f64;
        // SAFETY: `ids_ptr` addresses t u32 (checked, or this count's bucket's
        // buffer, at least t long, filled just above), alive until the launch has run.
        let a = &mut h.a;
        timed(gpu, stages.as_deref_mut(), "embedding", 2.0 * row_bytes, &mut || unsafe {
            embedding_device_ids(gpu, &self.w.embed, ids_ptr, t, a)
        })?;
        let (mut x, mut y) = (&mut h.a, &mut h.b);
        let opts = StepOptions::default();
        let eps = self.cfg.rms_norm_eps;
        // Decode: each block's down projection is finished by the next block's
        // (or the final) RMSNorm launch, which also forms that norm. A rank's
        // blocks cannot: their outputs are summed over the group first.
        let group = self.group.as_deref();
        let defer_down = group.is_none() && step.varlen.is_none() && opts.fuse_split_finishes;
        let finish_bytes = 4.0 * row_bytes;
        let mut pending: Option<(&Block, Deferred)> = None;
        for (i, block) in self.w.blocks.iter().enumerate() {
            let mut chain = Chain { input_normed: false, defer_down };
            if let Some((prev, d)) = pending.take() {
                let out = &mut *x;
                timed(gpu, stages.as_deref_mut(), "down finish + RMSNorm", finish_bytes, &mut || {
                    prev.finish_deferred(gpu, &self.scratch, d, block.attn_norm(), eps, out, None)
                })?;
                chain.input_normed = true;
            }
            let kv = self.cache.layer(i)?;
            let stages = stages.as_deref_mut();
            let d = block.launch_stages(gpu, kv, &self.rope, &self.scratch, opts, chain, step, x, y, stages, group)?;
            pending = d.map(|d| (block, d));
            std::mem::swap(&mut x, &mut y);
        }
        // `y` holds the final norm of every row once the last block's output is finished.
        let mut finished = false;
        if let Some((prev, d)) = pending.take() {
            let (out, normed) = (&mut *x, &mut *y);
            timed(gpu, stages.as_deref_mut(), "down finish + RMSNorm", finish_bytes, &mut || {
                prev.finish_deferred(gpu, &self.scratch, d, &self.w.final_norm, eps, out, Some(normed))
            })?;
            finished = true;
        }
        let head_bytes = self.step_weight_bytes(0) as f64
            - self.w.blocks.iter().map(|b| b.weight_bytes() as f64).sum::<f64>()
            + (rows.map_or(t, |r| r.len()) * self.vocab() * 2) as f64;
        let mut head = || match rows {
            None => {
                if !finished {
                    rms_norm(gpu, x, &self.w.final_norm, eps, y)?;
                }
                self.launch_head(gpu, y, logits)
            }
            Some(rows) => {
                let r = rows.len();
                let mut heads = self.heads.borrow_mut();
                let bucket = token_bucket(r);
                if let Entry::Vacant(slot) = heads.entry(bucket) {
                    let z = bf16::ZERO;
                    // SAFETY: as for the ids.
                    let buf = unsafe { DeviceBuffer::<u32>::uninitialized(bucket) }
                        .map_err(crate::error::cuda("cuMemAlloc"))?;
                    let (g, n) = (Tensor::filled(gpu, &[bucket, d], z)?, Tensor::filled(gpu, &[bucket, d], z)?);
                    slot.insert(HeadRows { rows: buf, gathered: g, normed: n });
                }
                let hr = heads.get_mut(&bucket).expect("inserted above");
                hr.gathered.refit(&[r, d])?;
                hr.normed.refit(&[r, d])?;
                upload_async(gpu, &hr.rows, rows)?;
                // SAFETY: the rows buffer holds r indices below t (the last token of
                // each sequence), uploaded just above; `x` is `[t, d]`.
                unsafe { embedding_device_ids(gpu, x, hr.rows.as_device_ptr().as_raw(), r, &mut hr.gathered)? };
                rms_norm(gpu, &hr.gathered, &self.w.final_norm, eps, &mut hr.normed)?;
                self.launch_head(gpu, &hr.normed, logits)
            }
        };
        timed(gpu, stages, "final norm + LM head", head_bytes, &mut head)
    }

    /// logits = normed · headᵀ. The GEMM stores column pairs, so with an odd
    /// vocabulary the head has one zero row more and writes a padded buffer,
    /// whose first `vocab` columns are then copied out (stream-ordered).
    fn launch_head(&self, gpu: &Gpu, normed: &Tensor<bf16>, logits: &mut Tensor<bf16>) -> Result<()> {
        let head = self.w.lm_head.as_ref().unwrap_or(&self.w.embed);
        let (rows, vocab, padded) = (normed.shape()[0], self.vocab(), head.shape()[0]);
        if padded == vocab {
            return linear(gpu, normed, head, logits);
        }
        crate::ops::same_shape("model head", "logits", &[rows, vocab], logits.shape())?;
        let mut pads = self.padded_logits.borrow_mut();
        let bucket = token_bucket(rows);
        if let Entry::Vacant(slot) = pads.entry(bucket) {
            slot.insert(Tensor::filled(gpu, &[bucket, padded], bf16::ZERO)?);
        }
        let buf = pads.get_mut(&bucket).expect("inserted above");
        buf.refit(&[rows, padded])?;
        linear(gpu, normed, head, buf)?;
        let copy = cust::sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: cust::sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: buf.device_ptr(),
            srcArray: std::ptr::null_mut(),
            srcPitch: padded * 2,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: cust::sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: logits.device_ptr(),
            dstArray: std::ptr::null_mut(),
            dstPitch: vocab * 2,
            WidthInBytes: vocab * 2,
            Height: rows,
        };
        // SAFETY: both are `rows` rows (checked) of at least `vocab` bf16, at
        // their pitches; stream-ordered after the GEMM, and both stay allocated
        // (the padded buffer is the model's, and kept for every decode count).
        let status = unsafe { cust::sys::cuMemcpy2DAsync_v2(&copy, gpu.stream().as_inner()) };
        crate::error::check("cuMemcpy2DAsync", status)
    }
}

/// Runs `f`, timed as a stage of its own when `stages` is given.
fn timed(
    gpu: &Gpu,
    stages: Option<&mut Vec<Stage>>,
    name: &'static str,
    bytes: f64,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<()> {
    let Some(list) = stages else { return f() };
    let before = gpu.launch_count();
    let ms = gpu.time_ms(f)? as f64;
    list.push(Stage { name, ms, bytes, flops: 0.0, launches: gpu.launch_count() - before });
    Ok(())
}

/// Rows of the embedding and head matrices: the vocabulary, made even for the
/// GEMM's paired stores (the extra row is zero, and its logit never leaves the model).
pub(crate) fn head_rows(vocab: usize) -> usize {
    vocab.next_multiple_of(2)
}

/// A decode step of a fixed set of sequences captured as one CUDA graph: the
/// embedding of the last sampled tokens, every block, the head and the draw.
/// Page tables, lengths, token slots and sampling parameters live in fixed
/// buffers refreshed before each replay; split-KV attention is planned for the
/// model's longest context. [`Model::decode_graph_for`] replays it for any set
/// of as many sequences.
///
/// The graph holds device addresses of its own buffers (freed after `exec`) and
/// of the model's weights, cache pools, RoPE table and the scratch of its batch
/// size's bucket, which the model never frees or replaces while it lives (the
/// buffers of a bucket a decode step used are never freed); it replays only through
/// [`Model::decode_graph`] on the model that captured it.
pub struct ModelGraph {
    // Declared first, dropped first: the buffers and the group below outlive
    // the graph.
    exec: GraphExec,
    _group: Option<Rc<dyn AllReduce>>,
    model: u64,
    io: GraphIo,
    out: GraphOut,
    reads: TokenReads,
}

/// Two pinned host copies of the drawn tokens, each filled by a copy queued
/// behind a step ([`ModelGraph::queue_tokens`]) and collected after its event.
struct TokenReads {
    slots: [TokenSlot; 2],
}

struct TokenSlot {
    host: cust::memory::LockedBuffer<u32>,
    done: cust::event::Event,
    /// The read this slot holds: pending while its [`TokenRead`] lives, so a
    /// read dropped uncollected frees the slot.
    ticket: std::rc::Weak<()>,
}

impl TokenReads {
    fn new(batch: usize) -> Result<TokenReads> {
        let slot = || -> Result<TokenSlot> {
            Ok(TokenSlot {
                host: cust::memory::LockedBuffer::new(&0u32, batch).map_err(crate::error::cuda("cuMemHostAlloc"))?,
                done: cust::event::Event::new(cust::event::EventFlags::DISABLE_TIMING)
                    .map_err(crate::error::cuda("cuEventCreate"))?,
                ticket: std::rc::Weak::new(),
            })
        };
        Ok(TokenReads { slots: [slot()?, slot()?] })
    }
}

/// A read of one step's drawn tokens, queued by [`ModelGraph::queue_tokens`]
/// and collected once by [`ModelGraph::read_tokens`] of the same graph.
#[must_use]
#[derive(Debug)]
pub struct TokenRead {
    ticket: std::rc::Rc<()>,
}

/// The fixed buffers a captured step reads its sequences' slots from.
struct GraphIo {
    seqs: Vec<SeqId>,
    words: GraphWords,
}

/// The fixed buffers a captured step writes: logits, and the drawn tokens
/// (which are also the next step's input).
struct GraphOut {
    logits: Tensor<bf16>,
    sampled: SampleOutput,
}

impl GraphIo {
    /// Fills the page tables, lengths and token slots for a step of the
    /// graph's sequences, grown already from lengths `starts` (checked against
    /// them and `plan_len`): every replay reads what was checked here.
    fn stage<'a>(
        &'a mut self,
        gpu: &Gpu,
        cache: &PagedKvCache,
        starts: &[usize],
        plan_len: usize,
    ) -> Result<(DecodeBatch<'a>, TokenSlots<'a>)> {
        let (batch, slots) = self.words.stage(gpu, cache, &self.seqs, starts, plan_len)?;
        slots.check("model decode", &batch, plan_len)?;
        Ok((batch, slots))
    }
}

impl Drop for ModelGraph {
    fn drop(&mut self) {
        // A replay may still be running on the buffers about to be freed.
        let _ = cust::context::CurrentContext::synchronize();
    }
}

impl ModelGraph {
    pub fn sequences(&self) -> &[SeqId] {
        &self.io.seqs
    }

    /// The tokens the last step drew, one per sequence (waits for the GPU).
    pub fn tokens(&self, gpu: &Gpu) -> Result<Vec<u32>> {
        self.out.sampled.tokens(gpu)
    }

    /// Queues a copy of the tokens the last queued step draws, behind that step,
    /// into pinned host memory, without waiting: the next step may be queued
    /// before they are collected ([`read_tokens`](Self::read_tokens)), so the
    /// GPU never waits for the host between steps. At most two reads may be
    /// pending.
    pub fn queue_tokens(&mut self, gpu: &Gpu) -> Result<TokenRead> {
        let Some(slot) = self.reads.slots.iter_mut().find(|s| s.ticket.strong_count() == 0) else {
            return Err(Error::InvalidArgument("queue_tokens: two reads pending; collect one first".into()));
        };
        let bytes = self.io.seqs.len() * 4;
        // SAFETY: the slot's pinned buffer holds one u32 per sequence, as does the
        // drawn-token buffer; neither is freed before the copy has run (dropping
        // the graph synchronizes first). A copy of a read dropped uncollected may
        // still be queued into this slot: it runs before this one, in stream order,
        // and the host reads the slot only after this copy's event.
        let status = unsafe {
            cust::sys::cuMemcpyDtoHAsync_v2(
                slot.host.as_mut_ptr() as *mut std::ffi::c_void,
                self.out.sampled.tokens_ptr(),
                bytes,
                gpu.stream().as_inner(),
            )
        };
        crate::error::check("cuMemcpyDtoHAsync", status)?;
        slot.done.record(gpu.stream()).map_err(crate::error::cuda("cuEventRecord"))?;
        let ticket = std::rc::Rc::new(());
        slot.ticket = std::rc::Rc::downgrade(&ticket);
        Ok(TokenRead { ticket })
    }

    /// Waits for `read`'s copy alone (not for steps queued after it) and returns
    /// its tokens, one per sequence.
    pub fn read_tokens(&mut self, read: TokenRead) -> Result<Vec<u32>> {
        let mine = |s: &&mut TokenSlot| s.ticket.upgrade().is_some_and(|t| std::rc::Rc::ptr_eq(&t, &read.ticket));
        let Some(slot) = self.reads.slots.iter_mut().find(mine) else {
            return Err(Error::InvalidArgument("read_tokens: not a pending read of this graph".into()));
        };
        slot.done.synchronize().map_err(crate::error::cuda("cuEventSynchronize"))?;
        Ok(slot.host.as_slice().to_vec())
    }

    /// The last step's logits, `[sequences, vocab]`.
    pub fn logits(&self) -> &Tensor<bf16> {
        &self.out.logits
    }
}

impl Model {
    /// Decodes one step of `seqs` (next tokens `ids`) plainly through fixed
    /// buffers, draws each sequence's next token with `params`, then captures
    /// that step as a CUDA graph for [`decode_graph`](Self::decode_graph). The
    /// drawn tokens are in the graph ([`ModelGraph::tokens`]).
    pub fn capture_decode(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        ids: &[u32],
        params: &[SamplingParams],
    ) -> Result<ModelGraph> {
        let b = seqs.len();
        check_lens("model decode", seqs, &vec![1; b])?;
        self.check_ids("model decode", ids, b)?;
        let plan_len = self.rope.max_pos();
        let mut io =
            GraphIo { seqs: seqs.to_vec(), words: GraphWords::new(b, plan_len.div_ceil(self.cache.page_size()))? };
        let mut out = GraphOut {
            logits: Tensor::filled(gpu, &[b, self.vocab()], bf16::ZERO)?,
            sampled: SampleOutput::new(gpu, b, false)?,
        };
        let reads = TokenReads::new(b)?;
        let sp = sampling::stage::<bf16>(gpu, out.logits.shape(), params, &out.sampled)?;
        out.sampled.set_tokens(gpu, ids)?;
        let ones = vec![1; b];
        let starts = admit(&mut self.cache, plan_len, Phase::Decode, seqs, &ones)?;
        self.decode_counts.insert(b);
        let captured = (|| {
            let (batch, slots) = io.stage(gpu, &self.cache, &starts, plan_len)?;
            let step = Step::decode(&ones, &starts, &batch, &slots);
            // The first step, plainly, through the fixed buffers; then the same
            // launches recorded.
            self.launch_step(gpu, &step, &sp, &mut out)?;
            gpu.synchronize()?;
            gpu.capture(|| self.launch_step(gpu, &step, &sp, &mut out))
        })();
        match captured {
            Ok(exec) => Ok(ModelGraph { exec, _group: self.group.clone(), model: self.id, io, out, reads }),
            Err(e) => {
                self.shrink(seqs, &starts);
                Err(e)
            }
        }
    }

    /// A graph step's launches: the forward pass from the last drawn tokens,
    /// then the draw.
    fn launch_step(&self, gpu: &Gpu, step: &Step, sp: &sampling::SamplingPlan, out: &mut GraphOut) -> Result<()> {
        self.launch_forward(gpu, step, Ids::Sampled(&out.sampled), None, &mut out.logits, None)?;
        // SAFETY: `sp` was staged for these logits' shape and this output.
        unsafe { sampling::launch(gpu, sp, &out.logits, &mut out.sampled) }?;
        // A rank's draw is the first rank's, so the ranks' next steps agree.
        match &self.group {
            Some(group) => group.broadcast_tokens(gpu, &mut out.sampled),
            None => Ok(()),
        }
    }

    /// Undoes a growth whose step failed before it was queued in full.
    fn shrink(&mut self, seqs: &[SeqId], starts: &[usize]) {
        for (&s, &len) in seqs.iter().zip(starts) {
            self.cache.shrink_to(s, len);
        }
    }

    /// One decode step of the graph's sequences: grows them, refreshes the fixed
    /// buffers, replays the graph. The step's input is `ids` if given, else the
    /// tokens the graph drew last; the drawn tokens are in the graph.
    pub fn decode_graph(
        &mut self,
        gpu: &Gpu,
        g: &mut ModelGraph,
        ids: Option<&[u32]>,
        params: &[SamplingParams],
    ) -> Result<()> {
        self.replay(gpu, g, None, ids, params)
    }

    /// [`decode_graph`](Self::decode_graph) for another set of as many
    /// sequences, which take the graph's slots from this step on: a graph
    /// serves every batch of its size (continuous batching), since each replay
    /// reads the page tables, lengths and slots staged for it. `ids` are the
    /// new sequences' next tokens.
    pub fn decode_graph_for(
        &mut self,
        gpu: &Gpu,
        g: &mut ModelGraph,
        seqs: &[SeqId],
        ids: &[u32],
        params: &[SamplingParams],
    ) -> Result<()> {
        self.replay(gpu, g, Some(seqs), Some(ids), params)
    }

    fn replay(
        &mut self,
        gpu: &Gpu,
        g: &mut ModelGraph,
        seqs: Option<&[SeqId]>,
        ids: Option<&[u32]>,
        params: &[SamplingParams],
    ) -> Result<()> {
        if g.model != self.id {
            return Err(Error::InvalidArgument("decode_graph: the graph was captured on another model".into()));
        }
        let b = g.io.seqs.len();
        let seqs = seqs.map_or_else(|| g.io.seqs.clone(), <[SeqId]>::to_vec);
        if seqs.len() != b {
            return Err(Error::Shape(format!("{} sequences for a graph of {b}", seqs.len())));
        }
        if let Some(ids) = ids {
            self.check_ids("model decode", ids, b)?;
        }
        sampling::plan::<bf16>(g.out.logits.shape(), params, b)?;
        let plan_len = self.rope.max_pos();
        let starts = admit(&mut self.cache, plan_len, Phase::Decode, &seqs, &vec![1; b])?;
        g.io.seqs = seqs;
        let step = (|| {
            if let Some(ids) = ids {
                g.out.sampled.set_tokens(gpu, ids)?;
            }
            sampling::stage::<bf16>(gpu, g.out.logits.shape(), params, &g.out.sampled)?;
            g.io.stage(gpu, &self.cache, &starts, plan_len)?;
            // SAFETY: the graph is this model's (checked above); it points into its
            // own buffers and into this model's weights, cache pools, RoPE table
            // and the scratch of a decode count, none of which is freed while the model lives.
            unsafe { gpu.launch_graph(&g.exec) }
        })();
        if step.is_err() {
            let seqs = g.io.seqs.clone();
            self.shrink(&seqs, &starts);
        }
        step
    }
}

/// The most split-K workspace and split-tail scratch (f32) the model's GEMMs
/// take at any token count: splits only happen below the token count where
/// whole tiles fill the SMs (a few hundred at these widths), so counts up to
/// 4096 cover them all; the scratch depends on the SM count alone.
fn split_workspace_bound(cfg: &ModelConfig, sm_count: usize, arch: crate::runtime::Arch) -> (usize, usize) {
    let (d, ff) = (cfg.hidden_size, cfg.intermediate_size);
    let shapes = [(cfg.q_dim() + 2 * cfg.kv_dim(), d), (d, cfg.q_dim()), (2 * ff, d), (d, ff), (cfg.vocab_size, d)];
    let (mut workspace, mut scratch) = (0, 0);
    for (n, k) in shapes {
        for m in 1..=4096 {
            let p =
                crate::ops::gemm::plan(&[m, k], &[n, k], &[m, n], None, crate::ops::Epilogue::Plain, sm_count, arch);
            workspace = workspace.max(p.as_ref().map_or(0, |p| p.workspace_len()));
            scratch = scratch.max(p.map_or(0, |p| p.split_tail_scratch_len()));
        }
    }
    (workspace, scratch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Epilogue;
    use crate::runtime::Arch;

    #[test]
    fn the_reserved_workspace_covers_every_token_count() {
        let cfg = ModelConfig::llama3_8b();
        for arch in [Arch::Sm80, Arch::Sm90a] {
            let (bound, scratch) = split_workspace_bound(&cfg, 132, arch);
            // The split tail on Hopper: its counters and a slot of 128×256 f32 per SM.
            let tail = if arch == Arch::Sm90a { abi::gemm::tma::split_tail_scratch_len(132) } else { 0 };
            assert_eq!(scratch, tail, "{arch:?}");
            // The 128×128 split tiles below a wave of whole ones: at most 132 tiles of
            // 128×128 f32 sums (off Hopper the head's 64-row split, 64 × vocab), and
            // at least the decode down projection's.
            let most = if arch == Arch::Sm90a { 132 * 128 * 128 } else { 64 * cfg.vocab_size };
            assert!(bound <= most, "{arch:?}: {bound}");
            assert!(bound >= 64 * 4096, "{arch:?}: {bound}");
            for m in [4097, 8192, 65536] {
                let p = crate::ops::gemm::plan(&[m, 4096], &[4096, 4096], &[m, 4096], None, Epilogue::Plain, 132, arch);
                assert_eq!(p.unwrap().workspace_len(), 0, "{arch:?} m{m}");
            }
        }
    }
}
