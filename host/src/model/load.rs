//! Weights to HBM: from a memory-mapped checkpoint, tensor by tensor straight
//! from the mapped bytes (bf16; f16 and f32 are converted one tensor at a
//! time), or seeded random weights generated on the GPU.

use super::gpu::{head_rows, Model, ModelOptions, ModelWeights};
use super::{Checkpoint, ModelConfig};
use crate::error::{check, Error, Result};
use crate::layer::block::Block;
use crate::layer::weights::to_bf16;
use crate::layer::LayerWeights;
use crate::ops::{fill_random, SwiGluMlp};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use crate::tp::{AllReduce, ShardPlan};
use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};
use safetensors::{tensor::TensorView, Dtype};

/// Copies a `[rows, cols]` source (bf16 little-endian bytes, in host memory)
/// into rows `first, first + step, …` of `dst` (`[_, cols]`).
fn upload_rows(dst: &Tensor<bf16>, first: usize, step: usize, src: &[u8], rows: usize) -> Result<()> {
    let cols = dst.shape().last().copied().unwrap_or(0);
    let dst_rows = dst.numel() / cols.max(1);
    if src.len() != rows * cols * 2 || rows == 0 || first + (rows - 1) * step >= dst_rows {
        return Err(Error::Shape(format!("upload: {rows} rows into {:?} from row {first} by {step}", dst.shape())));
    }
    let copy = cust::sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: cust::sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        srcHost: src.as_ptr() as *const std::ffi::c_void,
        srcDevice: 0,
        srcArray: std::ptr::null_mut(),
        srcPitch: cols * 2,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: cust::sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst.device_ptr() + (first * cols * 2) as u64,
        dstArray: std::ptr::null_mut(),
        dstPitch: step * cols * 2,
        WidthInBytes: cols * 2,
        Height: rows,
    };
    // SAFETY: the source holds rows × cols bf16 (checked); the destination rows
    // first + i·step (i < rows) are inside `dst` (checked); the copy is
    // synchronous, so `src` only needs to live across the call.
    check("cuMemcpy2D", unsafe { cust::sys::cuMemcpy2D_v2(&copy) })
}

/// A tensor's bytes as bf16: borrowed from the mapping when it is bf16 already.
fn bf16_bytes<'a>(name: &str, t: &'a TensorView<'a>) -> Result<std::borrow::Cow<'a, [u8]>> {
    if t.dtype() == Dtype::BF16 {
        return Ok(std::borrow::Cow::Borrowed(t.data()));
    }
    let v = to_bf16(t).map_err(|e| Error::DType(format!("{name}: {e}")))?;
    Ok(std::borrow::Cow::Owned(v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()))
}

/// Reads checkpoint tensors into GPU tensors, counting bytes on a progress bar.
struct Loader<'a> {
    ckpt: &'a Checkpoint,
    gpu: &'a Gpu,
    bar: ProgressBar,
}

impl Loader<'_> {
    /// A new `[shape]` tensor holding `name`.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor<bf16>> {
        let t = Tensor::filled(self.gpu, shape, bf16::ZERO)?;
        self.to_rows(name, shape, &t, 0, 1)?;
        Ok(t)
    }

    /// A new `[rows, cols]` tensor holding `name` (`shape`, of fewer rows) in its first rows, zeros after.
    fn padded(&self, name: &str, shape: &[usize], rows: usize) -> Result<Tensor<bf16>> {
        let t = Tensor::filled(self.gpu, &[rows, shape[1]], bf16::ZERO)?;
        self.to_rows(name, shape, &t, 0, 1)?;
        Ok(t)
    }

    /// `name` (`[n]`) into elements `offset..offset + n` of `dst`.
    fn at_offset(&self, name: &str, n: usize, dst: &Tensor<bf16>, offset: usize) -> Result<()> {
        let view = self.ckpt.tensor_checked(name, &[n])?;
        let bytes = bf16_bytes(name, &view)?;
        if offset + n > dst.numel() {
            return Err(Error::Shape(format!("{name}: {n} elements at {offset} of {:?}", dst.shape())));
        }
        // SAFETY: `bytes` holds n bf16 (checked shape) and elements offset..offset + n
        // lie inside `dst` (checked); the copy is synchronous.
        let status = unsafe {
            cust::sys::cuMemcpyHtoD_v2(
                dst.device_ptr() + (offset * 2) as u64,
                bytes.as_ptr() as *const std::ffi::c_void,
                bytes.len(),
            )
        };
        check("cuMemcpyHtoD", status)?;
        self.bar.inc(bytes.len() as u64);
        Ok(())
    }

    /// `name` (`[rows, cols]`, or `[cols]`) into rows `first, first + step, …` of `dst`.
    fn to_rows(&self, name: &str, shape: &[usize], dst: &Tensor<bf16>, first: usize, step: usize) -> Result<()> {
        let view = self.ckpt.tensor_checked(name, shape)?;
        let bytes = bf16_bytes(name, &view)?;
        let rows = if shape.len() == 1 { 1 } else { shape[0] };
        upload_rows(dst, first, step, &bytes, rows)?;
        self.bar.inc(bytes.len() as u64);
        Ok(())
    }
}

