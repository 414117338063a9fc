//! RMSNorm over bf16 rows, f32 math: y = x · rsqrt(mean(x²) + eps) · w.
//!
//! With a residual `r`, the kernel first forms s = x + r (rounded to bf16, as the
//! framework does), writes s as the next residual, and normalizes s: the form a
//! transformer layer uses, in one pass over memory instead of two.
//! Each block holds one row in registers (`VPT` packs per thread); v6 instead
//! gives each warp its own row (`PPL` packs per lane).

use crate::gpu::math::rsqrt;
use crate::gpu::pack::{Bf16x1, Bf16x8, Pack};
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, lane_id, thread_idx_x, warp_id, WARP_SIZE};
use crate::gpu::warp::{block_reduce, warp_reduce_sum};

pub use abi::RmsNormArgs;

#[inline(always)]
unsafe fn resident<
    P: Pack,
    const VPT: usize,
    const PREFETCH_WEIGHT: bool,
    const REPACK: bool,
    const PIPELINE: bool,
    const STREAM: bool,
>(
    a: RmsNormArgs,
) {
    let t = thread_idx_x() as usize;
    let nthreads = block_dim_x() as usize;
    let npacks = a.cols as usize / P::LANES;
    let pack_bytes = P::LANES * P::ELEM_BYTES;
    let num_warps = (nthreads as u32).div_ceil(32);
    let (scratch_a, scratch_b) =
        (crate::shared_array!(rmsnorm_scratch_a: [f32; 32]), crate::shared_array!(rmsnorm_scratch_b: [f32; 32]));
    let valid = |j: usize| j * nthreads + t < npacks;
    let offset = |j: usize| (j * nthreads + t) * pack_bytes;
    let fused = a.residual != 0;
    let load_row = |row: u32, v: &mut [P; VPT]| {
        let x = (a.x as *const u8).add(row as usize * a.in_row_stride as usize * P::ELEM_BYTES);
        for (j, p) in v.iter_mut().enumerate() {
            if valid(j) {
                // v5: x and the residual are read once: no L1 allocation, 256-byte
                // L2 prefetch.
                *p = if STREAM { P::load_stream(x.add(offset(j))) } else { P::load(x.add(offset(j))) };
            }
        }
    };
    let mut row = block_idx_x();
    let mut use_b = false;
    let mut v: [P; VPT] = core::mem::MaybeUninit::uninit().assume_init();
    if PIPELINE && row < a.rows {
        load_row(row, &mut v);
    }
    while row < a.rows {
        let in_off = row as usize * a.in_row_stride as usize * P::ELEM_BYTES;
        if !PIPELINE {
            load_row(row, &mut v);
        }
        // v4 (a grid of resident blocks): the next row's loads leave before this
        // row's reduction and stores, so the block always has bytes in flight.
        let next_row = row + grid_dim_x();
        let mut next: [P; VPT] = core::mem::MaybeUninit::uninit().assume_init();
        if PIPELINE && next_row < a.rows {
            load_row(next_row, &mut next);
        }
        if fused {
            let r = (a.residual as *const u8).add(in_off);
            let s_out = (a.sum_out as *mut u8).add(in_off);
            for (j, p) in v.iter_mut().enumerate() {
                if valid(j) {
                    let rp = if STREAM { P::load_stream(r.add(offset(j))) } else { P::load(r.add(offset(j))) };
                    // Round the sum to bf16 first: the stored residual and the
                    // normalized value must agree.
                    *p = P::from_fn(|l| p.get(l) + rp.get(l));
                    p.store(s_out.add(offset(j)));
                }
            }
        }
        // v2 loads the weights before the reduction, so their latency hides behind
        // the barrier instead of following it (at the cost of registers).
        let mut w: [P; VPT] = core::mem::MaybeUninit::uninit().assume_init();
        if PREFETCH_WEIGHT {
            for (j, wp) in w.iter_mut().enumerate() {
                if valid(j) {
                    *wp = P::load((a.weight as *const u8).add(offset(j)));
                }
            }
        }
        let mut ss = 0.0f32;
        for (j, p) in v.iter().enumerate() {
            if valid(j) {
                for l in 0..P::LANES {
                    ss += p.get(l) * p.get(l);
                }
            }
        }
        // Alternate scratch arrays between rows: one barrier per reduction suffices.
        ss = block_reduce(ss, 0.0, |a, b| a + b, if use_b { scratch_b } else { scratch_a }, num_warps);
        use_b = !use_b;
        let inv_rms = rsqrt(ss / a.cols as f32 + a.eps);
        let y = (a.y as *mut u8).add(row as usize * a.y_row_stride as usize * P::ELEM_BYTES);
        for (j, p) in v.iter().enumerate() {
            if valid(j) {
                // v3: unpack again here rather than keep the f32 copies from the sum
                // of squares alive (80 → 50 registers at r4: more rows in flight).
                let p = &if REPACK { p.opaque() } else { *p };
                let wp = if PREFETCH_WEIGHT { w[j] } else { P::load((a.weight as *const u8).add(offset(j))) };
                P::from_fn(|l| p.get(l) * inv_rms * wp.get(l)).store(y.add(offset(j)));
            }
        }
        if PIPELINE {
            v = next;
        }
        row = next_row;
    }
}

