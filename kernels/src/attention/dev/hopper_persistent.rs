//! The shipped warp-specialized Hopper kernel (`flash_hopper_ws`) with other
//! schedules, rescales and tilings:
//! - **Lazy rescale** (`flash_fwd_hopper_lazy_*`, and with the counter walk
//!   `flash_fwd_hopper_persistent_lazy_*`). The reference max moves only when a
//!   tile's max passes it by more than 2^8; a warp none of whose rows moved
//!   skips O's rescale.
//! - **Split reductions** (`flash_fwd_hopper_split_*`). Each row's max and sum
//!   in four partials: a quarter of the softmax's dependent chain.
//! - **Turns at the exponentials** (`hopper_turns::Turns`, shipped at head dim
//!   128 with a causal mask and at 64 on the counter walk) at head dims 64 and
//!   256 on one tile per block (`flash_fwd_hopper_turns_*`) and on the strided
//!   walk at 128 and 256 (`flash_fwd_hopper_turns_walk_*`), at 256 on the
//!   shipped 128-key tiles.
//! - **Free consumers on the counter walk at head dim 64**
//!   (`flash_fwd_hopper_free_counter_hd64`), shipped there before the turns,
//!   and at 256 on the 128-key tiles (`flash_fwd_hopper_free_hd256`,
//!   `_walk_hd256`), shipped there before the turns at issuing.
//! - **A quarter of the exponentials on the FMA pipe**
//!   (`flash_fwd_hopper_fma_ex2_*`, with the strided walk at head dim 128):
//!   the SFU's ex2 for three C fragments in four, a polynomial for the fourth.
//! - **Three K/V stages** (`flash_fwd_hopper_stages3_*`, head dims 64 and
//!   128, on each walk the shipped kernel's consumers there): a stage both
//!   consumers have released has a tile and a half of their work to land
//!   before the first one needs it, not half a tile.
//! - **80-key tiles at head dim 256** (`flash_fwd_hopper_n80_walk_hd256`, the
//!   strided walk): FlashAttention-3's key tile there, 1.25× the keys a step.
//! - **64-key tiles at head dim 256** (`flash_fwd_hopper_n64_hd256`,
//!   `_walk_hd256`) in two stages, where the shipped kernel takes 128-key tiles
//!   in one stage of K and one of V (its 64-key tiles stay on the counter walk);
//!   and 128-key tiles on the counter walk (`flash_fwd_hopper_n128_counter_hd256`).
//! - **176-key tiles** (`flash_fwd_hopper_n176_*`, head dims 64 and 128, and
//!   at 64 with the counter walk), as FlashAttention-3 takes without a causal
//!   mask: the per-tile steps over 1.375× the keys.
//! - **O by TMA stores** (`flash_fwd_hopper_tma_store_*`, `_walk_*`,
//!   `_counter_*`, head dims 64 and 128): the shipped kernels with `TmaStores`
//!   writing O (at 64 on the counter walk with its turns), staged in shared
//!   memory past the barriers (head dim 256's tiles leave no room for it).
//! - **P·V one tile late** (`flash_fwd_hopper_late_pv_*`, every head dim,
//!   and `_walk_*`, `_counter_*` at 64 and 128): FlashAttention-3's
//!   in-warpgroup pipeline, S(j) and P(j−1)·V(j−1) issued together and S(j)'s
//!   softmax under that P·V (`Rescale::LATE_PV`), K and V on barriers of their
//!   own; and with the consumers taking turns at issuing those GEMMs
//!   (`hopper_turns::LatePvTurns`, shipped at head dim 128 without a mask) at
//!   head dim 64, on the walks the shipped kernel does not take with it, and at
//!   256 on 64-key tiles in two stages, one tile per block and the strided walk
//!   (`flash_fwd_hopper_late_pv_turns_*`): FlashAttention-3's schedule there.
//! - **Turns at issuing, P·V in order** (`hopper_turns::IssueTurns`, shipped at
//!   head dim 256 off the counter walk) at head dims 64 and 128 on every walk
//!   (`flash_fwd_hopper_issue_turns_*`, `_walk_*`, `_counter_*`) and at 256 on
//!   the counter walk's 128-key tiles (`_counter_hd256`): the ping-pong without
//!   the late P·V's registers.

