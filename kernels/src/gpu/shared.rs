//! Shared memory: the dynamic window (`extern __shared__`) and static arrays.
//! Rust has no address-space attribute, so shared memory is reached through 32-bit
//! shared-window addresses and `ld.shared`/`st.shared`.

use core::arch::{asm, global_asm};
use core::marker::PhantomData;

global_asm!(".extern .shared .align 128 .b8 dyn_smem[];");

/// Shared-window address of the dynamic shared memory given at launch.
#[inline(always)]
pub fn dynamic_shared_base() -> u32 {
    let addr: u32;
    unsafe { asm!("mov.u32 {a}, dyn_smem;", a = out(reg32) addr) };
    addr
}

/// A typed view of `N` elements of shared memory at a shared-window address.
#[derive(Clone, Copy)]
pub struct SharedArray<T, const N: usize> {
    addr: u32,
    _t: PhantomData<T>,
}

impl<T: SharedWord, const N: usize> SharedArray<T, N> {
    /// # Safety
    /// `addr` must be a shared-window address with room for `N` elements of `T`.
    #[inline(always)]
    pub unsafe fn at(addr: u32) -> Self {
        Self { addr, _t: PhantomData }
    }

    #[inline(always)]
    pub fn addr(&self) -> u32 {
        self.addr
    }

    #[inline(always)]
    pub fn load(&self, i: usize) -> T {
        unsafe { T::ld_shared(self.addr + (i * core::mem::size_of::<T>()) as u32) }
    }

    #[inline(always)]
    pub fn store(&self, i: usize, v: T) {
        unsafe { T::st_shared(self.addr + (i * core::mem::size_of::<T>()) as u32, v) }
    }
}

/// Declares a static `.shared` array of `N` 32-bit words and returns a
/// [`SharedArray`] over it, like `cuda_std::shared_array!`. The name must be unique
/// in the crate; each kernel that uses it gets its own copy per block.
#[macro_export]
macro_rules! shared_array {
    ($name:ident: [$t:ty; $n:literal]) => {{
        // global_asm! must be an item; a module is an item allowed in a block.
        #[allow(non_snake_case)]
        mod $name {
            core::arch::global_asm!(concat!(".shared .align 16 .b32 ", stringify!($name), "[", stringify!($n), "];"));
        }
        let addr: u32;
        unsafe { core::arch::asm!(concat!("mov.u32 {a}, ", stringify!($name), ";"), a = out(reg32) addr) };
        unsafe { $crate::gpu::shared::SharedArray::<$t, $n>::at(addr) }
    }};
}

/// 32-bit words (the only kind `shared_array!` holds) that can be moved to and from shared memory.
pub trait SharedWord: Copy {
    /// # Safety
    /// `addr` must be a valid, aligned shared-window address.
    unsafe fn ld_shared(addr: u32) -> Self;
    /// # Safety
    /// `addr` must be a valid, aligned shared-window address.
    unsafe fn st_shared(addr: u32, v: Self);
}

impl SharedWord for f32 {
    #[inline(always)]
    unsafe fn ld_shared(addr: u32) -> f32 {
        let v: f32;
        asm!("ld.shared.f32 {v}, [{a}];", v = out(reg32) v, a = in(reg32) addr);
        v
    }
    #[inline(always)]
    unsafe fn st_shared(addr: u32, v: f32) {
        asm!("st.shared.f32 [{a}], {v};", a = in(reg32) addr, v = in(reg32) v);
    }
}

impl SharedWord for u32 {
    #[inline(always)]
    unsafe fn ld_shared(addr: u32) -> u32 {
        let v: u32;
        asm!("ld.shared.u32 {v}, [{a}];", v = out(reg32) v, a = in(reg32) addr);
        v
    }
    #[inline(always)]
    unsafe fn st_shared(addr: u32, v: u32) {
        asm!("st.shared.u32 [{a}], {v};", a = in(reg32) addr, v = in(reg32) v);
    }
}

/// 16-byte shared load.
///
/// # Safety
/// `addr` must be a 16-byte aligned shared-window address.
#[inline(always)]
pub unsafe fn ld_shared_v4(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    asm!("ld.shared.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
        a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg32) addr);
    [a, b, c, d]
}

/// 8-byte shared load.
///
/// # Safety
/// `addr` must be an 8-byte aligned shared-window address.
#[inline(always)]
pub unsafe fn ld_shared_v2(addr: u32) -> [u32; 2] {
    let (a, b): (u32, u32);
    asm!("ld.shared.v2.u32 {{{a}, {b}}}, [{p}];", a = out(reg32) a, b = out(reg32) b, p = in(reg32) addr);
    [a, b]
}

/// 8-byte shared store.
///
/// # Safety
/// `addr` must be an 8-byte aligned shared-window address.
#[inline(always)]
pub unsafe fn st_shared_v2(addr: u32, v: [u32; 2]) {
    asm!("st.shared.v2.u32 [{p}], {{{a}, {b}}};", p = in(reg32) addr, a = in(reg32) v[0], b = in(reg32) v[1]);
}

/// 16-byte shared store.
///
/// # Safety
/// `addr` must be a 16-byte aligned shared-window address.
#[inline(always)]
pub unsafe fn st_shared_v4(addr: u32, v: [u32; 4]) {
    asm!("st.shared.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
        p = in(reg32) addr, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3]);
}

/// `atomicAdd` on a shared f32 without a return value.
///
/// # Safety
/// `addr` must be a 4-byte aligned shared-window address.
#[inline(always)]
pub unsafe fn red_shared_add_f32(addr: u32, v: f32) {
    asm!("red.shared.add.f32 [{a}], {v};", a = in(reg32) addr, v = in(reg32) v, options(nostack));
}
