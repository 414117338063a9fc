//! GPU tests of row softmax against the f64 CPU reference.

use host::ops::softmax::dev::{plan_with, SoftmaxDevType};
use host::ops::softmax::{plan, SoftmaxType};
use host::ops::{softmax, softmax_dyn, softmax_with, SoftmaxVersion};
use host::reference::softmax_rows;
use host::{bf16, DType, DynTensor, Error, Gpu, Tensor};
use lab::testing::ShapeRng as Rng;
use lab::testing::{cast, expect_close, quick, random_with_outliers, rel_l2_error, to_f64, tolerance, GpuTests};

/// Runs one case: seeded input with outliers, poisoned output, compare.
fn check<T: SoftmaxDevType>(
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

fn check_values<T: SoftmaxDevType>(
    gpu: &Gpu,
    x: &[T],
    rows: usize,
    cols: usize,
    version: SoftmaxVersion,
) -> Result<(), String> {
    let shape = [rows, cols];
    let kernel = plan_with::<T>(&shape, &shape, version).map_err(|e| e.to_string())?.plan.kernel;
    let xt = Tensor::from_host(gpu, x, &shape).map_err(|e| e.to_string())?;
    let mut yt = Tensor::filled(gpu, &shape, T::POISON).map_err(|e| e.to_string())?;
    softmax_with(gpu, &xt, &mut yt, version).map_err(|e| e.to_string())?;
    let y = to_f64(&yt.to_host(gpu).map_err(|e| e.to_string())?);
    let reference = softmax_rows(&to_f64(x), cols);
    let what = format!("{} {rows}x{cols} {version:?} ({kernel:?})", T::NAME);
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

fn all_sizes<T: SoftmaxDevType>(gpu: &Gpu) -> Result<(), String> {
    for (i, &(rows, cols)) in sizes().iter().enumerate() {
        check::<T>(gpu, rows, cols, SoftmaxVersion::Auto, 100 + i as u64)?;
    }
    Ok(())
}

/// Every version on the shapes it accepts, so the benchmarked versions are correct too.
fn all_versions<T: SoftmaxDevType>(gpu: &Gpu) -> Result<(), String> {
    for &(rows, cols) in &[(37, 8), (37, 512), (9, 4096), (9, 4104), (3, 16384)] {
        for v in [SoftmaxVersion::V1, SoftmaxVersion::V2, SoftmaxVersion::Online] {
            if plan_with::<T>(&[rows, cols], &[rows, cols], v).is_ok() {
                check::<T>(gpu, rows, cols, v, 7)?;
            }
        }
    }
    Ok(())
}

/// Infinities and NaN: -inf rows give zeros, +inf share the mass, NaN stays in its row.
fn special_values<T: SoftmaxDevType>(gpu: &Gpu) -> Result<(), String> {
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

/// Column counts on both sides of every place the shipped plan changes kernel:
/// each packs-per-thread and block-size step, and the move to the online kernel,
/// for 16-byte rows and for rows of single elements (found by scanning the pure
/// plan), and one element past each (a row that is no longer whole packs).
fn plan_edges<T: SoftmaxType>() -> Vec<usize> {
    let kernel = |cols: usize| plan::<T>(&[1, cols], &[1, cols]).unwrap().kernel;
    let mut edges = Vec::new();
    let mut scan = |cols: &mut dyn Iterator<Item = usize>| {
        let mut prev = None;
        for c in cols {
            if prev.is_some_and(|p| kernel(p) != kernel(c)) {
                edges.extend([prev.unwrap(), c, c + 1]);
            }
            prev = Some(c);
        }
    };
    scan(&mut (1..=12_000).map(|n| n * T::LANES));
    scan(&mut (1..=20_000).filter(|c| c % T::LANES != 0));
    edges
}

/// Most elements of one random shape (the fixed shapes go past it).
const MAX_RANDOM_ELEMS: usize = 1 << 20;
/// Longest rows tested: the online kernel, a few rows of them.
const LONG_ROW: usize = 1 << 20;

/// Seeded shapes for the shipped `softmax`: single rows and columns, primes, both
/// sides of every plan edge, rows 1..20k, rows of 2^20 (the online kernel) and
/// more rows than the grid's cap; ~20 of them under `quick()`.
fn random_shapes<T: SoftmaxType>(seed: u64) -> Vec<(usize, usize)> {
    let mut rng = Rng(seed);
    let edges = plan_edges::<T>();
    let primes = [2, 3, 5, 7, 13, 31, 61, 127, 257, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071];
    let mut shapes =
        vec![(1, 1), (1, LONG_ROW), (3, LONG_ROW - 1), (2, LONG_ROW + T::LANES), ((1 << 20) + 3, 1), (20_000, 7)];
    for &cols in &edges {
        shapes.push((rng.log_uniform(64), cols));
    }
    while shapes.len() < 240 {
        let cols = match rng.next_u64() % 3 {
            0 => rng.pick(&primes),
            1 => rng.pick(&edges),
            _ => rng.log_uniform(1 << 17),
        };
        shapes.push((rng.log_uniform(20_000).min((MAX_RANDOM_ELEMS / cols).max(1)), cols));
    }
    if quick() {
        let step = shapes.len() / 20;
        shapes = shapes.into_iter().step_by(step).collect();
    }
    shapes
}

/// The shipped `softmax` on every random shape, one launch each, against the f64
/// reference, from an output poisoned with NaN.
fn random_shapes_match_reference<T: SoftmaxType>(gpu: &Gpu) -> Result<(), String> {
    let shapes = random_shapes::<T>(0x50f7 + T::BYTES as u64);
    if !quick() && shapes.len() < 200 {
        return Err(format!("only {} shapes", shapes.len()));
    }
    for (i, &(rows, cols)) in shapes.iter().enumerate() {
        let shape = [rows, cols];
        let x: Vec<T> = cast(&random_with_outliers(1000 + i as u64, rows * cols, 3.0));
        let xt = Tensor::from_host(gpu, &x, &shape).map_err(|e| e.to_string())?;
        let mut yt = Tensor::filled(gpu, &shape, T::POISON).map_err(|e| e.to_string())?;
        let before = gpu.launch_count();
        softmax(gpu, &xt, &mut yt).map_err(|e| e.to_string())?;
        let launches = gpu.launch_count() - before;
        let kernel = plan::<T>(&shape, &shape).map_err(|e| e.to_string())?.kernel;
        let what = format!("softmax {} {rows}x{cols} ({kernel:?}, shape {i})", T::NAME);
        if launches != 1 {
            return Err(format!("{what}: {launches} launches"));
        }
        let y = to_f64(&yt.to_host(gpu).map_err(|e| e.to_string())?);
        expect_close(&what, rel_l2_error(&y, &softmax_rows(&to_f64(&x), cols)), tolerance::<T>())?;
    }
    Ok(())
}

/// Every refused call returns its typed error, launches nothing and leaves its
/// output as it was.
fn bad_input(gpu: &Gpu) -> Result<(), String> {
    fn refused<T: DType>(
        gpu: &Gpu,
        what: &str,
        y: &Tensor<T>,
        got: host::Result<()>,
        want: fn(&Error) -> bool,
        launches: u64,
    ) -> Result<(), String> {
        match got {
            Err(e) if want(&e) => {}
            other => return Err(format!("{what}: got {other:?}")),
        }
        if gpu.launch_count() != launches {
            return Err(format!("{what}: launched a kernel"));
        }
        if !y.to_host(gpu).map_err(|e| e.to_string())?.iter().all(|v| v.is_nan()) {
            return Err(format!("{what}: wrote its output"));
        }
        Ok(())
    }
    let launches = gpu.launch_count();
    let x = Tensor::<f32>::from_host(gpu, &[1.0; 12], &[3, 4]).map_err(|e| e.to_string())?;
    let mut wrong = Tensor::<f32>::filled(gpu, &[4, 3], f32::NAN).map_err(|e| e.to_string())?;
    let r = softmax(gpu, &x, &mut wrong);
    refused(gpu, "transposed output", &wrong, r, |e| matches!(e, Error::Shape(_)), launches)?;
    let mut short = Tensor::<f32>::filled(gpu, &[3, 3], f32::NAN).map_err(|e| e.to_string())?;
    let r = softmax(gpu, &x, &mut short);
    refused(gpu, "smaller output", &short, r, |e| matches!(e, Error::Shape(_)), launches)?;
    let mut flat = Tensor::<f32>::filled(gpu, &[12], f32::NAN).map_err(|e| e.to_string())?;
    let r = softmax(gpu, &x, &mut flat);
    refused(gpu, "flattened output", &flat, r, |e| matches!(e, Error::Shape(_)), launches)?;
    let xb = Tensor::<bf16>::filled(gpu, &[2, 0, 5], bf16::ONE).map_err(|e| e.to_string())?;
    let mut yb = Tensor::<bf16>::filled(gpu, &[2, 0, 5], bf16::NAN).map_err(|e| e.to_string())?;
    let r = softmax(gpu, &xb, &mut yb);
    refused(gpu, "empty input", &yb, r, |e| matches!(e, Error::Empty(_)), launches)?;
    let xb: DynTensor = Tensor::<bf16>::filled(gpu, &[3, 4], bf16::ONE).map_err(|e| e.to_string())?.into();
    let mut yf: DynTensor = Tensor::<f32>::filled(gpu, &[3, 4], f32::NAN).map_err(|e| e.to_string())?.into();
    let r = softmax_dyn(gpu, &xb, &mut yf);
    let DynTensor::F32(y) = &yf else { unreachable!() };
    refused(gpu, "mismatched dtypes", y, r, |e| matches!(e, Error::DType(_)), launches)?;
    // The dev versions refuse what they cannot run, before launching too.
    let mut y6 = Tensor::<f32>::filled(gpu, &[1, 6], f32::NAN).map_err(|e| e.to_string())?;
    let x6 = Tensor::<f32>::filled(gpu, &[1, 6], 0.5).map_err(|e| e.to_string())?;
    let r = softmax_with(gpu, &x6, &mut y6, SoftmaxVersion::V2);
    refused(gpu, "v2 on a partial pack", &y6, r, |e| matches!(e, Error::Alignment(_)), launches)?;
    Ok(())
}

/// The shape lists hold what they promise (checked without a GPU too).
fn check_shape_lists() {
    for (edges, shapes) in
        [(plan_edges::<f32>(), random_shapes::<f32>(1)), (plan_edges::<bf16>(), random_shapes::<bf16>(2))]
    {
        assert!(quick() || shapes.len() >= 200, "{} shapes", shapes.len());
        assert!(edges.len() >= 24, "plan edges {edges:?}");
        assert!(quick() || edges.iter().all(|c| shapes.iter().any(|s| s.1 == *c)));
        assert!(quick() || shapes.iter().any(|s| s.1 > LONG_ROW));
        assert!(shapes.iter().all(|&(r, c)| r >= 1 && c >= 1 && r * c <= 3 * LONG_ROW + 64));
    }
}

fn main() {
    check_shape_lists();
    let mut t = GpuTests::new("softmax");
    t.run("softmax_f32_random_shapes", random_shapes_match_reference::<f32>);
    t.run("softmax_bf16_random_shapes", random_shapes_match_reference::<bf16>);
    t.run("softmax_f32_odd_and_long_sizes", all_sizes::<f32>);
    t.run("softmax_bf16_odd_and_long_sizes", all_sizes::<bf16>);
    t.run("softmax_f32_every_version", all_versions::<f32>);
    t.run("softmax_bf16_every_version", all_versions::<bf16>);
    t.run("softmax_f32_infinities_and_nan", special_values::<f32>);
    t.run("softmax_bf16_infinities_and_nan", special_values::<bf16>);
    t.run("softmax_bad_input_fails_before_launch", bad_input);
    t.finish();
}
