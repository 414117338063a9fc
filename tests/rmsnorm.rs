//! GPU tests of RMSNorm (plain and fused residual add) against the f64 CPU reference.

use host::ops::rmsnorm::dev::{plan_tuned, rms_norm_tuned, RmsNormVersion};
use host::ops::rmsnorm::{plan, PREFERRED_THREADS};
use host::ops::{add_rms_norm, rms_norm};
use host::reference::rms_norm_rows;
use host::{bf16, DType, Error, Gpu, Tensor};
use lab::testing::ShapeRng as Rng;
use lab::testing::{cast, expect_close, quick, random_with_outliers, rel_l2_error, to_f64, GpuTests};

const EPS: f32 = 1e-5;
const TOL: f64 = 1e-2;

fn upload(gpu: &Gpu, v: &[bf16], shape: &[usize]) -> Result<Tensor<bf16>, String> {
    Tensor::from_host(gpu, v, shape).map_err(|e| e.to_string())
}

fn poisoned(gpu: &Gpu, shape: &[usize]) -> Result<Tensor<bf16>, String> {
    Tensor::filled(gpu, shape, bf16::POISON).map_err(|e| e.to_string())
}

fn check(
    gpu: &Gpu,
    rows: usize,
    cols: usize,
    fused: bool,
    version: RmsNormVersion,
    threads: u32,
    seed: u64,
) -> Result<(), String> {
    let shape = [rows, cols];
    let x: Vec<bf16> = cast(&random_with_outliers(seed, rows * cols, 1.0));
    let r: Vec<bf16> = cast(&random_with_outliers(seed + 1, rows * cols, 1.0));
    let w: Vec<bf16> = cast(&random_with_outliers(seed + 2, cols, 0.5));
    let (xt, rt, wt) = (upload(gpu, &x, &shape)?, upload(gpu, &r, &shape)?, upload(gpu, &w, &[cols])?);
    let mut yt = poisoned(gpu, &shape)?;
    let mut st = poisoned(gpu, &shape)?;
    let kernel =
        plan_tuned(&shape, &[cols], &shape, None, EPS, threads, version).map_err(|e| e.to_string())?.plan.kernel;
    if version != RmsNormVersion::V1 {
        let residual = fused.then_some((&rt, &mut st));
        rms_norm_tuned(gpu, &xt, residual, &wt, EPS, &mut yt, threads, version).map_err(|e| e.to_string())?;
    } else if fused {
        add_rms_norm(gpu, &xt, &rt, &wt, EPS, &mut st, &mut yt).map_err(|e| e.to_string())?;
    } else {
        rms_norm(gpu, &xt, &wt, EPS, &mut yt).map_err(|e| e.to_string())?;
    }
    let (x64, r64, w64) = (to_f64(&x), to_f64(&r), to_f64(&w));
    let (y_ref, s_ref) = rms_norm_rows(&x64, fused.then_some(&r64[..]), &w64, EPS as f64);
    let y = to_f64(&yt.to_host(gpu).map_err(|e| e.to_string())?);
    let what = format!("rmsnorm{} {rows}x{cols} ({kernel:?}/{threads})", if fused { "+add" } else { "" });
    expect_close(&what, rel_l2_error(&y, &y_ref), TOL)?;
    if fused {
        let s = to_f64(&st.to_host(gpu).map_err(|e| e.to_string())?);
        // s is x + r rounded to bf16 on both sides: it must match exactly.
        expect_close(&format!("{what} sum"), rel_l2_error(&s, &s_ref), 1e-7)?;
    }
    Ok(())
}

fn sizes() -> Vec<(usize, usize)> {
    let mut s =
        vec![(67, 1), (67, 3), (67, 31), (67, 33), (9, 4095), (9, 4096), (9, 4097), (3, 16384), (3, 16392), (2, 65536)];
    if !quick() {
        s.extend([(1031, 4096), (5, 262145), (1, 14336), (4099, 1032)]);
    }
    s
}

fn all_sizes(fused: bool, version: RmsNormVersion) -> impl FnOnce(&Gpu) -> Result<(), String> {
    move |gpu| {
        for (i, &(rows, cols)) in sizes().iter().enumerate() {
            check(gpu, rows, cols, fused, version, PREFERRED_THREADS, 40 + i as u64)?;
        }
        Ok(())
    }
}

