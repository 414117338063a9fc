//! The GPU test harness: tolerances by dtype, and a runner that reports GPU
//! tests as skipped (not passed) on machines without a GPU. The data and error
//! helpers of `host` are re-exported so a test imports from one place.

pub use host::data::{cast, random_with_outliers, to_f64};
pub use host::metrics::{median_ms, rel_l2_error};
use host::{DType, Error, Gpu};
use std::panic::AssertUnwindSafe;

pub mod checkpoint;

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
                    "{suite}: running on {} (sm_{}{}, {} SMs, {} {})",
                    i.name,
                    i.compute_capability.0,
                    i.compute_capability.1,
                    i.sm_count,
                    i.arch.name(),
                    i.image.name()
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

/// SplitMix64: a seeded stream for the random-shape tests, independent of the
/// data generator (`random_with_outliers`).
pub struct ShapeRng(pub u64);

impl ShapeRng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())]
    }

    /// Uniform in [0, 1), from 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// In `1..=max`, each power-of-two octave equally likely, then uniform in it.
    pub fn log_uniform(&mut self, max: usize) -> usize {
        let bits = (self.next_u64() % (max.ilog2() as u64 + 1)) as u32;
        let lo = 1usize << bits;
        (lo + (self.next_u64() as usize) % lo).min(max)
    }
}