use crate::attention::flash_hopper_ws::{
    flash_hopper_ws, hopper_entries, hopper_entry, Consumer, Eager, Hd128, Hd256, Hd64, OneTile, QuadStores, RegisterQ,
    Rescale, SharedQ, TmaStores,
};
use crate::attention::hopper_tile::{Keys128Stages3, Keys176, Keys80, BM, BN};
use crate::attention::hopper_walk::{Counter, Strided};
use crate::attention::hopper_turns::{IssueTurns, LatePvTurns, Turns};
use crate::attention::tile_ops::{
    rescale, rescale_if_moved, softmax_scores_fma_ex2, softmax_scores_lazy, softmax_scores_split,
};
use crate::gpu::mma::FragC;
use abi::FlashTmaArgs;

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

hopper_entries!(OneTile, Lazy, SharedQ, flash_fwd_hopper_lazy_hd64, flash_fwd_hopper_lazy_hd128, flash_fwd_hopper_lazy_hd256);
hopper_entries!(
    OneTile,
    Split,
    SharedQ,
    flash_fwd_hopper_split_hd64,
    flash_fwd_hopper_split_hd128,
    flash_fwd_hopper_split_hd256
);
// Turns at head dim 64 on one tile per block, and at 256 on the shipped 128-key
// tiles on one tile per block and the strided walk (the shipped entries hold
// 128's and 64's counter walk).
hopper_entry!(64, flash_fwd_hopper_turns_hd64, OneTile, Turns, RegisterQ, QuadStores);
// The counter walk at 64 with free consumers, and at 256 the 128-key tiles with
// free consumers on one tile per block and the strided walk (shipped there
// before the turns at issuing).
hopper_entry!(64, flash_fwd_hopper_free_counter_hd64, Counter, Eager, RegisterQ, QuadStores);
hopper_entry!(256 keys128, flash_fwd_hopper_free_hd256, OneTile, Eager, QuadStores);
hopper_entry!(256 keys128, flash_fwd_hopper_free_walk_hd256, Strided, Eager, QuadStores);
hopper_entry!(256 keys128, flash_fwd_hopper_turns_hd256, OneTile, Turns, QuadStores);
hopper_entry!(256 keys128, flash_fwd_hopper_turns_walk_hd256, Strided, Turns, QuadStores);
hopper_entries!(
    OneTile,
    FmaEx2,
    RegisterQ,
    flash_fwd_hopper_fma_ex2_hd64,
    flash_fwd_hopper_fma_ex2_hd128,
    flash_fwd_hopper_fma_ex2_hd256
);
// The walk at head dim 128 only, as `HopperTurns` takes it.
hopper_entry!(128, flash_fwd_hopper_fma_ex2_walk_hd128, Strided, FmaEx2, QuadStores);

// The walk with turns at head dim 128 only: at 256 its consumers spill.
hopper_entry!(128, flash_fwd_hopper_turns_walk_hd128, Strided, Turns, QuadStores);

hopper_entries!(
    Counter,
    Lazy,
    SharedQ,
    flash_fwd_hopper_persistent_lazy_hd64,
    flash_fwd_hopper_persistent_lazy_hd128,
    flash_fwd_hopper_persistent_lazy_hd256
);

macro_rules! entry_n176 {
    ($name:ident, $d:literal, $halves:literal, $dtiles:literal, $pv:ty, $schedule:ty, $q:ty) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: FlashTmaArgs) {
            flash_hopper_ws::<BM, $d, $halves, $dtiles, $pv, 176, 88, 22, 11, Keys176, $schedule, Eager, $q, QuadStores>(a)
        }
        crate::launch_bounds!($name: FlashTmaArgs, 384, 1);
    };
}

