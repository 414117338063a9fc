//! Global-memory access: 16-byte vector loads and stores, and `cp.async` into
//! shared memory (sm_80+), so tiles can stream in while earlier ones are computed.

use super::thread::{sync_threads, thread_idx_x};
use super::warp::{shuffle_u32, sync_warp};
use core::arch::asm;

/// A 16-byte vector: four 32-bit words (4 × f32, 8 × bf16).
pub type Vec4 = [u32; 4];

/// 16-byte global load.
///
/// # Safety
/// `p` must be a 16-byte aligned global address.
#[inline(always)]
pub unsafe fn ld_global_v4(p: *const u8) -> Vec4 {
    let (a, b, c, d): (u32, u32, u32, u32);
    asm!("ld.global.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
        a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) p,
        options(readonly, nostack));
    [a, b, c, d]
}

/// 16-byte load through the read-only (non-coherent) path, for data no thread of
/// the launch writes (weights).
///
/// # Safety
/// `p` must be a 16-byte aligned global address, not written during the launch.
#[inline(always)]
pub unsafe fn ld_global_nc_v4(p: *const u8) -> Vec4 {
    let (a, b, c, d): (u32, u32, u32, u32);
    asm!("ld.global.nc.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
        a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) p,
        options(readonly, nostack));
    [a, b, c, d]
}

/// 16-byte load of data read once: read-only path, not kept in L1, and (sm_90a,
/// PTX 7.4+) a 256-byte L2 prefetch hint so DRAM serves whole 256-byte segments of
/// a streamed row. The sm_80 module (older PTX) uses the plain read-only load.
///
/// # Safety
/// `p` must be a 16-byte aligned global address, not written during the launch.
#[inline(always)]
pub unsafe fn ld_global_stream_v4(p: *const u8) -> Vec4 {
    #[cfg(target_feature = "sm_90a")]
    {
        let (a, b, c, d): (u32, u32, u32, u32);
        asm!("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) p,
            options(readonly, nostack));
        [a, b, c, d]
    }
    #[cfg(not(target_feature = "sm_90a"))]
    {
        ld_global_nc_v4(p)
    }
}

/// 16-byte global store.
///
/// # Safety
/// `p` must be a 16-byte aligned global address.
#[inline(always)]
pub unsafe fn st_global_v4(p: *mut u8, v: Vec4) {
    asm!("st.global.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
        p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
        options(nostack));
}

/// 16-byte streaming store (`.cs`: evict first), for outputs nobody reads soon.
///
/// # Safety
/// `p` must be a 16-byte aligned global address.
#[inline(always)]
pub unsafe fn st_global_cs_v4(p: *mut u8, v: Vec4) {
    asm!("st.global.cs.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
        p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
        options(nostack));
}

/// Asynchronous 16-byte copy global → shared, bypassing L1 (`cp.async.cg`).
///
/// # Safety
/// Both addresses 16-byte aligned; `dst` a shared-window address.
#[inline(always)]
pub unsafe fn cp_async_16(dst: u32, src: *const u8) {
    asm!("cp.async.cg.shared.global [{d}], [{s}], 16;", d = in(reg32) dst, s = in(reg64) src, options(nostack));
}

/// Like [`cp_async_16`], but copies only `src_bytes` (0 or 16) and zero-fills the rest:
/// out-of-range tile rows load as zeros without a branch.
///
/// # Safety
/// As [`cp_async_16`]; `src` must be valid when `src_bytes` is 16.
#[inline(always)]
pub unsafe fn cp_async_16_zfill(dst: u32, src: *const u8, src_bytes: u32) {
    asm!("cp.async.cg.shared.global [{d}], [{s}], 16, {n};",
        d = in(reg32) dst, s = in(reg64) src, n = in(reg32) src_bytes, options(nostack));
}

/// Closes the current group of `cp.async` copies.
#[inline(always)]
pub fn cp_async_commit() {
    unsafe { asm!("cp.async.commit_group;", options(nostack)) };
}

/// Waits until at most `N` of this thread's committed groups are still in flight.
#[inline(always)]
pub fn cp_async_wait<const N: u32>() {
    unsafe { asm!("cp.async.wait_group {n};", n = const N, options(nostack)) };
}

