//! Fast math through PTX approximations (core has no exp/log on this target).

use core::arch::asm;

pub const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// 2^x (`ex2.approx.ftz`): about 2 ulp; ex2(-inf) = +0.
#[inline(always)]
pub fn ex2(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("ex2.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x) };
    y
}

/// e^x through ex2.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    ex2(x * LOG2_E)
}

/// log2(x) (`lg2.approx.ftz`).
#[inline(always)]
pub fn lg2(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("lg2.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x) };
    y
}

/// 1/x, approximate (`rcp.approx.ftz`, 1 ulp).
#[inline(always)]
pub fn rcp(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("rcp.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x) };
    y
}

/// 1/x, correctly rounded (`rcp.rn`), for once-per-row normalizers.
#[inline(always)]
pub fn rcp_exact(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("rcp.rn.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x) };
    y
}

/// 1/sqrt(x), approximate (`rsqrt.approx.ftz`).
#[inline(always)]
pub fn rsqrt(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("rsqrt.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x) };
    y
}

/// sqrt(x), correctly rounded.
#[inline(always)]
pub fn sqrt(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("sqrt.rn.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x) };
    y
}

/// max(a, b) that returns NaN if either is NaN (`max.NaN`), unlike `f32::max`.
#[inline(always)]
pub fn fmax_nan(a: f32, b: f32) -> f32 {
    let y: f32;
    unsafe { asm!("max.NaN.f32 {y}, {a}, {b};", y = out(reg32) y, a = in(reg32) a, b = in(reg32) b) };
    y
}

/// a·b + c with one rounding (`fma.rn`).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    let y: f32;
    unsafe {
        asm!("fma.rn.f32 {y}, {a}, {b}, {c};", y = out(reg32) y, a = in(reg32) a, b = in(reg32) b, c = in(reg32) c)
    };
    y
}
