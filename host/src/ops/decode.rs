//! Decode attention over a paged KV cache in HBM (PagedAttention layout,
//! Flash-Decoding split-KV).
//!
//! - [`PageAllocator`]: host-side bookkeeping: a free list of pages, each sequence
//!   owns a list of them; growth is all-or-nothing, so a full pool is a clear
//!   error that changes nothing.
//! - [`PagedKvCache`]: one layer's K and V pools, `[num_pages, page_size,
//!   n_kv_heads, head_dim]` bf16, plus its allocator.
//! - [`decode_attention`]: one query per sequence (`q: [batch, n_heads, head_dim]`),
//!   or up to [`MAX_Q_LEN`] (speculative decoding, `[batch, q_len, n_heads,
//!   head_dim]`, causal among them), against each sequence's whole cache; splits
//!   chosen so the GPU is full even at batch 1, merged exactly by log-sum-exp:
//!   by a second kernel, or ([`DecodeVersion::Fused`]) by the last block of each
//!   split group in the same launch.

use crate::error::{cuda, Error, Result};
use crate::runtime::{Gpu, GrowOnlyBuffer};
use crate::tensor::Tensor;
use cust::memory::DeviceBuffer;
use half::bf16;
use std::cell::RefCell;

/// A sequence's handle in a [`PageAllocator`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SeqId(usize);

#[derive(Debug, Default, Clone)]
struct SeqState {
    pages: Vec<u32>,
    len: usize,
}

/// Page bookkeeping for one pool: which pages are free, which belong to whom.
#[derive(Debug)]
pub struct PageAllocator {
    page_size: usize,
    free: Vec<u32>,
    seqs: Vec<Option<SeqState>>,
}

impl PageAllocator {
    pub fn new(num_pages: usize, page_size: usize) -> Result<PageAllocator> {
        if num_pages == 0 || page_size == 0 || num_pages > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!("{num_pages} pages of {page_size} tokens")));
        }
        // Pop from the end: pages are handed out in ascending order.
        Ok(PageAllocator { page_size, free: (0..num_pages as u32).rev().collect(), seqs: Vec::new() })
    }

    pub fn add_sequence(&mut self) -> SeqId {
        self.seqs.push(Some(SeqState::default()));
        SeqId(self.seqs.len() - 1)
    }

    fn state(&self, seq: SeqId) -> Result<&SeqState> {
        self.seqs.get(seq.0).and_then(|s| s.as_ref()).ok_or_else(|| Error::InvalidArgument(format!("unknown {seq:?}")))
    }

    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.state(seq)?.len)
    }

    pub fn pages(&self, seq: SeqId) -> Result<&[u32]> {
        Ok(&self.state(seq)?.pages)
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Grows `seq` by `tokens`, taking new pages as needed; if the pool cannot
    /// supply them, returns an error and leaves everything as it was.
    pub fn grow(&mut self, seq: SeqId, tokens: usize) -> Result<()> {
        let st = self.state(seq)?;
        let need = (st.len + tokens).div_ceil(self.page_size).saturating_sub(st.pages.len());
        if need > self.free.len() {
            return Err(Error::TooLarge(format!(
                "KV cache pool full: {seq:?} needs {need} more pages, {} free",
                self.free.len()
            )));
        }
        let new_pages: Vec<u32> = (0..need).map(|_| self.free.pop().unwrap()).collect();
        let st = self.seqs[seq.0].as_mut().unwrap();
        st.pages.extend(new_pages);
        st.len += tokens;
        Ok(())
    }

    /// Shrinks `seq` back to `len` tokens, returning pages it no longer needs.
    fn shrink_to(&mut self, seq: SeqId, len: usize) {
        let ps = self.page_size;
        if let Some(Some(st)) = self.seqs.get_mut(seq.0) {
            st.len = st.len.min(len);
            while st.pages.len() > st.len.div_ceil(ps) {
                self.free.push(st.pages.pop().unwrap());
            }
        }
    }

    /// Grows each `seqs[i]` by `tokens[i]`; if any cannot grow, none does.
    pub fn grow_all(&mut self, seqs: &[SeqId], tokens: &[usize]) -> Result<()> {
        if seqs.len() != tokens.len() {
            return Err(Error::Shape(format!("{} sequences, {} token counts", seqs.len(), tokens.len())));
        }
        let mut done = Vec::with_capacity(seqs.len());
        for (&s, &n) in seqs.iter().zip(tokens) {
            let before = match self.len(s) {
                Ok(len) => len,
                Err(e) => {
                    self.undo(&done);
                    return Err(e);
                }
            };
            if let Err(e) = self.grow(s, n) {
                self.undo(&done);
                return Err(e);
            }
            done.push((s, before));
        }
        Ok(())
    }

    fn undo(&mut self, grown: &[(SeqId, usize)]) {
        for &(s, len) in grown.iter().rev() {
            self.shrink_to(s, len);
        }
    }

    /// Ends a sequence and returns its pages to the pool.
    pub fn release(&mut self, seq: SeqId) -> Result<()> {
        self.state(seq)?;
        let st = self.seqs[seq.0].take().unwrap();
        self.free.extend(st.pages.into_iter().rev());
        Ok(())
    }
}

