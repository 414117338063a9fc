//! One rank's slice of a layer's weights, from the whole layer or straight from
//! a mapped checkpoint (only the slice is read and converted).

use super::ShardPlan;
use crate::error::{Error, Result};
use crate::layer::weights::{bytes_to_bf16, layer_tensors};
use crate::layer::{LayerConfig, LayerWeights};
use crate::model::checkpoint::check_view;
use crate::model::Checkpoint;
use half::bf16;
use std::ops::Range;

/// A rank's block of one tensor viewed as a `[_, width]` row-major matrix.
struct Slice {
    rows: Range<usize>,
    cols: Range<usize>,
    width: usize,
}

/// The block each of the layer's tensors gives a rank, in `layer_tensors`'
/// order: attn_norm, q, k, v, o, mlp_norm, gate, up, down. Norms are whole.
fn slices(c: &LayerConfig, p: &ShardPlan) -> [Slice; 9] {
    let (d, q, ff) = (c.d_model, c.q_dim(), c.d_ff);
    let norm = || Slice { rows: 0..d, cols: 0..1, width: 1 };
    let rows = |rows: Range<usize>| Slice { rows, cols: 0..d, width: d };
    let cols = |cols: Range<usize>, width| Slice { rows: 0..d, cols, width };
    [
        norm(),
        rows(p.q_rows()),
        rows(p.kv_rows()),
        rows(p.kv_rows()),
        cols(p.q_rows(), q),
        norm(),
        rows(p.ffn.clone()),
        rows(p.ffn.clone()),
        cols(p.ffn.clone(), ff),
    ]
}

impl Slice {
    /// The block's elements of `data`, `elem` bytes (or 1 unit) each, row by row.
    fn of<T: Copy>(&self, data: &[T], elem: usize) -> Vec<T> {
        let (w, c0, c1) = (self.width * elem, self.cols.start * elem, self.cols.end * elem);
        self.rows.clone().flat_map(|r| data[r * w + c0..r * w + c1].iter().copied()).collect()
    }
}

/// Refuses a plan made for other dimensions.
fn check_plan(c: &LayerConfig, p: &ShardPlan) -> Result<()> {
    if *p != ShardPlan::new(c, p.world, p.rank)? {
        return Err(Error::InvalidArgument(format!("shard plan {p:?} is not of this layer's dimensions")));
    }
    Ok(())
}

fn assemble(mut parts: impl Iterator<Item = Vec<bf16>>) -> LayerWeights {
    let mut next = || parts.next().expect("nine tensors");
    LayerWeights {
        attn_norm: next(),
        wq: next(),
        wk: next(),
        wv: next(),
        wo: next(),
        mlp_norm: next(),
        w_gate: next(),
        w_up: next(),
        w_down: next(),
    }
}

impl LayerWeights {
    /// Rank `plan.rank`'s slice of these weights of a layer of `c`: its heads'
    /// rows of Q, K and V and columns of O, its FFN rows of gate and up and
    /// columns of down; the norms whole. A layer of `plan.shard_config(c)`.
    pub fn shard(&self, c: &LayerConfig, plan: &ShardPlan) -> Result<LayerWeights> {
        check_plan(c, plan)?;
        let full = [
            &self.attn_norm,
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.mlp_norm,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
        ];
        Ok(assemble(slices(c, plan).iter().zip(full).map(|(s, data)| s.of(data, 1))))
    }

    /// Rank `plan.rank`'s slice of layer `layer` of a checkpoint, read from the
    /// mapped file: only the slice's bytes are touched and converted to bf16.
    pub fn shard_from_checkpoint(ckpt: &Checkpoint, layer: usize, plan: &ShardPlan) -> Result<LayerWeights> {
        let n = ckpt.config().num_hidden_layers;
        if layer >= n {
            return Err(Error::InvalidArgument(format!("layer {layer} of a checkpoint with {n} layers")));
        }
        let c = ckpt.config().layer_config();
        check_plan(&c, plan)?;
        let mut parts = Vec::with_capacity(9);
        for (s, (name, shape)) in slices(&c, plan).iter().zip(layer_tensors(&c, layer)) {
            let t = ckpt.tensor(&name)?;
            check_view(&name, &t, &shape)?;
            let elem = t.data().len() / shape.iter().product::<usize>().max(1);
            let bytes = s.of(t.data(), elem);
            parts.push(bytes_to_bf16(t.dtype(), &bytes).map_err(|e| Error::DType(format!("{name}: {e}")))?);
        }
        Ok(assemble(parts.into_iter()))
    }
}
