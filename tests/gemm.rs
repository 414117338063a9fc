//! GPU tests of the tensor-core GEMM epilogues and the SwiGLU MLP against f64 references.

use host::ops::gemm::{interleave_gate_up, plan};
use host::ops::{linear, linear_ex, linear_with, Epilogue, GemmVersion, MlpScratch, Overlap, SwiGluMlp};
use host::reference::{linear as linear_ref, rms_norm_rows, round_bf16, swiglu};
use host::{bf16, Arch, Error, Gpu, Tensor};
use lab::testing::{cast, expect_close, quick, random_with_outliers, rel_l2_error, to_f64, GpuTests};

fn e(err: Error) -> String {
    err.to_string()
}

fn rand_bf16(seed: u64, n: usize, scale: f32) -> Vec<bf16> {
    cast(&random_with_outliers(seed, n, scale))
}

fn check_gemm(gpu: &Gpu, m: usize, n: usize, k: usize, v: GemmVersion, seed: u64) -> Result<(), String> {
    let x = rand_bf16(seed, m * k, 1.0);
    let w = rand_bf16(seed + 1, n * k, 0.05);
    let r = rand_bf16(seed + 2, m * n, 1.0);
    let (xt, wt, rt) = (
        Tensor::from_host(gpu, &x, &[m, k]).map_err(e)?,
        Tensor::from_host(gpu, &w, &[n, k]).map_err(e)?,
        Tensor::from_host(gpu, &r, &[m, n]).map_err(e)?,
    );
    let y_ref = linear_ref(&to_f64(&x), &to_f64(&w), m, n, k);
    let what = format!("{v:?} m{m} n{n} k{k}");

    let mut out = Tensor::<bf16>::filled(gpu, &[m, n], bf16::NAN).map_err(e)?;
    linear_with(gpu, &xt, &wt, None, &mut out, Epilogue::Plain, v).map_err(e)?;
    expect_close(&format!("{what} plain"), rel_l2_error(&to_f64(&out.to_host(gpu).map_err(e)?), &y_ref), 1e-2)?;

    out.fill(bf16::NAN).map_err(e)?;
    linear_with(gpu, &xt, &wt, Some(&rt), &mut out, Epilogue::Residual, v).map_err(e)?;
    let res_ref: Vec<f64> = y_ref.iter().zip(to_f64(&r)).map(|(y, r)| y + r).collect();
    expect_close(&format!("{what} residual"), rel_l2_error(&to_f64(&out.to_host(gpu).map_err(e)?), &res_ref), 1e-2)?;

    // SwiGLU: treat w as [gate; up] halves, interleave them, compare with the f64 form.
    let ff = n / 2;
    let (gate, up) = w.split_at(ff * k);
    let gu = interleave_gate_up(gate, up, k).map_err(e)?;
    let gut = Tensor::from_host(gpu, &gu, &[n, k]).map_err(e)?;
    let mut h = Tensor::<bf16>::filled(gpu, &[m, ff], bf16::NAN).map_err(e)?;
    linear_with(gpu, &xt, &gut, None, &mut h, Epilogue::SwiGlu, v).map_err(e)?;
    let h_ref = swiglu(&to_f64(&x), &to_f64(gate), &to_f64(up), m, ff, k);
    expect_close(&format!("{what} swiglu"), rel_l2_error(&to_f64(&h.to_host(gpu).map_err(e)?), &h_ref), 1e-2)
}

fn shapes() -> Vec<(usize, usize, usize)> {
    let mut s = vec![(1, 2, 8), (3, 100, 72), (17, 264, 136), (129, 4104, 200), (1, 4104, 4104)];
    if !quick() {
        s.extend([(2049, 256, 4096), (129, 4096, 14336), (17, 28672, 4096), (2049, 1026, 1032)]);
    }
    s
}

fn gemm_all(gpu: &Gpu) -> Result<(), String> {
    for (i, &(m, n, k)) in shapes().iter().enumerate() {
        check_gemm(gpu, m, n, k, GemmVersion::Auto, 500 + 10 * i as u64)?;
    }
    Ok(())
}

/// Every mma.sync tile version (the Hopper-only ones are added where they run).
const MMA_SYNC_VERSIONS: [GemmVersion; 21] = {
    use GemmVersion::*;
    [
        V1,
        V2,
        V1SplitK,
        Skinny,
        SkinnySplitK,
        SkinnySplitKFixup,
        SkinnyStreamK,
        SkinnyStreamKPipelined,
        Skinny64StreamK,
        Skinny32StreamK,
        Gemv,
        Rows64,
        Rows64SplitK,
        SkinnyK128SplitK,
        SkinnyK128StreamK,
        SkinnyK128,
        SkinnyK128Fill,
        SkinnyK128SplitKFixup,
        SkinnyK128FillFixup,
        Skinny64,
        Skinny64SplitK,
    ]
};

