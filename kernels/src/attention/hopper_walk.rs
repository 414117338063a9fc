//! The persistent schedules of the Hopper kernel: at most one block per SM walks
//! the tile grid longest-first within L2-sized sections
//! ([`QueryTile::of_walk`]), so under a causal mask the short tiles fill the
//! end. The producer runs ahead across tiles: the next tile's first K/V stage
//! and Q load while the consumers finish the last tile and write it out.
//! - [`Strided`] (shipped over equal tiles: the host's `plan::walk`):
//!   block `b` takes walk tiles `b`, `b + grid`, …; the producer and the
//!   consumers each count them, so nothing is handed over.
//! - [`Counter`] (shipped where tiles differ in length or are short): each
//!   block takes its next tile from a global counter as it finishes the last,
//!   handing each tile's index to the consumers through a shared word
//!   ([`Announce`]).

use super::flash_hopper_ws::{Announce, Handoff, Schedule};
use super::hopper_tile::QueryTile;
use crate::gpu::mem::{atom_add_relaxed_u32, st_relaxed_u32};
use crate::gpu::thread::{block_idx_x, grid_dim_x, thread_idx_x};
use crate::gpu::warp::shuffle_u32;
use abi::FlashTmaArgs;

/// Walk tiles `block, block + grid, …`.
pub(in crate::attention) struct Strided;

impl Strided {
    #[inline(always)]
    unsafe fn walk(a: &FlashTmaArgs, rows: usize, mut each: impl FnMut(QueryTile, u32)) {
        let (mut t, mut n) = (block_idx_x(), 0);
        while t < a.walk_tiles() {
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
        Strided::walk(a, rows, |tile, n| each(tile, n, Announce { h, word: None }))
    }
    #[inline(always)]
    unsafe fn consume(a: &FlashTmaArgs, _: Handoff, rows: usize, each: impl FnMut(QueryTile, u32)) {
        Strided::walk(a, rows, each)
    }
}

/// The walk's tiles handed out as blocks finish: each block's first by its
/// index, the rest from `tile_counter` (the GPU's, which only this stream's
/// launches use, one after another), which every block's fetches take from 0
/// to the tile count; the fetch that takes the last value sets it back to 0.
/// The producer's first thread hands each tile's index to the consumers with
/// its Q load ([`Handoff`]), and [`END`] after the last.
pub(in crate::attention) struct Counter;

/// The hand-over word that ends the walk.
const END: u32 = u32::MAX;

impl Schedule for Counter {
    const HANDS_OVER: bool = true;

    #[inline(always)]
    unsafe fn produce(a: &FlashTmaArgs, h: Handoff, rows: usize, mut each: impl FnMut(QueryTile, u32, Announce)) {
        let total = a.walk_tiles();
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
                each(tile, n, Announce { h, word: Some(t) });
                n += 1;
            }
            t = grid_dim_x() + taken;
        }
        if thread_idx_x() == 0 {
            if n > 0 {
                h.q_empty.wait((n - 1) & 1);
            }
            Announce { h, word: Some(END) }.publish();
            h.q_full.arrive();
        }
    }

    #[inline(always)]
    unsafe fn consume(a: &FlashTmaArgs, h: Handoff, rows: usize, mut each: impl FnMut(QueryTile, u32)) {
        let mut n = 0u32;
        loop {
            // The tile's own wait on this phase then passes at once.
            h.q_full.wait(n & 1);
            let t = h.word.load(0);
            if t == END {
                return;
            }
            each(QueryTile::of_walk(a, t, rows), n);
            n += 1;
        }
    }
}
