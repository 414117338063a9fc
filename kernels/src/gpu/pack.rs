//! Packs: the unit one thread loads and stores at once. 16-byte packs (`F32x4`,
//! `Bf16x8`) are the fast path; 1-element packs serve rows that are not 16-byte
//! aligned. Kernels are generic over the pack, so both paths share one algorithm.

use super::bf16::{f32_to_bf16, max_bf16x2_nan, pack_bf16x2, unpack_bf16x2};
use super::math::fmax_nan;
use super::mem::{ld_global_stream_v4, ld_global_v4, st_global_cs_v4, Vec4};

pub trait Pack: Copy {
    /// Elements per pack.
    const LANES: usize;
    /// Bytes per element in memory.
    const ELEM_BYTES: usize;
    /// # Safety
    /// `p` must be valid and aligned for one pack.
    unsafe fn load(p: *const u8) -> Self;
    /// # Safety
    /// `p` must be valid and aligned for one pack.
    unsafe fn store(self, p: *mut u8);
    /// A load of data read once and not written during the launch (see
    /// `mem::ld_global_stream_v4`); a plain load where the pack has no such form.
    ///
    /// # Safety
    /// As `load`, and nothing writes `p` during the launch.
    #[inline(always)]
    unsafe fn load_stream(p: *const u8) -> Self {
        Self::load(p)
    }
    fn get(&self, lane: usize) -> f32;
    fn from_fn<F: FnMut(usize) -> f32>(f: F) -> Self;

    /// The same pack, passed through an empty asm statement so the compiler cannot
    /// reuse values it derived from it earlier: it unpacks again instead of keeping
    /// unpacked copies alive in registers (fewer registers, more blocks per SM).
    #[inline(always)]
    fn opaque(self) -> Self {
        self
    }

    /// Largest element; NaN if any element is NaN (so NaN reaches row sums).
    #[inline(always)]
    fn max(&self) -> f32 {
        let mut m = f32::NEG_INFINITY;
        for l in 0..Self::LANES {
            m = fmax_nan(m, self.get(l));
        }
        m
    }
}

/// A 16-byte pack, which `cp.async` can stage in shared memory.
pub trait Pack16: Pack {
    fn from_raw(v: Vec4) -> Self;
    fn raw(self) -> Vec4;
}

#[derive(Clone, Copy)]
pub struct F32x4(pub Vec4);

#[derive(Clone, Copy)]
pub struct Bf16x8(pub Vec4);

#[derive(Clone, Copy)]
pub struct F32x1(pub f32);

#[derive(Clone, Copy)]
pub struct Bf16x1(pub u16);

impl Pack for F32x4 {
    const LANES: usize = 4;
    const ELEM_BYTES: usize = 4;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self {
        F32x4(ld_global_v4(p))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut u8) {
        st_global_cs_v4(p, self.0)
    }
    #[inline(always)]
    fn get(&self, lane: usize) -> f32 {
        f32::from_bits(self.0[lane])
    }
    #[inline(always)]
    fn from_fn<F: FnMut(usize) -> f32>(mut f: F) -> Self {
        F32x4([f(0).to_bits(), f(1).to_bits(), f(2).to_bits(), f(3).to_bits()])
    }
}

impl Pack16 for F32x4 {
    #[inline(always)]
    fn from_raw(v: Vec4) -> Self {
        F32x4(v)
    }
    #[inline(always)]
    fn raw(self) -> Vec4 {
        self.0
    }
}

impl Pack for Bf16x8 {
    const LANES: usize = 8;
    const ELEM_BYTES: usize = 2;
    #[inline(always)]
    fn opaque(self) -> Self {
        Bf16x8(opaque_words(self.0))
    }
    #[inline(always)]
    fn max(&self) -> f32 {
        self.max_packed()
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self {
        Bf16x8(ld_global_v4(p))
    }
    #[inline(always)]
    unsafe fn load_stream(p: *const u8) -> Self {
        Bf16x8(ld_global_stream_v4(p))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut u8) {
        st_global_cs_v4(p, self.0)
    }
    #[inline(always)]
    fn get(&self, lane: usize) -> f32 {
        let (lo, hi) = unpack_bf16x2(self.0[lane / 2]);
        if lane % 2 == 0 {
            lo
        } else {
            hi
        }
    }
    #[inline(always)]
    fn from_fn<F: FnMut(usize) -> f32>(mut f: F) -> Self {
        let mut w = [0u32; 4];
        for (i, word) in w.iter_mut().enumerate() {
            let lo = f(2 * i);
            let hi = f(2 * i + 1);
            *word = pack_bf16x2(lo, hi);
        }
        Bf16x8(w)
    }
}

/// Four words through an empty asm statement (see [`Pack::opaque`]).
#[inline(always)]
fn opaque_words(mut w: Vec4) -> Vec4 {
    unsafe {
        core::arch::asm!("// opaque {0} {1} {2} {3}", inout(reg32) w[0], inout(reg32) w[1], inout(reg32) w[2], inout(reg32) w[3],
            options(pure, nomem, nostack));
    }
    w
}

impl Bf16x8 {
    /// Max over the pack with packed bf16x2 compares: 3 instructions for 8 lanes.
    #[inline(always)]
    fn max_packed(&self) -> f32 {
        let w = max_bf16x2_nan(max_bf16x2_nan(self.0[0], self.0[1]), max_bf16x2_nan(self.0[2], self.0[3]));
        let (lo, hi) = unpack_bf16x2(w);
        fmax_nan(lo, hi)
    }
}

impl Pack16 for Bf16x8 {
    #[inline(always)]
    fn from_raw(v: Vec4) -> Self {
        Bf16x8(v)
    }
    #[inline(always)]
    fn raw(self) -> Vec4 {
        self.0
    }
}

impl Pack for F32x1 {
    const LANES: usize = 1;
    const ELEM_BYTES: usize = 4;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self {
        F32x1(*(p as *const f32))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut u8) {
        *(p as *mut f32) = self.0
    }
    #[inline(always)]
    fn get(&self, _lane: usize) -> f32 {
        self.0
    }
    #[inline(always)]
    fn from_fn<F: FnMut(usize) -> f32>(mut f: F) -> Self {
        F32x1(f(0))
    }
}

impl Pack for Bf16x1 {
    const LANES: usize = 1;
    const ELEM_BYTES: usize = 2;
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self {
        Bf16x1(*(p as *const u16))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut u8) {
        *(p as *mut u16) = self.0
    }
    #[inline(always)]
    fn get(&self, _lane: usize) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
    #[inline(always)]
    fn from_fn<F: FnMut(usize) -> f32>(mut f: F) -> Self {
        Bf16x1(f32_to_bf16(f(0)))
    }
}
