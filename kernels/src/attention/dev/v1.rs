//! FlashAttention forward, v1: 4 warps, 64 query rows per block (16 per warp),
//! 64-key tiles, head dim D ∈ {64, 128}; Q stays in registers. At head dim 128
//! the Q fragments, O and S exceed 255 registers and spill.
//!
//! Loading (cp.async into swizzled tiles) and compute (ldmatrix + mma) are
//! separate steps, so a Hopper variant can swap in TMA + wgmma behind them.

use crate::attention::tile_ops::{finish_row, lse, online_softmax, pv_tile, qk_tile};
use crate::gpu::bf16::pack_bf16x2;
use crate::gpu::mem::{cp_async_commit, cp_async_wait};
use crate::gpu::mma::{ldmatrix_x4, FragA, FragC};
use crate::gpu::shared::dynamic_shared_base;
use crate::gpu::thread::{block_idx_x, block_idx_y, block_idx_z, sync_threads, thread_idx_x};
use crate::gpu::tile::SmemTile;
use abi::attention::dev::V1;
use abi::FlashArgs;

const BM: usize = V1.rows;
const BN: usize = V1.keys;
const THREADS: usize = V1.threads as usize;
const N_TILES: usize = BN / 8;

/// `KSTEPS` = D/16 (k-steps of Q·Kᵀ), `DTILES` = D/8 (n-tiles of O).
#[inline(always)]
pub unsafe fn flash_fwd<const D: usize, const KSTEPS: usize, const DTILES: usize>(a: FlashArgs) {
    const {
        assert!(KSTEPS == D / 16 && DTILES == D / 8);
        assert!((SmemTile::<BM, D>::BYTES + 4 * SmemTile::<BN, D>::BYTES) as usize == V1.tile_bytes(D));
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
    let q0 = block_idx_y() as usize * BM;
    if q0 >= len_q {
        return;
    }
    let kv_head = head / (a.n_heads / a.n_kv_heads) as usize;
    let causal = a.causal != 0;
    // Causal mask aligned bottom-right: query i sees keys j <= i + diag.
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
    let stage_bytes = 2 * SmemTile::<BN, D>::BYTES;
    let k_tile = |stage: usize| SmemTile::<BN, D>::at(smem + SmemTile::<BM, D>::BYTES + stage as u32 * stage_bytes);
    let v_tile = |stage: usize| {
        SmemTile::<BN, D>::at(smem + SmemTile::<BM, D>::BYTES + stage as u32 * stage_bytes + SmemTile::<BN, D>::BYTES)
    };
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
    cp_async_wait::<0>();
    sync_threads();

    // Q stays in registers as A fragments for the whole KV sweep.
    let mut qf: [FragA; KSTEPS] = [[0; 4]; KSTEPS];
    for (kk, f) in qf.iter_mut().enumerate() {
        *f = ldmatrix_x4(q_tile.chunk_addr(warp * 16 + lane % 16, 2 * kk + lane / 16));
    }

    // Two rows per lane: g = lane/4 and g + 8 of this warp's 16.
    let mut m = [f32::NEG_INFINITY; 2];
    let mut l = [0.0f32; 2];
    let mut o: [FragC; DTILES] = [[0.0; 4]; DTILES];
    let row_in_seq = |h: usize| q0 + warp * 16 + lane / 4 + 8 * h;

    for j in 0..n_tiles {
        let stage = j & 1;
        if j + 1 < n_tiles {
            load_kv(j + 1, stage ^ 1);
        }
        cp_async_commit();
        cp_async_wait::<1>();
        sync_threads();

        // S = Q·Kᵀ for this warp's 16 rows × 64 keys.
        let kt = k_tile(stage);
        let mut s: [FragC; N_TILES] = qk_tile(&qf, kt, lane);

        let kv0 = j * BN;
        let ragged = kv0 + BN > len_k;
        let on_diagonal = causal && (kv0 + BN - 1) as isize > q0 as isize + diag;
        if ragged || on_diagonal {
            for (nt, frag) in s.iter_mut().enumerate() {
                for (e, v) in frag.iter_mut().enumerate() {
                    let col = kv0 + nt * 8 + 2 * (lane % 4) + e % 2;
                    let limit = row_in_seq(e / 2) as isize + diag;
                    if col >= len_k || (causal && col as isize > limit) {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
        }

        online_softmax(&mut s, &mut o, &mut m, &mut l, a.scale_log2);

        // O += P·V with P straight from the S registers (C layout → A layout).
        pv_tile(&s, v_tile(stage), &mut o, lane);
        // Everyone is done with this stage before the next iteration refills it.
        sync_threads();
    }

    let o_stride = a.n_heads as usize * D * 2;
    for h in 0..2 {
        let (total, inv) = finish_row(&l, h);
        let row = row_in_seq(h);
        if row < len_q {
            let token = q_start + row;
            let dst = (a.o as *mut u8).add(token * o_stride + head * D * 2);
            for (dt, frag) in o.iter().enumerate() {
                let col = dt * 8 + 2 * (lane % 4);
                *(dst.add(col * 2) as *mut u32) = pack_bf16x2(frag[2 * h] * inv, frag[2 * h + 1] * inv);
            }
            if lane % 4 == 0 {
                *(a.lse as *mut f32).add(head * a.total_q as usize + token) = lse(m[h], total);
            }
        }
    }
}

macro_rules! entries {
    ($($name:ident => <$d:literal, $ks:literal, $dt:literal>;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(args: FlashArgs) {
            flash_fwd::<$d, $ks, $dt>(args)
        }
        crate::launch_bounds!($name: FlashArgs, 128);
    )*};
}

entries! {
    flash_fwd_hd64 => <64, 4, 8>;
    flash_fwd_hd128 => <128, 8, 16>;
}

// `launch_bounds!` takes a literal.
const _: () = assert!(V1.threads == 128);
