//! RoPE on the fused QKV projection's output and the K/V write into the paged
//! cache, in one launch (`rope_qkv_cache`).

mod slots;

pub(crate) use slots::TokenSlots;

use crate::error::{cuda, Error, Result};
use crate::ops::decode::{DecodeBatch, KvLayer};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use cust::memory::DeviceBuffer;
use half::bf16;

/// cos and sin of pos·inv_freq\[i\] for every position below `max_pos` and
/// `i < head_dim / 2`, computed in f64 and stored as f32 `[max_pos, head_dim / 2]`.
pub struct RopeTable {
    cos: DeviceBuffer<f32>,
    sin: DeviceBuffer<f32>,
    max_pos: usize,
    head_dim: usize,
}

impl RopeTable {
    /// Plain RoPE: inv_freq\[i\] = θ^(−i/(head_dim/2)).
    pub fn new(gpu: &Gpu, head_dim: usize, theta: f64, max_pos: usize) -> Result<RopeTable> {
        if !(theta.is_finite() && theta > 0.0) {
            return Err(Error::InvalidArgument(format!("RoPE table: θ {theta}")));
        }
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = (0..half).map(|i| theta.powf(-(i as f64) / half as f64)).collect();
        Self::from_inv_freq(gpu, head_dim, &inv_freq, max_pos)
    }

    /// RoPE with explicit inverse frequencies, one per rotated pair (`head_dim / 2`,
    /// each finite and positive): scaled RoPE such as
    /// [`ModelConfig::rope_inv_freq`](crate::model::ModelConfig::rope_inv_freq).
    /// cos and sin are not multiplied by any attention factor (transformers'
    /// is 1 for plain and `llama3` RoPE).
    pub fn from_inv_freq(_gpu: &Gpu, head_dim: usize, inv_freq: &[f64], max_pos: usize) -> Result<RopeTable> {
        let (cos, sin) = table_values(head_dim, inv_freq, max_pos)?;
        let (cos, sin) = (
            DeviceBuffer::from_slice(&cos).map_err(cuda("cuMemcpyHtoD"))?,
            DeviceBuffer::from_slice(&sin).map_err(cuda("cuMemcpyHtoD"))?,
        );
        crate::tensor::uploaded()?;
        Ok(RopeTable { cos, sin, max_pos, head_dim })
    }

    /// Device addresses of the `[max_pos, head_dim/2]` f32 cos and sin tables.
    #[cfg(feature = "dev")]
    pub(crate) fn table_ptrs(&self) -> (u64, u64) {
        (self.cos.as_device_ptr().as_raw(), self.sin.as_device_ptr().as_raw())
    }

    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn bytes(&self) -> usize {
        2 * self.cos.len() * 4
    }
}

/// The checked arguments of [`RopeTable::from_inv_freq`] and its cos and sin,
/// `[max_pos, head_dim / 2]` each.
fn table_values(head_dim: usize, inv_freq: &[f64], max_pos: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let bad_freq = inv_freq.iter().any(|f| !(f.is_finite() && *f > 0.0));
    if head_dim == 0 || !head_dim.is_multiple_of(2) || max_pos == 0 || inv_freq.len() != head_dim / 2 || bad_freq {
        return Err(Error::InvalidArgument(format!(
            "RoPE table: head_dim {head_dim}, {} inverse frequencies{}, {max_pos} positions",
            inv_freq.len(),
            if bad_freq { " (not all finite and positive)" } else { "" }
        )));
    }
    let n = max_pos * inv_freq.len();
    let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for pos in 0..max_pos {
        for &f in inv_freq {
            let (s, c) = (pos as f64 * f).sin_cos();
            cos.push(c as f32);
            sin.push(s as f32);
        }
    }
    Ok((cos, sin))
}

/// Threads per block: one unit of a token's work each (`abi::rope`).
const THREADS: u32 = crate::kernels::ROPE_QKV_CACHE.max_threads();

/// A launch's checked geometry: tokens, query heads, KV heads, head dim.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Geometry {
    tokens: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Checks the tensors' shapes against a cache of `kv` KV heads of `hd` and a
