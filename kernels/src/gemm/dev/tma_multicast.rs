//! The Hopper GEMM in clusters of two blocks along M (`GemmVersion::TmaMulticast`).
//!
//! The two blocks of a cluster compute vertically adjacent 128×256 tiles, which
//! read the same 256 columns of W. Each block's producer loads its own X box and
//! half of the W box, the half multicast into both blocks' shared memory, so L2
//! feeds each W box once per pair instead of twice: a third fewer bytes a K
//! tile. Measured no faster than the persistent kernel from M = 1024 to 8192³:
//! L2's feed is not what limits it there. A stage is free again only once the
//! consumers of both blocks have released it, since either producer writes it
//! in both: each consumer warpgroup arrives on its own block's `empty` barrier
//! and on its peer's. The cluster walks its pairs of tiles persistently, both
//! blocks in step, so their rings' stages and phases stay aligned.

use crate::gemm::quad_store::store_tile;
use crate::gemm::tma::{tile_of, Cols256, Ring, ThreadPairs, WideTile, X_BYTES};
use crate::gpu::cluster::{cluster_rank, cluster_sync_unaligned};
use crate::gpu::thread::{block_idx_x, grid_dim_x, thread_idx_x};
use crate::gpu::tma;
use crate::gpu::wgmma;
use abi::gemm::tma::{BK, BM, BN, CONSUMERS, STAGES};
use abi::GemmTmaArgs;

/// Blocks per cluster, stacked along M.
const PAIR: usize = 2;
/// Each block's share of a W box: `BN / PAIR` rows.
const W_PART_BYTES: u32 = (BN / PAIR * BK * 2) as u32;
const STAGE_BYTES: u32 = X_BYTES + PAIR as u32 * W_PART_BYTES;

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_multicast(a: GemmTmaArgs) {
    let g = a.gemm;
    let tid = thread_idx_x() as usize;
    let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
    let (m_tiles, n_tiles) = (m.div_ceil(BM), n.div_ceil(BN));
    let k_tiles = k.div_ceil(BK);
    let rank = cluster_rank() as usize;
    let peer = (rank ^ 1) as u32;
    let (cluster, clusters) = (block_idx_x() as usize / PAIR, grid_dim_x() as usize / PAIR);
    let pair_rows = m_tiles.div_ceil(PAIR);
    let pairs = pair_rows * n_tiles;
    // This block's tile of pair `u`.
    let tile = |u: usize| {
        let (pm, tn) = tile_of(u, pair_rows, n_tiles);
        (pm * PAIR + rank, tn)
    };

    let ring = Ring::new(STAGES, STAGE_BYTES, X_BYTES);
    if tid == 0 {
        ring.init((CONSUMERS * PAIR) as u32);
    }
    // The peer's barriers are initialized before any multicast or remote arrival.
    cluster_sync_unaligned();

    let warpgroup = tid / 128;
    if warpgroup == 0 {
        // As the shipped kernel: the consumers' epilogue takes the producer's spare registers.
        wgmma::setmaxnreg_dec::<40>();
        if tid == 0 {
            tma::acquire_map(a.map_x);
            tma::acquire_map(a.map_w);
            let mut it = 0;
            let mut u = cluster;
            while u < pairs {
                let (tm, tn) = tile(u);
                // Past an odd last row tile this block's rows lie beyond M: it
                // loads the row tile above (its sums are not stored) and still
                // sends its peer its half of W.
                let xm = tm.min(m_tiles - 1);
                for kt in 0..k_tiles {
                    let s = it % STAGES;
                    if it >= STAGES {
                        ring.empty(s).wait(((it / STAGES) as u32 - 1) & 1);
                    }
                    ring.full(s).arrive_expect_tx(STAGE_BYTES);
                    let k0 = (kt * BK) as i32;
                    tma::load_2d(ring.x(s), a.map_x, k0, (xm * BM) as i32, ring.full(s));
                    let part = ring.w(s) + rank as u32 * W_PART_BYTES;
                    tma::load_2d_multicast(part, a.map_w, k0, (tn * BN + rank * BN / PAIR) as i32, ring.full(s), 0b11);
                    it += 1;
                }
                u += clusters;
            }
        }
    } else {
        wgmma::setmaxnreg_inc::<232>();
        let c = warpgroup - 1;
        let (warp, lane) = ((tid % 128) / 32, tid % 32);
        // Releases a stage to both producers.
        let release = |s: usize| {
            if tid % 128 == 0 {
                ring.empty(s).arrive();
                ring.empty(s).arrive_remote(peer);
            }
        };
        let mut acc = [0.0f32; 128];
        let mut it = 0;
        let mut u = cluster;
        while u < pairs {
            let (tm, tn) = tile(u);
            for kt in 0..k_tiles {
                let s = it % STAGES;
                ring.full(s).wait((it / STAGES) as u32 & 1);
                wgmma::fence();
                for kk in 0..BK / 16 {
                    let da = wgmma::desc_k_major_sw128(ring.x(s) + (c * 64 * 128 + kk * 32) as u32);
                    let db = wgmma::desc_k_major_sw128(ring.w(s) + (kk * 32) as u32);
                    Cols256::mma(&mut acc, da, db, kt > 0 || kk > 0);
                }
                wgmma::commit_group();
                wgmma::wait_group::<1>();
                if kt > 0 {
                    release((it - 1) % STAGES);
                }
                it += 1;
            }
            wgmma::wait_group::<0>();
            release((it - 1) % STAGES);
            let pairs_of = ThreadPairs { row0: tm * BM + c * 64 + warp * 16 + lane / 4, col0: tn * BN + 2 * (lane % 4), m, n };
            store_tile(g, &pairs_of, &acc);
            u += clusters;
        }
    }
    // Neither block leaves while its peer may still write its shared memory or
    // arrive on its barriers.
    cluster_sync_unaligned();
}
crate::launch_bounds!(gemm_bf16_tma_multicast: GemmTmaArgs, 384, 1);
