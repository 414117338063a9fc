//! Thread-block clusters (sm_90): blocks of one cluster run at once on one GPC
//! and read each other's shared memory (distributed shared memory).

use core::arch::asm;

/// This block's rank in its cluster (`%cluster_ctarank`).
#[inline(always)]
pub fn cluster_rank() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {r}, %cluster_ctarank;", r = out(reg32) r, options(pure, nomem, nostack)) };
    r
}

/// Blocks in this cluster (`%cluster_nctarank`).
#[inline(always)]
pub fn cluster_size() -> u32 {
    let n: u32;
    unsafe { asm!("mov.u32 {n}, %cluster_nctarank;", n = out(reg32) n, options(pure, nomem, nostack)) };
    n
}

/// Barrier over every thread of the cluster: shared-memory writes before it (with
/// release semantics) are visible to reads after it in any block (acquire). Every
/// thread of every block must reach it.
#[inline(always)]
pub fn cluster_sync() {
    unsafe {
        asm!("barrier.cluster.arrive.release.aligned;", "barrier.cluster.wait.acquire.aligned;", options(nostack))
    }
}

/// [`cluster_sync`] for code that branches on the thread before it: LLVM may
/// thread such a branch through the barrier, so lanes reach it from two copies,
/// which the `.aligned` form does not allow.
#[inline(always)]
pub fn cluster_sync_unaligned() {
    unsafe { asm!("barrier.cluster.arrive.release;", "barrier.cluster.wait.acquire;", options(nostack)) }
}

/// The cluster-space address of `addr` (a shared address of this block) in the
/// shared memory of the block of rank `rank`.
#[inline(always)]
pub fn map_shared_rank(addr: u32, rank: u32) -> u32 {
    let out: u32;
    unsafe {
        asm!("mapa.shared::cluster.u32 {o}, {a}, {r};", o = out(reg32) out, a = in(reg32) addr, r = in(reg32) rank,
            options(pure, nomem, nostack))
    };
    out
}

/// One f32 from another block's shared memory ([`map_shared_rank`] address).
///
/// # Safety
/// `addr` must be a 4-byte aligned cluster shared address of a block still running.
#[inline(always)]
pub unsafe fn ld_shared_cluster_f32(addr: u32) -> f32 {
    let v: f32;
    asm!("ld.shared::cluster.f32 {v}, [{a}];", v = out(reg32) v, a = in(reg32) addr, options(readonly, nostack));
    v
}

/// Four f32 from another block's shared memory.
///
/// # Safety
/// `addr` must be a 16-byte aligned cluster shared address of a block still running.
#[inline(always)]
pub unsafe fn ld_shared_cluster_f32x4(addr: u32) -> [f32; 4] {
    let (a, b, c, d): (f32, f32, f32, f32);
    asm!("ld.shared::cluster.v4.f32 {{{a}, {b}, {c}, {d}}}, [{p}];",
        a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg32) addr,
        options(readonly, nostack));
    [a, b, c, d]
}
