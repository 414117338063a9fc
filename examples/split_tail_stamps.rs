//! Where a split-tail GEMM's time goes, block by block: runs the stamped dev
//! version of the split tail (one block per SM, the last round's tiles cut along
//! K) several times and prints, per launch, the spread of the blocks' main
//! loops and finishes, the slowest and fastest SMs, and how alike the SMs'
//! main-loop times are from one launch to the next (a property of the SM, or
//! of the launch). With `--csv FILE`, every block of every launch. The stamped
//! kernels sum a split tile in its last slice's block, as the shipped split
//! tail does below 4 slices (from 4 it sums in shares).
//!
//! `split_tail_stamps [--m M] [--n N] [--k K] [--n192 0|1] [--waves 0|1] [--launches L] [--csv FILE]`
//! (defaults: the MLP t128 down projection, 128 × 4096 × 14336, on 128×192 tiles, one block
//! per SM, 5 launches; `--waves 1`: 128×192 tiles on twice as many blocks as SMs).

use host::ops::gemm::{split_tail_stamps, BlockStamps, GemmVersion};
use host::ops::Epilogue;
use host::{bf16, Gpu, Tensor};
use lab::testing::{cast, random_with_outliers};
use std::io::Write;

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn upload(gpu: &Gpu, seed: u64, shape: &[usize]) -> Result<Tensor<bf16>, host::Error> {
    Tensor::from_host(gpu, &cast::<bf16>(&random_with_outliers(seed, shape.iter().product(), 1.0)), shape)
}

/// Median and the spread (min, max) of `v`, microseconds.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Pearson correlation of two equally long series.
fn correlation(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma) * (x - ma)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb) * (y - mb)).sum();
    cov / (va * vb).sqrt()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (m, n, k) = (arg(&args, "--m", 128), arg(&args, "--n", 4096), arg(&args, "--k", 14336));
    let (n192, launches) = (arg(&args, "--n192", 1) != 0, arg(&args, "--launches", 5).max(2));
    let waves = arg(&args, "--waves", 0) != 0;
    let version = match (n192, waves) {
        (_, true) => GemmVersion::TmaSplitTailN192WavesStamped,
        (true, false) => GemmVersion::TmaSplitTailN192Stamped,
        (false, false) => GemmVersion::TmaSplitTailStamped,
    };
    let csv = args.iter().position(|a| a == "--csv").and_then(|i| args.get(i + 1)).cloned();
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("split_tail_stamps: no usable GPU ({e}); SKIPPED, nothing run");
            return Ok(());
        }
    };
    let (x, w) = (upload(&gpu, 71, &[m, k])?, upload(&gpu, 72, &[n, k])?);
    let mut out = Tensor::filled(&gpu, &[m, n], bf16::ZERO)?;
    println!("split tail {version:?}, m{m} n{n} k{k}, {launches} launches (after one to warm up)");
    split_tail_stamps(&gpu, &x, &w, None, &mut out, Epilogue::Plain, version)?;
    let mut runs: Vec<Vec<BlockStamps>> = Vec::new();
    for _ in 0..launches {
        runs.push(split_tail_stamps(&gpu, &x, &w, None, &mut out, Epilogue::Plain, version)?);
    }
    let us = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e3;
    let sms = gpu.info().sm_count as usize;
    // Main-loop time per SM, per launch, summed over its blocks (an SM without a unit reads 0).
    let mut by_sm: Vec<Vec<f64>> = Vec::new();
    for (r, blocks) in runs.iter().enumerate() {
        let live: Vec<&BlockStamps> = blocks.iter().filter(|b| b.units > 0).collect();
        if live.is_empty() {
            println!("launch {r}: no block computed a unit");
            continue;
        }
        let t0 = live.iter().map(|b| b.start).min().unwrap_or(0);
        let end = live.iter().map(|b| b.done).max().unwrap_or(0);
        let (start, start_lo, start_hi) = spread(live.iter().map(|b| us(t0, b.start)).collect());
        let (ramp, ramp_lo, ramp_hi) = spread(live.iter().map(|b| us(b.start, b.first_data)).collect());
        let (main, main_lo, main_hi) = spread(live.iter().map(|b| us(b.first_data, b.loop_end)).collect());
        let (fin, fin_lo, fin_hi) = spread(live.iter().map(|b| us(b.loop_end, b.done)).collect());
        let (done, done_lo, done_hi) = spread(live.iter().map(|b| us(t0, b.done)).collect());
        println!(
            "launch {r}: {} blocks, {:.1} µs first start to last done; median (min–max) µs: start {start:.1} ({start_lo:.1}–{start_hi:.1}), first stage {ramp:.1} ({ramp_lo:.1}–{ramp_hi:.1}), main loop {main:.1} ({main_lo:.1}–{main_hi:.1}), finish {fin:.1} ({fin_lo:.1}–{fin_hi:.1}), done {done:.1} ({done_lo:.1}–{done_hi:.1})",
            live.len(),
            us(t0, end)
        );
        let mut per_sm = vec![0.0; sms];
        for b in &live {
            if (b.sm as usize) < sms {
                per_sm[b.sm as usize] += us(b.first_data, b.loop_end);
            }
        }
        by_sm.push(per_sm);
        let summed: Vec<&&BlockStamps> = live.iter().filter(|b| b.summed).collect();
        if !summed.is_empty() {
            let (sum_fin, _, sum_hi) = spread(summed.iter().map(|b| us(b.loop_end, b.done)).collect());
            println!(
                "  {} blocks summed a split tile: finish median {sum_fin:.1} µs, longest {sum_hi:.1}",
                summed.len()
            );
        }
    }
    // The same SMs slow every launch? Correlate each launch's per-SM main loops with the next's.
    let pairs: Vec<String> = by_sm.windows(2).map(|p| format!("{:.2}", correlation(&p[0], &p[1]))).collect::<Vec<_>>();
    println!("per-SM main-loop time, correlation of consecutive launches: {}", pairs.join(" "));
    let mean: Vec<f64> = (0..sms).map(|s| by_sm.iter().map(|r| r[s]).sum::<f64>() / by_sm.len() as f64).collect();
    let mut order: Vec<usize> = (0..sms).filter(|&s| mean[s] > 0.0).collect();
    order.sort_by(|&a, &b| mean[b].total_cmp(&mean[a]));
    let show = |ids: &[usize]| ids.iter().map(|&s| format!("SM{s} {:.1}", mean[s])).collect::<Vec<_>>().join(", ");
    println!("slowest SMs (mean main loop µs): {}", show(&order[..order.len().min(8)]));
    println!("fastest SMs: {}", show(&order[order.len().saturating_sub(8)..]));
    if let Some(path) = csv {
        let mut f = std::fs::File::create(&path)?;
        writeln!(f, "launch,block,sm,start_ns,first_data_ns,loop_end_ns,done_ns,units,summed")?;
        for (r, blocks) in runs.iter().enumerate() {
            for b in blocks {
                writeln!(
                    f,
                    "{r},{},{},{},{},{},{},{},{}",
                    b.block, b.sm, b.start, b.first_data, b.loop_end, b.done, b.units, b.summed as u8
                )?;
            }
        }
        println!("every block: {path}");
    }
    Ok(())
}
