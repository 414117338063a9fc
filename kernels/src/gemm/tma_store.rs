//! The wgmma tiles' epilogue through shared memory and a TMA store (dev): a
//! consumer warpgroup packs its 64 rows to bf16 into a staging of 64-column
//! boxes (128-byte swizzled, the layout the copy engine reads) by `stmatrix`,
//! which takes the accumulators' fragment layout as it is (no shuffles), and
//! its first thread issues one bulk store a box; the warpgroup goes on to its
//! next tile while the copy runs. Plain epilogue only: rows and columns past
//! the output are clipped by the map's extent.

// Only the dev entries store by TMA; the shipped walks compile the branch away.
#![cfg_attr(not(feature = "dev"), allow(dead_code))]

use crate::gpu::bf16::pack_bf16x2;
use crate::gpu::mma::stmatrix_x4;
use crate::gpu::thread::named_sync;
use crate::gpu::tma;
use crate::gpu::wgmma;
use abi::gemm::tma_store::{BM, BOX_ROWS};

/// Columns of a stored box: one 128-byte swizzle row.
const BOX_COLS: usize = 64;
const BOX_BYTES: usize = BOX_ROWS * BOX_COLS * 2;

/// Consumer warpgroup `c`'s staging among the block's, from `base` (1024-byte aligned).
#[inline(always)]
pub(crate) const fn staging(base: u32, c: usize, bn: usize) -> u32 {
    base + (c * (bn / BOX_COLS) * BOX_BYTES) as u32
}

/// Stores consumer warpgroup `c`'s 64 × `bn` outputs (`ACC` accumulators a
/// thread, `t` its index in the warpgroup) of tile (`tm`, `tn`) by the map
/// `map_out` through its staging at `stage`, which it may write once the last
/// store from it has read it out (waited for here). Every thread of the
/// warpgroup calls it; named barrier `1 + c` is the warpgroup's.
///
/// # Safety
/// `map_out` must map the output `[m, n]` with 64 × [`BOX_ROWS`] boxes;
/// `stage` must hold `bn / 64` boxes that nothing else uses; every thread
/// of the warpgroup must call [`store_tile_done`] before the block ends (its
/// thread 0, which commits the stores, waits there).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn store_tile_tma<const ACC: usize>(
    map_out: u64,
    stage: u32,
    c: usize,
    t: usize,
    tm: usize,
    tn: usize,
    bn: usize,
    acc: &[f32; ACC],
) {
    const { assert!(ACC % 8 == 0 && (ACC * 2) % BOX_COLS == 0) };
    let leader = t == 0;
    if leader {
        tma::store_wait_read::<0>();
    }
    let barrier = 1 + c as u32;
    named_sync(barrier, 128);
    // Lanes 8i..8i+7 address matrix i of a 16 × 16 block: rows (i % 2)·8 on,
    // columns (i / 2)·8 on; matrix i is the fragment of 8-column group
    // 2g + i / 2 at row half i % 2.
    let (warp, lane) = (t / 32, t % 32);
    let i = lane / 8;
    let row = warp * 16 + (i % 2) * 8 + lane % 8;
    let word = |j: usize, h: usize| pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    for g in 0..ACC / 8 {
        let col = 16 * g + (i / 2) * 8;
        // The 16-byte chunk of the 128-byte row, XORed with the row's place in
        // its 8-row group (the swizzle).
        let chunk = ((col % BOX_COLS) / 8) ^ (row % 8);
        let at = stage + ((col / BOX_COLS) * BOX_BYTES + row * 128 + chunk * 16) as u32;
        stmatrix_x4(at, [word(2 * g, 0), word(2 * g, 1), word(2 * g + 1, 0), word(2 * g + 1, 1)]);
    }
    // Each thread's stores before the copy engine reads them.
    wgmma::fence_proxy_async_shared();
    named_sync(barrier, 128);
    if leader {
        let row0 = (tm * BM + c * BOX_ROWS) as i32;
        for b in 0..bn / BOX_COLS {
            tma::store_2d(map_out, (tn * bn + b * BOX_COLS) as i32, row0, stage + (b * BOX_BYTES) as u32);
        }
        tma::store_commit();
    }
}

/// The warpgroup's stores have completed: before the block ends (the staging
/// must outlive their reads), by its first thread.
#[inline(always)]
pub(crate) fn store_tile_done(t: usize) {
    if t == 0 {
        tma::store_wait::<0>();
    }
}
