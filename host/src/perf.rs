//! Benchmark cases shared by `examples/perf.rs` (the PERF.md table) and the
//! criterion bench: each allocates its tensors once and exposes one launch.
//! Names match `torch_reference.py`, so the two outputs join on the name.

use crate::error::{check, Result};
use crate::ops::softmax::plan;
use crate::ops::{add_rms_norm, rms_norm, softmax_with, SoftmaxVersion};
use crate::runtime::Gpu;
use crate::tensor::{DType, Tensor};
use crate::testing::{cast, random_with_outliers};
use half::bf16;

/// Device-to-device copy bandwidth (bytes read + written per second) is the
/// roofline for these memory-bound kernels; H200 measured about 4.2 TB/s.
pub struct Case {
    pub name: String,
    /// Bytes that must cross HBM: each input read once, each output written once.
    pub bytes: usize,
    run: Box<dyn FnMut(&Gpu) -> Result<()>>,
}

impl Case {
    pub fn run(&mut self, gpu: &Gpu) -> Result<()> {
        (self.run)(gpu)
    }
}

fn upload<T: DType>(gpu: &Gpu, seed: u64, shape: &[usize], scale: f32) -> Result<Tensor<T>> {
    let n = shape.iter().product();
    Tensor::from_host(
        gpu,
        &cast::<T>(&random_with_outliers(seed, n, scale)),
        shape,
    )
}

pub fn softmax_case<T: crate::ops::softmax::SoftmaxType>(
    gpu: &Gpu,
    rows: usize,
    cols: usize,
    version: SoftmaxVersion,
) -> Result<Case> {
    let x = upload::<T>(gpu, 1, &[rows, cols], 3.0)?;
    let mut y = Tensor::<T>::filled(gpu, &[rows, cols], T::POISON)?;
    let tag = match version {
        SoftmaxVersion::Auto => String::new(),
        v => format!(" [{v:?}]"),
    };
    Ok(Case {
        name: format!("softmax {} {rows}x{cols}{tag}", T::NAME),
        bytes: 2 * rows * cols * T::BYTES,
        run: Box::new(move |gpu| softmax_with(gpu, &x, &mut y, version)),
    })
}

pub fn rmsnorm_case(gpu: &Gpu, rows: usize, cols: usize, fused: bool) -> Result<Case> {
    let x = upload::<bf16>(gpu, 2, &[rows, cols], 1.0)?;
    let r = upload::<bf16>(gpu, 3, &[rows, cols], 1.0)?;
    let w = upload::<bf16>(gpu, 4, &[cols], 0.5)?;
    let mut y = Tensor::<bf16>::filled(gpu, &[rows, cols], bf16::POISON)?;
    let mut s = Tensor::<bf16>::filled(gpu, &[rows, cols], bf16::POISON)?;
    let eps = 1e-5;
    Ok(Case {
        name: format!(
            "{}rmsnorm bf16 {rows}x{cols}",
            if fused { "add+" } else { "" }
        ),
        bytes: if fused { 4 } else { 2 } * rows * cols * 2,
        run: Box::new(move |gpu| {
            if fused {
                add_rms_norm(gpu, &x, &r, &w, eps, &mut s, &mut y)
            } else {
                rms_norm(gpu, &x, &w, eps, &mut y)
            }
        }),
    })
}

/// A 2 GiB device-to-device copy: the bandwidth ceiling, measured in the same run.
pub fn copy_case(gpu: &Gpu) -> Result<Case> {
    let n = 1usize << 29;
    let a = Tensor::<f32>::from_host(gpu, &vec![1.5f32; n], &[n])?;
    let b = Tensor::<f32>::filled(gpu, &[n], f32::NAN)?;
    Ok(Case {
        name: "copy f32 2GiB d2d".into(),
        bytes: 2 * n * 4,
        run: Box::new(move |gpu| {
            let status = unsafe {
                cust::sys::cuMemcpyDtoDAsync_v2(
                    b.device_ptr(),
                    a.device_ptr(),
                    n * 4,
                    gpu.stream().as_inner(),
                )
            };
            check("cuMemcpyDtoDAsync", status)
        }),
    })
}

/// The cases of the build-pipeline issue's table (and the reference's smaller ones).
pub fn standard_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    let mut cases = vec![copy_case(gpu)?];
    for (rows, cols) in [(32768, 4096), (4096, 32768), (65536, 1024), (1024, 262144)] {
        cases.push(softmax_case::<f32>(gpu, rows, cols, SoftmaxVersion::Auto)?);
        cases.push(softmax_case::<bf16>(gpu, rows, cols, SoftmaxVersion::Auto)?);
    }
    for rows in [1, 64, 16384] {
        cases.push(rmsnorm_case(gpu, rows, 4096, false)?);
        cases.push(rmsnorm_case(gpu, rows, 4096, true)?);
    }
    Ok(cases)
}

/// Kernel versions side by side on the target shapes (the dev-area comparison).
pub fn version_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    let mut cases = Vec::new();
    for (rows, cols) in [(32768, 4096), (4096, 32768)] {
        for v in [
            SoftmaxVersion::V1,
            SoftmaxVersion::V2,
            SoftmaxVersion::Online,
        ] {
            // A version that cannot hold the row is simply not in the table.
            let shape = [rows, cols];
            if plan::<f32>(&shape, &shape, v).is_ok() {
                cases.push(softmax_case::<f32>(gpu, rows, cols, v)?);
            }
            if plan::<bf16>(&shape, &shape, v).is_ok() {
                cases.push(softmax_case::<bf16>(gpu, rows, cols, v)?);
            }
        }
    }
    Ok(cases)
}
