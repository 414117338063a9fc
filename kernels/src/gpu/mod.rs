//! Device support: what a kernel author would take from `cuda_std`, with similar names.
//! Every inline PTX instruction in the crate lives under this module.

/// `asm!` of `$op` (with `$rest`, its operands and options) behind two shared
/// stores of the f32 anchors `$a` and `$b` to `$scratch`, each under a predicate
/// no float satisfies (x < −∞): ptxas keeps stores on their side of a barrier
/// or wait, so the anchors, and all they depend on, are computed before `$op`,
/// while the stores never run.
macro_rules! asm_after_anchors {
    ($a:expr, $b:expr, $scratch:expr, $op:literal, $($rest:tt)*) => {
        core::arch::asm!(
            "{{",
            ".reg .pred never;",
            "setp.lt.f32 never, {a}, 0fFF800000;",
            "@never st.shared.f32 [{s}], {a};",
            "setp.lt.f32 never, {b}, 0fFF800000;",
            "@never st.shared.f32 [{s}], {b};",
            $op,
            "}}",
            a = in(reg32) $a,
            b = in(reg32) $b,
            s = in(reg32) $scratch,
            $($rest)*
        )
    };
}

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

/// `v` through an asm statement with effects: LLVM computes what depends on it
/// where it stands, never hoisted out of a loop.
#[cfg_attr(not(all(target_feature = "sm_90a", feature = "dev")), allow(dead_code))]
#[inline(always)]
pub fn unhoisted_u32(mut v: u32) -> u32 {
    unsafe { core::arch::asm!("// unhoisted {0}", inout(reg32) v, options(nomem, nostack)) };
    v
}

/// Aborts the kernel; the launch then fails with an error on the host.
#[inline(always)]
pub fn trap() -> ! {
    unsafe { core::arch::nvptx::trap() }
}

/// Declares an entry point's parameter block and `.maxntid` (optionally
/// `.minnctapersm`), like CUDA's `__launch_bounds__`: ptxas then caps registers so
/// the block size can launch. xtask's link step reads these comment lines from the
/// PTX and applies them; the host's build generates one typed kernel handle
/// (`Kernel<abi::Params>`) per line, so a launch with another struct cannot compile.
/// The function-pointer constant checks that the entry really takes `$params`.
#[macro_export]
macro_rules! launch_bounds {
    ($kernel:ident : $params:ident, $threads:expr $(, $min_blocks:expr)?) => {
        const _: unsafe extern "ptx-kernel" fn(abi::$params) = $kernel;
        core::arch::global_asm!(concat!(
            "// xtask:launch_bounds ",
            stringify!($kernel),
            " ",
            stringify!($threads),
            " ",
            $crate::launch_bounds!(@min $($min_blocks)?),
            " ",
            stringify!($params)
        ));
    };
    (@min) => { "0" };
    (@min $min_blocks:expr) => { stringify!($min_blocks) };
}