/// Whether this GPU gives a block the dynamic shared memory `v`'s tiles need (the
/// 128-deep `SkinnyK128*` tiles, 108 KB, do not fit the 99 KB of sm_86/89/120).
fn fits(gpu: &Gpu, v: GemmVersion) -> bool {
    let info = gpu.info();
    plan(&[1, 64], &[64, 64], &[1, 64], None, Epilogue::Plain, v, info.sm_count as usize, info.arch)
        // A version plan() refuses stays in, so the test reports it.
        .map_or(true, |p| p.smem <= info.max_shared_per_block_optin)
}

/// Every tile configuration on shapes with ragged M, N and K edges.
fn gemm_versions(gpu: &Gpu) -> Result<(), String> {
    let shapes: &[(usize, usize, usize)] =
        // (70, 264, 136): two 64-row tiles, the second ragged (and five 16-row ones).
        // (3, 264, 1160): 19 K tiles, so the split kernels really split, also under
        // the sanitizer's quick mode. (5, 65538, 72): 1026 stream-K iterations of
        // 2 K tiles over the resident blocks, so whole and partial tiles mix.
        if quick() {
            &[(17, 264, 136), (70, 264, 136), (3, 264, 1160), (5, 65538, 72)]
        } else {
            &[(17, 264, 136), (70, 264, 136), (129, 520, 1160), (3, 4096, 14336), (5, 65538, 72)]
        };
    let mut versions = MMA_SYNC_VERSIONS.to_vec();
    if gpu.info().arch == Arch::Sm90a {
        versions.extend([GemmVersion::WgmmaExperimental, GemmVersion::Tma, GemmVersion::TmaPersistent]);
    }
    versions.retain(|&v| fits(gpu, v));
    for v in versions {
        for (i, &(m, n, k)) in shapes.iter().enumerate() {
            check_gemm(gpu, m, n, k, v, 700 + 10 * i as u64)?;
        }
    }
    Ok(())
}

/// The Hopper kernels on their own: tiny, ragged and many-tile shapes. Off Hopper
/// they must refuse cleanly.
fn gemm_hopper(gpu: &Gpu) -> Result<(), String> {
    if gpu.info().arch != Arch::Sm90a {
        let x = Tensor::<bf16>::filled(gpu, &[4, 64], bf16::ONE).map_err(e)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[4, 4], bf16::NAN).map_err(e)?;
        let w = Tensor::<bf16>::filled(gpu, &[4, 64], bf16::ONE).map_err(e)?;
        return match linear_with(gpu, &x, &w, None, &mut out, Epilogue::Plain, GemmVersion::Tma) {
            Err(Error::InvalidArgument(_)) => Ok(()),
            other => Err(format!("Tma off Hopper gave {other:?}")),
        };
    }
    let shapes: &[(usize, usize, usize)] = if quick() {
        &[(1, 2, 8), (130, 260, 200), (1100, 4100, 72)]
    } else {
        // 1100 × 4100: 153 tiles, more than the SMs, so persistent blocks take
        // several tiles and the ring's phases carry across tile boundaries.
        &[
            (1, 2, 8),
            (3, 100, 72),
            (128, 256, 64),
            (130, 260, 200),
            (257, 1000, 4104),
            (1025, 2050, 1032),
            (1100, 4100, 328),
        ]
    };
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        for v in [GemmVersion::Tma, GemmVersion::TmaPersistent] {
            check_gemm(gpu, m, n, k, v, 300 + 10 * i as u64)?;
        }
    }
    Ok(())
}

fn mlp(gpu: &Gpu) -> Result<(), String> {
    let sizes: &[(usize, usize, usize)] =
        if quick() { &[(3, 64, 96)] } else { &[(1, 256, 688), (17, 256, 688), (129, 512, 1376), (3, 4096, 14336)] };
    for (i, &(t, d, ff)) in sizes.iter().enumerate() {
        let seed = 900 + 10 * i as u64;
        let x = rand_bf16(seed, t * d, 1.0);
        let (wg, wu, wd) =
            (rand_bf16(seed + 1, ff * d, 0.02), rand_bf16(seed + 2, ff * d, 0.02), rand_bf16(seed + 3, d * ff, 0.02));
        let gamma = rand_bf16(seed + 4, d, 1.0);
        let mlp = SwiGluMlp::new(gpu, d, ff, &wg, &wu, &wd, Some((&gamma, 1e-5))).map_err(e)?;
        let mut scratch = MlpScratch::new(gpu, &mlp, t).map_err(e)?;
        let xt = Tensor::from_host(gpu, &x, &[t, d]).map_err(e)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[t, d], bf16::NAN).map_err(e)?;
        mlp.forward(gpu, &xt, &mut scratch, &mut out).map_err(e)?;
        let x64 = to_f64(&x);
        let (normed, _) = rms_norm_rows(&x64, None, &to_f64(&gamma), 1e-5);
        let normed: Vec<f64> = normed.into_iter().map(round_bf16).collect();
        let h = swiglu(&normed, &to_f64(&wg), &to_f64(&wu), t, ff, d);
        let down = linear_ref(&h, &to_f64(&wd), t, d, ff);
        let want: Vec<f64> = down.iter().zip(&x64).map(|(a, b)| a + b).collect();
        let got = to_f64(&out.to_host(gpu).map_err(e)?);
        expect_close(&format!("mlp t{t} d{d} ff{ff}"), rel_l2_error(&got, &want), 1e-2)?;
    }
    Ok(())
}

