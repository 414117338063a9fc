//! `config.json` and `generation_config.json` of a Hugging Face checkpoint, for the
//! Llama family (Llama, Mistral, Qwen2), checked against what the kernels support.

use crate::error::{Error, Result};
use crate::layer::LayerConfig;
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// The architectures whose checkpoints share the Llama tensor layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelType {
    Llama,
    Mistral,
    /// Llama with a bias on the Q, K and V projections.
    Qwen2,
}

/// The element type the checkpoint was saved in (`torch_dtype`, or `dtype` in newer files).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDType {
    BF16,
    F16,
    F32,
}

/// RoPE frequency scaling.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Llama-3.1: wavelengths above `original_max_position_embeddings / low_freq_factor`
    /// are stretched by `factor`, those below `… / high_freq_factor` kept, and the band
    /// between blended linearly.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: usize },
}

/// The model's dimensions and options, from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub model_type: ModelType,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    /// The output projection is `model.embed_tokens.weight` (no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// Q, K and V projections carry a bias (`attention_bias`, or implied by Qwen2).
    pub attention_bias: bool,
    /// Attention window of Mistral-style sliding-window attention, where it is in use.
    pub sliding_window: Option<usize>,
    pub dtype: Option<WeightDType>,
}

/// `config.json` as written, before defaults and checks. Unknown keys are ignored.
#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    /// Newer files fold `rope_theta` and the scaling into one object.
    rope_parameters: Option<Value>,
    vocab_size: Option<usize>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
}

fn bad(m: String) -> Error {
    Error::Checkpoint(format!("config.json: {m}"))
}

fn required(v: Option<usize>, field: &str) -> Result<usize> {
    v.ok_or_else(|| bad(format!("`{field}` is missing")))
}

/// Reads a number field of a JSON object (the rope scaling), naming it when absent.
fn number(obj: &Value, parent: &str, field: &str) -> Result<f64> {
    obj.get(field).and_then(Value::as_f64).ok_or_else(|| bad(format!("`{parent}.{field}` is missing or not a number")))
}

/// `null`, `{}`, `{"rope_type": "default"}` mean none; `llama3` is the one scaling supported.
fn rope_scaling(v: Option<&Value>, parent: &str) -> Result<Option<RopeScaling>> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    if !v.is_object() {
        return Err(bad(format!("`{parent}` must be an object or null")));
    }
    // Older files name the kind `type`.
    let kind = v.get("rope_type").or_else(|| v.get("type")).and_then(Value::as_str);
    match kind {
        None | Some("default") => Ok(None),
        Some("llama3") => Ok(Some(RopeScaling::Llama3 {
            factor: number(v, parent, "factor")?,
            low_freq_factor: number(v, parent, "low_freq_factor")?,
            high_freq_factor: number(v, parent, "high_freq_factor")?,
            original_max_position_embeddings: number(v, parent, "original_max_position_embeddings")? as usize,
        })),
        Some(other) => Err(bad(format!("`{parent}.rope_type` `{other}` is not supported (llama3, default)"))),
    }
}