/// V6 gives each warp a row: rows not a multiple of the block's warps, every
/// packs-per-lane entry and its edges, and the shapes that fall back to V1.
fn v6_sizes(threads: u32) -> Vec<(usize, usize)> {
    let mut s = Vec::new();
    for rows in [1, 3, 17] {
        for cols in [1, 3, 8, 31, 33, 256, 264, 1032, 2048, 4088, 4095, 4096, 4097, 4104] {
            s.push((rows, cols));
        }
    }
    s.extend([(67, 512), (67, 4096), (9, 16384)]);
    if !quick() {
        s.extend([(1031, 4096), (4099, 1032)]);
        if threads == 128 {
            // More row groups than row_grid's cap of blocks: the grid-stride loop.
            s.push(((4 << 20) + 5, 8));
        }
    }
    s
}

fn v6_all_sizes(fused: bool, threads: u32) -> impl FnOnce(&Gpu) -> Result<(), String> {
    move |gpu| {
        for (i, &(rows, cols)) in v6_sizes(threads).iter().enumerate() {
            check(gpu, rows, cols, fused, RmsNormVersion::V6, threads, 60 + i as u64)?;
        }
        Ok(())
    }
}

/// Elements per 16-byte pack.
const LANES: usize = 8;
/// Most elements of one random shape (the fixed shapes go past it).
const MAX_RANDOM_ELEMS: usize = 1 << 20;
/// Longest rows tested: the streaming kernel, a few rows of them.
const LONG_ROW: usize = 1 << 20;

/// Column counts on both sides of every place the shipped plan (plain or fused)
/// changes kernel: each packs-per-thread and block-size step, and the move to the
/// streaming kernel, for 16-byte rows and rows of single elements (found by
/// scanning the pure plan), and one element past each.
fn plan_edges(fused: bool) -> Vec<usize> {
    let kernel = |cols: usize| {
        let s = [1, cols];
        plan(&s, &[cols], &s, fused.then_some((&s[..], &s[..])), EPS).unwrap().kernel
    };
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
    scan(&mut (1..=3000).map(|n| n * LANES));
    scan(&mut (1..=5000).filter(|c| c % LANES != 0));
    edges
}

