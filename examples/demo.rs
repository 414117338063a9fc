//! The project's main job for now: softmax and RMSNorm on the GPU, checked against
//! the CPU reference, with their bandwidth. Without a GPU it says so and runs the
//! CPU reference alone.

use clap::Parser;
use host::data::{cast, random_with_outliers, to_f64};
use host::metrics::{median_ms, rel_l2_error};
use host::ops::{add_rms_norm, softmax};
use host::reference::{rms_norm_rows, softmax_rows};
use host::{bf16, DType, Error, Gpu, Tensor};
use std::process::ExitCode;

const COPY_TBPS: f64 = 4.2; // H200 device-to-device copy, measured

/// Softmax (f32, 32768×4096) and fused add + RMSNorm (bf16, 16384×4096) on the GPU,
/// checked against the CPU reference, with their bandwidth. Without a GPU, the CPU
/// reference alone on a small input.
#[derive(Parser)]
#[command(name = "demo")]
struct Cli {}

fn main() -> ExitCode {
    Cli::parse();
    let result = match Gpu::new() {
        Ok(gpu) => on_gpu(&gpu),
        Err(Error::NoDevice) => {
            println!("No NVIDIA GPU/driver on this machine: running the CPU reference only.");
            cpu_only();
            Ok(())
        }
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn cpu_only() {
    let x: Vec<f64> = random_with_outliers(1, 4 * 8, 2.0).iter().map(|&v| v as f64).collect();
    let y = softmax_rows(&x, 8);
    println!("softmax, first row of 4x8: {:?}", &y[..8].iter().map(|v| format!("{v:.4}")).collect::<Vec<_>>());
    let w = vec![1.0; 8];
    let (n, _) = rms_norm_rows(&x, None, &w, 1e-5);
    println!("rmsnorm, first row of 4x8: {:?}", &n[..8].iter().map(|v| format!("{v:.4}")).collect::<Vec<_>>());
}

fn report(name: &str, err: f64, tol: f64, ms: f64, bytes: usize) {
    let tbps = bytes as f64 / ms / 1e9;
    let verdict = if err <= tol { "ok" } else { "MISMATCH" };
    println!(
        "{name:34} error {err:.1e} ({verdict})  {ms:7.4} ms  {tbps:5.2} TB/s  {:4.0}% of copy",
        100.0 * tbps / COPY_TBPS
    );
}

fn on_gpu(gpu: &Gpu) -> Result<(), Box<dyn std::error::Error>> {
    let i = gpu.info();
    println!(
        "{} (compute {}.{}, {} SMs), running {} PTX built from Rust",
        i.name,
        i.compute_capability.0,
        i.compute_capability.1,
        i.sm_count,
        i.arch.name()
    );

    let (rows, cols) = (32768, 4096);
    let x32 = random_with_outliers(7, rows * cols, 3.0);
    let reference = softmax_rows(&x32.iter().map(|&v| v as f64).collect::<Vec<_>>(), cols);
    let x = Tensor::<f32>::from_host(gpu, &x32, &[rows, cols])?;
    let mut y = Tensor::<f32>::filled(gpu, &[rows, cols], f32::POISON)?;
    let ms = median_ms(gpu, 3, 20, |_| softmax(gpu, &x, &mut y))?;
    let err = rel_l2_error(&to_f64(&y.to_host(gpu)?), &reference);
    report("softmax f32 32768x4096", err, 1e-5, ms, 2 * rows * cols * 4);

    let (rows, cols) = (16384, 4096);
    let xv: Vec<bf16> = cast(&random_with_outliers(8, rows * cols, 1.0));
    let rv: Vec<bf16> = cast(&random_with_outliers(9, rows * cols, 1.0));
    let wv: Vec<bf16> = cast(&random_with_outliers(10, cols, 0.5));
    let (x, r, w) = (
        Tensor::from_host(gpu, &xv, &[rows, cols])?,
        Tensor::from_host(gpu, &rv, &[rows, cols])?,
        Tensor::from_host(gpu, &wv, &[cols])?,
    );
    let mut s = Tensor::<bf16>::filled(gpu, &[rows, cols], bf16::POISON)?;
    let mut y = Tensor::<bf16>::filled(gpu, &[rows, cols], bf16::POISON)?;
    let ms = median_ms(gpu, 3, 20, |_| add_rms_norm(gpu, &x, &r, &w, 1e-5, &mut s, &mut y))?;
    let (y_ref, _) = rms_norm_rows(&to_f64(&xv), Some(&to_f64(&rv)), &to_f64(&wv), 1e-5);
    let err = rel_l2_error(&to_f64(&y.to_host(gpu)?), &y_ref);
    report("add+rmsnorm bf16 16384x4096", err, 1e-2, ms, 4 * rows * cols * 2);
    Ok(())
}
