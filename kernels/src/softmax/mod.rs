//! Row softmax: y = exp(x - max) / Σ exp(x - max), f32 math for f32 or bf16 rows.
//!
//! The shipped kernels, the two that `softmax` (Auto) launches:
//! - `v1`: one row per block, the row held in registers, loaded directly.
//! - `online`: rows too long for one block's registers; one pass keeps a running
//!   max and sum, a second pass writes.
//!
//! `dev` (feature `dev`) keeps the versions measured against them.
//!
//! Edge cases: a row that is all -inf gives zeros (nothing to attend to); +inf
//! entries share the mass equally; NaN anywhere in a row makes that row NaN.

mod online;
mod v1;

use crate::gpu::bf16::{pack_bf16x2, pack_f16x2, unpack_bf16x2, unpack_f16x2};
use crate::gpu::math::{ex2, fma, fmax_nan, rcp_exact, LOG2_E};
use crate::gpu::pack::{Bf16x1, Bf16x8, F32x1, F32x4, Pack};
use crate::gpu::shared::SharedArray;
use crate::gpu::warp::block_reduce;

/// exp(x - m) where m is finite.
#[inline(always)]
fn exp_rel(x: f32, m: f32) -> f32 {
    ex2((x - m) * LOG2_E)
}

/// exp(x - m) for any m: equal infinities give 1 (their limit), not NaN.
#[inline(always)]
fn exp_rel_guarded(x: f32, m: f32) -> f32 {
    if x == m {
        1.0
    } else {
        exp_rel(x, m)
    }
}

/// How a pack takes part in softmax. The default recomputes exp at output time; f32
/// packs keep exp(x - m_thread) in place of x, which saves the second ex2.
pub trait SoftmaxPack: Pack {
    /// Σ exp(x - m) over the pack, for the thread's own max `m` (never -inf here).
    #[inline(always)]
    fn sum_exp(&mut self, m: f32) -> f32 {
        let mut s = 0.0;
        for l in 0..Self::LANES {
            s += if m == f32::INFINITY { exp_rel_guarded(self.get(l), m) } else { exp_rel(self.get(l), m) };
        }
        s
    }

    /// The output pack: exp(x - m_row) * inv, where `scale` = exp(m_thread - m_row) * inv
    /// serves packs that kept their exponentials.
    #[inline(always)]
    fn finish(self, m_row: f32, inv: f32, _scale: f32) -> Self {
        finish_fresh(self, m_row, inv)
    }
}

/// exp(x - m_row) * inv from the original values, for a finite or +inf `m_row`.
#[inline(always)]
pub fn finish_fresh<P: Pack>(p: P, m_row: f32, inv: f32) -> P {
    if m_row == f32::INFINITY {
        P::from_fn(|l| exp_rel_guarded(p.get(l), m_row) * inv)
    } else {
        P::from_fn(|l| exp_rel(p.get(l), m_row) * inv)
    }
}

impl SoftmaxPack for F32x4 {
    #[inline(always)]
    fn sum_exp(&mut self, m: f32) -> f32 {
        let e = if m == f32::INFINITY {
            F32x4::from_fn(|l| exp_rel_guarded(self.get(l), m))
        } else {
            F32x4::from_fn(|l| exp_rel(self.get(l), m))
        };
        *self = e;
        (e.get(0) + e.get(1)) + (e.get(2) + e.get(3))
    }

    #[inline(always)]
    fn finish(self, _m_row: f32, _inv: f32, scale: f32) -> Self {
        F32x4::from_fn(|l| self.get(l) * scale)
    }
}

impl SoftmaxPack for Bf16x8 {
    // Keeps 2^15·exp(x − m) in place as packed f16: one ex2 per element instead
    // of two, in the same registers. The 2^15 lifts values down to 2^-39 above
    // f16's underflow; every thread uses it, so it cancels in the row sum. bf16
    // inputs also allow x·log2e − m·log2e as one FMA (error ≪ bf16's 2^-9).
    #[inline(always)]
    fn sum_exp(&mut self, m: f32) -> f32 {
        const LIFT: f32 = 15.0;
        let guarded = m == f32::INFINITY;
        let ml = m * LOG2_E - LIFT;
        let mut s = 0.0;
        for w in self.0.iter_mut() {
            let (lo, hi) = unpack_bf16x2(*w);
            let (e_lo, e_hi) = if guarded {
                (exp_rel_guarded(lo, m) * 32768.0, exp_rel_guarded(hi, m) * 32768.0)
            } else {
                (ex2(fma(lo, LOG2_E, -ml)), ex2(fma(hi, LOG2_E, -ml)))
            };
            s += e_lo + e_hi;
            *w = pack_f16x2(e_lo, e_hi);
        }
        s
    }

    #[inline(always)]
    fn finish(self, _m_row: f32, _inv: f32, scale: f32) -> Self {
        let mut out = [0u32; 4];
        for (o, &w) in out.iter_mut().zip(self.0.iter()) {
            let (lo, hi) = unpack_f16x2(w);
            *o = pack_bf16x2(lo * scale, hi * scale);
        }
        Bf16x8(out)
    }
}

impl SoftmaxPack for F32x1 {}
impl SoftmaxPack for Bf16x1 {}

/// Scratch for the two block reductions of a row (max, then sum); two arrays so one
/// barrier per reduction suffices (see `block_reduce`).
#[derive(Clone, Copy)]
pub struct RowScratch {
    max: SharedArray<f32, 32>,
    sum: SharedArray<f32, 32>,
}

