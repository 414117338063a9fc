//! Seeded normal bf16 fills on the GPU (`fill_random_bf16`), fast enough to
//! make a whole model's weights: element i is `mean + std · z(seed, i)`, with
//! `z` a standard normal from Philox-4x32-10 and Box–Muller
//! ([`abi::random`]). The CPU computes the same bits with [`normal_bf16`]
//! (the same f32 operations, built for the host), so a test can recompute any
//! element of any tensor without downloading or generating the rest.
//!
//! [`fill_random_with_outliers`] also multiplies z by [`OUTLIER_SCALE`] for
//! about one element in 1024 ([`OUTLIER_BELOW`]), like
//! [`random_with_outliers`](crate::data::random_with_outliers)'s heavy tail.

use crate::error::{Error, Result};
use crate::kernels::FILL_RANDOM_BF16;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
pub use abi::random::{normal_bf16 as normal_bf16_bits, CHUNK, OUTLIER_BELOW, OUTLIER_SCALE};
use abi::FillRandomArgs;
use half::bf16;

/// Blocks per SM: 2048 threads resident, grid-strided over the tensor.
const BLOCKS_PER_SM: u32 = 8;

/// The most elements one fill takes (the kernel's u32 element count).
pub const MAX_ELEMENTS: usize = u32::MAX as usize;

/// A validated launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FillPlan {
    pub n: u32,
    /// [`CHUNK`]-element chunks, one per thread per grid step.
    pub chunks: u32,
    pub threads: u32,
}

/// Checks a fill of a tensor of shape `shape` and sizes it. Pure: no GPU.
pub fn plan(shape: &[usize], mean: f32, std: f32) -> Result<FillPlan> {
    let n = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let Some(n) = n else { return Err(Error::TooLarge(format!("fill_random: shape {shape:?} overflows usize"))) };
    if n == 0 {
        return Err(Error::Empty(format!("fill_random: shape {shape:?} has no elements")));
    }
    if n > MAX_ELEMENTS {
        return Err(Error::TooLarge(format!("fill_random: {n} elements; at most {MAX_ELEMENTS} per call")));
    }
    if !mean.is_finite() || !std.is_finite() {
        return Err(Error::InvalidArgument(format!("fill_random: mean {mean} and std {std} must be finite")));
    }
    let chunks = n.div_ceil(CHUNK) as u32;
    Ok(FillPlan { n: n as u32, chunks, threads: FILL_RANDOM_BF16.max_threads() })
}

/// Fills `out` with `mean + std · z`, z standard normal, seeded by `seed` and
/// each element's index (so the values do not depend on the launch geometry).
pub fn fill_random(gpu: &Gpu, out: &mut Tensor<bf16>, seed: u64, mean: f32, std: f32) -> Result<()> {
    fill(gpu, out, seed, mean, std, 0)
}

/// [`fill_random`] where about one element in 1024 has its z multiplied by
/// [`OUTLIER_SCALE`]: the variance is std² · (1 + 63/1024).
pub fn fill_random_with_outliers(gpu: &Gpu, out: &mut Tensor<bf16>, seed: u64, mean: f32, std: f32) -> Result<()> {
    fill(gpu, out, seed, mean, std, OUTLIER_BELOW)
}

/// Element `index` of [`fill_random`] (or, with `outliers`,
/// [`fill_random_with_outliers`]) with these arguments: the CPU reference.
pub fn normal_bf16(seed: u64, index: u64, mean: f32, std: f32, outliers: bool) -> bf16 {
    bf16::from_bits(normal_bf16_bits(seed, index, mean, std, if outliers { OUTLIER_BELOW } else { 0 }))
}

