//! Text generation with a whole Llama-family model on the GPU: a Hugging Face
//! checkpoint folder (or, without `--model`, seeded random weights of
//! Llama-3-8B's size), the prompt through the chat template and the tokenizer,
//! prefill, then one CUDA graph per decode step with sampling on the GPU. Text
//! streams to stdout; one line of figures ends the run.
//!
//! cargo xtask generate [--model DIR] [--prompt TEXT] [--max-tokens N]
//!     [--temperature T] [--top-p P] [--top-k K] [--seed S] [--batch B] [--speculate N]
//!
//! Tensor-parallel: `tp_launch --ranks N -- generate --model DIR …` runs one
//! rank per GPU, each loading only its slices of the checkpoint. Rank 0 reads
//! the prompt and broadcasts its token ids; every rank samples, and takes rank
//! 0's draw (broadcast in the decode graph), and rank 0 alone prints.

use clap::Parser;
use host::model::{
    Checkpoint, GreedyCheck, Message, Model, ModelConfig, ModelGraph, ModelOptions, PromptLookup, Tokenizer,
};
use host::ops::{sample, SampleOutput, SamplingParams, SeqId};
use host::tp::launch::RankEnv;
use host::tp::nccl::{Communicator, Nccl};
use host::{bf16, Gpu, Tensor};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// `println!` on the process that prints (rank 0 of a tensor-parallel run).
macro_rules! say {
    ($lead:expr, $($arg:tt)*) => {
        if $lead {
            println!($($arg)*);
        }
    };
}

/// The measured copy rate of the H200 (docs/PERF.md), the floor's denominator.
const COPY_TB_S: f64 = 4.2;

#[derive(Parser)]
#[command(name = "generate")]
struct Cli {
    /// A Hugging Face checkpoint folder; without it, seeded random Llama-3-8B-sized weights
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// The prompt (through the chat template where the checkpoint has one)
    #[arg(long, default_value = "Write a haiku about memory bandwidth.")]
    prompt: String,
    /// Use the prompt as raw text, without the chat template
    #[arg(long)]
    raw: bool,
    /// Random model: prompt tokens (seeded ids) before decoding starts
    #[arg(long, value_name = "N", default_value_t = 4032)]
    prompt_tokens: usize,
    /// New tokens to generate per sequence
    #[arg(long, value_name = "N", default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy (default: the checkpoint's generation_config, else greedy)
    #[arg(long)]
    temperature: Option<f32>,
    /// Nucleus mass, in (0, 1]
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep the K most likely tokens (0: off)
    #[arg(long)]
    top_k: Option<u32>,
    /// The request's seed
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sequences decoded together (the prompt prefilled once and forked into each, or --copies; each its own seed); text shows the first
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Prefill a copy of the prompt for every sequence instead of forking one:
    /// each then reads KV pages of its own, as a batch of distinct prompts does
    /// (`torch_model_decode.py`'s random ones). Forks share the prompt's pages,
    /// which a decode step's sequences then read largely from L2
    #[arg(long)]
    copies: bool,
    /// Prefill the prompt in chunks of at most N tokens, each attending to the
    /// ones before (chunked prefill: the prefill's activations sized for N, not
    /// for the whole prompt); 0: the whole prompt in one step
    #[arg(long, value_name = "N", default_value_t = 0)]
    prefill_chunk: usize,
    /// Longest sequence the model is sized for (KV cache and RoPE table)
    #[arg(long, value_name = "TOKENS", default_value_t = 4096)]
    context: usize,
    /// Keep going past end-of-sequence tokens
    #[arg(long)]
    ignore_eos: bool,
    /// After generating, time one more decode step stage by stage (summed over the layers) and print the ledger
    #[arg(long)]
    ledger: bool,
    /// After generating, prefill the prompt this many more times on fresh sequences and print the
    /// median by CUDA events: the warm figure, beside the cold first prefill in the time to first token
    #[arg(long, value_name = "N", default_value_t = 5)]
    prefill_repeats: usize,
    /// Wait for each decode step's tokens before queuing the next, and time each
    /// step by CUDA events too. By default step n is queued before step n − 1's
    /// tokens are collected, so the GPU never waits for the host between steps
    /// (one step past an end-of-sequence token runs and is dropped)
    #[arg(long)]
    wait_each_step: bool,
    /// Speculative decoding by prompt lookup: each step guesses up to N tokens
    /// from the context (what followed the last earlier occurrence of its final
    /// 1–3 tokens) and checks them in one decode step of several tokens; greedy
    /// only, one sequence, eager steps (no graph; no ledger or warm prefill)
    #[arg(long, value_name = "N", default_value_t = 0)]
    speculate: usize,
}

