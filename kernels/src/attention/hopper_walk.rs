//! The persistent schedules of the Hopper kernel: at most one block per SM walks
//! the tile grid longest-first within L2-sized sections
//! ([`QueryTile::of_walk`]), so under a causal mask the short tiles fill the
//! end. The producer runs ahead across tiles: the next tile's first K/V stage
//! and Q load while the consumers finish the last tile and write it out.
//! - [`Strided`] (shipped at head dims 128 and 256 without a causal mask): block `b` takes walk tiles `b`, `b + grid`, …; the
//!   producer and the consumers each count them, so nothing is handed over.
//! - [`Persistent`] (dev): each block takes its next tile from a global counter
//!   as it finishes the last. The producer's warp hands each tile's index to
//!   the consumers through two shared words ([`Announce`]), meeting each
//!   consumer warpgroup at a named barrier once the tile's Q load is issued.
//!   Racecheck reports the words' stores and loads as racing even so.

use super::flash_hopper_ws::{Announce, Handoff, Schedule};
#[cfg(feature = "dev")]
use super::flash_hopper_ws::{HANDOFF_BARRIER, HANDOFF_THREADS};
use super::hopper_tile::QueryTile;
#[cfg(feature = "dev")]
use crate::gpu::mem::{atom_add_relaxed_u32, st_relaxed_u32};
use crate::gpu::thread::{block_idx_x, grid_dim_x};
#[cfg(feature = "dev")]
use crate::gpu::thread::{named_sync, thread_idx_x};
#[cfg(feature = "dev")]
use crate::gpu::warp::shuffle_u32;
use abi::FlashTmaArgs;

/// Walk tiles `block, block + grid, …`.
pub(in crate::attention) struct Strided;

impl Strided {
    #[inline(always)]
    unsafe fn walk(a: &FlashTmaArgs, rows: usize, mut each: impl FnMut(QueryTile, u32)) {
        let total = a.flash.n_heads * a.query_tiles * a.sequences;
        let (mut t, mut n) = (block_idx_x(), 0);
        while t < total {
            let tile = QueryTile::of_walk(a, t, rows);
            if !tile.is_past_end() {
                each(tile, n);
                n += 1;
            }
            t += grid_dim_x();
        }
    }
}

impl Schedule for Strided {
    #[inline(always)]
    unsafe fn produce(a: &FlashTmaArgs, h: Handoff, rows: usize, mut each: impl FnMut(QueryTile, u32, Announce)) {
        Strided::walk(a, rows, |tile, n| each(tile, n, Announce { h, n, word: None, consumers: 0 }))
    }
    #[inline(always)]
    unsafe fn consume(a: &FlashTmaArgs, _: Handoff, rows: usize, each: impl FnMut(QueryTile, u32)) {
        Strided::walk(a, rows, each)
    }
}

/// Tiles handed out as blocks finish: each block's first by its index, the
/// rest from `tile_counter`, which every block's fetches take from 0 to the
/// tile count; the fetch that takes the last value sets it back to 0.
#[cfg(feature = "dev")]
pub(in crate::attention) struct Persistent;

/// The hand-over word that ends the walk.
#[cfg(feature = "dev")]
const END: u32 = u32::MAX;

#[cfg(feature = "dev")]
impl Schedule for Persistent {
    #[inline(always)]
    unsafe fn produce(a: &FlashTmaArgs, h: Handoff, rows: usize, mut each: impl FnMut(QueryTile, u32, Announce)) {
        let total = a.flash.n_heads * a.query_tiles * a.sequences;
        let consumers = (rows / 64) as u32;
        let counter = a.tile_counter as *mut u32;
        let (mut t, mut n) = (block_idx_x(), 0);
        while t < total {
            // Taken before this tile's loads are issued, so its latency hides under them.
            let mut taken = 0;
            if thread_idx_x() == 0 {
                taken = atom_add_relaxed_u32(counter, 1);
                if taken == total - 1 {
                    st_relaxed_u32(counter, 0);
                }
            }
            let taken = shuffle_u32(taken, 0);
            let tile = QueryTile::of_walk(a, t, rows);
            if !tile.is_past_end() {
                each(tile, n, Announce { h, n, word: Some(t), consumers });
                n += 1;
            }
            t = grid_dim_x() + taken;
        }
        Announce { h, n, word: Some(END), consumers }.send();
    }

    #[inline(always)]
    unsafe fn consume(a: &FlashTmaArgs, h: Handoff, rows: usize, mut each: impl FnMut(QueryTile, u32)) {
        let c = thread_idx_x() / 128 - 1;
        let mut n = 0u32;
        loop {
            named_sync(HANDOFF_BARRIER + c, HANDOFF_THREADS);
            let t = h.words.load((n & 1) as usize);
            if t == END {
                return;
            }
            each(QueryTile::of_walk(a, t, rows), n);
            n += 1;
        }
    }
}
