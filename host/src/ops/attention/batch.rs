//! A packed batch of variable-length sequences: cumulative token offsets, checked
//! on the host and copied once to the device, where the kernels read them.

use crate::error::{cuda, Error, Result};
use crate::runtime::Gpu;
use cust::memory::DeviceBuffer;
use std::marker::PhantomData;

/// Most tokens a batch may hold on either side: the kernels keep token indices
/// and a key tile's reach past the last token (under 1024) in `i32`, as the
/// tensor maps' coordinates are.
pub const MAX_TOKENS: usize = i32::MAX as usize - 1024;
/// Most sequences in a batch: one grid z-slice each.
pub const MAX_SEQUENCES: usize = 65535;

/// The sizes of a batch that a launch is planned with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchDims {
    /// Query tokens over all sequences (the rows of q, o and lse).
    pub total_q: usize,
    /// Key tokens over all sequences (the rows of k and v).
    pub total_k: usize,
    pub sequences: usize,
    /// The longest sequence's queries: the grid's query tiles.
    pub max_q: usize,
}

/// Cumulative sequence offsets of a packed batch, on the host (for validation and
/// grid sizing) and on the device (for the kernel). Immutable once made, so the
/// two copies agree. The device copies live in buffers of its own
/// (`VarlenBatch<'static>`), or in buffers a layer reuses step after step, which
/// it borrows for its life so that no other batch overwrites them.
pub struct VarlenBatch<'a> {
    cu_q: Vec<u32>,
    cu_k: Vec<u32>,
    dev_q: u64,
    dev_k: u64,
    _owned: Option<(DeviceBuffer<u32>, DeviceBuffer<u32>)>,
    _bufs: PhantomData<&'a ()>,
}

impl VarlenBatch<'static> {
    /// Sequence i has `q_lens[i]` queries and `k_lens[i]` keys (equal for
    /// self-attention prefill; more keys when earlier tokens are cached).
    pub fn new(gpu: &Gpu, q_lens: &[usize], k_lens: &[usize]) -> Result<VarlenBatch<'static>> {
        let (cu_q, cu_k) = offsets_of_lengths(q_lens, k_lens)?;
        VarlenBatch::upload(gpu, cu_q, cu_k)
    }

    /// From cumulative offsets (FlashAttention's `cu_seqlens`): sequence i holds
    /// query tokens `cu_q[i] .. cu_q[i + 1]` and key tokens `cu_k[i] .. cu_k[i + 1]`.
    /// Both start at 0, never decrease and have one entry more than there are sequences.
    pub fn from_offsets(gpu: &Gpu, cu_q: &[u32], cu_k: &[u32]) -> Result<VarlenBatch<'static>> {
        check_offsets(cu_q, cu_k)?;
        VarlenBatch::upload(gpu, cu_q.to_vec(), cu_k.to_vec())
    }

    fn upload(_gpu: &Gpu, cu_q: Vec<u32>, cu_k: Vec<u32>) -> Result<VarlenBatch<'static>> {
        let owned_q = DeviceBuffer::from_slice(&cu_q).map_err(cuda("cuMemcpyHtoD"))?;
        let owned_k = DeviceBuffer::from_slice(&cu_k).map_err(cuda("cuMemcpyHtoD"))?;
        crate::tensor::uploaded()?;
        let (dev_q, dev_k) = (owned_q.as_device_ptr().as_raw(), owned_k.as_device_ptr().as_raw());
        Ok(VarlenBatch { cu_q, cu_k, dev_q, dev_k, _owned: Some((owned_q, owned_k)), _bufs: PhantomData })
    }
}

impl<'a> VarlenBatch<'a> {
    /// Offsets `cu_q`, `cu_k` ([`offsets_of_lengths`]) whose device copies are
    /// at `dev_q`, `dev_k`.
    ///
    /// # Safety
    /// The addresses must hold the offsets, copied in on the stream before any
    /// launch that reads them, and stay so for `'a`.
    pub(crate) unsafe fn in_step(cu_q: Vec<u32>, cu_k: Vec<u32>, dev_q: u64, dev_k: u64) -> VarlenBatch<'a> {
        VarlenBatch { cu_q, cu_k, dev_q, dev_k, _owned: None, _bufs: PhantomData }
    }

    pub fn total_q(&self) -> usize {
        *self.cu_q.last().unwrap() as usize
    }

    pub fn total_k(&self) -> usize {
        *self.cu_k.last().unwrap() as usize
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.cu_q.len() - 1
    }

    pub fn q_range(&self, i: usize) -> std::ops::Range<usize> {
        self.cu_q[i] as usize..self.cu_q[i + 1] as usize
    }

    pub fn k_range(&self, i: usize) -> std::ops::Range<usize> {
        self.cu_k[i] as usize..self.cu_k[i + 1] as usize
    }

    pub fn dims(&self) -> BatchDims {
        let max_q = self.cu_q.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
        BatchDims { total_q: self.total_q(), total_k: self.total_k(), sequences: self.batch(), max_q }
    }

    /// Device addresses of the query and key offsets (`batch() + 1` u32 each).
    pub(super) fn device_offsets(&self) -> (u64, u64) {
        (self.dev_q, self.dev_k)
    }
}

