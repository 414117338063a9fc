//! The SwiGLU MLP block of a Llama-style layer, with its weights resident on the GPU:
//! out = x + W_down · (SiLU(W_gate·n) ⊙ (W_up·n)), n = RMSNorm(x) (optional).
//! Two GEMM launches (plus the norm): the gate/up activations never reach HBM.
//! Every shape of the pass is checked, and both GEMMs prepared, before the first
//! launch.

#[cfg(feature = "dev")]
mod dev;

use super::gemm::{self, interleave_gate_up, Epilogue, GemmPlan, Overlap};
use super::rmsnorm::rms_norm;
use super::same_shape;
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
        self.normed.capacity_bytes() + self.act.capacity_bytes()
    }

    /// Shaped for `tokens`, at most the count it was made for.
    pub(crate) fn fit(&mut self, tokens: usize) -> Result<()> {
        let (d, ff) = (self.normed.shape()[1], self.act.shape()[1]);
        self.normed.refit(&[tokens, d])?;
        self.act.refit(&[tokens, ff])
    }

    pub fn new(gpu: &Gpu, mlp: &SwiGluMlp, tokens: usize) -> Result<MlpScratch> {
        Ok(MlpScratch {
            normed: Tensor::filled(gpu, &[tokens, mlp.d], bf16::ZERO)?,
            act: Tensor::filled(gpu, &[tokens, mlp.ff], bf16::ZERO)?,
        })
    }
}

/// Plans one GEMM from its (x, w, out, residual) shapes and epilogue: the
/// shipped `gemm::plan`, or a dev version's.
pub type GemmPlanner<'a> = &'a dyn Fn(&[usize], &[usize], &[usize], Option<&[usize]>, Epilogue) -> Result<GemmPlan>;

/// One forward pass's GEMMs, checked and sized.
#[derive(Clone, Debug, PartialEq)]
pub struct MlpPlan {
    pub gate_up: GemmPlan,
    pub down: GemmPlan,
}

