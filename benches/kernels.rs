//! Criterion benchmarks of the memory-bound kernels, timed with CUDA events
//! (`iter_custom`), reported as bytes per second; each case also prints its share
//! of the measured device-to-device copy bandwidth.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use host::perf::{copy_case, standard_cases};
use host::testing::median_ms;
use host::Gpu;
use std::time::Duration;

fn kernels(c: &mut Criterion) {
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("kernels bench: no usable GPU ({e}); skipped");
            return;
        }
    };
    let copy_gbs = {
        let mut copy = copy_case(&gpu).expect("copy case");
        let ms = median_ms(&gpu, 3, 10, |_| copy.run(&gpu)).expect("copy timing");
        copy.bytes as f64 / ms / 1e6
    };
    let mut group = c.benchmark_group("memory-bound");
    group.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for mut case in standard_cases(&gpu).expect("cases").into_iter().skip(1) {
        let ms = median_ms(&gpu, 3, 10, |_| case.run(&gpu)).expect("timing");
        let gbs = case.bytes as f64 / ms / 1e6;
        eprintln!("{}: {gbs:.0} GB/s = {:.0}% of copy ({copy_gbs:.0} GB/s)", case.name, 100.0 * gbs / copy_gbs);
        group.throughput(Throughput::Bytes(case.bytes as u64));
        group.bench_function(case.name.clone(), |b| {
            b.iter_custom(|iters| {
                let ms = gpu.time_ms(|| (0..iters).try_for_each(|_| case.run(&gpu))).expect("launch");
                Duration::from_secs_f64(ms as f64 / 1e3)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
