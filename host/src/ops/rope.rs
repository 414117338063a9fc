//! RoPE on the fused QKV projection's output and the K/V write into the paged
//! cache, in one launch (`rope_qkv_cache`).

use super::decode::{upload_async, DecodeBatch, PagedKvCache};
use crate::error::{cuda, Error, Result};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use cust::memory::DeviceBuffer;
use half::bf16;

/// cos and sin of pos·θ^(−i/(d/2)) for every position below `max_pos`, computed
/// in f64 and stored as f32 `[max_pos, head_dim / 2]`.
pub struct RopeTable {
    cos: DeviceBuffer<f32>,
    sin: DeviceBuffer<f32>,
    max_pos: usize,
    head_dim: usize,
}

impl RopeTable {
    pub fn new(_gpu: &Gpu, head_dim: usize, theta: f64, max_pos: usize) -> Result<RopeTable> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) || max_pos == 0 || !(theta.is_finite() && theta > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "RoPE table: head_dim {head_dim}, θ {theta}, {max_pos} positions"
            )));
        }
        let half = head_dim / 2;
        let (mut cos, mut sin) = (Vec::with_capacity(max_pos * half), Vec::with_capacity(max_pos * half));
        for pos in 0..max_pos {
            for i in 0..half {
                let (s, c) = (pos as f64 * theta.powf(-(i as f64) / half as f64)).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        Ok(RopeTable {
            cos: DeviceBuffer::from_slice(&cos).map_err(cuda("cuMemcpyHtoD"))?,
            sin: DeviceBuffer::from_slice(&sin).map_err(cuda("cuMemcpyHtoD"))?,
            max_pos,
            head_dim,
        })
    }

    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    pub fn bytes(&self) -> usize {
        2 * self.cos.len() * 4
    }
}

/// Where each token of a launch goes: its row of the batch's page table and its
/// position in its sequence (device copies: buffers of its own, or fixed ones
/// that a captured graph reads).
pub(crate) struct TokenSlots {
    seq: u64,
    pos: u64,
    _owned: Option<(DeviceBuffer<u32>, DeviceBuffer<u32>)>,
    max_pos: usize,
    len: usize,
}

fn check_slots(seq: &[u32], pos: &[u32]) -> Result<()> {
    if seq.len() != pos.len() || seq.is_empty() {
        return Err(Error::Shape(format!("{} token rows, {} positions", seq.len(), pos.len())));
    }
    Ok(())
}

impl TokenSlots {
    pub(crate) fn new(_gpu: &Gpu, seq: &[u32], pos: &[u32]) -> Result<TokenSlots> {
        check_slots(seq, pos)?;
        let (s, p) = (
            DeviceBuffer::from_slice(seq).map_err(cuda("cuMemcpyHtoD"))?,
            DeviceBuffer::from_slice(pos).map_err(cuda("cuMemcpyHtoD"))?,
        );
        Ok(TokenSlots {
            seq: s.as_device_ptr().as_raw(),
            pos: p.as_device_ptr().as_raw(),
            _owned: Some((s, p)),
            max_pos: pos.iter().copied().max().unwrap_or(0) as usize,
            len: seq.len(),
        })
    }

    /// Into fixed buffers (`bufs.0` rows, `bufs.1` positions) by stream-ordered copies.
    pub(crate) fn into_buffers(
        gpu: &Gpu,
        seq: &[u32],
        pos: &[u32],
        bufs: &(DeviceBuffer<u32>, DeviceBuffer<u32>),
    ) -> Result<TokenSlots> {
        check_slots(seq, pos)?;
        upload_async(gpu, &bufs.0, seq)?;
        upload_async(gpu, &bufs.1, pos)?;
        Ok(TokenSlots {
            seq: bufs.0.as_device_ptr().as_raw(),
            pos: bufs.1.as_device_ptr().as_raw(),
            _owned: None,
            max_pos: pos.iter().copied().max().unwrap_or(0) as usize,
            len: seq.len(),
        })
    }
}

