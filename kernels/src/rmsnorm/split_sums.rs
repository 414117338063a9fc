//! `rmsnorm_split_sums`: the decode step's O-projection finish and the MLP's
//! RMSNorm in one launch.

use super::RmsNormArgs;
use crate::gpu::math::rsqrt;
use crate::gpu::pack::{Bf16x8, Pack};
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, thread_idx_x};
use crate::gpu::warp::block_reduce;

/// Packs (8 columns each) per thread of [`rmsnorm_split_sums`].
const SUMS_VPT: usize = abi::rmsnorm::SPLIT_SUMS_PACKS;

/// The decode step's O projection finished and the MLP's RMSNorm in one launch:
/// s = residual + (split-K sums of the projection, `x` as [rows, cols] f32, read
/// and zeroed as `gemm_finalize` would), rounded to bf16 once, goes to `sum_out`;
/// y = RMSNorm(s)·w. One block per row, all of a thread's loads issued before its
/// first use. Launched to overlap the split GEMM: it waits for it first.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn rmsnorm_split_sums(a: RmsNormArgs) {
    use crate::gpu::mem::{ld_global_cg_f32x4, st_global_v4};
    use crate::gpu::thread::{launch_dependents, wait_for_prior_grids};
    launch_dependents();
    wait_for_prior_grids();
    let (t, nthreads) = (thread_idx_x() as usize, block_dim_x() as usize);
    let cols = a.cols as usize;
    let npacks = cols / Bf16x8::LANES;
    let valid = |j: usize| j * nthreads + t < npacks;
    let col = |j: usize| (j * nthreads + t) * Bf16x8::LANES;
    let (scratch_a, scratch_b) =
        (crate::shared_array!(rmsnorm_sums_a: [f32; 32]), crate::shared_array!(rmsnorm_sums_b: [f32; 32]));
    let mut use_b = false;
    let mut row = block_idx_x();
    while row < a.rows {
        let sums = (a.x as *mut f32).add(row as usize * cols);
        let in_off = row as usize * a.in_row_stride as usize * 2;
        let (r, s_out) = ((a.residual as *const u8).add(in_off), (a.sum_out as *mut u8).add(in_off));
        // Every load (sums, residual, weights) is issued before the first store:
        // a store between them could alias a later load, which would then wait
        // behind it, a round trip a pack.
        let mut sums_v = [([0.0f32; 4], [0.0f32; 4]); SUMS_VPT];
        let mut rp = [Bf16x8([0; 4]); SUMS_VPT];
        let mut w = [Bf16x8([0; 4]); SUMS_VPT];
        for j in 0..SUMS_VPT {
            if valid(j) {
                let at = sums.add(col(j));
                sums_v[j] = (ld_global_cg_f32x4(at), ld_global_cg_f32x4(at.add(4)));
                rp[j] = Bf16x8::load(r.add(col(j) * 2));
                w[j] = Bf16x8::load((a.weight as *const u8).add(col(j) * 2));
            }
        }
        let mut v = [Bf16x8([0; 4]); SUMS_VPT];
        for (j, p) in v.iter_mut().enumerate() {
            if valid(j) {
                let at = sums.add(col(j));
                st_global_v4(at as *mut u8, [0; 4]);
                st_global_v4(at.add(4) as *mut u8, [0; 4]);
                let (lo, hi) = sums_v[j];
                *p = Bf16x8::from_fn(|l| (if l < 4 { lo[l] } else { hi[l - 4] }) + rp[j].get(l));
                p.store(s_out.add(col(j) * 2));
            }
        }
        let mut ss = 0.0f32;
        for (j, p) in v.iter().enumerate() {
            if valid(j) {
                for l in 0..Bf16x8::LANES {
                    ss += p.get(l) * p.get(l);
                }
            }
        }
        // Alternate scratch arrays between rows: one barrier per reduction suffices.
        ss = block_reduce(ss, 0.0, |a, b| a + b, if use_b { scratch_b } else { scratch_a }, (nthreads as u32).div_ceil(32));
        use_b = !use_b;
        let inv_rms = rsqrt(ss / cols as f32 + a.eps);
        let y = (a.y as *mut u8).add(row as usize * a.y_row_stride as usize * 2);
        for (j, p) in v.iter().enumerate() {
            if valid(j) {
                Bf16x8::from_fn(|l| p.get(l) * inv_rms * w[j].get(l)).store(y.add(col(j) * 2));
            }
        }
        row += grid_dim_x();
    }
}
crate::launch_bounds!(rmsnorm_split_sums: RmsNormArgs, 512);
