//! Seeded normal bf16 fills (weights for tests and benchmarks, generated on the
//! GPU): element i is `mean + std · z(seed, i)` with `z` from
//! [`abi::random::pair`], which the CPU reference runs too, so a test can
//! recompute any element bit for bit.

use crate::gpu::bf16::pack_bf16x2;
use crate::gpu::mem::st_global_v4;
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, thread_idx_x};
use abi::random::{affine, pair, CHUNK, PER_CALL};
pub use abi::FillRandomArgs;

/// Philox blocks per chunk: one 16-byte store takes this many Box–Muller pairs.
const PAIRS: usize = CHUNK / PER_CALL;

/// Grid-strided over `CHUNK`-element chunks: each thread draws a chunk's
/// `PAIRS` Philox blocks (independent, so they overlap) and writes it with one
/// 16-byte store; the one partial chunk at the end is written element by element.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn fill_random_bf16(a: FillRandomArgs) {
    let n = a.n as usize;
    let chunks = a.n.div_ceil(CHUNK as u32);
    let out = a.out as *mut u16;
    let mut c = block_idx_x() * block_dim_x() + thread_idx_x();
    while c < chunks {
        let mut w = [0u32; PAIRS];
        for (j, word) in w.iter_mut().enumerate() {
            let z = pair(a.seed, c as u64 * PAIRS as u64 + j as u64, a.outlier_below);
            *word = pack_bf16x2(affine(z[0], a.mean, a.std), affine(z[1], a.mean, a.std));
        }
        let first = c as usize * CHUNK;
        if first + CHUNK <= n {
            st_global_v4(out.add(first) as *mut u8, w);
        } else {
            for e in 0..n - first {
                *out.add(first + e) = (w[e / 2] >> (16 * (e % 2))) as u16;
            }
        }
        c += grid_dim_x() * block_dim_x();
    }
}
crate::launch_bounds!(fill_random_bf16: FillRandomArgs, 256);
