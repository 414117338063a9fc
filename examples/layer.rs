//! The fused decoder layer end to end: prefill of a prompt, then decode steps, at
//! batch 1 and batch 16, with a slice of the output checked against the f64 CPU
//! reference, times, tokens/s, launch counts and the four ledgers (capacity,
//! bandwidth, compute, communication).
//!
//! cargo xtask run layer [--prompt=2048] [--steps=128] [--batches=1,16]
//!     [--weights=model.safetensors --layer-index=0] [--d-model=… --heads=… …]

use host::data::{cast, random_with_outliers, to_f64};
use host::layer::reference::{layer_forward, RefCache};
use host::layer::{Layer, LayerConfig, LayerWeights, Stage};
use host::metrics::{median_ms, rel_l2_error};
use host::ops::{linear, SeqId};
use host::reference::round_bf16;
use host::{bf16, Gpu, Tensor};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().find_map(|a| a.strip_prefix(&format!("--{name}=")).map(str::to_string))
}

fn upload(gpu: &Gpu, seed: u64, rows: usize, d: usize) -> Res<Tensor<bf16>> {
    Ok(Tensor::from_host(gpu, &cast::<bf16>(&random_with_outliers(seed, rows * d, 1.0)), &[rows, d])?)
}

/// Ceilings measured in this run: device copy (bytes read + written per second)
/// and our bf16 GEMM on 8192³.
fn ceilings(gpu: &Gpu) -> Res<(f64, f64)> {
    let copy_gbs = host::metrics::copy_gbs(gpu, 1 << 31, 10)?;
    let n = 8192;
    let (a, b) = (upload(gpu, 1, n, n)?, upload(gpu, 2, n, n)?);
    let mut c = Tensor::<bf16>::filled(gpu, &[n, n], bf16::ZERO)?;
    let ms = median_ms(gpu, 2, 5, |_| linear(gpu, &a, &b, &mut c))?;
    Ok((copy_gbs, 2.0 * (n * n * n) as f64 / ms / 1e9))
}

fn ledgers(title: &str, stages: &[Stage], copy_gbs: f64, gemm_tflops: f64) {
    println!("  {title}: bandwidth, compute and communication ledgers (each stage timed alone)");
    println!(
        "    {:50} {:>9} {:>5} {:>10} {:>7} {:>7} {:>9} {:>7}  bound",
        "stage", "µs", "launch", "MB", "GB/s", "%copy", "TFLOP/s", "%gemm"
    );
    let (mut total_ms, mut total_launches) = (0.0, 0);
    for s in stages {
        let gbs = s.bytes / s.ms / 1e6;
        let tflops = s.flops / s.ms / 1e9;
        // The ledger whose floor is higher is the one that bounds the stage.
        let (t_mem, t_math) = (s.bytes / (copy_gbs * 1e9), s.flops / (gemm_tflops * 1e12));
        let bound = if t_mem >= t_math { "bandwidth" } else { "compute" };
        println!(
            "    {:50} {:9.1} {:>5} {:10.1} {:7.0} {:6.0}% {:9.1} {:6.0}%  {bound}",
            s.name,
            s.ms * 1e3,
            s.launches,
            s.bytes / 1e6,
            gbs,
            100.0 * gbs / copy_gbs,
            tflops,
            100.0 * tflops / gemm_tflops
        );
        total_ms += s.ms;
        total_launches += s.launches;
    }
    println!("    {:50} {:9.1} {:>5}", "sum of stages", total_ms * 1e3, total_launches);
    println!("    communication: 0 bytes (one GPU; the entry stays for multi-GPU)");
}

fn capacity(gpu: &Gpu, layer: &Layer) -> Res<()> {
    let (free, total) = cust::memory::mem_get_info()?;
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    println!("  capacity ledger (HBM):");
    println!("    weights      {:8.3} GiB", gib(layer.weight_bytes()));
    println!("    KV cache     {:8.3} GiB", gib(layer.cache().pool_bytes()));
    println!("    activations  {:8.3} GiB", gib(layer.activation_bytes()));
    println!("    workspace    {:8.3} GiB (split-K)", gib(gpu.workspace_bytes()));
    println!("    free         {:8.3} GiB of {:.1} GiB", gib(free), gib(total));
    Ok(())
}

/// The first `rows` outputs of sequence 0 against the reference (causal: they
/// depend on the first `rows` tokens only).
fn check_slice(
    c: &LayerConfig,
    w: &LayerWeights,
    x: &Tensor<bf16>,
    out: &Tensor<bf16>,
    gpu: &Gpu,
    rows: usize,
) -> Res<f64> {
    let d = c.d_model;
    let xs: Vec<f64> = to_f64(&x.to_host(gpu)?[..rows * d]).into_iter().map(round_bf16).collect();
    let want = layer_forward(c, w, &xs, &mut RefCache::default());
    let got = to_f64(&out.to_host(gpu)?[..rows * d]);
    Ok(rel_l2_error(&got, &want))
}

