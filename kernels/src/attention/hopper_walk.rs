//! The persistent schedules of the Hopper kernel: at most one block per SM walks
//! the tile grid longest-first within L2-sized sections
//! ([`QueryTile::of_walk`]), so under a causal mask the short tiles fill the
//! end. The producer runs ahead across tiles: the next tile's first K/V stage
//! and Q load while the consumers finish the last tile and write it out.
//! - [`Strided`] (shipped where the tiles are equal or short: the host's
//!   `plan::walks`):
//!   block `b` takes walk tiles `b`, `b + grid`, …; the producer and the
//!   consumers each count them, so nothing is handed over.
//! - `Persistent` (`dev::hopper_persistent`): each block takes its next tile
//!   from a global counter as it finishes the last, handing each tile's index
//!   to the consumers through shared words ([`Announce`]).

use super::flash_hopper_ws::{Announce, Handoff, Schedule};
use super::hopper_tile::QueryTile;
use crate::gpu::thread::{block_idx_x, grid_dim_x};
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
        Strided::walk(a, rows, |tile, n| each(tile, n, Announce { h, n, word: None, consumers: 0 }))
    }
    #[inline(always)]
    unsafe fn consume(a: &FlashTmaArgs, _: Handoff, rows: usize, each: impl FnMut(QueryTile, u32)) {
        Strided::walk(a, rows, each)
    }
}
