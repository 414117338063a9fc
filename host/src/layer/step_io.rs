//! What a step reads that the host prepares: the page tables, lengths, token
//! slots and varlen offsets of its sequences, uploaded in one copy into a
//! buffer a layer or a model reuses step after step (a captured graph's fixed
//! one), a mixed step's running rows, and the keys of prompts that continue
//! earlier chunks.

use super::block::{token_bucket, Step};
use super::LayerConfig;
use crate::error::{cuda, Error, Result};
use crate::ops::attention::offsets_of_lengths;
use crate::ops::decode::{expand_runs, upload_async, DecodeBatch, GatherRows, PagedKvCache, Run, SeqId, Tables};
use crate::ops::rope::TokenSlots;
use crate::ops::VarlenBatch;
use crate::runtime::{Gpu, GrowOnlyBuffer};
use crate::tensor::Tensor;
use cust::memory::DeviceBuffer;
use half::bf16;
use std::cell::RefCell;

/// The running sequences of a mixed step: their decode batch (in the order of
/// the step's last rows) and the attention buffers of their rows.
pub(crate) struct DecodeTail<'a> {
    pub batch: DecodeBatch<'a>,
    pub bufs: &'a RefCell<TailRows>,
}

/// `[rows, heads, head_dim]` q and o, `[rows, heads]` LSE of a mixed step's
/// running rows: every element is written before it is read in a step.
pub(crate) type TailRows = (Tensor<bf16>, Tensor<bf16>, Tensor<f32>);

/// A prefill step whose prompts continue earlier chunks: the varlen pass reads
/// each prompt's whole sequence (and each running row's own token), gathered
/// from the cache into the first `rows` rows of `bufs`.
pub(crate) struct CachedKeys<'a> {
    pub rows: GatherRows<'a>,
    pub bufs: &'a RefCell<KeyRows>,
}

/// `[capacity, n_kv_heads, head_dim]` K and V gathered for the varlen pass,
/// zeros at first: the gather writes the step's rows before the pass reads
/// them, and the rows past them (a sequence of keys without queries, which
/// the last sequence's final tile may read, masked) hold zeros or earlier
/// steps' keys, finite either way.
pub(crate) type KeyRows = (Tensor<bf16>, Tensor<bf16>);

fn tail_rows_new(gpu: &Gpu, cfg: &LayerConfig, rows: usize) -> Result<TailRows> {
    let (h, hd) = (cfg.n_heads, cfg.head_dim);
    Ok((
        Tensor::filled(gpu, &[rows, h, hd], bf16::ZERO)?,
        Tensor::filled(gpu, &[rows, h, hd], bf16::ZERO)?,
        Tensor::filled(gpu, &[rows, h], 0.0f32)?,
    ))
}

/// The running rows' buffers shaped for `rows`, at most their capacity.
fn tail_rows_fit((q, o, lse): &mut TailRows, cfg: &LayerConfig, rows: usize) -> Result<()> {
    let (h, hd) = (cfg.n_heads, cfg.head_dim);
    q.refit(&[rows, h, hd])?;
    o.refit(&[rows, h, hd])?;
    lse.refit(&[rows, h])
}

/// The device buffer a layer (or a model) reuses for each step's page tables,
/// lengths, token slots and sequence offsets, all uploaded by one copy on the
/// stream: it queues behind the launches of the step before (which read the
/// old contents), and the host never waits, where buffers of a step's own
/// would take an allocation and a synchronous copy each and drain the device
/// when freed. One copy, not one an array: each is a driver call made before
/// the step's first launch, while the GPU waits. Captured graphs keep buffers
/// of their own.
#[derive(Default)]
pub(crate) struct StepBuffers {
    words: GrowOnlyBuffer<u32>,
    /// A mixed step's running rows' attention buffers, for the last bucket of
    /// their counts ([`token_bucket`]: made again when a count falls outside it).
    tail_rows: Option<(usize, RefCell<TailRows>)>,
    /// The gathered keys of steps whose prompts continue earlier chunks, and
    /// their capacity in rows (grown by half again when a step needs more, so a
    /// long prompt's chunks reallocate a few times, not each step).
    key_rows: Option<(usize, RefCell<KeyRows>)>,
}

/// What a step reads, uploaded into [`StepBuffers`] it borrows.
pub(crate) struct Staged<'a> {
    batch: DecodeBatch<'a>,
    slots: TokenSlots<'a>,
    varlen: Option<VarlenBatch<'a>>,
    tail: Option<DecodeTail<'a>>,
    keys: Option<CachedKeys<'a>>,
}

