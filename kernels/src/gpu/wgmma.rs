//! Hopper warpgroup MMA (`wgmma`, sm_90a only): shared-memory matrix descriptors
//! and the asynchronous m64nNk16 bf16 multiply, scoped to a warpgroup (4 warps).
//!
//! Accumulator layout of m64nNk16 (f32): warp w of the warpgroup owns rows
//! 16w..16w+15, and within each n8 block j it holds `acc[4j..4j+4]` exactly as
//! mma.sync's C fragment: (g, 2c..2c+1) and (g+8, 2c..2c+1).

use core::arch::asm;

/// Orders this warpgroup's register and shared-memory accesses before `wgmma`.
#[inline(always)]
pub fn fence() {
    unsafe { asm!("wgmma.fence.sync.aligned;", options(nostack)) };
}

/// Closes the group of `wgmma` operations issued so far.
#[inline(always)]
pub fn commit_group() {
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack)) };
}

/// Waits until at most `N` committed `wgmma` groups are pending.
#[inline(always)]
pub fn wait_group<const N: u32>() {
    unsafe { asm!("wgmma.wait_group.sync.aligned {n};", n = const N, options(nostack)) };
}

/// [`wait_group`], but not before `anchors` are computed. ptxas's latency model
/// takes a `wgmma` to finish long before it does, so it hoists the wait above
/// independent arithmetic, and the work meant to run under the `wgmma` runs
/// after it. Each anchor feeds a shared store to `scratch` behind a predicate
/// no float satisfies (x < −∞); ptxas keeps stores ahead of the wait.
#[inline(always)]
pub fn wait_group_after<const N: u32>(anchors: [f32; 2], scratch: u32) {
    unsafe {
        asm_after_anchors!(
            anchors[0],
            anchors[1],
            scratch,
            "wgmma.wait_group.sync.aligned {n};",
            n = const N,
            options(nostack),
        )
    };
}

/// Raises this warpgroup's registers per thread to `N` (a multiple of 8, ≤ 256),
/// taking them from warpgroups that lowered theirs: consumers of a
/// warp-specialized kernel hold accumulators the producer does not need.
#[inline(always)]
pub fn setmaxnreg_inc<const N: u32>() {
    unsafe { asm!("setmaxnreg.inc.sync.aligned.u32 {n};", n = const N, options(nostack)) };
}

/// Lowers this warpgroup's registers per thread to `N` (see [`setmaxnreg_inc`]).
#[inline(always)]
pub fn setmaxnreg_dec<const N: u32>() {
    unsafe { asm!("setmaxnreg.dec.sync.aligned.u32 {n};", n = const N, options(nostack)) };
}

/// Pins `regs` at this point of the program (no instruction): register
/// arithmetic on them cannot move across the `fence` or `wait_group` next to
/// it, which, having no operands, LLVM may otherwise reorder around.
#[inline(always)]
pub fn fence_operands(regs: &mut [f32]) {
    for r in regs.iter_mut() {
        unsafe { asm!("/* {0} */", inout(reg32) *r, options(nostack, nomem, preserves_flags)) };
    }
}

/// [`fence_operands`] for registers a queued `wgmma` reads (P's A fragments):
/// they stay live, unchanged, until the `wait_group` that retires it.
#[inline(always)]
pub fn fence_operands_u32(regs: &mut [u32]) {
    for r in regs.iter_mut() {
        unsafe { asm!("/* {0} */", inout(reg32) *r, options(nostack, nomem, preserves_flags)) };
    }
}

/// Makes shared memory written through the generic proxy (ordinary stores,
/// cp.async) visible to the async proxy that `wgmma` reads with.
#[inline(always)]
pub fn fence_proxy_async_shared() {
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack)) };
}

