//! f64 reference of the decoder layer, rounding to bf16 wherever the GPU layer
//! stores a bf16 intermediate, so the two can be compared at bf16 tolerance:
//! RMSNorm → QKV projection → RoPE → causal attention over the cache → O
//! projection + residual → RMSNorm → SwiGLU MLP + residual.

use super::{LayerConfig, LayerWeights};
use crate::data::to_f64;
use crate::reference::{attention, linear, rms_norm_rows, round_bf16, swiglu};

/// Rotary position embedding, rotate-half convention (as Llama in Hugging Face):
/// pairs (i, i + hd/2) of each head rotate by pos · θ^(−i/(hd/2)).
/// `x`: `[tokens, heads, head_dim]`; token t sits at `positions[t]`.
pub fn rope(x: &mut [f64], heads: usize, head_dim: usize, positions: &[usize], theta: f64) {
    let half = head_dim / 2;
    let inv_freq: Vec<f64> = (0..half).map(|i| theta.powf(-(i as f64) / half as f64)).collect();
    rope_with_inv_freq(x, heads, head_dim, positions, &inv_freq);
}

/// [`rope`] with explicit inverse frequencies: pair i rotates by pos · `inv_freq[i]`.
pub fn rope_with_inv_freq(x: &mut [f64], heads: usize, head_dim: usize, positions: &[usize], inv_freq: &[f64]) {
    let half = head_dim / 2;
    assert_eq!(inv_freq.len(), half, "one inverse frequency per rotated pair");
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..heads {
            let v = &mut x[(t * heads + h) * head_dim..][..head_dim];
            for (i, &f) in inv_freq.iter().enumerate() {
                let (s, c) = (pos as f64 * f).sin_cos();
                let (a, b) = (v[i], v[i + half]);
                v[i] = a * c - b * s;
                v[i + half] = a * s + b * c;
            }
        }
    }
}

fn rounded(v: Vec<f64>) -> Vec<f64> {
    v.into_iter().map(round_bf16).collect()
}

/// K and V of the tokens a sequence has seen, after RoPE: `[tokens, kv_heads, head_dim]`.
#[derive(Clone, Debug, Default)]
pub struct RefCache {
    pub k: Vec<f64>,
    pub v: Vec<f64>,
}

impl RefCache {
    pub fn len(&self, c: &LayerConfig) -> usize {
        self.k.len() / c.kv_dim()
    }

    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }
}

/// Runs `x` (`[tokens, d_model]`, the next tokens of one sequence) through the
/// layer, attending to `cache` plus themselves (causal), and appends their K/V to
/// `cache`. Returns the layer output `[tokens, d_model]`.
pub fn layer_forward(c: &LayerConfig, w: &LayerWeights, x: &[f64], cache: &mut RefCache) -> Vec<f64> {
    let proj = attention_block(c, w, x, cache);
    let h: Vec<f64> = rounded(proj.iter().zip(x).map(|(p, r)| p + r).collect());
    let down = mlp_block(c, w, &h);
    rounded(down.iter().zip(&h).map(|(a, r)| a + r).collect())
}

/// The attention half of [`layer_forward`] without its residual: RMSNorm, QKV,
/// RoPE, attention over `cache` (extended by `x`'s K/V) and the O projection,
/// `[tokens, d_model]` in f64 before rounding. With a shard's weights and
/// heads, one rank's partial sum of it.
pub fn attention_block(c: &LayerConfig, w: &LayerWeights, x: &[f64], cache: &mut RefCache) -> Vec<f64> {
    let (d, t) = (c.d_model, x.len() / c.d_model);
    let start = cache.len(c);
    let (n1, _) = rms_norm_rows(x, None, &to_f64(&w.attn_norm), c.eps as f64);
    let n1 = rounded(n1);
    let mut q = rounded(linear(&n1, &to_f64(&w.wq), t, c.q_dim(), d));
    let mut k = rounded(linear(&n1, &to_f64(&w.wk), t, c.kv_dim(), d));
    let v = rounded(linear(&n1, &to_f64(&w.wv), t, c.kv_dim(), d));
    let positions: Vec<usize> = (start..start + t).collect();
    rope(&mut q, c.n_heads, c.head_dim, &positions, c.rope_theta);
    rope(&mut k, c.n_kv_heads, c.head_dim, &positions, c.rope_theta);
    let (q, k) = (rounded(q), rounded(k));
    cache.k.extend_from_slice(&k);
    cache.v.extend_from_slice(&v);
    let scale = 1.0 / (c.head_dim as f64).sqrt();
    let (o, _) =
        attention(&q, &cache.k, &cache.v, &[t], &[start + t], c.n_heads, c.n_kv_heads, c.head_dim, true, scale);
    let o = rounded(o);
    linear(&o, &to_f64(&w.wo), t, d, c.q_dim())
}

/// The MLP half of [`layer_forward`] without its residual: RMSNorm, SwiGLU and
/// the down projection of `h`, in f64 before rounding (a rank's partial sum
/// with a shard's weights).
pub fn mlp_block(c: &LayerConfig, w: &LayerWeights, h: &[f64]) -> Vec<f64> {
    let (d, t) = (c.d_model, h.len() / c.d_model);
    let (n2, _) = rms_norm_rows(h, None, &to_f64(&w.mlp_norm), c.eps as f64);
    let n2 = rounded(n2);
    let act = swiglu(&n2, &to_f64(&w.w_gate), &to_f64(&w.w_up), t, c.d_ff, d);
    linear(&act, &to_f64(&w.w_down), t, d, c.d_ff)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::random_with_outliers;

    #[test]
    fn rope_is_identity_at_zero_and_preserves_pair_norms() {
        let x: Vec<f64> = (0..2 * 8).map(|i| i as f64 - 3.5).collect();
        let mut y = x.clone();
        rope(&mut y, 1, 8, &[0, 5], 10000.0);
        assert_eq!(&y[..8], &x[..8]);
        for i in 0..4 {
            let before = x[8 + i].hypot(x[12 + i]);
            let after = y[8 + i].hypot(y[12 + i]);
            assert!((before - after).abs() < 1e-12);
        }
        assert_ne!(&y[8..], &x[8..]);
    }

    #[test]
    fn decoding_after_prefill_equals_a_longer_prefill() {
        let c = LayerConfig::small();
        let w = LayerWeights::random(&c, 11).unwrap();
        let x: Vec<f64> = random_with_outliers(12, 6 * c.d_model, 1.0).iter().map(|&v| round_bf16(v as f64)).collect();
        let mut full = RefCache::default();
        let all = layer_forward(&c, &w, &x, &mut full);
        let mut cache = RefCache::default();
        let first = layer_forward(&c, &w, &x[..5 * c.d_model], &mut cache);
        let last = layer_forward(&c, &w, &x[5 * c.d_model..], &mut cache);
        assert_eq!(&all[..5 * c.d_model], &first[..]);
        let err = all[5 * c.d_model..].iter().zip(&last).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(err < 1e-9, "{err}");
        assert_eq!(cache.k, full.k);
    }
}
