//! v1: one row per block (grid-strided), the row in registers, loaded directly.

use super::{softmax_row_resident, RowPointers, RowScratch, SoftmaxArgs, SoftmaxPack};
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, thread_idx_x};

#[inline(always)]
pub unsafe fn kernel<P: SoftmaxPack, const VPT: usize>(a: SoftmaxArgs) {
    let t = thread_idx_x() as usize;
    let nthreads = block_dim_x() as usize;
    let npacks = a.cols as usize / P::LANES;
    let scratch = RowScratch::new();
    let pack_bytes = P::LANES * P::ELEM_BYTES;
    let mut row = block_idx_x();
    while row < a.rows {
        let x = a.x_row::<P>(row);
        let y = a.y_row::<P>(row);
        let valid = |j: usize| j * nthreads + t < npacks;
        let mut v: [P; VPT] = core::mem::MaybeUninit::uninit().assume_init();
        for (j, p) in v.iter_mut().enumerate() {
            if valid(j) {
                *p = P::load(x.add((j * nthreads + t) * pack_bytes));
            }
        }
        softmax_row_resident(&mut v, valid, scratch, (nthreads as u32).div_ceil(32), |j, p| {
            p.store(y.add((j * nthreads + t) * pack_bytes))
        });
        row += grid_dim_x();
    }
}
