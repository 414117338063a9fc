//! Hopper's Tensor Memory Accelerator and the shared-memory barriers it signals
//! (sm_90a only). A producer thread starts a tile copy with [`load_2d`]; the copy
//! engine writes the tile (swizzled as the tensor map says) and counts its bytes
//! on an mbarrier, which consumers wait on with [`Barrier::wait`]. No thread of
//! the block spends registers or issue slots on addresses.

use core::arch::asm;

/// A 64-bit mbarrier in shared memory, by its shared-window address.
#[derive(Clone, Copy)]
pub struct Barrier(pub u32);

impl Barrier {
    /// Sets the number of arrivals that complete each phase. One thread, before
    /// any use, followed by [`fence_barrier_init`] and a block barrier.
    #[inline(always)]
    pub fn init(self, arrivals: u32) {
        unsafe {
            asm!("mbarrier.init.shared::cta.b64 [{b}], {n};", b = in(reg32) self.0, n = in(reg32) arrivals, options(nostack))
        };
    }

    /// Arrives once and announces `bytes` of copies that will complete on this phase.
    #[inline(always)]
    pub fn arrive_expect_tx(self, bytes: u32) {
        unsafe {
            asm!("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{b}], {n};", b = in(reg32) self.0, n = in(reg32) bytes,
                options(nostack))
        };
    }

    /// Arrives once (release: this thread's earlier accesses happen before the phase completes).
    #[inline(always)]
    pub fn arrive(self) {
        unsafe { asm!("mbarrier.arrive.shared::cta.b64 _, [{b}];", b = in(reg32) self.0, options(nostack)) };
    }

    /// Arrives once on the barrier at this address in the shared memory of the
    /// cluster's block `rank` (release at the default CTA scope: a cluster-scope
    /// release costs a fence on every arrival).
    ///
    /// # Safety
    /// Block `rank` of this cluster must still be running, its barrier initialized.
    #[inline(always)]
    pub unsafe fn arrive_remote(self, rank: u32) {
        let remote = crate::gpu::cluster::map_shared_rank(self.0, rank);
        asm!("mbarrier.arrive.shared::cluster.b64 _, [{b}];", b = in(reg32) remote, options(nostack));
    }

    /// Whether the phase with parity `parity` has completed (waits a bounded time in hardware).
    #[inline(always)]
    pub fn try_wait(self, parity: u32) -> bool {
        let done: u32;
        unsafe {
            asm!(
                "{{",
                ".reg .pred p;",
                "mbarrier.try_wait.parity.shared::cta.b64 p, [{b}], {ph};",
                "selp.u32 {d}, 1, 0, p;",
                "}}",
                b = in(reg32) self.0, ph = in(reg32) parity, d = out(reg32) done, options(nostack)
            )
        };
        done != 0
    }

    /// Blocks until the phase with parity `parity` has completed (acquire).
    #[inline(always)]
    pub fn wait(self, parity: u32) {
        while !self.try_wait(parity) {}
    }
}

/// Makes initialized barriers visible to the async proxy (the copy engine).
#[inline(always)]
pub fn fence_barrier_init() {
    unsafe { asm!("fence.mbarrier_init.release.cluster;", options(nostack)) };
}

/// Starts a copy of the box at element coordinates (`inner`, `outer`) of the 2-D
/// tensor described by the tensor map at `map` (a global address) into shared
/// memory at `dst`; its bytes complete on `bar`. Out-of-bounds elements read as 0.
///
/// # Safety
/// `map` must point to a valid `CUtensorMap` in global memory, and `dst` to shared
/// memory that fits the box (1024-byte aligned for the 128-byte swizzle) and that
/// nothing reads or writes until `bar` completes.
#[inline(always)]
pub unsafe fn load_2d(dst: u32, map: u64, inner: i32, outer: i32, bar: Barrier) {
    asm!(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [{dst}], [{map}, {{{c0}, {c1}}}], [{bar}];",
        dst = in(reg32) dst, map = in(reg64) map, c0 = in(reg32) inner, c1 = in(reg32) outer, bar = in(reg32) bar.0,
        options(nostack)
    );
}

/// As [`load_2d`], the box written at `dst` in the shared memory of every block
/// of the cluster whose rank is set in `ranks`, its bytes completing on the
/// barrier at `bar`'s address in each of them.
///
/// # Safety
/// As [`load_2d`], in every block of `ranks`; each must still be running.
#[inline(always)]
pub unsafe fn load_2d_multicast(dst: u32, map: u64, inner: i32, outer: i32, bar: Barrier, ranks: u16) {
    asm!(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [{dst}], [{map}, {{{c0}, {c1}}}], [{bar}], {mask};",
        dst = in(reg32) dst, map = in(reg64) map, c0 = in(reg32) inner, c1 = in(reg32) outer, bar = in(reg32) bar.0,
        mask = in(reg16) ranks, options(nostack)
    );
}

