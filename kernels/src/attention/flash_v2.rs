//! FlashAttention forward, v2: the portable path (sm_80 and later). 4 warps, 128
//! query rows per block, so each warp owns 32 rows (two m16 tiles). Every K/V
//! fragment read from shared memory then feeds two MMAs instead of one, halving
//! shared-memory traffic per FLOP, which bounded v1 (16 rows per warp). Q is
//! re-read from shared memory each tile instead of living in registers, to make
//! room for the larger O accumulator. Heavy causal blocks (last query tiles) are
//! scheduled first.
//!
//! Shipped with the key tiles that keep O and S within 255 registers
//! (`abi::attention::V2_HD64`, `V2_HD128`); `dev` instantiates the larger ones.

use super::tile_ops::{finish_row, k_frags, lse, online_softmax, p_frag, v_frags};
use super::FlashArgs;
use crate::gpu::bf16::pack_bf16x2;
use crate::gpu::mem::{cp_async_commit, cp_async_wait};
use crate::gpu::mma::{ldmatrix_x4, mma_bf16_16816, FragA, FragC};
use crate::gpu::shared::dynamic_shared_base;
use crate::gpu::thread::{block_idx_x, block_idx_y, block_idx_z, grid_dim_y, sync_threads, thread_idx_x};
use crate::gpu::tile::SmemTile;
use abi::attention::{v2, V2_HD128, V2_HD64, V2_ROWS, V2_THREADS};

const BM: usize = V2_ROWS;
const THREADS: usize = V2_THREADS as usize;
/// m16 tiles per warp.
const MT: usize = 2;

