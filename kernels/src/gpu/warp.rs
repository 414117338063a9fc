//! Warp shuffles and reductions, and block reductions built on them.

use super::shared::SharedArray;
use super::thread::{lane_id, sync_threads, warp_id, WARP_SIZE};
use core::arch::asm;

const FULL_MASK: u32 = 0xffff_ffff;

/// `__syncwarp()`: the warp's lanes meet here (and their shared-memory accesses
/// before it are ordered before those after it).
#[inline(always)]
pub fn sync_warp() {
    unsafe { asm!("bar.warp.sync {full};", full = in(reg32) FULL_MASK, options(nostack)) };
}

/// `__shfl_xor_sync` on the full warp.
#[inline(always)]
pub fn shuffle_xor_f32(v: f32, lane_mask: u32) -> f32 {
    let out: f32;
    unsafe {
        asm!("shfl.sync.bfly.b32 {o}, {v}, {m}, 0x1f, {full};",
            o = out(reg32) out, v = in(reg32) v, m = in(reg32) lane_mask, full = in(reg32) FULL_MASK);
    }
    out
}

/// `__shfl_xor_sync` of a u32 on the full warp.
#[inline(always)]
pub fn shuffle_xor_u32(v: u32, lane_mask: u32) -> u32 {
    let out: u32;
    unsafe {
        asm!("shfl.sync.bfly.b32 {o}, {v}, {m}, 0x1f, {full};",
            o = out(reg32) out, v = in(reg32) v, m = in(reg32) lane_mask, full = in(reg32) FULL_MASK);
    }
    out
}

/// `__all_sync` on the full warp: whether `p` holds in every lane.
#[inline(always)]
pub fn all_lanes(p: bool) -> bool {
    let out: u32;
    unsafe {
        asm!(
            "{{",
            ".reg .pred p, q;",
            "setp.ne.u32 p, {v}, 0;",
            "vote.sync.all.pred q, p, {full};",
            "selp.u32 {o}, 1, 0, q;",
            "}}",
            o = out(reg32) out, v = in(reg32) p as u32, full = in(reg32) FULL_MASK,
        );
    }
    out != 0
}

/// `__shfl_sync` on the full warp: every lane reads `v` from lane `src`.
#[inline(always)]
pub fn shuffle_f32(v: f32, src: u32) -> f32 {
    let out: f32;
    unsafe {
        asm!("shfl.sync.idx.b32 {o}, {v}, {s}, 0x1f, {full};",
            o = out(reg32) out, v = in(reg32) v, s = in(reg32) src, full = in(reg32) FULL_MASK);
    }
    out
}

/// `__shfl_sync` of a u32 on the full warp.
#[inline(always)]
pub fn shuffle_u32(v: u32, src: u32) -> u32 {
    let out: u32;
    unsafe {
        asm!("shfl.sync.idx.b32 {o}, {v}, {s}, 0x1f, {full};",
            o = out(reg32) out, v = in(reg32) v, s = in(reg32) src, full = in(reg32) FULL_MASK);
    }
    out
}

/// Butterfly reduction: every lane ends with the result.
#[inline(always)]
pub fn warp_reduce<F: Fn(f32, f32) -> f32>(mut v: f32, op: F) -> f32 {
    let mut mask = WARP_SIZE / 2;
    while mask > 0 {
        v = op(v, shuffle_xor_f32(v, mask));
        mask /= 2;
    }
    v
}

#[inline(always)]
pub fn warp_reduce_max(v: f32) -> f32 {
    warp_reduce(v, f32::max)
}

#[inline(always)]
pub fn warp_reduce_sum(v: f32) -> f32 {
    warp_reduce(v, |a, b| a + b)
}

/// Reduces over the whole block; every thread gets the result. `scratch` holds one
/// slot per warp. One barrier: callers alternate two scratch arrays between
/// consecutive reductions so a fast warp cannot overwrite slots still being read.
#[inline(always)]
pub fn block_reduce<F: Fn(f32, f32) -> f32 + Copy>(
    v: f32,
    identity: f32,
    op: F,
    scratch: SharedArray<f32, 32>,
    num_warps: u32,
) -> f32 {
    let v = warp_reduce(v, op);
    if lane_id() == 0 {
        scratch.store(warp_id() as usize, v);
    }
    sync_threads();
    let lane = lane_id();
    let r = if lane < num_warps { scratch.load(lane as usize) } else { identity };
    warp_reduce(r, op)
}
