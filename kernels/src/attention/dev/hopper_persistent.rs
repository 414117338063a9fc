//! The shipped warp-specialized Hopper kernel (`flash_hopper_ws`) with other
//! schedules, rescales and tilings:
//! - **Tiles from a counter** (`flash_fwd_hopper_persistent_*`): the walk's
//!   order, each block taking its next tile as it finishes the last
//!   (`Persistent`); racecheck reports its hand-over.
//! - **Lazy rescale** (`flash_fwd_hopper_lazy_*`, and with the walk
//!   `flash_fwd_hopper_persistent_lazy_*`). The reference max moves only when a
//!   tile's max passes it by more than 2^8; a warp none of whose rows moved
//!   skips O's rescale.
//! - **Split reductions** (`flash_fwd_hopper_split_*`). Each row's max and sum
//!   in four partials: a quarter of the softmax's dependent chain.
//! - **Turns at the exponentials** (`flash_fwd_hopper_turns_*`, with the
//!   strided walk `flash_fwd_hopper_turns_walk_hd128`). The consumers take turns
//!   on named barriers for the ex2 of their softmax, so one's SFU work runs
//!   while the other's GEMMs do, and they stay half a tile apart.
//! - **A quarter of the exponentials on the FMA pipe**
//!   (`flash_fwd_hopper_fma_ex2_*`, with the strided walk at head dim 128):
//!   the SFU's ex2 for three C fragments in four, a polynomial for the fourth.
//! - **Three consumers** (`flash_fwd_hopper_m192_hd64`): 192 query rows, as
//!   FlashAttention-3 takes at head dim 64, where a warpgroup's softmax takes as
//!   long as its GEMMs: a third warpgroup's GEMMs run under the other two's.
//! - **176-key tiles** (`flash_fwd_hopper_n176_*`, head dims 64 and 128), as
//!   FlashAttention-3 takes without a causal mask: the per-tile steps over
//!   1.375× the keys.

use crate::attention::flash_hopper_ws::{
    flash_hopper_ws, Announce, Consumer, Eager, Handoff, Hd128, Hd256, Hd64, OneTile, RegisterQ, Rescale, Schedule,
    SharedQ, HANDOFF_BARRIER, HANDOFF_THREADS,
};
use crate::attention::hopper_tile::{Keys128, Keys128Rows192, Keys176, Keys64, QueryTile, BM, BN};
use crate::attention::hopper_walk::Strided;
use crate::attention::tile_ops::{
    online_softmax_in_turn, rescale, rescale_if_moved, softmax_scores_fma_ex2, softmax_scores_lazy,
    softmax_scores_split,
};
use crate::gpu::mem::{atom_add_relaxed_u32, st_relaxed_u32};
use crate::gpu::mma::FragC;
use crate::gpu::thread::{
    block_idx_x, grid_dim_x, named_arrive, named_arrive_after, named_sync, named_sync_after, thread_idx_x,
};
use crate::gpu::warp::shuffle_u32;
use abi::FlashTmaArgs;

/// The walk's tiles handed out as blocks finish: each block's first by its
/// index, the rest from `tile_counter`, which every block's fetches take from 0 to the
/// tile count; the fetch that takes the last value sets it back to 0. The
/// producer's warp meets each consumer warpgroup at a named barrier once the
/// tile's Q load is issued, with the tile's index in the word by its parity;
/// racecheck reports the words' stores and loads as racing even so.
struct Persistent;

/// The hand-over word that ends the walk.
const END: u32 = u32::MAX;

impl Schedule for Persistent {
    #[inline(always)]
    unsafe fn produce(a: &FlashTmaArgs, h: Handoff, rows: usize, mut each: impl FnMut(QueryTile, u32, Announce)) {
        let total = a.walk_tiles();
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
        _: Consumer,
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
        _: Consumer,
    ) {
        let corr = softmax_scores_split(s, m, l, scale_log2);
        rescale(o, corr);
    }
}

/// O rescaled on every tile, as [`Eager`], with a quarter of the
/// exponentials on the FMA pipe ([`softmax_scores_fma_ex2`]).
struct FmaEx2;

impl Rescale for FmaEx2 {
    #[inline(always)]
    fn online_softmax<const NT: usize, const DT: usize>(
        s: &mut [FragC; NT],
        o: &mut [FragC; DT],
        m: &mut [f32; 2],
        l: &mut [f32; 2],
        scale_log2: f32,
        _: Consumer,
    ) {
        let corr = softmax_scores_fma_ex2(s, m, l, scale_log2);
        rescale(o, corr);
    }
}