/// One layer's paged K/V cache in HBM.
pub struct PagedKvCache {
    pub alloc: PageAllocator,
    k: Tensor<bf16>,
    v: Tensor<bf16>,
    n_kv_heads: usize,
    head_dim: usize,
    /// Split-KV partial results (grow-only: a captured decode graph may hold them).
    partials: RefCell<GrowOnlyBuffer<f32>>,
    /// The fused kernels' per-(sequence, block column) split counters: zeroed at
    /// allocation, and each launch leaves them zero.
    counters: RefCell<GrowOnlyBuffer<u32>>,
}

/// Page tables and lengths of a batch of sequences, uploaded for one step: into
/// buffers of its own ([`PagedKvCache::batch`]), or into fixed ones a captured CUDA
/// graph reads ([`PagedKvCache::batch_into`]).
pub struct DecodeBatch {
    /// `[batch, max_pages]` u32 page ids and `[batch]` u32 lengths (device addresses).
    page_table: u64,
    seq_lens: u64,
    _owned: Option<(DeviceBuffer<u32>, DeviceBuffer<u32>)>,
    max_pages: usize,
    min_len: usize,
    /// The length the split count is planned for (≥ max_len): a graph plans for
    /// the longest sequence it may see, so its grid never changes.
    plan_len: usize,
    batch: usize,
}

impl DecodeBatch {
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Device address of the `[batch, max_pages]` u32 page table.
    pub(crate) fn page_table_ptr(&self) -> u64 {
        self.page_table
    }

    pub(crate) fn max_pages(&self) -> usize {
        self.max_pages
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
        if batch == 0 || max_pages == 0 {
            return Err(Error::InvalidArgument(format!("batch buffers for {batch} sequences × {max_pages} pages")));
        }
        // No zeroing memset: it would run on the legacy stream, unordered with the
        // uploads on ours; every use is preceded by an upload.
        // SAFETY: u32 has no invalid bit patterns.
        Ok(BatchBuffers {
            page_table: unsafe { DeviceBuffer::uninitialized(batch * max_pages) }.map_err(cuda("cuMemAlloc"))?,
            seq_lens: unsafe { DeviceBuffer::uninitialized(batch) }.map_err(cuda("cuMemAlloc"))?,
            max_pages,
            batch,
        })
    }
}

/// Copies `data` to `dst` on the GPU's stream (ordered after queued work).
pub(crate) fn upload_async(gpu: &Gpu, dst: &DeviceBuffer<u32>, data: &[u32]) -> Result<()> {
    if data.len() > dst.len() {
        return Err(Error::TooLarge(format!("{} words into a buffer of {}", data.len(), dst.len())));
    }
    // SAFETY: dst holds at least data.len() u32; the driver stages pageable
    // memory before returning, so `data` may be dropped right after.
    let status = unsafe {
        cust::sys::cuMemcpyHtoDAsync_v2(
            dst.as_device_ptr().as_raw(),
            data.as_ptr() as *const std::ffi::c_void,
            std::mem::size_of_val(data),
            gpu.stream().as_inner(),
        )
    };
    crate::error::check("cuMemcpyHtoDAsync", status)
}

const SPLIT_THREADS: u32 = 32;
/// Warps per block of the `decode_wide_*` entries (two K/V stages each).
const WIDE_WARPS: usize = 4;
/// Warps per block of the `decode_wide8_*` entries (one K/V stage each).
const WIDE8_WARPS: usize = 8;
const KEY_TILE: usize = 32;
/// Query rows (token, head pairs of one KV head) per decode block: one m16 tile.
const ROW_TILE: usize = 16;
/// Most new query tokens per sequence in one step (speculative decoding).
pub const MAX_Q_LEN: usize = 8;
use abi::decode_merge::groups as merge_groups;

