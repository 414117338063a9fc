//! Dev version of the batch-1 decode step: every layer in one persistent launch
//! (`persistent_decode_b1`, kernels' `decode::dev::persistent`), then the final
//! norm and the LM head as in the shipped step. Measured against the shipped
//! CUDA graph of separate launches (`lab`'s `persistent_decode` example).

use super::Model;
use crate::error::{Error, Result};
use crate::kernels::dev as k;
use crate::layer::block::{admit, Phase};
use crate::ops::decode::{upload_async, BatchBuffers};
use crate::ops::{embedding_device_ids, rms_norm, SeqId};
use crate::runtime::{Arch, Gpu};
use crate::tensor::Tensor;
use abi::persistent as p;
use cust::memory::{CopyDestination, DeviceBuffer};
use half::bf16;

/// What the persistent step needs besides the model: the layer table, its
/// vectors, the attention partials and the barrier counters.
pub struct PersistentDecode {
    model: u64,
    /// `[n_layers]` [`p::Layer`], as u64 words.
    layers: DeviceBuffer<u64>,
    ids: DeviceBuffer<u32>,
    x: Tensor<bf16>,
    h: Tensor<bf16>,
    qkv: Tensor<bf16>,
    o: Tensor<bf16>,
    act: Tensor<bf16>,
    normed: Tensor<bf16>,
    partial: DeviceBuffer<f32>,
    counters: DeviceBuffer<u32>,
    /// The sequence's page table, refreshed by a stream-ordered copy each step.
    tables: BatchBuffers,
    /// Block 0's timer at the start and after each grid barrier.
    trace: DeviceBuffer<u64>,
    /// `abi::persistent` measurement flags, 0 for real steps.
    pub flags: u32,
    blocks: usize,
}

pub use p::{ATTENTION_STAMPS as INNER, STAGES_PER_LAYER};

impl PersistentDecode {
    /// Timing only (wrong results): weight slots released unread.
    pub const SKIP_MATH: u32 = p::SKIP_MATH;
    /// Timing only (wrong results): no attention stage.
    pub const SKIP_ATTENTION: u32 = p::SKIP_ATTENTION;

    /// The last step's stage times in µs, `[layer][stage]` (stages: norm + QKV,
    /// attention, O, norm + gate/up, down; each up to its grid barrier's end).
    pub fn stage_times_us(&self) -> Result<Vec<[f64; STAGES_PER_LAYER]>> {
        let t = self.trace_ns()?;
        let layers = (t.len() - 1) / (STAGES_PER_LAYER + INNER);
        // Stamp k is the end of stage k − 1 (stamp 0: the start).
        let span = |k: usize| (t[k + 1] - t[k]) as f64 / 1e3;
        Ok((0..layers).map(|l| std::array::from_fn(|i| span(STAGES_PER_LAYER * l + i))).collect())
    }

    /// The last step's attention stage inside, µs from its start, per layer
    /// (the times `abi::persistent::ATTENTION_STAMPS` lists).
    pub fn attention_times_us(&self) -> Result<Vec<[f64; INNER]>> {
        let t = self.trace_ns()?;
        let layers = (t.len() - 1) / (STAGES_PER_LAYER + INNER);
        Ok((0..layers)
            .map(|l| {
                let start = t[1 + STAGES_PER_LAYER * l];
                let inner = &t[1 + STAGES_PER_LAYER * layers + INNER * l..][..INNER];
                std::array::from_fn(|i| (inner[i] as f64 - start as f64) / 1e3)
            })
            .collect())
    }

    fn trace_ns(&self) -> Result<Vec<u64>> {
        let mut t = vec![0u64; self.trace.len()];
        self.trace.copy_to(&mut t[..]).map_err(crate::error::cuda("cuMemcpyDtoH"))?;
        Ok(t)
    }
}

const LAYER_WORDS: usize = std::mem::size_of::<p::Layer>() / 8;

fn refuse(what: String) -> Error {
    Error::InvalidArgument(format!("persistent decode: {what}"))
}

