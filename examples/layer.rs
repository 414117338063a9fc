//! The fused decoder layer end to end: prefill of a prompt, then decode steps, at
//! batch 1 and batch 16, with a slice of the output checked against the f64 CPU
//! reference, times, tokens/s, launch counts and the four ledgers (capacity,
//! bandwidth, compute, communication).
//!
//! cargo xtask layer [--prompt=2048] [--steps=128] [--batches=1,16]
//!     [--weights=model.safetensors --layer-index=0] [--d-model=… --heads=… …]
//!
//! Every flag, and the weights file, is checked before the GPU driver is touched.

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use host::data::{cast, random_with_outliers, to_f64};
use host::layer::reference::{layer_forward, RefCache};
use host::layer::{Layer, LayerConfig, LayerWeights, Stage};
use host::metrics::{median_ms, rel_l2_error};
use host::ops::{linear, SeqId};
use host::reference::round_bf16;
use host::{bf16, Gpu, Tensor};
use std::path::PathBuf;
use std::process::ExitCode;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The fused decoder layer: prefill, then decode steps at each batch size, checked
/// against the CPU reference, with times, launch counts and the four ledgers.
#[derive(Parser)]
#[command(name = "layer")]
struct Cli {
    /// Prompt tokens per sequence
    #[arg(long, value_name = "TOKENS", default_value_t = 2048, value_parser = at_least(1))]
    prompt: usize,
    /// Decode steps: one warm-up step, then STEPS - 1 timed ones
    #[arg(long, default_value_t = 128, value_parser = at_least(2))]
    steps: usize,
    /// Batch sizes, comma-separated; each runs on its own
    #[arg(long, value_name = "B,B,...", value_delimiter = ',', default_value = "1,16", value_parser = at_least(1))]
    batches: Vec<usize>,
    /// Weights: a safetensors file with Hugging Face names (bf16, f16 or f32); seeded random weights without it
    #[arg(long, value_name = "FILE")]
    weights: Option<PathBuf>,
    /// Which layer of the --weights file
    #[arg(long, value_name = "N", default_value_t = 0, requires = "weights")]
    layer_index: usize,
    /// Model width
    #[arg(long, value_name = "N", default_value_t = LayerConfig::default().d_model, value_parser = at_least(1))]
    d_model: usize,
    /// Query heads
    #[arg(long, value_name = "N", default_value_t = LayerConfig::default().n_heads, value_parser = at_least(1))]
    heads: usize,
    /// Key/value heads (grouped-query attention); must divide --heads
    #[arg(long, value_name = "N", default_value_t = LayerConfig::default().n_kv_heads, value_parser = at_least(1))]
    kv_heads: usize,
    /// Head dimension: 64 or 128
    #[arg(long, value_name = "N", default_value_t = LayerConfig::default().head_dim, value_parser = head_dim)]
    head_dim: usize,
    /// MLP hidden width
    #[arg(long, value_name = "N", default_value_t = LayerConfig::default().d_ff, value_parser = at_least(1))]
    ffn: usize,
    /// RoPE base
    #[arg(long, value_name = "THETA", default_value_t = LayerConfig::default().rope_theta, value_parser = positive)]
    rope_theta: f64,
    /// RMSNorm epsilon
    #[arg(long, default_value_t = LayerConfig::default().eps, value_parser = epsilon)]
    eps: f32,
}

fn at_least(min: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |s| match s.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        Ok(_) => Err(format!("must be at least {min}")),
        Err(_) => Err("not a whole number".into()),
    }
}

fn head_dim(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ (64 | 128)) => Ok(n),
        _ => Err("the kernels take head dimension 64 or 128".into()),
    }
}

fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err("must be a positive number".into()),
    }
}

fn epsilon(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err("must be a finite number, zero or more".into()),
    }
}

impl Cli {
    /// The layer's shape, with the checks that involve more than one flag.
    fn config(&self) -> Result<LayerConfig, String> {
        for (flag, value) in [("--d-model", self.d_model), ("--ffn", self.ffn)] {
            if !value.is_multiple_of(8) {
                return Err(format!("{flag}={value}: must be a multiple of 8 (16-byte bf16 rows)"));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!("--heads={} is not a multiple of --kv-heads={}", self.heads, self.kv_heads));
        }
        let c = LayerConfig {
            d_model: self.d_model,
            n_heads: self.heads,
            n_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            d_ff: self.ffn,
            rope_theta: self.rope_theta,
            eps: self.eps,
        };
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }

    /// The --weights file, read and checked on the CPU: it exists, is a safetensors
    /// file, and holds layer --layer-index in the shapes of the config.
    fn load_weights(&self, path: &std::path::Path, c: &LayerConfig) -> Result<LayerWeights, String> {
        let at = format!("--weights={}", path.display());
        let bytes = std::fs::read(path).map_err(|e| format!("{at}: cannot read: {e}"))?;
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| format!("{at}: not a safetensors file: {e}"))?;
        LayerWeights::from_safetensors(&bytes, self.layer_index, c)
            .map_err(|e| format!("{at} --layer-index={}: {e}", self.layer_index))
    }
}

/// Stops the way clap does for a bad flag: the message, the usage line, exit code 2.
fn flag_error(message: String) -> ! {
    Cli::command().error(ErrorKind::ValueValidation, message).exit()
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
    // Room for the measured run and the profiled one, each sequence in whole pages.
    const PAGE: usize = 64;
    let mut layer = Layer::new(gpu, c, w, 2 * b * max_len.next_multiple_of(PAGE), PAGE, max_len)?;
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

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("layer: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Res<()> {
    let cfg = cli.config().unwrap_or_else(|m| flag_error(m));
    let file_weights = cli.weights.as_ref().map(|path| cli.load_weights(path, &cfg).unwrap_or_else(|m| flag_error(m)));
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("layer: no usable GPU ({e}); SKIPPED, nothing run");
            return Ok(());
        }
    };
    let weights = match file_weights {
        Some(w) => w,
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
    for &b in &cli.batches {
        run_batch(&gpu, &cfg, &weights, b, cli.prompt, cli.steps, ceil)?;
    }
    Ok(())
}