impl Staged<'_> {
    /// The step of `lens[i]` tokens of each sequence from `starts[i]`.
    pub fn step<'s>(&'s self, lens: &'s [usize], starts: &'s [usize]) -> Step<'s> {
        Step {
            lens,
            starts,
            batch: &self.batch,
            slots: &self.slots,
            varlen: self.varlen.as_ref(),
            tail: self.tail.as_ref(),
            keys: self.keys.as_ref(),
        }
    }
}

/// Arrays packed for one upload, each starting 16 bytes on.
#[derive(Default)]
struct Words(Vec<u32>);

impl Words {
    /// Appends `w`; its offset in words.
    fn push(&mut self, w: &[u32]) -> usize {
        let at = self.0.len();
        self.0.extend_from_slice(w);
        self.0.resize(self.0.len().next_multiple_of(4), 0);
        at
    }
}

/// A step's page tables, lengths and token slots on the host, as both kinds
/// of step buffer upload them: the first four arrays of its [`Words`].
struct BatchWords {
    tables: Tables,
    seq: Vec<u32>,
    pos: Vec<u32>,
}

impl BatchWords {
    /// `tables`, and the slots of `lens[i]` tokens of sequence i from `starts[i]`.
    fn new(tables: Tables, starts: &[usize], lens: &[usize]) -> BatchWords {
        let (seq, pos) = token_slots(starts, lens);
        BatchWords { tables, seq, pos }
    }

    /// Appends the four arrays to `words`; their offsets.
    fn push(&self, words: &mut Words) -> [usize; 4] {
        [words.push(&self.tables.table), words.push(&self.tables.lens), words.push(&self.seq), words.push(&self.pos)]
    }

    /// The batch of `cache` (planned for `plan_len`, `None`: its longest
    /// sequence) and the slots, at `addr` of the offsets `push` gave.
    ///
    /// # Safety
    /// As [`DecodeBatch::in_step`] and [`TokenSlots::in_step`]: the addresses
    /// hold the pushed words, uploaded before any launch that reads them, for `'a`.
    unsafe fn bind<'a>(
        self,
        cache: &PagedKvCache,
        addr: impl Fn(usize) -> u64,
        at: [usize; 4],
        plan_len: Option<usize>,
    ) -> Result<(DecodeBatch<'a>, TokenSlots<'a>)> {
        let slots = TokenSlots::in_step(&self.seq, &self.pos, addr(at[2]), addr(at[3]))?;
        Ok((DecodeBatch::in_step(cache.id(), self.tables, addr(at[0]), addr(at[1]), plan_len), slots))
    }
}

impl StepBuffers {
    /// Bytes of what it keeps between steps beside the uploaded words: a mixed
    /// step's running rows' buffers and the gathered keys (freed by dropping it).
    pub fn bytes(&self) -> usize {
        let tail = self.tail_rows.as_ref().map_or(0, |(_, b)| {
            let (q, o, lse) = &*b.borrow();
            q.capacity_bytes() + o.capacity_bytes() + lse.capacity_bytes()
        });
        let keys = self.key_rows.as_ref().map_or(0, |(_, b)| {
            let (k, v) = &*b.borrow();
            k.size_bytes() + v.size_bytes()
        });
        tail + keys
    }

