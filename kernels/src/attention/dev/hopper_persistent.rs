//! The shipped warp-specialized Hopper kernel (`flash_hopper_ws`) with other
//! schedules, rescales and tilings:
//! - **The strided walk at head dim 64** (`flash_fwd_hopper_strided_hd64`),
//!   shipped at 128 and 256 without a causal mask.
//! - **Tiles from a counter** (`flash_fwd_hopper_persistent_*`): the walk's
//!   order, each block taking its next tile as it finishes the last
//!   ([`Persistent`]); racecheck reports its hand-over.
//! - **Lazy rescale** (`flash_fwd_hopper_lazy_*`, and with the walk
//!   `flash_fwd_hopper_persistent_lazy_*`). The reference max moves only when a
//!   tile's max passes it by more than 2^8; a warp none of whose rows moved
//!   skips O's rescale.
//! - **Split reductions** (`flash_fwd_hopper_split_*`). Each row's max and sum
//!   in four partials: a quarter of the softmax's dependent chain.
//! - **Three consumers** (`flash_fwd_hopper_m192_hd64`): 192 query rows, as
//!   FlashAttention-3 takes at head dim 64, where a warpgroup's softmax takes as
//!   long as its GEMMs: a third warpgroup's GEMMs run under the other two's.
//! - **176-key tiles** (`flash_fwd_hopper_n176_*`, head dims 64 and 128), as
//!   FlashAttention-3 takes without a causal mask: the per-tile steps over
//!   1.375× the keys.

use crate::attention::flash_hopper_ws::{flash_hopper_ws, Eager, Hd128, Hd256, Hd64, OneTile, RegisterQ, Rescale, SharedQ};
use crate::attention::hopper_tile::{Keys128, Keys128Rows192, Keys176, Keys64, BM, BN};
use crate::attention::hopper_walk::{Persistent, Strided};
use crate::attention::tile_ops::{rescale, rescale_if_moved, softmax_scores_lazy, softmax_scores_split};
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
#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_strided_hd64(a: FlashTmaArgs) {
    flash_hopper_ws::<BM, 64, 1, 8, Hd64, BN, 64, 16, 8, Keys128, Strided, Eager, RegisterQ>(a)
}
crate::launch_bounds!(flash_fwd_hopper_strided_hd64: FlashTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_persistent_hd64(a: FlashTmaArgs) {
    flash_hopper_ws::<BM, 64, 1, 8, Hd64, BN, 64, 16, 8, Keys128, Persistent, Eager, RegisterQ>(a)
}
crate::launch_bounds!(flash_fwd_hopper_persistent_hd64: FlashTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_persistent_hd128(a: FlashTmaArgs) {
    flash_hopper_ws::<BM, 128, 2, 16, Hd128, BN, 64, 16, 8, Keys128, Persistent, Eager, SharedQ>(a)
}
crate::launch_bounds!(flash_fwd_hopper_persistent_hd128: FlashTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_persistent_hd256(a: FlashTmaArgs) {
    flash_hopper_ws::<BM, 256, 4, 32, Hd256, 64, 32, 8, 4, Keys64, Persistent, Eager, SharedQ>(a)
}
crate::launch_bounds!(flash_fwd_hopper_persistent_hd256: FlashTmaArgs, 384, 1);

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

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_m192_hd64(a: FlashTmaArgs) {
    flash_hopper_ws::<192, 64, 1, 8, Hd64, BN, 64, 16, 8, Keys128Rows192, OneTile, Eager, SharedQ>(a)
}
crate::launch_bounds!(flash_fwd_hopper_m192_hd64: FlashTmaArgs, 512, 1);
