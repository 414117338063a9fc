//! Stream-K with one cp.async ring over a block's whole range (`gemm_bf16_skinny_streamk_v2`).

use crate::gemm::mma::{add_partial, fill_ring, load_tile_k, mma_k_tile, store_tile, Acc, Ring};
use crate::gemm::stream_k::{finish_split_tile, StreamKShare};
use crate::gpu::mem::{cp_async_commit, cp_async_wait, cp_async_wait_n};
use crate::gpu::thread::{launch_dependents, sync_threads, thread_idx_x};
use abi::GemmArgs;

/// Stream-K as [`gemm_stream_k`](crate::gemm::stream_k::gemm_stream_k), with one cp.async ring over the block's whole
/// range of (tile, K tile) iterations: the next tile's first stages are already
/// loading while this tile's partial sums go to the workspace and its counter is
/// taken, so the weight stream does not drain at every tile boundary (it did:
/// 16-row partials at 16 tokens cost more than the GEMV's bytes would).
#[inline(always)]
pub(crate) unsafe fn gemm_stream_k_pipelined<
    const BM: usize,
    const BN: usize,
    const WARPS_N: usize,
    const WMT: usize,
    const WNT: usize,
    const STAGES: usize,
    const THREADS: usize,
    const BK: usize,
>(
    a: GemmArgs,
) {
    launch_dependents();
    let tid = thread_idx_x() as usize;
    let (m, n, k) = (a.m as usize, a.n as usize, a.k as usize);
    let StreamKShare { tiles_n, k_tiles, begin, end } = StreamKShare::of::<BM, BN, BK>(a);
    let iters = end - begin;
    let row_bytes = k * 2;
    let origin = |it: usize| {
        let tile = it / k_tiles;
        (tile, tile / tiles_n * BM, tile % tiles_n * BN, it % k_tiles)
    };

    let ring = Ring::<BM, BN, BK>::in_dynamic_shared();
    let (x_tile, w_tile) = (|s| ring.x(s), |s| ring.w(s));
    let load_x = |i: usize, s: usize| {
        let (_, m0, _, kt) = origin(begin + i);
        let src = (a.x as *const u8).add(m0 * row_bytes + kt * BK * 2);
        load_tile_k::<BM, BK, THREADS>(x_tile(s), src, row_bytes, m - m0, k - kt * BK, tid);
    };
    let load_w = |i: usize, s: usize| {
        let (_, _, n0, kt) = origin(begin + i);
        let src = (a.w as *const u8).add(n0 * row_bytes + kt * BK * 2);
        load_tile_k::<BN, BK, THREADS>(w_tile(s), src, row_bytes, n - n0, k - kt * BK, tid);
    };

    fill_ring::<STAGES>(iters, load_w, load_x);

    let mut acc: Acc<WMT, WNT> = [[[0.0; 4]; WNT]; WMT];
    let mut seg_kt0 = origin(begin).3;
    for i in 0..iters {
        cp_async_wait_n(STAGES - 2);
        sync_threads();
        let next = i + STAGES - 1;
        if next < iters {
            load_x(next, next % STAGES);
            load_w(next, next % STAGES);
        }
        cp_async_commit();
        mma_k_tile::<BM, BN, WARPS_N, WMT, WNT, BK>(x_tile(i % STAGES), w_tile(i % STAGES), &mut acc);

        let (tile, m0, n0, kt) = origin(begin + i);
        if kt + 1 == k_tiles || i + 1 == iters {
            // The segment of this tile ends here; later stages keep loading.
            if seg_kt0 == 0 && kt + 1 == k_tiles {
                store_tile::<WARPS_N, WMT, WNT>(a, m0, n0, &acc);
            } else {
                add_partial::<WARPS_N, WMT, WNT>(a, m0, n0, &acc);
                finish_split_tile::<BM, BN, THREADS>(a, m0, n0, tile, (kt + 1 - seg_kt0) as u32, k_tiles as u32);
            }
            acc = [[[0.0; 4]; WNT]; WMT];
            seg_kt0 = 0;
        }
    }
    cp_async_wait::<0>();
}
