//! Error and time measurements: relative L2 error against a reference, and the
//! median of CUDA-event timings.

use crate::runtime::Gpu;

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

/// Device-to-device copy rate of `bytes` (bytes read + written per second, GB/s),
/// the median of `reps` driver copies: the ceiling of memory-bound kernels.
pub fn copy_gbs(gpu: &Gpu, bytes: usize, reps: usize) -> crate::Result<f64> {
    let n = bytes / 4;
    let a = crate::Tensor::<f32>::filled(gpu, &[n], 1.5)?;
    let b = crate::Tensor::<f32>::filled(gpu, &[n], 0.0)?;
    let ms = median_ms(gpu, 3, reps, |_| {
        // SAFETY: both buffers hold n f32 and outlive the synchronizing timer.
        let status =
            unsafe { cust::sys::cuMemcpyDtoDAsync_v2(b.device_ptr(), a.device_ptr(), n * 4, gpu.stream().as_inner()) };
        crate::error::check("cuMemcpyDtoDAsync", status)
    })?;
    Ok(2.0 * (n * 4) as f64 / ms / 1e6)
}
