//! Memory ceilings, measured beside the kernels they bound. No `Auto` path
//! launches them, so they live only in the dev modules (feature `dev`).

#[cfg(feature = "dev")]
pub mod dev;