/// v6: one warp per row, the block's warps independent: no shared memory and no
/// block barrier, so a warp that finishes its row moves on at once. Each lane
/// issues all its loads for the row before the shuffle reduction.
#[inline(always)]
unsafe fn warp_rows<P: Pack, const PPL: usize>(a: RmsNormArgs) {
    let lane = lane_id() as usize;
    let warps = block_dim_x() / WARP_SIZE;
    let npacks = a.cols as usize / P::LANES;
    let pack_bytes = P::LANES * P::ELEM_BYTES;
    let valid = |j: usize| j * WARP_SIZE as usize + lane < npacks;
    let offset = |j: usize| (j * WARP_SIZE as usize + lane) * pack_bytes;
    let fused = a.residual != 0;
    // Warp-uniform, so the full-mask shuffles below always see the whole warp.
    // usize: the grid-stride step must not wrap near u32::MAX rows.
    let mut row = (block_idx_x() * warps + warp_id()) as usize;
    while row < a.rows as usize {
        let in_off = row * a.in_row_stride as usize * P::ELEM_BYTES;
        let x = (a.x as *const u8).add(in_off);
        let mut v: [P; PPL] = core::mem::MaybeUninit::uninit().assume_init();
        for (j, p) in v.iter_mut().enumerate() {
            if valid(j) {
                *p = P::load_stream(x.add(offset(j)));
            }
        }
        if fused {
            let r = (a.residual as *const u8).add(in_off);
            let s_out = (a.sum_out as *mut u8).add(in_off);
            for (j, p) in v.iter_mut().enumerate() {
                if valid(j) {
                    let rp = P::load_stream(r.add(offset(j)));
                    // Round the sum to bf16 first, as `resident` does.
                    *p = P::from_fn(|l| p.get(l) + rp.get(l));
                    p.store(s_out.add(offset(j)));
                }
            }
        }
        let mut ss = 0.0f32;
        for (j, p) in v.iter().enumerate() {
            if valid(j) {
                for l in 0..P::LANES {
                    ss += p.get(l) * p.get(l);
                }
            }
        }
        // Butterfly: every lane gets the same bits.
        let inv_rms = rsqrt(warp_reduce_sum(ss) / a.cols as f32 + a.eps);
        let y = (a.y as *mut u8).add(row * a.y_row_stride as usize * P::ELEM_BYTES);
        for (j, p) in v.iter().enumerate() {
            if valid(j) {
                // Unpack again (as v3) rather than keep the f32 copies from the sum
                // of squares alive (w16: 255 → 121 registers; w4 spilled).
                let p = p.opaque();
                // Weights are read by every row: plain loads, kept in L1.
                let wp = P::load((a.weight as *const u8).add(offset(j)));
                P::from_fn(|l| p.get(l) * inv_rms * wp.get(l)).store(y.add(offset(j)));
            }
        }
        row += (grid_dim_x() * warps) as usize;
    }
}

