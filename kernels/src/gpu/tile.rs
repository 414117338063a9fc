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
    /// of a paged cache): row r of `self` from `a + 16·row_off16(r)`, of `other`
    /// from `b + 16·row_off16(r)`; rows at or past `valid_rows` are zero-filled,
    /// and their offset must still be in bounds (0 will do). `row_off16` runs once
    /// per pass on every thread, so it may be a warp shuffle (a warp computing each
    /// row's address once and sharing it).
    ///
    /// Thread t always moves chunk t % CHUNKS, of rows t / CHUNKS + k·(NTHREADS /
    /// CHUNKS): its chunk and the swizzle of each pass are fixed, so a pass is an
    /// offset, two address multiply-adds and two copies. (A loop that derived row,
    /// chunk and swizzle from a running index took ~36 instructions a pass: 37% of
    /// the b1 L4096 decode kernel's instructions by ncu.)
    ///
    /// # Safety
    /// As `load_async`, for every row's address in both tiles.
    #[inline(always)]
    pub unsafe fn load_row_pairs_async<const NTHREADS: usize>(
        &self,
        other: &Self,
        a: *const u8,
        b: *const u8,
        row_off16: impl Fn(usize) -> u32,
        valid_rows: usize,
        tid: usize,
    ) {
        let per_pass = NTHREADS / Self::CHUNKS;
        const {
            assert!(NTHREADS.is_multiple_of(Self::CHUNKS) && (NTHREADS / Self::CHUNKS).is_power_of_two());
            assert!(ROWS.is_multiple_of(NTHREADS / Self::CHUNKS));
        }
        let (first_row, chunk) = (tid / Self::CHUNKS, tid % Self::CHUNKS);
        let (a, b) = (a.add(chunk * 16), b.add(chunk * 16));
        // (pass·per_pass + first_row) & 7 == ((pass·per_pass) & 7) ^ (first_row & 7):
        // per_pass is a power of two and first_row < per_pass.
        let lane_swizzle = (chunk ^ (first_row & 7)) * 16;
        let (dst_a, dst_b) = (self.base as usize + first_row * COLS * 2, other.base as usize + first_row * COLS * 2);
        // Rolled (an opaque bound): unrolled, LLVM computes every pass's addresses
        // up front, +20–80 registers across the decode kernels.
        for pass in 0..opaque_u32((ROWS / per_pass) as u32) as usize {
            let row = pass * per_pass + first_row;
            let off = row_off16(row) as usize * 16;
            let at = pass * per_pass * COLS * 2 + (lane_swizzle ^ (((pass * per_pass) & 7) * 16));
            let bytes = if row < valid_rows { 16 } else { 0 };
            cp_async_16_zfill((dst_a + at) as u32, a.add(off), bytes);
            cp_async_16_zfill((dst_b + at) as u32, b.add(off), bytes);
        }
    }
}
