//! RoPE and the KV-cache write for the fused layer: one block per token reads
//! that token's q, k, v from the QKV projection's output, rotates q and k
//! (rotate-half convention, as Llama in Hugging Face), and writes q for the
//! attention kernel and k, v into the token's page of the cache (and, for
//! prefill, into contiguous k, v for FlashAttention).
//!
//! cos and sin come from a table the host fills in f64: angles pos·inv_freq[i]
//! reach 10⁵ radians, where f32 range reduction would lose the phase.

use crate::gpu::bf16::{bf16_to_f32, f32_to_bf16, pack_bf16x2};
use crate::gpu::mem::{ld_global_cg_f32x4, ld_global_nc_v4, ld_global_v4, st_global_v4};
use crate::gpu::thread::{
    block_dim_x, block_idx_x, block_idx_y, launch_dependents, thread_idx_x, wait_for_prior_grids,
};
use abi::rope::{units, PAIRS as ROPE_PAIRS, V_CHUNK};
pub use abi::RopeKvArgs;

/// Grid (tokens, y): each thread of a token's blocks takes one unit, either
/// `ROPE_PAIRS` rotated pairs (i, i + half) of a q or k head or `V_CHUNK`
/// elements of v, so all of its loads go out at once (a loop of dependent
/// iterations per thread cost 9.3 µs at one token by ncu). The host
/// checks head_dim % 8 == 0, which keeps every access aligned. With `qkv_sums`
/// the inputs are the QKV GEMM's split-K sums, rounded to bf16 as its finalize
/// would (one launch instead of two in the decode step). With `bias`, q, k and v
/// are the projection's with its bias added: on the sums path in f32 before the
/// one rounding (as transformers' Linear), on the bf16 path to the rounded
/// product and rounded again (a double rounding, within bf16 tolerance).
#[no_mangle]
pub unsafe extern "ptx-kernel" fn rope_qkv_cache(a: RopeKvArgs) {
    // Launched to overlap the QKV GEMM: its launch latency hides under the GEMM's
    // tail, and nothing the GEMM writes is read before the GEMM has finished.
    launch_dependents();
    let t = block_idx_x() as usize;
    let (h, kv, hd) = (a.n_heads as usize, a.n_kv_heads as usize, a.head_dim as usize);
    let half = hd / 2;
    let rot_units = (h + kv) * half / ROPE_PAIRS;
    let unit = block_idx_y() as usize * block_dim_x() as usize + thread_idx_x() as usize;
    if unit >= units(h, kv, hd) {
        wait_for_prior_grids();
        return;
    }
    // The token's slot and page come from the step's uploads, copied in before
    // any kernel of the step started: their two dependent round trips run under
    // the GEMM's tail instead of after it.
    let pos = *(a.token_pos as *const u32).add(t) as usize;
    let seq = *(a.token_seq as *const u32).add(t) as usize;
    let page_size = a.page_size as usize;
    let page = *(a.page_table as *const u32).add(seq * a.max_pages as usize + pos / page_size) as usize;
    wait_for_prior_grids();
    // Element offset of this token's row (all KV heads) in either pool.
    let cache_row = (page * page_size + pos % page_size) * kv * hd;
    let src = (a.qkv as *const u16).add(t * (h + 2 * kv) * hd);

    let sums = (a.qkv_sums as *mut f32).wrapping_add(t * (h + 2 * kv) * hd);
    // Indexed like a row of qkv.
    let bias = a.bias as *const u16;
    if unit >= rot_units {
        let e = (unit - rot_units) * V_CHUNK;
        let off = (h + kv) * hd + e;
        let b = if a.bias != 0 { ld_global_nc_v4(bias.add(off) as *const u8) } else { [0; 4] };
        let (b_lo, b_hi) = (b[0] as u64 | (b[1] as u64) << 32, b[2] as u64 | (b[3] as u64) << 32);
        let v = if a.qkv_sums != 0 {
            let p = sums.add(off);
            let (mut lo, mut hi) = (take_sums(p), take_sums(p.add(4)));
            if a.bias != 0 {
                (lo, hi) = (plus_bf16x4(lo, b_lo), plus_bf16x4(hi, b_hi));
            }
            [pack_bf16x2(lo[0], lo[1]), pack_bf16x2(lo[2], lo[3]), pack_bf16x2(hi[0], hi[1]), pack_bf16x2(hi[2], hi[3])]
        } else {
            let v = ld_global_v4(src.add(off) as *const u8);
            if a.bias != 0 {
                let (lo, hi) = (v[0] as u64 | (v[1] as u64) << 32, v[2] as u64 | (v[3] as u64) << 32);
                let (lo, hi) = (add_bf16x4(lo, b_lo), add_bf16x4(hi, b_hi));
                [lo as u32, (lo >> 32) as u32, hi as u32, (hi >> 32) as u32]
            } else {
                v
            }
        };
        st_global_v4((a.v_pool as *mut u16).add(cache_row + e) as *mut u8, v);
        if a.v_out != 0 {
            st_global_v4((a.v_out as *mut u16).add(t * kv * hd + e) as *mut u8, v);
        }
        return;
    }
    let (head, i) = (unit * ROPE_PAIRS / half, unit * ROPE_PAIRS % half);
    let off = head * hd + i;
    // 8-byte words: as `[u16; 4]` LLVM splits the access into four 2-byte ones.
    let (b0, b1) =
        if a.bias != 0 { (*(bias.add(off) as *const u64), *(bias.add(off + half) as *const u64)) } else { (0, 0) };
    let (x0, x1) = if a.qkv_sums != 0 {
        let p = sums.add(off);
        let (mut s0, mut s1) = (take_sums(p), take_sums(p.add(half)));
        if a.bias != 0 {
            (s0, s1) = (plus_bf16x4(s0, b0), plus_bf16x4(s1, b1));
        }
        (bf16x4(s0), bf16x4(s1))
    } else {
        let (x0, x1) = (*(src.add(off) as *const u64), *(src.add(off + half) as *const u64));
        if a.bias != 0 {
            (add_bf16x4(x0, b0), add_bf16x4(x1, b1))
        } else {
            (x0, x1)
        }
    };
    let c = ld_global_nc_v4((a.cos as *const f32).add(pos * half + i) as *const u8);
    let s = ld_global_nc_v4((a.sin as *const f32).add(pos * half + i) as *const u8);
    let (mut y0, mut y1) = (0u64, 0u64);
    for j in 0..ROPE_PAIRS {
        let (c, s) = (f32::from_bits(c[j]), f32::from_bits(s[j]));
        let (a0, a1) = (bf16_to_f32((x0 >> (16 * j)) as u16), bf16_to_f32((x1 >> (16 * j)) as u16));
        y0 |= (f32_to_bf16(a0 * c - a1 * s) as u64) << (16 * j);
        y1 |= (f32_to_bf16(a0 * s + a1 * c) as u64) << (16 * j);
    }
    let put = |base: *mut u16| {
        *(base as *mut u64) = y0;
        *(base.add(half) as *mut u64) = y1;
    };
    if head < h {
        put((a.q_out as *mut u16).add((t * h + head) * hd + i));
    } else {
        let kh = head - h;
        put((a.k_pool as *mut u16).add(cache_row + kh * hd + i));
        if a.k_out != 0 {
            put((a.k_out as *mut u16).add((t * kv + kh) * hd + i));
        }
    }
}
crate::launch_bounds!(rope_qkv_cache: RopeKvArgs, 128);