/// `KSTEPS` = D/16, `DTILES` = D/8, `NT` = BN/8 (n-tiles of S).
#[inline(always)]
pub unsafe fn flash_fwd<const D: usize, const BN: usize, const KSTEPS: usize, const DTILES: usize, const NT: usize>(
    a: FlashArgs,
) {
    const {
        assert!(KSTEPS == D / 16 && DTILES == D / 8 && NT == BN / 8);
        // The layout below is the one the host sizes the launch's shared memory for.
        assert!((SmemTile::<BM, D>::BYTES + 4 * SmemTile::<BN, D>::BYTES) as usize == v2(BN).tile_bytes(D));
    }
    let tid = thread_idx_x() as usize;
    let (warp, lane) = (tid / 32, tid % 32);
    let head = block_idx_x() as usize;
    let batch = block_idx_z() as usize;
    let cu_q = a.cu_seqlens_q as *const u32;
    let cu_k = a.cu_seqlens_k as *const u32;
    let (q_start, k_start) = (*cu_q.add(batch) as usize, *cu_k.add(batch) as usize);
    let len_q = *cu_q.add(batch + 1) as usize - q_start;
    let len_k = *cu_k.add(batch + 1) as usize - k_start;
    // Last query tiles first: under a causal mask they have the most keys.
    let q0 = (grid_dim_y() - 1 - block_idx_y()) as usize * BM;
    if q0 >= len_q {
        return;
    }
    let kv_head = head / (a.n_heads / a.n_kv_heads) as usize;
    let causal = a.causal != 0;
    let diag = len_k as isize - len_q as isize;
    let kv_end = if causal { (q0 as isize + BM as isize + diag).clamp(0, len_k as isize) as usize } else { len_k };
    let n_tiles = kv_end.div_ceil(BN);

    let q_stride = a.n_heads as usize * D * 2;
    let kv_stride = a.n_kv_heads as usize * D * 2;
    let q_src = (a.q as *const u8).add((q_start + q0) * q_stride + head * D * 2);
    let k_src = (a.k as *const u8).add(k_start * kv_stride + kv_head * D * 2);
    let v_src = (a.v as *const u8).add(k_start * kv_stride + kv_head * D * 2);

    let smem = dynamic_shared_base();
    let q_tile = SmemTile::<BM, D>::at(smem);
    let kv_bytes = SmemTile::<BN, D>::BYTES;
    let k_tile = |stage: usize| SmemTile::<BN, D>::at(smem + SmemTile::<BM, D>::BYTES + stage as u32 * 2 * kv_bytes);
    let v_tile =
        |stage: usize| SmemTile::<BN, D>::at(smem + SmemTile::<BM, D>::BYTES + (stage as u32 * 2 + 1) * kv_bytes);
    let load_kv = |j: usize, stage: usize| {
        let rows = len_k - j * BN;
        k_tile(stage).load_async::<THREADS>(k_src.add(j * BN * kv_stride), kv_stride, rows, tid);
        v_tile(stage).load_async::<THREADS>(v_src.add(j * BN * kv_stride), kv_stride, rows, tid);
    };

    q_tile.load_async::<THREADS>(q_src, q_stride, len_q - q0, tid);
    if n_tiles > 0 {
        load_kv(0, 0);
    }
    cp_async_commit();

    // Per lane: rows g and g+8 of each of the warp's two m-tiles.
    let mut m = [[f32::NEG_INFINITY; 2]; MT];
    let mut l = [[0.0f32; 2]; MT];
    let mut o: [[FragC; DTILES]; MT] = [[[0.0; 4]; DTILES]; MT];
    let row_in_seq = |mt: usize, h: usize| q0 + warp * 32 + mt * 16 + lane / 4 + 8 * h;

    for j in 0..n_tiles {
        let stage = j & 1;
        if j + 1 < n_tiles {
            load_kv(j + 1, stage ^ 1);
        }
        cp_async_commit();
        cp_async_wait::<1>();
        sync_threads();

        // S = Q·Kᵀ: each K fragment serves both m-tiles.
        let kt = k_tile(stage);
        let mut s: [[FragC; NT]; MT] = [[[0.0; 4]; NT]; MT];
        for kk in 0..KSTEPS {
            let mut qa: [FragA; MT] = [[0; 4]; MT];
            for (mt, f) in qa.iter_mut().enumerate() {
                *f = ldmatrix_x4(q_tile.chunk_addr(warp * 32 + mt * 16 + lane % 16, 2 * kk + lane / 16));
            }
            for np in 0..NT / 2 {
                let b = k_frags(kt, np, kk, lane);
                for mt in 0..MT {
                    mma_bf16_16816(&mut s[mt][2 * np], &qa[mt], b[0], b[1]);
                    mma_bf16_16816(&mut s[mt][2 * np + 1], &qa[mt], b[2], b[3]);
                }
            }
        }

        let kv0 = j * BN;
        let ragged = kv0 + BN > len_k;
        let on_diagonal = causal && (kv0 + BN - 1) as isize > q0 as isize + diag;
        if ragged || on_diagonal {
            for (mt, sm) in s.iter_mut().enumerate() {
                for (nt, frag) in sm.iter_mut().enumerate() {
                    for (e, v) in frag.iter_mut().enumerate() {
                        let col = kv0 + nt * 8 + 2 * (lane % 4) + e % 2;
                        let limit = row_in_seq(mt, e / 2) as isize + diag;
                        if col >= len_k || (causal && col as isize > limit) {
                            *v = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }

        for mt in 0..MT {
            online_softmax(&mut s[mt], &mut o[mt], &mut m[mt], &mut l[mt], a.scale_log2);
        }

        // O += P·V, P from the S registers; each V fragment serves both m-tiles.
        let vt = v_tile(stage);
        for kk in 0..NT / 2 {
            let mut p: [FragA; MT] = [[0; 4]; MT];
            for (mt, f) in p.iter_mut().enumerate() {
                *f = p_frag(&s[mt][2 * kk], &s[mt][2 * kk + 1]);
            }
            for dp in 0..DTILES / 2 {
                let b = v_frags(vt, kk, dp, lane);
                for mt in 0..MT {
                    mma_bf16_16816(&mut o[mt][2 * dp], &p[mt], b[0], b[1]);
                    mma_bf16_16816(&mut o[mt][2 * dp + 1], &p[mt], b[2], b[3]);
                }
            }
        }
        sync_threads();
    }
    if n_tiles == 0 {
        cp_async_wait::<0>();
    }

    let o_stride = a.n_heads as usize * D * 2;
    for mt in 0..MT {
        for h in 0..2 {
            let (total, inv) = finish_row(&l[mt], h);
            let row = row_in_seq(mt, h);
            if row < len_q {
                let token = q_start + row;
                let dst = (a.o as *mut u8).add(token * o_stride + head * D * 2);
                for (dt, frag) in o[mt].iter().enumerate() {
                    let col = dt * 8 + 2 * (lane % 4);
                    *(dst.add(col * 2) as *mut u32) = pack_bf16x2(frag[2 * h] * inv, frag[2 * h + 1] * inv);
                }
                if lane % 4 == 0 {
                    *(a.lse as *mut f32).add(head * a.total_q as usize + token) = lse(m[mt][h], total);
                }
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_v2_hd64_bn32(args: FlashArgs) {
    flash_fwd::<64, { V2_HD64.keys }, 4, 8, { V2_HD64.keys / 8 }>(args)
}
crate::launch_bounds!(flash_fwd_v2_hd64_bn32: FlashArgs, 128);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_v2_hd128_bn16(args: FlashArgs) {
    flash_fwd::<128, { V2_HD128.keys }, 8, 16, { V2_HD128.keys / 8 }>(args)
}
crate::launch_bounds!(flash_fwd_v2_hd128_bn16: FlashArgs, 128);

// `launch_bounds!` takes a literal.
const _: () = assert!(V2_THREADS == 128);
