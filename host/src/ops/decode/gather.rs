//! Rows of a layer's cache copied into contiguous K and V (`kv_gather`): the
//! keys FlashAttention reads for a prompt chunk whose sequence already holds
//! earlier chunks.

use super::batch::DecodeBatch;
use super::cache::{KvLayer, PagedKvCache};
use super::pages::SeqId;
use crate::error::{cuda, Error, Result};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use cust::memory::DeviceBuffer;
use half::bf16;
use std::marker::PhantomData;
use std::ops::Range;

/// Threads per `kv_gather` block (its launch bound), one 16-byte unit of K and of V each.
const GATHER_THREADS: u32 = crate::kernels::KV_GATHER.max_threads();

/// A run of positions of the sequence in one row of a batch.
pub(crate) type Run = (u32, Range<u32>);

/// The rows a gather copies, in order: runs of positions of a batch's
/// sequences (checked on the host, a run at a time), and the same rows one by
/// one on the GPU (each row's batch row and position, what the kernel reads),
/// made from the runs, so the two agree. The device arrays are in buffers of
/// its own, or in a step's uploaded words, which it borrows for its life.
pub(crate) struct GatherRows<'a> {
    runs: Vec<Run>,
    rows: usize,
    seq_ptr: u64,
    pos_ptr: u64,
    _owned: Option<(DeviceBuffer<u32>, DeviceBuffer<u32>)>,
    _bufs: PhantomData<&'a ()>,
}

/// Each row of `runs`, in order: its batch row, and its position.
pub(crate) fn expand(runs: &[Run]) -> (Vec<u32>, Vec<u32>) {
    let (mut seq, mut pos) = (Vec::new(), Vec::new());
    for (row, r) in runs {
        seq.extend(std::iter::repeat_n(*row, r.len()));
        pos.extend(r.clone());
    }
    (seq, pos)
}

/// The rows `runs` name: at least one.
fn count_rows(runs: &[Run]) -> Result<usize> {
    let rows = runs.iter().map(|(_, r)| r.len()).sum();
    if rows == 0 {
        return Err(Error::Empty("kv_gather: no rows".into()));
    }
    Ok(rows)
}

impl GatherRows<'static> {
    pub(crate) fn owned(_gpu: &Gpu, runs: Vec<Run>) -> Result<GatherRows<'static>> {
        let rows = count_rows(&runs)?;
        let (seq, pos) = expand(&runs);
        let (s, p) = (
            DeviceBuffer::from_slice(&seq).map_err(cuda("cuMemcpyHtoD"))?,
            DeviceBuffer::from_slice(&pos).map_err(cuda("cuMemcpyHtoD"))?,
        );
        crate::tensor::uploaded()?;
        let (seq_ptr, pos_ptr) = (s.as_device_ptr().as_raw(), p.as_device_ptr().as_raw());
        Ok(GatherRows { runs, rows, seq_ptr, pos_ptr, _owned: Some((s, p)), _bufs: PhantomData })
    }
}

