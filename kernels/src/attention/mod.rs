//! Attention kernels.
//!
//! `flash`: FlashAttention-2-style forward for prefill: per block, one tile of
//! query rows of one head; K/V tiles stream through shared memory (cp.async, two
//! stages), S = Q·Kᵀ and O += P·V run on tensor cores (mma.sync m16n8k16), and the
//! online softmax keeps (m, ℓ, O) in registers so scores never reach HBM.

mod flash;
#[cfg(target_feature = "sm_90a")]
mod flash_hopper;
mod flash_v2;
pub(crate) mod tile_ops;

pub use abi::FlashArgs;
