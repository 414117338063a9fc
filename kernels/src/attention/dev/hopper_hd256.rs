//! The shipped warp-specialized Hopper kernel at head dim 256 (sm_90a), a dev
//! version until it is measured: 64-key tiles, so O's 128 accumulators per
//! thread fit beside S's 32 and P's 16 in the consumers' 232 registers.

use crate::attention::flash_hopper_ws::{flash_hopper_ws, Hd256};
use crate::attention::hopper_tile::Keys64;
use abi::attention::HOPPER_HD256;
use abi::FlashTmaArgs;

const _: () = assert!(HOPPER_HD256.threads == 384 && HOPPER_HD256.keys == 64);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_ws_hd256(a: FlashTmaArgs) {
    flash_hopper_ws::<256, 4, 32, Hd256, 64, 32, 8, 4, Keys64>(a)
}
crate::launch_bounds!(flash_fwd_hopper_ws_hd256: FlashTmaArgs, 384, 1);
