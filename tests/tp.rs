//! Tensor parallelism emulated on one GPU with the shipped kernels: every rank's
//! slice of a layer runs in turn (its heads' QKV, RoPE and KV cache, attention,
//! its O columns; its FFN columns of gate/up and down), and the all-reduce of
//! the O and down partial sums is a chain of residual-epilogue GEMMs, each
//! adding one rank's partial to the running sum. TP = 1, 2 and 4 over a prefill
//! and decode steps, against the whole layer's f64 reference and the sharded
//! CPU reference. This exercises every slice and offset of `ShardPlan`.

use host::layer::reference::{layer_forward, RefCache};
use host::layer::{LayerConfig, LayerWeights};
use host::ops::gemm::interleave_gate_up;
use host::ops::{
    decode_attention, flash_attention, linear, linear_residual, linear_swiglu, rms_norm, rope_qkv_cache,
    AttentionOptions, PagedKvCache, RopeTable, SeqId, VarlenBatch,
};
use host::tp::reference::{self as tp_ref, RankRef};
use host::tp::ShardPlan;
use host::{bf16, Error, Gpu, Tensor};
use lab::testing::{cast, expect_close, random_with_outliers, rel_l2_error, to_f64, GpuTests};

fn e(err: Error) -> String {
    err.to_string()
}

/// One rank's slice of the layer, on the GPU, with its own KV cache.
struct Rank {
    cfg: LayerConfig,
    attn_norm: Tensor<bf16>,
    mlp_norm: Tensor<bf16>,
    w_qkv: Tensor<bf16>,
    w_o: Tensor<bf16>,
    w_gate_up: Tensor<bf16>,
    w_down: Tensor<bf16>,
    cache: PagedKvCache,
    seq: SeqId,
}

impl Rank {
    fn new(gpu: &Gpu, cfg: LayerConfig, w: &LayerWeights, max_tokens: usize) -> Result<Rank, String> {
        let (d, q, kv, ff) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.d_ff);
        let up = |data: &[bf16], shape: &[usize]| Tensor::from_host(gpu, data, shape).map_err(e);
        let qkv: Vec<bf16> = [&w.wq[..], &w.wk[..], &w.wv[..]].concat();
        let gate_up = interleave_gate_up(&w.w_gate, &w.w_up, d).map_err(e)?;
        let mut cache = PagedKvCache::new(gpu, max_tokens.div_ceil(16), 16, cfg.n_kv_heads, cfg.head_dim).map_err(e)?;
        let seq = cache.add_sequence();
        Ok(Rank {
            attn_norm: up(&w.attn_norm, &[d])?,
            mlp_norm: up(&w.mlp_norm, &[d])?,
            w_qkv: up(&qkv, &[q + 2 * kv, d])?,
            w_o: up(&w.wo, &[d, q])?,
            w_gate_up: up(&gate_up, &[2 * ff, d])?,
            w_down: up(&w.w_down, &[d, ff])?,
            cache,
            seq,
            cfg,
        })
    }

    /// `h_next = h + attention(x)·W_oᵀ` over this rank's heads, for `x`'s
    /// tokens at positions `start..`: one rank's share of the all-reduce added.
    fn attention_into(
        &mut self,
        gpu: &Gpu,
        rope: &RopeTable,
        x: &Tensor<bf16>,
        start: usize,
        h: &Tensor<bf16>,
        h_next: &mut Tensor<bf16>,
    ) -> Result<(), String> {
        let c = self.cfg.clone();
        let (t, d) = (x.shape()[0], c.d_model);
        let (heads, kv, hd) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let nan = bf16::NAN;
        let mut normed = Tensor::filled(gpu, &[t, d], nan).map_err(e)?;
        rms_norm(gpu, x, &self.attn_norm, c.eps, &mut normed).map_err(e)?;
        let mut qkv = Tensor::filled(gpu, &[t, (heads + 2 * kv) * hd], nan).map_err(e)?;
        linear(gpu, &normed, &self.w_qkv, &mut qkv).map_err(e)?;
        self.cache.grow_all(&[self.seq], &[t]).map_err(e)?;
        let batch = self.cache.batch(gpu, &[self.seq]).map_err(e)?;
        let (seq, pos): (Vec<u32>, Vec<u32>) = (0..t).map(|i| (0, (start + i) as u32)).unzip();
        let mut q = Tensor::filled(gpu, &[t, heads, hd], nan).map_err(e)?;
        let mut o = Tensor::filled(gpu, &[t, heads, hd], nan).map_err(e)?;
        if start == 0 {
            let mut k = Tensor::filled(gpu, &[t, kv, hd], nan).map_err(e)?;
            let mut v = Tensor::filled(gpu, &[t, kv, hd], nan).map_err(e)?;
            rope_qkv_cache(gpu, &qkv, None, rope, &self.cache, &batch, &seq, &pos, &mut q, Some((&mut k, &mut v)))
                .map_err(e)?;
            let vb = VarlenBatch::new(gpu, &[t], &[t]).map_err(e)?;
            let mut lse = Tensor::filled(gpu, &[heads, t], 0.0f32).map_err(e)?;
            let opts = AttentionOptions { causal: true, scale: None };
            flash_attention(gpu, &q, &k, &v, &vb, opts, &mut o, &mut lse).map_err(e)?;
        } else {
            if t != 1 {
                return Err("decode steps take one token".into());
            }
            rope_qkv_cache(gpu, &qkv, None, rope, &self.cache, &batch, &seq, &pos, &mut q, None).map_err(e)?;
            let mut lse = Tensor::filled(gpu, &[t, heads], 0.0f32).map_err(e)?;
            decode_attention(gpu, &self.cache, &batch, &q, None, &mut o, &mut lse).map_err(e)?;
        }
        o.reshape(&[t, heads * hd]).map_err(e)?;
        linear_residual(gpu, &o, &self.w_o, h, h_next).map_err(e)
    }

    /// `out_next = out + SwiGLU(normed)·W_downᵀ` over this rank's FFN columns.
    fn mlp_into(
        &self,
        gpu: &Gpu,
        normed: &Tensor<bf16>,
        out: &Tensor<bf16>,
        out_next: &mut Tensor<bf16>,
    ) -> Result<(), String> {
        let t = normed.shape()[0];
        let mut act = Tensor::filled(gpu, &[t, self.cfg.d_ff], bf16::NAN).map_err(e)?;
        linear_swiglu(gpu, normed, &self.w_gate_up, &mut act).map_err(e)?;
        linear_residual(gpu, &act, &self.w_down, out, out_next).map_err(e)
    }
}