impl<'a> GatherRows<'a> {
    /// `runs`, whose rows ([`expand`]) are at `seq_ptr` and `pos_ptr`.
    ///
    /// # Safety
    /// The addresses must hold `expand(&runs)`, copied in on the stream before
    /// any launch that reads them, and stay so for `'a`.
    pub(crate) unsafe fn in_step(runs: Vec<Run>, seq_ptr: u64, pos_ptr: u64) -> Result<GatherRows<'a>> {
        let rows = count_rows(&runs)?;
        Ok(GatherRows { runs, rows, seq_ptr, pos_ptr, _owned: None, _bufs: PhantomData })
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Every run lies inside its sequence of `batch` (so each row's page is one
    /// of the sequence's own).
    fn check(&self, op: &str, batch: &DecodeBatch) -> Result<()> {
        let lens = batch.lens();
        for (row, r) in &self.runs {
            match lens.get(*row as usize) {
                Some(&len) if r.end <= len => {}
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "{op}: positions {r:?} of row {row} of a batch with lengths {lens:?}"
                    )))
                }
            }
        }
        Ok(())
    }
}

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
        let op = "kv_gather";
        if seqs.len() != ranges.len() {
            return Err(Error::InvalidArgument(format!("{op}: {} sequences, {} ranges", seqs.len(), ranges.len())));
        }
        let mut runs = Vec::with_capacity(ranges.len());
        for (i, r) in ranges.iter().enumerate() {
            let (start, end) = (u32::try_from(r.start), u32::try_from(r.end));
            let (Ok(start), Ok(end)) = (start, end) else {
                return Err(Error::TooLarge(format!("{op}: positions {r:?}")));
            };
            if start > end {
                return Err(Error::InvalidArgument(format!("{op}: positions {r:?} run backwards")));
            }
            runs.push((i as u32, start..end));
        }
        let rows = count_rows(&runs)?;
        let shape = [rows, self.n_kv_heads(), self.head_dim()];
        crate::ops::same_shape(op, "k", &shape, k_out.shape())?;
        crate::ops::same_shape(op, "v", &shape, v_out.shape())?;
        let layer = self.layer(layer)?;
        let batch = self.batch(gpu, seqs)?;
        let rows = GatherRows::owned(gpu, runs)?;
        gather_rows(gpu, layer, &batch, &rows, k_out, v_out)
    }
}

/// `kv_gather` of `rows` (runs of `batch`'s sequences, which must be
/// `cache`'s) into the first `rows` rows of `k_out` and `v_out` (`[at least
/// rows, n_kv_heads, head_dim]`; rows past them are left as they are).
pub(crate) fn gather_rows(
    gpu: &Gpu,
    cache: KvLayer,
    batch: &DecodeBatch,
    rows: &GatherRows,
    k_out: &mut Tensor<bf16>,
    v_out: &mut Tensor<bf16>,
) -> Result<()> {
    let op = "kv_gather";
    batch.check_cache(op, cache.id())?;
    let (kv, hd) = (cache.n_kv_heads(), cache.head_dim());
    for (name, t) in [("k", &*k_out), ("v", &*v_out)] {
        if !matches!(*t.shape(), [n, h, d] if n >= rows.rows() && h == kv && d == hd) {
            return Err(Error::Shape(format!("{op}: {name} is {:?}, not [≥ {}, {kv}, {hd}]", t.shape(), rows.rows())));
        }
    }
    rows.check(op, batch)?;
    // head_dim is 64 or 128 (the cache checks it): whole 16-byte units.
    let row_units = kv * hd / 8;
    let units = rows
        .rows()
        .checked_mul(row_units)
        .filter(|&u| u <= (u32::MAX - GATHER_THREADS) as usize)
        .ok_or_else(|| Error::TooLarge(format!("{op}: {} rows of {row_units} units", rows.rows())))?;
    let (k_pool, v_pool) = cache.pools();
    let args = abi::KvGatherArgs {
        k_pool,
        v_pool,
        page_table: batch.page_table_ptr(),
        token_seq: rows.seq_ptr,
        token_pos: rows.pos_ptr,
        k_out: k_out.device_ptr(),
        v_out: v_out.device_ptr(),
        rows: rows.rows() as u32,
        row_units: row_units as u32,
        page_size: cache.page_size() as u32,
        max_pages: batch.max_pages() as u32,
    };
    let blocks = (units as u32).div_ceil(GATHER_THREADS);
    // SAFETY: the batch is this cache's, and the device rows are the runs' (by
    // construction), each inside its sequence, so every row's page is one of
    // the sequence's own (a page of these pools); the outputs hold at least
    // `rows × row_units` 16-byte units, and the kernel's unit index stays within
    // u32 (checked above).
    unsafe { gpu.launch(crate::kernels::KV_GATHER, (blocks, 1, 1), GATHER_THREADS, 0, &args) }
}
