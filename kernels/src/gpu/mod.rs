//! Device support: what a kernel author would take from `cuda_std`, with similar names.
//! Every inline PTX instruction in the crate lives under this module.

pub mod bf16;
#[cfg(target_feature = "sm_90a")]
pub mod cluster;
pub mod math;
pub mod mem;
pub mod mma;
pub mod pack;
pub mod shared;
pub mod thread;
pub mod tile;
#[cfg(target_feature = "sm_90a")]
pub mod tma;
pub mod warp;
#[cfg(target_feature = "sm_90a")]
pub mod wgmma;

/// `v`, hidden from the optimizer (an empty asm statement): a loop bound that LLVM
/// must not unroll, or a value it must not fold.
#[inline(always)]
pub fn opaque_u32(mut v: u32) -> u32 {
    unsafe { core::arch::asm!("// opaque {0}", inout(reg32) v, options(pure, nomem, nostack)) };
    v
}

/// Aborts the kernel; the launch then fails with an error on the host.
#[inline(always)]
pub fn trap() -> ! {
    unsafe { core::arch::nvptx::trap() }
}

/// Declares `.maxntid` (and optionally `.minnctapersm`) for an entry point, like
/// CUDA's `__launch_bounds__`: ptxas then caps registers so the block size can launch.
/// xtask's link step reads these comment lines from the PTX and applies them.
#[macro_export]
macro_rules! launch_bounds {
    ($kernel:ident, $threads:expr) => {
        core::arch::global_asm!(concat!(
            "// xtask:launch_bounds ",
            stringify!($kernel),
            " ",
            stringify!($threads),
            " 0"
        ));
    };
    ($kernel:ident, $threads:expr, $min_blocks:expr) => {
        core::arch::global_asm!(concat!(
            "// xtask:launch_bounds ",
            stringify!($kernel),
            " ",
            stringify!($threads),
            " ",
            stringify!($min_blocks)
        ));
    };
}
