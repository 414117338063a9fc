//! One layer's weights on the host, in the Hugging Face (`nn.Linear`) layout:
//! seeded random, or read from a safetensors file by Hugging Face tensor names.

use super::LayerConfig;
use crate::data::{cast, random_with_outliers};
use crate::error::{Error, Result};
use crate::model::checkpoint::check_view;
use crate::model::Checkpoint;
use half::bf16;
use safetensors::{tensor::TensorView, Dtype, SafeTensors};

#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// `[d]`
    pub attn_norm: Vec<bf16>,
    /// `[n_heads·head_dim, d]`
    pub wq: Vec<bf16>,
    /// `[n_kv_heads·head_dim, d]`
    pub wk: Vec<bf16>,
    pub wv: Vec<bf16>,
    /// `[d, n_heads·head_dim]`
    pub wo: Vec<bf16>,
    /// `[d]`
    pub mlp_norm: Vec<bf16>,
    /// `[d_ff, d]`
    pub w_gate: Vec<bf16>,
    pub w_up: Vec<bf16>,
    /// `[d, d_ff]`
    pub w_down: Vec<bf16>,
}

/// (field, Hugging Face name under `model.layers.{i}.`, shape) for every tensor.
pub(crate) fn layout(c: &LayerConfig) -> [(&'static str, &'static str, [usize; 2]); 9] {
    let (d, q, kv, ff) = (c.d_model, c.q_dim(), c.kv_dim(), c.d_ff);
    [
        ("attn_norm", "input_layernorm.weight", [d, 1]),
        ("wq", "self_attn.q_proj.weight", [q, d]),
        ("wk", "self_attn.k_proj.weight", [kv, d]),
        ("wv", "self_attn.v_proj.weight", [kv, d]),
        ("wo", "self_attn.o_proj.weight", [d, q]),
        ("mlp_norm", "post_attention_layernorm.weight", [d, 1]),
        ("w_gate", "mlp.gate_proj.weight", [ff, d]),
        ("w_up", "mlp.up_proj.weight", [ff, d]),
        ("w_down", "mlp.down_proj.weight", [d, ff]),
    ]
}

/// The Hugging Face name and shape of every tensor of layer `layer`, in [`layout`] order.
pub(crate) fn layer_tensors(c: &LayerConfig, layer: usize) -> Vec<(String, Vec<usize>)> {
    layout(c)
        .into_iter()
        .map(|(_, hf, [r, k])| (format!("model.layers.{layer}.{hf}"), if k == 1 { vec![r] } else { vec![r, k] }))
        .collect()
}

impl LayerWeights {
    pub(crate) fn field_mut(&mut self, name: &str) -> &mut Vec<bf16> {
        match name {
            "attn_norm" => &mut self.attn_norm,
            "wq" => &mut self.wq,
            "wk" => &mut self.wk,
            "wv" => &mut self.wv,
            "wo" => &mut self.wo,
            "mlp_norm" => &mut self.mlp_norm,
            "w_gate" => &mut self.w_gate,
            "w_up" => &mut self.w_up,
            _ => &mut self.w_down,
        }
    }

    pub(crate) fn field(&self, name: &str) -> &[bf16] {
        match name {
            "attn_norm" => &self.attn_norm,
            "wq" => &self.wq,
            "wk" => &self.wk,
            "wv" => &self.wv,
            "wo" => &self.wo,
            "mlp_norm" => &self.mlp_norm,
            "w_gate" => &self.w_gate,
            "w_up" => &self.w_up,
            _ => &self.w_down,
        }
    }

    pub(crate) fn empty() -> Self {
        LayerWeights {
            attn_norm: vec![],
            wq: vec![],
            wk: vec![],
            wv: vec![],
            wo: vec![],
            mlp_norm: vec![],
            w_gate: vec![],
            w_up: vec![],
            w_down: vec![],
        }
    }

    /// Seeded random weights: projections ~ 0.02·N(0,1) with outliers (as in the
    /// PyTorch reference), norm weights near 1.
    pub fn random(c: &LayerConfig, seed: u64) -> Result<Self> {
        c.validate()?;
        let mut w = Self::empty();
        for (i, (field, _, [r, k])) in layout(c).into_iter().enumerate() {
            let n = r * k;
            let values = random_with_outliers(seed + i as u64, n, 0.02);
            *w.field_mut(field) =
                if k == 1 { values.iter().map(|v| bf16::from_f32(1.0 + 5.0 * v)).collect() } else { cast(&values) };
        }
        Ok(w)
    }