/// Rows too long for one block's registers: pass 1 forms s (and writes it when
/// fused) while summing squares; pass 2 re-reads s, which L2 mostly still holds.
#[inline(always)]
unsafe fn streaming<P: Pack, const UNROLL: usize>(a: RmsNormArgs) {
    let t = thread_idx_x() as usize;
    let nthreads = block_dim_x() as usize;
    let npacks = a.cols as usize / P::LANES;
    let pack_bytes = P::LANES * P::ELEM_BYTES;
    let num_warps = (nthreads as u32).div_ceil(32);
    let (scratch_a, scratch_b) =
        (crate::shared_array!(rmsnorm_stream_a: [f32; 32]), crate::shared_array!(rmsnorm_stream_b: [f32; 32]));
    let fused = a.residual != 0;
    let mut row = block_idx_x();
    let mut use_b = false;
    while row < a.rows {
        let in_off = row as usize * a.in_row_stride as usize * P::ELEM_BYTES;
        let x = (a.x as *const u8).add(in_off);
        let s_row = if fused { (a.sum_out as *const u8).add(in_off) } else { x };
        let mut ss = 0.0f32;
        let mut base = 0;
        while base < npacks {
            let mut v: [P; UNROLL] = core::mem::MaybeUninit::uninit().assume_init();
            for (u, p) in v.iter_mut().enumerate() {
                let i = base + u * nthreads + t;
                if i < npacks {
                    *p = P::load(x.add(i * pack_bytes));
                    if fused {
                        let rp = P::load((a.residual as *const u8).add(in_off + i * pack_bytes));
                        *p = P::from_fn(|l| p.get(l) + rp.get(l));
                        p.store((a.sum_out as *mut u8).add(in_off + i * pack_bytes));
                    }
                }
            }
            for (u, p) in v.iter().enumerate() {
                if base + u * nthreads + t < npacks {
                    for l in 0..P::LANES {
                        ss += p.get(l) * p.get(l);
                    }
                }
            }
            base += UNROLL * nthreads;
        }
        // The block barrier inside the reduction also orders this block's s stores
        // before the re-reads below.
        ss = block_reduce(ss, 0.0, |a, b| a + b, if use_b { scratch_b } else { scratch_a }, num_warps);
        use_b = !use_b;
        let inv_rms = rsqrt(ss / a.cols as f32 + a.eps);
        let y = (a.y as *mut u8).add(row as usize * a.y_row_stride as usize * P::ELEM_BYTES);
        let mut i = t;
        while i < npacks {
            let p = P::load(s_row.add(i * pack_bytes));
            let w = P::load((a.weight as *const u8).add(i * pack_bytes));
            P::from_fn(|l| p.get(l) * inv_rms * w.get(l)).store(y.add(i * pack_bytes));
            i += nthreads;
        }
        row += grid_dim_x();
    }
}

/// The number after `@` is the entry's launch bound (then, optionally, the minimum
/// blocks per SM); the host's table must agree.
macro_rules! entries {
    ($($name:ident => $version:ident::<$($param:tt),*> @ $threads:literal $(, $min_blocks:literal)?;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(args: RmsNormArgs) {
            // A programmatically launched successor (a GEMM) may start loading
            // its weights as SMs free up; it waits for this grid before reading.
            crate::gpu::thread::launch_dependents();
            $version::<$($param),*>(args)
        }
        crate::launch_bounds!($name: RmsNormArgs, $threads $(, $min_blocks)?);
    )*};
}

entries! {
    rmsnorm_bf16x8_r1 => resident::<Bf16x8, 1, false, false, false, false> @ 1024;
    rmsnorm_bf16x8_r2 => resident::<Bf16x8, 2, false, false, false, false> @ 1024;
    rmsnorm_bf16x8_r4 => resident::<Bf16x8, 4, false, false, false, false> @ 512;
    rmsnorm_bf16x8_r8 => resident::<Bf16x8, 8, false, false, false, false> @ 256;
    rmsnorm_v2_bf16x8_r1 => resident::<Bf16x8, 1, true, false, false, false> @ 1024;
    rmsnorm_v2_bf16x8_r2 => resident::<Bf16x8, 2, true, false, false, false> @ 1024;
    rmsnorm_v2_bf16x8_r4 => resident::<Bf16x8, 4, true, false, false, false> @ 512;
    rmsnorm_v2_bf16x8_r8 => resident::<Bf16x8, 8, true, false, false, false> @ 256;
    rmsnorm_v3_bf16x8_r1 => resident::<Bf16x8, 1, false, true, false, false> @ 1024;
    rmsnorm_v3_bf16x8_r2 => resident::<Bf16x8, 2, false, true, false, false> @ 1024;
    rmsnorm_v3_bf16x8_r4 => resident::<Bf16x8, 4, false, true, false, false> @ 512;
    rmsnorm_v3_bf16x8_r8 => resident::<Bf16x8, 8, false, true, false, false> @ 256;
    rmsnorm_v4_bf16x8_r1 => resident::<Bf16x8, 1, false, false, true, false> @ 1024;
    rmsnorm_v4_bf16x8_r2 => resident::<Bf16x8, 2, false, false, true, false> @ 1024;
    rmsnorm_v4_bf16x8_r4 => resident::<Bf16x8, 4, false, false, true, false> @ 512;
    rmsnorm_v4_bf16x8_r8 => resident::<Bf16x8, 8, false, false, true, false> @ 256;
    rmsnorm_v5_bf16x8_r1 => resident::<Bf16x8, 1, false, false, false, true> @ 1024;
    rmsnorm_v5_bf16x8_r2 => resident::<Bf16x8, 2, false, false, false, true> @ 1024;
    rmsnorm_v5_bf16x8_r4 => resident::<Bf16x8, 4, false, false, false, true> @ 512;
    rmsnorm_v5_bf16x8_r8 => resident::<Bf16x8, 8, false, false, false, true> @ 256;
    rmsnorm_bf16x1_r1 => resident::<Bf16x1, 1, false, false, false, false> @ 1024;
    rmsnorm_bf16x1_r2 => resident::<Bf16x1, 2, false, false, false, false> @ 1024;
    rmsnorm_bf16x1_r4 => resident::<Bf16x1, 4, false, false, false, false> @ 512;
    rmsnorm_v6_bf16x8_w1 => warp_rows::<Bf16x8, 1> @ 1024;
    rmsnorm_v6_bf16x8_w2 => warp_rows::<Bf16x8, 2> @ 1024;
    rmsnorm_v6_bf16x8_w4 => warp_rows::<Bf16x8, 4> @ 1024;
    rmsnorm_v6_bf16x8_w8 => warp_rows::<Bf16x8, 8> @ 512;
    // Two blocks of 256 per SM (≤ 128 registers); three (≤ 80) spilled.
    rmsnorm_v6_bf16x8_w16 => warp_rows::<Bf16x8, 16> @ 256, 2;
    rmsnorm_bf16x8_stream => streaming::<Bf16x8, 4> @ 512;
    rmsnorm_bf16x1_stream => streaming::<Bf16x1, 4> @ 512;
}