impl Model {
    /// Checks the model against the kernel's limits and allocates its buffers.
    pub fn persistent_decode(&self, gpu: &Gpu) -> Result<PersistentDecode> {
        if gpu.info().arch != Arch::Sm90a {
            return Err(refuse("needs sm_90a (bulk copies, mbarriers)".into()));
        }
        if self.group().is_some() {
            return Err(refuse("a tensor-parallel rank's step all-reduces between its launches".into()));
        }
        let c = self.cfg.layer_config();
        let (d, h, kv, hd, ff) = (c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff);
        let group = h / kv;
        let n = gpu.info().sm_count as usize;
        if hd != p::HEAD_DIM || group > p::MAX_GROUP || h % kv != 0 {
            return Err(refuse(format!(
                "head_dim {hd}, {h} heads over {kv}: needs 128 and ≤ {} per KV head",
                p::MAX_GROUP
            )));
        }
        for (name, k) in [("hidden_size", d), ("intermediate_size", ff), ("q width", h * hd)] {
            if k % p::K_MULTIPLE != 0 || k > p::MAX_K {
                return Err(refuse(format!("{name} {k}: needs a multiple of {} up to {}", p::K_MULTIPLE, p::MAX_K)));
            }
        }
        for (rows, pair) in [((h + 2 * kv) * hd, 1), (d, 1), (2 * ff, 2)] {
            if (rows / pair).div_ceil(n) * pair > p::MAX_ROWS {
                return Err(refuse(format!("{rows} rows over {n} blocks exceed {} per block", p::MAX_ROWS)));
            }
        }
        // The attention shuffles K/V row offsets within a layer's pool as u32.
        let pool_bytes = self.cache.pool_bytes() / (2 * self.cache.layers().max(1));
        if pool_bytes > u32::MAX as usize {
            return Err(refuse(format!("a layer's K or V pool of {pool_bytes} bytes exceeds 4 GiB")));
        }
        if p::SMEM_BYTES > gpu.info().max_shared_per_block_optin as usize {
            return Err(refuse(format!("{} bytes of shared memory per block", p::SMEM_BYTES)));
        }
        let mut table = Vec::with_capacity(self.w.blocks.len() * LAYER_WORDS);
        for (i, b) in self.w.blocks.iter().enumerate() {
            let l = b
                .persistent_layer(self.cache.layer(i)?.pools())
                .ok_or_else(|| refuse("a block without an MLP norm".into()))?;
            table.extend(l.words());
        }
        let cuda = || crate::error::cuda("cuMemAlloc");
        let max_splits = (n / kv).clamp(1, p::MERGE_SPLITS / group);
        let z = bf16::ZERO;
        let step = PersistentDecode {
            model: self.id,
            layers: DeviceBuffer::from_slice(&table).map_err(cuda())?,
            ids: DeviceBuffer::from_slice(&[0u32]).map_err(cuda())?,
            x: Tensor::filled(gpu, &[1, d], z)?,
            h: Tensor::filled(gpu, &[d], z)?,
            qkv: Tensor::filled(gpu, &[(h + 2 * kv) * hd], z)?,
            o: Tensor::filled(gpu, &[h * hd], z)?,
            act: Tensor::filled(gpu, &[ff], z)?,
            normed: Tensor::filled(gpu, &[1, d], z)?,
            partial: DeviceBuffer::zeroed(kv * max_splits * group * p::PARTIAL).map_err(cuda())?,
            counters: DeviceBuffer::zeroed(1 + self.w.blocks.len() * kv).map_err(cuda())?,
            tables: BatchBuffers::new(1, self.max_context().div_ceil(self.cache.page_size()))?,
            trace: DeviceBuffer::zeroed(1 + (STAGES_PER_LAYER + INNER) * self.w.blocks.len()).map_err(cuda())?,
            flags: 0,
            blocks: n,
        };
        // The uploads and zeroing memsets above ran on the legacy stream, which
        // the launches on ours do not wait for.
        crate::tensor::uploaded()?;
        Ok(step)
    }

