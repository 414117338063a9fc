//! The paged K/V cache in HBM: one K and one V pool per layer, the allocator
//! that hands out their pages (shared by every layer: a page id names the same
//! token rows in each layer's pools), and the scratch the split-KV merge needs.

use super::batch::{BatchBuffers, DecodeBatch, Tables, MAX_BATCH};
use super::pages::{PageAllocator, PageCopy, SeqId};
use crate::error::{cuda, Error, Result};
use crate::runtime::{Gpu, GrowOnlyBuffer};
use crate::tensor::Tensor;
use cust::memory::DeviceBuffer;
use half::bf16;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Largest K or V pool the decode kernel addresses (row offsets in 16-byte units, u32).
pub const MAX_POOL_BYTES: usize = 16 << 32;

/// Which cache a batch came from (unique in the process, never reused), and
/// the cache's page epoch then: a batch made before pages went back to the
/// free list is refused like another cache's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CacheId(u64, u64);

static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

/// The paged K/V cache in HBM: per layer, pools `[num_pages, page_size,
/// n_kv_heads, head_dim]` bf16, allocated once for the cache's life, and one
/// allocator that hands out pages of all of them at once. Sequences are added,
/// grown and released through the cache; the allocator is only readable from
/// outside ([`alloc`](Self::alloc)), so every page id a batch holds is one of
/// these pools'. Ops take one layer's pools ([`layer`](Self::layer); a
/// `&PagedKvCache` converts to its layer 0).
pub struct PagedKvCache {
    id: u64,
    alloc: PageAllocator,
    /// Each layer's K and V pools.
    pools: Vec<(Tensor<bf16>, Tensor<bf16>)>,
    n_kv_heads: usize,
    head_dim: usize,
    /// Split-KV partial results (grow-only: a captured decode graph may hold them).
    partials: RefCell<GrowOnlyBuffer<f32>>,
    /// The in-launch merges' per-(sequence, block column) split counters:
    /// zeroed at allocation, and each launch leaves them zero.
    counters: RefCell<GrowOnlyBuffer<u32>>,
}

