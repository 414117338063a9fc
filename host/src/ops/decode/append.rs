//! The K/V append of a decode step (`kv_append`): one new token per sequence,
//! whose K and V are already on the GPU.

use super::batch::{DecodeBatch, MAX_BATCH};
use super::cache::{KvLayer, PagedKvCache};
use super::pages::SeqId;
use crate::error::{Error, Result};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;

/// Threads per `kv_append` block (its launch bound), 16 bytes of K and of V each.
const APPEND_THREADS: u32 = crate::kernels::KV_APPEND.max_threads();

impl PagedKvCache {
    /// Grows each sequence by one token and writes its K and V (`[batch,
    /// n_kv_heads, head_dim]` on the GPU, after RoPE) into the cache; returns
    /// the grown sequences' batch. Every argument is checked first; if any
    /// sequence cannot grow, none does and nothing is launched.
    pub fn append(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        k_new: &Tensor<bf16>,
        v_new: &Tensor<bf16>,
    ) -> Result<DecodeBatch<'static>> {
        let op = "kv_append";
        if seqs.is_empty() || seqs.len() > MAX_BATCH {
            return Err(Error::InvalidArgument(format!("{op}: {} sequences (1 to {MAX_BATCH})", seqs.len())));
        }
        // Two rows for one sequence would both land on its new last position.
        if let Some(s) = seqs.iter().enumerate().find_map(|(i, s)| seqs[..i].contains(s).then_some(s)) {
            return Err(Error::InvalidArgument(format!("{op}: {s:?} appears twice")));
        }
        if self.layers() != 1 {
            return Err(Error::InvalidArgument(format!(
                "{op}: a cache of {} layers is filled by its model",
                self.layers()
            )));
        }
        let shape = [seqs.len(), self.n_kv_heads(), self.head_dim()];
        crate::ops::same_shape(op, "k", &shape, k_new.shape())?;
        crate::ops::same_shape(op, "v", &shape, v_new.shape())?;
        let batch = self.grow_one_each(gpu, seqs)?;
        let (k_pool, v_pool) = KvLayer::from(&*self).pools();
        let args = abi::KvAppendArgs {
            k_new: k_new.device_ptr(),
            v_new: v_new.device_ptr(),
            k_pool,
            v_pool,
            page_table: batch.page_table_ptr(),
            seq_lens: batch.seq_lens_ptr(),
            n_kv_heads: self.n_kv_heads() as u32,
            head_dim: self.head_dim() as u32,
            page_size: self.page_size() as u32,
            max_pages: batch.max_pages() as u32,
        };
        // SAFETY: the batch is this cache's, made after the growth: every length
        // is at least 1 and its last position's page is the sequence's own (a
        // page of these pools); k_new and v_new hold one [n_kv_heads, head_dim]
        // row per sequence, a multiple of 16 bytes (head_dim 64 or 128).
        let launched =
            unsafe { gpu.launch(crate::kernels::KV_APPEND, (seqs.len() as u32, 1, 1), APPEND_THREADS, 0, &args) };
        if let Err(e) = launched {
            self.undo_one_each(seqs);
            return Err(e);
        }
        Ok(batch)
    }
}