/// Packs (8 columns each) per thread of [`rmsnorm_split_sums`].
const SUMS_VPT: usize = abi::SPLIT_SUMS_PACKS;

/// The decode step's O projection finished and the MLP's RMSNorm in one launch:
/// s = residual + (split-K sums of the projection, `x` as [rows, cols] f32, read
/// and zeroed as `gemm_finalize` would), rounded to bf16 once, goes to `sum_out`;
/// y = RMSNorm(s)·w. One block per row, all of a thread's loads issued before its
/// first use. Launched to overlap the split GEMM: it waits for it first.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn rmsnorm_split_sums(a: RmsNormArgs) {
    use crate::gpu::mem::{ld_global_cg_f32x4, st_global_v4};
    use crate::gpu::thread::{launch_dependents, wait_for_prior_grids};
    launch_dependents();
    wait_for_prior_grids();
    let (t, nthreads) = (thread_idx_x() as usize, block_dim_x() as usize);
    let cols = a.cols as usize;
    let npacks = cols / Bf16x8::LANES;
    let valid = |j: usize| j * nthreads + t < npacks;
    let col = |j: usize| (j * nthreads + t) * Bf16x8::LANES;
    let (scratch_a, scratch_b) =
        (crate::shared_array!(rmsnorm_sums_a: [f32; 32]), crate::shared_array!(rmsnorm_sums_b: [f32; 32]));
    let mut use_b = false;
    let mut row = block_idx_x();
    while row < a.rows {
        let sums = (a.x as *mut f32).add(row as usize * cols);
        let in_off = row as usize * a.in_row_stride as usize * 2;
        let (r, s_out) = ((a.residual as *const u8).add(in_off), (a.sum_out as *mut u8).add(in_off));
        let mut v = [Bf16x8([0; 4]); SUMS_VPT];
        for (j, p) in v.iter_mut().enumerate() {
            if valid(j) {
                let at = sums.add(col(j));
                let (lo, hi) = (ld_global_cg_f32x4(at), ld_global_cg_f32x4(at.add(4)));
                st_global_v4(at as *mut u8, [0; 4]);
                st_global_v4(at.add(4) as *mut u8, [0; 4]);
                let rp = Bf16x8::load(r.add(col(j) * 2));
                *p = Bf16x8::from_fn(|l| (if l < 4 { lo[l] } else { hi[l - 4] }) + rp.get(l));
                p.store(s_out.add(col(j) * 2));
            }
        }
        // The weights load before the reduction: their latency hides behind it
        // (ncu b16: 7.2 µs with them loaded after it).
        let mut w = [Bf16x8([0; 4]); SUMS_VPT];
        for (j, wp) in w.iter_mut().enumerate() {
            if valid(j) {
                *wp = Bf16x8::load((a.weight as *const u8).add(col(j) * 2));
            }
        }
        let mut ss = 0.0f32;
        for (j, p) in v.iter().enumerate() {
            if valid(j) {
                for l in 0..Bf16x8::LANES {
                    ss += p.get(l) * p.get(l);
                }
            }
        }
        // Alternate scratch arrays between rows: one barrier per reduction suffices.
        ss = block_reduce(ss, 0.0, |a, b| a + b, if use_b { scratch_b } else { scratch_a }, (nthreads as u32).div_ceil(32));
        use_b = !use_b;
        let inv_rms = rsqrt(ss / cols as f32 + a.eps);
        let y = (a.y as *mut u8).add(row as usize * a.y_row_stride as usize * 2);
        for (j, p) in v.iter().enumerate() {
            if valid(j) {
                Bf16x8::from_fn(|l| p.get(l) * inv_rms * w[j].get(l)).store(y.add(col(j) * 2));
            }
        }
        row += grid_dim_x();
    }
}
crate::launch_bounds!(rmsnorm_split_sums: RmsNormArgs, 512);
