//! A step's batch: the page tables and lengths of a set of sequences, on the
//! GPU, tied to the cache they came from and to the device buffers they live in.

use super::cache::CacheId;
use crate::error::{cuda, Error, Result};
use crate::runtime::Gpu;
use cust::memory::DeviceBuffer;
use std::marker::PhantomData;

/// Most sequences in one batch (the merge grid's y dimension and the kernels'
/// z dimension).
pub const MAX_BATCH: usize = 65535;

/// Page tables and lengths of a batch of sequences of one [`PagedKvCache`],
/// uploaded for one step: into buffers of its own ([`PagedKvCache::batch`],
/// `DecodeBatch<'static>`), into fixed ones a captured CUDA graph reads
/// ([`PagedKvCache::batch_into`]), or into the grow-only buffers a layer reuses
/// step after step; it borrows the buffers it does not own exclusively for its life.
///
/// A batch is a snapshot: sequences grown or released afterwards are not seen
/// by it. Its page ids stay those the cache's allocator handed out (below the
/// pool's page count, which never changes), so it stays in bounds of its cache
/// whatever happens to the sequences since; the ops refuse it for any other cache.
///
/// [`PagedKvCache`]: super::PagedKvCache
/// [`PagedKvCache::batch`]: super::PagedKvCache::batch
/// [`PagedKvCache::batch_into`]: super::PagedKvCache::batch_into
pub struct DecodeBatch<'a> {
    cache: CacheId,
    /// `[batch, max_pages]` u32 page ids and `[batch]` u32 lengths (device
    /// addresses into `owned`, or into buffers borrowed for `'a`: [`BatchBuffers`],
    /// a layer's step buffers, a graph's fixed ones).
    page_table: u64,
    seq_lens: u64,
    _owned: Option<(DeviceBuffer<u32>, DeviceBuffer<u32>)>,
    _bufs: PhantomData<&'a ()>,
    /// Host copy of the uploaded lengths.
    lens: Vec<u32>,
    /// Host copy of the uploaded page table.
    table: Vec<u32>,
    max_pages: usize,
    min_len: usize,
    /// The length the split count is planned for (≥ the longest sequence): a
    /// graph plans for the longest sequence it may see, so its grid never changes.
    plan_len: usize,
}

/// The host side of a batch: page table rows of `max_pages` entries (pages
/// past a sequence's own are 0), and lengths; checked by
/// [`PagedKvCache`](super::PagedKvCache) to cover no more than each sequence's pages.
pub(crate) struct Tables {
    pub table: Vec<u32>,
    pub lens: Vec<u32>,
    pub max_pages: usize,
}

impl DecodeBatch<'static> {
    /// Uploads `t` into buffers of its own.
    pub(crate) fn owned(cache: CacheId, t: Tables) -> Result<DecodeBatch<'static>> {
        let page_table = DeviceBuffer::from_slice(&t.table).map_err(cuda("cuMemcpyHtoD"))?;
        let seq_lens = DeviceBuffer::from_slice(&t.lens).map_err(cuda("cuMemcpyHtoD"))?;
        crate::tensor::uploaded()?;
        let plan_len = t.lens.iter().copied().max().unwrap_or(0) as usize;
        let (pt, sl) = (page_table.as_device_ptr().as_raw(), seq_lens.as_device_ptr().as_raw());
        Ok(DecodeBatch::new(cache, pt, sl, Some((page_table, seq_lens)), t, plan_len))
    }
}

