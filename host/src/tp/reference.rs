//! The CPU reference of a tensor-parallel layer: each rank runs the attention
//! and MLP halves over its shard, and the ranks' partial sums are added where
//! the all-reduces go, before the residual adds.

use crate::layer::reference::{attention_block, mlp_block, RefCache};
use crate::layer::{LayerConfig, LayerWeights};
use crate::reference::round_bf16;

/// One rank of the reference: its layer (`ShardPlan::shard_config`), its
/// weights (`LayerWeights::shard`) and its KV cache (its KV heads only).
pub struct RankRef {
    pub config: LayerConfig,
    pub weights: LayerWeights,
    pub cache: RefCache,
}

/// [`crate::layer::reference::layer_forward`] over the ranks: `x` is
/// `[tokens, d_model]` on every rank, and so is the result.
pub fn layer_forward(ranks: &mut [RankRef], x: &[f64]) -> Vec<f64> {
    let attn = all_reduce(ranks.iter_mut().map(|r| attention_block(&r.config, &r.weights, x, &mut r.cache)));
    let h: Vec<f64> = attn.iter().zip(x).map(|(a, r)| round_bf16(a + r)).collect();
    let mlp = all_reduce(ranks.iter().map(|r| mlp_block(&r.config, &r.weights, &h)));
    mlp.iter().zip(&h).map(|(a, r)| round_bf16(a + r)).collect()
}

/// The element-wise sum of the ranks' partial outputs.
fn all_reduce(parts: impl Iterator<Item = Vec<f64>>) -> Vec<f64> {
    parts
        .reduce(|mut sum, p| {
            sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
            sum
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::random_with_outliers;
    use crate::layer::reference;
    use crate::tp::ShardPlan;

    fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        (num / b.iter().map(|y| y * y).sum::<f64>()).sqrt()
    }

    /// TP = 1, 2 and 4 against the whole layer: a prefill of 7 tokens, then two
    /// decode steps through each rank's own cache.
    #[test]
    fn sharded_layer_matches_the_whole_layer() {
        let c =
            LayerConfig { d_model: 256, n_heads: 8, n_kv_heads: 4, head_dim: 64, d_ff: 512, ..LayerConfig::small() };
        let w = LayerWeights::random(&c, 5).unwrap();
        let x: Vec<f64> = random_with_outliers(9, 9 * c.d_model, 1.0).iter().map(|&v| round_bf16(v as f64)).collect();
        let chunks = [&x[..7 * c.d_model], &x[7 * c.d_model..8 * c.d_model], &x[8 * c.d_model..]];
        let mut whole = RefCache::default();
        let want: Vec<Vec<f64>> = chunks.iter().map(|x| reference::layer_forward(&c, &w, x, &mut whole)).collect();
        for world in [1, 2, 4] {
            let mut ranks: Vec<RankRef> = ShardPlan::all(&c, world)
                .unwrap()
                .iter()
                .map(|p| RankRef {
                    config: p.shard_config(&c),
                    weights: w.shard(&c, p).unwrap(),
                    cache: RefCache::default(),
                })
                .collect();
            for (x, want) in chunks.iter().zip(&want) {
                let got = layer_forward(&mut ranks, x);
                if world == 1 {
                    assert_eq!(&got, want, "TP 1 is the layer itself");
                }
                let err = rel_l2(&got, want);
                assert!(err < 1e-3, "TP {world}: rel L2 {err}");
            }
            let kv: usize = ranks.iter().map(|r| r.cache.k.len()).sum();
            assert_eq!(kv, whole.k.len(), "TP {world}: the ranks' caches hold every KV head once");
        }
    }
}