/// Cumulative offsets of per-sequence lengths, checked as [`check_offsets`] does.
pub(crate) fn offsets_of_lengths(q_lens: &[usize], k_lens: &[usize]) -> Result<(Vec<u32>, Vec<u32>)> {
    let cumulative = |lens: &[usize]| -> Result<Vec<u32>> {
        let mut cu = Vec::with_capacity(lens.len() + 1);
        let mut total = 0usize;
        cu.push(0);
        for &n in lens {
            total = total.saturating_add(n);
            if total > MAX_TOKENS {
                return Err(Error::TooLarge(format!("varlen batch: more than {MAX_TOKENS} tokens")));
            }
            cu.push(total as u32);
        }
        Ok(cu)
    };
    let (cu_q, cu_k) = (cumulative(q_lens)?, cumulative(k_lens)?);
    check_offsets(&cu_q, &cu_k)?;
    Ok((cu_q, cu_k))
}

/// Offsets the kernels can take: as many for queries as for keys, at least one
/// sequence and at most [`MAX_SEQUENCES`], each starting at 0 and never
/// decreasing, totals within [`MAX_TOKENS`].
pub(crate) fn check_offsets(cu_q: &[u32], cu_k: &[u32]) -> Result<()> {
    let op = "varlen batch";
    if cu_q.len() != cu_k.len() {
        return Err(Error::Shape(format!("{op}: {} query offsets vs {} key offsets", cu_q.len(), cu_k.len())));
    }
    if cu_q.len() < 2 {
        return Err(Error::Empty(format!("{op}: no sequence ({} offsets)", cu_q.len())));
    }
    if cu_q.len() - 1 > MAX_SEQUENCES {
        return Err(Error::TooLarge(format!("{op}: {} sequences exceed {MAX_SEQUENCES}", cu_q.len() - 1)));
    }
    for (side, cu) in [("query", cu_q), ("key", cu_k)] {
        if cu[0] != 0 {
            return Err(Error::InvalidArgument(format!("{op}: {side} offsets start at {}, not 0", cu[0])));
        }
        if let Some(i) = cu.windows(2).position(|w| w[1] < w[0]) {
            return Err(Error::InvalidArgument(format!(
                "{op}: {side} offsets decrease at sequence {i} ({} then {})",
                cu[i],
                cu[i + 1]
            )));
        }
        let total = *cu.last().unwrap() as usize;
        if total > MAX_TOKENS {
            return Err(Error::TooLarge(format!("{op}: {total} {side} tokens exceed {MAX_TOKENS}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_become_offsets() {
        let (q, k) = offsets_of_lengths(&[3, 0, 5], &[3, 2, 9]).unwrap();
        assert_eq!(q, [0, 3, 3, 8]);
        assert_eq!(k, [0, 3, 5, 14]);
    }

    #[test]
    fn refuses_bad_offsets() {
        let shape = |r: Result<()>| matches!(r, Err(Error::Shape(_)));
        let empty = |r: Result<()>| matches!(r, Err(Error::Empty(_)));
        let invalid = |r: Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
        let too_large = |r: Result<()>| matches!(r, Err(Error::TooLarge(_)));
        assert!(shape(check_offsets(&[0, 4], &[0, 4, 8])));
        assert!(empty(check_offsets(&[0], &[0])));
        assert!(empty(check_offsets(&[], &[])));
        assert!(invalid(check_offsets(&[1, 4], &[0, 4])));
        assert!(invalid(check_offsets(&[0, 4], &[2, 4])));
        assert!(invalid(check_offsets(&[0, 4, 3], &[0, 4, 8])));
        assert!(invalid(check_offsets(&[0, 4, 8], &[0, 9, 8])));
        assert!(too_large(check_offsets(&[0, u32::MAX], &[0, 1])));
        let many = vec![0u32; MAX_SEQUENCES + 2];
        assert!(too_large(check_offsets(&many, &many)));
        assert!(check_offsets(&[0, 0, 4], &[0, 1, 1]).is_ok());
    }

    #[test]
    fn refuses_bad_lengths() {
        assert!(matches!(offsets_of_lengths(&[1, 2], &[1]), Err(Error::Shape(_))));
        assert!(matches!(offsets_of_lengths(&[], &[]), Err(Error::Empty(_))));
        assert!(matches!(offsets_of_lengths(&[MAX_TOKENS, 1], &[1, 1]), Err(Error::TooLarge(_))));
        assert!(matches!(offsets_of_lengths(&[usize::MAX, 1], &[1, 1]), Err(Error::TooLarge(_))));
    }
}