// 80-key tiles at head dim 256, on the walk the shipped kernel takes there
// without a causal mask.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_n80_walk_hd256(a: FlashTmaArgs) {
    flash_hopper_ws::<BM, 256, 4, 32, Hd256, 80, 40, 10, 5, Keys80, Strided, Eager, SharedQ, QuadStores>(a)
}
crate::launch_bounds!(flash_fwd_hopper_n80_walk_hd256: FlashTmaArgs, 384, 1);

// 64-key tiles at head dim 256 in two stages, on one tile per block and the
// strided walk, where the shipped kernel takes 128-key tiles.
hopper_entry!(256, flash_fwd_hopper_n64_hd256, OneTile, Eager, QuadStores);
hopper_entry!(256, flash_fwd_hopper_n64_walk_hd256, Strided, Eager, QuadStores);
// 128-key tiles at head dim 256 on the counter walk, where the shipped kernel
// keeps 64-key tiles (short causal sequences).
hopper_entry!(256 keys128, flash_fwd_hopper_n128_counter_hd256, Counter, Eager, QuadStores);

entry_n176!(flash_fwd_hopper_n176_hd64, 64, 1, 8, Hd64, OneTile, SharedQ);
entry_n176!(flash_fwd_hopper_n176_hd128, 128, 2, 16, Hd128, OneTile, SharedQ);
// Not at head dim 128: with the walk's state the consumers spill.
entry_n176!(flash_fwd_hopper_persistent_n176_hd64, 64, 1, 8, Hd64, Counter, SharedQ);

/// The shipped kernel with three K/V stages at head dim `$d` on `$schedule`,
/// with `$rescale` and Q as `$q` says.
macro_rules! entry_stages3 {
    ($name:ident, $d:literal, $halves:literal, $dtiles:literal, $pv:ty, $schedule:ty, $rescale:ty, $q:ty) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: FlashTmaArgs) {
            flash_hopper_ws::<
                BM, $d, $halves, $dtiles, $pv, BN, 64, 16, 8, Keys128Stages3, $schedule, $rescale, $q, QuadStores,
            >(a)
        }
        crate::launch_bounds!($name: FlashTmaArgs, 384, 1);
    };
}

// The shipped consumers of each walk: at head dim 64 free on one tile a block
// and the strided walk, in turns on the counter walk (Q in registers); at 128
// free on one tile, P·V late in turns on the strided walk (its long unmasked
// rows), in turns at the exponentials on the counter walk (its long causal rows).
entry_stages3!(flash_fwd_hopper_stages3_hd64, 64, 1, 8, Hd64, OneTile, Eager, RegisterQ);
entry_stages3!(flash_fwd_hopper_stages3_walk_hd64, 64, 1, 8, Hd64, Strided, Eager, RegisterQ);
entry_stages3!(flash_fwd_hopper_stages3_counter_hd64, 64, 1, 8, Hd64, Counter, Turns, RegisterQ);
entry_stages3!(flash_fwd_hopper_stages3_hd128, 128, 2, 16, Hd128, OneTile, Eager, SharedQ);
entry_stages3!(flash_fwd_hopper_stages3_walk_hd128, 128, 2, 16, Hd128, Strided, LatePvTurns, SharedQ);
entry_stages3!(flash_fwd_hopper_stages3_counter_hd128, 128, 2, 16, Hd128, Counter, Turns, SharedQ);

/// The shipped kernel's head dims 64 and 128 on `$schedule`, O by TMA stores.
macro_rules! tma_store_entries {
    ($schedule:ty, $hd64:ident, $hd128:ident) => {
        hopper_entry!(64, $hd64, $schedule, Eager, RegisterQ, TmaStores);
        hopper_entry!(128, $hd128, $schedule, Eager, TmaStores);
    };
}