impl PagedKvCache {
    pub fn new(
        gpu: &Gpu,
        num_pages: usize,
        page_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<PagedKvCache> {
        if head_dim != 64 && head_dim != 128 {
            return Err(Error::Shape(format!("decode: head_dim {head_dim} is not supported (64 or 128)")));
        }
        let shape = [num_pages, page_size, n_kv_heads, head_dim];
        // The kernel passes row offsets between lanes in 16-byte units, as u32.
        let pool_bytes = shape.iter().try_fold(2usize, |acc, &d| acc.checked_mul(d));
        if pool_bytes.is_none_or(|b| b > MAX_POOL_BYTES) {
            return Err(Error::TooLarge(format!("KV pool {shape:?}: each pool must stay below 64 GiB")));
        }
        Ok(PagedKvCache {
            alloc: PageAllocator::new(num_pages, page_size)?,
            k: Tensor::filled(gpu, &shape, bf16::ZERO)?,
            v: Tensor::filled(gpu, &shape, bf16::ZERO)?,
            n_kv_heads,
            head_dim,
            partials: RefCell::new(GrowOnlyBuffer::default()),
            counters: RefCell::new(GrowOnlyBuffer::default()),
        })
    }

    pub(crate) fn pools(&self) -> (u64, u64) {
        (self.k.device_ptr(), self.v.device_ptr())
    }

    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Bytes of the K and V pools together.
    pub fn pool_bytes(&self) -> usize {
        self.k.size_bytes() + self.v.size_bytes()
    }

    fn token_elems(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Appends `k`, `v` (`[tokens, n_kv_heads, head_dim]`, host data) to `seq`:
    /// the prefill path, and the way tests fill the cache.
    pub fn write(&mut self, gpu: &Gpu, seq: SeqId, k: &[bf16], v: &[bf16]) -> Result<()> {
        let per = self.token_elems();
        if k.len() != v.len() || !k.len().is_multiple_of(per) {
            return Err(Error::Shape(format!("write: k/v must be [tokens, {}, {}]", self.n_kv_heads, self.head_dim)));
        }
        let start = self.alloc.len(seq)?;
        self.alloc.grow(seq, k.len() / per)?;
        gpu.synchronize()?;
        let ps = self.alloc.page_size();
        let pages = self.alloc.pages(seq)?.to_vec();
        let mut t = 0;
        while t < k.len() / per {
            let pos = start + t;
            let run = (ps - pos % ps).min(k.len() / per - t);
            let dst = (pages[pos / ps] as usize * ps + pos % ps) * per;
            let (src_k, src_v) = (&k[t * per..(t + run) * per], &v[t * per..(t + run) * per]);
            for (pool, src) in [(&self.k, src_k), (&self.v, src_v)] {
                let raw: Vec<u16> = src.iter().map(|x| x.to_bits()).collect();
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
        Ok(())
    }

    /// The page table (rows of `row_pages`, or of the longest sequence's page
    /// count if `None`) and lengths of `seqs`.
    fn tables(&self, seqs: &[SeqId], row_pages: Option<usize>) -> Result<(Vec<u32>, Vec<u32>, usize)> {
        if seqs.is_empty() || seqs.len() > 65535 {
            return Err(Error::InvalidArgument(format!("decode batch of {} sequences", seqs.len())));
        }
        let longest = seqs.iter().map(|&s| self.alloc.pages(s).map(|p| p.len())).collect::<Result<Vec<_>>>()?;
        let longest = longest.into_iter().max().unwrap_or(0).max(1);
        let max_pages = row_pages.unwrap_or(longest);
        if longest > max_pages {
            return Err(Error::TooLarge(format!("a sequence holds {longest} pages; the table rows hold {max_pages}")));
        }
        let mut table = vec![0u32; seqs.len() * max_pages];
        let mut lens = Vec::with_capacity(seqs.len());
        for (i, &s) in seqs.iter().enumerate() {
            let pages = self.alloc.pages(s)?;
            table[i * max_pages..i * max_pages + pages.len()].copy_from_slice(pages);
            lens.push(self.alloc.len(s)? as u32);
        }
        Ok((table, lens, max_pages))
    }

    /// Page tables and lengths for `seqs`, uploaded for one launch.
    pub fn batch(&self, _gpu: &Gpu, seqs: &[SeqId]) -> Result<DecodeBatch> {
        let (table, lens, max_pages) = self.tables(seqs, None)?;
        let max_len = lens.iter().copied().max().unwrap_or(0) as usize;
        let page_table = DeviceBuffer::from_slice(&table).map_err(cuda("cuMemcpyHtoD"))?;
        let seq_lens = DeviceBuffer::from_slice(&lens).map_err(cuda("cuMemcpyHtoD"))?;
        Ok(DecodeBatch {
            page_table: page_table.as_device_ptr().as_raw(),
            seq_lens: seq_lens.as_device_ptr().as_raw(),
            _owned: Some((page_table, seq_lens)),
            max_pages,
            min_len: lens.iter().copied().min().unwrap_or(0) as usize,
            plan_len: max_len,
            batch: seqs.len(),
        })
    }

    /// As [`batch`](Self::batch), into `bufs` (no allocation) by a stream-ordered
    /// copy, with the split count planned for `plan_len` tokens: what a captured
    /// decode graph needs, whose launches keep their pointers and grids.
    pub fn batch_into(&self, gpu: &Gpu, seqs: &[SeqId], bufs: &BatchBuffers, plan_len: usize) -> Result<DecodeBatch> {
        if seqs.len() != bufs.batch {
            return Err(Error::Shape(format!("{} sequences into buffers for {}", seqs.len(), bufs.batch)));
        }
        let (table, lens, max_pages) = self.tables(seqs, Some(bufs.max_pages))?;
        let max_len = lens.iter().copied().max().unwrap_or(0) as usize;
        if max_len > plan_len {
            return Err(Error::TooLarge(format!("a sequence of {max_len} tokens in a batch planned for {plan_len}")));
        }
        upload_async(gpu, &bufs.page_table, &table)?;
        upload_async(gpu, &bufs.seq_lens, &lens)?;
        Ok(DecodeBatch {
            page_table: bufs.page_table.as_device_ptr().as_raw(),
            seq_lens: bufs.seq_lens.as_device_ptr().as_raw(),
            _owned: None,
            max_pages,
            min_len: lens.iter().copied().min().unwrap_or(0) as usize,
            plan_len,
            batch: seqs.len(),
        })
    }

    /// Grows each sequence by one token and writes its K and V (`[batch,
    /// n_kv_heads, head_dim]` on the GPU, after RoPE) into the cache. If any
    /// sequence cannot grow, none does and nothing is written.
    pub fn append(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        k_new: &Tensor<bf16>,
        v_new: &Tensor<bf16>,
    ) -> Result<DecodeBatch> {
        let shape = [seqs.len(), self.n_kv_heads, self.head_dim];
        super::same_shape("kv_append", "k", &shape, k_new.shape())?;
        super::same_shape("kv_append", "v", &shape, v_new.shape())?;
        let mut grown = Vec::new();
        for &s in seqs {
            if let Err(e) = self.alloc.grow(s, 1) {
                for &g in &grown {
                    self.shrink_last(g);
                }
                return Err(e);
            }
            grown.push(s);
        }
        let batch = self.batch(gpu, seqs)?;
        let args = abi::KvAppendArgs {
            k_new: k_new.device_ptr(),
            v_new: v_new.device_ptr(),
            k_pool: self.k.device_ptr(),
            v_pool: self.v.device_ptr(),
            page_table: batch.page_table,
            seq_lens: batch.seq_lens,
            n_kv_heads: self.n_kv_heads as u32,
            head_dim: self.head_dim as u32,
            page_size: self.alloc.page_size() as u32,
            max_pages: batch.max_pages as u32,
        };
        // SAFETY: every sequence owns the page its new last position falls in.
        unsafe { gpu.launch(crate::kernels::KV_APPEND, (seqs.len() as u32, 1, 1), 256, 0, &args)? };
        Ok(batch)
    }

    /// Undoes a one-token growth (used when a batch append fails part-way).
    fn shrink_last(&mut self, seq: SeqId) {
        let ps = self.alloc.page_size;
        if let Some(Some(st)) = self.alloc.seqs.get_mut(seq.0) {
            st.len -= 1;
            while st.pages.len() > st.len.div_ceil(ps) {
                self.alloc.free.push(st.pages.pop().unwrap());
            }
        }
    }

    fn partials(&self, len: usize) -> Result<u64> {
        // SAFETY (alloc): f32 has no invalid bit patterns; every slot read is written first.
        let alloc = |n| unsafe { DeviceBuffer::uninitialized(n) }.map_err(cuda("cuMemAlloc"));
        Ok(self.partials.borrow_mut().at_least(len, alloc)?.0)
    }

    /// Device address of at least `len` zero u32 counters.
    fn counters(&self, len: usize) -> Result<u64> {
        self.counters.borrow_mut().zeroed_at_least(len)
    }
}

/// Largest K or V pool the decode kernel addresses (row offsets in 16-byte units, u32).
pub const MAX_POOL_BYTES: usize = 16 << 32;

/// (splits, tokens per split, a multiple of `tile` keys) for a batch whose sequences each need
/// `blocks_per_seq` blocks per split (KV heads × row tiles), given how many blocks fit on the
/// GPU at once (`sm_count × blocks_per_sm`). Blocks do equal work, so time goes
/// by whole waves: the split count that fills its last wave best wins (fewest
/// splits among near-ties: less to merge). A grid of 1.13 waves ran at 2.5 TB/s
/// where one full wave ran at 3.5 (docs/PERF.md).
pub fn choose_splits(
    batch: usize,
    blocks_per_seq: usize,
    max_len: usize,
    sm_count: usize,
    blocks_per_sm: usize,
    tile: usize,
) -> (usize, usize) {
    let units = (batch * blocks_per_seq).max(1);
    let capacity = (sm_count * blocks_per_sm).max(1);
    // Lower is better: the last wave's fill, negated; near-ties go to fewer splits.
    let unfilled = |splits: usize, _chunk_tiles: usize| {
        let blocks = units * splits;
        -(blocks as f64 / (blocks.div_ceil(capacity) * capacity) as f64)
    };
    pick_splits(max_len, tile, units, capacity, unfilled, 0.01)
}

/// The split count (and tokens per split, a multiple of `tile`) with the lowest
/// `score(splits, key tiles per split)` among 1 to 4 waves' worth of splits, a
/// later candidate winning only by more than `margin`.
fn pick_splits(
    max_len: usize,
    tile: usize,
    units: usize,
    capacity: usize,
    score: impl Fn(usize, usize) -> f64,
    margin: f64,
) -> (usize, usize) {
    let tiles = max_len.div_ceil(tile).max(1);
    let max_splits = tiles.min(4 * capacity / units + 1).max(1);
    let mut best = (f64::INFINITY, tiles);
    for want in 1..=max_splits {
        let chunk_tiles = tiles.div_ceil(want);
        let v = score(tiles.div_ceil(chunk_tiles), chunk_tiles);
        if v < best.0 - margin {
            best = (v, chunk_tiles);
        }
    }
    let chunk = best.1 * tile;
    (max_len.div_ceil(chunk).max(1), chunk)
}

/// [`choose_splits`] for kernels with one block per SM (the wide ones), where a
/// second wave costs a whole block's latency: the split count with the least
/// waves × (key tiles per block + [`WAVE_COST_TILES`]) wins (fewest splits among
/// ties). The fill rule took 33 splits (two full waves: ncu 17.8 µs) over 16
/// (one wave at 97%: 11.4 µs) at b1 L4097 in the layer (session 7); with this
/// rule b1 L4097 ran 12.8 µs in a graph against 16.3, and b1 L131072 (16 splits
/// against 33) 4078 GB/s against 3733 (session 8, run 1).
pub fn choose_splits_waves(
    batch: usize,
    blocks_per_seq: usize,
    max_len: usize,
    sm_count: usize,
    tile: usize,
) -> (usize, usize) {
    let units = (batch * blocks_per_seq).max(1);
    let capacity = sm_count.max(1);
    let cost = |splits: usize, chunk_tiles: usize| {
        ((units * splits).div_ceil(capacity) * (chunk_tiles + WAVE_COST_TILES)) as f64
    };
    pick_splits(max_len, tile, units, capacity, cost, 0.0)
}

/// A wave's fixed cost in key tiles of one block (launch, page table, merge), for
/// [`choose_splits_waves`]: a guess that measured well (session 8).
const WAVE_COST_TILES: usize = 2;

/// How the split-KV partials are merged (versions side by side, llm.c style).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeVersion {
    /// The shipped choice: [`DecodeVersion::Wide`] where it applies (one query
    /// per sequence, G ≤ 16, its shared memory fits), else [`DecodeVersion::TwoLaunch`].
    /// H200 (session 6, runs 1 and 4): b1 L4096 11.1–11.5 µs in a graph against
    /// 11.8–12.0, b16 L4096 3.72–3.95 TB/s against 3.51, b64 4.19–4.24 against
    /// 4.06–4.12; with the wave-cost split rule (session 8) b1 L131072 4078 GB/s
    /// against two-launch's 3757.
    Auto,
    /// The split kernel writes partials; `decode_merge` combines them.
    TwoLaunch,
    /// One launch: the last block of each split group merges the group's partials
    /// (one split: each block writes the output directly).
    Fused,
    /// One launch of 4-warp blocks: each warp takes a quarter of the block's keys
    /// and the warps combine in shared memory, so a quarter of the partials reach
    /// the fused merge, which the last block does with all its threads. For small
    /// batches (b1 L4096: 16 partials per KV head instead of 64). One query per
    /// sequence with G ≤ 16 only; other shapes take `Fused`. With one block per
    /// SM, splits by [`choose_splits_waves`].
    Wide,
    /// `Wide` whose blocks of one KV head (2 to 16 splits) run as one thread-block
    /// cluster and merge through distributed shared memory after a cluster
    /// barrier: no partials in global memory, no fence, no counter (sm_90, head
    /// dim 128, where all the clusters fit at once; elsewhere `Wide`).
    Cluster,
    /// `Wide` with 8 warps of one K/V stage each in the same shared memory as
    /// 4 of two: two warps per scheduler, and half the key tiles per warp (one
    /// at b1 L4096). Measured (session 8): equal at b1 L4096, 3–5% slower at
    /// b16 (ncu: 8.6 cycles per issued instruction against 5.0, 24% more
    /// instructions). Kept for the record, not Auto.
    Wide8,
}

impl DecodeVersion {
    /// The concrete version for a call, given whether the wide blocks apply to it.
    pub fn resolve(self, wide_applies: bool) -> DecodeVersion {
        match self {
            DecodeVersion::Auto | DecodeVersion::Wide if wide_applies => DecodeVersion::Wide,
            DecodeVersion::Cluster if wide_applies => DecodeVersion::Cluster,
            DecodeVersion::Wide8 if wide_applies => DecodeVersion::Wide8,
            DecodeVersion::Auto => DecodeVersion::TwoLaunch,
            DecodeVersion::Wide | DecodeVersion::Cluster | DecodeVersion::Wide8 => DecodeVersion::Fused,
            v => v,
        }
    }
}

/// out[b, h] = softmax(scale · q[b, h] · K_bᵀ) · V_b over each sequence's cache,
/// and each row's LSE. `q`, `out`: `[batch, heads, head_dim]` with `lse`
/// `[batch, heads]`; or, for speculative decoding, `[batch, q_len, heads,
/// head_dim]` with `lse` `[batch, q_len, heads]` (q_len ≤ [`MAX_Q_LEN`]): the
/// q_len queries are each sequence's last q_len positions (already in the cache),
/// and query i sees the keys up to its own position.
pub fn decode_attention(
    gpu: &Gpu,
    cache: &PagedKvCache,
    batch: &DecodeBatch,
    q: &Tensor<bf16>,
    scale: Option<f32>,
    out: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
) -> Result<()> {
    decode_attention_with(gpu, cache, batch, q, scale, out, lse, DecodeVersion::Auto)
}

/// [`decode_attention`] with an explicit merge version.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_with(
    gpu: &Gpu,
    cache: &PagedKvCache,
    batch: &DecodeBatch,
    q: &Tensor<bf16>,
    scale: Option<f32>,
    out: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
    version: DecodeVersion,
) -> Result<()> {
    let op = "decode_attention";
    let (b, q_len, h, d) = match *q.shape() {
        [b, h, d] => (b, 1, h, d),
        [b, t, h, d] => (b, t, h, d),
        _ => {
            return Err(Error::Shape(format!(
                "{op}: q must be [batch, heads, head_dim] or [batch, q_len, heads, head_dim]"
            )))
        }
    };
    super::same_shape(op, "output", q.shape(), out.shape())?;
    let lse_shape: &[usize] = if q.shape().len() == 3 { &[b, h] } else { &[b, q_len, h] };
    super::same_shape(op, "lse", lse_shape, lse.shape())?;
    if b != batch.batch || d != cache.head_dim {
        return Err(Error::Shape(format!(
            "{op}: q {:?} vs batch of {} and head_dim {}",
            q.shape(),
            batch.batch,
            cache.head_dim
        )));
    }
    if h == 0 || h % cache.n_kv_heads != 0 {
        return Err(Error::Shape(format!("{op}: {h} query heads over {} KV heads", cache.n_kv_heads)));
    }
    // (q_len = 1 keeps allowing an empty sequence: its row comes out 0, LSE −inf.)
    if q_len == 0 || q_len > MAX_Q_LEN || (q_len > 1 && batch.min_len < q_len) {
        return Err(Error::InvalidArgument(format!(
            "{op}: {q_len} new queries per sequence (1 to {MAX_Q_LEN}, and no more than the shortest sequence's {})",
            batch.min_len
        )));
    }
    let scale = scale.unwrap_or(1.0 / (d as f32).sqrt());
    if !scale.is_finite() || scale <= 0.0 {
        return Err(Error::InvalidArgument(format!("{op}: scale {scale}")));
    }
    let group = h / cache.n_kv_heads;
    // A wide block is its warps' one-warp rings side by side: each a Q tile and
    // `stages` K/V stages.
    let ring_bytes = |stages: usize| (ROW_TILE + 2 * stages * KEY_TILE) * d * 2;
    let (wide_warps, wide_stages) = if version == DecodeVersion::Wide8 { (WIDE8_WARPS, 1) } else { (WIDE_WARPS, 2) };
    // Wide blocks need 144–160 KB at head dim 128: GPUs with 99 KB per block
    // (sm_86/89/120) take `Fused` instead (1 KB for statics).
    let version = version.resolve(
        q_len == 1
            && group <= ROW_TILE
            && wide_warps * ring_bytes(wide_stages) + 1024 <= gpu.info().max_shared_per_block_optin as usize,
    );
    let wide = matches!(version, DecodeVersion::Wide | DecodeVersion::Cluster | DecodeVersion::Wide8);
    let fused = version != DecodeVersion::TwoLaunch;
    let mut kernel = match (version, fused) {
        (_, true) if wide => wide_kernel(d, wide_warps),
        (_, true) => fused_kernel(d, q_len, group),
        (_, false) => split_kernel(d, q_len, group),
    };
    let (warps, stages) = if wide { (wide_warps, wide_stages) } else { (1, 2) };
    let (threads, smem) = (SPLIT_THREADS * warps as u32, (warps * ring_bytes(stages)) as u32);
    let per_sm = gpu.occupancy(crate::kernels::lookup::<abi::DecodeArgs>(kernel)?, threads, smem)?.max(1) as usize;
    // Blocks along x: each KV head's (query token, head) rows in tiles of 16.
    let row_tiles = (h / cache.n_kv_heads * q_len).div_ceil(ROW_TILE);
    let x_blocks = cache.n_kv_heads * row_tiles;
    if x_blocks > i32::MAX as usize || b * q_len > 65535 {
        return Err(Error::TooLarge(format!("{op}: grid for {b} sequences × {q_len} queries × {h} heads")));
    }
    let sm_count = gpu.info().sm_count as usize;
    let (mut splits, mut chunk) = if wide && per_sm == 1 {
        choose_splits_waves(b, x_blocks, batch.plan_len, sm_count, KEY_TILE * warps)
    } else {
        choose_splits(b, x_blocks, batch.plan_len, sm_count, per_sm, KEY_TILE * warps)
    };
    // Cluster: the most splits (2 to 16, at most choose_splits') whose clusters
    // all fit at once. A cluster runs inside one GPC, and on the H200 only 7
    // clusters of 16 one-block-per-SM blocks fit (session 7), not b1 L4096's 8.
    let mut clustered = false;
    if version == DecodeVersion::Cluster && d == 128 && gpu.info().arch == crate::runtime::Arch::Sm90a {
        let tiles = batch.plan_len.div_ceil(KEY_TILE * warps).max(1);
        for want in (2..=splits.min(MAX_CLUSTER)).rev() {
            let chunk_tiles = tiles.div_ceil(want);
            let s = tiles.div_ceil(chunk_tiles);
            if s >= 2 && cluster_capacity(gpu, s)? as usize >= b * x_blocks {
                (splits, chunk, clustered) = (s, chunk_tiles * KEY_TILE * warps, true);
                break;
            }
        }
    }
    // Each warp of a block takes chunk / warps keys: whole key tiles, none left over.
    debug_assert!(chunk % (KEY_TILE * warps) == 0);
    let grid = (x_blocks as u32, splits as u32, b as u32);
    // A cluster per (sequence, KV head): its splits along y, all resident at once.
    let cluster = (1, splits as u32, 1);
    if clustered {
        kernel = CLUSTER_KERNEL;
    }
    let rows = b * q_len * h * splits;
    // The fused merge passes partial-row indices between lanes as u32.
    if fused && rows > u32::MAX as usize {
        return Err(Error::TooLarge(format!("{op}: {rows} partial rows")));
    }
    let partials = cache.partials(rows * (d + 1))?;
    let counters = if fused { cache.counters(b * x_blocks)? } else { 0 };
    let args = abi::DecodeArgs {
        q: q.device_ptr(),
        k_pool: cache.k.device_ptr(),
        v_pool: cache.v.device_ptr(),
        page_table: batch.page_table,
        seq_lens: batch.seq_lens,
        o_partial: partials,
        lse_partial: partials + (rows * d * 4) as u64,
        out: out.device_ptr(),
        lse: lse.device_ptr(),
        n_heads: h as u32,
        n_kv_heads: cache.n_kv_heads as u32,
        page_size: cache.alloc.page_size() as u32,
        max_pages: batch.max_pages as u32,
        chunk: chunk as u32,
        splits: splits as u32,
        scale_log2: scale * std::f32::consts::LOG2_E,
        q_len: q_len as u32,
        group: group as u32,
        page_shift: page_shift(cache.alloc.page_size()),
        counters,
    };
    // SAFETY: page tables list only pages each sequence owns; partials hold
    // rows × (d + 1) f32; the counters (fused) are b × x_blocks zero u32; every
    // sequence holds at least q_len tokens; shapes were checked above.
    // Both kernels wait for earlier kernels before touching memory: they may overlap.
    unsafe {
        if clustered {
            return gpu.launch_cluster_after(crate::kernels::lookup(kernel)?, grid, cluster, threads, smem, &args);
        }
        gpu.launch_after(crate::kernels::lookup(kernel)?, grid, threads, smem, &args)?;
        if fused {
            return Ok(());
        }
        let threads = (d * merge_groups(splits)) as u32;
        gpu.launch_after(crate::kernels::DECODE_MERGE, (h as u32, (b * q_len) as u32, 1), threads, 0, &args)
    }
}

/// [`abi::DecodeArgs::page_shift`] for pages of `page_size` tokens.
fn page_shift(page_size: usize) -> u32 {
    if page_size.is_power_of_two() {
        page_size.trailing_zeros()
    } else {
        abi::NO_PAGE_SHIFT
    }
}

/// The split kernel for head dim `d`, `q_len` new queries per sequence and query
/// groups of `group` heads: one query with a group that fits one m16 row tile (the
/// common decode step) takes the plain entry, compiled without the (token, head)
/// row mapping and per-row causal limits; speculative steps and wider groups take
/// the `spec` entry.
pub fn split_kernel(d: usize, q_len: usize, group: usize) -> &'static str {
    match (d == 64, q_len == 1 && group <= ROW_TILE) {
        (true, true) => "decode_split_hd64",
        (false, true) => "decode_split_hd128",
        (true, false) => "decode_split_spec_hd64",
        (false, false) => "decode_split_spec_hd128",
    }
}

/// [`DecodeVersion::Cluster`]'s kernel (head dim 128, sm_90a module only).
pub const CLUSTER_KERNEL: &str = "decode_cluster_hd128";
/// Most blocks in one cluster on Hopper (past the portable 8).
const MAX_CLUSTER: usize = 16;

/// How many clusters of `splits` blocks of [`CLUSTER_KERNEL`] (one per KV head and
/// sequence) fit on `gpu` at once; 0 off Hopper. [`DecodeVersion::Cluster`] needs
/// one per (sequence, KV head).
pub fn cluster_capacity(gpu: &Gpu, splits: usize) -> Result<u32> {
    if gpu.info().arch != crate::runtime::Arch::Sm90a || !(1..=MAX_CLUSTER).contains(&splits) {
        return Ok(0);
    }
    let smem = (WIDE_WARPS * (ROW_TILE + 4 * KEY_TILE) * 128 * 2) as u32;
    let grid = (1, splits as u32, 1);
    gpu.max_active_clusters(
        crate::kernels::lookup::<abi::DecodeArgs>(CLUSTER_KERNEL)?,
        grid,
        grid,
        SPLIT_THREADS * WIDE_WARPS as u32,
        smem,
    )
}

/// The many-warp fused entry for head dim `d`: [`DecodeVersion::Wide`]'s 4 warps
/// of two K/V stages, or [`DecodeVersion::Wide8`]'s 8 warps of one.
pub fn wide_kernel(d: usize, warps: usize) -> &'static str {
    match (d == 64, warps == WIDE8_WARPS) {
        (true, false) => "decode_wide_hd64",
        (false, false) => "decode_wide_hd128",
        (true, true) => "decode_wide8_hd64",
        (false, true) => "decode_wide8_hd128",
    }
}

