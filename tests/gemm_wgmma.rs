//! EXPERIMENTAL: the sm_90a `wgmma` GEMM against the f64 reference, in its own
//! binary so that a fault there cannot take the validated GEMM tests down with it.
//! Never run yet (written without device time); see docs/NOTES.md.

use host::ops::gemm::{linear_with, Epilogue, GemmVersion};
use host::reference::linear as linear_ref;
use host::testing::{cast, expect_close, random_with_outliers, rel_l2_error, to_f64, GpuTests};
use host::{bf16, Arch, Error, Gpu, Tensor};

fn check(gpu: &Gpu, m: usize, n: usize, k: usize) -> Result<(), String> {
    let e = |err: Error| err.to_string();
    let x: Vec<bf16> = cast(&random_with_outliers(1, m * k, 1.0));
    let w: Vec<bf16> = cast(&random_with_outliers(2, n * k, 0.05));
    let xt = Tensor::from_host(gpu, &x, &[m, k]).map_err(e)?;
    let wt = Tensor::from_host(gpu, &w, &[n, k]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[m, n], bf16::NAN).map_err(e)?;
    linear_with(gpu, &xt, &wt, None, &mut out, Epilogue::Plain, GemmVersion::WgmmaExperimental).map_err(e)?;
    let got = to_f64(&out.to_host(gpu).map_err(e)?);
    expect_close(
        &format!("wgmma m{m} n{n} k{k}"),
        rel_l2_error(&got, &linear_ref(&to_f64(&x), &to_f64(&w), m, n, k)),
        1e-2,
    )
}

fn shapes(gpu: &Gpu) -> Result<(), String> {
    if gpu.info().arch != Arch::Sm90a {
        return Err("needs an sm_90a (Hopper) GPU".into());
    }
    for (m, n, k) in [(64, 128, 64), (64, 128, 1024), (129, 264, 136), (2049, 1026, 1032)] {
        check(gpu, m, n, k)?;
    }
    Ok(())
}

fn main() {
    let mut t = GpuTests::new("gemm_wgmma");
    t.run("gemm_wgmma_experimental_against_reference", shapes);
    t.finish();
}
