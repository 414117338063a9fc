//! The shipped warp-specialized Hopper kernel (`flash_hopper_ws`) with a
//! persistent schedule, a lazy rescale of O, or both:
//! - **Persistent** (`flash_fwd_hopper_persistent_*`). At most one block per SM
//!   walks the tile grid in the one-tile launch's order, every grid-th tile. Its
//!   producer runs ahead across tiles: the next tile's first K/V stage and Q load
//!   while the consumers still finish the last tile and write it out.
//! - **Lazy rescale** (`flash_fwd_hopper_lazy_*`). The reference max moves only
//!   when a tile's max passes it by more than 2^8; a warp none of whose rows
//!   moved skips O's rescale.

use crate::attention::flash_hopper_ws::{flash_hopper_ws, Eager, Hd128, Hd256, Hd64, OneTile, Rescale, Schedule};
use crate::attention::hopper_tile::{Keys128, Keys64, QueryTile, BN};
use crate::attention::tile_ops::{rescale_if_moved, softmax_scores_lazy};
use crate::gpu::mma::FragC;
use crate::gpu::thread::{block_idx_x, grid_dim_x};
use abi::FlashTmaArgs;

/// Every grid-th tile of the (heads, query tiles, sequences) grid from the
/// block's index, skipping those past their sequence's end.
struct Persistent;

impl Schedule for Persistent {
    #[inline(always)]
    unsafe fn for_each_tile(a: &FlashTmaArgs, mut each: impl FnMut(QueryTile, u32)) {
        let f = &a.flash;
        let total = f.n_heads * a.query_tiles * a.sequences;
        let (mut t, mut n) = (block_idx_x(), 0);
        while t < total {
            let tile = QueryTile::of_index(f, t, a.query_tiles);
            if !tile.is_past_end() {
                each(tile, n);
                n += 1;
            }
            t += grid_dim_x();
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

macro_rules! entries {
    ($schedule:ty, $rescale:ty, $hd64:ident, $hd128:ident, $hd256:ident) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $hd64(a: FlashTmaArgs) {
            flash_hopper_ws::<64, 1, 8, Hd64, BN, 64, 16, 8, Keys128, $schedule, $rescale>(a)
        }
        crate::launch_bounds!($hd64: FlashTmaArgs, 384, 1);

        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $hd128(a: FlashTmaArgs) {
            flash_hopper_ws::<128, 2, 16, Hd128, BN, 64, 16, 8, Keys128, $schedule, $rescale>(a)
        }
        crate::launch_bounds!($hd128: FlashTmaArgs, 384, 1);

        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $hd256(a: FlashTmaArgs) {
            flash_hopper_ws::<256, 4, 32, Hd256, 64, 32, 8, 4, Keys64, $schedule, $rescale>(a)
        }
        crate::launch_bounds!($hd256: FlashTmaArgs, 384, 1);
    };
}

entries!(OneTile, Lazy, flash_fwd_hopper_lazy_hd64, flash_fwd_hopper_lazy_hd128, flash_fwd_hopper_lazy_hd256);
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
