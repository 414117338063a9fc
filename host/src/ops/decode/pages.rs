//! Host-side page bookkeeping of one KV pool: a free list of pages, and each
//! sequence's list of them. Growth is all-or-nothing, so a full pool is a clear
//! error that changes nothing. Every page id it hands out is below the pool's
//! page count: the only page ids the decode kernels ever see.

use crate::error::{Error, Result};

/// A sequence's handle in a [`PageAllocator`] (never reused once released).
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
    num_pages: usize,
    free: Vec<u32>,
    seqs: Vec<Option<SeqState>>,
    /// Bumped whenever pages go back to the free list: a batch made before then
    /// may name pages that now belong to another sequence.
    epoch: u64,
}

impl PageAllocator {
    pub fn new(num_pages: usize, page_size: usize) -> Result<PageAllocator> {
        if num_pages == 0 || page_size == 0 || num_pages > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!("{num_pages} pages of {page_size} tokens")));
        }
        // Pop from the end: pages are handed out in ascending order.
        Ok(PageAllocator {
            page_size,
            num_pages,
            free: (0..num_pages as u32).rev().collect(),
            seqs: Vec::new(),
            epoch: 0,
        })
    }

    pub fn add_sequence(&mut self) -> SeqId {
        self.seqs.push(Some(SeqState::default()));
        SeqId(self.seqs.len() - 1)
    }

    fn state(&self, seq: SeqId) -> Result<&SeqState> {
        self.seqs.get(seq.0).and_then(|s| s.as_ref()).ok_or_else(|| Error::InvalidArgument(format!("unknown {seq:?}")))
    }

    /// Tokens `seq` holds.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.state(seq)?.len)
    }

    /// The pages `seq` owns, in token order: `len.div_ceil(page_size)` of them.
    pub fn pages(&self, seq: SeqId) -> Result<&[u32]> {
        Ok(&self.state(seq)?.pages)
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Grows `seq` by `tokens`, taking new pages as needed; if the pool cannot
    /// supply them, returns an error and leaves everything as it was.
    pub fn grow(&mut self, seq: SeqId, tokens: usize) -> Result<()> {
        let st = self.state(seq)?;
        let Some(total) = st.len.checked_add(tokens) else {
            return Err(Error::TooLarge(format!("{seq:?}: {} + {tokens} tokens", st.len)));
        };
        let need = total.div_ceil(self.page_size).saturating_sub(st.pages.len());
        if need > self.free.len() {
            return Err(Error::TooLarge(format!(
                "KV cache pool full: {seq:?} needs {need} more pages, {} free",
                self.free.len()
            )));
        }
        let new_pages: Vec<u32> = (0..need).map(|_| self.free.pop().unwrap()).collect();
        let st = self.seqs[seq.0].as_mut().unwrap();
        st.pages.extend(new_pages);
        st.len = total;
        Ok(())
    }

    /// Shrinks `seq` back to `len` tokens (no-op if it holds fewer), returning
    /// pages it no longer needs: undoes a growth that could not be completed.
    pub(crate) fn shrink_to(&mut self, seq: SeqId, len: usize) {
        let ps = self.page_size;
        if let Some(Some(st)) = self.seqs.get_mut(seq.0) {
            st.len = st.len.min(len);
            while st.pages.len() > st.len.div_ceil(ps) {
                self.free.push(st.pages.pop().unwrap());
                self.epoch += 1;
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
            let grown = self.len(s).and_then(|before| self.grow(s, n).map(|_| before));
            match grown {
                Ok(before) => done.push((s, before)),
                Err(e) => {
                    self.undo(&done);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Shrinks each grown sequence back to its length before, latest first.
    pub(crate) fn undo(&mut self, grown: &[(SeqId, usize)]) {
        for &(s, len) in grown.iter().rev() {
            self.shrink_to(s, len);
        }
    }

    /// How many times pages went back to the free list.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Ends a sequence and returns its pages to the pool.
    pub fn release(&mut self, seq: SeqId) -> Result<()> {
        self.state(seq)?;
        let st = self.seqs[seq.0].take().unwrap();
        self.free.extend(st.pages.into_iter().rev());
        self.epoch += 1;
        Ok(())
    }
}

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
    fn grow_all_is_all_or_nothing() {
        let mut a = PageAllocator::new(3, 4).unwrap();
        let (s1, s2) = (a.add_sequence(), a.add_sequence());
        a.grow_all(&[s1, s2], &[4, 3]).unwrap();
        assert_eq!(a.free_pages(), 1);
        // s1 could take the last page, s2 then finds none: neither grows.
        assert!(matches!(a.grow_all(&[s1, s2], &[1, 2]), Err(Error::TooLarge(_))));
        assert_eq!((a.len(s1).unwrap(), a.len(s2).unwrap(), a.free_pages()), (4, 3, 1));
        // An unknown sequence after a grown one: the grown one is undone.
        a.release(s2).unwrap();
        assert!(a.grow_all(&[s1, s2], &[1, 1]).is_err());
        assert_eq!((a.len(s1).unwrap(), a.pages(s1).unwrap().len()), (4, 1));
        assert!(matches!(a.grow_all(&[s1], &[1, 1]), Err(Error::Shape(_))));
    }

    #[test]
    fn page_ids_stay_below_the_pool_and_cover_the_length() {
        let mut a = PageAllocator::new(7, 5).unwrap();
        let seqs: Vec<SeqId> = (0..3).map(|_| a.add_sequence()).collect();
        for (i, n) in [3usize, 11, 5, 1, 9].iter().enumerate() {
            let s = seqs[i % 3];
            let _ = a.grow(s, *n);
            for &s in &seqs {
                let (len, pages) = (a.len(s).unwrap(), a.pages(s).unwrap());
                assert_eq!(pages.len(), len.div_ceil(5));
                assert!(pages.iter().all(|&p| (p as usize) < a.num_pages()));
            }
        }
        assert!(PageAllocator::new(0, 16).is_err() && PageAllocator::new(4, 0).is_err());
        assert!(a.grow(seqs[0], usize::MAX).is_err());
    }
}
