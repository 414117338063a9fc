//! The shipped warp-specialized Hopper kernel (`flash_hopper_ws`) with a
//! persistent schedule, a lazy rescale of O, both, or split softmax reductions:
//! - **Persistent** (`flash_fwd_hopper_persistent_*`). At most one block per SM
//!   walks the tile grid longest-first within L2-sized sections
//!   ([`QueryTile::of_walk`]), taking its next tile from a global counter as it
//!   finishes the last, so under a causal mask the short tiles fill the end. Its
//!   producer runs ahead across tiles: the next tile's first K/V stage and Q load
//!   while the consumers still finish the last tile and write it out.
//! - **Lazy rescale** (`flash_fwd_hopper_lazy_*`). The reference max moves only
//!   when a tile's max passes it by more than 2^8; a warp none of whose rows
//!   moved skips O's rescale.
//! - **Split reductions** (`flash_fwd_hopper_split_*`). Each row's max and sum
//!   in four partials: a quarter of the softmax's dependent chain.
//! - **Q in registers** (`flash_fwd_hopper_qreg_*`, head dims 64 and 128). Each
//!   consumer loads its rows of Q as A fragments once per tile and releases the
//!   buffer; S = Q·Kᵀ then reads only K from shared memory, a third less
//!   traffic there per S step.
//! - **Three consumers** (`flash_fwd_hopper_m192_hd64`): 192 query rows, as
//!   FlashAttention-3 takes at head dim 64, where a warpgroup's softmax takes as
//!   long as its GEMMs: a third warpgroup's GEMMs run under the other two's.
//! - **176-key tiles** (`flash_fwd_hopper_n176_*`, head dims 64 and 128), as
//!   FlashAttention-3 takes without a causal mask: the per-tile steps over
//!   1.375× the keys.

use crate::attention::flash_hopper_ws::{
    flash_hopper_ws, Eager, Handoff, Hd128, Hd256, Hd64, OneTile, QOperand, Rescale, Schedule, SharedQ,
};
use crate::attention::hopper_tile::{KeyTile, Keys128, Keys128Rows192, Keys176, Keys64, QueryTile, TileSmem, BM, BN};
use crate::attention::tile_ops::{rescale, rescale_if_moved, softmax_scores_lazy, softmax_scores_split};
use crate::gpu::mem::{atom_add_relaxed_u32, st_relaxed_u32};
use crate::gpu::mma::FragC;
use crate::gpu::thread::{block_idx_x, grid_dim_x};
use abi::FlashTmaArgs;

/// Tiles handed out as blocks finish: each block's first by its index, the
/// rest from `tile_counter`, which every block's fetches take from 0 to the
/// tile count; the fetch that takes the last value sets it back to 0.
struct Persistent;

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
            if t == END {
                return;
            }
            each(QueryTile::of_walk(a, t, rows), n);
            n += 1;
        }
    }
}

/// The reference max held within 2^8 of the row max ([`softmax_scores_lazy`]).
struct Lazy;

impl Rescale for Lazy {
    #[inline(always)]
    fn online_softmax<const NT: usize, const DT: usize>(
        s: &mut [FragC; NT],
        o: &mut [FragC; DT],
        m: &mut [f32; 2],
        l: &mut [f32; 2],
        scale_log2: f32,
    ) {
        let corr = softmax_scores_lazy(s, m, l, scale_log2);
        rescale_if_moved(o, corr);
    }
}

/// O rescaled on every tile, as [`Eager`], with the row max and sum in four
/// partials each ([`softmax_scores_split`]).
struct Split;

impl Rescale for Split {
    #[inline(always)]
    fn online_softmax<const NT: usize, const DT: usize>(
        s: &mut [FragC; NT],
        o: &mut [FragC; DT],
        m: &mut [f32; 2],
        l: &mut [f32; 2],
        scale_log2: f32,
    ) {
        let corr = softmax_scores_split(s, m, l, scale_log2);
        rescale(o, corr);
    }
}

