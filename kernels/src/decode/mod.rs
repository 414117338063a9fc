//! Decode attention over a paged KV cache (Flash-Decoding): the split kernel
//! ([`split`]: `decode_split_*`, `decode_wide_*`), the exact LSE merge of its
//! partials ([`merge`]: `decode_merge`, and the `wide` entries' in-launch merge),
//! the K/V append of a decode step ([`append`]: `kv_append`), and the copy of
//! cached rows into contiguous K and V ([`gather`]: `kv_gather`). The tile shapes
//! the host sizes launches by are in [`abi::decode`].
//!
//! `dev` holds the versions kept for comparison: one-warp blocks that merge in
//! the launch (`decode_fused_*`), eight one-stage warps (`decode_wide8_*`), and
//! thread-block clusters merging through distributed shared memory
//! (`decode_cluster_hd128`).

mod append;
mod gather;
mod merge;
mod split;

#[cfg(feature = "dev")]
pub mod dev;