    /// `seqs`' batch and the slots of their `lens[i]` tokens from `starts[i]`;
    /// for prefill also the varlen offsets, and for a mixed step (`running` of
    /// `cfg`'s rows: the last sequences, one token each) their decode batch and
    /// attention buffers. A prefill's keys are its own tokens, unless a prompt
    /// continues earlier chunks (`starts[i] > 0`): then each prompt's keys are
    /// its whole sequence, gathered from the cache with the running rows' own
    /// (the rows and buffers of the gather come with the step), and a last
    /// sequence without queries holds the buffers' rows past them. Nothing is
    /// launched.
    #[allow(clippy::too_many_arguments)]
    pub fn stage(
        &mut self,
        gpu: &Gpu,
        cache: &PagedKvCache,
        seqs: &[SeqId],
        starts: &[usize],
        lens: &[usize],
        prefill: bool,
        running: Option<(&LayerConfig, usize)>,
    ) -> Result<Staged<'_>> {
        let running = running.filter(|&(_, n)| n > 0);
        let rows = BatchWords::new(cache.step_tables(seqs)?, starts, lens);
        let tail_tables = running.map(|(_, n)| cache.step_tables(&seqs[seqs.len() - n..])).transpose()?;
        let prompts = seqs.len() - running.map_or(0, |(_, n)| n);
        let (mut key_lens, key_runs) = if prefill { varlen_keys(starts, lens, prompts) } else { (Vec::new(), None) };
        if let Some(runs) = &key_runs {
            let keys: usize = runs.iter().map(|(_, r)| r.len()).sum();
            let cap = self.key_rows.as_ref().map_or(0, |(c, _)| *c);
            if keys > cap {
                // Stream-ordered work of earlier steps may still use the old
                // buffers: freeing them waits for it.
                self.key_rows = None;
                let rows = keys.max(cap + cap / 2);
                let shape = [rows, cache.n_kv_heads(), cache.head_dim()];
                let bufs = (Tensor::filled(gpu, &shape, bf16::ZERO)?, Tensor::filled(gpu, &shape, bf16::ZERO)?);
                self.key_rows = Some((rows, RefCell::new(bufs)));
            }
        }
        let offsets = if prefill {
            let cap = key_runs.as_ref().and(self.key_rows.as_ref()).map(|(cap, _)| *cap);
            let q_lens = pad_to_capacity(lens, &mut key_lens, cap);
            Some(offsets_of_lengths(&q_lens, &key_lens)?)
        } else {
            None
        };
        // The allocations come before the upload (the slots' checks after it
        // only refuse the step: no launch of it is queued, and the next
        // step's upload rewrites every word).
        if let Some((cfg, n)) = running {
            let bucket = token_bucket(n);
            if self.tail_rows.as_ref().is_none_or(|(b, _)| *b != bucket) {
                // Stream-ordered work of earlier steps may still use the old
                // buffers: freeing them waits for it.
                self.tail_rows = Some((bucket, RefCell::new(tail_rows_new(gpu, cfg, bucket)?)));
            }
            let (_, bufs) = self.tail_rows.as_mut().expect("made above");
            tail_rows_fit(bufs.get_mut(), cfg, n)?;
        }
        let mut words = Words::default();
        let at = rows.push(&mut words);
        let at_offsets = offsets.as_ref().map(|(q, k)| [words.push(q), words.push(k)]);
        let at_tail = tail_tables.as_ref().map(|t| [words.push(&t.table), words.push(&t.lens)]);
        let at_keys = key_runs.as_ref().map(|runs| {
            let (seq, pos) = expand_runs(runs);
            [words.push(&seq), words.push(&pos)]
        });
        let base = self.words.upload(gpu, &words.0)?;
        let addr = |i: usize| base + 4 * i as u64;
        // SAFETY: each address holds the words pushed at its offset, copied in
        // on the stream before any launch of the step; the result borrows
        // `self`, so no later step's upload overwrites them while it lives.
        unsafe {
            let (batch, slots) = rows.bind(cache, addr, at, None)?;
            let varlen =
                offsets.zip(at_offsets).map(|((q, k), [aq, ak])| VarlenBatch::in_step(q, k, addr(aq), addr(ak)));
            let tail = match (tail_tables, at_tail, &self.tail_rows) {
                (Some(t), Some([a_table, a_lens]), Some((_, bufs))) => Some(DecodeTail {
                    batch: DecodeBatch::in_step(cache.id(), t, addr(a_table), addr(a_lens), None),
                    bufs,
                }),
                _ => None,
            };
            let keys = match (key_runs, at_keys, &self.key_rows) {
                (Some(runs), Some([a_seq, a_pos]), Some((_, bufs))) => {
                    Some(CachedKeys { rows: GatherRows::in_step(runs, addr(a_seq), addr(a_pos))?, bufs })
                }
                _ => None,
            };
            Ok(Staged { batch, slots, varlen, tail, keys })
        }
    }
}

/// Words of a graph's buffer for `batch` sequences of `max_pages` pages: the
/// page table, the lengths and the two slot arrays, as [`Words`] packs them.
fn graph_words_len(batch: usize, max_pages: usize) -> usize {
    (batch * max_pages).next_multiple_of(4) + 3 * batch.next_multiple_of(4)
}