tma_store_entries!(OneTile, flash_fwd_hopper_tma_store_hd64, flash_fwd_hopper_tma_store_hd128);
tma_store_entries!(Strided, flash_fwd_hopper_tma_store_walk_hd64, flash_fwd_hopper_tma_store_walk_hd128);
// On the counter walk at head dim 64 the shipped consumers take turns.
hopper_entry!(64, flash_fwd_hopper_tma_store_counter_hd64, Counter, Turns, RegisterQ, TmaStores);
hopper_entry!(128, flash_fwd_hopper_tma_store_counter_hd128, Counter, Eager, TmaStores);

/// P·V one tile late ([`Rescale::LATE_PV`]); O rescaled on every tile, before
/// the P·V that adds to it.
struct LatePv;

impl Rescale for LatePv {
    const LATE_PV: bool = true;
}

hopper_entries!(
    OneTile,
    LatePv,
    RegisterQ,
    flash_fwd_hopper_late_pv_hd64,
    flash_fwd_hopper_late_pv_hd128,
    flash_fwd_hopper_late_pv_hd256
);
// On the walks at head dims 64 and 128: at 256 their consumers spill.
hopper_entry!(64, flash_fwd_hopper_late_pv_walk_hd64, Strided, LatePv, RegisterQ, QuadStores);
hopper_entry!(128, flash_fwd_hopper_late_pv_walk_hd128, Strided, LatePv, QuadStores);
hopper_entry!(64, flash_fwd_hopper_late_pv_counter_hd64, Counter, LatePv, RegisterQ, QuadStores);
hopper_entry!(128, flash_fwd_hopper_late_pv_counter_hd128, Counter, LatePv, QuadStores);

// The shipped turns at issuing (P·V in order) on every walk at head dims 64 and
// 128, and at 256 on the counter walk's 128-key tiles (the shipped entries hold
// 256's other walks).
hopper_entry!(64, flash_fwd_hopper_issue_turns_hd64, OneTile, IssueTurns, RegisterQ, QuadStores);
hopper_entry!(128, flash_fwd_hopper_issue_turns_hd128, OneTile, IssueTurns, QuadStores);
hopper_entry!(256 keys128, flash_fwd_hopper_issue_turns_counter_hd256, Counter, IssueTurns, QuadStores);
hopper_entry!(64, flash_fwd_hopper_issue_turns_walk_hd64, Strided, IssueTurns, RegisterQ, QuadStores);
hopper_entry!(128, flash_fwd_hopper_issue_turns_walk_hd128, Strided, IssueTurns, QuadStores);
hopper_entry!(64, flash_fwd_hopper_issue_turns_counter_hd64, Counter, IssueTurns, RegisterQ, QuadStores);
hopper_entry!(128, flash_fwd_hopper_issue_turns_counter_hd128, Counter, IssueTurns, QuadStores);

// The shipped late P·V in turns on the other walks and at head dim 64 (the
// shipped entry holds 128's strided walk); at 256 on 64-key tiles in two stages
// (FlashAttention-3's schedule there), one tile per block and the strided walk,
// the consumers at 240 registers.
hopper_entry!(64, flash_fwd_hopper_late_pv_turns_hd64, OneTile, LatePvTurns, RegisterQ, QuadStores);
hopper_entry!(128, flash_fwd_hopper_late_pv_turns_hd128, OneTile, LatePvTurns, QuadStores);
hopper_entry!(256, flash_fwd_hopper_late_pv_turns_hd256, OneTile, LatePvTurns, QuadStores);
hopper_entry!(256, flash_fwd_hopper_late_pv_turns_walk_hd256, Strided, LatePvTurns, QuadStores);
hopper_entry!(64, flash_fwd_hopper_late_pv_turns_counter_hd64, Counter, LatePvTurns, RegisterQ, QuadStores);
hopper_entry!(128, flash_fwd_hopper_late_pv_turns_counter_hd128, Counter, LatePvTurns, QuadStores);
