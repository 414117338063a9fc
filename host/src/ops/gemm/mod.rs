//! Linear layers on tensor cores: Y = X·Wᵀ with X `[M, K]`, W `[N, K]` (the
//! `nn.Linear` layout), bf16 in and out, f32 accumulation, and fused epilogues:
//! plain, residual add, and SwiGLU over interleaved gate/up weights.
//!
//! [`plan`] checks the tensors and picks the tile configuration (pure, CPU
//! tested); `prepare` resolves what the launch needs on the GPU (the split-K
//! workspace, TMA tensor maps) without launching; `launch` queues the kernel and
//! any `gemm_finalize`. An op checks and prepares every GEMM it runs before its
//! first launch.

mod cost;
#[cfg(feature = "dev")]
mod dev;
mod plan;

#[cfg(feature = "dev")]
pub use dev::{linear_ex_with, linear_with, plan_with, split_tail_stamps, BlockStamps, GemmVersion};
pub use plan::{auto_tiles, plan, Entry, GemmPlan, Schedule, Tiles, SHAPES_OF_EVERY_CONFIGURATION};

use crate::error::{Error, Result};
use crate::runtime::{Gpu, Kernel};
use crate::tensor::Tensor;
use crate::tensor_map::Bf16Box;
use abi::{epilogue, GemmArgs, GemmTmaArgs};
use half::bf16;

/// Whether a GEMM may overlap the kernel before it in the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlap {
    /// Plain stream order.
    None,
    /// `w` is resident (no kernel writes it): on Hopper the GEMM is launched as a
    /// programmatic dependent of the previous kernel, and its first weight tiles
    /// load while that kernel finishes; X is read only after it has completed.
    ResidentWeights,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    Plain,
    Residual,
    SwiGlu,
}

impl Epilogue {
    fn code(self) -> u32 {
        match self {
            Epilogue::Plain => epilogue::PLAIN,
            Epilogue::Residual => epilogue::RESIDUAL,
            Epilogue::SwiGlu => epilogue::SWIGLU,
        }
    }
}

/// A planned GEMM bound to its tensors, with the workspace and tensor maps its
/// launch needs already in place: nothing left that can refuse but the launch.
#[derive(Clone, Debug)]
pub(crate) struct Prepared {
    plan: GemmPlan,
    args: Args,
}

#[derive(Clone, Copy, Debug)]
enum Args {
    Mma(Kernel<GemmArgs>, GemmArgs),
    Tma(Kernel<GemmTmaArgs>, GemmTmaArgs),
}

impl Prepared {
    /// The split-K workspace's address (0 without one).
    fn workspace(&self) -> u64 {
        match self.args {
            Args::Mma(_, a) => a.workspace,
            Args::Tma(_, a) => a.gemm.workspace,
        }
    }
}

/// Binds plan `p` to device tensors `x` `[m, k]`, `w` `[n, k]`, `out` and
/// `residual` (0 for none; their shapes were checked by [`plan`]): takes the
/// split-K workspace and makes the TMA maps. Launches nothing.
pub(crate) fn prepare(gpu: &Gpu, p: GemmPlan, x: u64, w: u64, out: u64, residual: u64) -> Result<Prepared> {
    let optin = gpu.info().max_shared_per_block_optin;
    if p.smem > optin {
        return Err(Error::TooLarge(format!(
            "linear: {} needs {} bytes of shared memory per block; the device allows {optin}",
            p.tiles.name(),
            p.smem
        )));
    }
    let workspace = match p.split_tail_scratch_len() {
        0 if p.tiles.uses_workspace() => gpu.zeroed_workspace_f32(p.workspace_len())?,
        0 => 0,
        len => gpu.split_tail_scratch(len)?,
    };
    let gemm = GemmArgs {
        x,
        w,
        out,
        residual,
        m: p.m,
        n: p.n,
        k: p.k,
        epilogue: p.epilogue.code(),
        k_split: p.k_split,
        _pad: 0,
        workspace,
    };
    let args = match p.tiles.entry {
        Entry::Mma(kernel) => Args::Mma(kernel, gemm),
        Entry::Tma(kernel) => {
            let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
            let map_x = gpu.tensor_map(Bf16Box { ptr: x, rows: m, cols: k, box_rows: p.tiles.bm as u32 })?;
            let map_w = gpu.tensor_map(Bf16Box { ptr: w, rows: n, cols: k, box_rows: p.w_box_rows() })?;
            let box_rows = abi::gemm::tma_store::BOX_ROWS as u32;
            let (map_out, map_residual) = if p.tiles.stores_by_tma {
                let out_cols = if p.epilogue == Epilogue::SwiGlu { n / 2 } else { n };
                let map_out = gpu.tensor_map(Bf16Box { ptr: out, rows: m, cols: out_cols, box_rows })?;
                let map_residual = if p.epilogue == Epilogue::Residual {
                    gpu.tensor_map(Bf16Box { ptr: residual, rows: m, cols: n, box_rows })?
                } else {
                    0
                };
                (map_out, map_residual)
            } else {
                (0, 0)
            };
            Args::Tma(kernel, GemmTmaArgs { gemm, map_x, map_w, map_out, map_residual })
        }
    };
    Ok(Prepared { plan: p, args })
}

