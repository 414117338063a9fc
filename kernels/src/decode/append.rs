//! The K/V append of a decode step, for callers whose new K and V are already
//! on the GPU outside the fused RoPE kernel (`PagedKvCache::append`).

use crate::gpu::mem::{ld_global_v4, st_global_v4};
use crate::gpu::thread::{block_dim_x, block_idx_x, thread_idx_x};
use abi::KvAppendArgs;

/// Writes one new token's K and V per sequence into its page, at position
/// seq_lens[b] − 1 (the host has already grown the sequence). One block per
/// sequence; each thread moves 16 bytes of K and of V.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn kv_append(a: KvAppendArgs) {
    let b = block_idx_x() as usize;
    let row_bytes = (a.n_kv_heads * a.head_dim * 2) as usize;
    let pos = *(a.seq_lens as *const u32).add(b) as usize - 1;
    let page = *(a.page_table as *const u32).add(b * a.max_pages as usize + pos / a.page_size as usize) as usize;
    let dst_off = (page * a.page_size as usize + pos % a.page_size as usize) * row_bytes;
    let mut i = thread_idx_x() as usize * 16;
    while i < row_bytes {
        let k = ld_global_v4((a.k_new as *const u8).add(b * row_bytes + i));
        let v = ld_global_v4((a.v_new as *const u8).add(b * row_bytes + i));
        st_global_v4((a.k_pool as *mut u8).add(dst_off + i), k);
        st_global_v4((a.v_pool as *mut u8).add(dst_off + i), v);
        i += block_dim_x() as usize * 16;
    }
}
crate::launch_bounds!(kv_append: KvAppendArgs, 256);
