//! FlashAttention forward versions kept for comparison (host: `FlashVersion`);
//! none is launched by the shipped path.
//!
//! - `v1`: 64 query rows per block, 16 per warp, Q in registers, 64-key tiles
//!   (`flash_fwd_hd64`, `flash_fwd_hd128`; the latter spills).
//! - `v2_tiles`: the shipped `flash_v2` kernel with the key tiles that spill:
//!   64 keys at head dims 64 and 128, 32 keys at 128.
//! - `hopper` (sm_90a): the first Hopper kernel, thread 0 of a consumer also the
//!   producer, P·V on mma.sync (`flash_fwd_hopper_hd64`, `_hd128`).
//! - `hopper_persistent` (sm_90a): the shipped kernel with other schedules,
//!   rescales and tilings (its module doc lists them): the counter walk, the
//!   lazy rescale, split reductions, turns at the exponentials, exponentials
//!   on the FMA pipe, three K/V stages, 176-key tiles, P·V one tile late.

#[cfg(target_feature = "sm_90a")]
mod hopper;
#[cfg(target_feature = "sm_90a")]
mod hopper_persistent;
mod v1;
mod v2_tiles;
