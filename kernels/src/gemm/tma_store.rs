//! The wgmma tiles' epilogue through shared memory and a TMA store (dev): a
//! consumer warpgroup packs its 64 rows to bf16 into a staging of 64-column
//! boxes (128-byte swizzled, the layout the copy engine reads) by `stmatrix`,
//! which takes the accumulators' fragment layout as it is, and its first
//! thread issues one bulk store a box; the warpgroup goes on to its next tile
//! while the copy runs. Rows and columns past the output are clipped by the
//! map's extent.
//!
//! The residual epilogue has the tile's residual loaded into the staging by
//! TMA some K tiles before the main loop ends ([`load_residual`]), read back by
//! `ldmatrix` in the same fragment layout and added pair for pair as the other
//! epilogues add it. SwiGLU's outputs (one a pair, so a lane holds every
//! fourth column) are gathered two a word across the quad by two shuffles.

// Only the dev entries store by TMA; the shipped walks compile the branch away.
#![cfg_attr(not(feature = "dev"), allow(dead_code))]

use super::{add_residual_bf16x2, epilogue, swiglu_bf16};
use crate::gpu::bf16::pack_bf16x2;
use crate::gpu::mma::{ldmatrix_x4, stmatrix_x4};
use crate::gpu::thread::named_sync;
use crate::gpu::tma::{self, Barrier};
use crate::gpu::warp::shuffle_u32;
use crate::gpu::wgmma;
use abi::gemm::tma_store::{BM, BOX_ROWS};

/// Columns of a stored box: one 128-byte swizzle row.
const BOX_COLS: usize = 64;
const BOX_BYTES: usize = BOX_ROWS * BOX_COLS * 2;
/// K tiles before the end of a tile's main loop at which its residual starts
/// loading: long enough to hide the load, and in a tile of more K tiles than
/// this, late enough that the last store from the staging has long been read
/// (in a shorter one the first thread waits for that store's reads there).
pub(crate) const RESIDUAL_LEAD: usize = 8;

/// Consumer warpgroup `c`'s staging among the block's, from `base` (1024-byte aligned).
#[inline(always)]
pub(crate) const fn staging(base: u32, c: usize, bn: usize) -> u32 {
    base + (c * (bn / BOX_COLS) * BOX_BYTES) as u32
}

/// Where consumer warpgroup `c` of a block stores tile (`tm`, `tn`) of `bn`
/// columns: its staging, its thread `t`, and the launch's maps and epilogue.
#[derive(Clone, Copy)]
pub(crate) struct TileStore {
    pub map_out: u64,
    pub epilogue: u32,
    pub stage: u32,
    pub c: usize,
    pub t: usize,
    pub tm: usize,
    pub tn: usize,
    pub bn: usize,
    /// The residual epilogue's barrier, and the phase parity its load of this
    /// tile completes.
    pub residual: Option<(Barrier, u32)>,
}

/// The warpgroup's first thread: once the last store from `stage` has read
/// it, starts tile (`tm`, `tn`)'s residual boxes (consumer `c`'s 64 rows of
/// `bn` columns, over `map_residual`) loading into it, completing on `bar`.
///
/// # Safety
/// `map_residual` must map the residual `[m, n]` with 64 × [`BOX_ROWS`]
/// boxes; `stage` must hold `bn / 64` boxes; `bar` must have one arrival a
/// phase and not be waited on for this tile before this call.
#[inline(always)]
pub(crate) unsafe fn load_residual(map_residual: u64, stage: u32, bar: Barrier, c: usize, tm: usize, tn: usize, bn: usize) {
    tma::store_wait_read::<0>();
    let boxes = bn / BOX_COLS;
    bar.arrive_expect_tx((boxes * BOX_BYTES) as u32);
    let row0 = (tm * BM + c * BOX_ROWS) as i32;
    for b in 0..boxes {
        tma::load_2d(stage + (b * BOX_BYTES) as u32, map_residual, (tn * bn + b * BOX_COLS) as i32, row0, bar);
    }
}

