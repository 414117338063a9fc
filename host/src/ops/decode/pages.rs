//! Host-side page bookkeeping of one KV pool: a free list of pages, and each
//! sequence's list of them. Growth is all-or-nothing, so a full pool is a clear
//! error that changes nothing. Every page id it hands out is below the pool's
//! page count: the only page ids the decode kernels ever see.
//!
//! A fork shares its parent's whole pages (held by both, returned to the free
//! list when the last holder lets go) and gets a copy of a partial last one. A
//! sequence writes only at positions from its length on, so no holder ever
//! writes a shared page: whole pages lie below every holder's length, and a
//! truncate that would end inside a shared page first gives the sequence its
//! own copy of it.

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
    /// Bumped whenever a sequence lets go of a page: a batch made before then
    /// may name pages that now belong to another sequence.
    epoch: u64,
    /// Sequences holding each page (0: free).
    holders: Vec<u32>,
}

/// A page to copy on the GPU (every layer's K and V rows of page `from` into
/// page `to`) before a sequence that now holds `to` is read or written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PageCopy {
    pub from: u32,
    pub to: u32,
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
            holders: vec![0; num_pages],
        })
    }

    /// A free page, now held once (the caller checked one is free).
    fn take_page(&mut self) -> u32 {
        let p = self.free.pop().expect("a free page");
        self.holders[p as usize] = 1;
        p
    }

    /// One holder lets go of `page`; the last returns it to the free list.
    fn drop_page(&mut self, page: u32) {
        let h = &mut self.holders[page as usize];
        debug_assert!(*h > 0, "page {page} let go of more often than held");
        *h = h.saturating_sub(1);
        if *h == 0 {
            self.free.push(page);
        }
        self.epoch += 1;
    }

    /// Sequences holding `page` (0: free).
    pub fn holders(&self, page: u32) -> usize {
        self.holders.get(page as usize).map_or(0, |&h| h as usize)
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
        let new_pages: Vec<u32> = (0..need).map(|_| self.take_page()).collect();
        let st = self.seqs[seq.0].as_mut().unwrap();
        st.pages.extend(new_pages);
        st.len = total;
        Ok(())
    }

    /// Shrinks `seq` back to `len` tokens (no-op if it holds fewer), returning
    /// pages it no longer needs: undoes a growth that could not be completed.
    pub(crate) fn shrink_to(&mut self, seq: SeqId, len: usize) {
        let ps = self.page_size;
        let mut dropped = Vec::new();
        if let Some(Some(st)) = self.seqs.get_mut(seq.0) {
            st.len = st.len.min(len);
            while st.pages.len() > st.len.div_ceil(ps) {
                dropped.push(st.pages.pop().unwrap());
            }
        }
        for p in dropped {
            self.drop_page(p);
        }
    }

    /// A new sequence holding `parent`'s tokens: its whole pages shared, a
    /// partial last page copied into a page of its own (the copy returned, for
    /// the GPU). A full pool is an error that changes nothing.
    pub(crate) fn fork(&mut self, parent: SeqId) -> Result<(SeqId, Option<PageCopy>)> {
        let st = self.state(parent)?.clone();
        let whole = st.len / self.page_size;
        let partial = st.pages.len() > whole;
        if partial && self.free.is_empty() {
            return Err(Error::TooLarge(format!("KV cache pool full: a fork of {parent:?} needs a page, none free")));
        }
        let mut pages = st.pages[..whole].to_vec();
        for &p in &pages {
            self.holders[p as usize] += 1;
        }
        let copy = partial.then(|| {
            let to = self.take_page();
            pages.push(to);
            PageCopy { from: st.pages[whole], to }
        });
        self.seqs.push(Some(SeqState { pages, len: st.len }));
        Ok((SeqId(self.seqs.len() - 1), copy))
    }

    /// Before `seq` is cut to `len` tokens: where position `len` falls inside
    /// a page `seq` shares, that page is replaced by a copy of its own (the
    /// copy returned, for the GPU), so its next tokens write no shared page. A
    /// full pool is an error that changes nothing.
    pub(crate) fn detach(&mut self, seq: SeqId, len: usize) -> Result<Option<PageCopy>> {
        let st = self.state(seq)?;
        let i = len / self.page_size;
        let Some(&from) = st.pages.get(i).filter(|_| !len.is_multiple_of(self.page_size)) else { return Ok(None) };
        if self.holders[from as usize] < 2 {
            return Ok(None);
        }
        if self.free.is_empty() {
            return Err(Error::TooLarge(format!("KV cache pool full: {seq:?} needs a page of its own, none free")));
        }
        let to = self.take_page();
        self.seqs[seq.0].as_mut().unwrap().pages[i] = to;
        self.drop_page(from);
        Ok(Some(PageCopy { from, to }))
    }

    /// Undoes [`detach`](Self::detach) (its copy could not be queued).
    pub(crate) fn reattach(&mut self, seq: SeqId, len: usize, copy: PageCopy) {
        if let Some(Some(st)) = self.seqs.get_mut(seq.0) {
            st.pages[len / self.page_size] = copy.from;
            self.holders[copy.from as usize] += 1;
            self.drop_page(copy.to);
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
        for p in st.pages.into_iter().rev() {
            self.drop_page(p);
        }
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
    fn forks_share_whole_pages_and_copy_a_partial_one() {
        let mut a = PageAllocator::new(6, 4).unwrap();
        let p = a.add_sequence();
        a.grow(p, 10).unwrap(); // pages 0, 1 whole, 2 partial
        let (c, copy) = a.fork(p).unwrap();
        assert_eq!(copy, Some(PageCopy { from: 2, to: 3 }));
        assert_eq!((a.pages(c).unwrap(), a.len(c).unwrap()), (&[0, 1, 3][..], 10));
        assert_eq!([0, 1, 2, 3].map(|pg| a.holders(pg)), [2, 2, 1, 1]);
        // Each grows into pages of its own.
        a.grow(c, 2).unwrap();
        a.grow(p, 3).unwrap();
        assert_eq!((a.pages(c).unwrap(), a.pages(p).unwrap()), (&[0, 1, 3][..], &[0, 1, 2, 4][..]));
        // A fork at a page boundary shares every page and copies nothing.
        let (c2, copy) = a.fork(c).unwrap();
        assert_eq!((copy, a.pages(c2).unwrap()), (None, &[0, 1, 3][..]));
        assert_eq!([0, 1, 2, 3, 4].map(|pg| a.holders(pg)), [3, 3, 1, 2, 1]);
        // The shared pages go back only with their last holder.
        a.release(p).unwrap();
        assert_eq!((a.free_pages(), a.holders(0), a.holders(2)), (3, 2, 0));
        a.release(c).unwrap();
        a.release(c2).unwrap();
        assert_eq!(a.free_pages(), 6);
        // A full pool: a fork that needs a page is refused and changes nothing.
        let q = a.add_sequence();
        a.grow(q, 23).unwrap(); // six pages, the last partial
        assert!(matches!(a.fork(q), Err(Error::TooLarge(_))));
        assert_eq!((a.holders(0), a.free_pages()), (1, 0));
    }

    #[test]
    fn a_cut_inside_a_shared_page_detaches_it() {
        let mut a = PageAllocator::new(5, 4).unwrap();
        let p = a.add_sequence();
        a.grow(p, 12).unwrap(); // pages 0, 1, 2, all whole
        let (c, copy) = a.fork(p).unwrap();
        assert_eq!(copy, None);
        // At a page boundary nothing is shared past the cut.
        assert_eq!(a.detach(c, 8).unwrap(), None);
        // Inside page 1 (shared): c gets page 3, a copy.
        assert_eq!(a.detach(c, 6).unwrap(), Some(PageCopy { from: 1, to: 3 }));
        a.shrink_to(c, 6);
        assert_eq!((a.pages(c).unwrap(), a.holders(1), a.holders(2)), (&[0, 3][..], 1, 1));
        // p is still whole; its own pages are not shared, so no copy.
        assert_eq!(a.detach(p, 6).unwrap(), None);
        // Undone: back as before the detach.
        let (c2, _) = a.fork(p).unwrap();
        let copy = a.detach(c2, 5).unwrap().unwrap();
        a.reattach(c2, 5, copy);
        assert_eq!((a.pages(c2).unwrap(), a.holders(1), a.free_pages()), (&[0, 1, 2][..], 2, 1));
        // No free page for the copy: refused, nothing changes.
        let q = a.add_sequence();
        a.grow(q, 1).unwrap();
        assert!(matches!(a.detach(c2, 5), Err(Error::TooLarge(_))));
        assert_eq!(a.pages(c2).unwrap(), &[0, 1, 2]);
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
