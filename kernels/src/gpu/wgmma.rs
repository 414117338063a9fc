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

/// acc (+)= A·Bᵀ for a 64×128×16 step: A [64, 16] and B [128, 16], both K-major
/// in shared memory. `accumulate == false` overwrites acc.
#[inline(always)]
pub fn mma_m64n128k16(acc: &mut [f32; 64], desc_a: u64, desc_b: u64, accumulate: bool) {
    unsafe {
        asm!(
            "{{",
            ".reg .pred p;",
            "setp.ne.b32 p, {scale_d}, 0;",
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {{{d0}, {d1}, {d2}, {d3}, {d4}, {d5}, {d6}, {d7}, {d8}, {d9}, {d10}, {d11}, {d12}, {d13}, {d14}, {d15}, {d16}, {d17}, {d18}, {d19}, {d20}, {d21}, {d22}, {d23}, {d24}, {d25}, {d26}, {d27}, {d28}, {d29}, {d30}, {d31}, {d32}, {d33}, {d34}, {d35}, {d36}, {d37}, {d38}, {d39}, {d40}, {d41}, {d42}, {d43}, {d44}, {d45}, {d46}, {d47}, {d48}, {d49}, {d50}, {d51}, {d52}, {d53}, {d54}, {d55}, {d56}, {d57}, {d58}, {d59}, {d60}, {d61}, {d62}, {d63}}}, {da}, {db}, p, 1, 1, 0, 0;",
            "}}",
            d0 = inout(reg32) acc[0],
            d1 = inout(reg32) acc[1],
            d2 = inout(reg32) acc[2],
            d3 = inout(reg32) acc[3],
            d4 = inout(reg32) acc[4],
            d5 = inout(reg32) acc[5],
            d6 = inout(reg32) acc[6],
            d7 = inout(reg32) acc[7],
            d8 = inout(reg32) acc[8],
            d9 = inout(reg32) acc[9],
            d10 = inout(reg32) acc[10],
            d11 = inout(reg32) acc[11],
            d12 = inout(reg32) acc[12],
            d13 = inout(reg32) acc[13],
            d14 = inout(reg32) acc[14],
            d15 = inout(reg32) acc[15],
            d16 = inout(reg32) acc[16],
            d17 = inout(reg32) acc[17],
            d18 = inout(reg32) acc[18],
            d19 = inout(reg32) acc[19],
            d20 = inout(reg32) acc[20],
            d21 = inout(reg32) acc[21],
            d22 = inout(reg32) acc[22],
            d23 = inout(reg32) acc[23],
            d24 = inout(reg32) acc[24],
            d25 = inout(reg32) acc[25],
            d26 = inout(reg32) acc[26],
            d27 = inout(reg32) acc[27],
            d28 = inout(reg32) acc[28],
            d29 = inout(reg32) acc[29],
            d30 = inout(reg32) acc[30],
            d31 = inout(reg32) acc[31],
            d32 = inout(reg32) acc[32],
            d33 = inout(reg32) acc[33],
            d34 = inout(reg32) acc[34],
            d35 = inout(reg32) acc[35],
            d36 = inout(reg32) acc[36],
            d37 = inout(reg32) acc[37],
            d38 = inout(reg32) acc[38],
            d39 = inout(reg32) acc[39],
            d40 = inout(reg32) acc[40],
            d41 = inout(reg32) acc[41],
            d42 = inout(reg32) acc[42],
            d43 = inout(reg32) acc[43],
            d44 = inout(reg32) acc[44],
            d45 = inout(reg32) acc[45],
            d46 = inout(reg32) acc[46],
            d47 = inout(reg32) acc[47],
            d48 = inout(reg32) acc[48],
            d49 = inout(reg32) acc[49],
            d50 = inout(reg32) acc[50],
            d51 = inout(reg32) acc[51],
            d52 = inout(reg32) acc[52],
            d53 = inout(reg32) acc[53],
            d54 = inout(reg32) acc[54],
            d55 = inout(reg32) acc[55],
            d56 = inout(reg32) acc[56],
            d57 = inout(reg32) acc[57],
            d58 = inout(reg32) acc[58],
            d59 = inout(reg32) acc[59],
            d60 = inout(reg32) acc[60],
            d61 = inout(reg32) acc[61],
            d62 = inout(reg32) acc[62],
            d63 = inout(reg32) acc[63],
            da = in(reg64) desc_a,
            db = in(reg64) desc_b,
            scale_d = in(reg32) accumulate as u32,
            options(nostack),
        );
    }
}
