//! Attention kernels.
//!
//! FlashAttention forward for prefill, over packed variable-length sequences
//! (causal or not, GQA, each row's LSE). Per block, one tile of query rows of
//! one head; K/V tiles stream through shared memory, S = Q·Kᵀ and O += P·V run on
//! tensor cores, and the online softmax keeps (m, ℓ, O) in registers so scores
//! never reach HBM. Tile sizes are `abi::attention`'s, shared with the host.
//!
//! Shipped, per module, is exactly what the host's shipped path launches:
//! - sm_90a: `flash_hopper_ws` (a TMA producer warpgroup, both GEMMs on wgmma),
//!   head dims 64, 128 and 256, one query tile per block (at 64 with Q in
//!   registers), a strided walk of at most one block per SM and a walk by
//!   counter (`hopper_walk`) where the tiles are equal or short, and the
//!   consumers taking turns (`hopper_turns`): at head dim 128 at their
//!   exponentials with a causal mask on long sequences, at issuing with P·V a
//!   tile late without one from 2048 queries; at 64 at their exponentials on
//!   the counter walk, causal or not;
//! - sm_80: `flash_v2` (cp.async + mma.sync) with the key tiles that do not spill,
//!   32 keys at head dim 64 and 16 at 128.
//!
//! `dev` (feature `dev`) holds the versions kept for comparison; it also builds
//! `flash_v2` into the sm_90a dev module, for the portable path's figures on Hopper.

#[cfg(feature = "dev")]
pub mod dev;
#[cfg(target_feature = "sm_90a")]
mod flash_hopper_ws;
#[cfg(target_feature = "sm_90a")]
mod hopper_tile;
#[cfg(target_feature = "sm_90a")]
mod hopper_turns;
#[cfg(target_feature = "sm_90a")]
mod hopper_walk;
#[cfg(any(not(target_feature = "sm_90a"), feature = "dev"))]
mod flash_v2;
pub(crate) mod tile_ops;

pub use abi::FlashArgs;