impl PagedKvCache {
    /// A one-layer cache of `num_pages` pages of `page_size` tokens.
    pub fn new(
        gpu: &Gpu,
        num_pages: usize,
        page_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<PagedKvCache> {
        Self::with_layers(gpu, 1, num_pages, page_size, n_kv_heads, head_dim)
    }

    /// A cache for `layers` layers sharing one page allocator.
    pub fn with_layers(
        gpu: &Gpu,
        layers: usize,
        num_pages: usize,
        page_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<PagedKvCache> {
        if layers == 0 {
            return Err(Error::Shape("decode: a cache of 0 layers".into()));
        }
        if head_dim != 64 && head_dim != 128 {
            return Err(Error::Shape(format!("decode: head_dim {head_dim} is not supported (64 or 128)")));
        }
        if n_kv_heads == 0 {
            return Err(Error::Shape("decode: a cache of 0 KV heads".into()));
        }
        let alloc = PageAllocator::new(num_pages, page_size)?;
        let shape = [num_pages, page_size, n_kv_heads, head_dim];
        // The kernel passes row offsets between lanes in 16-byte units, as u32.
        let pool_bytes = shape.iter().try_fold(2usize, |acc, &d| acc.checked_mul(d));
        if pool_bytes.is_none_or(|b| b > MAX_POOL_BYTES) {
            return Err(Error::TooLarge(format!("KV pool {shape:?}: each pool must stay below 64 GiB")));
        }
        let pools = (0..layers)
            .map(|_| Ok((Tensor::filled(gpu, &shape, bf16::ZERO)?, Tensor::filled(gpu, &shape, bf16::ZERO)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(PagedKvCache {
            id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
            alloc,
            pools,
            n_kv_heads,
            head_dim,
            partials: RefCell::new(GrowOnlyBuffer::default()),
            counters: RefCell::new(GrowOnlyBuffer::default()),
        })
    }

    pub(crate) fn id(&self) -> CacheId {
        CacheId(self.id, self.alloc.epoch())
    }

    /// The page bookkeeping (lengths, pages, free pages), read-only.
    pub fn alloc(&self) -> &PageAllocator {
        &self.alloc
    }

    /// A new, empty sequence.
    pub fn add_sequence(&mut self) -> SeqId {
        self.alloc.add_sequence()
    }

    /// Ends a sequence; its pages return to the pool.
    pub fn release(&mut self, seq: SeqId) -> Result<()> {
        self.alloc.release(seq)
    }

    /// Drops the tokens of `seq` from position `len` on (a rejected draft, a
    /// chunk to run again); pages it no longer uses return to the pool. `len`
    /// must not pass the sequence's length. Where the cut falls inside a page
    /// `seq` shares with a fork, it first gets a copy of that page (queued on
    /// the stream), so its next tokens leave the other holders' as they are;
    /// with no free page for it, an error that changes nothing.
    pub fn truncate(&mut self, gpu: &Gpu, seq: SeqId, len: usize) -> Result<()> {
        let held = self.alloc.len(seq)?;
        if len > held {
            return Err(Error::InvalidArgument(format!("truncate: {seq:?} holds {held} tokens, fewer than {len}")));
        }
        if let Some(copy) = self.alloc.detach(seq, len)? {
            if let Err(e) = self.copy_page(gpu, copy) {
                self.alloc.reattach(seq, len, copy);
                return Err(e);
            }
        }
        self.alloc.shrink_to(seq, len);
        Ok(())
    }

    /// A new sequence holding `parent`'s tokens (a shared prompt, parallel
    /// samples of one): its whole pages shared with the parent, a partial last
    /// page copied on the stream; each then grows into pages of its own. Every
    /// row the parent holds must be written, or its write queued, first: the
    /// copy is taken now, and shared rows are never written again (the ops
    /// refuse to). With no free page for the copy, an error that changes nothing.
    pub fn fork(&mut self, gpu: &Gpu, parent: SeqId) -> Result<SeqId> {
        let (child, copy) = self.alloc.fork(parent)?;
        if let Some(copy) = copy {
            if let Err(e) = self.copy_page(gpu, copy) {
                self.alloc.release(child)?;
                return Err(e);
            }
        }
        Ok(child)
    }

    /// Queues the copy of page `from` into page `to` in every layer's pools.
    fn copy_page(&self, gpu: &Gpu, copy: PageCopy) -> Result<()> {
        let page_bytes = self.alloc.page_size() * self.token_elems() * 2;
        for (k, v) in &self.pools {
            for pool in [k, v] {
                let at = |page: u32| pool.device_ptr() + (page as usize * page_bytes) as u64;
                // SAFETY: both pages are below the pool's page count (the
                // allocator's), so each copy lies inside the pool, and they are
                // different pages; the copy is ordered on the stream with the
                // kernels that write `from` and read `to`.
                let status = unsafe {
                    cust::sys::cuMemcpyDtoDAsync_v2(at(copy.to), at(copy.from), page_bytes, gpu.stream().as_inner())
                };
                crate::error::check("cuMemcpyDtoDAsync", status)?;
            }
        }
        Ok(())
    }

    /// Grows each `seqs[i]` by `tokens[i]` without writing them (their K and V
    /// come later, e.g. from the RoPE kernel, before any fork of them); if any
    /// cannot grow, none does.
    pub fn grow_all(&mut self, seqs: &[SeqId], tokens: &[usize]) -> Result<()> {
        self.alloc.grow_all(seqs, tokens)
    }

    /// Shrinks `seq` back to `len` tokens (no-op if it holds fewer): undoes a
    /// growth whose step failed before it completed.
    pub(crate) fn shrink_to(&mut self, seq: SeqId, len: usize) {
        self.alloc.shrink_to(seq, len);
    }

    /// Device addresses of layer `layer`'s K and V pools (checked by [`layer`](Self::layer)).
    fn pools_of(&self, layer: usize) -> (u64, u64) {
        let (k, v) = &self.pools[layer];
        (k.device_ptr(), v.device_ptr())
    }

    /// How many layers' pools the cache holds.
    pub fn layers(&self) -> usize {
        self.pools.len()
    }

    /// Layer `layer`'s pools, for the ops.
    pub fn layer(&self, layer: usize) -> Result<KvLayer<'_>> {
        if layer >= self.pools.len() {
            return Err(Error::InvalidArgument(format!("KV layer {layer} of a cache of {}", self.pools.len())));
        }
        Ok(KvLayer { cache: self, layer })
    }

    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn page_size(&self) -> usize {
        self.alloc.page_size()
    }

    /// Bytes of every layer's K and V pools together.
    pub fn pool_bytes(&self) -> usize {
        self.pools.iter().map(|(k, v)| k.size_bytes() + v.size_bytes()).sum()
    }

    pub(crate) fn token_elems(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Appends `k`, `v` (`[tokens, n_kv_heads, head_dim]`, host data) to `seq`
    /// in layer 0's pools: the way tests fill a one-layer cache.
    pub fn write(&mut self, gpu: &Gpu, seq: SeqId, k: &[bf16], v: &[bf16]) -> Result<()> {
        let per = self.token_elems();
        if self.layers() != 1 {
            return Err(Error::InvalidArgument(format!(
                "write: a cache of {} layers is filled by its model",
                self.layers()
            )));
        }
        if k.len() != v.len() || !k.len().is_multiple_of(per) {
            return Err(Error::Shape(format!("write: k/v must be [tokens, {}, {}]", self.n_kv_heads, self.head_dim)));
        }
        let tokens = k.len() / per;
        let start = self.alloc.len(seq)?;
        self.alloc.grow(seq, tokens)?;
        let written = self.copy_rows(gpu, seq, start, k, v);
        if written.is_err() {
            self.alloc.shrink_to(seq, start);
        }
        written
    }

    /// Copies token rows `start..` of `seq` (already grown to hold them).
    fn copy_rows(&self, gpu: &Gpu, seq: SeqId, start: usize, k: &[bf16], v: &[bf16]) -> Result<()> {
        let per = self.token_elems();
        let tokens = k.len() / per;
        // The copies below run on the legacy stream: queued kernels may still read the pools.
        gpu.synchronize()?;
        let ps = self.alloc.page_size();
        let pages = self.alloc.pages(seq)?;
        let mut t = 0;
        while t < tokens {
            let pos = start + t;
            let run = (ps - pos % ps).min(tokens - t);
            let dst = (pages[pos / ps] as usize * ps + pos % ps) * per;
            let (src_k, src_v) = (&k[t * per..(t + run) * per], &v[t * per..(t + run) * per]);
            let (k_pool, v_pool) = &self.pools[0];
            for (pool, src) in [(k_pool, src_k), (v_pool, src_v)] {
                let raw: Vec<u16> = src.iter().map(|x| x.to_bits()).collect();
                // SAFETY: `pages[pos / ps]` is one of this pool's pages (< num_pages) and
                // the run stays inside it (pos % ps + run ≤ ps), so the copy's
                // `run × per` elements lie inside the pool; `raw` lives across the call.
                let status = unsafe {
                    cust::sys::cuMemcpyHtoD_v2(
                        pool.device_ptr() + (dst * 2) as u64,
                        raw.as_ptr() as *const std::ffi::c_void,
                        raw.len() * 2,
                    )
                };
                crate::error::check("cuMemcpyHtoD", status)?;
            }
            t += run;
        }
        // Stream-ordered work after this (a fork's page copy) must see the rows.
        crate::tensor::uploaded()
    }

    /// The K and V rows `seq` holds (`[tokens, n_kv_heads, head_dim]`, waiting for
    /// queued work first) in layer 0: the inverse of [`write`](Self::write), for tests.
    pub fn read(&self, gpu: &Gpu, seq: SeqId) -> Result<(Vec<bf16>, Vec<bf16>)> {
        self.read_layer(gpu, 0, seq)
    }

    /// [`read`](Self::read) of layer `layer`'s pools.
    pub fn read_layer(&self, gpu: &Gpu, layer: usize, seq: SeqId) -> Result<(Vec<bf16>, Vec<bf16>)> {
        let (k_pool, v_pool) = &self.pools[self.layer(layer)?.layer];
        let (per, ps) = (self.token_elems(), self.alloc.page_size());
        let (len, pages) = (self.alloc.len(seq)?, self.alloc.pages(seq)?);
        gpu.synchronize()?;
        let mut out = (vec![bf16::ZERO; len * per], vec![bf16::ZERO; len * per]);
        let mut raw = vec![0u16; ps * per];
        let mut t = 0;
        while t < len {
            let run = ps.min(len - t);
            let src = pages[t / ps] as usize * ps * per;
            for (pool, dst) in [(k_pool, &mut out.0), (v_pool, &mut out.1)] {
                // SAFETY: the page is one of this pool's (< num_pages) and `raw`
                // holds `run × per ≤ page_size × per` u16, the run's rows of it.
                let status = unsafe {
                    cust::sys::cuMemcpyDtoH_v2(
                        raw.as_mut_ptr() as *mut std::ffi::c_void,
                        pool.device_ptr() + (src * 2) as u64,
                        run * per * 2,
                    )
                };
                crate::error::check("cuMemcpyDtoH", status)?;
                for (d, &r) in dst[t * per..(t + run) * per].iter_mut().zip(&raw) {
                    *d = bf16::from_bits(r);
                }
            }
            t += run;
        }
        Ok(out)
    }

    /// The page table (rows of `row_pages`, or of the longest sequence's page
    /// count if `None`) and lengths of `seqs`, from this cache's allocator: each
    /// row lists the sequence's own pages, then zeros; each length covers no
    /// more than its pages.
    fn tables(&self, seqs: &[SeqId], row_pages: Option<usize>) -> Result<Tables> {
        if seqs.is_empty() || seqs.len() > MAX_BATCH {
            return Err(Error::InvalidArgument(format!("decode batch of {} sequences (1 to {MAX_BATCH})", seqs.len())));
        }
        let counts = seqs.iter().map(|&s| self.alloc.pages(s).map(|p| p.len())).collect::<Result<Vec<_>>>()?;
        let longest = counts.into_iter().max().unwrap_or(0).max(1);
        let max_pages = row_pages.unwrap_or(longest);
        if longest > max_pages {
            return Err(Error::TooLarge(format!("a sequence holds {longest} pages; the table rows hold {max_pages}")));
        }
        let ps = self.alloc.page_size();
        let mut table = vec![0u32; seqs.len() * max_pages];
        let mut lens = Vec::with_capacity(seqs.len());
        for (i, &s) in seqs.iter().enumerate() {
            let (pages, len) = (self.alloc.pages(s)?, self.alloc.len(s)?);
            // The kernels read the page of every position below the length.
            if len > pages.len() * ps || pages.iter().any(|&p| p as usize >= self.alloc.num_pages()) {
                return Err(Error::InvalidArgument(format!("{s:?}: {len} tokens in pages {pages:?}")));
            }
            table[i * max_pages..i * max_pages + pages.len()].copy_from_slice(pages);
            lens.push(u32::try_from(len).map_err(|_| Error::TooLarge(format!("{s:?}: {len} tokens")))?);
        }
        Ok(Tables { table, lens, max_pages })
    }

    /// Page tables and lengths for `seqs`, uploaded into buffers of the batch's own.
    pub fn batch(&self, _gpu: &Gpu, seqs: &[SeqId]) -> Result<DecodeBatch<'static>> {
        DecodeBatch::owned(self.id(), self.tables(seqs, None)?)
    }

    /// [`batch`](Self::batch)'s page tables and lengths, on the host (for a
    /// step that uploads them with its other words).
    pub(crate) fn step_tables(&self, seqs: &[SeqId]) -> Result<Tables> {
        self.tables(seqs, None)
    }

    /// The page tables (rows of `max_pages`) and lengths of `seqs` for a batch
    /// planned for `plan_len` tokens, refused if a sequence is longer.
    pub(crate) fn planned_tables(&self, seqs: &[SeqId], max_pages: usize, plan_len: usize) -> Result<Tables> {
        let t = self.tables(seqs, Some(max_pages))?;
        let max_len = t.lens.iter().copied().max().unwrap_or(0) as usize;
        if max_len > plan_len {
            return Err(Error::TooLarge(format!("a sequence of {max_len} tokens in a batch planned for {plan_len}")));
        }
        Ok(t)
    }

    /// As [`batch`](Self::batch), into `bufs` (no allocation) by a stream-ordered
    /// copy, with the split count planned for `plan_len` tokens: what a captured
    /// decode graph needs, whose launches keep their pointers and grids. The
    /// batch borrows `bufs` for its life, so no other batch can overwrite them.
    pub fn batch_into<'a>(
        &self,
        gpu: &Gpu,
        seqs: &[SeqId],
        bufs: &'a mut BatchBuffers,
        plan_len: usize,
    ) -> Result<DecodeBatch<'a>> {
        if seqs.len() != bufs.batch() {
            return Err(Error::Shape(format!("{} sequences into buffers for {}", seqs.len(), bufs.batch())));
        }
        let t = self.planned_tables(seqs, bufs.max_pages(), plan_len)?;
        DecodeBatch::into_buffers(gpu, self.id(), t, bufs, plan_len)
    }

    /// Device address of at least `len` f32 for split-KV partials.
    pub(super) fn partials(&self, len: usize) -> Result<u64> {
        // SAFETY (alloc): f32 has no invalid bit patterns; every slot read is written first.
        let alloc = |n| unsafe { DeviceBuffer::uninitialized(n) }.map_err(cuda("cuMemAlloc"));
        Ok(self.partials.borrow_mut().at_least(len, alloc)?.0)
    }

    /// Device address of at least `len` zero u32 counters.
    pub(super) fn counters(&self, len: usize) -> Result<u64> {
        self.counters.borrow_mut().zeroed_at_least(len)
    }

    /// Grows each of `seqs` (distinct) by one token and uploads their batch;
    /// on an error nothing has grown.
    pub(super) fn grow_one_each(&mut self, gpu: &Gpu, seqs: &[SeqId]) -> Result<DecodeBatch<'static>> {
        let before = seqs.iter().map(|&s| self.alloc.len(s).map(|len| (s, len))).collect::<Result<Vec<_>>>()?;
        self.alloc.grow_all(seqs, &vec![1; seqs.len()])?;
        let batch = self.batch(gpu, seqs);
        if batch.is_err() {
            self.alloc.undo(&before);
        }
        batch
    }

    /// Shrinks `seqs` back to the lengths before [`grow_one_each`](Self::grow_one_each).
    pub(super) fn undo_one_each(&mut self, seqs: &[SeqId]) {
        for &s in seqs.iter().rev() {
            if let Ok(len) = self.alloc.len(s) {
                self.alloc.shrink_to(s, len.saturating_sub(1));
            }
        }
    }
}

/// One layer's pools of a [`PagedKvCache`]: what the decode-attention, RoPE
/// and append ops read and write. It derefs to the cache (sizes, allocator).
#[derive(Clone, Copy)]
pub struct KvLayer<'a> {
    cache: &'a PagedKvCache,
    layer: usize,
}

impl KvLayer<'_> {
    /// Device addresses of this layer's K and V pools.
    pub(crate) fn pools(&self) -> (u64, u64) {
        self.cache.pools_of(self.layer)
    }

    pub fn index(&self) -> usize {
        self.layer
    }
}

impl std::ops::Deref for KvLayer<'_> {
    type Target = PagedKvCache;
    fn deref(&self) -> &PagedKvCache {
        self.cache
    }
}

impl<'a> From<&'a PagedKvCache> for KvLayer<'a> {
    /// Layer 0 (every cache has it).
    fn from(cache: &'a PagedKvCache) -> Self {
        KvLayer { cache, layer: 0 }
    }
}