/// table of `table_hd`: `q_out` `[tokens, heads, hd]`, `qkv` `[tokens, (heads +
/// 2·kv)·hd]`, `bias` `[(heads + 2·kv)·hd]`, `kv_out` `[tokens, kv, hd]` each;
/// heads a multiple of `kv`; hd a multiple of 8 (every access aligned) equal to
/// the table's.
fn check_shapes(
    op: &str,
    (kv, hd, table_hd): (usize, usize, usize),
    q_out: &[usize],
    qkv: &[usize],
    bias: Option<&[usize]>,
    kv_out: Option<(&[usize], &[usize])>,
) -> Result<Geometry> {
    let [t, h, d] = *q_out else {
        return Err(Error::Shape(format!("{op}: q_out must be [tokens, heads, head_dim], not {q_out:?}")));
    };
    if t == 0 || d != hd || hd != table_hd || h == 0 || kv == 0 || !h.is_multiple_of(kv) || !hd.is_multiple_of(8) {
        return Err(Error::Shape(format!(
            "{op}: q_out {q_out:?} vs cache heads {kv} × {hd} and a RoPE table for head_dim {table_hd}"
        )));
    }
    crate::ops::same_shape(op, "qkv", &[t, (h + 2 * kv) * hd], qkv)?;
    if let Some(b) = bias {
        crate::ops::same_shape(op, "bias", &[(h + 2 * kv) * hd], b)?;
    }
    if let Some((k, v)) = kv_out {
        crate::ops::same_shape(op, "k_out", &[t, kv, hd], k)?;
        crate::ops::same_shape(op, "v_out", &[t, kv, hd], v)?;
    }
    let g = Geometry { tokens: t, heads: h, kv_heads: kv, head_dim: hd };
    if t > i32::MAX as usize || grid(&g).1 > 65535 {
        return Err(Error::TooLarge(format!("{op}: {t} tokens of {h} + {kv} heads")));
    }
    Ok(g)
}

/// One block row per token, one thread per unit of its work (`abi::rope`).
fn grid(g: &Geometry) -> (u32, u32, u32) {
    let units = abi::rope::units(g.heads, g.kv_heads, g.head_dim);
    (g.tokens as u32, units.div_ceil(THREADS as usize) as u32, 1)
}

/// q_out = RoPE(q); the cache gets RoPE(k) and v at each token's slot; `kv_out`
/// (prefill) also gets them contiguously, `[tokens, n_kv_heads, head_dim]`.
/// `qkv` is `[tokens, (n_heads + 2·n_kv_heads)·head_dim]`; `bias` (Qwen2's QKV
/// projection bias), `[(n_heads + 2·n_kv_heads)·head_dim]`, is added to every
/// token's q, k and v before the rotation (rounded to bf16 once more: the
/// bf16 qkv is already a rounded product). Token i belongs to
/// the batch's sequence `seq[i]` at position `pos[i]`, below its length (the
/// caller has grown the sequences), and below the table's `max_pos`. `batch`
/// must come from `cache`. Every argument is checked before the launch.
#[allow(clippy::too_many_arguments)]
pub fn rope_qkv_cache<'c>(
    gpu: &Gpu,
    qkv: &Tensor<bf16>,
    bias: Option<&Tensor<bf16>>,
    table: &RopeTable,
    cache: impl Into<KvLayer<'c>>,
    batch: &DecodeBatch,
    seq: &[u32],
    pos: &[u32],
    q_out: &mut Tensor<bf16>,
    kv_out: Option<(&mut Tensor<bf16>, &mut Tensor<bf16>)>,
) -> Result<()> {
    let (cache, slots) = (cache.into(), TokenSlots::new(gpu, seq, pos)?);
    slots.check_unshared("rope_qkv_cache", batch, &cache)?;
    // SAFETY: no split-K sums.
    unsafe { rope_kv_write(gpu, qkv, bias, table, cache, batch, &slots, q_out, kv_out, None) }
}

/// Every check of [`rope_kv_write`], before anything is launched.
#[allow(clippy::too_many_arguments)]
fn check_args(
    qkv: &Tensor<bf16>,
    bias: Option<&Tensor<bf16>>,
    table: &RopeTable,
    cache: KvLayer,
    batch: &DecodeBatch,
    slots: &TokenSlots,
    q_out: &[usize],
    kv_out: Option<(&[usize], &[usize])>,
) -> Result<Geometry> {
    let op = "rope_qkv_cache";
    batch.check_cache(op, cache.id())?;
    let dims = (cache.n_kv_heads(), cache.head_dim(), table.head_dim);
    let g = check_shapes(op, dims, q_out, qkv.shape(), bias.map(|b| b.shape()), kv_out)?;
    if slots.len() != g.tokens {
        return Err(Error::Shape(format!("{op}: {} token slots for {} tokens", slots.len(), g.tokens)));
    }
    slots.check(op, batch, table.max_pos)?;
    Ok(g)
}