/// Descriptor of a K-major bf16 tile with 128-byte rows in the 128-byte swizzle
/// (the layout `SmemTile<ROWS, 64>` writes), its base 1024-byte aligned: 8-row
/// groups are 1024 bytes apart. `addr` may be advanced by 32 bytes per k16 step.
#[inline(always)]
pub fn desc_k_major_sw128(addr: u32) -> u64 {
    let start = ((addr & 0x3ffff) >> 4) as u64;
    let leading = 1u64; // unused for swizzled K-major layouts
    let stride = (1024u64 >> 4) << 32;
    let swizzle_128b = 1u64 << 62;
    start | (leading << 16) | stride | swizzle_128b
}

/// Descriptor of an MN-major bf16 tile in the 128-byte swizzle (rows of 64
/// N-contiguous elements, 128 bytes, 8-row groups 1024 bytes apart along K):
/// the layout a TMA box of 64 columns writes for V, read as the B of P·V.
/// `mn_block_bytes`: from one 64-element block of N to the next. `addr` may be
/// advanced by 2048 bytes (16 rows of K) per k16 step.
#[inline(always)]
pub fn desc_mn_major_sw128(addr: u32, mn_block_bytes: u32) -> u64 {
    let start = ((addr & 0x3ffff) >> 4) as u64;
    let leading = ((mn_block_bytes & 0x3ffff) >> 4) as u64;
    let stride = (1024u64 >> 4) << 32;
    let swizzle_128b = 1u64 << 62;
    start | (leading << 16) | stride | swizzle_128b
}

/// A shared-memory matrix descriptor kept as its two words, so that a step
/// along the tile (a k16 step, the next 64-row group) adds to the low word
/// alone: one integer add a `wgmma` instead of the descriptor built again.
#[derive(Clone, Copy)]
pub struct SmemDesc {
    lo: u32,
    hi: u32,
}

impl SmemDesc {
    /// [`desc_k_major_sw128`] of `addr`.
    #[inline(always)]
    pub fn k_major_sw128(addr: u32) -> Self {
        Self::split(desc_k_major_sw128(addr))
    }

    /// [`desc_mn_major_sw128`] of `addr`.
    #[inline(always)]
    pub fn mn_major_sw128(addr: u32, mn_block_bytes: u32) -> Self {
        Self::split(desc_mn_major_sw128(addr, mn_block_bytes))
    }

    #[inline(always)]
    fn split(d: u64) -> Self {
        Self { lo: d as u32, hi: (d >> 32) as u32 }
    }

    /// The descriptor of the same layout `bytes` (a multiple of 16) further
    /// on. The start field (bits 0–13) holds the address / 16, and shared
    /// addresses end below 2^18, so the add never carries out of it.
    #[inline(always)]
    pub fn at(self, bytes: u32) -> u64 {
        ((self.hi as u64) << 32) | (self.lo + (bytes >> 4)) as u64
    }
}

