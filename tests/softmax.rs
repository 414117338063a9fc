//! GPU tests of row softmax against the f64 CPU reference.

use host::ops::softmax::{plan, SoftmaxType};
use host::ops::{softmax, softmax_dyn, softmax_with, SoftmaxVersion};
use host::reference::softmax_rows;
use host::{bf16, DynTensor, Error, Gpu, Tensor};
use lab::testing::{cast, expect_close, quick, random_with_outliers, rel_l2_error, to_f64, tolerance, GpuTests};

/// Runs one case: seeded input with outliers, poisoned output, compare.
fn check<T: SoftmaxType>(
    gpu: &Gpu,
    rows: usize,
    cols: usize,
    version: SoftmaxVersion,
    seed: u64,
) -> Result<(), String> {
    let x32 = random_with_outliers(seed, rows * cols, 3.0);
    let x: Vec<T> = cast(&x32);
    check_values(gpu, &x, rows, cols, version)
}

fn check_values<T: SoftmaxType>(
    gpu: &Gpu,
    x: &[T],
    rows: usize,
    cols: usize,
    version: SoftmaxVersion,
) -> Result<(), String> {
    let shape = [rows, cols];
    let kernel = plan::<T>(&shape, &shape, version).map_err(|e| e.to_string())?.kernel;
    let xt = Tensor::from_host(gpu, x, &shape).map_err(|e| e.to_string())?;
    let mut yt = Tensor::filled(gpu, &shape, T::POISON).map_err(|e| e.to_string())?;
    softmax_with(gpu, &xt, &mut yt, version).map_err(|e| e.to_string())?;
    let y = to_f64(&yt.to_host(gpu).map_err(|e| e.to_string())?);
    let reference = softmax_rows(&to_f64(x), cols);
    let what = format!("{} {rows}x{cols} {version:?} ({kernel})", T::NAME);
    // Output dtype rounding sets the floor for bf16; f32 must be near-exact.
    expect_close(&what, rel_l2_error(&y, &reference), tolerance::<T>())
}

fn sizes() -> Vec<(usize, usize)> {
    let mut s = vec![
        (67, 1),
        (67, 3),
        (67, 31),
        (67, 33),
        (17, 4095),
        (17, 4096),
        (17, 4097),
        (5, 8192),
        (3, 32768),
        (2, 32769),
    ];
    if !quick() {
        s.extend([(2, 65536), (2, 262144), (2, 262145), (257, 1024), (4099, 64)]);
    }
    s
}

fn all_sizes<T: SoftmaxType>(gpu: &Gpu) -> Result<(), String> {
    for (i, &(rows, cols)) in sizes().iter().enumerate() {
        check::<T>(gpu, rows, cols, SoftmaxVersion::Auto, 100 + i as u64)?;
    }
    Ok(())
}

/// Every version on the shapes it accepts, so the benchmarked versions are correct too.
fn all_versions<T: SoftmaxType>(gpu: &Gpu) -> Result<(), String> {
    for &(rows, cols) in &[(37, 8), (37, 512), (9, 4096), (9, 4104), (3, 16384)] {
        for v in [SoftmaxVersion::V1, SoftmaxVersion::V2, SoftmaxVersion::Online] {
            if plan::<T>(&[rows, cols], &[rows, cols], v).is_ok() {
                check::<T>(gpu, rows, cols, v, 7)?;
            }
        }
    }
    Ok(())
}

/// Infinities and NaN: -inf rows give zeros, +inf share the mass, NaN stays in its row.
fn special_values<T: SoftmaxType>(gpu: &Gpu) -> Result<(), String> {
    for cols in [8usize, 33, 4096, 40000] {
        let mut x = random_with_outliers(3, 4 * cols, 2.0);
        x[..cols].fill(f32::NEG_INFINITY);
        x[cols + 3] = f32::INFINITY;
        x[cols + cols / 2] = f32::INFINITY;
        x[2 * cols + 1] = f32::NAN;
        x[3 * cols..3 * cols + cols / 2].fill(f32::NEG_INFINITY);
        for v in [SoftmaxVersion::Auto, SoftmaxVersion::Online] {
            check_values::<T>(gpu, &cast(&x), 4, cols, v)?;
        }
    }
    Ok(())
}

fn bad_input(gpu: &Gpu) -> Result<(), String> {
    let x = Tensor::<f32>::from_host(gpu, &[1.0; 12], &[3, 4]).map_err(|e| e.to_string())?;
    let mut wrong = Tensor::<f32>::filled(gpu, &[4, 3], f32::NAN).map_err(|e| e.to_string())?;
    match softmax(gpu, &x, &mut wrong) {
        Err(Error::Shape(_)) => {}
        other => return Err(format!("mismatched shape gave {other:?}")),
    }
    if !wrong.to_host(gpu).map_err(|e| e.to_string())?.iter().all(|v| v.is_nan()) {
        return Err("a rejected call wrote its output".into());
    }
    let empty = Tensor::<f32>::filled(gpu, &[0, 4], 0.5).map_err(|e| e.to_string())?;
    let mut empty_out = Tensor::<f32>::filled(gpu, &[0, 4], 0.5).map_err(|e| e.to_string())?;
    if !matches!(softmax(gpu, &empty, &mut empty_out), Err(Error::Empty(_))) {
        return Err("empty input not rejected".into());
    }
    let xb: DynTensor = Tensor::<bf16>::filled(gpu, &[3, 4], bf16::ONE).map_err(|e| e.to_string())?.into();
    let mut yf: DynTensor = Tensor::<f32>::filled(gpu, &[3, 4], f32::NAN).map_err(|e| e.to_string())?.into();
    if !matches!(softmax_dyn(gpu, &xb, &mut yf), Err(Error::DType(_))) {
        return Err("mismatched dtypes not rejected".into());
    }
    Ok(())
}

fn main() {
    let mut t = GpuTests::new("softmax");
    t.run("softmax_f32_odd_and_long_sizes", all_sizes::<f32>);
    t.run("softmax_bf16_odd_and_long_sizes", all_sizes::<bf16>);
    t.run("softmax_f32_every_version", all_versions::<f32>);
    t.run("softmax_bf16_every_version", all_versions::<bf16>);
    t.run("softmax_f32_infinities_and_nan", special_values::<f32>);
    t.run("softmax_bf16_infinities_and_nan", special_values::<bf16>);
    t.run("softmax_bad_input_fails_before_launch", bad_input);
    t.finish();
}