/// Checks a forward pass of a `d` → `ff` → `d` MLP on x `[t, d]` with scratch
/// `normed` `[t, d]` and `act` `[t, ff]` into out `[t, d]`; `norm` is the norm's
/// weight shape and eps where the pass applies it. Pure: no GPU needed.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    d: usize,
    ff: usize,
    norm: Option<(&[usize], f32)>,
    x: &[usize],
    normed: &[usize],
    act: &[usize],
    out: &[usize],
    gemm_plan: GemmPlanner,
) -> Result<MlpPlan> {
    let op = "swiglu_mlp";
    let [t, dx] = *x else { return Err(Error::Shape(format!("{op}: x must be [tokens, {d}], got {x:?}"))) };
    if dx != d {
        return Err(Error::Shape(format!("{op}: x has {dx} features, the MLP {d}")));
    }
    same_shape(op, "output", x, out)?;
    same_shape(op, "scratch (normed input)", x, normed)?;
    same_shape(op, "scratch (activations)", &[t, ff], act)?;
    if let Some((w, eps)) = norm {
        super::rmsnorm::plan(x, w, normed, None, eps)?;
    }
    Ok(MlpPlan {
        gate_up: gemm_plan(normed, &[2 * ff, d], act, None, Epilogue::SwiGlu)?,
        down: gemm_plan(act, &[d, ff], out, Some(x), Epilogue::Residual)?,
    })
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
        if d.checked_mul(ff).is_none_or(|n| w_gate.len() != n || w_down.len() != n) {
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

    /// A block already on the GPU: `w_gate_up` `[2·ff, d]` with gate and up rows
    /// interleaved ([`interleave_gate_up`]), `w_down` `[d, ff]`.
    pub fn from_device(
        d: usize,
        ff: usize,
        w_gate_up: Tensor<bf16>,
        w_down: Tensor<bf16>,
        norm: Option<(Tensor<bf16>, f32)>,
    ) -> Result<SwiGluMlp> {
        same_shape("SwiGluMlp", "w_gate_up", &[2 * ff, d], w_gate_up.shape())?;
        same_shape("SwiGluMlp", "w_down", &[d, ff], w_down.shape())?;
        if let Some((w, _)) = &norm {
            same_shape("SwiGluMlp", "norm", &[d], w.shape())?;
        }
        Ok(SwiGluMlp { d, ff, w_gate_up, w_down, norm })
    }

    /// (d, ff).
    pub fn dims(&self) -> (usize, usize) {
        (self.d, self.ff)
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
        let (sm_count, arch) = (gpu.info().sm_count as usize, gpu.info().arch);
        self.run(gpu, x, scratch, out, false, false, &|x, w, o, r, ep| gemm::plan(x, w, o, r, ep, sm_count, arch))
            .map(|_| ())
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
        let (sm_count, arch) = (gpu.info().sm_count as usize, gpu.info().arch);
        self.run(gpu, x, scratch, out, true, false, &|x, w, o, r, ep| gemm::plan(x, w, o, r, ep, sm_count, arch))
            .map(|_| ())
    }

    /// [`forward_prenormed`](Self::forward_prenormed) whose down projection, where
    /// it splits K, leaves its f32 sums in the GEMM workspace for the caller to
    /// finish with the residual `x` (the model's next RMSNorm does, in one
    /// launch): returns their address, `out` unwritten. Elsewhere writes `out`
    /// as usual and returns None.
    ///
    /// # Safety
    /// When sums come back, the caller queues the launch that reads and zeroes
    /// them before any other use of the workspace, then calls
    /// [`split_sums_finished`](super::gemm::split_sums_finished).
    pub(crate) unsafe fn forward_prenormed_deferred(
        &self,
        gpu: &Gpu,
        x: &Tensor<bf16>,
        scratch: &mut MlpScratch,
        out: &mut Tensor<bf16>,
    ) -> Result<Option<u64>> {
        let (sm_count, arch) = (gpu.info().sm_count as usize, gpu.info().arch);
        self.run(gpu, x, scratch, out, true, true, &|x, w, o, r, ep| gemm::plan(x, w, o, r, ep, sm_count, arch))
    }

    /// The `[2·ff, d]` interleaved gate/up and `[d, ff]` down weights.
    #[cfg(feature = "dev")]
    pub(crate) fn weights(&self) -> (&Tensor<bf16>, &Tensor<bf16>) {
        (&self.w_gate_up, &self.w_down)
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

    /// Checks the pass, prepares both GEMMs, then launches: the norm (unless
    /// `prenormed`, or the MLP has none), gate/up with SwiGLU, down + residual
    /// (or, when `defer` and the down GEMM splits K, its sums left unfinished).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        gpu: &Gpu,
        x: &Tensor<bf16>,
        scratch: &mut MlpScratch,
        out: &mut Tensor<bf16>,
        prenormed: bool,
        defer: bool,
        gemm_plan: GemmPlanner,
    ) -> Result<Option<u64>> {
        let norm = self.norm.as_ref().filter(|_| !prenormed);
        let norm_shape = norm.map(|(w, eps)| (w.shape(), *eps));
        let (normed, act) = (&scratch.normed, &scratch.act);
        let p = plan(self.d, self.ff, norm_shape, x.shape(), normed.shape(), act.shape(), out.shape(), gemm_plan)?;
        // The gate/up GEMM reads the normalized input where there is one.
        let input = if prenormed || norm.is_some() { normed.device_ptr() } else { x.device_ptr() };
        // One workspace for both (it only grows), then everything their launches need.
        let workspace = p.gate_up.workspace_len().max(p.down.workspace_len());
        if workspace > 0 {
            gpu.zeroed_workspace_f32(workspace)?;
        }
        let (w_gu, w_down) = (self.w_gate_up.device_ptr(), self.w_down.device_ptr());
        let gate_up = gemm::prepare(gpu, p.gate_up, input, w_gu, act.device_ptr(), 0)?;
        let down_splits = p.down.tiles.leaves_sums();
        let down = gemm::prepare(gpu, p.down, act.device_ptr(), w_down, out.device_ptr(), x.device_ptr())?;
        if let Some((w, eps)) = norm {
            rms_norm(gpu, x, w, *eps, &mut scratch.normed)?;
        }
        // Both weights are the MLP's own: each GEMM may start loading them while
        // the kernel before it finishes.
        let resident = Overlap::ResidentWeights;
        // SAFETY: the plans were checked against these tensors, which outlive the
        // calls; w_gate_up and w_down are written only by synchronous uploads in `new`.
        unsafe {
            gemm::launch(gpu, &gate_up, resident, true)?;
            if defer && down_splits {
                return gemm::linear_split_sums(gpu, &scratch.act, &self.w_down, resident);
            }
            gemm::launch(gpu, &down, resident, true)?;
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::Arch;

    fn check(
        x: &[usize],
        normed: &[usize],
        act: &[usize],
        out: &[usize],
        norm: Option<(&[usize], f32)>,
    ) -> Result<MlpPlan> {
        plan(4096, 14336, norm, x, normed, act, out, &|x, w, o, r, ep| gemm::plan(x, w, o, r, ep, 132, Arch::Sm90a))
    }

    #[test]
    fn checks_every_shape_of_the_pass() {
        let (t, d, ff) = (16, 4096, 14336);
        let w = [d];
        let ok = check(&[t, d], &[t, d], &[t, ff], &[t, d], Some((&w, 1e-5))).unwrap();
        assert_eq!(ok.gate_up.tiles.name(), "gemm_bf16_skinny_k128");
        assert_eq!(
            (ok.down.tiles.name(), ok.down.m, ok.down.n, ok.down.k),
            ("gemm_bf16_skinny_k128_splitk", 16, 4096, 14336)
        );
        let shape = |r: Result<MlpPlan>| matches!(r, Err(Error::Shape(_)));
        // The output, the scratch, x, and the norm weight, each wrong on its own.
        assert!(shape(check(&[t, d], &[t, d], &[t, ff], &[t + 1, d], None)));
        assert!(shape(check(&[t, d], &[t, d], &[t, ff], &[t, d + 8], None)));
        assert!(shape(check(&[t, d], &[t + 1, d], &[t, ff], &[t, d], None)));
        assert!(shape(check(&[t, d], &[t, d], &[t + 1, ff], &[t, d], None)));
        assert!(shape(check(&[t, d + 8], &[t, d + 8], &[t, ff], &[t, d + 8], None)));
        assert!(shape(check(&[t, d, 1], &[t, d], &[t, ff], &[t, d], None)));
        assert!(shape(check(&[t, d], &[t, d], &[t, ff], &[t, d], Some((&[d + 1], 1e-5)))));
        assert!(matches!(check(&[t, d], &[t, d], &[t, ff], &[t, d], Some((&w, -1.0))), Err(Error::InvalidArgument(_))));
        assert!(matches!(check(&[0, d], &[0, d], &[0, ff], &[0, d], None), Err(Error::Empty(_))));
    }
}
