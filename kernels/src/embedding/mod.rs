//! Embedding lookup: `out[i, :] = table[ids[i], :]`, one block per output row,
//! 16-byte vectors. An id past the table writes a row of zeros instead of
//! reading out of bounds: ids may come from a device-side sampler (inside a CUDA
//! graph) that the host never sees.

use crate::gpu::mem::{ld_global_nc_v4, st_global_v4, Vec4};
use crate::gpu::thread::{
    block_dim_x, block_idx_x, grid_dim_x, launch_dependents, thread_idx_x, wait_for_prior_grids,
};
pub use abi::EmbeddingArgs;

/// Vectors one thread loads before it stores any: the loads of a pass go out
/// together instead of one round trip each.
const UNROLL: usize = 4;
/// bf16 elements per 16-byte vector.
const LANES: usize = 8;

/// Grid-strided over rows (the host caps the grid); each thread copies vectors
/// `thread, thread + block, …` of its row.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn embedding_gather(a: EmbeddingArgs) {
    launch_dependents();
    // The ids may be the previous kernel's output (the sampler's tokens).
    wait_for_prior_grids();
    let vecs = a.d as usize / LANES;
    let step = block_dim_x() as usize;
    let mut row = block_idx_x();
    while row < a.n {
        let id = *(a.ids as *const u32).add(row as usize);
        let dst = (a.out as *mut u8).add(row as usize * vecs * 16);
        // Wrapping: for an id past the table this address is never read.
        let src = (a.table as *const u8).wrapping_add(id as usize * vecs * 16);
        let inside = id < a.vocab;
        let mut v = thread_idx_x() as usize;
        while v < vecs {
            let mut buf: [Vec4; UNROLL] = [[0; 4]; UNROLL];
            for (j, b) in buf.iter_mut().enumerate() {
                let i = v + j * step;
                if inside && i < vecs {
                    *b = ld_global_nc_v4(src.add(i * 16));
                }
            }
            for (j, b) in buf.iter().enumerate() {
                let i = v + j * step;
                if i < vecs {
                    st_global_v4(dst.add(i * 16), *b);
                }
            }
            v += UNROLL * step;
        }
        row += grid_dim_x();
    }
}
crate::launch_bounds!(embedding_gather: EmbeddingArgs, 256);
