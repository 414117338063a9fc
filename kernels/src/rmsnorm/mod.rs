//! RMSNorm over bf16 rows, f32 math: y = x · rsqrt(mean(x²) + eps) · w.
//!
//! With a residual `r`, the kernel first forms s = x + r (rounded to bf16, as the
//! framework does), writes s as the next residual, and normalizes s: the form a
//! transformer layer uses, in one pass over memory instead of two.
//!
//! The shipped kernels, what `rms_norm` / `add_rms_norm` (and the layer's decode
//! step) launch:
//! - `resident`: each block holds one row in registers (`VPT` packs per thread);
//! - `streaming`: rows too long for that, read twice;
//! - `rmsnorm_split_sums`: the decode step's split-K projection finish fused with
//!   the residual add and the norm.
//!
//! `dev` (feature `dev`) keeps the versions measured against them (v2–v6).

mod resident;
mod split_sums;
mod streaming;

use crate::gpu::pack::{Bf16x1, Bf16x8};
use resident::resident;
use streaming::streaming;

pub use abi::RmsNormArgs;
pub use split_sums::rmsnorm_split_sums;

/// The number after `@` is the entry's launch bound (then, optionally, the minimum
/// blocks per SM), which the host reads from the entry's typed handle. `_rN`: N
/// packs per thread, the `vpt` of the host's table row for that handle.
macro_rules! entries {
    ($($name:ident => $version:ident::<$($param:tt),*> @ $threads:literal $(, $min_blocks:literal)?;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(args: RmsNormArgs) {
            // A programmatically launched successor (a GEMM) may start loading
            // its weights as SMs free up; it waits for this grid before reading.
            crate::gpu::thread::launch_dependents();
            $version::<$($param),*>(args)
        }
        crate::launch_bounds!($name: RmsNormArgs, $threads $(, $min_blocks)?);
    )*};
}

entries! {
    rmsnorm_bf16x8_r1 => resident::<Bf16x8, 1> @ 1024;
    rmsnorm_bf16x8_r2 => resident::<Bf16x8, 2> @ 1024;
    rmsnorm_bf16x8_r4 => resident::<Bf16x8, 4> @ 512;
    rmsnorm_bf16x8_r8 => resident::<Bf16x8, 8> @ 256;
    rmsnorm_bf16x1_r1 => resident::<Bf16x1, 1> @ 1024;
    rmsnorm_bf16x1_r2 => resident::<Bf16x1, 2> @ 1024;
    rmsnorm_bf16x1_r4 => resident::<Bf16x1, 4> @ 512;
    rmsnorm_bf16x8_stream => streaming::<Bf16x8, 4> @ 512;
    rmsnorm_bf16x1_stream => streaming::<Bf16x1, 4> @ 512;
}

#[cfg(feature = "dev")]
pub mod dev;
