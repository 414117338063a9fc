//! FlashAttention forward over packed variable-length sequences.
//!
//! Layout (row-major, what the fused layer's QKV projection writes):
//! - Q, O: `[total_q, n_heads, head_dim]`: token t, head h, element d at
//!   `(t·n_heads + h)·head_dim + d`.
//! - K, V: `[total_k, n_kv_heads, head_dim]`; query head h reads KV head
//!   `h / (n_heads / n_kv_heads)` (GQA/MQA).
//! - LSE: `[n_heads, total_q]` f32, natural log of each row's softmax denominator
//!   (scaled scores), -inf for a row that sees no key.
//!
//! The grid walks heads fastest, so the query heads of one KV group run side by
//! side and share each K/V tile through L2.

use crate::error::{cuda, Error, Result};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use crate::tensor_map::HeadsBox;
use cust::memory::DeviceBuffer;
use half::bf16;

const THREADS: u32 = 128;

/// Kernel versions, kept side by side for benchmarking (llm.c style).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashVersion {
    /// The shipped choice: [`FlashVersion::Hopper`] on sm_90a; elsewhere the
    /// fastest configuration that does not spill (V2Bn32 at head dim 64, V2Bn16
    /// at 128).
    Auto,
    /// 64 query rows per block, 16 per warp, Q in registers.
    V1,
    /// 128 query rows per block, 32 per warp, 64-key tiles.
    V2,
    /// As V2 with 32-key tiles.
    V2Bn32,
    /// As V2 with 16-key tiles (head dim 128): no spills, measured slower.
    V2Bn16,
    /// sm_90a only: 128 query rows, 128-key tiles by TMA, S = Q·Kᵀ on `wgmma`,
    /// P·V on mma.sync (`flash_hopper.rs`). Measured 1.15–1.47× FlashAttention-2
    /// at head dim 128 (docs/PERF.md).
    Hopper,
}

impl FlashVersion {
    /// The concrete version `Auto` stands for on `arch`.
    pub fn resolve(self, arch: crate::runtime::Arch) -> FlashVersion {
        match (self, arch) {
            (FlashVersion::Auto, crate::runtime::Arch::Sm90a) => FlashVersion::Hopper,
            _ => self,
        }
    }

    /// (kernel, query rows per block, keys per tile) for a head dim.
    fn kernel(self, d: usize) -> Option<(&'static str, usize, usize)> {
        Some(match (self, d) {
            (FlashVersion::V1, 64) => ("flash_fwd_hd64", 64, 64),
            (FlashVersion::V1, 128) => ("flash_fwd_hd128", 64, 64),
            (FlashVersion::V2, 64) => ("flash_fwd_v2_hd64", 128, 64),
            (FlashVersion::V2, 128) => ("flash_fwd_v2_hd128", 128, 64),
            (FlashVersion::V2Bn32, 128) => ("flash_fwd_v2_hd128_bn32", 128, 32),
            // The portable path ships only configurations that do not spill: on the
            // H200 they cost 3–7% against the spilling ones (docs/PERF.md).
            (FlashVersion::V2Bn32 | FlashVersion::Auto, 64) => ("flash_fwd_v2_hd64_bn32", 128, 32),
            (FlashVersion::V2Bn16 | FlashVersion::Auto, 128) => ("flash_fwd_v2_hd128_bn16", 128, 16),
            (FlashVersion::Hopper, 64) => ("flash_fwd_hopper_hd64", 128, 128),
            (FlashVersion::Hopper, 128) => ("flash_fwd_hopper_hd128", 128, 128),
            _ => return None,
        })
    }
}

/// Every attention kernel (for the PTX consistency test); all launch 128 threads.
pub const KERNELS: &[&str] = &[
    "flash_fwd_hd64",
    "flash_fwd_hd128",
    "flash_fwd_v2_hd64",
    "flash_fwd_v2_hd64_bn32",
    "flash_fwd_v2_hd128",
    "flash_fwd_v2_hd128_bn32",
    "flash_fwd_v2_hd128_bn16",
];

/// Cumulative sequence offsets of a packed batch, on the host (for validation and
/// grid sizing) and on the device (for the kernel).
pub struct VarlenBatch {
    cu_q: Vec<u32>,
    cu_k: Vec<u32>,
    dev_q: DeviceBuffer<u32>,
    dev_k: DeviceBuffer<u32>,
    max_q: usize,
}