impl<'a> DecodeBatch<'a> {
    /// Uploads `t` into `bufs` by stream-ordered copies: launches queued before
    /// read the old contents. `t`'s rows must be `bufs`' width.
    pub(crate) fn into_buffers(
        gpu: &Gpu,
        cache: CacheId,
        t: Tables,
        bufs: &'a mut BatchBuffers,
        plan_len: usize,
    ) -> Result<DecodeBatch<'a>> {
        if t.lens.len() != bufs.batch || t.max_pages != bufs.max_pages || t.table.len() != bufs.page_table.len() {
            return Err(Error::Shape(format!(
                "{} sequences × {} pages into buffers for {} × {}",
                t.lens.len(),
                t.max_pages,
                bufs.batch,
                bufs.max_pages
            )));
        }
        upload_async(gpu, &bufs.page_table, &t.table)?;
        upload_async(gpu, &bufs.seq_lens, &t.lens)?;
        let (pt, sl) = (bufs.page_table.as_device_ptr().as_raw(), bufs.seq_lens.as_device_ptr().as_raw());
        Ok(DecodeBatch::new(cache, pt, sl, None, t, plan_len))
    }

    /// `t` of `cache`, whose device copies are at `page_table` and `seq_lens`,
    /// planned for `plan_len` tokens (at least the longest sequence; `None`: that).
    ///
    /// # Safety
    /// The addresses must hold `t.table` and `t.lens`, copied in on the stream
    /// before any launch that reads them, and stay so for `'a`.
    pub(crate) unsafe fn in_step(
        cache: CacheId,
        t: Tables,
        page_table: u64,
        seq_lens: u64,
        plan_len: Option<usize>,
    ) -> DecodeBatch<'a> {
        let longest = t.lens.iter().copied().max().unwrap_or(0) as usize;
        let plan_len = plan_len.unwrap_or(longest).max(longest);
        DecodeBatch::new(cache, page_table, seq_lens, None, t, plan_len)
    }

    fn new(
        cache: CacheId,
        page_table: u64,
        seq_lens: u64,
        owned: Option<(DeviceBuffer<u32>, DeviceBuffer<u32>)>,
        t: Tables,
        plan_len: usize,
    ) -> DecodeBatch<'a> {
        DecodeBatch {
            cache,
            page_table,
            seq_lens,
            _owned: owned,
            _bufs: PhantomData,
            min_len: t.lens.iter().copied().min().unwrap_or(0) as usize,
            lens: t.lens,
            table: t.table,
            max_pages: t.max_pages,
            plan_len,
        }
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.lens.len()
    }

    /// Each sequence's length when the batch was made.
    pub fn lens(&self) -> &[u32] {
        &self.lens
    }

    /// The shortest sequence's length.
    pub fn min_len(&self) -> usize {
        self.min_len
    }

    /// The length the split count is planned for.
    pub fn plan_len(&self) -> usize {
        self.plan_len
    }

    /// Page-table row length: the most pages any sequence of it may hold.
    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    pub(crate) fn cache_id(&self) -> CacheId {
        self.cache
    }

    /// The page of position `pos` of the batch's sequence `row` (both checked
    /// against the lengths by the caller).
    pub(crate) fn page_of(&self, row: usize, pos: usize, page_size: usize) -> u32 {
        self.table[row * self.max_pages + pos / page_size]
    }

    /// Refuses the batch unless it was made from the cache `cache`.
    pub(crate) fn check_cache(&self, op: &str, cache: CacheId) -> Result<()> {
        if self.cache == cache {
            Ok(())
        } else {
            Err(Error::ForeignBatch(format!(
                "{op}: the batch was made from another KV cache, or before pages of this one were freed"
            )))
        }
    }

    /// Device address of the `[batch, max_pages]` u32 page table.
    pub(crate) fn page_table_ptr(&self) -> u64 {
        self.page_table
    }

    /// Device address of the `[batch]` u32 lengths.
    pub(crate) fn seq_lens_ptr(&self) -> u64 {
        self.seq_lens
    }
}

/// Fixed device buffers a batch's page table and lengths are copied into before
/// each step (stream-ordered, so launches already queued read the old contents).
pub struct BatchBuffers {
    page_table: DeviceBuffer<u32>,
    seq_lens: DeviceBuffer<u32>,
    /// Page-table row length: the most pages any sequence may hold.
    max_pages: usize,
    batch: usize,
}

impl BatchBuffers {
    pub fn new(batch: usize, max_pages: usize) -> Result<BatchBuffers> {
        if batch == 0 || max_pages == 0 || batch > MAX_BATCH {
            return Err(Error::InvalidArgument(format!("batch buffers for {batch} sequences × {max_pages} pages")));
        }
        let Some(entries) = batch.checked_mul(max_pages).filter(|&n| n <= u32::MAX as usize) else {
            return Err(Error::TooLarge(format!("batch buffers for {batch} sequences × {max_pages} pages")));
        };
        // No zeroing memset: it would run on the legacy stream, unordered with the
        // uploads on ours; every use is preceded by an upload of every entry.
        // SAFETY: u32 has no invalid bit patterns.
        Ok(BatchBuffers {
            page_table: unsafe { DeviceBuffer::uninitialized(entries) }.map_err(cuda("cuMemAlloc"))?,
            seq_lens: unsafe { DeviceBuffer::uninitialized(batch) }.map_err(cuda("cuMemAlloc"))?,
            max_pages,
            batch,
        })
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn max_pages(&self) -> usize {
        self.max_pages
    }
}

/// Copies `data` to `dst` on the GPU's stream (ordered after queued work).
pub(crate) fn upload_async(gpu: &Gpu, dst: &DeviceBuffer<u32>, data: &[u32]) -> Result<()> {
    if data.len() > dst.len() {
        return Err(Error::TooLarge(format!("{} words into a buffer of {}", data.len(), dst.len())));
    }
    // SAFETY: dst holds at least data.len() u32, and callers keep it alive until
    // the stream has run the copy (the buffers are freed only after a synchronize).
    unsafe { gpu.upload_u32(dst.as_device_ptr().as_raw(), data) }
}