/// A captured decode step's page tables, lengths and token slots (one token a
/// sequence), in one fixed device buffer, refreshed by one copy before each
/// replay: the graph's launches keep its addresses.
pub(crate) struct GraphWords {
    buf: DeviceBuffer<u32>,
    batch: usize,
    max_pages: usize,
}

impl GraphWords {
    /// For `batch` sequences of at most `max_pages` pages each.
    pub fn new(batch: usize, max_pages: usize) -> Result<GraphWords> {
        if batch == 0 || max_pages == 0 || batch > crate::ops::decode::MAX_BATCH {
            return Err(Error::InvalidArgument(format!("graph buffers for {batch} sequences × {max_pages} pages")));
        }
        if batch.checked_mul(max_pages).is_none_or(|n| n > u32::MAX as usize) {
            return Err(Error::TooLarge(format!("graph buffers for {batch} sequences × {max_pages} pages")));
        }
        let len = graph_words_len(batch, max_pages);
        // No zeroing memset: it would run on the legacy stream, unordered with the
        // uploads on ours; every use is preceded by an upload of every word.
        // SAFETY: u32 has no invalid bit patterns.
        let buf = unsafe { DeviceBuffer::uninitialized(len) }.map_err(cuda("cuMemAlloc"))?;
        Ok(GraphWords { buf, batch, max_pages })
    }

    /// Uploads the page tables and lengths of `seqs` (planned for `plan_len`
    /// tokens) and the slots of their next tokens, at positions `starts`, in
    /// one copy on the stream; the batch and slots borrow the buffer.
    pub fn stage<'a>(
        &'a mut self,
        gpu: &Gpu,
        cache: &PagedKvCache,
        seqs: &[SeqId],
        starts: &[usize],
        plan_len: usize,
    ) -> Result<(DecodeBatch<'a>, TokenSlots<'a>)> {
        if seqs.len() != self.batch || starts.len() != self.batch {
            return Err(Error::Shape(format!("{} sequences into graph buffers for {}", seqs.len(), self.batch)));
        }
        let rows =
            BatchWords::new(cache.planned_tables(seqs, self.max_pages, plan_len)?, starts, &vec![1; starts.len()]);
        let mut words = Words::default();
        let at = rows.push(&mut words);
        // Sizes fixed by `new`: the layout is the same every step, as the
        // graph's launches read it.
        if words.0.len() != self.buf.len() {
            return Err(Error::Shape(format!("{} words into graph buffers of {}", words.0.len(), self.buf.len())));
        }
        upload_async(gpu, &self.buf, &words.0)?;
        let addr = |i: usize| self.buf.as_device_ptr().as_raw() + 4 * i as u64;
        // SAFETY: each address holds the words pushed at its offset, copied in
        // on the stream before any launch that reads them; the results borrow
        // `self`, so nothing overwrites them while they live.
        unsafe { rows.bind(cache, addr, at, Some(plan_len)) }
    }
}

impl Drop for StepBuffers {
    fn drop(&mut self) {
        // Queued launches may still read the buffers about to be freed.
        let _ = cust::context::CurrentContext::synchronize();
    }
}

/// Runs `f` on the mixed step of `seqs` (the prompts, then the last `running`
/// sequences with one token each) as [`admit_mixed`] admitted them (`starts`,
/// `lens`), staged in `bufs`: the running tokens are one-token sequences to the
/// varlen pass, and their decode batch makes the step's tail.
#[allow(clippy::too_many_arguments)]
pub(crate) fn with_mixed_step<R>(
    gpu: &Gpu,
    bufs: &mut StepBuffers,
    cache: &PagedKvCache,
    cfg: &LayerConfig,
    seqs: &[SeqId],
    running: usize,
    starts: &[usize],
    lens: &[usize],
    f: impl FnOnce(&Step) -> Result<R>,
) -> Result<R> {
    let staged = bufs.stage(gpu, cache, seqs, starts, lens, true, Some((cfg, running)))?;
    f(&staged.step(lens, starts))
}