impl VarlenBatch {
    /// Sequence i has `q_lens[i]` queries and `k_lens[i]` keys (equal for
    /// self-attention prefill; more keys when earlier tokens are cached).
    pub fn new(_gpu: &Gpu, q_lens: &[usize], k_lens: &[usize]) -> Result<VarlenBatch> {
        if q_lens.is_empty() || q_lens.len() != k_lens.len() {
            return Err(Error::Shape(format!("{} query lengths vs {} key lengths", q_lens.len(), k_lens.len())));
        }
        if q_lens.len() > 65535 {
            return Err(Error::TooLarge(format!("batch of {} sequences exceeds 65535", q_lens.len())));
        }
        let cumulative = |lens: &[usize]| -> Result<Vec<u32>> {
            let mut cu = vec![0u32];
            for &n in lens {
                let next = *cu.last().unwrap() as usize + n;
                if next > u32::MAX as usize / 2 {
                    return Err(Error::TooLarge(format!("{next} tokens in one batch")));
                }
                cu.push(next as u32);
            }
            Ok(cu)
        };
        let (cu_q, cu_k) = (cumulative(q_lens)?, cumulative(k_lens)?);
        let max_q = q_lens.iter().copied().max().unwrap_or(0);
        if max_q.div_ceil(64) > 65535 {
            return Err(Error::TooLarge(format!("sequence of {max_q} queries exceeds the grid")));
        }
        let dev_q = DeviceBuffer::from_slice(&cu_q).map_err(cuda("cuMemcpyHtoD"))?;
        let dev_k = DeviceBuffer::from_slice(&cu_k).map_err(cuda("cuMemcpyHtoD"))?;
        Ok(VarlenBatch { cu_q, cu_k, dev_q, dev_k, max_q })
    }

    pub fn total_q(&self) -> usize {
        *self.cu_q.last().unwrap() as usize
    }

    pub fn total_k(&self) -> usize {
        *self.cu_k.last().unwrap() as usize
    }

    pub fn batch(&self) -> usize {
        self.cu_q.len() - 1
    }

    pub fn q_range(&self, i: usize) -> std::ops::Range<usize> {
        self.cu_q[i] as usize..self.cu_q[i + 1] as usize
    }