/// Queues a prepared GEMM, and with `finalize` the `gemm_finalize` of a kernel
/// that leaves its sums in the workspace. If the finalize cannot be launched, the
/// sums are marked for zeroing before the workspace's next use.
///
/// # Safety
/// The tensors `g` was prepared with must still be alive and hold their checked
/// shapes. With [`Overlap::ResidentWeights`], `w` must not be written by the
/// kernel queued just before (nor by any still running).
pub(crate) unsafe fn launch(gpu: &Gpu, g: &Prepared, overlap: Overlap, finalize: bool) -> Result<()> {
    let p = &g.plan;
    // Kernels that wait load W before `wait_for_prior_grids` and everything else
    // after it; the others run in plain stream order.
    let after = overlap == Overlap::ResidentWeights && p.tiles.waits;
    unsafe fn queue<A: abi::Params>(gpu: &Gpu, after: bool, kernel: Kernel<A>, p: &GemmPlan, args: &A) -> Result<()> {
        let (threads, smem) = (p.tiles.threads, p.smem);
        match (after, p.cluster()) {
            (true, 1) => gpu.launch_after(kernel, p.grid, threads, smem, args),
            (false, 1) => gpu.launch(kernel, p.grid, threads, smem, args),
            // Clusters wait for nothing; no more than fit at once (a second wave
            // of a persistent walk would run after the first).
            (_, c) => {
                let fit = gpu.max_active_clusters(kernel, p.grid, (c, 1, 1), threads, smem)?;
                let grid = (p.grid.0.min(c * fit.max(1)), p.grid.1, p.grid.2);
                gpu.with_programmatic_launch(false, || {
                    gpu.launch_cluster_after(kernel, grid, (c, 1, 1), threads, smem, args)
                })
            }
        }
    }
    let args = match g.args {
        Args::Tma(kernel, args) => queue(gpu, after, kernel, p, &args).map(|_| args.gemm),
        Args::Mma(kernel, args) => queue(gpu, after, kernel, p, &args).map(|_| args),
    }?;
    let Some(grid) = p.finalize_grid().filter(|_| finalize) else { return Ok(()) };
    // It waits for the split kernel before reading: always safe to overlap.
    let threads = abi::gemm::FINALIZE_THREADS as u32;
    let done = gpu.launch_after(crate::kernels::GEMM_FINALIZE, grid, threads, 0, &args);
    if done.is_err() {
        gpu.workspace_dirty(p.workspace_len());
    }
    done
}

/// [`plan`], [`prepare`] and [`launch`] for one GEMM on tensors.
///
/// # Safety
/// As [`linear_ex`].
unsafe fn run(
    gpu: &Gpu,
    p: GemmPlan,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    residual: Option<&Tensor<bf16>>,
    out: &mut Tensor<bf16>,
    overlap: Overlap,
) -> Result<()> {
    let r = residual.map_or(0, |r| r.device_ptr());
    let g = prepare(gpu, p, x.device_ptr(), w.device_ptr(), out.device_ptr(), r)?;
    launch(gpu, &g, overlap, true)
}

/// out = x·wᵀ through `ep` (`residual` for [`Epilogue::Residual`] only), with a
/// choice of [`Overlap`] with the previous kernel.
///
/// # Safety
/// With [`Overlap::ResidentWeights`], `w` must not be written by the kernel queued
/// just before this call on the GPU's stream (nor by any still running): the GEMM
/// may read it before that kernel has finished.
pub unsafe fn linear_ex(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    residual: Option<&Tensor<bf16>>,
    out: &mut Tensor<bf16>,
    ep: Epilogue,
    overlap: Overlap,
) -> Result<()> {
    let (sm_count, arch) = (gpu.info().sm_count as usize, gpu.info().arch);
    let p = plan(x.shape(), w.shape(), out.shape(), residual.map(|r| r.shape()), ep, sm_count, arch)?;
    run(gpu, p, x, w, residual, out, overlap)
}