/// `atomicAdd` on global f32 without a return value (`red.global.add.f32`).
///
/// # Safety
/// `p` must be a 4-byte aligned global address.
#[inline(always)]
pub unsafe fn red_add_f32(p: *mut f32, v: f32) {
    asm!("red.global.add.f32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack));
}

/// Adds (v0, v1) to the f32 pair at `p` with no return value: one vector reduction
/// on sm_90a (PTX 8.1), half the L2 atomic operations of two scalar ones; two
/// scalar reductions elsewhere.
///
/// # Safety
/// `p` must be an 8-byte aligned global address.
#[inline(always)]
pub unsafe fn red_add_f32x2(p: *mut f32, v0: f32, v1: f32) {
    #[cfg(target_feature = "sm_90a")]
    asm!("red.global.add.v2.f32 [{p}], {{{a}, {b}}};", p = in(reg64) p, a = in(reg32) v0, b = in(reg32) v1,
        options(nostack));
    #[cfg(not(target_feature = "sm_90a"))]
    {
        red_add_f32(p, v0);
        red_add_f32(p.add(1), v1);
    }
}

/// `atomicAdd` at GPU scope with no ordering: for counters that hand out work
/// and guard no data.
///
/// # Safety
/// `p` must be a valid 4-byte aligned global address.
#[inline(always)]
pub unsafe fn atom_add_relaxed_u32(p: *mut u32, v: u32) -> u32 {
    let old: u32;
    asm!("atom.relaxed.gpu.global.add.u32 {o}, [{p}], {v};", o = out(reg32) old, p = in(reg64) p, v = in(reg32) v,
        options(nostack));
    old
}

/// `atomicOr` at GPU scope with no ordering: for flags that claim work and
/// guard no data (an earlier acquire made the data visible).
///
/// # Safety
/// `p` must be a valid 4-byte aligned global address.
#[inline(always)]
pub unsafe fn atom_or_relaxed_u32(p: *mut u32, v: u32) -> u32 {
    let old: u32;
    asm!("atom.relaxed.gpu.global.or.b32 {o}, [{p}], {v};", o = out(reg32) old, p = in(reg64) p, v = in(reg32) v,
        options(nostack));
    old
}

/// `atomicOr` with acquire-release semantics at GPU scope, as
/// [`atom_add_acq_rel_u32`] for a flag set in a counter's word.
///
/// # Safety
/// `p` must be a valid 4-byte aligned global address.
#[inline(always)]
pub unsafe fn atom_or_acq_rel_u32(p: *mut u32, v: u32) -> u32 {
    let old: u32;
    asm!("atom.acq_rel.gpu.global.or.b32 {o}, [{p}], {v};", o = out(reg32) old, p = in(reg64) p, v = in(reg32) v,
        options(nostack));
    old
}

/// A store at GPU scope with no ordering, seen by [`atom_add_relaxed_u32`]s of
/// later kernels in the stream.
///
/// # Safety
/// `p` must be a valid 4-byte aligned global address.
#[inline(always)]
pub unsafe fn st_relaxed_u32(p: *mut u32, v: u32) {
    asm!("st.relaxed.gpu.global.u32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack));
}

/// `atomicAdd` with acquire-release semantics at GPU scope: one instruction in
/// place of fence, add, fence. After a block barrier its release covers the
/// whole block's earlier writes (release is cumulative over what the barrier
/// ordered before it); its acquire, passed on by a later barrier, lets the block
/// read what other releasers wrote.
///
/// # Safety
/// `p` must be a valid 4-byte aligned global address.
#[inline(always)]
pub unsafe fn atom_add_acq_rel_u32(p: *mut u32, v: u32) -> u32 {
    let old: u32;
    asm!("atom.acq_rel.gpu.global.add.u32 {o}, [{p}], {v};", o = out(reg32) old, p = in(reg64) p, v = in(reg32) v,
        options(nostack));
    old
}

/// Adds `part` to the global `counter` once the whole block has written its share
/// of some result; true in every thread of the block whose addition brings the
/// count to `whole` (the last contributor, which may then read every other
/// block's share with `.cg` loads). Every thread of the block must call it.
///
/// The first barrier orders every thread's stores before thread 0's
/// acquire-release add (one instruction rather than fence, add, fence), so they are
/// visible before the count goes up; its acquire orders the other blocks'
/// shares before this block's later reads, which the second barrier passes on
/// to every thread.
///
/// # Safety
/// `counter` must be a valid global u32 that only such arrivals touch.
#[inline(always)]
pub unsafe fn block_completes_count(counter: *mut u32, part: u32, whole: u32) -> bool {
    let last = crate::shared_array!(block_completes_count_last: [u32; 1]);
    sync_threads();
    if thread_idx_x() == 0 {
        let done = atom_add_acq_rel_u32(counter, part);
        last.store(0, (done + part == whole) as u32);
    }
    sync_threads();
    last.load(0) != 0
}

/// [`block_completes_count`] for one warp: true in every lane of the warp whose
/// addition brings the count to `whole`. Every lane of the warp must call it.
///
/// # Safety
/// As [`block_completes_count`].
#[inline(always)]
pub unsafe fn warp_completes_count(counter: *mut u32, part: u32, whole: u32) -> bool {
    sync_warp();
    let mut last = 0;
    if crate::gpu::thread::lane_id() == 0 {
        last = (atom_add_acq_rel_u32(counter, part) + part == whole) as u32;
    }
    let last = shuffle_u32(last, 0) != 0;
    sync_warp();
    last
}

/// One u32 from global memory, issued where it is written: not `pure`, so the
/// compiler keeps it ahead of later loads rather than sinking it to its first use
/// (a load started early overlaps the round trips that follow it).
///
/// # Safety
/// `p` must be a 4-byte aligned global address.
#[inline(always)]
pub unsafe fn ld_global_u32_early(p: *const u32) -> u32 {
    let v: u32;
    asm!("ld.global.u32 {v}, [{p}];", v = out(reg32) v, p = in(reg64) p, options(readonly, nostack));
    v
}

/// Two f32 from global memory through L2 only (`.cg`), for data other blocks
/// wrote during this launch.
///
/// # Safety
/// `p` must be an 8-byte aligned global address.
#[inline(always)]
pub unsafe fn ld_global_cg_f32x2(p: *const f32) -> (f32, f32) {
    let (a, b): (f32, f32);
    asm!("ld.global.cg.v2.f32 {{{a}, {b}}}, [{p}];", a = out(reg32) a, b = out(reg32) b, p = in(reg64) p,
        options(readonly, nostack));
    (a, b)
}

/// Four f32 (16-byte aligned) from global memory through L2 only (`.cg`), for
/// data other blocks wrote during this launch.
///
/// # Safety
/// `p` must be a valid, 16-byte aligned global address.
#[inline(always)]
pub unsafe fn ld_global_cg_f32x4(p: *const f32) -> [f32; 4] {
    let (a, b, c, d): (f32, f32, f32, f32);
    asm!("ld.global.cg.v4.f32 {{{a}, {b}, {c}, {d}}}, [{p}];",
        a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) p,
        options(readonly, nostack));
    [a, b, c, d]
}

/// One f32 from global memory through L2 only (`.cg`), for data other blocks
/// wrote during this launch.
///
/// # Safety
/// `p` must be a 4-byte aligned global address.
#[inline(always)]
pub unsafe fn ld_global_cg_f32(p: *const f32) -> f32 {
    let v: f32;
    asm!("ld.global.cg.f32 {v}, [{p}];", v = out(reg32) v, p = in(reg64) p, options(readonly, nostack));
    v
}

/// [`cp_async_wait`] for a count known only after monomorphization (a const
/// generic expression); constant-folds to the single matching instruction.
#[inline(always)]
pub fn cp_async_wait_n(n: usize) {
    match n {
        0 => cp_async_wait::<0>(),
        1 => cp_async_wait::<1>(),
        2 => cp_async_wait::<2>(),
        3 => cp_async_wait::<3>(),
        4 => cp_async_wait::<4>(),
        5 => cp_async_wait::<5>(),
        _ => cp_async_wait::<6>(),
    }
}

/// 16 bytes from global memory through L2 only (`.cg`), for data other blocks
/// wrote during this launch.
///
/// # Safety
/// `p` must be a valid, 16-byte aligned global address.
#[inline(always)]
pub unsafe fn ld_global_cg_v4(p: *const u8) -> Vec4 {
    let (a, b, c, d): (u32, u32, u32, u32);
    asm!("ld.global.cg.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
        a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) p,
        options(readonly, nostack));
    [a, b, c, d]
}

/// A global u32 with acquire semantics at GPU scope: what the releaser wrote
/// before its release is visible after this load.
///
/// # Safety
/// `p` must be a valid 4-byte aligned global address.
#[inline(always)]
pub unsafe fn ld_acquire_u32(p: *const u32) -> u32 {
    let v: u32;
    asm!("ld.acquire.gpu.global.u32 {v}, [{p}];", v = out(reg32) v, p = in(reg64) p, options(nostack));
    v
}

/// One bf16 from global memory through L2 only (`.cg`), for data other blocks
/// wrote during this launch.
///
/// # Safety
/// `p` must be a 2-byte aligned global address.
#[inline(always)]
pub unsafe fn ld_global_cg_u16(p: *const u16) -> u16 {
    let v: u16;
    asm!("ld.global.cg.u16 {v}, [{p}];", v = out(reg16) v, p = in(reg64) p, options(readonly, nostack));
    v
}