struct Prompt {
    ids: Vec<u32>,
    tokenizer: Option<Tokenizer>,
    eos: Vec<u32>,
}

fn prompt_of(cli: &Cli, ckpt: Option<&Checkpoint>, vocab: usize) -> Res<Prompt> {
    let Some(ckpt) = ckpt else {
        // Seeded ids: the model is random, so is its text.
        let mut x = cli.seed ^ 0x5851_f42d_4c95_7f2d;
        let ids = (0..cli.prompt_tokens)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) % vocab as u64) as u32
            })
            .collect();
        return Ok(Prompt { ids, tokenizer: None, eos: vec![] });
    };
    let tok = ckpt.tokenizer()?;
    let (text, special) = match (cli.raw, ckpt.chat_template()?) {
        (false, Some(t)) => (t.apply(&[Message::user(cli.prompt.clone())], true)?, false),
        _ => (cli.prompt.clone(), true),
    };
    let ids = tok.encode(&text, special)?;
    let eos = ckpt.generation_config().map(|g| g.eos_token_ids.clone()).unwrap_or_default();
    Ok(Prompt { ids, tokenizer: Some(tok), eos })
}

fn params_of(cli: &Cli, ckpt: Option<&Checkpoint>, batch: usize, step: u64) -> Vec<SamplingParams> {
    let g = ckpt.and_then(|c| c.generation_config());
    let sampled = g.and_then(|g| g.do_sample).unwrap_or(false);
    let temperature =
        cli.temperature.unwrap_or(if sampled { g.and_then(|g| g.temperature).unwrap_or(1.0) } else { 0.0 });
    let top_p = cli.top_p.unwrap_or(if sampled { g.and_then(|g| g.top_p).unwrap_or(1.0) } else { 1.0 });
    let top_k = cli.top_k.unwrap_or(if sampled { g.and_then(|g| g.top_k).unwrap_or(0) as u32 } else { 0 });
    (0..batch)
        .map(|i| SamplingParams { temperature, top_k, top_p, seed: cli.seed.wrapping_add(i as u64), step })
        .collect()
}

/// Prints the text of `ids` past what was printed already.
struct Stream {
    ids: Vec<u32>,
    printed: usize,
    /// Rank 0 (or the only process): the one that prints.
    lead: bool,
}

impl Stream {
    fn push(&mut self, tok: &Tokenizer, id: u32) -> Res<()> {
        self.ids.push(id);
        let text = tok.decode(&self.ids, true)?;
        // Hold back a trailing partial UTF-8 sequence (shown as U+FFFD).
        if self.lead && text.len() > self.printed && !text.ends_with('\u{fffd}') {
            print!("{}", &text[self.printed..]);
            std::io::stdout().flush()?;
            self.printed = text.len();
        }
        Ok(())
    }
}