    pub fn k_range(&self, i: usize) -> std::ops::Range<usize> {
        self.cu_k[i] as usize..self.cu_k[i + 1] as usize
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionOptions {
    pub causal: bool,
    /// Softmax scale; `None` means 1/√head_dim.
    pub scale: Option<f32>,
}

impl Default for AttentionOptions {
    fn default() -> Self {
        AttentionOptions { causal: true, scale: None }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct FlashPlan {
    pub kernel: &'static str,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub smem: u32,
    pub scale: f32,
    /// Loads through TMA tensor maps (`FlashTmaArgs`): the Hopper kernels.
    pub tma: bool,
    /// Query rows per block and keys per tile (the TMA boxes).
    pub block: (usize, usize),
}

/// The Hopper kernels: 256 threads; 1024 bytes align the swizzled tiles, 64 hold
/// the barriers.
const HOPPER_THREADS: u32 = 256;
const HOPPER_SMEM_SLACK: usize = 1024 + 64;

/// Validates shapes against the batch and picks the kernel. Pure: no GPU needed.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    q: &[usize],
    k: &[usize],
    v: &[usize],
    o: &[usize],
    lse: &[usize],
    total_q: usize,
    total_k: usize,
    batch: usize,
    max_q: usize,
    opts: AttentionOptions,
    version: FlashVersion,
) -> Result<FlashPlan> {
    let op = "flash_attention";
    let [tq, h, d] = *q else {
        return Err(Error::Shape(format!("{op}: q must be [tokens, heads, head_dim], got {q:?}")));
    };
    let [tk, hkv, dk] = *k else {
        return Err(Error::Shape(format!("{op}: k must be [tokens, kv_heads, head_dim], got {k:?}")));
    };
    super::same_shape(op, "v", k, v)?;
    super::same_shape(op, "output", q, o)?;
    super::same_shape(op, "lse", &[h, tq], lse)?;
    if tq != total_q || tk != total_k {
        return Err(Error::Shape(format!("{op}: batch holds {total_q} queries / {total_k} keys, tensors {tq} / {tk}")));
    }
    if dk != d {
        return Err(Error::Shape(format!("{op}: q head_dim {d} but k head_dim {dk}")));
    }
    if h == 0 || hkv == 0 || tq == 0 {
        return Err(Error::Empty(format!("{op}: q {q:?}, k {k:?}")));
    }
    if h % hkv != 0 {
        return Err(Error::Shape(format!("{op}: {h} query heads are not a multiple of {hkv} KV heads")));
    }
    if h > 65535 {
        return Err(Error::TooLarge(format!("{op}: {h} heads")));
    }
    if d != 64 && d != 128 {
        return Err(Error::Shape(format!("{op}: head_dim {d} is not supported (64 or 128)")));
    }
    let (kernel, block_m, block_n) = version
        .kernel(d)
        .ok_or_else(|| Error::InvalidArgument(format!("{op}: {version:?} has no kernel for head_dim {d}")))?;
    let scale = opts.scale.unwrap_or(1.0 / (d as f32).sqrt());
    if !scale.is_finite() || scale <= 0.0 {
        return Err(Error::InvalidArgument(format!("{op}: scale must be finite and positive, got {scale}")));
    }
    // Q tile + two stages of K and V tiles.
    let tiles = (block_m + 4 * block_n) * d * 2;
    let tma = version == FlashVersion::Hopper;
    let (threads, smem) = if tma { (HOPPER_THREADS, tiles + HOPPER_SMEM_SLACK) } else { (THREADS, tiles) };
    let grid = (h as u32, max_q.div_ceil(block_m).max(1) as u32, batch as u32);
    Ok(FlashPlan { kernel, grid, threads, smem: smem as u32, scale, tma, block: (block_m, block_n) })
}

/// O = softmax(scale·Q·Kᵀ + mask)·V per sequence and head, and each row's LSE.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention(
    gpu: &Gpu,
    q: &Tensor<bf16>,
    k: &Tensor<bf16>,
    v: &Tensor<bf16>,
    batch: &VarlenBatch,
    opts: AttentionOptions,
    o: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
) -> Result<()> {
    flash_attention_with(gpu, q, k, v, batch, opts, o, lse, FlashVersion::Auto)
}

/// [`flash_attention`] with an explicit kernel version.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_with(
    gpu: &Gpu,
    q: &Tensor<bf16>,
    k: &Tensor<bf16>,
    v: &Tensor<bf16>,
    batch: &VarlenBatch,
    opts: AttentionOptions,
    o: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
    version: FlashVersion,
) -> Result<()> {
    let version = version.resolve(gpu.info().arch);
    let p = plan(
        q.shape(),
        k.shape(),
        v.shape(),
        o.shape(),
        lse.shape(),
        batch.total_q(),
        batch.total_k(),
        batch.batch(),
        batch.max_q,
        opts,
        version,
    )?;
    let args = abi::FlashArgs {
        q: q.device_ptr(),
        k: k.device_ptr(),
        v: v.device_ptr(),
        o: o.device_ptr(),
        lse: lse.device_ptr(),
        cu_seqlens_q: batch.dev_q.as_device_ptr().as_raw(),
        cu_seqlens_k: batch.dev_k.as_device_ptr().as_raw(),
        n_heads: q.shape()[1] as u32,
        n_kv_heads: k.shape()[1] as u32,
        total_q: batch.total_q() as u32,
        causal: opts.causal as u32,
        scale_log2: p.scale * std::f32::consts::LOG2_E,
        _pad: 0,
    };
    if p.tma {
        if gpu.info().arch != crate::runtime::Arch::Sm90a {
            return Err(Error::InvalidArgument(format!(
                "flash_attention: {version:?} runs on sm_90a (H100/H200) only"
            )));
        }
        let (h, hkv, d) = (q.shape()[1], k.shape()[1], q.shape()[2]);
        let map = |ptr, tokens, heads, box_tokens| {
            gpu.heads_tensor_map(HeadsBox { ptr, tokens, heads, head_dim: d, box_tokens })
        };
        let (bm, bn) = (p.block.0 as u32, p.block.1 as u32);
        let args = abi::FlashTmaArgs {
            flash: args,
            map_q: map(q.device_ptr(), batch.total_q(), h, bm)?,
            map_k: map(k.device_ptr(), batch.total_k(), hkv, bn)?,
            map_v: map(v.device_ptr(), batch.total_k(), hkv, bn)?,
        };
        // SAFETY: as below; the maps cover exactly q, k and v.
        return unsafe { gpu.launch(crate::kernels::lookup(p.kernel)?, p.grid, p.threads, p.smem, &args) };
    }
    // SAFETY: shapes were checked against the batch offsets the kernel reads.
    unsafe { gpu.launch(crate::kernels::lookup(p.kernel)?, p.grid, p.threads, p.smem, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_for(q: &[usize], k: &[usize], lse: &[usize], opts: AttentionOptions) -> Result<FlashPlan> {
        plan(q, k, k, q, lse, q[0], k[0], 1, q[0], opts, FlashVersion::Auto)
    }

    #[test]
    fn picks_kernel_and_grid() {
        let p = plan_for(&[100, 32, 128], &[100, 8, 128], &[32, 100], AttentionOptions::default()).unwrap();
        assert_eq!(p.kernel, "flash_fwd_v2_hd128_bn16");
        assert_eq!(FlashVersion::Auto.resolve(crate::runtime::Arch::Sm90a), FlashVersion::Hopper);
        assert_eq!(p.grid, (32, 1, 1));
        assert!((p.scale - 128f32.sqrt().recip()).abs() < 1e-7);
    }

    #[test]
    fn rejects_bad_shapes() {
        let o = AttentionOptions::default();
        assert!(matches!(plan_for(&[10, 6, 128], &[10, 4, 128], &[6, 10], o), Err(Error::Shape(_))));
        assert!(matches!(plan_for(&[10, 4, 96], &[10, 4, 96], &[4, 10], o), Err(Error::Shape(_))));
        assert!(matches!(plan_for(&[10, 4, 64], &[10, 4, 64], &[4, 11], o), Err(Error::Shape(_))));
        assert!(matches!(plan_for(&[10, 4, 64], &[10, 4, 128], &[4, 10], o), Err(Error::Shape(_))));
        let bad_scale = AttentionOptions { scale: Some(f32::NAN), ..o };
        assert!(matches!(plan_for(&[10, 4, 64], &[10, 4, 64], &[4, 10], bad_scale), Err(Error::InvalidArgument(_))));
    }
}