/// A GEMM launched to overlap the one before it (programmatic dependent launch on
/// Hopper) must read that one's output only once it is complete: y2 = (x·w1ᵀ)·w2ᵀ,
/// checked against the reference on the downloaded y1, every tile version.
fn overlapped_chain(gpu: &Gpu) -> Result<(), String> {
    use GemmVersion::*;
    // On Hopper the overlap must really be on (the driver entry point was found).
    if gpu.info().arch == Arch::Sm90a && !gpu.programmatic_launch() {
        return Err("sm_90a without programmatic dependent launch (cuLaunchKernelEx not found)".into());
    }
    // Auto, then every mma.sync version.
    let versions: Vec<GemmVersion> = std::iter::once(Auto).chain(MMA_SYNC_VERSIONS).collect();
    let shapes: &[(usize, usize, usize)] =
        if quick() { &[(3, 264, 1160)] } else { &[(1, 4104, 4104), (17, 1032, 14336), (129, 4096, 1160)] };
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        let seed = 1300 + 10 * i as u64;
        let x = Tensor::from_host(gpu, &rand_bf16(seed, m * k, 1.0), &[m, k]).map_err(e)?;
        let w1 = Tensor::from_host(gpu, &rand_bf16(seed + 1, k * k, 0.05), &[k, k]).map_err(e)?;
        let w2h = rand_bf16(seed + 2, n * k, 0.05);
        let w2 = Tensor::from_host(gpu, &w2h, &[n, k]).map_err(e)?;
        let mut y1 = Tensor::<bf16>::filled(gpu, &[m, k], bf16::NAN).map_err(e)?;
        let mut y2 = Tensor::<bf16>::filled(gpu, &[m, n], bf16::NAN).map_err(e)?;
        for v in versions.iter().copied().filter(|&v| fits(gpu, v)) {
            y1.fill(bf16::NAN).map_err(e)?;
            y2.fill(bf16::NAN).map_err(e)?;
            // Several pairs back to back: the second GEMM of each pair may start
            // while the first still runs.
            for _ in 0..3 {
                linear(gpu, &x, &w1, &mut y1).map_err(e)?;
                // SAFETY: w2 is uploaded once, before the loop; no kernel writes it.
                unsafe { linear_ex(gpu, &y1, &w2, None, &mut y2, Epilogue::Plain, v, Overlap::ResidentWeights) }
                    .map_err(e)?;
            }
            let want = linear_ref(&to_f64(&y1.to_host(gpu).map_err(e)?), &to_f64(&w2h), m, n, k);
            let got = to_f64(&y2.to_host(gpu).map_err(e)?);
            expect_close(&format!("overlapped {v:?} m{m} n{n} k{k}"), rel_l2_error(&got, &want), 1e-2)?;
        }
    }
    Ok(())
}

fn bad_input(gpu: &Gpu) -> Result<(), String> {
    let x = Tensor::<bf16>::filled(gpu, &[4, 70], bf16::ONE).map_err(e)?;
    let w = Tensor::<bf16>::filled(gpu, &[8, 70], bf16::ONE).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[4, 8], bf16::NAN).map_err(e)?;
    match linear(gpu, &x, &w, &mut out) {
        Err(Error::Alignment(_)) => Ok(()),
        other => Err(format!("d_in 70 gave {other:?}")),
    }
}

fn main() {
    let mut t = GpuTests::new("gemm");
    t.run("gemm_hopper_tma_wgmma", gemm_hopper);
    t.run("gemm_plain_residual_swiglu_odd_shapes", gemm_all);
    t.run("gemm_every_tile_version", gemm_versions);
    t.run("swiglu_mlp_against_reference", mlp);
    t.run("gemm_overlapped_with_previous_kernel", overlapped_chain);
    t.run("gemm_bad_input_fails_before_launch", bad_input);
    t.finish();
}