fn run(cli: &Cli) -> Res<()> {
    let ckpt = cli.model.as_ref().map(Checkpoint::open).transpose()?;
    let cfg = ckpt.as_ref().map_or_else(ModelConfig::llama3_8b, |c| c.config().clone());
    let b = cli.batch.max(1);
    let rank = RankEnv::from_env()?;
    if rank.is_some() && ckpt.is_none() {
        return Err("a tensor-parallel rank loads its slices of a checkpoint: give --model".into());
    }
    let lead = rank.as_ref().is_none_or(|r| r.rank == 0);
    if cli.speculate > 0
        && (b > 1 || rank.is_some() || cli.ledger || params_of(cli, ckpt.as_ref(), 1, 0)[0].temperature != 0.0)
    {
        return Err("--speculate checks drafts greedily, on one sequence of one GPU: give --temperature 0, and no --batch or --ledger".into());
    }
    let mut prompt = prompt_of(cli, ckpt.as_ref(), cfg.vocab_size)?;
    // KV slots: the prompt, every new token but the last (it is never fed back), and the ledger's step.
    let slots = prompt.ids.len() + cli.max_tokens.max(1) - 1 + cli.ledger as usize;
    if prompt.ids.is_empty() || slots > cli.context {
        return Err(format!(
            "a prompt of {} tokens and {} new ones do not fit a context of {}",
            prompt.ids.len(),
            cli.max_tokens,
            cli.context
        )
        .into());
    }
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        // A rank that skipped would leave its peers waiting in NCCL.
        Err(e) if rank.is_some() => return Err(format!("no usable GPU: {e}").into()),
        Err(e) => {
            say!(lead, "generate: no usable GPU ({e}); SKIPPED, nothing run");
            return Ok(());
        }
    };
    let opts = ModelOptions::for_batch(b, cli.context);
    let t0 = Instant::now();
    let mut model = match (&ckpt, &rank) {
        (Some(c), Some(r)) => {
            let nccl = Arc::new(Nccl::load()?);
            let comm = Communicator::new(&nccl, &gpu, r.world, r.rank, &r.unique_id(&nccl, Duration::from_secs(300))?)?;
            // Rank 0 drives: the others take its prompt's ids.
            comm.broadcast_ids(&gpu, &mut prompt.ids)?;
            Model::load_shard(&gpu, c, Box::new(comm), opts)?
        }
        (Some(c), None) => Model::load(&gpu, c, opts, true)?,
        (None, _) => Model::random(&gpu, &cfg, cli.seed, opts)?,
    };
    gpu.synchronize()?;
    let load_s = t0.elapsed().as_secs_f64();
    if let Some(r) = &rank {
        let g = model.group().map_or(0, |g| g.world());
        eprintln!("rank {}/{g}: {:.2} GB of weights (its slices) in {load_s:.1} s", r.rank, gb(model.weight_bytes()));
    }
    match &ckpt {
        _ if !lead => {}
        Some(c) => eprintln!("{}: {:.2} GB of weights in {load_s:.1} s", c.dir().display(), gb(model.weight_bytes())),
        None => eprintln!(
            "seeded random Llama-3-8B-sized weights ({:.2} GB, generated on the GPU in {load_s:.1} s): the text is meaningless, so token ids are not shown",
            gb(model.weight_bytes())
        ),
    }

    // Prefill the prompt once and fork it into every sequence; the first token
    // of each from its last logits.
    let mut logits = Tensor::filled(&gpu, &[b, cfg.vocab_size], bf16::ZERO)?;
    let mut last = Tensor::filled(&gpu, &[1, cfg.vocab_size], bf16::ZERO)?;
    let mut first = SampleOutput::new(&gpu, b, false)?;
    let t_prefill = Instant::now();
    let seqs = prefill_forked(cli, &gpu, &mut model, &prompt.ids, &mut last, &mut logits)?;
    sample(&gpu, &logits, &params_of(cli, ckpt.as_ref(), b, 0), &mut first)?;
    if let Some(group) = model.group() {
        group.broadcast_tokens(&gpu, &mut first)?;
    }
    let mut ids = first.tokens(&gpu)?;
    let ttft = t_prefill.elapsed().as_secs_f64() * 1e3;

    let mut stream = Stream { ids: vec![], printed: 0, lead };
    let show = |stream: &mut Stream, id: u32| -> Res<()> {
        match &prompt.tokenizer {
            Some(t) => stream.push(t, id),
            None => Ok(()),
        }
    };
    show(&mut stream, ids[0])?;
    let done = |id: u32| !cli.ignore_eos && prompt.eos.contains(&id);
    if cli.speculate > 0 {
        let mut show_all = |new: &[u32]| new.iter().try_for_each(|&id| show(&mut stream, id));
        return speculate(cli, &gpu, &mut model, seqs[0], &prompt.ids, ids[0], ttft, &done, &mut show_all);
    }
    let (mut steps, mut gpu_steps) = (Vec::with_capacity(cli.max_tokens), Vec::with_capacity(cli.max_tokens));
    let mut graph: Option<ModelGraph> = None;
    let mut generated = 1;
    if !cli.wait_each_step && generated < cli.max_tokens && !done(ids[0]) {
        // The capture step compiles the graph: not a decode step's time.
        let g = graph.insert(model.capture_decode(&gpu, &seqs, &ids, &params_of(cli, ckpt.as_ref(), b, 1))?);
        ids = g.tokens(&gpu)?;
        generated += 1;
        show(&mut stream, ids[0])?;
        // Step n is queued (with its tokens' read) before step n − 1's tokens are
        // collected; each step's time is the gap between two collections.
        let mut pending = None;
        let mut last = Instant::now();
        // Nothing more is queued after an end token drawn by the capture step.
        let mut queued = if done(ids[0]) { cli.max_tokens } else { generated };
        loop {
            if queued < cli.max_tokens {
                model.decode_graph(&gpu, g, None, &params_of(cli, ckpt.as_ref(), b, queued as u64))?;
                let read = g.queue_tokens(&gpu)?;
                queued += 1;
                if let Some(prev) = pending.replace(read) {
                    ids = g.read_tokens(prev)?;
                } else {
                    continue;
                }
            } else if let Some(prev) = pending.take() {
                ids = g.read_tokens(prev)?;
            } else {
                break;
            }
            let now = Instant::now();
            steps.push((now - last).as_secs_f64() * 1e3);
            last = now;
            generated += 1;
            show(&mut stream, ids[0])?;
            if done(ids[0]) {
                // The step queued behind this one ran past the end: collect and drop it.
                if let Some(extra) = pending.take() {
                    g.read_tokens(extra)?;
                }
                break;
            }
        }
        // The first collection's gap includes the pipeline's fill.
        if !steps.is_empty() {
            steps.remove(0);
        }
    }
    while cli.wait_each_step && generated < cli.max_tokens && !done(ids[0]) {
        let params = params_of(cli, ckpt.as_ref(), b, generated as u64);
        let t = Instant::now();
        match graph.as_mut() {
            None => graph = Some(model.capture_decode(&gpu, &seqs, &ids, &params)?),
            Some(g) => gpu_steps.push(gpu.time_ms(|| model.decode_graph(&gpu, g, None, &params))? as f64),
        }
        ids = graph.as_ref().expect("captured").tokens(&gpu)?;
        // The capture step compiles the graph: not a decode step's time.
        if generated > 1 {
            steps.push(t.elapsed().as_secs_f64() * 1e3);
        }
        generated += 1;
        show(&mut stream, ids[0])?;
    }
    say!(lead, "");
    let ctx = prompt.ids.len() + generated;
    let kv_bytes = b * ctx * 2 * cfg.num_hidden_layers * cfg.kv_dim() * 2;
    let floor_ms = (model.step_weight_bytes(b) + kv_bytes) as f64 / (COPY_TB_S * 1e12) * 1e3;
    if steps.is_empty() {
        say!(lead, "time to first token {ttft:.1} ms (no timed decode steps: raise --max-tokens)");
        drop(graph);
        return warm_prefill(cli, lead, &gpu, &mut model, seqs, &prompt.ids, &mut last, &mut logits);
    }
    let ms = median(&mut steps);
    let gpu_note = if cli.wait_each_step {
        format!("GPU {:.3} ms by CUDA events", median(&mut gpu_steps))
    } else {
        "pipelined: steps queued ahead, no per-step events".to_string()
    };
    // Forks read the prompt's shared pages largely from L2: the floor counts
    // them once per sequence, as distinct prompts would need.
    let how = match (b, cli.copies) {
        (1, _) => String::new(),
        (_, true) => format!(" × {b} copies"),
        (_, false) => format!(", forked into {b}: the floor counts the shared KV once per sequence"),
    };
    say!(
        lead,
        "time to first token {ttft:.1} ms ({} prompt tokens{how}) | {:.1} tokens/s | {ms:.3} ms/token (median of {} steps, batch {b}, context {ctx}; {gpu_note}) | {:.1}% of the copy-rate floor ({floor_ms:.3} ms: {:.2} GB of weights + {:.2} GB of KV at {COPY_TB_S} TB/s)",
        prompt.ids.len(),
        b as f64 * 1e3 / ms,
        steps.len(),
        100.0 * floor_ms / ms,
        gb(model.step_weight_bytes(b)),
        gb(kv_bytes),
    );
    if cli.ledger {
        let mut logits = Tensor::filled(&gpu, &[b, cfg.vocab_size], bf16::ZERO)?;
        let stages = model.decode_profiled(&gpu, &seqs, &ids, &mut logits)?;
        let total: f64 = stages.iter().map(|s| s.ms).sum();
        say!(lead, "ledger of one decode step, stages timed apart (batch {b}, context {}):", ctx + 1);
        for s in &stages {
            say!(
                lead,
                "  {:<50} {:8.3} ms {:7.3} GB {:6.0} GB/s ({:4.1}% of copy) {:4} launches",
                s.name,
                s.ms,
                s.bytes / 1e9,
                s.bytes / s.ms / 1e6,
                s.bytes / s.ms / 1e6 / (COPY_TB_S * 10.0),
                s.launches
            );
        }
        let launches: u64 = stages.iter().map(|s| s.launches).sum();
        say!(
            lead,
            "  {:<50} {total:8.3} ms, {} launches + 1 sampling = graph kernel nodes per step",
            "total",
            launches
        );
    }
    drop(graph);
    let mut logits = Tensor::filled(&gpu, &[b, cfg.vocab_size], bf16::ZERO)?;
    warm_prefill(cli, lead, &gpu, &mut model, seqs, &prompt.ids, &mut last, &mut logits)
}