/// The varlen pass's keys for a prefill of `lens[i]` tokens of each sequence
/// from `starts[i]`, the first `prompts` of them prompts and the rest a mixed
/// step's running rows: each sequence's key count, and the runs of positions to
/// gather from the cache. Each sequence's own tokens, read where the RoPE launch
/// wrote them (no gather), unless a prompt continues earlier chunks; then every
/// prompt's whole sequence, and each running row's own token.
fn varlen_keys(starts: &[usize], lens: &[usize], prompts: usize) -> (Vec<usize>, Option<Vec<Run>>) {
    if starts[..prompts].iter().all(|&s| s == 0) {
        return (lens.to_vec(), None);
    }
    let runs: Vec<Run> = (0..lens.len())
        .map(|i| {
            let from = if i < prompts { 0 } else { starts[i] };
            // Lengths fit in u32: the step's page tables were made (they refuse more).
            (i as u32, from as u32..(starts[i] + lens[i]) as u32)
        })
        .collect();
    (runs.iter().map(|(_, r)| r.len()).collect(), Some(runs))
}

/// The varlen pass's query counts (`lens`), and `key_lens` grown, so that its
/// keys fill gathered buffers of `cap` rows: a last sequence of no queries
/// holds the rows past the step's keys (none when they fill them, or with no
/// gathered buffers).
fn pad_to_capacity(lens: &[usize], key_lens: &mut Vec<usize>, cap: Option<usize>) -> Vec<usize> {
    let mut q_lens = lens.to_vec();
    let keys: usize = key_lens.iter().sum();
    if let Some(cap) = cap.filter(|&c| c > keys) {
        q_lens.push(0);
        key_lens.push(cap - keys);
    }
    q_lens
}

/// Each token's row of the batch's page table and its position, for tokens
/// `starts[i] .. starts[i] + lens[i]` of sequence i.
fn token_slots(starts: &[usize], lens: &[usize]) -> (Vec<u32>, Vec<u32>) {
    let runs: Vec<Run> = (0..lens.len()).map(|i| (i as u32, starts[i] as u32..(starts[i] + lens[i]) as u32)).collect();
    expand_runs(&runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_start_every_array_16_bytes_on() {
        let mut w = Words::default();
        assert_eq!([w.push(&[1, 2, 3]), w.push(&[4]), w.push(&[5, 6, 7, 8]), w.push(&[9])], [0, 4, 8, 12]);
        assert_eq!(w.0, [1, 2, 3, 0, 4, 0, 0, 0, 5, 6, 7, 8, 9, 0, 0, 0]);
    }

    #[test]
    fn continuing_prompts_gather_their_whole_sequence() {
        // Fresh prompts and running rows: the step's own tokens, no gather.
        assert_eq!(varlen_keys(&[0, 0, 7], &[3, 2, 1], 2), (vec![3, 2, 1], None));
        // A prompt after 4 cached tokens: every prompt's whole sequence, and
        // the running row's own token at its position.
        let (lens, runs) = varlen_keys(&[4, 0, 7], &[3, 2, 1], 2);
        assert_eq!(lens, [7, 2, 1]);
        let runs = runs.unwrap();
        assert_eq!(runs, [(0, 0..7), (1, 0..2), (2, 7..8)]);
        let (seq, pos) = expand_runs(&runs);
        assert_eq!(seq, [0, 0, 0, 0, 0, 0, 0, 1, 1, 2]);
        assert_eq!(pos, [0, 1, 2, 3, 4, 5, 6, 0, 1, 7]);
        // A prefill alone (no running rows).
        assert_eq!(varlen_keys(&[2], &[1], 1), (vec![3], Some(vec![(0, 0..3)])));
    }

    #[test]
    fn a_query_less_sequence_takes_the_key_rows_past_the_step() {
        let mut keys = vec![7, 2, 1];
        assert_eq!(pad_to_capacity(&[3, 2, 1], &mut keys, Some(16)), [3, 2, 1, 0]);
        assert_eq!(keys, [7, 2, 1, 6]);
        // Filled exactly, or no gathered buffers: nothing added.
        let mut keys = vec![7, 2, 1];
        assert_eq!(pad_to_capacity(&[3, 2, 1], &mut keys, Some(10)), [3, 2, 1]);
        assert_eq!(pad_to_capacity(&[3, 2, 1], &mut keys, None), [3, 2, 1]);
        assert_eq!(keys, [7, 2, 1]);
    }

    #[test]
    fn a_graph_step_packs_to_its_buffer_length() {
        for (batch, max_pages) in [(1, 1), (3, 5), (64, 64), (127, 33)] {
            let mut w = Words::default();
            w.push(&vec![0; batch * max_pages]);
            for _ in 0..3 {
                w.push(&vec![0; batch]);
            }
            assert_eq!(w.0.len(), graph_words_len(batch, max_pages), "{batch} × {max_pages}");
        }
    }
}