/// out = x·wᵀ
pub fn linear(gpu: &Gpu, x: &Tensor<bf16>, w: &Tensor<bf16>, out: &mut Tensor<bf16>) -> Result<()> {
    // SAFETY: no overlap, plain stream order.
    unsafe { linear_ex(gpu, x, w, None, out, Epilogue::Plain, Overlap::None) }
}

/// out = residual + x·wᵀ (the O and down projections).
pub fn linear_residual(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    residual: &Tensor<bf16>,
    out: &mut Tensor<bf16>,
) -> Result<()> {
    // SAFETY: no overlap, plain stream order.
    unsafe { linear_ex(gpu, x, w, Some(residual), out, Epilogue::Residual, Overlap::None) }
}

/// out = SiLU(x·W_gateᵀ) ⊙ (x·W_upᵀ) from one GEMM over `w_gate_up`, whose rows
/// interleave gate and up (see [`interleave_gate_up`]); out is `[M, N/2]`.
pub fn linear_swiglu(gpu: &Gpu, x: &Tensor<bf16>, w_gate_up: &Tensor<bf16>, out: &mut Tensor<bf16>) -> Result<()> {
    // SAFETY: no overlap, plain stream order.
    unsafe { linear_ex(gpu, x, w_gate_up, None, out, Epilogue::SwiGlu, Overlap::None) }
}

/// The plan [`linear_split_sums`] launches for `x` × `wᵀ` (plain epilogue): its
/// tiles say whether it leaves split-K sums.
pub(crate) fn split_sums_plan(gpu: &Gpu, x: &[usize], w: &[usize]) -> Result<GemmPlan> {
    let out = [x.first().copied().unwrap_or(0), w.first().copied().unwrap_or(0)];
    plan(x, w, &out, None, Epilogue::Plain, gpu.info().sm_count as usize, gpu.info().arch)
}

/// x·wᵀ as split-K sums left in the GEMM workspace, for a kernel that finishes
/// them itself (the decode step's RoPE + KV write, the MLP's RMSNorm): where the
/// shipped plan splits K with a `gemm_finalize` launch, launches only the split
/// kernel and returns the workspace address of the `[m, n]` f32 sums, marked for
/// zeroing before the workspace's next use until [`split_sums_finished`]. Elsewhere
/// launches nothing and returns None.
///
/// # Safety
/// As [`linear_ex`]; and the caller's next launch must read all of the sums and
/// leave them zero, before any other GEMM runs.
pub(crate) unsafe fn linear_split_sums(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w: &Tensor<bf16>,
    overlap: Overlap,
) -> Result<Option<u64>> {
    let p = split_sums_plan(gpu, x.shape(), w.shape())?;
    if !p.tiles.leaves_sums() {
        return Ok(None);
    }
    let g = prepare(gpu, p, x.device_ptr(), w.device_ptr(), 0, 0)?;
    launch(gpu, &g, overlap, false)?;
    // Until the consumer is launched, a failure would leave the sums behind.
    gpu.workspace_dirty(g.plan.workspace_len());
    Ok(Some(g.workspace()))
}

/// The launch that finishes the last [`linear_split_sums`]' sums has been queued:
/// the workspace will be zero again.
///
/// # Safety
/// That launch reads and zeroes all of the sums, and nothing else marked the
/// workspace since [`linear_split_sums`] returned.
pub(crate) unsafe fn split_sums_finished(gpu: &Gpu) {
    gpu.workspace_clean();
}

/// Rows `[gate_0, up_0, gate_1, up_1, …]` from `[ff, d]` gate and up weights, so
/// every output tile holds matching gate/up pairs for the SwiGLU epilogue.
pub fn interleave_gate_up<T: Copy>(gate: &[T], up: &[T], d: usize) -> Result<Vec<T>> {
    if gate.len() != up.len() || d == 0 || !gate.len().is_multiple_of(d) {
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
    fn interleaves_rows() {
        assert_eq!(interleave_gate_up(&[1, 2, 3, 4], &[5, 6, 7, 8], 2).unwrap(), vec![1, 2, 5, 6, 3, 4, 7, 8]);
        assert!(interleave_gate_up(&[1, 2, 3], &[5, 6, 7, 8], 2).is_err());
    }
}