/// Prefills `prompt` (in chunks of `--prefill-chunk` tokens when given) for
/// `logits.shape()[0]` new sequences: once, then forked into the others,
/// sharing the prompt's pages (`last`, `[1, vocab]`, gets its last logits,
/// copied into each row of `logits`); or with `--copies` once for each.
fn prefill_forked(
    cli: &Cli,
    gpu: &Gpu,
    model: &mut Model,
    prompt: &[u32],
    last: &mut Tensor<bf16>,
    logits: &mut Tensor<bf16>,
) -> host::Result<Vec<SeqId>> {
    let chunk = if cli.prefill_chunk == 0 { prompt.len().max(1) } else { cli.prefill_chunk };
    let b = logits.shape()[0];
    let mut seqs: Vec<SeqId> = (0..if cli.copies { b } else { 1 }).map(|_| model.add_sequence()).collect();
    let prefilled = (|| -> host::Result<()> {
        // An empty prompt: one empty chunk, which the prefill refuses.
        for part in prompt.chunks(chunk).chain(prompt.is_empty().then_some(prompt)) {
            let parts = vec![part; seqs.len()];
            let out = if cli.copies { &mut *logits } else { &mut *last };
            model.prefill(gpu, &seqs, &parts, out)?;
        }
        if cli.copies {
            return Ok(());
        }
        for i in 0..b {
            logits.copy_rows_from(gpu, i, last, 0, 1)?;
            if i > 0 {
                seqs.push(model.fork(gpu, seqs[0])?);
            }
        }
        Ok(())
    })();
    match prefilled {
        Ok(()) => Ok(seqs),
        Err(e) => {
            // The forks made so far too: each holds the prompt's pages.
            for s in seqs {
                let _ = model.release(s);
            }
            Err(e)
        }
    }
}

