//! Decode attention over a paged KV cache in HBM (PagedAttention layout,
//! Flash-Decoding split-KV).
//!
//! - [`PageAllocator`] (`pages`): host-side bookkeeping: a free list of pages,
//!   each sequence owns a list of them; growth is all-or-nothing.
//! - [`PagedKvCache`] (`cache`): one layer's K and V pools, `[num_pages,
//!   page_size, n_kv_heads, head_dim]` bf16, plus its allocator; `append` writes
//!   a step's new K and V (`kv_append`), and `gather` copies rows of it into
//!   contiguous K and V (`kv_gather`) for a prompt chunk's attention.
//! - [`DecodeBatch`] (`batch`): a set of sequences' page tables and lengths on
//!   the GPU, tied to the cache it came from and to the buffers it lives in.
//! - [`decode_attention`]: one query per sequence (`q: [batch, n_heads,
//!   head_dim]`), or up to [`MAX_Q_LEN`] (speculative decoding, `[batch, q_len,
//!   n_heads, head_dim]`, causal among them), against each sequence's whole
//!   cache; splits chosen so the GPU is full even at batch 1 (`plan`), merged
//!   exactly by log-sum-exp: by 4-warp blocks in the same launch where they
//!   apply, else by `decode_merge`.
//!
//! With the `dev` feature, `dev` holds the versions kept for comparison
//! (`DecodeVersion`, `decode_attention_with`).

mod append;
mod batch;
mod cache;
#[cfg(feature = "dev")]
mod dev;
mod gather;
mod pages;
mod plan;

pub use abi::decode::MAX_Q_LEN;
pub(crate) use batch::{upload_async, Tables};
pub use batch::{BatchBuffers, DecodeBatch, MAX_BATCH};
pub use cache::{KvLayer, PagedKvCache, MAX_POOL_BYTES};
#[cfg(feature = "dev")]
pub use dev::{cluster_capacity, decode_attention_with, DecodeVersion};
pub(crate) use gather::{expand as expand_runs, gather_rows, GatherRows, Run};
pub use pages::{PageAllocator, SeqId};
pub use plan::{choose_splits, choose_splits_waves};

use crate::error::Result;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;
use plan::{Geometry, Operands, Plan};

/// out[b, h] = softmax(scale · q[b, h] · K_bᵀ) · V_b over each sequence's cache,
/// and each row's LSE. `q`, `out`: `[batch, heads, head_dim]` with `lse`
/// `[batch, heads]`; or, for speculative decoding, `[batch, q_len, heads,
/// head_dim]` with `lse` `[batch, q_len, heads]` (q_len ≤ [`MAX_Q_LEN`]): the
/// q_len queries are each sequence's last q_len positions (already in the cache),
/// and query i sees the keys up to its own position. `scale` defaults to
/// 1/√head_dim. `batch` must come from `cache` ([`Error::ForeignBatch`]
/// otherwise); every argument is checked before anything is launched.
///
/// [`Error::ForeignBatch`]: crate::Error::ForeignBatch
pub fn decode_attention<'c>(
    gpu: &Gpu,
    cache: impl Into<KvLayer<'c>>,
    batch: &DecodeBatch,
    q: &Tensor<bf16>,
    scale: Option<f32>,
    out: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
) -> Result<()> {
    let cache = cache.into();
    let g = check(cache, batch, q, out, lse, scale)?;
    let schedule = plan::auto_schedule(&g, gpu.info().max_shared_per_block_optin);
    let per_sm = gpu.occupancy(schedule.kernel, schedule.threads(), schedule.smem(g.head_dim))?.max(1);
    let p = plan::plan(&g, schedule, batch.plan_len(), gpu.info().sm_count as usize, per_sm as usize)?;
    launch(gpu, cache, batch, q, out, lse, &g, &p)
}

/// [`plan::check`] on a call's tensors.
fn check(
    cache: KvLayer,
    batch: &DecodeBatch,
    q: &Tensor<bf16>,
    out: &Tensor<bf16>,
    lse: &Tensor<f32>,
    scale: Option<f32>,
) -> Result<Geometry> {
    let o = Operands {
        same_cache: batch.cache_id() == cache.id(),
        n_kv_heads: cache.n_kv_heads(),
        head_dim: cache.head_dim(),
        batch: batch.batch(),
        min_len: batch.min_len(),
    };
    plan::check("decode_attention", &o, q.shape(), out.shape(), lse.shape(), scale)
}

/// The split kernel's parameters for `p`, with the partials and counters at
/// `partials` and `counters`.
#[allow(clippy::too_many_arguments)]
fn args(
    cache: KvLayer,
    batch: &DecodeBatch,
    q: &Tensor<bf16>,
    out: &Tensor<bf16>,
    lse: &Tensor<f32>,
    g: &Geometry,
    p: &Plan,
    partials: u64,
    counters: u64,
) -> abi::DecodeArgs {
    let (k_pool, v_pool) = cache.pools();
    abi::DecodeArgs {
        q: q.device_ptr(),
        k_pool,
        v_pool,
        page_table: batch.page_table_ptr(),
        seq_lens: batch.seq_lens_ptr(),
        o_partial: partials,
        lse_partial: partials + (p.partial_rows * g.head_dim * 4) as u64,
        out: out.device_ptr(),
        lse: lse.device_ptr(),
        n_heads: g.heads as u32,
        n_kv_heads: g.kv_heads as u32,
        page_size: cache.page_size() as u32,
        max_pages: batch.max_pages() as u32,
        chunk: p.chunk as u32,
        splits: p.splits as u32,
        scale_log2: g.scale_log2,
        q_len: g.q_len as u32,
        group: g.group as u32,
        page_shift: plan::page_shift(cache.page_size()),
        counters,
    }
}

/// Launches `p` (checked by [`check`] against these very operands, sized by
/// [`plan::plan`]): the split kernel, then `decode_merge` unless it merges itself.
#[allow(clippy::too_many_arguments)]
fn launch(
    gpu: &Gpu,
    cache: KvLayer,
    batch: &DecodeBatch,
    q: &Tensor<bf16>,
    out: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
    g: &Geometry,
    p: &Plan,
) -> Result<()> {
    let partials = cache.partials(p.partial_floats(g.head_dim))?;
    let counters = if p.schedule.fused { cache.counters(p.counters)? } else { 0 };
    let a = args(cache, batch, q, out, lse, g, p, partials, counters);
    let (threads, smem) = (p.schedule.threads(), p.schedule.smem(g.head_dim));
    // SAFETY: `batch` is `cache`'s (checked), so its page tables list only pages of
    // these pools, each length covered by its sequence's pages, rows of
    // max_pages entries for batch sequences, in live buffers the batch owns or
    // borrows; q, out and lse have the checked shapes; partials hold rows ×
    // (d + 1) f32 and the counters (fused) batch × x_blocks zero u32; with
    // q_len > 1 every sequence holds at least q_len tokens. Both kernels wait
    // for earlier kernels before touching memory: they may overlap them.
    unsafe {
        gpu.launch_after(p.schedule.kernel, p.grid, threads, smem, &a)?;
        if let Some((grid, threads)) = p.merge {
            gpu.launch_after(crate::kernels::DECODE_MERGE, grid, threads, 0, &a)?;
        }
    }
    Ok(())
}