/// Stores consumer warpgroup `s.c`'s 64 × `s.bn` results of `ACC`
/// accumulators a thread through the epilogue (SwiGLU: half as many columns)
/// by `s.map_out`, through its staging, which it may write once the last
/// store from it has read it out (waited for here, or by [`load_residual`]).
/// Every thread of the warpgroup calls it; named barrier `1 + c` is the
/// warpgroup's.
///
/// # Safety
/// `s.map_out` must map the output (`[m, n]`, or `[m, n / 2]` for SwiGLU)
/// with 64 × [`BOX_ROWS`] boxes; the staging must hold `bn / 64` boxes that
/// nothing else uses; under the residual epilogue [`load_residual`] must have
/// started this tile's residual; every thread of the warpgroup must call
/// [`store_tile_done`] before the block ends.
#[inline(always)]
pub(crate) unsafe fn store_tile_tma<const ACC: usize>(s: TileStore, acc: &[f32; ACC]) {
    // (Instantiated for every tile width; `gemm_tma` asserts whole boxes of
    // output columns, SwiGLU's half-wide rows too, where it stores by TMA.)
    const { assert!(ACC % 16 == 0) };
    let leader = s.t == 0;
    let barrier = 1 + s.c as u32;
    match s.residual {
        // The residual's load was issued after the last store's reads: its
        // arrival orders every thread's writes after them.
        Some((bar, parity)) => bar.wait(parity),
        None => {
            if leader {
                tma::store_wait_read::<0>();
            }
            named_sync(barrier, 128);
        }
    }
    // Lanes 8i..8i+7 address matrix i of a 16 × 16 block: rows (i % 2)·8 on,
    // columns (i / 2)·8 on; matrix i holds row half i % 2 of 8-column group
    // 2g + i / 2.
    let (warp, lane) = (s.t / 32, s.t % 32);
    let i = lane / 8;
    let row = warp * 16 + (i % 2) * 8 + lane % 8;
    // The 16-byte chunk of the 128-byte row, XORed with the row's place in
    // its 8-row group (the swizzle).
    let at = |col: usize| {
        let chunk = ((col % BOX_COLS) / 8) ^ (row % 8);
        s.stage + ((col / BOX_COLS) * BOX_BYTES + row * 128 + chunk * 16) as u32
    };
    let pair = |j: usize, h: usize| (acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    let out_cols = if s.epilogue == epilogue::SWIGLU {
        // Pair j's output is column 4j + q of the row: lane q of a quad holds
        // columns q and q + 4 of each group of 8. Packed (q, q + 4) a word,
        // lane q takes its columns 2q, 2q + 1 from lanes 2q and 2q + 1 (mod 4).
        let (q, quad) = (lane % 4, (lane & !3) as u32);
        let src = quad + (2 * q % 4) as u32;
        let word = |m: usize, h: usize| {
            let (a, b) = (swiglu_bf16(pair(2 * m, h).0, pair(2 * m, h).1), swiglu_bf16(pair(2 * m + 1, h).0, pair(2 * m + 1, h).1));
            let p = a as u32 | (b as u32) << 16;
            let (x, y) = (shuffle_u32(p, src), shuffle_u32(p, src + 1));
            if q < 2 {
                (x & 0xffff) | y << 16
            } else {
                x >> 16 | (y & 0xffff_0000)
            }
        };
        for g in 0..ACC / 16 {
            stmatrix_x4(at(16 * g + (i / 2) * 8), [word(2 * g, 0), word(2 * g, 1), word(2 * g + 1, 0), word(2 * g + 1, 1)]);
        }
        s.bn / 2
    } else {
        let residual = s.residual.is_some();
        for g in 0..ACC / 8 {
            let addr = at(16 * g + (i / 2) * 8);
            let r = if residual { ldmatrix_x4(addr) } else { [0; 4] };
            let word = |k: usize| {
                let (v0, v1) = pair(2 * g + k / 2, k % 2);
                if residual {
                    add_residual_bf16x2(v0, v1, r[k])
                } else {
                    pack_bf16x2(v0, v1)
                }
            };
            stmatrix_x4(addr, [word(0), word(1), word(2), word(3)]);
        }
        s.bn
    };
    // Each thread's stores before the copy engine reads them.
    wgmma::fence_proxy_async_shared();
    named_sync(barrier, 128);
    if leader {
        let row0 = (s.tm * BM + s.c * BOX_ROWS) as i32;
        for b in 0..out_cols / BOX_COLS {
            let col = (s.tn * out_cols + b * BOX_COLS) as i32;
            tma::store_2d(s.map_out, col, row0, s.stage + (b * BOX_BYTES) as u32);
        }
        tma::store_commit();
    }
}

/// The warpgroup's stores have completed: before the block ends (the staging
/// must outlive their reads), by its thread 0, which committed them.
#[inline(always)]
pub(crate) fn store_tile_done(t: usize) {
    if t == 0 {
        tma::store_wait::<0>();
    }
}