/// Releases `seqs`, then prefills `prompt` and forks it into `seqs.len()`
/// fresh sequences `--prefill-repeats` times (each released after), timed by
/// CUDA events: the prefill with buffers, tensor maps and kernels already set up.
#[allow(clippy::too_many_arguments)]
fn warm_prefill(
    cli: &Cli,
    lead: bool,
    gpu: &Gpu,
    model: &mut Model,
    seqs: Vec<SeqId>,
    prompt: &[u32],
    last: &mut Tensor<bf16>,
    logits: &mut Tensor<bf16>,
) -> Res<()> {
    if cli.prefill_repeats == 0 {
        return Ok(());
    }
    let b = seqs.len();
    for s in seqs {
        model.release(s)?;
    }
    let mut times = Vec::with_capacity(cli.prefill_repeats);
    for _ in 0..cli.prefill_repeats {
        let mut fresh = Vec::new();
        let ms = gpu.time_ms(|| {
            fresh = prefill_forked(cli, gpu, model, prompt, last, logits)?;
            Ok(())
        })?;
        times.push(ms as f64);
        for s in fresh {
            model.release(s)?;
        }
    }
    say!(
        lead,
        "prefill, warm: {:.2} ms by CUDA events (median of {}; {} prompt tokens, {} {b} sequences)",
        median(&mut times),
        times.len(),
        prompt.len(),
        if cli.copies { "a copy for each of" } else { "forked into" }
    );
    Ok(())
}

