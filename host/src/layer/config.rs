//! Layer dimensions. The default is the reference layer (Llama-3-8B).

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct LayerConfig {
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub d_ff: usize,
    pub rope_theta: f64,
    pub eps: f32,
}

impl Default for LayerConfig {
    fn default() -> Self {
        LayerConfig {
            d_model: 4096,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            d_ff: 14336,
            rope_theta: 500000.0,
            eps: 1e-5,
        }
    }
}

impl LayerConfig {
    /// A small configuration with the same structure (GQA 4:1), for fast tests.
    pub fn small() -> Self {
        LayerConfig { d_model: 256, n_heads: 4, n_kv_heads: 1, head_dim: 64, d_ff: 688, ..Self::default() }
    }

    /// Checks what the kernels need: head dims 64/128, heads dividing evenly, and
    /// 16-byte rows for the GEMMs.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.head_dim != 64 && self.head_dim != 128 {
            return bad(format!("head_dim {} (64 or 128)", self.head_dim));
        }
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!("{} heads over {} KV heads", self.n_heads, self.n_kv_heads));
        }
        if !self.d_model.is_multiple_of(8) || !self.d_ff.is_multiple_of(8) || self.d_model == 0 || self.d_ff == 0 {
            return bad(format!("d_model {} and d_ff {} must be positive multiples of 8", self.d_model, self.d_ff));
        }
        if !(self.eps.is_finite() && self.eps >= 0.0 && self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("eps {} / rope_theta {}", self.eps, self.rope_theta));
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Applies `--name=value` flags (`--d-model`, `--heads`, `--kv-heads`,
    /// `--head-dim`, `--ffn`, `--rope-theta`, `--eps`); other arguments are left
    /// for the caller and returned.
    pub fn apply_flags(&mut self, args: &[String]) -> Result<Vec<String>> {
        let mut rest = Vec::new();
        for arg in args {
            let Some((key, value)) = arg.strip_prefix("--").and_then(|a| a.split_once('=')) else {
                rest.push(arg.clone());
                continue;
            };
            let int = || value.parse::<usize>().map_err(|_| Error::InvalidArgument(format!("{arg}: not an integer")));
            let float = || value.parse::<f64>().map_err(|_| Error::InvalidArgument(format!("{arg}: not a number")));
            match key {
                "d-model" => self.d_model = int()?,
                "heads" => self.n_heads = int()?,
                "kv-heads" => self.n_kv_heads = int()?,
                "head-dim" => self.head_dim = int()?,
                "ffn" => self.d_ff = int()?,
                "rope-theta" => self.rope_theta = float()?,
                "eps" => self.eps = float()? as f32,
                _ => rest.push(arg.clone()),
            }
        }
        self.validate()?;
        Ok(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_the_reference_layer_and_flags_override() {
        let mut c = LayerConfig::default();
        assert_eq!((c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff), (4096, 32, 8, 128, 14336));
        let rest = c.apply_flags(&["--heads=16".into(), "--kv-heads=4".into(), "prompt.txt".into()]).unwrap();
        assert_eq!((c.n_heads, c.n_kv_heads), (16, 4));
        assert_eq!(rest, vec!["prompt.txt".to_string()]);
        assert!(c.clone().apply_flags(&["--kv-heads=5".into()]).is_err());
        assert!(c.apply_flags(&["--head-dim=96".into()]).is_err());
    }
}
