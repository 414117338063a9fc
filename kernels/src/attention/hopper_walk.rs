//! The persistent schedule of the shipped Hopper kernel: at most one block per
//! SM walks the tile grid longest-first within L2-sized sections
//! ([`QueryTile::of_walk`]), taking its next tile from a global counter as it
//! finishes the last, so under a causal mask the short tiles fill the end. The
//! producer runs ahead across tiles: the next tile's first K/V stage and Q load
//! while the consumers finish the last tile and write it out.

use super::flash_hopper_ws::{Handoff, Schedule};
use super::hopper_tile::QueryTile;
use crate::gpu::mem::{atom_add_relaxed_u32, st_relaxed_u32};
use crate::gpu::thread::{block_idx_x, grid_dim_x, named_sync, thread_idx_x};
use abi::FlashTmaArgs;

/// Tiles handed out as blocks finish: each block's first by its index, the
/// rest from `tile_counter`, which every block's fetches take from 0 to the
/// tile count; the fetch that takes the last value sets it back to 0.
pub(in crate::attention) struct Persistent;

/// The hand-over word that ends the walk.
const END: u32 = u32::MAX;

impl Schedule for Persistent {
    #[inline(always)]
    unsafe fn produce(a: &FlashTmaArgs, h: Handoff, rows: usize, mut each: impl FnMut(QueryTile, u32)) {
        let total = a.flash.n_heads * a.query_tiles * a.sequences;
        let counter = a.tile_counter as *mut u32;
        let (mut t, mut n) = (block_idx_x(), 0);
        while t < total {
            // Taken before this tile's loads are issued, so its latency hides under them.
            let taken = atom_add_relaxed_u32(counter, 1);
            if taken == total - 1 {
                st_relaxed_u32(counter, 0);
            }
            let tile = QueryTile::of_walk(a, t, rows);
            if !tile.is_past_end() {
                // Word n % 2 was last read for tile n − 2, before the consumers
                // released its Q, which the producer waited for on tile n − 1.
                h.slots.store((n & 1) as usize, t);
                each(tile, n);
                n += 1;
            }
            t = grid_dim_x() + taken;
        }
        // The consumers are done with the last Q (and its word); a bare arrival
        // completes Q's next phase with the end word in place.
        if n > 0 {
            h.q_empty.wait((n - 1) & 1);
        }
        h.slots.store((n & 1) as usize, END);
        h.q_full.arrive();
    }

    #[inline(always)]
    unsafe fn consume(a: &FlashTmaArgs, h: Handoff, rows: usize, mut each: impl FnMut(QueryTile, u32)) {
        let mut n = 0;
        loop {
            // `each` waits on this phase again: it has not moved on, as the
            // producer waits for this tile's Q to be released first.
            h.q_full.wait(n & 1);
            let t = h.slots.load((n & 1) as usize);
            // Every thread of the warpgroup has read the word before its first
            // thread releases the tile's Q, after which the producer rewrites it.
            named_sync(thread_idx_x() / 128, 128);
            if t == END {
                return;
            }
            each(QueryTile::of_walk(a, t, rows), n);
            n += 1;
        }
    }
}