/// As [`load_2d`] for a 3-D tensor map: the box at element coordinates
/// (`c0`, `c1`, `c2`), innermost first.
///
/// # Safety
/// As [`load_2d`].
#[inline(always)]
pub unsafe fn load_3d(dst: u32, map: u64, c0: i32, c1: i32, c2: i32, bar: Barrier) {
    asm!(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [{dst}], [{map}, {{{c0}, {c1}, {c2}}}], [{bar}];",
        dst = in(reg32) dst, map = in(reg64) map, c0 = in(reg32) c0, c1 = in(reg32) c1, c2 = in(reg32) c2,
        bar = in(reg32) bar.0, options(nostack)
    );
}

/// As [`store_3d`] for a 2-D tensor map: the box at element coordinates
/// (`inner`, `outer`).
///
/// # Safety
/// As [`store_3d`].
#[inline(always)]
pub unsafe fn store_2d(map: u64, inner: i32, outer: i32, src: u32) {
    asm!(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [{map}, {{{c0}, {c1}}}], [{src}];",
        map = in(reg64) map, c0 = in(reg32) inner, c1 = in(reg32) outer, src = in(reg32) src,
        options(nostack)
    );
}

/// Starts a copy of the box at element coordinates (`c0`, `c1`, `c2`),
/// innermost first, of the 3-D tensor described by the tensor map at `map`
/// from shared memory at `src`, in the thread's current bulk group (see
/// [`store_commit`]). Elements past the tensor's extent are not written.
///
/// # Safety
/// `map` must point to a valid `CUtensorMap` in global memory over memory the
/// kernel may write; `src` must hold the box (1024-byte aligned for the
/// 128-byte swizzle), each writer's stores followed by its
/// `fence.proxy.async` (`wgmma::fence_proxy_async_shared`) before the issuing
/// thread learns they are done, and stay unwritten until [`store_wait_read`]
/// says the copy has read it.
#[inline(always)]
pub unsafe fn store_3d(map: u64, c0: i32, c1: i32, c2: i32, src: u32) {
    asm!(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [{map}, {{{c0}, {c1}, {c2}}}], [{src}];",
        map = in(reg64) map, c0 = in(reg32) c0, c1 = in(reg32) c1, c2 = in(reg32) c2, src = in(reg32) src,
        options(nostack)
    );
}

/// Closes the thread's current bulk group of stores.
#[inline(always)]
pub fn store_commit() {
    unsafe { asm!("cp.async.bulk.commit_group;", options(nostack)) };
}

/// Waits until at most `N` of the thread's committed bulk groups still read
/// their shared memory (the rest may still be writing global memory).
#[inline(always)]
pub fn store_wait_read<const N: u32>() {
    unsafe { asm!("cp.async.bulk.wait_group.read {n};", n = const N, options(nostack)) };
}

/// Waits until at most `N` of the thread's committed bulk groups are incomplete.
#[inline(always)]
pub fn store_wait<const N: u32>() {
    unsafe { asm!("cp.async.bulk.wait_group {n};", n = const N, options(nostack)) };
}

/// Readies a tensor map for this thread's TMA operations, before its first:
/// the host writes maps into global memory by copies, and a map cache slot
/// is reused for other maps, so the tensormap proxy is fenced to see the
/// current 128 bytes (as the CUDA guide asks for maps in global memory);
/// then the copy engine is hinted to fetch it.
///
/// # Safety
/// `map` must be the global address of a tensor map.
#[inline(always)]
pub unsafe fn acquire_map(map: u64) {
    asm!(
        "fence.proxy.tensormap::generic.acquire.sys [{map}], 128;",
        "prefetch.tensormap [{map}];",
        map = in(reg64) map,
        options(nostack)
    );
}

/// An L2 policy for data read once (weights streamed through a decode step):
/// evicted first, so activations and the KV cache keep their lines.
#[inline(always)]
pub fn evict_first_policy() -> u64 {
    let p: u64;
    unsafe { asm!("createpolicy.fractional.L2::evict_first.b64 {p}, 1.0;", p = out(reg64) p, options(nostack)) };
    p
}

/// Starts a copy of `bytes` contiguous bytes from global `src` into shared memory
/// at `dst` under the L2 `policy`; the bytes complete on `bar`.
///
/// # Safety
/// `src` and `dst` must be 16-byte aligned with `bytes` (a multiple of 16)
/// readable and writable, and nothing may touch `dst` until `bar` completes.
#[inline(always)]
pub unsafe fn load_bulk(dst: u32, src: *const u8, bytes: u32, bar: Barrier, policy: u64) {
    asm!(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [{dst}], [{src}], {n}, [{bar}], {pol};",
        dst = in(reg32) dst, src = in(reg64) src, n = in(reg32) bytes, bar = in(reg32) bar.0, pol = in(reg64) policy,
        options(nostack)
    );
}
