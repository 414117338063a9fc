//! Thread, block and grid indices, and the block barrier.

use core::arch::nvptx;

#[inline(always)]
pub fn thread_idx_x() -> u32 {
    unsafe { nvptx::_thread_idx_x() as u32 }
}

#[inline(always)]
pub fn block_idx_x() -> u32 {
    unsafe { nvptx::_block_idx_x() as u32 }
}

#[inline(always)]
pub fn block_idx_y() -> u32 {
    unsafe { nvptx::_block_idx_y() as u32 }
}

#[inline(always)]
pub fn block_idx_z() -> u32 {
    unsafe { nvptx::_block_idx_z() as u32 }
}

#[inline(always)]
pub fn block_dim_x() -> u32 {
    unsafe { nvptx::_block_dim_x() as u32 }
}

#[inline(always)]
pub fn grid_dim_x() -> u32 {
    unsafe { nvptx::_grid_dim_x() as u32 }
}

#[inline(always)]
pub fn grid_dim_y() -> u32 {
    unsafe { nvptx::_grid_dim_y() as u32 }
}

#[inline(always)]
pub fn grid_dim_z() -> u32 {
    unsafe { nvptx::_grid_dim_z() as u32 }
}

pub const WARP_SIZE: u32 = 32;

#[inline(always)]
pub fn lane_id() -> u32 {
    thread_idx_x() % WARP_SIZE
}

#[inline(always)]
pub fn warp_id() -> u32 {
    thread_idx_x() / WARP_SIZE
}

/// A block barrier that stays correct when LLVM duplicates it into both arms of
/// a branch (it does, when the condition is tested again after the barrier, as
/// in warp-specialized kernels): `barrier.sync` counts threads, while `bar.sync`
/// (`.aligned`) requires all lanes of a warp at the same instruction.
#[inline(always)]
pub fn sync_threads_unaligned() {
    unsafe { core::arch::asm!("barrier.sync 0;", options(nostack)) }
}

/// Waits at named barrier `id` (1–15) until `threads` threads have reached it by
/// this or [`named_arrive`]: warpgroups taking turns (ping-pong scheduling).
/// Unaligned, for the reason [`sync_threads_unaligned`] is.
#[inline(always)]
pub fn named_sync(id: u32, threads: u32) {
    unsafe { core::arch::asm!("barrier.sync {id}, {n};", id = in(reg32) id, n = in(reg32) threads, options(nostack)) }
}

/// Counts toward named barrier `id` without waiting (see [`named_sync`]).
#[inline(always)]
pub fn named_arrive(id: u32, threads: u32) {
    unsafe { core::arch::asm!("barrier.arrive {id}, {n};", id = in(reg32) id, n = in(reg32) threads, options(nostack)) }
}

/// [`named_sync`] with `anchors` computed before it and taken as read after
/// it: ptxas moves arithmetic across a barrier freely but keeps shared loads
/// and stores on their side of it. Each anchor feeds a shared store to
/// `scratch` before the barrier, and comes back through a shared load after
/// it, both behind a predicate no float satisfies (x < −∞), so what depends
/// on the returned values starts after the barrier.
#[inline(always)]
pub fn named_sync_after(id: u32, threads: u32, anchors: [f32; 2], scratch: u32) -> [f32; 2] {
    let (mut a, mut b) = (anchors[0], anchors[1]);
    unsafe {
        core::arch::asm!(
            "{{",
            ".reg .pred never;",
            ".reg .f32 t;",
            "setp.lt.f32 never, {a}, 0fFF800000;",
            "@never st.shared.f32 [{s}], {a};",
            "@never st.shared.f32 [{s}], {b};",
            "barrier.sync {id}, {n};",
            "@never ld.shared.f32 t, [{s}];",
            "selp.f32 {a}, t, {a}, never;",
            "selp.f32 {b}, t, {b}, never;",
            "}}",
            a = inout(reg32) a,
            b = inout(reg32) b,
            s = in(reg32) scratch,
            id = in(reg32) id,
            n = in(reg32) threads,
            options(nostack),
        )
    }
    [a, b]
}

/// [`named_arrive`] once `anchors` are computed (`asm_after_anchors!`).
#[inline(always)]
pub fn named_arrive_after(id: u32, threads: u32, anchors: [f32; 2], scratch: u32) {
    unsafe {
        asm_after_anchors!(
            anchors[0],
            anchors[1],
            scratch,
            "barrier.arrive {id}, {n};",
            id = in(reg32) id,
            n = in(reg32) threads,
            options(nostack),
        )
    }
}

/// `__syncthreads()`: every thread of the block waits here, and shared-memory
/// writes before it are visible to all after it.
#[inline(always)]
pub fn sync_threads() {
    unsafe { nvptx::_syncthreads() }
}

/// Programmatic dependent launch (Hopper): lets the next kernel in the stream, when
/// it was launched with programmatic stream serialization, start its blocks (and
/// their prologue: weight loads) before this grid ends. Before sm_90: nothing.
#[inline(always)]
pub fn launch_dependents() {
    #[cfg(target_feature = "sm_90a")]
    unsafe {
        core::arch::asm!("griddepcontrol.launch_dependents;", options(nostack))
    }
}

/// Waits until the grids this one depends on have completed and their writes are
/// visible. A kernel launched with programmatic stream serialization must call it
/// before reading anything earlier kernels write, and before writing anything they
/// read. Without such a launch (or before sm_90) it returns at once. Not `nomem`:
/// no memory access may move above it.
#[inline(always)]
pub fn wait_for_prior_grids() {
    #[cfg(target_feature = "sm_90a")]
    unsafe {
        core::arch::asm!("griddepcontrol.wait;", options(nostack))
    }
}

/// The GPU's global nanosecond timer (`%globaltimer`), the same on every SM.
#[inline(always)]
pub fn global_timer_ns() -> u64 {
    let t: u64;
    unsafe { core::arch::asm!("mov.u64 {t}, %globaltimer;", t = out(reg64) t, options(nostack)) };
    t
}

/// The SM the thread runs on (`%smid`).
#[inline(always)]
pub fn sm_id() -> u32 {
    let id: u32;
    unsafe { core::arch::asm!("mov.u32 {id}, %smid;", id = out(reg32) id, options(nostack)) };
    id
}

/// Suspends the thread for about `ns` nanoseconds (sm_70+): a polling loop that
/// backs off leaves the memory system to the threads doing work.
#[inline(always)]
pub fn nanosleep(ns: u32) {
    unsafe { core::arch::asm!("nanosleep.u32 {t};", t = in(reg32) ns, options(nostack)) };
}
