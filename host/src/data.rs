//! Seeded inputs with outliers and element-type conversions: what the seeded
//! weights, the examples and the tests generate their data with.

use crate::tensor::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// `n` values: roughly normal with standard deviation `scale`, plus about 0.5%
/// outliers of up to ±20·scale, from a fixed seed. Never all zeros.
pub fn random_with_outliers(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            // Sum of uniforms: cheap, bell-shaped, unit variance.
            let g: f32 = (0..4).map(|_| rng.gen::<f32>()).sum::<f32>() - 2.0;
            let v = g * 1.732 * scale;
            if rng.gen::<f32>() < 0.005 {
                v.signum() * scale * rng.gen_range(5.0..20.0)
            } else {
                v
            }
        })
        .collect()
}

/// Converts to the element type (rounding for bf16).
pub fn cast<T: DType>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x as f64)).collect()
}

pub fn to_f64<T: DType>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}
