//! One tensor-parallel rank of the Llama decoder layer (`host::tp::TpLayer`):
//! each sequence's prompt is prefilled, then the decode step runs as a CUDA
//! graph with the group's two all-reduces inside it, at each batch size.
//! Run alone, it is TP = 1 through NCCL, timed beside the plain layer's graph;
//! under `tp_launch --ranks N -- tp_layer …` each process is one rank.
//! Every rank prints its capacity ledger (its slice of the weights, its KV
//! cache) and its communication ledger: bytes all-reduced per step (the first
//! all-reduce sums f32 where the O projection leaves split-K sums), each
//! all-reduce timed alone in a graph, and their share of the step.
//!
//! tp_layer [--dims 8b|70b] [--context 4096] [--batches 1,16,64] [--steps 32]

use clap::{Parser, ValueEnum};
use host::data::{cast, random_with_outliers};
use host::layer::{Layer, LayerConfig, LayerWeights};
use host::metrics::median_ms;
use host::ops::SeqId;
use host::tp::launch::RankEnv;
use host::tp::nccl::{Communicator, Nccl, Summable};
use host::tp::{Reduction, TpLayer};
use host::{bf16, Gpu, Tensor};
use std::process::ExitCode;
use std::time::Duration;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy, ValueEnum)]
enum Dims {
    /// Llama-3-8B: d 4096, 32/8 heads, FFN 14336
    #[value(name = "8b")]
    Llama8B,
    /// Llama-3-70B: d 8192, 64/8 heads, FFN 28672
    #[value(name = "70b")]
    Llama70B,
}

/// A tensor-parallel rank of the decoder layer: decode steps in a graph, with
/// the communication ledger.
#[derive(Parser)]
#[command(name = "tp_layer")]
struct Cli {
    /// The layer's dimensions
    #[arg(long, value_enum, default_value = "8b")]
    dims: Dims,
    /// Tokens of context per sequence before the timed steps
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Batch sizes, comma-separated; each runs on its own
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    batches: Vec<usize>,
    /// Timed decode steps per batch (after one plain step and the capture)
    #[arg(long, default_value_t = 32)]
    steps: usize,
}

impl Dims {
    fn config(self) -> LayerConfig {
        let c = LayerConfig::default();
        match self {
            Dims::Llama8B => LayerConfig { d_model: 4096, n_heads: 32, n_kv_heads: 8, head_dim: 128, d_ff: 14336, ..c },
            Dims::Llama70B => {
                LayerConfig { d_model: 8192, n_heads: 64, n_kv_heads: 8, head_dim: 128, d_ff: 28672, ..c }
            }
        }
    }
}

/// Prompts go through in groups of this many sequences, so the prefill's
/// scratch stays a few GB at any batch.
const PREFILL_GROUP: usize = 8;

/// Either layer, for the same timing code.
trait Decoder {
    fn add_sequence(&mut self) -> SeqId;
    fn prefill(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqId],
        lens: &[usize],
        x: &Tensor<bf16>,
        out: &mut Tensor<bf16>,
    ) -> Res<()>;
    /// One plain step, then the capture; returns the median ms of a graph step.
    fn graph_step_ms(&mut self, gpu: &Gpu, seqs: &[SeqId], xs: &[Tensor<bf16>], steps: usize) -> Res<f64>;
}

/// The same methods on both layers (their decode graphs are of different types).
macro_rules! decoder {
    ($layer:ty) => {
        impl Decoder for $layer {
            fn add_sequence(&mut self) -> SeqId {
                <$layer>::add_sequence(self)
            }

            fn prefill(
                &mut self,
                gpu: &Gpu,
                s: &[SeqId],
                lens: &[usize],
                x: &Tensor<bf16>,
                out: &mut Tensor<bf16>,
            ) -> Res<()> {
                Ok(<$layer>::prefill(self, gpu, s, lens, x, out)?)
            }

            fn graph_step_ms(&mut self, gpu: &Gpu, seqs: &[SeqId], xs: &[Tensor<bf16>], steps: usize) -> Res<f64> {
                let mut out = Tensor::filled(gpu, xs[0].shape(), bf16::NAN)?;
                self.decode(gpu, seqs, &xs[0], &mut out)?;
                let mut g = self.capture_decode(gpu, seqs, &xs[1], &mut out)?;
                Ok(median_ms(gpu, 2, steps, |i| self.decode_graph(gpu, &mut g, &xs[i % xs.len()], &mut out))?)
            }
        }
    };
}