/// [`rope_qkv_cache`] with the token slots already on the GPU, and optionally
/// (`qkv_sums`, from [`linear_split_sums`](crate::ops::gemm::linear_split_sums))
/// the QKV projection's split-K sums as the input, which the kernel zeroes;
/// `qkv` is then only checked for its shape, and the bias is added to the f32
/// sums before their one rounding.
///
/// # Safety
/// `qkv_sums`, when given, must address `[tokens, qkv width]` f32 that stay
/// allocated until the launch has run, and that no other launch writes meanwhile.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rope_kv_write(
    gpu: &Gpu,
    qkv: &Tensor<bf16>,
    bias: Option<&Tensor<bf16>>,
    table: &RopeTable,
    cache: KvLayer,
    batch: &DecodeBatch,
    slots: &TokenSlots,
    q_out: &mut Tensor<bf16>,
    kv_out: Option<(&mut Tensor<bf16>, &mut Tensor<bf16>)>,
    qkv_sums: Option<u64>,
) -> Result<()> {
    let shapes = kv_out.as_ref().map(|(k, v)| (k.shape(), v.shape()));
    let g = check_args(qkv, bias, table, cache, batch, slots, q_out.shape(), shapes)?;
    let (k_out, v_out) = kv_out.map_or((0, 0), |(k, v)| (k.device_ptr(), v.device_ptr()));
    let (k_pool, v_pool) = cache.pools();
    let (token_seq, token_pos) = slots.ptrs();
    let args = abi::RopeKvArgs {
        qkv: qkv.device_ptr(),
        q_out: q_out.device_ptr(),
        k_out,
        v_out,
        k_pool,
        v_pool,
        page_table: batch.page_table_ptr(),
        token_seq,
        token_pos,
        cos: table.cos.as_device_ptr().as_raw(),
        sin: table.sin.as_device_ptr().as_raw(),
        n_heads: g.heads as u32,
        n_kv_heads: g.kv_heads as u32,
        head_dim: g.head_dim as u32,
        page_size: cache.page_size() as u32,
        max_pages: batch.max_pages() as u32,
        _pad: 0,
        qkv_sums: qkv_sums.unwrap_or(0),
        bias: bias.map_or(0, |b| b.device_ptr()),
    };
    // SAFETY: shapes (the bias's too) checked above; the batch is this cache's and every token's
    // row and position are inside it (so its page is one of these pools') and
    // inside the table; the sums are the caller's contract. The kernel waits for
    // earlier kernels before touching memory: it may overlap them.
    unsafe { gpu.launch_after(crate::kernels::ROPE_QKV_CACHE, grid(&g), THREADS, 0, &args) }
}