/// Seeded shapes for the shipped `rms_norm` / `add_rms_norm`: single rows and
/// columns, primes, both sides of every plan edge, rows 1..20k, rows of 2^20
/// (the streaming kernel) and more rows than the grid's cap; ~20 under `quick()`.
fn random_shapes(fused: bool, seed: u64) -> Vec<(usize, usize)> {
    let mut rng = Rng(seed);
    let edges = plan_edges(fused);
    let primes = [2, 3, 5, 7, 13, 31, 61, 127, 257, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071];
    let mut shapes =
        vec![(1, 1), (1, LONG_ROW), (3, LONG_ROW - 1), (2, LONG_ROW + LANES), ((1 << 20) + 3, 1), (20_000, 7)];
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

/// The shipped `rms_norm` (or `add_rms_norm`) on every random shape, one launch
/// each, against the f64 reference, from outputs poisoned with NaN; the fused
/// sum must match exactly.
fn random_shapes_match_reference(fused: bool) -> impl FnOnce(&Gpu) -> Result<(), String> {
    move |gpu| {
        let shapes = random_shapes(fused, 0x7a5 + fused as u64);
        for (i, &(rows, cols)) in shapes.iter().enumerate() {
            let shape = [rows, cols];
            let seed = 2000 + 3 * i as u64;
            let x: Vec<bf16> = cast(&random_with_outliers(seed, rows * cols, 1.0));
            let r: Vec<bf16> = cast(&random_with_outliers(seed + 1, rows * cols, 1.0));
            let w: Vec<bf16> = cast(&random_with_outliers(seed + 2, cols, 0.5));
            let (xt, wt) = (upload(gpu, &x, &shape)?, upload(gpu, &w, &[cols])?);
            let (mut yt, mut st) = (poisoned(gpu, &shape)?, poisoned(gpu, &shape)?);
            let residual = fused.then_some((&shape[..], &shape[..]));
            let kernel = plan(&shape, &[cols], &shape, residual, EPS).map_err(|e| e.to_string())?.kernel;
            let before = gpu.launch_count();
            if fused {
                let rt = upload(gpu, &r, &shape)?;
                add_rms_norm(gpu, &xt, &rt, &wt, EPS, &mut st, &mut yt).map_err(|e| e.to_string())?;
            } else {
                rms_norm(gpu, &xt, &wt, EPS, &mut yt).map_err(|e| e.to_string())?;
            }
            let launches = gpu.launch_count() - before;
            let what =
                format!("{} {rows}x{cols} ({kernel:?}, shape {i})", if fused { "add_rms_norm" } else { "rms_norm" });
            if launches != 1 {
                return Err(format!("{what}: {launches} launches"));
            }
            let (x64, r64, w64) = (to_f64(&x), to_f64(&r), to_f64(&w));
            let (y_ref, s_ref) = rms_norm_rows(&x64, fused.then_some(&r64[..]), &w64, EPS as f64);
            let y = to_f64(&yt.to_host(gpu).map_err(|e| e.to_string())?);
            expect_close(&what, rel_l2_error(&y, &y_ref), TOL)?;
            if fused {
                let s = to_f64(&st.to_host(gpu).map_err(|e| e.to_string())?);
                expect_close(&format!("{what} sum"), rel_l2_error(&s, &s_ref), 1e-7)?;
            }
        }
        Ok(())
    }
}

/// A refused call: its typed error, no launch, and its outputs untouched.
fn refused(
    gpu: &Gpu,
    what: &str,
    outputs: &[&Tensor<bf16>],
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
    for y in outputs {
        if !y.to_host(gpu).map_err(|e| e.to_string())?.iter().all(|v| v.is_nan()) {
            return Err(format!("{what}: wrote an output"));
        }
    }
    Ok(())
}

fn bad_input(gpu: &Gpu) -> Result<(), String> {
    let shape = |e: &Error| matches!(e, Error::Shape(_));
    let invalid = |e: &Error| matches!(e, Error::InvalidArgument(_));
    let launches = gpu.launch_count();
    let x = poisoned(gpu, &[4, 64])?;
    let mut y = poisoned(gpu, &[4, 64])?;
    let w63 = poisoned(gpu, &[63])?;
    let r = rms_norm(gpu, &x, &w63, EPS, &mut y);
    refused(gpu, "wrong weight length", &[&y], r, shape, launches)?;
    let w2d = poisoned(gpu, &[1, 64])?;
    let r = rms_norm(gpu, &x, &w2d, EPS, &mut y);
    refused(gpu, "two-dimensional weight", &[&y], r, shape, launches)?;
    let w = poisoned(gpu, &[64])?;
    let mut y_wide = poisoned(gpu, &[2, 128])?;
    let r = rms_norm(gpu, &x, &w, EPS, &mut y_wide);
    refused(gpu, "reshaped output", &[&y_wide], r, shape, launches)?;
    for eps in [f32::INFINITY, f32::NAN, -1e-5] {
        let r = rms_norm(gpu, &x, &w, eps, &mut y);
        refused(gpu, &format!("eps {eps}"), &[&y], r, invalid, launches)?;
    }
    let empty = poisoned(gpu, &[0, 64])?;
    let mut empty_y = poisoned(gpu, &[0, 64])?;
    let r = rms_norm(gpu, &empty, &w, EPS, &mut empty_y);
    refused(gpu, "empty input", &[], r, |e| matches!(e, Error::Empty(_)), launches)?;
    let mut s = poisoned(gpu, &[4, 64])?;
    let r_narrow = poisoned(gpu, &[4, 32])?;
    let r = add_rms_norm(gpu, &x, &r_narrow, &w, EPS, &mut s, &mut y);
    refused(gpu, "mismatched residual", &[&s, &y], r, shape, launches)?;
    let residual = poisoned(gpu, &[4, 64])?;
    let mut s_tall = poisoned(gpu, &[5, 64])?;
    let r = add_rms_norm(gpu, &x, &residual, &w, EPS, &mut s_tall, &mut y);
    refused(gpu, "mismatched sum output", &[&s_tall, &y], r, shape, launches)?;
    let r = add_rms_norm(gpu, &x, &residual, &w63, EPS, &mut s, &mut y);
    refused(gpu, "fused, wrong weight length", &[&s, &y], r, shape, launches)?;
    let r = add_rms_norm(gpu, &x, &residual, &w, f32::NAN, &mut s, &mut y);
    refused(gpu, "fused, NaN eps", &[&s, &y], r, invalid, launches)?;
    let r = rms_norm_tuned(gpu, &x, None, &w63, EPS, &mut y, PREFERRED_THREADS, RmsNormVersion::V6);
    refused(gpu, "v6, wrong weight length", &[&y], r, shape, launches)?;
    Ok(())
}

/// The read-only memory-ceiling kernel (`stream_sum`, measured beside the norms):
/// its sum against the f64 sum of the same positive bf16 values, odd lengths, and
/// bad input refused.
fn stream_sum_matches_cpu(gpu: &Gpu) -> Result<(), String> {
    use host::ops::stream::stream_sum;
    for (i, n) in [8usize, 8 * 1001, (1 << 20) + 8 * 37].into_iter().enumerate() {
        let x: Vec<bf16> =
            cast(&random_with_outliers(300 + i as u64, n, 1.0).iter().map(|v| v.abs()).collect::<Vec<_>>());
        let want: f64 = x.iter().map(|v| v.to_f64()).sum();
        let xt = upload(gpu, &x, &[n])?;
        let mut out = Tensor::<f32>::filled(gpu, &[1], 0.0).map_err(|e| e.to_string())?;
        stream_sum(gpu, &xt, &mut out).map_err(|e| e.to_string())?;
        let got = out.to_host(gpu).map_err(|e| e.to_string())?[0] as f64;
        expect_close(&format!("stream_sum n{n}"), ((got - want) / want).abs(), 1e-5)?;
    }
    let launches = gpu.launch_count();
    let odd = upload(gpu, &[bf16::ONE; 12], &[12])?;
    let mut out = Tensor::<f32>::filled(gpu, &[1], 0.0).map_err(|e| e.to_string())?;
    if !matches!(stream_sum(gpu, &odd, &mut out), Err(Error::Alignment(_))) {
        return Err("stream_sum accepted 12 elements (not whole 16-byte vectors)".into());
    }
    let x = upload(gpu, &[bf16::ONE; 16], &[16])?;
    let mut two = Tensor::<f32>::filled(gpu, &[2], 0.0).map_err(|e| e.to_string())?;
    if !matches!(stream_sum(gpu, &x, &mut two), Err(Error::Shape(_))) {
        return Err("stream_sum accepted a two-element output".into());
    }
    let empty = Tensor::<bf16>::filled(gpu, &[0, 8], bf16::ONE).map_err(|e| e.to_string())?;
    if !matches!(stream_sum(gpu, &empty, &mut out), Err(Error::Empty(_))) {
        return Err("stream_sum accepted an empty input".into());
    }
    if gpu.launch_count() != launches {
        return Err("a refused stream_sum launched a kernel".into());
    }
    Ok(())
}

/// The shape lists hold what they promise (checked without a GPU too).
fn check_shape_lists() {
    for fused in [false, true] {
        let (edges, shapes) = (plan_edges(fused), random_shapes(fused, 1));
        assert!(quick() || shapes.len() >= 200, "{} shapes", shapes.len());
        assert!(edges.len() >= 18, "plan edges {edges:?}");
        assert!(quick() || edges.iter().all(|c| shapes.iter().any(|s| s.1 == *c)));
        assert!(quick() || shapes.iter().any(|s| s.1 > LONG_ROW));
        assert!(shapes.iter().all(|&(r, c)| r >= 1 && c >= 1 && r * c <= 3 * LONG_ROW + 64));
    }
}

fn main() {
    check_shape_lists();
    let mut t = GpuTests::new("rmsnorm");
    t.run("rms_norm_random_shapes", random_shapes_match_reference(false));
    t.run("add_rms_norm_random_shapes", random_shapes_match_reference(true));
    t.run("rmsnorm_plain_odd_sizes", all_sizes(false, RmsNormVersion::V1));
    t.run("rmsnorm_fused_residual_odd_sizes", all_sizes(true, RmsNormVersion::V1));
    t.run("rmsnorm_v2_plain_odd_sizes", all_sizes(false, RmsNormVersion::V2));
    t.run("rmsnorm_v2_fused_residual_odd_sizes", all_sizes(true, RmsNormVersion::V2));
    t.run("rmsnorm_v3_plain_odd_sizes", all_sizes(false, RmsNormVersion::V3));
    t.run("rmsnorm_v3_fused_residual_odd_sizes", all_sizes(true, RmsNormVersion::V3));
    t.run("rmsnorm_v4_plain_odd_sizes", all_sizes(false, RmsNormVersion::V4));
    t.run("rmsnorm_v4_fused_residual_odd_sizes", all_sizes(true, RmsNormVersion::V4));
    t.run("rmsnorm_v5_plain_odd_sizes", all_sizes(false, RmsNormVersion::V5));
    t.run("rmsnorm_v5_fused_residual_odd_sizes", all_sizes(true, RmsNormVersion::V5));
    for threads in [128, 256] {
        t.run(&format!("rmsnorm_v6_plain_odd_sizes_{threads}"), v6_all_sizes(false, threads));
        t.run(&format!("rmsnorm_v6_fused_residual_odd_sizes_{threads}"), v6_all_sizes(true, threads));
    }
    t.run("rmsnorm_bad_input_fails_before_launch", bad_input);
    t.run("stream_sum_matches_cpu", stream_sum_matches_cpu);
    t.finish();
}
