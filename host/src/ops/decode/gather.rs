//! Rows of a layer's cache copied into contiguous K and V (`kv_gather`): the
//! keys FlashAttention reads for a prompt chunk whose sequence already holds
//! earlier chunks.

use super::batch::DecodeBatch;
use super::cache::{KvLayer, PagedKvCache};
use super::pages::SeqId;
use crate::error::{Error, Result};
use crate::ops::rope::TokenSlots;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;
use std::ops::Range;

/// Threads per `kv_gather` block (its launch bound), one 16-byte unit of K and of V each.
const GATHER_THREADS: u32 = crate::kernels::KV_GATHER.max_threads();

impl PagedKvCache {
    /// Copies positions `ranges[i]` of each `seqs[i]`, from layer `layer`'s
    /// pools, into `k_out` and `v_out` (`[Σ range lengths, n_kv_heads,
    /// head_dim]`, in that order), on the stream. Every range must lie inside
    /// its sequence; everything is checked before the launch.
    pub fn gather(
        &self,
        gpu: &Gpu,
        layer: usize,
        seqs: &[SeqId],
        ranges: &[Range<usize>],
        k_out: &mut Tensor<bf16>,
        v_out: &mut Tensor<bf16>,
    ) -> Result<()> {
        if seqs.len() != ranges.len() {
            return Err(Error::InvalidArgument(format!(
                "kv_gather: {} sequences, {} ranges",
                seqs.len(),
                ranges.len()
            )));
        }
        let (mut row, mut pos) = (Vec::new(), Vec::new());
        for (i, r) in ranges.iter().enumerate() {
            let to_u32 = |p: usize| u32::try_from(p).map_err(|_| Error::TooLarge(format!("kv_gather: position {p}")));
            row.extend(std::iter::repeat_n(to_u32(i)?, r.len()));
            pos.extend(r.clone().map(to_u32).collect::<Result<Vec<_>>>()?);
        }
        let layer = self.layer(layer)?;
        let batch = self.batch(gpu, seqs)?;
        let slots = TokenSlots::new(gpu, &row, &pos)?;
        gather_rows(gpu, layer, &batch, &slots, k_out, v_out)
    }
}

/// `kv_gather` of the rows `slots` names (each inside its sequence of `batch`,
/// which must be `cache`'s) into `k_out` and `v_out` (`[slots, n_kv_heads,
/// head_dim]`).
pub(crate) fn gather_rows(
    gpu: &Gpu,
    cache: KvLayer,
    batch: &DecodeBatch,
    slots: &TokenSlots,
    k_out: &mut Tensor<bf16>,
    v_out: &mut Tensor<bf16>,
) -> Result<()> {
    let op = "kv_gather";
    batch.check_cache(op, cache.id())?;
    let shape = [slots.len(), cache.n_kv_heads(), cache.head_dim()];
    crate::ops::same_shape(op, "k", &shape, k_out.shape())?;
    crate::ops::same_shape(op, "v", &shape, v_out.shape())?;
    slots.check(op, batch, usize::MAX)?;
    // head_dim is 64 or 128 (the cache checks it): whole 16-byte units.
    let row_units = cache.n_kv_heads() * cache.head_dim() / 8;
    let units = slots
        .len()
        .checked_mul(row_units)
        .filter(|&u| u <= (u32::MAX - GATHER_THREADS) as usize)
        .ok_or_else(|| Error::TooLarge(format!("{op}: {} rows of {row_units} units", slots.len())))?;
    let (k_pool, v_pool) = cache.pools();
    let (token_seq, token_pos) = slots.ptrs();
    let args = abi::KvGatherArgs {
        k_pool,
        v_pool,
        page_table: batch.page_table_ptr(),
        token_seq,
        token_pos,
        k_out: k_out.device_ptr(),
        v_out: v_out.device_ptr(),
        rows: slots.len() as u32,
        row_units: row_units as u32,
        page_size: cache.page_size() as u32,
        max_pages: batch.max_pages() as u32,
    };
    let blocks = (units as u32).div_ceil(GATHER_THREADS);
    // SAFETY: the batch is this cache's, and every row's position lies below
    // its sequence's length, so its page is one of the sequence's own (a page
    // of these pools); the outputs hold `rows × row_units` 16-byte units, and
    // the kernel's unit index stays within u32 (checked above).
    unsafe { gpu.launch(crate::kernels::KV_GATHER, (blocks, 1, 1), GATHER_THREADS, 0, &args) }
}