    /// One decode step of `seq` with input token `id` through the persistent
    /// kernel: its K and V join the cache and `logits` (`[1, vocab]`) gets the
    /// next token's logits.
    pub fn decode_persistent(
        &mut self,
        gpu: &Gpu,
        pd: &mut PersistentDecode,
        seq: SeqId,
        id: u32,
        logits: &mut Tensor<bf16>,
    ) -> Result<()> {
        if pd.model != self.id {
            return Err(Error::InvalidArgument("persistent decode: buffers of another model".into()));
        }
        self.check_ids("persistent decode", &[id], 1)?;
        crate::ops::same_shape("persistent decode", "logits", &[1, self.vocab()], logits.shape())?;
        let starts = admit(&mut self.cache, self.rope.max_pos(), Phase::Decode, &[seq], &[1])?;
        let step = self.launch_persistent(gpu, pd, seq, starts[0], id, logits);
        if step.is_err() {
            self.shrink(&[seq], &starts);
        }
        step
    }

    fn launch_persistent(
        &self,
        gpu: &Gpu,
        pd: &mut PersistentDecode,
        seq: SeqId,
        pos: usize,
        id: u32,
        logits: &mut Tensor<bf16>,
    ) -> Result<()> {
        let c = self.cfg.layer_config();
        let (kv, group) = (c.n_kv_heads, c.n_heads / c.n_kv_heads);
        let batch = self.cache.batch_into(gpu, &[seq], &mut pd.tables, self.max_context())?;
        let page_table = batch.page_table_ptr();
        let ctx = pos + 1;
        // One split per block where the keys allow, each a whole number of
        // 32-key groups and none empty.
        let max_splits = (pd.blocks / kv).clamp(1, p::MERGE_SPLITS / group);
        let chunk = ctx.div_ceil(max_splits.min(ctx.div_ceil(32))).next_multiple_of(32);
        let splits = ctx.div_ceil(chunk);
        upload_async(gpu, &pd.ids, &[id])?;
        // SAFETY: the ids buffer holds one id below the vocabulary (checked), uploaded above.
        unsafe { embedding_device_ids(gpu, &self.w.embed, pd.ids.as_device_ptr().as_raw(), 1, &mut pd.x)? };
        let status = unsafe {
            cust::sys::cuMemsetD32Async(
                pd.counters.as_device_ptr().as_raw(),
                0,
                pd.counters.len(),
                gpu.stream().as_inner(),
            )
        };
        crate::error::check("cuMemsetD32Async", status)?;
        let (cos, sin) = self.rope.table_ptrs();
        let args = abi::PersistentDecodeArgs {
            layers: pd.layers.as_device_ptr().as_raw(),
            x: pd.x.device_ptr(),
            h: pd.h.device_ptr(),
            qkv: pd.qkv.device_ptr(),
            o: pd.o.device_ptr(),
            act: pd.act.device_ptr(),
            partial: pd.partial.as_device_ptr().as_raw(),
            counters: pd.counters.as_device_ptr().as_raw(),
            cos,
            sin,
            page_table,
            trace: pd.trace.as_device_ptr().as_raw(),
            n_layers: self.w.blocks.len() as u32,
            d: c.d_model as u32,
            n_heads: c.n_heads as u32,
            n_kv_heads: kv as u32,
            ff: c.d_ff as u32,
            page_size: self.cache.page_size() as u32,
            pos: pos as u32,
            splits: splits as u32,
            chunk: chunk as u32,
            eps: self.cfg.rms_norm_eps,
            scale_log2: std::f32::consts::LOG2_E / (c.head_dim as f32).sqrt(),
            flags: pd.flags,
        };
        // SAFETY: every address is a live buffer of the model or of `pd` sized by
        // the checks in `persistent_decode`; the page table covers `pos` (admitted);
        // one block per SM with this much shared memory keeps every block resident.
        unsafe {
            gpu.launch(
                k::PERSISTENT_DECODE_B1,
                (pd.blocks as u32, 1, 1),
                p::THREADS as u32,
                p::SMEM_BYTES as u32,
                &args,
            )?
        };
        rms_norm(gpu, &pd.x, &self.w.final_norm, self.cfg.rms_norm_eps, &mut pd.normed)?;
        self.launch_head(gpu, &pd.normed, logits)
    }
}
