//! Decode GEMM (a few tokens, M ≤ 16 per row block) without split-K partials:
//! each block owns 8·NT output columns over the whole K, which its WARPS warps
//! split and add up in shared memory, so nothing goes through an f32 workspace
//! (the skinny kernels' partial sums and their fences grow with the token count).
//!
//! Weights go straight from HBM to registers, 16 bytes per lane, already in the
//! mma B-fragment order: within each 32-wide K chunk, lane (g, t) = (lane / 4,
//! lane % 4) loads W[n0 + 8·nt + g][8t .. 8t + 8], and the chunk's two k16 steps
//! use elements 0–3 and 4–7. The dot product does not depend on the order of K,
//! so the same permutation on X's fragments (its rows g and g + 8, the same
//! 16 bytes, through L1: every block reads X) keeps every product paired.

use crate::gemm::store_pair;
use crate::gpu::mem::{ld_global_stream_v4, ld_global_v4};
use crate::gpu::mma::{mma_bf16_16816, FragA, FragC};
use crate::gpu::shared::{dynamic_shared_base, ld_shared_v4, st_shared_v4};
use crate::gpu::thread::{
    block_idx_x, block_idx_y, launch_dependents, sync_threads, thread_idx_x, wait_for_prior_grids,
};
use abi::gemm::gemv::{BATCH, K_CHUNK as CHUNK, N8_TILES, ROWS, THREADS, WARPS};
use abi::GemmArgs;

type Batch<const NT: usize, const U: usize> = [[[u32; 4]; NT]; U];

/// U chunks of this lane's W rows, from chunk `c` on (past `c_end`, past K or past
/// N: zeros, which add nothing).
#[inline(always)]
unsafe fn load_w<const NT: usize, const U: usize>(a: GemmArgs, n0: usize, c: usize, c_end: usize) -> Batch<NT, U> {
    let lane = thread_idx_x() as usize % 32;
    let (g, t) = (lane / 4, lane % 4);
    let (n, k) = (a.n as usize, a.k as usize);
    let mut wv: Batch<NT, U> = [[[0; 4]; NT]; U];
    for (u, chunk) in wv.iter_mut().enumerate() {
        let koff = (c + u) * CHUNK + 8 * t;
        if c + u < c_end && koff < k {
            for (nt, v) in chunk.iter_mut().enumerate() {
                let row = n0 + nt * 8 + g;
                if row < n {
                    *v = ld_global_stream_v4((a.w as *const u8).add((row * k + koff) * 2));
                }
            }
        }
    }
    wv
}

/// Y = X·Wᵀ through the epilogue for rows m0..m0+16 and 8·NT columns per block.
#[inline(always)]
unsafe fn gemv<const NT: usize, const WARPS: usize, const U: usize>(a: GemmArgs) {
    launch_dependents();
    let tid = thread_idx_x() as usize;
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let (m, n, k) = (a.m as usize, a.n as usize, a.k as usize);
    let n0 = block_idx_x() as usize * NT * 8;
    let m0 = block_idx_y() as usize * 16;
    let chunks = k.div_ceil(CHUNK);
    // Each warp a contiguous share of the chunks: long sequential runs per W row.
    let (c_begin, c_end) = (chunks * warp / WARPS, chunks * (warp + 1) / WARPS);

    // The first weights need nothing from earlier kernels.
    let mut next = load_w::<NT, U>(a, n0, c_begin, c_end);
    wait_for_prior_grids();
    let x_row = |r: usize, koff: usize| {
        if m0 + r < m && koff < k {
            // Coherent load: X was written by the kernel this one may overlap.
            ld_global_v4((a.x as *const u8).add(((m0 + r) * k + koff) * 2))
        } else {
            [0; 4]
        }
    };
    let mut acc: [FragC; NT] = [[0.0; 4]; NT];
    let mut c = c_begin;
    while c < c_end {
        let cur = next;
        // The next batch is in flight while this one is multiplied.
        if c + U < c_end {
            next = load_w::<NT, U>(a, n0, c + U, c_end);
        }
        for (u, w) in cur.iter().enumerate() {
            if c + u >= c_end {
                break;
            }
            let koff = (c + u) * CHUNK + 8 * t;
            let (lo, hi) = (x_row(g, koff), x_row(g + 8, koff));
            for s in 0..2 {
                let af: FragA = [lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1]];
                for (nt, wn) in w.iter().enumerate() {
                    mma_bf16_16816(&mut acc[nt], &af, wn[2 * s], wn[2 * s + 1]);
                }
            }
        }
        c += U;
    }

    // Warps 1.. hand their sums to warp 0 through shared memory.
    let slot = |w: usize, nt: usize| dynamic_shared_base() + (((w * NT + nt) * 32 + lane) * 16) as u32;
    if warp > 0 {
        for (nt, f) in acc.iter().enumerate() {
            st_shared_v4(slot(warp, nt), f.map(f32::to_bits));
        }
    }
    sync_threads();
    if warp != 0 {
        return;
    }
    for w in 1..WARPS {
        for (nt, f) in acc.iter_mut().enumerate() {
            let v = ld_shared_v4(slot(w, nt));
            for e in 0..4 {
                f[e] += f32::from_bits(v[e]);
            }
        }
    }
    for (nt, f) in acc.iter().enumerate() {
        let col = n0 + nt * 8 + 2 * t;
        for h in 0..2 {
            let row = m0 + g + 8 * h;
            // n is even (host-checked): col < n covers col + 1.
            if row < m && col < n {
                store_pair(a, row, col, f[2 * h], f[2 * h + 1]);
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemv_bf16_n16(args: GemmArgs) {
    gemv::<N8_TILES, WARPS, BATCH>(args)
}
// One m16 fragment of rows per block; the host's block size and shared memory
// follow `abi::gemm::gemv`.
const _: () = assert!(ROWS == 16 && THREADS == 256);
crate::launch_bounds!(gemv_bf16_n16: GemmArgs, 256);