decoder!(Layer);
decoder!(TpLayer<'_>);

fn upload(gpu: &Gpu, seed: u64, rows: usize, d: usize) -> Res<Tensor<bf16>> {
    let v: Vec<bf16> = cast(&random_with_outliers(seed, rows * d, 1.0));
    Ok(Tensor::from_host(gpu, &v, &[rows, d])?)
}

/// `b` sequences of `context` tokens each in `layer`, then the median ms of a
/// decode step replayed from a graph.
fn decode_at(gpu: &Gpu, layer: &mut dyn Decoder, d: usize, b: usize, context: usize, steps: usize) -> Res<f64> {
    let seqs: Vec<SeqId> = (0..b).map(|_| layer.add_sequence()).collect();
    for group in seqs.chunks(PREFILL_GROUP) {
        let lens = vec![context; group.len()];
        let x = upload(gpu, 7, group.len() * context, d)?;
        let mut out = Tensor::filled(gpu, x.shape(), bf16::NAN)?;
        layer.prefill(gpu, group, &lens, &x, &mut out)?;
    }
    let xs: Vec<Tensor<bf16>> = (0..4).map(|i| upload(gpu, 100 + i, b, d)).collect::<Res<_>>()?;
    layer.graph_step_ms(gpu, &seqs, &xs, steps)
}

/// The median ms of one all-reduce `r`, replayed from a graph.
fn all_reduce_ms(gpu: &Gpu, comm: &Communicator, r: Reduction, reps: usize) -> Res<f64> {
    fn timed<T: Summable>(gpu: &Gpu, comm: &Communicator, mut t: Tensor<T>, reps: usize) -> Res<f64> {
        let g = gpu.capture(|| comm.all_reduce_sum(gpu, &mut t))?;
        // SAFETY: the graph points into `t`, which outlives every replay.
        Ok(median_ms(gpu, 3, reps, |_| unsafe { gpu.launch_graph(&g) })?)
    }
    match r.f32_sums {
        true => timed(gpu, comm, Tensor::filled(gpu, &[r.elements], 0.5f32)?, reps),
        false => timed(gpu, comm, Tensor::filled(gpu, &[r.elements], bf16::from_f32(0.5))?, reps),
    }
}

fn run(cli: Cli) -> Res<()> {
    let c = cli.dims.config();
    let d = c.d_model;
    let env = RankEnv::from_env()?;
    let nccl = std::sync::Arc::new(Nccl::load()?);
    let gpu = Gpu::new()?;
    let (world, rank, id) = match &env {
        Some(env) => (env.world, env.rank, env.unique_id(&nccl, Duration::from_secs(120))?),
        None => (1, 0, nccl.unique_id()?),
    };
    let comm = Communicator::new(&nccl, &gpu, world, rank, &id)?;
    let (major, minor, patch) = nccl.version()?;
    let who = format!("rank {rank}/{world}");
    println!("{who}: {}, NCCL {major}.{minor}.{patch}", gpu.info().name);
    let w = LayerWeights::random(&c, 1)?;
    let max_b = cli.batches.iter().copied().max().unwrap_or(1);
    let max_pos = cli.context + cli.steps + 8;
    let cache_tokens = max_b * (max_pos + 16);
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    for &b in &cli.batches {
        let mut tp = TpLayer::new(&gpu, &c, &w, &comm, cache_tokens, 16, max_pos)?;
        let p = tp.plan().clone();
        let tp_ms = decode_at(&gpu, &mut tp, d, b, cli.context, cli.steps)?;
        // The first all-reduce sums the O projection's f32 split-K sums where it leaves them.
        let [r1, r2] = tp.decode_all_reduces(&gpu, b)?;
        let (first_ms, second_ms) = (all_reduce_ms(&gpu, &comm, r1, 50)?, all_reduce_ms(&gpu, &comm, r2, 50)?);
        let (first, second) = (r1.bytes(), r2.bytes());
        // Ring all-reduce: each rank sends and receives 2·(n − 1)/n of the tensor.
        let link_bytes = 2 * (first + second) * (world - 1) / world;
        println!(
            "{who}: b{b} L{}: decode step in a graph {:.4} ms (heads {:?}, KV heads {:?}, FFN {:?})",
            cli.context, tp_ms, p.q_heads, p.kv_heads, p.ffn
        );
        println!(
            "{who}:   communication: all-reduces of {first} and {second} bytes per step, {link_bytes} bytes sent per rank; each alone in a graph {:.2} and {:.2} µs, together {:.1}% of the step",
            first_ms * 1e3,
            second_ms * 1e3,
            100.0 * (first_ms + second_ms) / tp_ms
        );
        println!(
            "{who}:   capacity: weights {:.3} GiB, KV cache {:.3} GiB, activations {:.3} GiB",
            gib(tp.layer().weight_bytes()),
            gib(tp.layer().cache().pool_bytes()),
            gib(tp.layer().activation_bytes())
        );
        drop(tp);
        if world == 1 {
            let mut plain = Layer::new(&gpu, &c, &w, cache_tokens, 16, max_pos)?;
            let plain_ms = decode_at(&gpu, &mut plain, d, b, cli.context, cli.steps)?;
            println!(
                "{who}:   the plain layer's graph step {plain_ms:.4} ms: TP = 1 through NCCL reads {:.3}×",
                plain_ms / tp_ms
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tp_layer: {e}");
            ExitCode::FAILURE
        }
    }
}