/// The emulated TP layer over `x` (`[t, d]`, positions `start..`).
fn tp_forward(
    gpu: &Gpu,
    ranks: &mut [Rank],
    rope: &RopeTable,
    x: &Tensor<bf16>,
    start: usize,
) -> Result<Tensor<bf16>, String> {
    let c = ranks[0].cfg.clone();
    let shape = x.shape().to_vec();
    let fresh = || Tensor::filled(gpu, &shape, bf16::NAN).map_err(e);
    // h = x + Σ_r attention_r(x)·W_o,rᵀ, one rank's partial at a time.
    let mut h = Tensor::from_host(gpu, &x.to_host(gpu).map_err(e)?, &shape).map_err(e)?;
    for r in ranks.iter_mut() {
        let mut next = fresh()?;
        r.attention_into(gpu, rope, x, start, &h, &mut next)?;
        h = next;
    }
    // The norms are whole on every rank: rank 0's serve.
    let mut normed = fresh()?;
    rms_norm(gpu, &h, &ranks[0].mlp_norm, c.eps, &mut normed).map_err(e)?;
    let mut out = Tensor::from_host(gpu, &h.to_host(gpu).map_err(e)?, &shape).map_err(e)?;
    for r in ranks.iter() {
        let mut next = fresh()?;
        r.mlp_into(gpu, &normed, &out, &mut next)?;
        out = next;
    }
    Ok(out)
}

/// TP 1, 2 and 4 (GQA 8/4, head dim 64, FFN 1024): a 37-token prefill, then
/// three decode steps, against the f64 references; the ranks' caches together
/// hold every KV head of the whole layer's cache.
fn emulated_tp_matches_the_layer(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig { d_model: 512, n_heads: 8, n_kv_heads: 4, head_dim: 64, d_ff: 1024, ..LayerConfig::default() };
    let w = LayerWeights::random(&c, 21).map_err(e)?;
    let (prompt, steps) = (37, 3);
    let x: Vec<bf16> = cast(&random_with_outliers(22, (prompt + steps) * c.d_model, 1.0));
    let chunks: Vec<&[bf16]> =
        std::iter::once(&x[..prompt * c.d_model]).chain(x[prompt * c.d_model..].chunks(c.d_model)).collect();
    let mut whole = RefCache::default();
    let want: Vec<Vec<f64>> = chunks.iter().map(|x| layer_forward(&c, &w, &to_f64(x), &mut whole)).collect();
    let rope = RopeTable::new(gpu, c.head_dim, c.rope_theta, 256).map_err(e)?;
    for world in [1, 2, 4] {
        let plans = ShardPlan::all(&c, world).map_err(e)?;
        let mut ranks = Vec::new();
        let mut refs = Vec::new();
        for p in &plans {
            let (sc, sw) = (p.shard_config(&c), w.shard(&c, p).map_err(e)?);
            ranks.push(Rank::new(gpu, sc.clone(), &sw, prompt + steps)?);
            refs.push(RankRef { config: sc, weights: sw, cache: RefCache::default() });
        }
        let mut start = 0;
        for (i, (chunk, want)) in chunks.iter().zip(&want).enumerate() {
            let t = chunk.len() / c.d_model;
            let xt = Tensor::from_host(gpu, chunk, &[t, c.d_model]).map_err(e)?;
            let got = to_f64(&tp_forward(gpu, &mut ranks, &rope, &xt, start)?.to_host(gpu).map_err(e)?);
            if got.iter().any(|v| v.is_nan()) {
                return Err(format!("TP {world}, step {i}: NaN in the output"));
            }
            let sharded = tp_ref::layer_forward(&mut refs, &to_f64(chunk));
            expect_close(&format!("TP {world} step {i} vs the layer"), rel_l2_error(&got, want), 1e-2)?;
            expect_close(&format!("TP {world} step {i} vs the sharded reference"), rel_l2_error(&got, &sharded), 1e-2)?;
            start += t;
        }
        let kv: usize = ranks
            .iter()
            .map(|r| r.cache.read(gpu, r.seq).map(|(k, _)| k.len()))
            .sum::<Result<usize, _>>()
            .map_err(e)?;
        if kv != whole.k.len() {
            return Err(format!("TP {world}: the ranks' caches hold {kv} K values, the layer's {}", whole.k.len()));
        }
    }
    Ok(())
}

fn main() {
    let mut t = GpuTests::new("tp");
    t.run("tp_emulated_on_one_gpu_matches_the_layer", emulated_tp_matches_the_layer);
    t.finish();
}
