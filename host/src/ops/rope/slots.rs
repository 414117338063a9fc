//! Where each token of a RoPE launch goes: its row of the batch's page table and
//! its position in its sequence, on the GPU, with host copies for the checks.

use crate::error::{cuda, Error, Result};
use crate::ops::decode::{DecodeBatch, PagedKvCache};
use crate::runtime::Gpu;
use cust::memory::DeviceBuffer;
use std::marker::PhantomData;

/// Each token's page-table row and position: device copies in buffers of its
/// own, or in a step's uploaded words (a layer's step buffers, a graph's fixed
/// buffer), which it borrows for its life (so none other overwrites them).
pub(crate) struct TokenSlots<'a> {
    seq_ptr: u64,
    pos_ptr: u64,
    _owned: Option<(DeviceBuffer<u32>, DeviceBuffer<u32>)>,
    _bufs: PhantomData<&'a ()>,
    seq: Vec<u32>,
    pos: Vec<u32>,
}

fn check_slots(seq: &[u32], pos: &[u32]) -> Result<()> {
    if seq.len() != pos.len() || seq.is_empty() {
        return Err(Error::Shape(format!("{} token rows, {} positions", seq.len(), pos.len())));
    }
    Ok(())
}

impl TokenSlots<'static> {
    pub(crate) fn new(_gpu: &Gpu, seq: &[u32], pos: &[u32]) -> Result<TokenSlots<'static>> {
        check_slots(seq, pos)?;
        let (s, p) = (
            DeviceBuffer::from_slice(seq).map_err(cuda("cuMemcpyHtoD"))?,
            DeviceBuffer::from_slice(pos).map_err(cuda("cuMemcpyHtoD"))?,
        );
        crate::tensor::uploaded()?;
        Ok(TokenSlots {
            seq_ptr: s.as_device_ptr().as_raw(),
            pos_ptr: p.as_device_ptr().as_raw(),
            _owned: Some((s, p)),
            _bufs: PhantomData,
            seq: seq.to_vec(),
            pos: pos.to_vec(),
        })
    }
}

impl<'a> TokenSlots<'a> {
    /// Rows `seq` and positions `pos` whose device copies are at `seq_ptr` and `pos_ptr`.
    ///
    /// # Safety
    /// The addresses must hold `seq` and `pos`, copied in on the stream before
    /// any launch that reads them, and stay so for `'a`.
    pub(crate) unsafe fn in_step(seq: &[u32], pos: &[u32], seq_ptr: u64, pos_ptr: u64) -> Result<TokenSlots<'a>> {
        check_slots(seq, pos)?;
        Ok(TokenSlots { seq_ptr, pos_ptr, _owned: None, _bufs: PhantomData, seq: seq.to_vec(), pos: pos.to_vec() })
    }

    pub(crate) fn len(&self) -> usize {
        self.seq.len()
    }

    /// Device addresses of the rows and the positions.
    pub(crate) fn ptrs(&self) -> (u64, u64) {
        (self.seq_ptr, self.pos_ptr)
    }

    /// Checks every token against `batch` and a table of `max_pos` positions
    /// ([`check_tokens`]).
    pub(crate) fn check(&self, op: &str, batch: &DecodeBatch, max_pos: usize) -> Result<()> {
        check_tokens(op, &self.seq, &self.pos, batch.lens(), max_pos)
    }

    /// `batch` is `cache`'s, and every token (checked against it) lands in a
    /// page its sequence holds alone: a page shared with a fork holds the other
    /// holders' rows too. The layer and the model write only from a sequence's
    /// length on, where no page is shared; a caller placing tokens anywhere
    /// below it is checked here.
    pub(crate) fn check_unshared(&self, op: &str, batch: &DecodeBatch, cache: &PagedKvCache) -> Result<()> {
        batch.check_cache(op, cache.id())?;
        self.check(op, batch, usize::MAX)?;
        let ps = cache.page_size();
        for (&s, &p) in self.seq.iter().zip(&self.pos) {
            if cache.alloc().holders(batch.page_of(s as usize, p as usize, ps)) > 1 {
                return Err(Error::InvalidArgument(format!(
                    "{op}: position {p} of row {s} is in a page shared with a fork (truncate the sequence there first)"
                )));
            }
        }
        Ok(())
    }
}

/// Every token's row is one of the batch's sequences (`lens`), and its position
/// is below that sequence's length (so its page is the sequence's own) and below
/// the RoPE table's `max_pos`.
pub(crate) fn check_tokens(op: &str, seq: &[u32], pos: &[u32], lens: &[u32], max_pos: usize) -> Result<()> {
    for (i, (&s, &p)) in seq.iter().zip(pos).enumerate() {
        let Some(&len) = lens.get(s as usize) else {
            return Err(Error::InvalidArgument(format!("{op}: token {i} in row {s} of a batch of {}", lens.len())));
        };
        if p >= len || p as usize >= max_pos {
            return Err(Error::InvalidArgument(format!(
                "{op}: token {i} at position {p} of a sequence of {len} (RoPE table of {max_pos})"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_stay_inside_their_sequences_and_the_table() {
        let lens = [3u32, 0, 5];
        assert!(check_tokens("op", &[0, 0, 2, 2], &[1, 2, 0, 4], &lens, 8).is_ok());
        for (seq, pos, max_pos) in [
            (vec![3u32], vec![0u32], 8usize), // no fourth sequence
            (vec![1], vec![0], 8),            // an empty sequence holds no position
            (vec![0], vec![3], 8),            // one past the sequence
            (vec![2], vec![4], 4),            // past the table
        ] {
            assert!(matches!(check_tokens("op", &seq, &pos, &lens, max_pos), Err(Error::InvalidArgument(_))));
        }
        assert!(check_slots(&[0, 1], &[0]).is_err() && check_slots(&[], &[]).is_err());
    }
}
