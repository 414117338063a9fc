//! Measures the kernels on the benchmark shapes and prints one line per case in
//! `torch_reference.py`'s format (median of CUDA-event timings after warm-up).
//! `--json FILE` also writes the figures; `--versions` adds the dev versions;
//! `--attention` adds the FlashAttention sweep; `--gemm` the GEMM and MLP cases
//! (`--mlp` the MLP cases alone);
//! `--decode` the decode-attention cases; `--wgmma` the experimental Hopper GEMM;
//! `--only A,B` keeps the cases whose names contain A or B (`=A`: named exactly A).
//! `--interleave` times the versions of each shape in rounds, one call of each
//! per round (`lab::perf::interleaved_medians`), so that drift between cases does
//! not pass for a difference between versions.

use host::ops::stream::stream_sum;
use host::{bf16, Gpu, Tensor};
use lab::perf::{
    attention_cases, decode_cases, gemm_cases, interleaved_medians, layer_cases, mlp_cases, set_only, shape_groups,
    standard_cases, version_cases, wanted, wgmma_cases,
};
use lab::testing::median_ms;
use std::fmt::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let json_path = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1)).cloned();
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("perf: no usable GPU ({e}); nothing measured");
            return Ok(());
        }
    };
    println!(
        "{} (sm_{}{}, {} SMs) ours",
        gpu.info().name,
        gpu.info().compute_capability.0,
        gpu.info().compute_capability.1,
        gpu.info().sm_count
    );
    // `--only A,B`: keep the cases whose names contain one of the substrings (a key
    // starting with '=': only the case of exactly that name); the larger groups skip
    // building the others at all.
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1));
    if let Some(only) = only {
        set_only(&only.split(',').collect::<Vec<_>>());
    }
    let mut cases = standard_cases(&gpu)?;
    if args.iter().any(|a| a == "--versions") {
        cases.extend(version_cases(&gpu)?);
    }
    if args.iter().any(|a| a == "--attention") {
        cases.extend(attention_cases(&gpu)?);
    }
    if args.iter().any(|a| a == "--gemm") {
        cases.extend(gemm_cases(&gpu)?);
    } else if args.iter().any(|a| a == "--mlp") {
        cases.extend(mlp_cases(&gpu)?);
    }
    if args.iter().any(|a| a == "--decode") {
        cases.extend(decode_cases(&gpu)?);
    }
    if args.iter().any(|a| a == "--layer") {
        cases.extend(layer_cases(&gpu)?);
    }
    if args.iter().any(|a| a == "--wgmma") {
        cases.extend(wgmma_cases(&gpu)?);
    }
    cases.retain(|c| wanted(&c.name));
    let mut json = String::from("{\n");
    // Before each case, ~20 ms of stateless streaming: with the 5 warm-up calls
    // alone, the first case after a long host-side setup read up to 11% slow (the
    // same MLP kernels 0.1028 ms as the first row, 0.0926 a row later). Stateless
    // because some cases append to a KV cache per call.
    // PERF_WARM_MS=0 turns it off (under ncu, which would profile every launch).
    let warm_ms: u64 = std::env::var("PERF_WARM_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let ballast = Tensor::<bf16>::filled(&gpu, &[128 << 20], bf16::ONE)?;
    let mut sink = Tensor::<f32>::filled(&gpu, &[1], 0.0)?;
    // The first case gets 25 times as long: with 20 ms the first row still read
    // 13% slow (MLP t1 Auto 0.1022 ms, the same kernels 0.0905 rows later), as if
    // the GPU came out of a low-power state only after the setup.
    let mut first = true;
    let mut warm = || -> host::Result<()> {
        let start = std::time::Instant::now();
        let ms = if std::mem::take(&mut first) { 25 * warm_ms } else { warm_ms };
        while start.elapsed() < std::time::Duration::from_millis(ms) {
            for _ in 0..10 {
                stream_sum(&gpu, &ballast, &mut sink)?;
            }
            gpu.synchronize()?;
        }
        Ok(())
    };
    let interleave = args.iter().any(|a| a == "--interleave");
    let names: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    let groups = if interleave { shape_groups(&names) } else { (0..cases.len()).map(|i| vec![i]).collect() };
    let mut timed: Vec<Option<host::Result<f64>>> = cases.iter().map(|_| None).collect();
    // The SM clock right after each case (or group) was timed, where NVML answers.
    let clocks = lab::clocks::Clocks::open(&gpu.info().pci_bus_id);
    let mut clock_at: Vec<Option<lab::clocks::ClockSample>> = cases.iter().map(|_| None).collect();
    for group in groups {
        warm()?;
        if group.len() == 1 {
            let case = &mut cases[group[0]];
            timed[group[0]] = Some(median_ms(&gpu, 5, 30, |_| case.run(&gpu)));
        } else {
            let mut members: Vec<&mut lab::perf::Case> =
                cases.iter_mut().enumerate().filter(|(i, _)| group.contains(i)).map(|(_, c)| c).collect();
            for (&i, ms) in group.iter().zip(interleaved_medians(&gpu, &mut members, 5, 30)) {
                timed[i] = Some(ms);
            }
        }
        let sample = clocks.as_ref().and_then(|c| c.sample());
        for &i in &group {
            clock_at[i] = sample;
        }
    }
    for ((case, ms), clock) in cases.iter().zip(timed).zip(clock_at) {
        // A version that does not take a shape says so and the sweep goes on.
        let ms = match ms.expect("every case is in one group") {
            Ok(ms) => ms,
            Err(e) => {
                println!("{:52} not run: {e}", case.name);
                continue;
            }
        };
        let gbs = case.bytes as f64 / ms / 1e6;
        let tflops = case.flops / ms / 1e9;
        let at = clock.map_or(String::new(), |c| match c.slowdowns().as_str() {
            "" => format!(" {:5} MHz", c.sm_mhz),
            why => format!(" {:5} MHz ({why})", c.sm_mhz),
        });
        println!("{:52} {ms:9.4} ms {tflops:7.1} TFLOP/s {gbs:7.0} GB/s{at}", case.name);
        let sep = if json.len() > 2 { ",\n" } else { "" };
        let mhz =
            clock.map_or(String::new(), |c| format!(", \"sm_mhz\": {}, \"clock_reasons\": {}", c.sm_mhz, c.reasons));
        write!(json, "{sep} \"{}\": {{\"ms\": {ms}, \"tflops\": {tflops}, \"gbs\": {gbs}{mhz}}}", case.name)?;
    }
    json += "\n}\n";
    if let Some(path) = json_path {
        std::fs::write(path, json)?;
    }
    Ok(())
}
