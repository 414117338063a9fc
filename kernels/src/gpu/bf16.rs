//! bf16 and f16 conversion and packing. Packed pairs keep the lower-index
//! element in the low half, as they sit in memory.

use core::arch::asm;

#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Round-to-nearest-even f32 → bf16 bits.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let h: u16;
    unsafe { asm!("cvt.rn.bf16.f32 {h}, {x};", h = out(reg16) h, x = in(reg32) x) };
    h
}

/// Unpacks two bf16 in a word: (low element, high element).
#[inline(always)]
pub fn unpack_bf16x2(w: u32) -> (f32, f32) {
    (f32::from_bits(w << 16), f32::from_bits(w & 0xffff_0000))
}

/// Packs two f32 as bf16 (round to nearest even): `lo` goes to the low half.
#[inline(always)]
pub fn pack_bf16x2(lo: f32, hi: f32) -> u32 {
    let w: u32;
    unsafe { asm!("cvt.rn.bf16x2.f32 {w}, {hi}, {lo};", w = out(reg32) w, hi = in(reg32) hi, lo = in(reg32) lo) };
    w
}

#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    let x: f32;
    unsafe { asm!("cvt.f32.f16 {x}, {h};", x = out(reg32) x, h = in(reg16) bits) };
    x
}

/// Round-to-nearest-even f32 → f16 bits.
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    let h: u16;
    unsafe { asm!("cvt.rn.f16.f32 {h}, {x};", h = out(reg16) h, x = in(reg32) x) };
    h
}

/// Packs two f32 as f16: `lo` goes to the low half.
#[inline(always)]
pub fn pack_f16x2(lo: f32, hi: f32) -> u32 {
    let w: u32;
    unsafe { asm!("cvt.rn.f16x2.f32 {w}, {hi}, {lo};", w = out(reg32) w, hi = in(reg32) hi, lo = in(reg32) lo) };
    w
}

/// Unpacks two f16 in a word: (low element, high element).
#[inline(always)]
pub fn unpack_f16x2(w: u32) -> (f32, f32) {
    (f16_to_f32(w as u16), f16_to_f32((w >> 16) as u16))
}

/// Lane-wise max of two bf16 pairs, NaN-propagating (`max.NaN.bf16x2`).
#[inline(always)]
pub fn max_bf16x2_nan(a: u32, b: u32) -> u32 {
    let y: u32;
    unsafe { asm!("max.NaN.bf16x2 {y}, {a}, {b};", y = out(reg32) y, a = in(reg32) a, b = in(reg32) b) };
    y
}
