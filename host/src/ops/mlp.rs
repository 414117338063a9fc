//! The SwiGLU MLP block of a Llama-style layer, with its weights resident on the GPU:
//! out = x + W_down · (SiLU(W_gate·n) ⊙ (W_up·n)), n = RMSNorm(x) (optional).
//! Two GEMM launches (plus the norm): the gate/up activations never reach HBM.

use super::gemm::{interleave_gate_up, linear_ex, Epilogue, GemmVersion, Overlap};
use super::rmsnorm::rms_norm;
use crate::error::{Error, Result};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;

pub struct SwiGluMlp {
    d: usize,
    ff: usize,
    /// [2·ff, d], gate and up rows interleaved.
    w_gate_up: Tensor<bf16>,
    /// [d, ff]
    w_down: Tensor<bf16>,
    norm: Option<(Tensor<bf16>, f32)>,
}

/// Activations the MLP needs between its launches, sized for `tokens`.
pub struct MlpScratch {
    normed: Tensor<bf16>,
    act: Tensor<bf16>,
}

impl MlpScratch {
    pub fn bytes(&self) -> usize {
        self.normed.size_bytes() + self.act.size_bytes()
    }

    pub fn new(gpu: &Gpu, mlp: &SwiGluMlp, tokens: usize) -> Result<MlpScratch> {
        Ok(MlpScratch {
            normed: Tensor::filled(gpu, &[tokens, mlp.d], bf16::ZERO)?,
            act: Tensor::filled(gpu, &[tokens, mlp.ff], bf16::ZERO)?,
        })
    }
}

impl SwiGluMlp {
    /// `w_gate`, `w_up`: `[ff, d]`; `w_down`: `[d, ff]` (Hugging Face layout);
    /// `norm`: the RMSNorm weight `[d]` and eps, or `None` to skip the norm.
    pub fn new(
        gpu: &Gpu,
        d: usize,
        ff: usize,
        w_gate: &[bf16],
        w_up: &[bf16],
        w_down: &[bf16],
        norm: Option<(&[bf16], f32)>,
    ) -> Result<SwiGluMlp> {
        if w_gate.len() != ff * d || w_down.len() != d * ff {
            return Err(Error::Shape(format!("MLP weights must be [{ff}, {d}] and [{d}, {ff}]")));
        }
        let gu = interleave_gate_up(w_gate, w_up, d)?;
        let norm = match norm {
            Some((w, eps)) => Some((Tensor::from_host(gpu, w, &[d])?, eps)),
            None => None,
        };
        Ok(SwiGluMlp {
            d,
            ff,
            w_gate_up: Tensor::from_host(gpu, &gu, &[2 * ff, d])?,
            w_down: Tensor::from_host(gpu, w_down, &[d, ff])?,
            norm,
        })
    }

    /// Bytes of everything resident: the three matrices and the norm weight.
    pub fn bytes(&self) -> usize {
        self.w_gate_up.size_bytes() + self.w_down.size_bytes() + self.norm.as_ref().map_or(0, |(w, _)| w.size_bytes())
    }

    /// Bytes of weights streamed per forward pass.
    pub fn weight_bytes(&self) -> usize {
        3 * self.d * self.ff * 2
    }

    /// out = x + MLP(x), for x `[tokens, d]` with scratch sized for `tokens`.
    pub fn forward(&self, gpu: &Gpu, x: &Tensor<bf16>, scratch: &mut MlpScratch, out: &mut Tensor<bf16>) -> Result<()> {
        self.forward_with(gpu, x, scratch, out, GemmVersion::Auto)
    }

    /// [`forward`](Self::forward) with both GEMMs on an explicit kernel version.
    pub fn forward_with(
        &self,
        gpu: &Gpu,
        x: &Tensor<bf16>,
        scratch: &mut MlpScratch,
        out: &mut Tensor<bf16>,
        version: GemmVersion,
    ) -> Result<()> {
        let input = match &self.norm {
            Some((w, eps)) => {
                rms_norm(gpu, x, w, *eps, &mut scratch.normed)?;
                &scratch.normed
            }
            None => x,
        };
        self.gemms(gpu, input, x, &mut scratch.act, out, version)
    }

    /// [`forward`](Self::forward) after the caller has put RMSNorm(x) (with this
    /// MLP's norm weight, [`norm`](Self::norm)) in `scratch`: the layer's decode
    /// step forms it in the launch that finishes the O projection.
    pub(crate) fn forward_prenormed(
        &self,
        gpu: &Gpu,
        x: &Tensor<bf16>,
        scratch: &mut MlpScratch,
        out: &mut Tensor<bf16>,
    ) -> Result<()> {
        self.gemms(gpu, &scratch.normed, x, &mut scratch.act, out, GemmVersion::Auto)
    }

    /// The norm weight and eps, if this MLP normalizes its input.
    pub fn norm(&self) -> Option<(&Tensor<bf16>, f32)> {
        self.norm.as_ref().map(|(w, eps)| (w, *eps))
    }

    /// Where the caller of [`forward_prenormed`](Self::forward_prenormed) writes
    /// the normalized input.
    pub(crate) fn normed_input(scratch: &mut MlpScratch) -> &mut Tensor<bf16> {
        &mut scratch.normed
    }

    fn gemms(
        &self,
        gpu: &Gpu,
        input: &Tensor<bf16>,
        x: &Tensor<bf16>,
        act: &mut Tensor<bf16>,
        out: &mut Tensor<bf16>,
        version: GemmVersion,
    ) -> Result<()> {
        // Both weights are the MLP's own: each GEMM may start loading them while
        // the kernel before it finishes.
        let resident = Overlap::ResidentWeights;
        // SAFETY: w_gate_up and w_down are written only by synchronous uploads in `new`.
        unsafe {
            linear_ex(gpu, input, &self.w_gate_up, None, act, Epilogue::SwiGlu, version, resident)?;
            linear_ex(gpu, act, &self.w_down, Some(x), out, Epilogue::Residual, version, resident)
        }
    }
}
