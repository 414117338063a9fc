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

/// 2^x for x ≤ 0 on the FMA and integer pipes, leaving the SFU to [`ex2`]:
/// x = n + f with n the nearest integer and f ∈ [−½, ½]; 2^f by its degree-4
/// Taylor polynomial (relative error under 6e-5, far below bf16's 2^-9); n
/// added to the exponent bits. Below −126 it gives 0 (−∞ included: 2^x is
/// under f32's normal range there), and NaN gives NaN.
#[inline(always)]
pub fn ex2_fma(x: f32) -> f32 {
    // Adding 1.5·2^23 rounds to an integer, held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const C: [f32; 4] = [0.693_147_2, 0.240_226_5, 0.055_504_11, 0.009_618_129];
    let y = fmax_nan(x, -126.0);
    let t = y + ROUND;
    let f = y - (t - ROUND);
    let p = fma(fma(fma(fma(C[3], f, C[2]), f, C[1]), f, C[0]), f, 1.0);
    let r = f32::from_bits(p.to_bits().wrapping_add(t.to_bits() << 23));
    if x < -126.0 {
        0.0
    } else if x.is_nan() {
        // The exponent add would turn NaN's bits into f32::MAX's.
        x
    } else {
        r
    }
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
