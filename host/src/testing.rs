//! Shared by the GPU tests, examples and benches: seeded inputs with outliers,
//! error metrics, and a small harness that reports GPU tests as skipped (not
//! passed) on machines without a GPU.

use crate::error::Error;
use crate::runtime::Gpu;
use crate::tensor::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::panic::AssertUnwindSafe;

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

/// ‖out − ref‖₂ / ‖ref‖₂. NaN where the reference has none counts as infinite
/// error; NaN where the reference has NaN is a match.
pub fn rel_l2_error(out: &[f64], reference: &[f64]) -> f64 {
    assert_eq!(out.len(), reference.len());
    let (mut num, mut den) = (0.0, 0.0);
    for (&o, &r) in out.iter().zip(reference) {
        if r.is_nan() {
            if !o.is_nan() {
                return f64::INFINITY;
            }
            continue;
        }
        if !o.is_finite() {
            return f64::INFINITY;
        }
        num += (o - r) * (o - r);
        den += r * r;
    }
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

/// Tolerance by dtype: f32 1e-5, bf16 1e-2 (relative L2).
pub fn tolerance<T: DType>() -> f64 {
    if T::BYTES == 4 {
        1e-5
    } else {
        1e-2
    }
}

/// Fails with a readable message when `err` is over `tol` (NaN never passes).
pub fn expect_close(what: &str, err: f64, tol: f64) -> Result<(), String> {
    if err <= tol {
        Ok(())
    } else {
        Err(format!("{what}: relative error {err:.3e} > {tol:.0e}"))
    }
}

/// Whether the sanitizer-sized (quick) shape set was asked for.
pub fn quick() -> bool {
    std::env::var_os("GPU_TEST_QUICK").is_some()
}

/// A minimal harness for GPU test binaries (`harness = false`). Every test runs on
/// the one `Gpu`; without a GPU each is reported as skipped. The closing line has
/// the form `N passed, N failed, N skipped`.
pub struct GpuTests {
    suite: &'static str,
    gpu: Option<Gpu>,
    filters: Vec<String>,
    passed: usize,
    failed: usize,
    skipped: usize,
}

impl GpuTests {
    pub fn new(suite: &'static str) -> GpuTests {
        let filters = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
        let gpu = match Gpu::new() {
            Ok(gpu) => {
                let i = gpu.info();
                println!(
                    "{suite}: running on {} (sm_{}{}, {} SMs, {} PTX)",
                    i.name,
                    i.compute_capability.0,
                    i.compute_capability.1,
                    i.sm_count,
                    i.arch.name()
                );
                Some(gpu)
            }
            Err(Error::NoDevice) => {
                println!("{suite}: no GPU on this machine: GPU tests are SKIPPED, not passed");
                None
            }
            Err(e) => {
                println!("{suite}: GPU unusable ({e}): GPU tests are SKIPPED, not passed");
                None
            }
        };
        GpuTests { suite, gpu, filters, passed: 0, failed: 0, skipped: 0 }
    }

    pub fn gpu(&self) -> Option<&Gpu> {
        self.gpu.as_ref()
    }

    pub fn run(&mut self, name: &str, test: impl FnOnce(&Gpu) -> Result<(), String>) {
        if !self.filters.is_empty() && !self.filters.iter().any(|f| name.contains(f.as_str())) {
            return;
        }
        let Some(gpu) = &self.gpu else {
            println!("test {name} ... skipped (no GPU)");
            self.skipped += 1;
            return;
        };
        let start = std::time::Instant::now();
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| test(gpu)));
        let secs = start.elapsed().as_secs_f64();
        match outcome {
            Ok(Ok(())) => {
                println!("test {name} ... ok ({secs:.2} s)");
                self.passed += 1;
            }
            Ok(Err(msg)) => {
                println!("test {name} ... FAILED: {msg}");
                self.failed += 1;
            }
            Err(_) => {
                println!("test {name} ... FAILED (panicked)");
                self.failed += 1;
            }
        }
    }

    /// Prints the summary and exits non-zero if any test failed.
    pub fn finish(self) -> ! {
        println!();
        println!("{}: {} passed, {} failed, {} skipped", self.suite, self.passed, self.failed, self.skipped);
        std::process::exit(if self.failed > 0 { 1 } else { 0 });
    }
}

/// Median GPU time of `f` in milliseconds over `reps` runs after `warmup` runs,
/// each timed by CUDA events.
pub fn median_ms(
    gpu: &Gpu,
    warmup: usize,
    reps: usize,
    mut f: impl FnMut(usize) -> crate::Result<()>,
) -> crate::Result<f64> {
    for i in 0..warmup {
        f(i)?;
    }
    gpu.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for i in 0..reps {
        times.push(gpu.time_ms(|| f(warmup + i))? as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
