//! Shared-memory tiles that carry their shape (ThunderKittens-style): a ROWS × COLS
//! bf16 tile whose 16-byte chunks are XOR-swizzled by `row % 8`, so the eight
//! row addresses of one `ldmatrix` land in eight different bank groups.

use super::mem::cp_async_16_zfill;
use super::opaque_u32;

#[derive(Clone, Copy)]
pub struct SmemTile<const ROWS: usize, const COLS: usize> {
    base: u32,
}

impl<const ROWS: usize, const COLS: usize> SmemTile<ROWS, COLS> {
    pub const BYTES: u32 = (ROWS * COLS * 2) as u32;
    /// 16-byte chunks per row.
    pub const CHUNKS: usize = COLS / 8;

    /// # Safety
    /// `base` must be a 128-byte aligned shared-window address with `BYTES` free.
    #[inline(always)]
    pub unsafe fn at(base: u32) -> Self {
        SmemTile { base }
    }

    /// Shared address of chunk `chunk` (8 elements) of row `row`.
    #[inline(always)]
    pub fn chunk_addr(&self, row: usize, chunk: usize) -> u32 {
        self.base + (row * COLS * 2 + ((chunk ^ (row & 7)) * 16)) as u32
    }

    /// Starts `cp.async` copies of rows `0..ROWS` from `src` (rows `row_stride`
    /// bytes apart). Rows at or past `valid_rows` are zero-filled, not read, so a
    /// ragged last tile needs no branch in the math. All `NTHREADS` threads call this.
    ///
    /// # Safety
    /// `src` rows below `valid_rows` must be readable; addresses 16-byte aligned.
    #[inline(always)]
    pub unsafe fn load_async<const NTHREADS: usize>(
        &self,
        src: *const u8,
        row_stride: usize,
        valid_rows: usize,
        tid: usize,
    ) {
        self.load_rows_async::<NTHREADS>(|row| src.add(row * row_stride), valid_rows, src, tid);
    }

    /// As [`load_async`](Self::load_async) for rows that are not evenly spaced
    /// (a paged KV cache): `row_ptr(r)` gives row r's address, for r < `valid_rows`.
    ///
    /// # Safety
    /// As `load_async`, for every address `row_ptr` returns.
    #[inline(always)]
    pub unsafe fn load_rows_async<const NTHREADS: usize>(
        &self,
        row_ptr: impl Fn(usize) -> *const u8,
        valid_rows: usize,
        fallback: *const u8,
        tid: usize,
    ) {
        let per_thread = (ROWS * Self::CHUNKS).div_ceil(NTHREADS);
        for i in 0..per_thread {
            let id = i * NTHREADS + tid;
            if id < ROWS * Self::CHUNKS {
                let (row, chunk) = (id / Self::CHUNKS, id % Self::CHUNKS);
                let ok = row < valid_rows;
                let p = if ok { row_ptr(row).add(chunk * 16) } else { fallback };
                cp_async_16_zfill(self.chunk_addr(row, chunk), p, if ok { 16 } else { 0 });
            }
        }
    }

    /// Loads two tiles whose rows sit at the same offsets from two bases (K and V
    /// of a paged cache): row r of `self` from `a + row_off(r)`, of `other` from
    /// `b + row_off(r)`; rows at or past `valid_rows` are zero-filled. `row_off`
    /// runs for every chunk on every thread, valid row or not, so it may use warp
    /// shuffles (a warp computing each row's address once and sharing it).
    ///
    /// # Safety
    /// As `load_async`, for every valid row's address in both tiles.
    #[inline(always)]
    pub unsafe fn load_row_pairs_async<const NTHREADS: usize>(
        &self,
        other: &Self,
        a: *const u8,
        b: *const u8,
        row_off: impl Fn(usize) -> usize,
        valid_rows: usize,
        tid: usize,
    ) {
        // A rolled loop: unrolled, LLVM computes every pass's addresses up front
        // and the hd128 decode kernel spills on sm_80.
        let per_thread = opaque_u32((ROWS * Self::CHUNKS).div_ceil(NTHREADS) as u32) as usize;
        for i in 0..per_thread {
            let id = i * NTHREADS + tid;
            let (row, chunk) = (id / Self::CHUNKS, id % Self::CHUNKS);
            let off = row_off(row.min(ROWS - 1));
            if id < ROWS * Self::CHUNKS {
                let ok = row < valid_rows;
                let (pa, pb) = if ok { (a.add(off + chunk * 16), b.add(off + chunk * 16)) } else { (a, b) };
                let bytes = if ok { 16 } else { 0 };
                cp_async_16_zfill(self.chunk_addr(row, chunk), pa, bytes);
                cp_async_16_zfill(other.chunk_addr(row, chunk), pb, bytes);
            }
        }
    }
}