/// q_out = RoPE(q); the cache gets RoPE(k) and v at each token's slot; `kv_out`
/// (prefill) also gets them contiguously, `[tokens, n_kv_heads, head_dim]`.
/// `qkv` is `[tokens, (n_heads + 2·n_kv_heads)·head_dim]`. The caller has grown
/// the sequences, and `batch` lists their pages. With `qkv_sums` (from
/// [`linear_split_sums`](super::gemm::linear_split_sums), `[tokens, qkv width]`
/// f32) the inputs are those sums, which the kernel zeroes; `qkv` is then only
/// checked for its shape.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_kv_write(
    gpu: &Gpu,
    qkv: &Tensor<bf16>,
    table: &RopeTable,
    cache: &PagedKvCache,
    batch: &DecodeBatch,
    slots: &TokenSlots,
    q_out: &mut Tensor<bf16>,
    kv_out: Option<(&mut Tensor<bf16>, &mut Tensor<bf16>)>,
    qkv_sums: Option<u64>,
) -> Result<()> {
    let op = "rope_kv_write";
    let (kv, hd) = (cache.n_kv_heads(), cache.head_dim());
    let [t, h, d] = *q_out.shape() else {
        return Err(Error::Shape(format!("{op}: q_out must be [tokens, heads, head_dim]")));
    };
    if d != hd || hd != table.head_dim || h == 0 || !h.is_multiple_of(kv) || !hd.is_multiple_of(8) {
        return Err(Error::Shape(format!("{op}: q_out {:?} vs cache heads {kv} × {hd}", q_out.shape())));
    }
    super::same_shape(op, "qkv", &[t, (h + 2 * kv) * hd], qkv.shape())?;
    if slots.len != t {
        return Err(Error::Shape(format!("{op}: {} token slots for {t} tokens", slots.len)));
    }
    if slots.max_pos >= table.max_pos {
        return Err(Error::TooLarge(format!(
            "{op}: position {} past the RoPE table ({})",
            slots.max_pos, table.max_pos
        )));
    }
    let (k_out, v_out) = match kv_out {
        Some((k, v)) => {
            super::same_shape(op, "k_out", &[t, kv, hd], k.shape())?;
            super::same_shape(op, "v_out", &[t, kv, hd], v.shape())?;
            (k.device_ptr(), v.device_ptr())
        }
        None => (0, 0),
    };
    let (k_pool, v_pool) = cache.pools();
    let args = abi::RopeKvArgs {
        qkv: qkv.device_ptr(),
        q_out: q_out.device_ptr(),
        k_out,
        v_out,
        k_pool,
        v_pool,
        page_table: batch.page_table_ptr(),
        token_seq: slots.seq,
        token_pos: slots.pos,
        cos: table.cos.as_device_ptr().as_raw(),
        sin: table.sin.as_device_ptr().as_raw(),
        n_heads: h as u32,
        n_kv_heads: kv as u32,
        head_dim: hd as u32,
        page_size: cache.alloc.page_size() as u32,
        max_pages: batch.max_pages() as u32,
        _pad: 0,
        qkv_sums: qkv_sums.unwrap_or(0),
    };
    // SAFETY: shapes checked above; the caller grew every sequence to cover its
    // tokens' positions, so each slot's page is in the batch's table.
    // The kernel waits for earlier kernels before touching memory: it may overlap.
    // One thread per unit of a token's work (`abi::rope`).
    let grid = (t as u32, abi::rope::units(h, kv, hd).div_ceil(THREADS as usize) as u32, 1);
    unsafe { gpu.launch_after(crate::kernels::ROPE_QKV_CACHE, grid, THREADS, 0, &args) }
}

const THREADS: u32 = 128;
pub const KERNELS: &[(&str, u32)] = &[("rope_qkv_cache", THREADS)];
