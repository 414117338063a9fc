//! Megatron-style tensor parallelism: which slice of a layer each rank holds.
//! Q, K, V and gate/up are split by output rows (column-parallel: whole heads and
//! whole FFN columns per rank); O and down by input columns (row-parallel), so
//! each rank's O and down outputs are partial sums, all-reduced over the ranks.

use crate::error::{Error, Result};
use crate::layer::LayerConfig;
use std::ops::Range;

/// Rank `rank` of `world` ranks: its query heads, KV heads and FFN columns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    pub world: usize,
    pub rank: usize,
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    pub ffn: Range<usize>,
    head_dim: usize,
}

impl ShardPlan {
    /// The slice of a layer of `c` that `rank` holds. Refuses, naming the
    /// dimension, a split that is uneven or leaves a rank a width the kernels
    /// cannot take (KV heads are not replicated: TP ≤ the KV head count).
    pub fn new(c: &LayerConfig, world: usize, rank: usize) -> Result<ShardPlan> {
        c.validate()?;
        if world == 0 || rank >= world {
            return Err(Error::InvalidArgument(format!("rank {rank} of a tensor-parallel world of {world}")));
        }
        let split = |what: &str, n: usize| -> Result<Range<usize>> {
            if !n.is_multiple_of(world) {
                return Err(Error::InvalidArgument(format!(
                    "tensor parallelism {world}: {what} {n} do not split evenly over {world} ranks"
                )));
            }
            let per = n / world;
            Ok(rank * per..(rank + 1) * per)
        };
        let plan = ShardPlan {
            world,
            rank,
            q_heads: split("query heads", c.n_heads)?,
            kv_heads: split("KV heads", c.n_kv_heads)?,
            ffn: split("FFN columns (intermediate_size)", c.d_ff)?,
            head_dim: c.head_dim,
        };
        let ff = plan.ffn.len();
        if !ff.is_multiple_of(8) {
            return Err(Error::Alignment(format!(
                "tensor parallelism {world}: {ff} FFN columns per rank must be a multiple of 8 (16-byte rows)"
            )));
        }
        Ok(plan)
    }

    /// Every rank's plan, in rank order.
    pub fn all(c: &LayerConfig, world: usize) -> Result<Vec<ShardPlan>> {
        (0..world).map(|r| ShardPlan::new(c, world, r)).collect()
    }

    /// The layer one rank runs: its heads and FFN columns, the full model width.
    pub fn shard_config(&self, c: &LayerConfig) -> LayerConfig {
        LayerConfig { n_heads: self.q_heads.len(), n_kv_heads: self.kv_heads.len(), d_ff: self.ffn.len(), ..*c }
    }

    /// Rows of `q_proj` (and columns of `o_proj`) this rank holds.
    pub fn q_rows(&self) -> Range<usize> {
        self.q_heads.start * self.head_dim..self.q_heads.end * self.head_dim
    }

    /// Rows of `k_proj` and `v_proj` this rank holds.
    pub fn kv_rows(&self) -> Range<usize> {
        self.kv_heads.start * self.head_dim..self.kv_heads.end * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama70b() -> LayerConfig {
        LayerConfig { d_model: 8192, n_heads: 64, n_kv_heads: 8, head_dim: 128, d_ff: 28672, ..LayerConfig::default() }
    }

    #[test]
    fn llama_layers_split_over_1_2_4_8_ranks() {
        for c in [LayerConfig::default(), llama70b()] {
            for world in [1, 2, 4, 8] {
                let plans = ShardPlan::all(&c, world).unwrap();
                // The ranks tile every dimension in order, with no gap or overlap.
                let mut next = (0, 0, 0);
                for (r, p) in plans.iter().enumerate() {
                    assert_eq!((p.rank, p.world), (r, world));
                    assert_eq!((p.q_heads.start, p.kv_heads.start, p.ffn.start), next);
                    next = (p.q_heads.end, p.kv_heads.end, p.ffn.end);
                    let s = p.shard_config(&c);
                    s.validate().unwrap();
                    assert_eq!(s.n_heads / s.n_kv_heads, c.n_heads / c.n_kv_heads, "GQA groups stay whole");
                    assert_eq!(p.q_rows().len(), s.q_dim());
                    assert_eq!(p.kv_rows().len(), s.kv_dim());
                    assert_eq!(s.d_model, c.d_model);
                }
                assert_eq!(next, (c.n_heads, c.n_kv_heads, c.d_ff));
            }
        }
        let p = ShardPlan::new(&LayerConfig::default(), 4, 3).unwrap();
        assert_eq!((p.q_heads.clone(), p.kv_heads.clone(), p.ffn.clone()), (24..32, 6..8, 10752..14336));
        assert_eq!((p.q_rows(), p.kv_rows()), (3072..4096, 768..1024));
    }

    #[test]
    fn uneven_or_invalid_splits_are_refused_naming_the_dimension() {
        let c = LayerConfig::default();
        let msg = |world, rank| ShardPlan::new(&c, world, rank).unwrap_err().to_string();
        assert!(msg(16, 0).contains("KV heads 8"), "{}", msg(16, 0));
        assert!(msg(3, 0).contains("query heads 32"), "{}", msg(3, 0));
        assert!(msg(0, 0).contains("world of 0"));
        assert!(msg(2, 2).contains("rank 2"));
        let thirds = LayerConfig { n_heads: 48, n_kv_heads: 12, d_ff: 14344, ..c };
        let e = ShardPlan::new(&thirds, 3, 0).unwrap_err().to_string();
        assert!(e.contains("intermediate_size") && e.contains("14344"), "{e}");
        let narrow = LayerConfig { d_ff: 48, ..c };
        assert!(matches!(ShardPlan::new(&narrow, 8, 0), Err(Error::Alignment(_))));
    }
}