impl Model {
    /// Loads a checkpoint's weights into HBM (a progress bar on stderr when
    /// `progress`), with a KV cache sized by `opts`. Every tensor is checked for
    /// presence, shape and dtype before the first byte is uploaded.
    pub fn load(gpu: &Gpu, ckpt: &Checkpoint, opts: ModelOptions, progress: bool) -> Result<Model> {
        let cfg = ckpt.config();
        check_supported(cfg, &opts)?;
        ckpt.validate()?;
        let lc = cfg.layer_config();
        let total: usize = super::expected_tensors(cfg).iter().map(|t| t.shape.iter().product::<usize>() * 2).sum();
        let bar = if progress { ProgressBar::new(total as u64) } else { ProgressBar::hidden() };
        bar.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:40}] {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec})",
            )
            .map_err(|e| Error::InvalidArgument(format!("progress style: {e}")))?
            .progress_chars("=> "),
        );
        bar.set_message("weights to HBM");
        let ld = Loader { ckpt, gpu, bar };
        let (d, v, ff) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
        let vp = head_rows(v);
        let embed = ld.padded("model.embed_tokens.weight", &[v, d], vp)?;
        let mut blocks = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let name = |n: &str| format!("model.layers.{i}.{n}");
            let w_qkv = Tensor::filled(gpu, &[q + 2 * kv, d], bf16::ZERO)?;
            ld.to_rows(&name("self_attn.q_proj.weight"), &[q, d], &w_qkv, 0, 1)?;
            ld.to_rows(&name("self_attn.k_proj.weight"), &[kv, d], &w_qkv, q, 1)?;
            ld.to_rows(&name("self_attn.v_proj.weight"), &[kv, d], &w_qkv, q + kv, 1)?;
            // Gate and up rows interleave, as the SwiGLU epilogue reads them.
            let w_gate_up = Tensor::filled(gpu, &[2 * ff, d], bf16::ZERO)?;
            ld.to_rows(&name("mlp.gate_proj.weight"), &[ff, d], &w_gate_up, 0, 2)?;
            ld.to_rows(&name("mlp.up_proj.weight"), &[ff, d], &w_gate_up, 1, 2)?;
            let mlp_norm = ld.tensor(&name("post_attention_layernorm.weight"), &[d])?;
            let mlp = SwiGluMlp::from_device(
                d,
                ff,
                w_gate_up,
                ld.tensor(&name("mlp.down_proj.weight"), &[d, ff])?,
                Some((mlp_norm, cfg.rms_norm_eps)),
            )?;
            let attn_norm = ld.tensor(&name("input_layernorm.weight"), &[d])?;
            let w_o = ld.tensor(&name("self_attn.o_proj.weight"), &[d, q])?;
            let qkv_bias = if cfg.attention_bias {
                let b = Tensor::filled(gpu, &[q + 2 * kv], bf16::ZERO)?;
                ld.at_offset(&name("self_attn.q_proj.bias"), q, &b, 0)?;
                ld.at_offset(&name("self_attn.k_proj.bias"), kv, &b, q)?;
                ld.at_offset(&name("self_attn.v_proj.bias"), kv, &b, q + kv)?;
                Some(b)
            } else {
                None
            };
            blocks.push(Block::from_device(&lc, attn_norm, w_qkv, w_o, mlp, qkv_bias)?);
        }
        let final_norm = ld.tensor("model.norm.weight", &[d])?;
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(ld.padded("lm_head.weight", &[v, d], vp)?) };
        ld.bar.finish_and_clear();
        Model::from_weights(gpu, cfg, ModelWeights { embed, lm_head, final_norm, blocks }, opts)
    }

    /// Rank `group.rank()` of a tensor-parallel model of `group.world()` ranks,
    /// with a KV cache of its KV heads sized by `opts`: only the rank's slices
    /// of the blocks are read from the mapped checkpoint (its heads' rows of Q,
    /// K and V and columns of O, its FFN rows of gate and up and columns of
    /// down); the embedding, the norms and the LM head are whole on every rank.
    /// Every step of the model all-reduces over `group`.
    pub fn load_shard(gpu: &Gpu, ckpt: &Checkpoint, group: Box<dyn AllReduce>, opts: ModelOptions) -> Result<Model> {
        let cfg = ckpt.config();
        check_supported(cfg, &opts)?;
        ckpt.validate()?;
        if cfg.attention_bias {
            return Err(Error::InvalidArgument(
                "tensor parallelism: a checkpoint with Q, K and V biases is not sliced yet".into(),
            ));
        }
        let lc = cfg.layer_config();
        let plan = ShardPlan::new(&lc, group.world(), group.rank())?;
        let rank = plan.shard_config(&lc);
        let rank_cfg = ModelConfig {
            num_attention_heads: rank.n_heads,
            num_key_value_heads: rank.n_kv_heads,
            intermediate_size: rank.d_ff,
            ..cfg.clone()
        };
        let ld = Loader { ckpt, gpu, bar: ProgressBar::hidden() };
        let (d, v) = (cfg.hidden_size, cfg.vocab_size);
        let vp = head_rows(v);
        let embed = ld.padded("model.embed_tokens.weight", &[v, d], vp)?;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| Block::from_host(gpu, &rank, &LayerWeights::shard_from_checkpoint(ckpt, i, &plan)?))
            .collect::<Result<Vec<Block>>>()?;
        let final_norm = ld.tensor("model.norm.weight", &[d])?;
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(ld.padded("lm_head.weight", &[v, d], vp)?) };
        let w = ModelWeights { embed, lm_head, final_norm, blocks };
        Ok(Model::from_weights(gpu, &rank_cfg, w, opts)?.in_group(group))
    }

    /// A model of `cfg`'s dimensions with seeded random weights generated on
    /// the GPU: projections and embeddings ~ N(0, 0.02²), norm weights ~ N(1, 0.1²).
    pub fn random(gpu: &Gpu, cfg: &ModelConfig, seed: u64, opts: ModelOptions) -> Result<Model> {
        check_supported(cfg, &opts)?;
        let lc = cfg.layer_config();
        let (d, v, ff) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
        let mut next = 0u64;
        let mut random = |shape: &[usize], mean: f32, std: f32| -> Result<Tensor<bf16>> {
            let mut t = Tensor::filled(gpu, shape, bf16::ZERO)?;
            // Each tensor its own stream of the seed.
            next += 1;
            fill_random(gpu, &mut t, seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(next), mean, std)?;
            Ok(t)
        };
        let vp = head_rows(v);
        let embed = random(&[vp, d], 0.0, 0.02)?;
        let mut blocks = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            let attn_norm = random(&[d], 1.0, 0.1)?;
            let w_qkv = random(&[q + 2 * kv, d], 0.0, 0.02)?;
            let w_o = random(&[d, q], 0.0, 0.02)?;
            let mlp_norm = random(&[d], 1.0, 0.1)?;
            let mlp = SwiGluMlp::from_device(
                d,
                ff,
                random(&[2 * ff, d], 0.0, 0.02)?,
                random(&[d, ff], 0.0, 0.02)?,
                Some((mlp_norm, cfg.rms_norm_eps)),
            )?;
            let qkv_bias = if cfg.attention_bias { Some(random(&[q + 2 * kv], 0.0, 0.02)?) } else { None };
            blocks.push(Block::from_device(&lc, attn_norm, w_qkv, w_o, mlp, qkv_bias)?);
        }
        let final_norm = random(&[d], 1.0, 0.1)?;
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(random(&[vp, d], 0.0, 0.02)?) };
        gpu.synchronize()?;
        Model::from_weights(gpu, cfg, ModelWeights { embed, lm_head, final_norm, blocks }, opts)
    }
}

/// What the GPU model does not do yet, refused with the config field named.
fn check_supported(cfg: &ModelConfig, opts: &ModelOptions) -> Result<()> {
    cfg.validate()?;
    if let Some(w) = cfg.sliding_window.filter(|&w| w < opts.max_context) {
        return Err(Error::Checkpoint(format!(
            "config.json: `sliding_window` {w} is below the context of {}: sliding-window attention is not supported",
            opts.max_context
        )));
    }
    if opts.max_context > cfg.max_position_embeddings {
        return Err(Error::InvalidArgument(format!(
            "a context of {} past `max_position_embeddings` {}",
            opts.max_context, cfg.max_position_embeddings
        )));
    }
    Ok(())
}
