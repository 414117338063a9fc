//! Linear layers on tensor cores: Y = X·Wᵀ with X `[M, K]`, W `[N, K]` (the
//! `nn.Linear` layout), bf16 in and out, f32 accumulation, and fused epilogues:
//! plain, residual add, and SwiGLU over interleaved gate/up weights.

use crate::error::{Error, Result};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use abi::epilogue;
use half::bf16;

const BLOCK: usize = 128;
const THREADS: u32 = 128;
const SMEM: u32 = 3 * (128 + 128) * 64 * 2;
pub const KERNEL: &str = "gemm_bf16_v1";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    Plain,
    Residual,
    SwiGlu,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GemmPlan {
    pub grid: (u32, u32, u32),
    pub m: u32,
    pub n: u32,
    pub k: u32,
}

/// Validates a GEMM and its epilogue's tensors. Pure: no GPU needed.
pub fn plan(x: &[usize], w: &[usize], out: &[usize], residual: Option<&[usize]>, ep: Epilogue) -> Result<GemmPlan> {
    let op = "linear";
    let [m, k] = *x else { return Err(Error::Shape(format!("{op}: x must be [tokens, d_in], got {x:?}"))) };
    let [n, kw] = *w else { return Err(Error::Shape(format!("{op}: w must be [d_out, d_in], got {w:?}"))) };
    if k != kw {
        return Err(Error::Shape(format!("{op}: x has d_in {k}, w has {kw}")));
    }
    if m == 0 || n == 0 || k == 0 {
        return Err(Error::Empty(format!("{op}: x {x:?}, w {w:?}")));
    }
    if k % 8 != 0 {
        return Err(Error::Alignment(format!("{op}: d_in {k} must be a multiple of 8 (16-byte rows)")));
    }
    if n % 2 != 0 {
        return Err(Error::Alignment(format!("{op}: d_out {n} must be even (paired bf16 stores)")));
    }
    let out_cols = if ep == Epilogue::SwiGlu { n / 2 } else { n };
    super::same_shape(op, "output", &[m, out_cols], out)?;
    match (ep, residual) {
        (Epilogue::Residual, Some(r)) => super::same_shape(op, "residual", &[m, n], r)?,
        (Epilogue::Residual, None) => {
            return Err(Error::InvalidArgument(format!("{op}: residual epilogue needs a residual")))
        }
        _ => {}
    }
    let limit = u32::MAX as usize / 2;
    if m > 65535 * BLOCK || n > limit || k > limit || m.checked_mul(k).is_none_or(|e| e > isize::MAX as usize / 2) {
        return Err(Error::TooLarge(format!("{op}: [{m}, {k}] × [{n}, {k}]")));
    }
    Ok(GemmPlan {
        grid: (n.div_ceil(BLOCK) as u32, m.div_ceil(BLOCK) as u32, 1),
        m: m as u32,
        n: n as u32,
        k: k as u32,
    })
}

fn launch(gpu: &Gpu, p: &GemmPlan, x: u64, w: u64, out: u64, residual: u64, ep: Epilogue) -> Result<()> {
    let args = abi::GemmArgs {
        x,
        w,
        out,
        residual,
        m: p.m,
        n: p.n,
        k: p.k,
        epilogue: match ep {
            Epilogue::Plain => epilogue::PLAIN,
            Epilogue::Residual => epilogue::RESIDUAL,
            Epilogue::SwiGlu => epilogue::SWIGLU,
        },
    };
    // SAFETY: plan() checked every tensor against m, n, k and the epilogue.
    unsafe { gpu.launch(KERNEL, p.grid, THREADS, SMEM, &args) }
}

/// out = x·wᵀ
pub fn linear(gpu: &Gpu, x: &Tensor<bf16>, w: &Tensor<bf16>, out: &mut Tensor<bf16>) -> Result<()> {
    let p = plan(x.shape(), w.shape(), out.shape(), None, Epilogue::Plain)?;
    launch(gpu, &p, x.device_ptr(), w.device_ptr(), out.device_ptr(), 0, Epilogue::Plain)
}

/// out = residual + x·wᵀ (the O and down projections).
pub fn linear_residual(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    residual: &Tensor<bf16>,
    out: &mut Tensor<bf16>,
) -> Result<()> {
    let p = plan(x.shape(), w.shape(), out.shape(), Some(residual.shape()), Epilogue::Residual)?;
    launch(gpu, &p, x.device_ptr(), w.device_ptr(), out.device_ptr(), residual.device_ptr(), Epilogue::Residual)
}

/// out = SiLU(x·W_gateᵀ) ⊙ (x·W_upᵀ) from one GEMM over `w_gate_up`, whose rows
/// interleave gate and up (see [`interleave_gate_up`]); out is `[M, N/2]`.
pub fn linear_swiglu(gpu: &Gpu, x: &Tensor<bf16>, w_gate_up: &Tensor<bf16>, out: &mut Tensor<bf16>) -> Result<()> {
    let p = plan(x.shape(), w_gate_up.shape(), out.shape(), None, Epilogue::SwiGlu)?;
    launch(gpu, &p, x.device_ptr(), w_gate_up.device_ptr(), out.device_ptr(), 0, Epilogue::SwiGlu)
}

/// Rows `[gate_0, up_0, gate_1, up_1, …]` from `[ff, d]` gate and up weights, so
/// every output tile holds matching gate/up pairs for the SwiGLU epilogue.
pub fn interleave_gate_up<T: Copy>(gate: &[T], up: &[T], d: usize) -> Result<Vec<T>> {
    if gate.len() != up.len() || d == 0 || gate.len() % d != 0 {
        return Err(Error::Shape(format!("gate ({}) and up ({}) must both be [ff, {d}]", gate.len(), up.len())));
    }
    let mut out = Vec::with_capacity(2 * gate.len());
    for (g, u) in gate.chunks(d).zip(up.chunks(d)) {
        out.extend_from_slice(g);
        out.extend_from_slice(u);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_shapes_and_alignment() {
        assert_eq!(plan(&[3, 72], &[100, 72], &[3, 100], None, Epilogue::Plain).unwrap().grid, (1, 1, 1));
        assert_eq!(
            plan(&[2049, 4096], &[28672, 4096], &[2049, 14336], None, Epilogue::SwiGlu).unwrap().grid,
            (224, 17, 1)
        );
        assert!(matches!(plan(&[3, 70], &[100, 70], &[3, 100], None, Epilogue::Plain), Err(Error::Alignment(_))));
        assert!(matches!(plan(&[3, 72], &[101, 72], &[3, 101], None, Epilogue::Plain), Err(Error::Alignment(_))));
        assert!(matches!(plan(&[3, 72], &[100, 64], &[3, 100], None, Epilogue::Plain), Err(Error::Shape(_))));
        assert!(matches!(plan(&[3, 72], &[100, 72], &[3, 100], None, Epilogue::SwiGlu), Err(Error::Shape(_))));
        assert!(matches!(
            plan(&[3, 72], &[100, 72], &[3, 100], None, Epilogue::Residual),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(plan(&[0, 72], &[100, 72], &[0, 100], None, Epilogue::Plain), Err(Error::Empty(_))));
    }

    #[test]
    fn interleaves_rows() {
        assert_eq!(interleave_gate_up(&[1, 2, 3, 4], &[5, 6, 7, 8], 2).unwrap(), vec![1, 2, 5, 6, 3, 4, 7, 8]);
        assert!(interleave_gate_up(&[1, 2, 3], &[5, 6, 7, 8], 2).is_err());
    }
}
