//! RoPE and the KV-cache write for the fused layer: one block per token reads
//! that token's q, k, v from the QKV projection's output, rotates q and k
//! (rotate-half convention, as Llama in Hugging Face), and writes q for the
//! attention kernel and k, v into the token's page of the cache (and, for
//! prefill, into contiguous k, v for FlashAttention).
//!
//! cos and sin come from a table the host fills in f64: angles pos·θ^(−i/half)
//! reach 10⁵ radians, where f32 range reduction would lose the phase.

use crate::gpu::bf16::{bf16_to_f32, f32_to_bf16};
use crate::gpu::thread::{block_dim_x, block_idx_x, launch_dependents, thread_idx_x, wait_for_prior_grids};
pub use abi::RopeKvArgs;

#[no_mangle]
pub unsafe extern "ptx-kernel" fn rope_qkv_cache(a: RopeKvArgs) {
    // Launched to overlap the QKV GEMM: its launch latency hides under the GEMM's
    // tail, and nothing is read before the GEMM has finished.
    launch_dependents();
    wait_for_prior_grids();
    let t = block_idx_x() as usize;
    let (h, kv, hd) = (a.n_heads as usize, a.n_kv_heads as usize, a.head_dim as usize);
    let half = hd / 2;
    let pos = *(a.token_pos as *const u32).add(t) as usize;
    let seq = *(a.token_seq as *const u32).add(t) as usize;
    let page_size = a.page_size as usize;
    let page = *(a.page_table as *const u32).add(seq * a.max_pages as usize + pos / page_size) as usize;
    // Element offset of this token's row (all KV heads) in either pool.
    let cache_row = (page * page_size + pos % page_size) * kv * hd;
    let src = (a.qkv as *const u16).add(t * (h + 2 * kv) * hd);
    let (cos, sin) = ((a.cos as *const f32).add(pos * half), (a.sin as *const f32).add(pos * half));
    let (q_out, k_out, v_out) = (a.q_out as *mut u16, a.k_out as *mut u16, a.v_out as *mut u16);
    let (k_pool, v_pool) = (a.k_pool as *mut u16, a.v_pool as *mut u16);

    // One thread per rotated pair (i, i + half) of a q or k head.
    let mut p = thread_idx_x() as usize;
    while p < (h + kv) * half {
        let (head, i) = (p / half, p % half);
        let (x0, x1) = (bf16_to_f32(*src.add(head * hd + i)), bf16_to_f32(*src.add(head * hd + i + half)));
        let (c, s) = (*cos.add(i), *sin.add(i));
        let (y0, y1) = (f32_to_bf16(x0 * c - x1 * s), f32_to_bf16(x0 * s + x1 * c));
        if head < h {
            let o = (t * h + head) * hd + i;
            *q_out.add(o) = y0;
            *q_out.add(o + half) = y1;
        } else {
            let kh = head - h;
            let o = cache_row + kh * hd + i;
            *k_pool.add(o) = y0;
            *k_pool.add(o + half) = y1;
            if !k_out.is_null() {
                let o = (t * kv + kh) * hd + i;
                *k_out.add(o) = y0;
                *k_out.add(o + half) = y1;
            }
        }
        p += block_dim_x() as usize;
    }
    let v_src = src.add((h + kv) * hd);
    let mut e = thread_idx_x() as usize;
    while e < kv * hd {
        let v = *v_src.add(e);
        *v_pool.add(cache_row + e) = v;
        if !v_out.is_null() {
            *v_out.add(t * kv * hd + e) = v;
        }
        e += block_dim_x() as usize;
    }
}
crate::launch_bounds!(rope_qkv_cache, 256);