impl ModelConfig {
    /// Parses and checks the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let model_type = match raw.model_type.as_deref() {
            Some("llama") => ModelType::Llama,
            Some("mistral") => ModelType::Mistral,
            Some("qwen2") => ModelType::Qwen2,
            Some(other) => return Err(bad(format!("`model_type` `{other}` is not supported (llama, mistral, qwen2)"))),
            None => return Err(bad("`model_type` is missing".into())),
        };
        // transformers 5 writes `dtype`; older files `torch_dtype`. Errors name the one read.
        let (dtype_field, dtype) = match (&raw.torch_dtype, &raw.dtype) {
            (Some(t), _) => ("torch_dtype", Some(t.as_str())),
            (None, d) => ("dtype", d.as_deref()),
        };
        let dtype = match dtype {
            None => None,
            Some("bfloat16") => Some(WeightDType::BF16),
            Some("float16") => Some(WeightDType::F16),
            Some("float32") => Some(WeightDType::F32),
            Some(other) => {
                return Err(bad(format!("`{dtype_field}` `{other}` is not supported (bfloat16, float16, float32)")))
            }
        };
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(bad(format!("`hidden_act` `{act}` is not supported (silu)")));
        }
        if raw.mlp_bias == Some(true) {
            return Err(bad("`mlp_bias` true is not supported".into()));
        }
        let params = raw.rope_parameters.as_ref().filter(|v| !v.is_null());
        let (rope_theta, rope_scaling) = match params {
            Some(p) => (
                p.get("rope_theta").and_then(Value::as_f64).or(raw.rope_theta),
                rope_scaling(Some(p), "rope_parameters")?,
            ),
            None => (raw.rope_theta, rope_scaling(raw.rope_scaling.as_ref(), "rope_scaling")?),
        };
        let hidden_size = required(raw.hidden_size, "hidden_size")?;
        let num_attention_heads = required(raw.num_attention_heads, "num_attention_heads")?;
        if num_attention_heads == 0 {
            return Err(bad("`num_attention_heads` must be positive".into()));
        }
        let sliding_window = match model_type {
            // Qwen2 files name a window that only `use_sliding_window` turns on.
            ModelType::Qwen2 if raw.use_sliding_window != Some(true) => None,
            _ => raw.sliding_window,
        };
        let c = ModelConfig {
            model_type,
            hidden_size,
            intermediate_size: required(raw.intermediate_size, "intermediate_size")?,
            num_hidden_layers: required(raw.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(num_attention_heads),
            head_dim: raw.head_dim.unwrap_or(hidden_size / num_attention_heads),
            // The Hugging Face default of all three architectures.
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: rope_theta.unwrap_or(10000.0),
            rope_scaling,
            vocab_size: required(raw.vocab_size, "vocab_size")?,
            max_position_embeddings: required(raw.max_position_embeddings, "max_position_embeddings")?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            attention_bias: raw.attention_bias.unwrap_or(false) || model_type == ModelType::Qwen2,
            sliding_window,
            dtype,
        };
        c.validate()?;
        Ok(c)
    }

    /// Reads, parses and checks a `config.json` file.
    /// Llama-3-8B's dimensions (the seeded model of `cargo xtask generate`).
    pub fn llama3_8b() -> Self {
        ModelConfig {
            model_type: ModelType::Llama,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: None,
            vocab_size: 128256,
            max_position_embeddings: 8192,
            tie_word_embeddings: false,
            attention_bias: false,
            sliding_window: None,
            dtype: Some(WeightDType::BF16),
        }
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Checkpoint(format!("{}: {e}", path.display())))?;
        Self::from_json(&text)
    }

    /// Checks what the kernels support; every error names the field at fault.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(bad(format!("`{field}` must be positive")));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(bad(format!(
                "`num_attention_heads` {} is not a multiple of `num_key_value_heads` {}",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        if self.head_dim != 64 && self.head_dim != 128 {
            return Err(bad(format!("`head_dim` {} is not supported by the kernels (64, 128)", self.head_dim)));
        }
        // The GEMMs read rows in 16-byte (8 × bf16) pieces.
        for (field, v) in [("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size)] {
            if !v.is_multiple_of(8) {
                return Err(bad(format!("`{field}` {v} is not a multiple of 8")));
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(bad(format!("`rms_norm_eps` {} must be positive", self.rms_norm_eps)));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(bad(format!("`rope_theta` {} must be positive", self.rope_theta)));
        }
        if let Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) = &self.rope_scaling
        {
            if !(*factor >= 1.0 && *low_freq_factor > 0.0 && high_freq_factor > low_freq_factor)
                || *original_max_position_embeddings == 0
            {
                return Err(bad(format!(
                    "`rope_scaling` needs factor ≥ 1, 0 < low_freq_factor < high_freq_factor and a positive \
                     original_max_position_embeddings (got {factor}, {low_freq_factor}, {high_freq_factor}, \
                     {original_max_position_embeddings})"
                )));
            }
        }
        Ok(())
    }

    /// The dimensions of one decoder layer. [`LayerConfig`] has no RoPE scaling, QKV
    /// bias or sliding window yet: a model that uses them needs those in the layer.
    pub fn layer_config(&self) -> LayerConfig {
        LayerConfig {
            d_model: self.hidden_size,
            n_heads: self.num_attention_heads,
            n_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            d_ff: self.intermediate_size,
            rope_theta: self.rope_theta,
            eps: self.rms_norm_eps,
        }
    }

    /// `n_heads · head_dim`, the width of Q and of the attention output.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// `n_kv_heads · head_dim`, the width of K and V.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// RoPE inverse frequencies `θ^(-2i/head_dim)` for `i < head_dim/2`, with the
    /// scaling applied: what a rotation kernel needs per pair of dimensions.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        let base = (0..self.head_dim / 2).map(|i| self.rope_theta.powf(-((2 * i) as f64) / d));
        match &self.rope_scaling {
            None => base.collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let old = *original_max_position_embeddings as f64;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                base.map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
            }
        }
    }
}

/// Sampling defaults and special tokens, from the optional `generation_config.json`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct GenerationConfig {
    pub bos_token_id: Option<u32>,
    /// Every token that ends generation (the file gives one id or a list).
    #[serde(rename = "eos_token_id", default, deserialize_with = "one_or_many")]
    pub eos_token_ids: Vec<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
}

fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(u32),
        Many(Vec<u32>),
    }
    Ok(match Option::<OneOrMany>::deserialize(d)? {
        None => vec![],
        Some(OneOrMany::One(id)) => vec![id],
        Some(OneOrMany::Many(ids)) => ids,
    })
}

impl GenerationConfig {
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| Error::Checkpoint(format!("generation_config.json: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA31: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "torch_dtype": "bfloat16", "tie_word_embeddings": false
    }"#;

    #[test]
    fn llama31_maps_to_the_reference_layer() {
        let c = ModelConfig::from_json(LLAMA31).unwrap();
        assert_eq!(c.layer_config(), LayerConfig::default());
        assert_eq!(c.dtype, Some(WeightDType::BF16));
        assert!(!c.attention_bias && !c.tie_word_embeddings);
        assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0));
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_stretches_low_ones() {
        let c = ModelConfig::from_json(LLAMA31).unwrap();
        let plain = ModelConfig { rope_scaling: None, ..c.clone() }.rope_inv_freq();
        let scaled = c.rope_inv_freq();
        assert_eq!(scaled.len(), 64);
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-18);
        assert!(scaled.iter().zip(&plain).all(|(s, p)| s <= p && *s >= p / 8.0));
    }

    /// Against transformers' `_compute_llama3_parameters`, step by step: the plain
    /// frequencies, those past the low-frequency wavelength divided by the factor,
    /// then the medium band (neither below the high-frequency wavelength nor above
    /// the low one) blended by the smooth factor.
    #[test]
    fn llama31_inv_freq_follows_transformers() {
        let c = ModelConfig::from_json(LLAMA31).unwrap();
        assert_eq!((c.head_dim, c.rope_theta), (128, 500000.0));
        let (factor, low_ff, high_ff, old_ctx) = (8.0, 1.0, 4.0, 8192.0);
        let (low_wavelen, high_wavelen) = (old_ctx / low_ff, old_ctx / high_ff);
        let mut medium = Vec::new();
        let expected: Vec<f64> = (0..64)
            .map(|i| {
                let inv_freq = 1.0 / 500000f64.powf((2 * i) as f64 / 128.0);
                let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
                let llama = if wavelen > low_wavelen { inv_freq / factor } else { inv_freq };
                let smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff);
                let smoothed = (1.0 - smooth) * llama / factor + smooth * llama;
                // `~(wavelen < high) * ~(wavelen > low)` there; no NaN here.
                if wavelen >= high_wavelen && wavelen <= low_wavelen {
                    medium.push(i);
                    smoothed
                } else {
                    llama
                }
            })
            .collect();
        // Wavelengths 2π·500000^(i/64) cross 2048 after i = 28 and 8192 after i = 34.
        assert_eq!(medium, (29..=34).collect::<Vec<_>>());
        let got = c.rope_inv_freq();
        assert_eq!(got.len(), 64);
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert!((g - e).abs() <= 1e-12 * e, "inv_freq[{i}]: {g} vs {e}");
        }
        // The band is strictly between the kept and the stretched frequencies.
        let plain = ModelConfig { rope_scaling: None, ..c.clone() }.rope_inv_freq();
        for i in 29..=34 {
            assert!(got[i] < plain[i] && got[i] > plain[i] / factor, "inv_freq[{i}] outside the band");
        }
        assert_eq!(got[28], plain[28]);
        assert_eq!(got[35], plain[35] / factor);
    }

    #[test]
    fn defaults_fill_kv_heads_head_dim_and_theta() {
        let c = ModelConfig::from_json(
            r#"{"model_type": "mistral", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 2,
                "num_attention_heads": 16, "vocab_size": 100, "max_position_embeddings": 512, "rope_scaling": null}"#,
        )
        .unwrap();
        assert_eq!((c.num_key_value_heads, c.head_dim, c.rope_theta), (16, 64, 10000.0));
        assert_eq!((c.rope_scaling, c.sliding_window, c.dtype), (None, None, None));
    }

    #[test]
    fn generation_config_takes_one_eos_or_a_list() {
        let g = GenerationConfig::from_json(r#"{"bos_token_id": 1, "eos_token_id": [2, 7], "top_p": 0.9}"#).unwrap();
        assert_eq!((g.bos_token_id, g.eos_token_ids.as_slice(), g.top_p), (Some(1), &[2, 7][..], Some(0.9)));
        let g = GenerationConfig::from_json(r#"{"eos_token_id": 2, "temperature": 0.6, "top_k": 50}"#).unwrap();
        assert_eq!((g.eos_token_ids.as_slice(), g.temperature, g.top_k), (&[2][..], Some(0.6), Some(50)));
        assert!(GenerationConfig::from_json("{}").unwrap().eos_token_ids.is_empty());
    }
}
