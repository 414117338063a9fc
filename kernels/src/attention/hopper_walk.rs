//! The persistent schedule of the Hopper kernel: at most one block per SM walks
//! the tile grid longest-first within L2-sized sections
//! ([`QueryTile::of_walk`]), taking its next tile from a global counter as it
//! finishes the last, so under a causal mask the short tiles fill the end. The
//! producer runs ahead across tiles: the next tile's first K/V stage and Q load
//! while the consumers finish the last tile and write it out.
//!
//! The producer's warp hands each tile's index to the consumers through one
//! shared word, as FlashAttention-3's scheduler does: it waits on each consumer
//! warpgroup's empty barrier before its first thread writes the word (all of
//! the warpgroup has read the last one) and arrives on its full barrier after.

use super::flash_hopper_ws::{Handoff, Schedule};
use super::hopper_tile::QueryTile;
use crate::gpu::mem::{atom_add_relaxed_u32, st_relaxed_u32};
use crate::gpu::thread::{block_idx_x, grid_dim_x, named_arrive, named_sync, thread_idx_x};
use crate::gpu::warp::{shuffle_u32, sync_warp};
use abi::FlashTmaArgs;

/// Tiles handed out as blocks finish: each block's first by its index, the
/// rest from `tile_counter`, which every block's fetches take from 0 to the
/// tile count; the fetch that takes the last value sets it back to 0.
pub(in crate::attention) struct Persistent;

/// The hand-over word that ends the walk.
const END: u32 = u32::MAX;
/// Named barriers of the hand-over: full ones from 4 and empty ones from 7, one
/// per consumer warpgroup (up to three). 0 is the block's, 1–3 the warpgroups'.
const FULL: u32 = 4;
const EMPTY: u32 = 7;
/// A consumer warpgroup and the producer's warp.
const PAIR_THREADS: u32 = 128 + 32;

/// The producer warp's side: waits until every consumer has read the last word
/// (none before the first), writes `t` and lets them read it.
#[inline(always)]
unsafe fn publish(h: Handoff, consumers: u32, first: bool, t: u32) {
    // The first thread comes from issuing the last tile's loads.
    sync_warp();
    if !first {
        for c in 0..consumers {
            named_sync(EMPTY + c, PAIR_THREADS);
        }
    }
    if thread_idx_x() == 0 {
        h.word.store(0, t);
    }
    for c in 0..consumers {
        named_arrive(FULL + c, PAIR_THREADS);
    }
}

impl Schedule for Persistent {
    #[inline(always)]
    unsafe fn produce(a: &FlashTmaArgs, h: Handoff, rows: usize, mut each: impl FnMut(QueryTile, u32)) {
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
                publish(h, consumers, n == 0, t);
                each(tile, n);
                n += 1;
            }
            t = grid_dim_x() + taken;
        }
        publish(h, consumers, n == 0, END);
    }

    #[inline(always)]
    unsafe fn consume(a: &FlashTmaArgs, h: Handoff, rows: usize, mut each: impl FnMut(QueryTile, u32)) {
        let c = thread_idx_x() / 128 - 1;
        let mut n = 0;
        loop {
            named_sync(FULL + c, PAIR_THREADS);
            let t = h.word.load(0);
            if t == END {
                return;
            }
            named_arrive(EMPTY + c, PAIR_THREADS);
            each(QueryTile::of_walk(a, t, rows), n);
            n += 1;
        }
    }
}