fn fill(gpu: &Gpu, out: &mut Tensor<bf16>, seed: u64, mean: f32, std: f32, outlier_below: u32) -> Result<()> {
    let p = plan(out.shape(), mean, std)?;
    if !out.device_ptr().is_multiple_of(16) {
        return Err(Error::Alignment(format!("fill_random: output at {:#x} is not 16-byte aligned", out.device_ptr())));
    }
    let args = FillRandomArgs {
        out: out.device_ptr(),
        n: p.n,
        outlier_below,
        seed: [seed as u32, (seed >> 32) as u32],
        mean,
        std,
    };
    let blocks = p.chunks.div_ceil(p.threads).min(gpu.info().sm_count.max(1) * BLOCKS_PER_SM);
    // SAFETY: out holds n bf16 from a 16-byte aligned address; the kernel writes
    // whole 16-byte chunks below n and single elements in the last partial one.
    unsafe { gpu.launch(FILL_RANDOM_BF16, (blocks, 1, 1), p.threads, 0, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use abi::random::{bf16_bits, box_muller, ln_unit, pair, sin_cos_turns, sqrt};

    #[test]
    fn plans_cover_every_element() {
        assert_eq!(plan(&[1], 0.0, 1.0).unwrap(), FillPlan { n: 1, chunks: 1, threads: 256 });
        assert_eq!(plan(&[3, 3], 0.0, 1.0).unwrap().chunks, 2);
        assert_eq!(plan(&[128256, 4096], 0.0, 0.02).unwrap().chunks, 128256 * 512);
        assert_eq!(plan(&[MAX_ELEMENTS], 0.0, 1.0).unwrap().chunks, (MAX_ELEMENTS as u32).div_ceil(8));
        assert!(matches!(plan(&[MAX_ELEMENTS + 1], 0.0, 1.0), Err(Error::TooLarge(_))));
        assert!(matches!(plan(&[usize::MAX, 2], 0.0, 1.0), Err(Error::TooLarge(_))));
        assert!(matches!(plan(&[4, 0], 0.0, 1.0), Err(Error::Empty(_))));
        assert!(matches!(plan(&[4], f32::NAN, 1.0), Err(Error::InvalidArgument(_))));
        assert!(matches!(plan(&[4], 0.0, f32::INFINITY), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn pieces_match_the_library_functions() {
        // ln over the whole range, and close to 1 (no cancellation).
        for m in (1u32..1 << 24).step_by(997).chain([1, 2, 3, (1 << 23) + 1, (1 << 24) - 3, (1 << 24) - 1]) {
            let want = (m as f64 / 16_777_216.0).ln();
            let got = ln_unit(m) as f64;
            assert!((got - want).abs() <= 4e-7 * want.abs().max(1e-6) + 1e-12, "ln({m}/2^24): {got} vs {want}");
        }
        for x in [1.2e-7f32, 1e-3, 0.5, 1.0, 2.0, 3.99, 17.0, 33.3] {
            let want = (x as f64).sqrt();
            assert!(((sqrt(x) as f64) - want).abs() <= 3e-7 * want, "sqrt({x})");
        }
        for t in (0u32..1 << 24).step_by(4093).chain([0, 1 << 21, (1 << 21) - 1, 1 << 22, (1 << 24) - 1]) {
            let a = t as f64 / 16_777_216.0 * std::f64::consts::TAU;
            let (s, c) = sin_cos_turns(t);
            assert!((s as f64 - a.sin()).abs() < 2e-7 && (c as f64 - a.cos()).abs() < 2e-7, "sincos at {t}");
        }
    }

    #[test]
    fn box_muller_stays_finite_at_the_edges() {
        for w0 in [0u32, 511, 512, u32::MAX - 511, u32::MAX] {
            for w1 in [0u32, 1 << 30, u32::MAX] {
                let (a, b) = box_muller(w0, w1);
                assert!(a.is_finite() && b.is_finite() && a.abs() < 5.8 && b.abs() < 5.8, "{w0} {w1}: {a} {b}");
            }
        }
        // The largest radius: u = 2^-24.
        let (a, _) = box_muller(0, 0);
        assert!((a as f64 - (2.0 * 24.0 * std::f64::consts::LN_2).sqrt()).abs() < 1e-5);
    }

    #[test]
    fn rounds_to_nearest_even() {
        for x in [0.0f32, -0.0, 1.0, -2.5, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, 3e38, -3.4e38, 1e-40, 0.1] {
            assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "{x}");
        }
        assert!(bf16::from_bits(bf16_bits(f32::NAN)).is_nan());
    }

    #[test]
    fn draws_are_standard_normal() {
        let n = 200_000u64;
        let (mut sum, mut sq, mut within1, mut outliers) = (0.0f64, 0.0f64, 0usize, 0usize);
        for j in 0..n / 2 {
            for z in pair([7, 0], j, 0) {
                sum += z as f64;
                sq += (z as f64).powi(2);
                within1 += (z.abs() < 1.0) as usize;
            }
            let [a, b] = pair([7, 0], j, OUTLIER_BELOW);
            let [c, d] = pair([7, 0], j, 0);
            outliers += (a != c) as usize + (b != d) as usize;
            assert!(a == c || a == c * OUTLIER_SCALE);
        }
        let (mean, var) = (sum / n as f64, sq / n as f64 - (sum / n as f64).powi(2));
        // 5 standard errors: of the mean 1/√n, of the variance √(2/n), of P(|z| < 1) √(p(1−p)/n).
        assert!(mean.abs() < 5.0 / (n as f64).sqrt(), "mean {mean}");
        assert!((var - 1.0).abs() < 5.0 * (2.0 / n as f64).sqrt(), "variance {var}");
        let p1 = within1 as f64 / n as f64;
        assert!((p1 - 0.682_689).abs() < 5.0 * (0.2166 / n as f64).sqrt(), "P(|z| < 1) = {p1}");
        let expected = n as f64 / 1024.0;
        assert!((outliers as f64 - expected).abs() < 5.0 * expected.sqrt(), "{outliers} outliers of {n}");
    }

    #[test]
    fn reference_depends_on_seed_and_index_only() {
        let v = |seed, i| normal_bf16(seed, i, 0.5, 2.0, false).to_bits();
        assert_eq!(v(1, 10), v(1, 10));
        let a: Vec<u16> = (0..64).map(|i| v(1, i)).collect();
        let b: Vec<u16> = (0..64).map(|i| v(2, i)).collect();
        let c: Vec<u16> = (0..64).map(|i| v(1 << 32, i)).collect();
        assert!(a.iter().zip(&b).filter(|(x, y)| x == y).count() < 8);
        assert!(a.iter().zip(&c).filter(|(x, y)| x == y).count() < 8);
        // mean + std·z, rounded once.
        let z = pair([1, 0], 5, 0)[1];
        assert_eq!(v(1, 11), bf16::from_f32(0.5 + 2.0 * z).to_bits());
        // Indices past 2^32 reach the counter's high word.
        assert_ne!(v(1, 1 << 33), v(1, 0));
    }
}
