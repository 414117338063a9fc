//! v2: a persistent block works through rows `block, block + grid, …`. While row r
//! is reduced and written from registers, `cp.async` already streams row r + grid
//! into shared memory, so the SM's loads never stop during the reductions.
//!
//! Each thread stages exactly the packs it will later read, so no barrier is needed
//! around the staging buffer: `cp.async.wait_group` alone makes them visible.

use crate::softmax::{softmax_row_resident, RowPointers, RowScratch, SoftmaxArgs, SoftmaxPack};
use crate::gpu::mem::{cp_async_16, cp_async_commit, cp_async_wait};
use crate::gpu::pack::Pack16;
use crate::gpu::shared::{dynamic_shared_base, ld_shared_v4};
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, thread_idx_x};

#[inline(always)]
pub unsafe fn kernel<P: SoftmaxPack + Pack16, const VPT: usize>(a: SoftmaxArgs) {
    let t = thread_idx_x() as usize;
    let nthreads = block_dim_x() as usize;
    let npacks = a.cols as usize / P::LANES;
    let scratch = RowScratch::new();
    let stage = dynamic_shared_base();
    let slot = |j: usize| stage + ((j * nthreads + t) * 16) as u32;
    let valid = |j: usize| j * nthreads + t < npacks;
    let prefetch = |row: u32| {
        if row < a.rows {
            let x = a.x_row::<P>(row);
            for j in 0..VPT {
                if valid(j) {
                    cp_async_16(slot(j), x.add((j * nthreads + t) * 16));
                }
            }
        }
        cp_async_commit();
    };

    let mut row = block_idx_x();
    prefetch(row);
    while row < a.rows {
        cp_async_wait::<0>();
        let mut v: [P; VPT] = core::mem::MaybeUninit::uninit().assume_init();
        for (j, p) in v.iter_mut().enumerate() {
            if valid(j) {
                *p = P::from_raw(ld_shared_v4(slot(j)));
            }
        }
        let next = row + grid_dim_x();
        prefetch(next);
        let y = a.y_row::<P>(row);
        softmax_row_resident(&mut v, valid, scratch, (nthreads as u32).div_ceil(32), |j, p| {
            p.store(y.add((j * nthreads + t) * 16))
        });
        row = next;
    }
}
