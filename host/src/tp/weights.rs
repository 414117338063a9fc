//! One rank's slice of a layer's weights, from the whole layer or straight from
//! a mapped checkpoint (only the slice is read and converted).

use super::ShardPlan;
use crate::error::{Error, Result};
use crate::layer::weights::{bytes_to_bf16, check_layer, layer_tensors, layout};
use crate::layer::{LayerConfig, LayerWeights};
use crate::model::checkpoint::check_view;
use crate::model::Checkpoint;
use std::ops::Range;

/// A rank's block of one tensor viewed as a `[_, width]` row-major matrix.
struct Slice {
    rows: Range<usize>,
    cols: Range<usize>,
    width: usize,
}

impl Slice {
    /// The block of `field` (a `layout` name) that rank `p` holds: its heads'
    /// rows of Q, K and V and columns of O, its FFN rows of gate and up and
    /// columns of down; the norms whole.
    fn of_field(field: &str, c: &LayerConfig, p: &ShardPlan) -> Slice {
        let (d, q, ff) = (c.d_model, c.q_dim(), c.d_ff);
        let rows = |rows: Range<usize>| Slice { rows, cols: 0..d, width: d };
        let cols = |cols: Range<usize>, width| Slice { rows: 0..d, cols, width };
        match field {
            "attn_norm" | "mlp_norm" => Slice { rows: 0..d, cols: 0..1, width: 1 },
            "wq" => rows(p.q_rows()),
            "wk" | "wv" => rows(p.kv_rows()),
            "wo" => cols(p.q_rows(), q),
            "w_gate" | "w_up" => rows(p.ffn.clone()),
            "w_down" => cols(p.ffn.clone(), ff),
            other => unreachable!("no layer field {other}"),
        }
    }

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

impl LayerWeights {
    /// Rank `plan.rank`'s slice of these weights of a layer of `c`: its heads'
    /// rows of Q, K and V and columns of O, its FFN rows of gate and up and
    /// columns of down; the norms whole. A layer of `plan.shard_config(c)`.
    pub fn shard(&self, c: &LayerConfig, plan: &ShardPlan) -> Result<LayerWeights> {
        check_plan(c, plan)?;
        let mut w = LayerWeights::empty();
        for (field, _, _) in layout(c) {
            *w.field_mut(field) = Slice::of_field(field, c, plan).of(self.field(field), 1);
        }
        Ok(w)
    }

    /// Rank `plan.rank`'s slice of layer `layer` of a checkpoint, read from the
    /// mapped file: only the slice's bytes are touched and converted to bf16.
    pub fn shard_from_checkpoint(ckpt: &Checkpoint, layer: usize, plan: &ShardPlan) -> Result<LayerWeights> {
        check_layer(ckpt, layer)?;
        let c = ckpt.config().layer_config();
        check_plan(&c, plan)?;
        let mut w = LayerWeights::empty();
        for ((field, _, _), (name, shape)) in layout(&c).into_iter().zip(layer_tensors(&c, layer)) {
            let t = ckpt.tensor(&name)?;
            check_view(&name, &t, &shape)?;
            let elem = t.data().len() / shape.iter().product::<usize>().max(1);
            let bytes = Slice::of_field(field, &c, plan).of(t.data(), elem);
            *w.field_mut(field) = bytes_to_bf16(t.dtype(), &bytes).map_err(|e| Error::DType(format!("{name}: {e}")))?;
        }
        Ok(w)
    }
}