macro_rules! entries {
    ($schedule:ty, $rescale:ty, $hd64:ident, $hd128:ident, $hd256:ident) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $hd64(a: FlashTmaArgs) {
            flash_hopper_ws::<BM, 64, 1, 8, Hd64, BN, 64, 16, 8, Keys128, $schedule, $rescale, SharedQ>(a)
        }
        crate::launch_bounds!($hd64: FlashTmaArgs, 384, 1);

        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $hd128(a: FlashTmaArgs) {
            flash_hopper_ws::<BM, 128, 2, 16, Hd128, BN, 64, 16, 8, Keys128, $schedule, $rescale, SharedQ>(a)
        }
        crate::launch_bounds!($hd128: FlashTmaArgs, 384, 1);

        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $hd256(a: FlashTmaArgs) {
            flash_hopper_ws::<BM, 256, 4, 32, Hd256, 64, 32, 8, 4, Keys64, $schedule, $rescale, SharedQ>(a)
        }
        crate::launch_bounds!($hd256: FlashTmaArgs, 384, 1);
    };
}

entries!(OneTile, Lazy, flash_fwd_hopper_lazy_hd64, flash_fwd_hopper_lazy_hd128, flash_fwd_hopper_lazy_hd256);
entries!(OneTile, Split, flash_fwd_hopper_split_hd64, flash_fwd_hopper_split_hd128, flash_fwd_hopper_split_hd256);
entries!(
    Persistent,
    Eager,
    flash_fwd_hopper_persistent_hd64,
    flash_fwd_hopper_persistent_hd128,
    flash_fwd_hopper_persistent_hd256
);
entries!(
    Persistent,
    Lazy,
    flash_fwd_hopper_persistent_lazy_hd64,
    flash_fwd_hopper_persistent_lazy_hd128,
    flash_fwd_hopper_persistent_lazy_hd256
);

macro_rules! entry_n176 {
    ($name:ident, $d:literal, $halves:literal, $dtiles:literal, $pv:ty, $schedule:ty) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: FlashTmaArgs) {
            flash_hopper_ws::<BM, $d, $halves, $dtiles, $pv, 176, 88, 22, 11, Keys176, $schedule, Eager, SharedQ>(a)
        }
        crate::launch_bounds!($name: FlashTmaArgs, 384, 1);
    };
}

entry_n176!(flash_fwd_hopper_n176_hd64, 64, 1, 8, Hd64, OneTile);
entry_n176!(flash_fwd_hopper_n176_hd128, 128, 2, 16, Hd128, OneTile);
// Not at head dim 128: with the walk's state the consumers spill.
entry_n176!(flash_fwd_hopper_persistent_n176_hd64, 64, 1, 8, Hd64, Persistent);

/// Q's fragments in registers ([`TileSmem::q_frags`]), head dims 64 and 128.
struct RegisterQ;

impl QOperand for RegisterQ {
    const RELEASED_AT_LOAD: bool = true;
    type Frags = [[u32; 4]; 8];
    #[inline(always)]
    unsafe fn load<const HALVES: usize, const KEYS: usize, const ROWS: usize>(
        mem: &TileSmem<HALVES, KEYS, ROWS>,
        c: usize,
        t: usize,
    ) -> [[u32; 4]; 8] {
        mem.q_frags(c, t)
    }
    #[inline(always)]
    fn qk<const HALVES: usize, const KEYS: usize, const ROWS: usize, const SACC: usize, K: KeyTile<SACC>>(
        mem: &TileSmem<HALVES, KEYS, ROWS>,
        q: &[[u32; 4]; 8],
        acc: &mut [f32; SACC],
        s: usize,
        _: usize,
    ) {
        mem.qk_rs::<SACC, K>(acc, q, s);
    }
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_qreg_hd64(a: FlashTmaArgs) {
    flash_hopper_ws::<BM, 64, 1, 8, Hd64, BN, 64, 16, 8, Keys128, OneTile, Eager, RegisterQ>(a)
}
crate::launch_bounds!(flash_fwd_hopper_qreg_hd64: FlashTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_qreg_hd128(a: FlashTmaArgs) {
    flash_hopper_ws::<BM, 128, 2, 16, Hd128, BN, 64, 16, 8, Keys128, OneTile, Eager, RegisterQ>(a)
}
crate::launch_bounds!(flash_fwd_hopper_qreg_hd128: FlashTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_m192_hd64(a: FlashTmaArgs) {
    flash_hopper_ws::<192, 64, 1, 8, Hd64, BN, 64, 16, 8, Keys128Rows192, OneTile, Eager, SharedQ>(a)
}
crate::launch_bounds!(flash_fwd_hopper_m192_hd64: FlashTmaArgs, 512, 1);