    /// Layer `layer` of a safetensors file with Hugging Face names
    /// (`model.layers.{layer}.self_attn.q_proj.weight`, …), in bf16, f16 or f32.
    pub fn from_safetensors(bytes: &[u8], layer: usize, c: &LayerConfig) -> Result<Self> {
        c.validate()?;
        let file = SafeTensors::deserialize(bytes).map_err(|e| Error::InvalidArgument(format!("safetensors: {e}")))?;
        Self::read(c, layer, |name| file.tensor(name).map_err(|e| Error::InvalidArgument(format!("{name}: {e}"))))
    }

    /// Layer `layer` of an open checkpoint, with the checkpoint's dimensions. The QKV
    /// biases of a Qwen2 checkpoint are not read: the layer has no place for them yet.
    pub fn from_checkpoint(ckpt: &Checkpoint, layer: usize) -> Result<Self> {
        check_layer(ckpt, layer)?;
        Self::read(&ckpt.config().layer_config(), layer, |name| ckpt.tensor(name))
    }

    /// Reads every tensor of layer `layer` through `tensor`, checks its shape and
    /// converts it to bf16.
    fn read<'a>(c: &LayerConfig, layer: usize, tensor: impl Fn(&str) -> Result<TensorView<'a>>) -> Result<Self> {
        let mut w = Self::empty();
        for ((field, _, _), (name, shape)) in layout(c).into_iter().zip(layer_tensors(c, layer)) {
            let t = tensor(&name)?;
            check_view(&name, &t, &shape)?;
            *w.field_mut(field) = to_bf16(&t).map_err(|e| Error::DType(format!("{name}: {e}")))?;
        }
        Ok(w)
    }

    /// Serializes as layer `layer` with Hugging Face names (bf16).
    pub fn to_safetensors(&self, layer: usize, c: &LayerConfig) -> Result<Vec<u8>> {
        let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = layout(c)
            .into_iter()
            .zip(layer_tensors(c, layer))
            .map(|((field, _, _), (name, shape))| {
                let data = self.field(field).iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
                (name, data, shape)
            })
            .collect();
        let views = bytes
            .iter()
            .map(|(n, d, s)| TensorView::new(Dtype::BF16, s.clone(), d).map(|v| (n.clone(), v)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::InvalidArgument(format!("safetensors: {e}")))?;
        safetensors::serialize(views, None).map_err(|e| Error::InvalidArgument(format!("safetensors: {e}")))
    }
}

/// Refuses a layer index past the checkpoint's layers.
pub(crate) fn check_layer(ckpt: &Checkpoint, layer: usize) -> Result<()> {
    let n = ckpt.config().num_hidden_layers;
    if layer >= n {
        return Err(Error::InvalidArgument(format!("layer {layer} of a checkpoint with {n} layers")));
    }
    Ok(())
}

/// A tensor's elements as bf16, converting f16 and f32.
pub(crate) fn to_bf16(t: &TensorView) -> std::result::Result<Vec<bf16>, String> {
    bytes_to_bf16(t.dtype(), t.data())
}

/// Little-endian elements of `dtype` (bf16, f16 or f32) as bf16.
pub(crate) fn bytes_to_bf16(dtype: Dtype, d: &[u8]) -> std::result::Result<Vec<bf16>, String> {
    Ok(match dtype {
        Dtype::BF16 => d.chunks_exact(2).map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|b| bf16::from_f32(half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()))
            .collect(),
        Dtype::F32 => d.chunks_exact(4).map(|b| bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))).collect(),
        other => return Err(format!("dtype {other:?} is not supported (bf16, f16, f32)")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safetensors_round_trip_with_hf_names() {
        let c = LayerConfig::small();
        let w = LayerWeights::random(&c, 7).unwrap();
        let bytes = w.to_safetensors(3, &c).unwrap();
        let back = LayerWeights::from_safetensors(&bytes, 3, &c).unwrap();
        assert_eq!(back.wq, w.wq);
        assert_eq!(back.w_down, w.w_down);
        assert_eq!(back.attn_norm, w.attn_norm);
        // Wrong layer index or wrong config: clear errors.
        assert!(LayerWeights::from_safetensors(&bytes, 0, &c).is_err());
        let other = LayerConfig { d_ff: 680, ..c.clone() };
        assert!(matches!(LayerWeights::from_safetensors(&bytes, 3, &other), Err(Error::Shape(_))));
    }
}