/// Defines `acc (+)= A·B` for one m64nNk16 step with A in registers (four bf16x2
/// per thread, mma.sync's A fragment per warp: what P packed from S's
/// accumulators is) and B [16, N] N-major in shared memory (`imm-trans-b` 1),
/// or with `$trans_b` 0 B [N, 16] K-major (as the SS form's).
macro_rules! wgmma_bf16_rs {
    ($(#[$doc:meta])* $name:ident, $n:literal, $regs:literal, [$($i:literal),*]) => {
        wgmma_bf16_rs!($(#[$doc])* $name, $n, $regs, 1, [$($i),*]);
    };
    ($(#[$doc:meta])* $name:ident, $n:literal, $regs:literal, $trans_b:literal, [$($i:literal),*]) => {
        $(#[$doc])*
        #[inline(always)]
        pub fn $name(acc: &mut [f32; $regs], a: [u32; 4], desc_b: u64, accumulate: bool) {
            unsafe {
                asm!(
                    "{{",
                    ".reg .pred p;",
                    "setp.ne.b32 p, {scale_d}, 0;",
                    concat!("wgmma.mma_async.sync.aligned.m64n", $n, "k16.f32.bf16.bf16 {{{0}", $(", {", $i, "}",)*
                        "}}, {{{a0}, {a1}, {a2}, {a3}}}, {db}, p, 1, 1, ", $trans_b, ";"),
                    "}}",
                    inout(reg32) acc[0],
                    $(inout(reg32) acc[$i],)*
                    a0 = in(reg32) a[0],
                    a1 = in(reg32) a[1],
                    a2 = in(reg32) a[2],
                    a3 = in(reg32) a[3],
                    db = in(reg64) desc_b,
                    scale_d = in(reg32) accumulate as u32,
                    options(nostack),
                );
            }
        }
    };
}

wgmma_bf16_rs!(
    /// 64×64×16, A in registers: 32 f32 accumulators per thread.
    mma_rs_m64n64k16, 64, 32, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
);
wgmma_bf16_rs!(
    /// 64×128×16, A in registers: 64 f32 accumulators per thread.
    mma_rs_m64n128k16, 128, 64, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63]
);
wgmma_bf16_rs!(
    /// 64×256×16, A in registers: 128 f32 accumulators per thread.
    mma_rs_m64n256k16, 256, 128, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127]
);

wgmma_bf16_rs!(
    /// 64×64×16, A in registers, B K-major: 32 f32 accumulators per thread.
    mma_rs_kmajor_m64n64k16, 64, 32, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
);
wgmma_bf16_rs!(
    /// 64×128×16, A in registers, B K-major: 64 f32 accumulators per thread.
    mma_rs_kmajor_m64n128k16, 128, 64, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63]
);
wgmma_bf16_rs!(
    /// 64×80×16, A in registers, B K-major: 40 f32 accumulators per thread.
    mma_rs_kmajor_m64n80k16, 80, 40, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
);
wgmma_bf16_rs!(
    /// 64×176×16, A in registers, B K-major: 88 f32 accumulators per thread.
    mma_rs_kmajor_m64n176k16, 176, 88, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87]
);

/// Defines `acc (+)= A·Bᵀ` for one m64nNk16 step: A [64, 16] and B [N, 16], both
/// K-major in shared memory, given by descriptors; `accumulate == false` overwrites
/// acc. The accumulators are listed one by one because asm! has no array operands.
macro_rules! wgmma_bf16 {
    ($(#[$doc:meta])* $name:ident, $n:literal, $regs:literal, [$($i:literal),*]) => {
        $(#[$doc])*
        #[inline(always)]
        pub fn $name(acc: &mut [f32; $regs], desc_a: u64, desc_b: u64, accumulate: bool) {
            unsafe {
                asm!(
                    "{{",
                    ".reg .pred p;",
                    "setp.ne.b32 p, {scale_d}, 0;",
                    concat!("wgmma.mma_async.sync.aligned.m64n", $n, "k16.f32.bf16.bf16 {{{0}", $(", {", $i, "}",)*
                        "}}, {da}, {db}, p, 1, 1, 0, 0;"),
                    "}}",
                    inout(reg32) acc[0],
                    $(inout(reg32) acc[$i],)*
                    da = in(reg64) desc_a,
                    db = in(reg64) desc_b,
                    scale_d = in(reg32) accumulate as u32,
                    options(nostack),
                );
            }
        }
    };
}

wgmma_bf16!(
    /// 64×64×16: 32 f32 accumulators per thread.
    mma_m64n64k16, 64, 32, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
);
wgmma_bf16!(
    /// 64×128×16: 64 f32 accumulators per thread.
    mma_m64n128k16, 128, 64, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63]
);
wgmma_bf16!(
    /// 64×80×16: 40 f32 accumulators per thread.
    mma_m64n80k16, 80, 40, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
);
wgmma_bf16!(
    /// 64×224×16: 112 f32 accumulators per thread.
    mma_m64n224k16, 224, 112, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111]
);
wgmma_bf16!(
    /// 64×176×16: 88 f32 accumulators per thread.
    mma_m64n176k16, 176, 88, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87]
);
wgmma_bf16!(
    /// 64×192×16: 96 f32 accumulators per thread.
    mma_m64n192k16, 192, 96, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95]
);
wgmma_bf16!(
    /// 64×256×16: 128 f32 accumulators per thread.
    mma_m64n256k16, 256, 128, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127]
);