/// Greedy speculative decoding of one sequence by prompt lookup
/// (`--speculate N`), after its first token: each step checks the guesses in
/// one decode step of several tokens; prints the tokens a step and the rate.
#[allow(clippy::too_many_arguments)]
fn speculate(
    cli: &Cli,
    gpu: &Gpu,
    model: &mut Model,
    seq: SeqId,
    prompt: &[u32],
    first: u32,
    ttft: f64,
    done: &dyn Fn(u32) -> bool,
    show: &mut dyn FnMut(&[u32]) -> Res<()>,
) -> Res<()> {
    let lookup = PromptLookup::new(3, cli.speculate)?;
    let mut check = GreedyCheck::new();
    let mut context: Vec<u32> = prompt.iter().copied().chain([first]).collect();
    let (mut steps, mut drafted, mut kept) = (0usize, 0usize, 0usize);
    let t = Instant::now();
    while context.len() - prompt.len() < cli.max_tokens && !done(*context.last().expect("first token")) {
        // The drafts stop where the token budget or the context would end.
        let room = (cli.max_tokens + prompt.len() - context.len()).min(cli.context - context.len());
        let drafts: Vec<u32> = lookup.propose(&context).iter().copied().take(room.saturating_sub(1)).collect();
        let new = check.step(gpu, model, seq, *context.last().expect("first token"), &drafts)?;
        let end = new.iter().position(|&id| done(id)).map_or(new.len(), |i| i + 1);
        // Drafts past an end token were kept but not emitted.
        (steps, drafted, kept) = (steps + 1, drafted + drafts.len(), kept + end.min(new.len() - 1));
        show(&new[..end])?;
        context.extend(&new[..end]);
    }
    let s = t.elapsed().as_secs_f64();
    let generated = context.len() - prompt.len() - 1;
    println!();
    println!(
        "time to first token {ttft:.1} ms ({} prompt tokens) | speculative (prompt lookup, up to {} drafts): {generated} tokens in {steps} steps ({:.2} a step; {kept} of {drafted} drafts kept) | {:.1} tokens/s, {:.3} ms a step",
        prompt.len(),
        cli.speculate,
        generated as f64 / steps.max(1) as f64,
        generated as f64 / s,
        s * 1e3 / steps.max(1) as f64,
    );
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn gb(bytes: usize) -> f64 {
    bytes as f64 / 1e9
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("generate: {e}");
            ExitCode::FAILURE
        }
    }
}