/// Named barriers of the consumers' turns at the exponentials, one per
/// consumer warpgroup from here (after the hand-over's).
const TURN_BARRIER: u32 = HANDOFF_BARRIER + 3;
// Up to three consumers, within the 16 named barriers.
const _: () = assert!(TURN_BARRIER + 3 <= 16);
/// The warpgroup whose turn it is and the one handing it over.
const TURN_THREADS: u32 = 2 * 128;

/// O rescaled on every tile, as [`Eager`], the consumers taking turns at the
/// exponentials in a ring ([`online_softmax_in_turn`]): consumer c waits on
/// barrier `TURN_BARRIER + c` and hands over on the next one's. The last
/// consumer's hand-over opens the ring; consumer 0 takes the hand-over that
/// closes it.
struct Turns;

impl Rescale for Turns {
    #[inline(always)]
    fn begin(who: Consumer) {
        if who.c == who.count - 1 {
            named_arrive(TURN_BARRIER, TURN_THREADS);
        }
    }
    #[inline(always)]
    fn end(who: Consumer) {
        if who.c == 0 {
            named_sync(TURN_BARRIER, TURN_THREADS);
        }
    }
    #[inline(always)]
    fn online_softmax<const NT: usize, const DT: usize>(
        s: &mut [FragC; NT],
        o: &mut [FragC; DT],
        m: &mut [f32; 2],
        l: &mut [f32; 2],
        scale_log2: f32,
        who: Consumer,
    ) {
        online_softmax_in_turn(
            s,
            o,
            m,
            l,
            scale_log2,
            |refs| named_sync_after(TURN_BARRIER + who.c, TURN_THREADS, refs, who.anchor),
            |sums| named_arrive_after(TURN_BARRIER + (who.c + 1) % who.count, TURN_THREADS, sums, who.anchor),
        );
    }
}

/// The three head dims' entries of one schedule and rescale; Q at head dim 64
/// as `$q64` reads it (from shared memory at 128 and 256).
macro_rules! entries {
    ($schedule:ty, $rescale:ty, $q64:ty, $hd64:ident, $hd128:ident, $hd256:ident) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $hd64(a: FlashTmaArgs) {
            flash_hopper_ws::<BM, 64, 1, 8, Hd64, BN, 64, 16, 8, Keys128, $schedule, $rescale, $q64>(a)
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

entries!(OneTile, Lazy, SharedQ, flash_fwd_hopper_lazy_hd64, flash_fwd_hopper_lazy_hd128, flash_fwd_hopper_lazy_hd256);
entries!(
    OneTile,
    Split,
    SharedQ,
    flash_fwd_hopper_split_hd64,
    flash_fwd_hopper_split_hd128,
    flash_fwd_hopper_split_hd256
);
entries!(
    OneTile,
    Turns,
    RegisterQ,
    flash_fwd_hopper_turns_hd64,
    flash_fwd_hopper_turns_hd128,
    flash_fwd_hopper_turns_hd256
);
entries!(
    OneTile,
    FmaEx2,
    RegisterQ,
    flash_fwd_hopper_fma_ex2_hd64,
    flash_fwd_hopper_fma_ex2_hd128,
    flash_fwd_hopper_fma_ex2_hd256
);
// The walk at head dim 128 only, as `HopperTurns` takes it.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_fma_ex2_walk_hd128(a: FlashTmaArgs) {
    flash_hopper_ws::<BM, 128, 2, 16, Hd128, BN, 64, 16, 8, Keys128, Strided, FmaEx2, SharedQ>(a)
}
crate::launch_bounds!(flash_fwd_hopper_fma_ex2_walk_hd128: FlashTmaArgs, 384, 1);

// The walk with turns at head dim 128 only: at 256 its consumers spill.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_turns_walk_hd128(a: FlashTmaArgs) {
    flash_hopper_ws::<BM, 128, 2, 16, Hd128, BN, 64, 16, 8, Keys128, Strided, Turns, SharedQ>(a)
}
crate::launch_bounds!(flash_fwd_hopper_turns_walk_hd128: FlashTmaArgs, 384, 1);

entries!(
    Persistent,
    Eager,
    RegisterQ,
    flash_fwd_hopper_persistent_hd64,
    flash_fwd_hopper_persistent_hd128,
    flash_fwd_hopper_persistent_hd256
);
entries!(
    Persistent,
    Lazy,
    SharedQ,
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

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_m192_hd64(a: FlashTmaArgs) {
    flash_hopper_ws::<192, 64, 1, 8, Hd64, BN, 64, 16, 8, Keys128Rows192, OneTile, Eager, SharedQ>(a)
}
crate::launch_bounds!(flash_fwd_hopper_m192_hd64: FlashTmaArgs, 512, 1);