impl RowScratch {
    #[inline(always)]
    pub fn new() -> Self {
        RowScratch {
            max: crate::shared_array!(softmax_max_scratch: [f32; 32]),
            sum: crate::shared_array!(softmax_sum_scratch: [f32; 32]),
        }
    }
}

/// Softmax of one row held as `VPT` packs per thread; `valid(j)` says whether pack j
/// of this thread lies inside the row. Calls `store(j, pack)` for each valid pack.
#[inline(always)]
pub fn softmax_row_resident<P: SoftmaxPack, const VPT: usize>(
    v: &mut [P; VPT],
    valid: impl Fn(usize) -> bool,
    scratch: RowScratch,
    num_warps: u32,
    mut store: impl FnMut(usize, P),
) {
    // NaN-propagating: a thread holding a NaN gets m = NaN, which poisons the
    // row sum, so the whole row comes out NaN.
    let mut m_thread = f32::NEG_INFINITY;
    for (j, p) in v.iter().enumerate() {
        if valid(j) {
            m_thread = fmax_nan(m_thread, p.max());
        }
    }
    let mut s_thread = 0.0;
    if m_thread != f32::NEG_INFINITY {
        for (j, p) in v.iter_mut().enumerate() {
            if valid(j) {
                s_thread += p.sum_exp(m_thread);
            }
        }
    }
    let m_row = block_reduce(m_thread, f32::NEG_INFINITY, fmax_nan, scratch.max, num_warps);
    // Rescale this thread's sum from its own max to the row max.
    let corr = if m_thread == m_row {
        1.0
    } else if m_thread == f32::NEG_INFINITY {
        0.0
    } else {
        exp_rel(m_thread, m_row)
    };
    let s_row = block_reduce(s_thread * corr, 0.0, |a, b| a + b, scratch.sum, num_warps);
    let inv = if m_row == f32::NEG_INFINITY { 0.0 } else { rcp_exact(s_row) };
    let scale = corr * inv;
    for (j, p) in v.iter().enumerate() {
        if valid(j) {
            // A thread whose values are all -inf never formed exponentials
            // (f32 packs still hold x); their outputs are exactly 0.
            if m_row == f32::NEG_INFINITY || m_thread == f32::NEG_INFINITY {
                store(j, P::from_fn(|_| 0.0));
            } else {
                store(j, p.finish(m_row, inv, scale));
            }
        }
    }
}

pub use abi::SoftmaxArgs;

/// Row addresses from the parameter block.
trait RowPointers {
    fn x_row<P: Pack>(&self, row: u32) -> *const u8;
    fn y_row<P: Pack>(&self, row: u32) -> *mut u8;
}

impl RowPointers for SoftmaxArgs {
    #[inline(always)]
    fn x_row<P: Pack>(&self, row: u32) -> *const u8 {
        (self.x as usize + row as usize * self.x_row_stride as usize * P::ELEM_BYTES) as *const u8
    }
    #[inline(always)]
    fn y_row<P: Pack>(&self, row: u32) -> *mut u8 {
        (self.y as usize + row as usize * self.y_row_stride as usize * P::ELEM_BYTES) as *mut u8
    }
}

/// The number after `@` is the entry's launch bound (most threads per block); the
/// host reads it from the entry's typed handle. `_rN`: N packs per thread, the
/// `vpt` of the host's table row for that handle.
macro_rules! entries {
    ($($name:ident => $version:ident::<$pack:ty, $vpt:literal> @ $threads:literal;)*) => {$(
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(args: SoftmaxArgs) {
            $version::kernel::<$pack, $vpt>(args)
        }
        crate::launch_bounds!($name: SoftmaxArgs, $threads);
    )*};
}

entries! {
    softmax_v1_f32x4_r1 => v1::<F32x4, 1> @ 1024;
    softmax_v1_f32x4_r2 => v1::<F32x4, 2> @ 1024;
    softmax_v1_f32x4_r4 => v1::<F32x4, 4> @ 1024;
    softmax_v1_f32x4_r8 => v1::<F32x4, 8> @ 1024;
    softmax_v1_bf16x8_r1 => v1::<Bf16x8, 1> @ 1024;
    softmax_v1_bf16x8_r2 => v1::<Bf16x8, 2> @ 1024;
    softmax_v1_bf16x8_r4 => v1::<Bf16x8, 4> @ 1024;
    softmax_v1_bf16x8_r8 => v1::<Bf16x8, 8> @ 512;
    softmax_v1_f32x1_r1 => v1::<F32x1, 1> @ 1024;
    softmax_v1_f32x1_r2 => v1::<F32x1, 2> @ 1024;
    softmax_v1_f32x1_r4 => v1::<F32x1, 4> @ 1024;
    softmax_v1_f32x1_r8 => v1::<F32x1, 8> @ 1024;
    softmax_v1_bf16x1_r1 => v1::<Bf16x1, 1> @ 1024;
    softmax_v1_bf16x1_r2 => v1::<Bf16x1, 2> @ 1024;
    softmax_v1_bf16x1_r4 => v1::<Bf16x1, 4> @ 1024;
    softmax_v1_bf16x1_r8 => v1::<Bf16x1, 8> @ 1024;
    softmax_online_f32x4 => online::<F32x4, 4> @ 1024;
    softmax_online_bf16x8 => online::<Bf16x8, 4> @ 1024;
    softmax_online_f32x1 => online::<F32x1, 8> @ 1024;
    softmax_online_bf16x1 => online::<Bf16x1, 8> @ 1024;
}

#[cfg(feature = "dev")]
pub mod dev;
