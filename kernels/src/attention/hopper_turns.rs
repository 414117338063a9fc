//! The consumers of `flash_hopper_ws` taking turns, so one warpgroup's softmax
//! runs under the other's GEMMs (FlashAttention-3's ping-pong):
//! - at the exponentials of their softmax ([`Turns`]): one's ex2 runs at the
//!   SFU's full rate while the other's GEMMs keep the tensor cores busy, the
//!   two half a tile apart. Shipped at head dim 128 with a causal mask on long
//!   sequences and at 64 on the counter walk, where it measured ahead of the
//!   free-running consumers;
//! - at issuing each key tile's pair of GEMMs, P·V one tile late
//!   ([`LatePvTurns`]). Shipped at head dim 128 without a mask from 2048
//!   queries, where it measured ahead of both;
//! - at issuing each GEMM, P·V in order ([`IssueTurns`]), which holds no more
//!   registers than the free consumers. Shipped at head dim 256 on its 128-key
//!   tiles, without a mask and with one on one tile per block, where it
//!   measured ahead of the free consumers and of [`Turns`].

use super::flash_hopper_ws::{hopper_entry, Consumer, OneTile, QuadStores, RegisterQ, Rescale};
use super::hopper_walk::{Counter, Strided};
use super::tile_ops::online_softmax_in_turn;
use crate::gpu::mma::FragC;
use crate::gpu::thread::{named_arrive, named_arrive_after, named_sync, named_sync_after};
use abi::FlashTmaArgs;

/// Named barriers of the turns, one per consumer warpgroup from here (0 is the
/// block's, 1–3 the warpgroups').
const TURN_BARRIER: u32 = 7;
// Up to three consumers, within the 16 named barriers.
const _: () = assert!(TURN_BARRIER + 3 <= 16);
/// The warpgroup whose turn it is and the one handing it over.
const TURN_THREADS: u32 = 2 * 128;

/// The barrier consumer `who` waits on for its turn.
#[inline(always)]
fn my_turn(who: Consumer) -> u32 {
    TURN_BARRIER + who.c
}

/// The barrier that hands the turn to the next consumer in the ring.
#[inline(always)]
fn next_turn(who: Consumer) -> u32 {
    TURN_BARRIER + (who.c + 1) % who.count
}

/// O rescaled on every tile, as `Eager`, the consumers taking turns at the
/// exponentials in a ring ([`online_softmax_in_turn`]): consumer c waits on
/// barrier `TURN_BARRIER + c` and hands over on the next one's. The last
/// consumer's hand-over opens the ring; consumer 0 takes the hand-over that
/// closes it.
pub(in crate::attention) struct Turns;

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
            |refs| named_sync_after(my_turn(who), TURN_THREADS, refs, who.anchor),
            |sums| named_arrive_after(next_turn(who), TURN_THREADS, sums, who.anchor),
        );
    }
}

/// The consumers taking turns at issuing their GEMMs, in a ring on the
/// barriers of [`Turns`] (which opens and closes it): with P·V one tile late
/// ([`Rescale::LATE_PV`]) a turn issues a key tile's S(j) and P(j−1)·V(j−1);
/// in order, S and P·V take a turn each.
pub(in crate::attention) struct TurnsAtIssue<const LATE_PV: bool>;

/// P·V one tile late: one turn issues S(j) and P(j−1)·V(j−1).
pub(in crate::attention) type LatePvTurns = TurnsAtIssue<true>;

/// P·V in order, S and P·V a turn each, so one consumer's softmax runs under
/// the other's GEMMs with no more registers live than the free consumers hold
/// (head dim 256 cannot hold a late P·V's beside O's 128 accumulators).
pub(in crate::attention) type IssueTurns = TurnsAtIssue<false>;

impl<const LATE: bool> Rescale for TurnsAtIssue<LATE> {
    const LATE_PV: bool = LATE;
    #[inline(always)]
    fn begin(who: Consumer) {
        Turns::begin(who);
    }
    #[inline(always)]
    fn end(who: Consumer) {
        Turns::end(who);
    }
    #[inline(always)]
    fn before_issue(who: Consumer) {
        named_sync(my_turn(who), TURN_THREADS);
    }
    #[inline(always)]
    fn after_issue(who: Consumer) {
        named_arrive(next_turn(who), TURN_THREADS);
    }
}

// The shipped entries with turns at head dim 128: at the exponentials on the
// counter walk and on one tile per block, the walks `plan::walk` takes with a
// causal mask; at issuing on the strided walk, the one it takes without. At
// head dim 64 at the exponentials on the counter walk: two consumers with Q in
// registers, and on long sequences three over 192 rows, in a ring of three. At
// head dim 256 at issuing, P·V in order, on one tile per block (causal) and the
// strided walk (no mask).
hopper_entry!(128, flash_fwd_hopper_ws_turns_hd128, OneTile, Turns, QuadStores);
hopper_entry!(128, flash_fwd_hopper_ws_turns_counter_hd128, Counter, Turns, QuadStores);
hopper_entry!(128, flash_fwd_hopper_ws_late_pv_turns_walk_hd128, Strided, LatePvTurns, QuadStores);
hopper_entry!(64, flash_fwd_hopper_ws_turns_counter_hd64, Counter, Turns, RegisterQ, QuadStores);
hopper_entry!(256 keys128, flash_fwd_hopper_ws_issue_turns_hd256, OneTile, IssueTurns, QuadStores);
hopper_entry!(256 keys128, flash_fwd_hopper_ws_issue_turns_walk_hd256, Strided, IssueTurns, QuadStores);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_ws_m192_turns_counter_hd64(a: FlashTmaArgs) {
    use crate::attention::flash_hopper_ws::{flash_hopper_ws, Hd64, SharedQ};
    use crate::attention::hopper_tile::{Keys128Rows192, BN};
    flash_hopper_ws::<192, 64, 1, 8, Hd64, BN, 64, 16, 8, Keys128Rows192, Counter, Turns, SharedQ, QuadStores>(a)
}
crate::launch_bounds!(flash_fwd_hopper_ws_m192_turns_counter_hd64: FlashTmaArgs, 512, 1);
