//! Criterion benchmarks of the kernels, timed with CUDA events (`iter_custom`).
//! Memory-bound cases report bytes per second and their share of the measured
//! device-to-device copy bandwidth; compute-bound ones report elements (FLOPs).
//!
//! `BENCH_GROUPS` picks groups (comma-separated; default `memory`):
//! `memory`, `attention`, `gemm`, `decode`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use host::Gpu;
use lab::perf::{attention_cases, copy_case, decode_cases, gemm_cases, standard_cases, Case};
use lab::testing::median_ms;
use std::time::Duration;

fn bench_cases(c: &mut Criterion, gpu: &Gpu, group: &str, cases: Vec<Case>, copy_gbs: f64) {
    let mut g = c.benchmark_group(group);
    g.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for mut case in cases {
        let ms = median_ms(gpu, 3, 10, |_| case.run(gpu)).expect("timing");
        if case.bytes > 0 {
            let gbs = case.bytes as f64 / ms / 1e6;
            eprintln!("{}: {gbs:.0} GB/s = {:.0}% of copy ({copy_gbs:.0} GB/s)", case.name, 100.0 * gbs / copy_gbs);
            g.throughput(Throughput::Bytes(case.bytes as u64));
        } else {
            eprintln!("{}: {:.1} TFLOP/s", case.name, case.flops / ms / 1e9);
            g.throughput(Throughput::Elements(case.flops as u64));
        }
        g.bench_function(case.name.clone(), |b| {
            b.iter_custom(|iters| {
                let ms = gpu.time_ms(|| (0..iters).try_for_each(|_| case.run(gpu))).expect("launch");
                Duration::from_secs_f64(ms as f64 / 1e3)
            })
        });
    }
    g.finish();
}

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
    let groups = std::env::var("BENCH_GROUPS").unwrap_or_else(|_| "memory".into());
    for group in groups.split(',') {
        let cases = match group.trim() {
            "memory" => standard_cases(&gpu).map(|c| c.into_iter().skip(1).collect()),
            "attention" => attention_cases(&gpu),
            "gemm" => gemm_cases(&gpu),
            "decode" => decode_cases(&gpu),
            other => {
                eprintln!("kernels bench: unknown group `{other}`");
                continue;
            }
        };
        bench_cases(c, &gpu, group.trim(), cases.expect("cases"), copy_gbs);
    }
}

criterion_group!(benches, kernels);
criterion_main!(benches);
