//! GPU tests of RMSNorm (plain and fused residual add) against the f64 CPU reference.

use host::ops::rmsnorm::{plan_tuned, rms_norm_tuned, RmsNormVersion, PREFERRED_THREADS};
use host::ops::{add_rms_norm, rms_norm};
use host::reference::rms_norm_rows;
use host::{bf16, DType, Error, Gpu, Tensor};
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
    let kernel = plan_tuned(&shape, &[cols], &shape, None, EPS, threads, version).map_err(|e| e.to_string())?.kernel;
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
    let what = format!("rmsnorm{} {rows}x{cols} ({kernel}/{threads})", if fused { "+add" } else { "" });
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

fn bad_input(gpu: &Gpu) -> Result<(), String> {
    let x = poisoned(gpu, &[4, 64])?;
    let w = poisoned(gpu, &[63])?;
    let mut y = poisoned(gpu, &[4, 64])?;
    if !matches!(rms_norm(gpu, &x, &w, EPS, &mut y), Err(Error::Shape(_))) {
        return Err("wrong weight length not rejected".into());
    }
    let w = poisoned(gpu, &[64])?;
    if !matches!(rms_norm(gpu, &x, &w, f32::INFINITY, &mut y), Err(Error::InvalidArgument(_))) {
        return Err("infinite eps not rejected".into());
    }
    let r = poisoned(gpu, &[4, 32])?;
    let mut s = poisoned(gpu, &[4, 64])?;
    if !matches!(add_rms_norm(gpu, &x, &r, &w, EPS, &mut s, &mut y), Err(Error::Shape(_))) {
        return Err("mismatched residual not rejected".into());
    }
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
    Ok(())
}

fn main() {
    let mut t = GpuTests::new("rmsnorm");
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