/// Four split-K sums (16-byte aligned), zeroed for the next GEMM that uses the
/// workspace, as `gemm_finalize` leaves it.
#[inline(always)]
unsafe fn take_sums(p: *mut f32) -> [f32; 4] {
    let v = ld_global_cg_f32x4(p);
    st_global_v4(p as *mut u8, [0; 4]);
    v
}

/// Four f32 as bf16 in one 8-byte word (element j in bits 16j..16j+16): the
/// values the QKV projection would have written.
#[inline(always)]
fn bf16x4(v: [f32; 4]) -> u64 {
    pack_bf16x2(v[0], v[1]) as u64 | (pack_bf16x2(v[2], v[3]) as u64) << 32
}

/// `v` + four bf16 (element j in bits 16j..16j+16), in f32.
#[inline(always)]
fn plus_bf16x4(v: [f32; 4], b: u64) -> [f32; 4] {
    let mut r = v;
    for (j, r) in r.iter_mut().enumerate() {
        *r += bf16_to_f32((b >> (16 * j)) as u16);
    }
    r
}

/// Four bf16 pairs added in f32 and rounded to bf16.
#[inline(always)]
fn add_bf16x4(x: u64, b: u64) -> u64 {
    let x = [0, 1, 2, 3].map(|j| bf16_to_f32((x >> (16 * j)) as u16));
    bf16x4(plus_bf16x4(x, b))
}