/// [`split_kernel`]'s choice among the fused entries, which also merge.
pub fn fused_kernel(d: usize, q_len: usize, group: usize) -> &'static str {
    match (d == 64, q_len == 1 && group <= ROW_TILE) {
        (true, true) => "decode_fused_hd64",
        (false, true) => "decode_fused_hd128",
        (true, false) => "decode_fused_spec_hd64",
        (false, false) => "decode_fused_spec_hd128",
    }
}

/// Every decode kernel with its block size (for the PTX consistency test).
pub const KERNELS: &[(&str, u32)] = &[
    ("decode_split_hd64", 32),
    ("decode_split_hd128", 32),
    ("decode_split_spec_hd64", 32),
    ("decode_split_spec_hd128", 32),
    ("decode_fused_hd64", 32),
    ("decode_fused_hd128", 32),
    ("decode_fused_spec_hd64", 32),
    ("decode_fused_spec_hd128", 32),
    ("decode_wide_hd64", 128),
    ("decode_wide_hd128", 128),
    ("decode_wide8_hd64", 256),
    ("decode_wide8_hd128", 256),
    ("decode_merge", 512),
    ("kv_append", 256),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_frees_reuses_and_refuses_when_full() {
        let mut a = PageAllocator::new(4, 16).unwrap();
        let (s1, s2) = (a.add_sequence(), a.add_sequence());
        a.grow(s1, 17).unwrap(); // two pages
        assert_eq!(a.pages(s1).unwrap(), &[0, 1]);
        a.grow(s2, 32).unwrap(); // two more: the pool is full
        assert_eq!(a.free_pages(), 0);
        a.grow(s1, 15).unwrap(); // fits in s1's second page
        assert_eq!(a.len(s1).unwrap(), 32);
        // Exhaustion: an error, and nothing changes.
        assert!(matches!(a.grow(s1, 1), Err(Error::TooLarge(_))));
        assert_eq!((a.len(s1).unwrap(), a.pages(s1).unwrap().len()), (32, 2));
        a.release(s2).unwrap();
        assert_eq!(a.free_pages(), 2);
        let s3 = a.add_sequence();
        a.grow(s3, 20).unwrap();
        assert_eq!(a.pages(s3).unwrap(), &[2, 3]);
        assert!(a.len(s2).is_err());
    }

    #[test]
    fn splits_fill_whole_waves() {
        // 6 blocks per SM on 132 SMs: 792 at once.
        let waves = |b: usize, len: usize| {
            let (splits, chunk) = choose_splits(b, 8, len, 132, 6, KEY_TILE);
            assert_eq!(chunk % KEY_TILE, 0);
            assert!((splits - 1) * chunk < len && splits * chunk >= len, "b{b} L{len}: {splits} × {chunk}");
            (b * 8 * splits) as f64 / 792.0
        };
        // b16: 6 splits (768 blocks, one wave) rather than 7 (896: 1.13 waves).
        assert_eq!(choose_splits(16, 8, 4096, 132, 6, KEY_TILE).0, 6);
        for (b, len) in [(16, 4096), (64, 4096), (8, 32768), (1, 131072)] {
            let w = waves(b, len);
            assert!(w.fract() == 0.0 || w.fract() > 0.9 || (w < 1.0 && w > 0.9), "b{b} L{len}: {w} waves");
        }
        assert_eq!(choose_splits(1, 8, 1, 132, 6, KEY_TILE), (1, 32));
        assert_eq!(choose_splits(1, 8, 4096, 132, 6, KEY_TILE).0, 64);
        // Wide blocks (one per SM, 4 × 32-key sub-chunks): 16 splits of 256 keys.
        assert_eq!(choose_splits(1, 8, 4096, 132, 1, KEY_TILE * WIDE_WARPS), (16, 256));
        // The fill rule's two full waves at b1 L4097 (the layer's steps), three at L131072.
        assert_eq!(choose_splits(1, 8, 4097, 132, 1, KEY_TILE * WIDE_WARPS).0, 33);
        assert_eq!(choose_splits(1, 8, 131072, 132, 1, KEY_TILE * WIDE_WARPS).0, 49);
        // The wave-cost rule: one wave wherever one wave holds the work.
        let waves = |b: usize, len: usize| choose_splits_waves(b, 8, len, 132, KEY_TILE * WIDE_WARPS);
        assert_eq!(waves(1, 4096), (16, 256));
        assert_eq!(waves(1, 4097), (11, 384));
        assert_eq!(waves(1, 131072).0, 16);
        assert_eq!(waves(8, 32768).0, 2);
        assert_eq!(waves(16, 4096).0, 1);
        assert_eq!(waves(64, 4096).0, 1);
        assert_eq!(waves(1, 1), (1, 128));
        // Eight one-tile warps per block: b1 L4096 gives each warp one key tile.
        assert_eq!(choose_splits_waves(1, 8, 4096, 132, KEY_TILE * WIDE8_WARPS), (16, 256));
    }

    #[test]
    fn plain_kernel_for_one_query_and_one_row_tile() {
        assert_eq!(split_kernel(128, 1, 4), "decode_split_hd128");
        assert_eq!(split_kernel(64, 1, 16), "decode_split_hd64");
        assert_eq!(split_kernel(64, 1, 17), "decode_split_spec_hd64");
        assert_eq!(split_kernel(128, 2, 4), "decode_split_spec_hd128");
        assert_eq!(split_kernel(64, 8, 1), "decode_split_spec_hd64");
        assert_eq!(fused_kernel(128, 1, 4), "decode_fused_hd128");
        assert_eq!(fused_kernel(64, 1, 17), "decode_fused_spec_hd64");
        assert_eq!(fused_kernel(128, 2, 4), "decode_fused_spec_hd128");
    }

    #[test]
    fn auto_takes_wide_where_it_applies() {
        assert_eq!(DecodeVersion::Auto.resolve(true), DecodeVersion::Wide);
        assert_eq!(DecodeVersion::Auto.resolve(false), DecodeVersion::TwoLaunch);
        assert_eq!(DecodeVersion::Wide.resolve(false), DecodeVersion::Fused);
        assert_eq!(DecodeVersion::Cluster.resolve(true), DecodeVersion::Cluster);
        assert_eq!(DecodeVersion::Cluster.resolve(false), DecodeVersion::Fused);
        assert_eq!(DecodeVersion::Wide8.resolve(true), DecodeVersion::Wide8);
        assert_eq!(DecodeVersion::Wide8.resolve(false), DecodeVersion::Fused);
        assert_eq!(DecodeVersion::Fused.resolve(true), DecodeVersion::Fused);
        assert_eq!(DecodeVersion::TwoLaunch.resolve(true), DecodeVersion::TwoLaunch);
    }
}