fn run_batch(
    gpu: &Gpu,
    c: &LayerConfig,
    w: &LayerWeights,
    b: usize,
    prompt: usize,
    steps: usize,
    ceil: (f64, f64),
) -> Res<()> {
    let d = c.d_model;
    // Warm-up, plain and graph decode steps, and one profiled step.
    let max_len = prompt + 2 * steps + 4;
    // Room for the measured run and the profiled one.
    let mut layer = Layer::new(gpu, c, w, 2 * b * max_len + 64, 64, max_len)?;
    let x = upload(gpu, 100 + b as u64, b * prompt, d)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[b * prompt, d], bf16::NAN)?;
    let lens = vec![prompt; b];

    // Warm-up on throwaway sequences (allocates scratch, loads kernels).
    let warm: Vec<SeqId> = (0..b).map(|_| layer.add_sequence()).collect();
    layer.prefill(gpu, &warm, &lens, &x, &mut out)?;
    for s in warm {
        layer.release(s)?;
    }
    gpu.synchronize()?;

    let seqs: Vec<SeqId> = (0..b).map(|_| layer.add_sequence()).collect();
    let launches = gpu.launch_count();
    let prefill_ms = gpu.time_ms(|| layer.prefill(gpu, &seqs, &lens, &x, &mut out))? as f64;
    let prefill_launches = gpu.launch_count() - launches;
    let err = check_slice(c, w, &x, &out, gpu, 4.min(prompt))?;

    let inputs: Vec<Tensor<bf16>> = (0..4).map(|i| upload(gpu, 200 + i, b, d)).collect::<Res<_>>()?;
    let mut step_out = Tensor::<bf16>::filled(gpu, &[b, d], bf16::NAN)?;
    layer.decode(gpu, &seqs, &inputs[0], &mut step_out)?; // warm-up step
    gpu.synchronize()?;
    let launches = gpu.launch_count();
    let decode_ms = gpu.time_ms(|| {
        for i in 1..steps {
            layer.decode(gpu, &seqs, &inputs[i % 4], &mut step_out)?;
        }
        Ok(())
    })? as f64;
    let per_step_launches = (gpu.launch_count() - launches) / (steps as u64 - 1).max(1);
    let per_step = decode_ms / (steps - 1).max(1) as f64;

    // The same steps replayed as a CUDA graph (the capture runs one step plainly).
    let mut graph = layer.capture_decode(gpu, &seqs, &inputs[0], &mut step_out)?;
    gpu.synchronize()?;
    let graph_ms = gpu.time_ms(|| {
        for i in 1..steps {
            layer.decode_graph(gpu, &mut graph, &inputs[i % 4], &mut step_out)?;
        }
        Ok(())
    })? as f64;
    let per_graph_step = graph_ms / (steps - 1).max(1) as f64;

    println!("batch {b}: prompt {prompt} tokens per sequence, {steps} decode steps");
    println!(
        "  prefill  {prefill_ms:9.3} ms  {:9.0} tokens/s  {prefill_launches} launches  (first 4 rows vs CPU reference: rel. error {err:.2e})",
        (b * prompt) as f64 / prefill_ms * 1e3
    );
    println!(
        "  decode   {per_step:9.3} ms/step  {:9.0} tokens/s  {per_step_launches} launches per step (plain launches)",
        b as f64 / per_step * 1e3
    );
    println!(
        "  decode   {per_graph_step:9.3} ms/step  {:9.0} tokens/s  one CUDA graph per step ({:.2}× the plain launches)",
        b as f64 / per_graph_step * 1e3,
        per_step / per_graph_step
    );
    // NaN fails too.
    if err.is_nan() || err > 1e-2 {
        return Err(format!("layer output differs from the reference: {err:.3e}").into());
    }

    // Ledgers from a profiled prefill (fresh sequences) and a profiled decode step.
    let fresh: Vec<SeqId> = (0..b).map(|_| layer.add_sequence()).collect();
    let stages = layer.prefill_profiled(gpu, &fresh, &lens, &x, &mut out)?;
    ledgers("prefill", &stages, ceil.0, ceil.1);
    let stages = layer.decode_profiled(gpu, &seqs, &inputs[0], &mut step_out)?;
    ledgers("decode step", &stages, ceil.0, ceil.1);
    capacity(gpu, &layer)
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut cfg = LayerConfig::default();
    let rest = cfg.apply_flags(&args)?;
    let prompt: usize = flag(&rest, "prompt").map_or(Ok(2048), |v| v.parse())?;
    let steps: usize = flag(&rest, "steps").map_or(Ok(128), |v| v.parse())?;
    let batches: Vec<usize> =
        flag(&rest, "batches").unwrap_or("1,16".into()).split(',').map(str::parse).collect::<Result<_, _>>()?;
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("layer: no usable GPU ({e}); SKIPPED, nothing run");
            return Ok(());
        }
    };
    let weights = match flag(&rest, "weights") {
        Some(path) => {
            let index: usize = flag(&rest, "layer-index").map_or(Ok(0), |v| v.parse())?;
            LayerWeights::from_safetensors(&std::fs::read(&path)?, index, &cfg)?
        }
        None => LayerWeights::random(&cfg, 7)?,
    };
    println!(
        "{}: layer d {} heads {}/{} head dim {} ffn {} θ {} eps {}",
        gpu.info().name,
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.rope_theta,
        cfg.eps
    );
    let ceil = ceilings(&gpu)?;
    println!("measured ceilings: copy {:.0} GB/s, bf16 GEMM (ours, 8192³) {:.0} TFLOP/s", ceil.0, ceil.1);
    for b in batches {
        run_batch(&gpu, &cfg, &weights, b, prompt, steps, ceil)?;
    }
    Ok(())
}