/// The QKV projection `x·w_qkvᵀ` and [`rope_qkv_cache`] as the layer's decode
/// step runs them: where the GEMM's plan splits K, the RoPE kernel finishes the
/// split-K sums itself (the bias added before their one rounding) and `qkv` is
/// left alone; elsewhere `qkv` gets the projection and the RoPE reads it.
/// Returns whether the sums path ran. For tests of that path.
#[cfg(feature = "dev")]
#[allow(clippy::too_many_arguments)]
pub fn linear_rope_qkv_cache<'c>(
    gpu: &Gpu,
    x: &Tensor<bf16>,
    w_qkv: &Tensor<bf16>,
    bias: Option<&Tensor<bf16>>,
    qkv: &mut Tensor<bf16>,
    table: &RopeTable,
    cache: impl Into<KvLayer<'c>>,
    batch: &DecodeBatch,
    seq: &[u32],
    pos: &[u32],
    q_out: &mut Tensor<bf16>,
    kv_out: Option<(&mut Tensor<bf16>, &mut Tensor<bf16>)>,
) -> Result<bool> {
    let cache = cache.into();
    use crate::ops::gemm::{linear_ex, linear_split_sums, plan, split_sums_finished, Epilogue, Overlap};
    let slots = TokenSlots::new(gpu, seq, pos)?;
    slots.check_unshared("linear_rope_qkv_cache", batch, &cache)?;
    // The sums are `[x rows, w rows]`: the RoPE reads them as `qkv`'s shape.
    let rows = |t: &Tensor<bf16>| t.shape().first().copied().unwrap_or(0);
    crate::ops::same_shape("linear_rope_qkv_cache", "qkv", &[rows(x), rows(w_qkv)], qkv.shape())?;
    let info = gpu.info();
    plan(x.shape(), w_qkv.shape(), qkv.shape(), None, Epilogue::Plain, info.sm_count as usize, info.arch)?;
    let shapes = kv_out.as_ref().map(|(k, v)| (k.shape(), v.shape()));
    check_args(qkv, bias, table, cache, batch, &slots, q_out.shape(), shapes)?;
    // SAFETY: every argument is checked above; plain stream order; the sums are
    // `qkv`'s shape, and the RoPE launch right after reads and zeroes them.
    unsafe {
        let sums = linear_split_sums(gpu, x, w_qkv, Overlap::None)?;
        if sums.is_none() {
            linear_ex(gpu, x, w_qkv, None, qkv, Epilogue::Plain, Overlap::None)?;
        }
        rope_kv_write(gpu, qkv, bias, table, cache, batch, &slots, q_out, kv_out, sums)?;
        if sums.is_some() {
            split_sums_finished(gpu);
        }
        Ok(sums.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_every_shape() {
        let dims = (8, 128, 128);
        let g = check_shapes("op", dims, &[5, 32, 128], &[5, 48 * 128], None, None).unwrap();
        assert_eq!(g, Geometry { tokens: 5, heads: 32, kv_heads: 8, head_dim: 128 });
        assert_eq!(grid(&g), (5, (40 * 64 / 4 + 8 * 16usize).div_ceil(128) as u32, 1));
        let (k, v) = ([5usize, 8, 128], [5usize, 8, 128]);
        assert!(check_shapes("op", dims, &[5, 32, 128], &[5, 48 * 128], Some(&[48 * 128]), Some((&k, &v))).is_ok());
        let bad = |dims, q: &[usize], qkv: &[usize], kv: Option<(&[usize], &[usize])>| {
            matches!(check_shapes("op", dims, q, qkv, None, kv), Err(Error::Shape(_)))
        };
        assert!(bad(dims, &[5, 32], &[5, 48 * 128], None));
        assert!(bad(dims, &[0, 32, 128], &[0, 48 * 128], None));
        assert!(bad(dims, &[5, 12, 128], &[5, 28 * 128], None));
        assert!(bad(dims, &[5, 32, 64], &[5, 48 * 64], None));
        assert!(bad((8, 128, 64), &[5, 32, 128], &[5, 48 * 128], None));
        assert!(bad(dims, &[5, 32, 128], &[5, 47 * 128], None));
        assert!(bad(dims, &[5, 32, 128], &[5, 48 * 128], Some((&[5, 8, 64], &v))));
        assert!(bad(dims, &[5, 32, 128], &[5, 48 * 128], Some((&k, &[4, 8, 128]))));
        let bad_bias = |b: &[usize]| {
            matches!(check_shapes("op", dims, &[5, 32, 128], &[5, 48 * 128], Some(b), None), Err(Error::Shape(_)))
        };
        assert!(bad_bias(&[47 * 128]) && bad_bias(&[1, 48 * 128]) && bad_bias(&[40 * 128]));
    }

    #[test]
    fn table_rotates_each_pair_by_its_own_frequency() {
        let inv_freq = [1.0, 0.25, 1e-3, 0.5];
        let (cos, sin) = table_values(8, &inv_freq, 3).unwrap();
        assert_eq!((cos.len(), sin.len()), (12, 12));
        for pos in 0..3 {
            for (i, f) in inv_freq.iter().enumerate() {
                let (s, c) = (pos as f64 * f).sin_cos();
                assert_eq!((cos[pos * 4 + i], sin[pos * 4 + i]), (c as f32, s as f32));
            }
        }
        let bad = |hd, f: &[f64], max_pos| matches!(table_values(hd, f, max_pos), Err(Error::InvalidArgument(_)));
        assert!(bad(8, &inv_freq[..3], 3) && bad(6, &inv_freq, 3) && bad(8, &inv_freq, 0) && bad(0, &[], 3));
        assert!(bad(8, &[1.0, 0.0, 1.0, 1.0], 3) && bad(8, &[1.0, -1.0, 1.0, 1.0], 3));
        assert!(bad(8, &[1.0, f64::NAN, 1.0, 1.0], 3) && bad(8, &[f64::INFINITY, 1.0, 1.0, 1.0], 3));
    }
}
