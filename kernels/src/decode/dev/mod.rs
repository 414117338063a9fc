//! Decode versions kept for comparison (`DecodeVersion::Fused`, `Wide8`,
//! `Cluster` on the host); built only into the `<arch>-dev.ptx` modules.

mod merge;
mod split;
#[cfg(target_feature = "sm_90a")]
mod persistent;
