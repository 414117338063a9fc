//! Tensor-core fragments and instructions (sm_80+): `ldmatrix` and
//! `mma.sync.m16n8k16` with bf16 inputs and f32 accumulators, warp-scoped.
//!
//! Fragment layouts (lane = thread % 32, g = lane / 4, c = lane % 4):
//! - A (16×16, row-major): a0 = (g, 2c..2c+1), a1 = (g+8, 2c..), a2 = (g, 8+2c..), a3 = (g+8, 8+2c..)
//! - B (16×8, "col"): b0 = (k 2c..2c+1, n g), b1 = (k 8+2c.., n g)
//! - C (16×8, f32): c0,c1 = (g, 2c..2c+1), c2,c3 = (g+8, 2c..2c+1)
//!
//! Pairs of bf16 keep the lower index in the low half.

use core::arch::asm;

/// A operand: four registers of bf16 pairs.
pub type FragA = [u32; 4];
/// Accumulator tile 16×8: four f32 per lane.
pub type FragC = [f32; 4];

/// d += a·b on a 16×8×16 tile (bf16 in, f32 accumulate).
#[inline(always)]
pub fn mma_bf16_16816(d: &mut FragC, a: &FragA, b0: u32, b1: u32) {
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{d0}, {d1}, {d2}, {d3}}};",
            d0 = inout(reg32) d[0], d1 = inout(reg32) d[1], d2 = inout(reg32) d[2], d3 = inout(reg32) d[3],
            a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
            b0 = in(reg32) b0, b1 = in(reg32) b1,
            options(nostack, nomem),
        );
    }
}

/// Four 8×8 b16 matrices from shared memory; lanes 8i..8i+7 give the row
/// addresses of matrix i, and register i receives (row g, cols 2c..2c+1) of it.
///
/// # Safety
/// Every lane's address must be a 16-byte aligned shared-window address.
#[inline(always)]
pub unsafe fn ldmatrix_x4(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
        a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg32) addr,
        options(nostack, readonly));
    [a, b, c, d]
}

/// Stores four 8×8 b16 matrices given as mma fragments: register i of lane l
/// holds row l/4, columns 2(l%4) and 2(l%4)+1 of matrix i; lanes 8i..8i+7 give
/// the shared addresses of matrix i's rows 0..7 (16 bytes each).
///
/// # Safety
/// Every lane's address must be 16-byte aligned shared memory the warp may write.
#[inline(always)]
pub unsafe fn stmatrix_x4(addr: u32, r: [u32; 4]) {
    asm!("stmatrix.sync.aligned.m8n8.x4.shared.b16 [{p}], {{{a}, {b}, {c}, {d}}};",
        p = in(reg32) addr, a = in(reg32) r[0], b = in(reg32) r[1], c = in(reg32) r[2], d = in(reg32) r[3],
        options(nostack));
}

/// As [`ldmatrix_x4`], transposed: register i receives (rows 2c..2c+1, col g).
///
/// # Safety
/// As [`ldmatrix_x4`].
#[inline(always)]
pub unsafe fn ldmatrix_x4_trans(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    asm!("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
        a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg32) addr,
        options(nostack, readonly));
    [a, b, c, d]
}
