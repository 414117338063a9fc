//! The batch-1 decode step two ways on seeded random Llama-3-8B weights at a
//! long context: the shipped CUDA graph of separate launches, and the dev
//! persistent kernel (every layer in one launch). Prints each one's median step
//! time by CUDA events, its share of the copy-rate floor, and how far the two
//! steps' logits are apart.
//!
//! `persistent_decode [--context N] [--steps N]` (defaults 4096 and 64).

use host::model::gpu::PersistentDecode;
use host::model::{Model, ModelConfig, ModelOptions};
use host::ops::SamplingParams;
use host::{bf16, Gpu, Tensor};
use lab::testing::{rel_l2_error, to_f64};

/// The measured copy rate of the H200 (docs/PERF.md), the floor's denominator.
const COPY_TB_S: f64 = 4.2;

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (context, steps) = (arg(&args, "--context", 4096), arg(&args, "--steps", 64));
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("persistent_decode: no usable GPU ({e}); SKIPPED, nothing run");
            return Ok(());
        }
    };
    let cfg = ModelConfig::llama3_8b();
    let v = cfg.vocab_size;
    // Each sequence: the prompt, then every step of every measurement.
    let room = context + 7 * (steps + 4) + 8;
    let mut model = Model::random(&gpu, &cfg, 1, ModelOptions::for_batch(3, room))?;
    let mut pd = model.persistent_decode(&gpu)?;
    let prompt: Vec<u32> = (0..context as u32 - 1).map(|i| (i * 7919 + 13) % v as u32).collect();
    let (a, b) = (model.add_sequence(), model.add_sequence());
    let mut two = Tensor::filled(&gpu, &[2, v], bf16::ZERO)?;
    model.prefill(&gpu, &[a, b], &[&prompt, &prompt], &mut two)?;

    // Both steps once from the same state: their logits side by side.
    let (mut shipped, mut ours) =
        (Tensor::filled(&gpu, &[1, v], bf16::NAN)?, Tensor::filled(&gpu, &[1, v], bf16::NAN)?);
    model.decode(&gpu, &[a], &[5], &mut shipped)?;
    model.decode_persistent(&gpu, &mut pd, b, 5, &mut ours)?;
    let (want, got) = (to_f64(&shipped.to_host(&gpu)?), to_f64(&ours.to_host(&gpu)?));
    let nan = got.iter().any(|x| x.is_nan());
    println!(
        "logits at context {context}: persistent vs shipped step, rel L2 {:.3e}{}",
        rel_l2_error(&got, &want),
        if nan { " (NaN!)" } else { "" }
    );

    // The baseline: two shipped paths, a prefill of the prompt and the token
    // against the decode step above.
    let c = model.add_sequence();
    let mut longer = prompt.clone();
    longer.push(5);
    let mut one = Tensor::filled(&gpu, &[1, v], bf16::NAN)?;
    model.prefill(&gpu, &[c], &[&longer], &mut one)?;
    println!(
        "  baseline: shipped prefill vs shipped decode step, rel L2 {:.3e}",
        rel_l2_error(&to_f64(&one.to_host(&gpu)?), &want)
    );
    model.release(c)?;

    let params = [SamplingParams::GREEDY];
    let mut graph = model.capture_decode(&gpu, &[a], &[7], &params)?;
    let mut graph_ms = Vec::with_capacity(steps);
    for _ in 0..steps + 4 {
        graph_ms.push(gpu.time_ms(|| model.decode_graph(&gpu, &mut graph, None, &params))? as f64);
    }
    drop(graph);
    let ctx = model.len(b)? + steps + 4;
    let kv_bytes = ctx * 2 * cfg.num_hidden_layers * cfg.kv_dim() * 2;
    let floor_ms = (model.step_weight_bytes(1) + kv_bytes) as f64 / (COPY_TB_S * 1e12) * 1e3;
    println!(
        "{} ({} SMs), Llama-3-8B random weights, batch 1, context ~{ctx}, floor {floor_ms:.3} ms",
        gpu.info().name,
        gpu.info().sm_count
    );
    // The first four steps are warm-up.
    let median = |ms: &[f64]| {
        let mut timed = ms[4..].to_vec();
        timed.sort_by(f64::total_cmp);
        timed[timed.len() / 2]
    };
    let m = median(&graph_ms);
    println!("decode step {:28} {m:.4} ms  {:.1}% of the floor", "graph (shipped)", 100.0 * floor_ms / m);
    let (d, q, kv, ff) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size);
    let bytes = [2 * (q + 2 * kv) * d, ctx * kv * 4, 2 * d * q, 4 * ff * d, 2 * d * ff];
    // The persistent step, then (timing only, their results are wrong) without
    // the GEMV math and without attention. Each sequence's context grows the same.
    for (flags, name) in [
        (0, "persistent (dev)"),
        (PersistentDecode::SKIP_MATH, "  weights streamed, no math"),
        (PersistentDecode::SKIP_ATTENTION, "  no attention"),
        (PersistentDecode::SKIP_MATH | PersistentDecode::SKIP_ATTENTION, "  streamed, no math or attn"),
    ] {
        pd.flags = flags;
        let mut ms = Vec::with_capacity(steps);
        for _ in 0..steps + 4 {
            ms.push(gpu.time_ms(|| model.decode_persistent(&gpu, &mut pd, b, 7, &mut ours))? as f64);
        }
        let m = median(&ms);
        println!("decode step {name:28} {m:.4} ms  {:.1}% of the floor", 100.0 * floor_ms / m);
        // The last step's stages, averaged over layers, against their bytes at the copy rate.
        let stages = pd.stage_times_us()?;
        let n = stages.len() as f64;
        let names = ["norm + QKV", "attention", "O + residual", "norm + gate/up", "down + residual"];
        let line: Vec<String> = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let us = stages.iter().map(|s| s[i]).sum::<f64>() / n;
                format!("{name} {us:.2} ({:.2})", bytes[i] as f64 / (COPY_TB_S * 1e6))
            })
            .collect();
        println!("    µs per layer (floor): {}", line.join(", "));
        let inner = pd.attention_times_us()?;
        let avg = |i: usize| inner.iter().map(|s| s[i]).sum::<f64>() / n;
        println!(
            "    attention, µs from its start: q ready {:.2}, first group QK {:.2}, softmax {:.2}, PV {:.2}; keys done {:.2}, partial counted {:.2}, merge done {:.2}",
            avg(0),
            avg(4),
            avg(5),
            avg(6),
            avg(1),
            avg(2),
            avg(3)
        );
    }
    pd.flags = 0;
    Ok(())
}
