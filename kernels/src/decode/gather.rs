//! Rows of a paged cache's K and V copied into contiguous tensors: the keys a
//! prefill chunk attends to when its sequence already holds earlier chunks.

use crate::gpu::mem::{ld_global_v4, st_global_v4};
use crate::gpu::thread::{block_dim_x, block_idx_x, thread_idx_x};
use abi::KvGatherArgs;

/// Each thread moves one 16-byte unit of K and the same unit of V: unit u is
/// unit `u % row_units` of row `u / row_units`, so every thread has work
/// whatever the row width. The host keeps `rows · row_units` within u32.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn kv_gather(a: KvGatherArgs) {
    let u = block_idx_x() * block_dim_x() + thread_idx_x();
    if u >= a.rows * a.row_units {
        return;
    }
    let (r, c) = ((u / a.row_units) as usize, (u % a.row_units) as usize);
    let units = a.row_units as usize;
    let seq = *(a.token_seq as *const u32).add(r) as usize;
    let pos = *(a.token_pos as *const u32).add(r) as usize;
    let page_size = a.page_size as usize;
    let page = *(a.page_table as *const u32).add(seq * a.max_pages as usize + pos / page_size) as usize;
    let src = ((page * page_size + pos % page_size) * units + c) * 16;
    let dst = (r * units + c) * 16;
    let k = ld_global_v4((a.k_pool as *const u8).add(src));
    let v = ld_global_v4((a.v_pool as *const u8).add(src));
    st_global_v4((a.k_out as *mut u8).add(dst), k);
    st_global_v4((a.v_out as *mut u8).add(dst), v);
}
crate::launch_bounds!(kv_gather: KvGatherArgs, 128);
