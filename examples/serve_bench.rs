//! Serving throughput of a whole model under continuous batching: requests of
//! seeded random prompt and output lengths arrive (all at once, or as a Poisson
//! stream at `--rate`), join the running batch between decode steps (their
//! prompts prefilled together, within a token budget; with `--chunked` a long
//! prompt's chunks over several steps; with `--shared-prefix` every prompt
//! starts with one system prompt, prefilled once and forked) and leave when done. Each
//! decode step replays the CUDA graph of its batch size. Reports throughput and
//! the p50/p99 of time to first token and inter-token latency, and writes an SVG.
//!
//! `--soak-steps N` then runs N more decode steps of the same traffic and checks
//! that free HBM (`cuMemGetInfo`) did not move. A greedy probe request, run
//! alone first, is sent again every `--check-every` steps; its tokens must
//! equal the lone run's, up to the first step whose top-2 margin in the lone run
//! is within `--tie-tolerance` of the top logit (rounding differs between batch
//! sizes, so a near-tie may go either way).
//!
//! cargo xtask serve-bench [--model DIR | --layers N] [--requests N] [--max-batch B]
//!     [--prompt MIN..MAX] [--output MIN..MAX] [--rate R] [--mixed] [--chunked] [--prefill-tokens N]
//!     [--shared-prefix N] [--soak-steps N] [--svg FILE]

use clap::Parser;
use host::model::{Checkpoint, Model, ModelConfig, ModelGraph, ModelOptions};
use host::ops::{sample, SampleOutput, SamplingParams, SeqId};
use host::{bf16, Gpu, Tensor};
use plotters::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Parser)]
#[command(name = "serve_bench")]
struct Cli {
    /// A Hugging Face checkpoint folder; without it, seeded random Llama-3-8B-sized weights
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Random model: this many layers instead of 32 (a short soak)
    #[arg(long)]
    layers: Option<usize>,
    /// Requests in the timed run
    #[arg(long, default_value_t = 256)]
    requests: usize,
    /// Most sequences decoded together
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Prompt lengths (past any shared prefix), uniform in MIN..MAX tokens
    #[arg(long, value_parser = parse_range, default_value = "32..1024")]
    prompt: (usize, usize),
    /// Output lengths, uniform in MIN..MAX tokens
    #[arg(long, value_parser = parse_range, default_value = "16..512")]
    output: (usize, usize),
    /// Arrivals per second (Poisson); without it every request arrives at the start
    #[arg(long)]
    rate: Option<f64>,
    /// Most prompt tokens prefilled in one step (without --chunked, at least one whole prompt)
    #[arg(long, default_value_t = 8192)]
    prefill_tokens: usize,
    /// New prompts join in a mixed step with the running sequences' next tokens
    /// (one pass over the weights) instead of a prefill step of their own
    #[arg(long)]
    mixed: bool,
    /// Every prompt starts with the same N tokens (a system prompt): prefilled
    /// once on a sequence the server keeps, each request forked from it (its
    /// pages shared) and prefilled from there on
    #[arg(long, value_name = "N", default_value_t = 0)]
    shared_prefix: usize,
    /// With --shared-prefix, prefill the prefix with each request instead of
    /// forking it: the same traffic, for comparison
    #[arg(long)]
    unshared: bool,
    /// Prompts longer than the step's budget are split across steps (chunked
    /// prefill: each chunk attends to the ones before it), so a step never
    /// carries more than `--prefill-tokens` prompt tokens
    #[arg(long)]
    chunked: bool,
    /// Sampling temperature of the requests (0: greedy); each request has its own seed
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Nucleus mass of the requests
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// After the timed run, this many more decode steps, checking HBM and the probe
    #[arg(long, value_name = "N")]
    soak_steps: Option<u64>,
    /// Decode steps between probe requests in the soak
    #[arg(long, default_value_t = 5000)]
    check_every: u64,
    /// Top-2 margin of the lone probe run, relative to its top logit (at least 1),
    /// under which a differing token is a tie (a bf16 step is 2^-7 = 0.0078 of a value)
    #[arg(long, default_value_t = 0.02)]
    tie_tolerance: f32,
    /// Write the plot here
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
}

fn parse_range(s: &str) -> Result<(usize, usize), String> {
    let (a, b) = s.split_once("..").ok_or("expected MIN..MAX")?;
    let (a, b): (usize, usize) = (a.parse().map_err(|e| format!("{e}"))?, b.parse().map_err(|e| format!("{e}"))?);
    if a == 0 || a > b {
        return Err(format!("{s}: need 0 < MIN <= MAX"));
    }
    Ok((a, b))
}

#[derive(Clone)]
struct Request {
    prompt: Vec<u32>,
    output: usize,
    arrival_s: f64,
    params: SamplingParams,
    probe: bool,
}

/// Tokens `from..to` of `req`'s prompt, run in one step on `seq` (which holds
/// the ones before).
struct Chunk {
    req: Request,
    seq: SeqId,
    from: usize,
    to: usize,
}

struct Live {
    req: Request,
    seq: SeqId,
    tokens: Vec<u32>,
    last_s: f64,
}

/// What a run measured.
#[derive(Default)]
struct Record {
    ttft_ms: Vec<f64>,
    itl_ms: Vec<f64>,
    /// (time s, live sequences) per decode step.
    batch: Vec<(f64, usize)>,
    tokens: usize,
    steps: u64,
    /// Steps that carried prompt tokens, and the wall time they took.
    prompt_steps: u64,
    prompt_s: f64,
    probes: Vec<Vec<u32>>,
}

/// Makes requests: seeded lengths and ids, arrivals from `start_s` on.
struct Traffic<'a> {
    cli: &'a Cli,
    rng: StdRng,
    vocab: usize,
    clock_s: f64,
    made: u64,
    /// `--shared-prefix` tokens every prompt starts with.
    prefix: Vec<u32>,
}

impl Traffic<'_> {
    fn next(&mut self) -> Request {
        let len = self.rng.gen_range(self.cli.prompt.0..=self.cli.prompt.1);
        let tail = (0..len).map(|_| self.rng.gen_range(0..self.vocab as u32));
        let prompt = self.prefix.iter().copied().chain(tail).collect();
        if let Some(rate) = self.cli.rate {
            self.clock_s += -(1.0 - self.rng.gen::<f64>()).ln() / rate;
        }
        self.made += 1;
        let seed = self.cli.seed.wrapping_mul(1_000_003).wrapping_add(self.made);
        Request {
            prompt,
            output: self.rng.gen_range(self.cli.output.0..=self.cli.output.1),
            arrival_s: self.clock_s,
            params: SamplingParams {
                temperature: self.cli.temperature,
                top_k: 0,
                top_p: self.cli.top_p,
                seed,
                step: 0,
            },
            probe: false,
        }
    }
}

struct Server<'a> {
    gpu: &'a Gpu,
    model: Model,
    graphs: HashMap<usize, ModelGraph>,
    eos: Vec<u32>,
    cli: &'a Cli,
    start: Instant,
    /// The sequence holding `--shared-prefix`'s tokens, and their count: new
    /// requests fork it.
    prefix: Option<(SeqId, usize)>,
}

impl Server<'_> {
    fn now_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Runs `chunks` in one step: with `mixed`, together with the next token of
    /// every live sequence (`Model::mixed`, one pass over the weights), else as
    /// a prefill. Prompts that end in this step draw their first token and go
    /// live; the others wait in `filling` for their next chunk.
    fn prompt_step(
        &mut self,
        chunks: Vec<Chunk>,
        mixed: bool,
        live: &mut Vec<Live>,
        filling: &mut VecDeque<Chunk>,
        rec: &mut Record,
    ) -> Res<()> {
        let (gpu, vocab) = (self.gpu, self.model.config().vocab_size);
        let seqs: Vec<SeqId> = chunks.iter().map(|c| c.seq).collect();
        let prompts: Vec<&[u32]> = chunks.iter().map(|c| &c.req.prompt[c.from..c.to]).collect();
        let running: &[Live] = if mixed { live } else { &[] };
        let ids: Vec<u32> = running.iter().map(|l| *l.tokens.last().expect("first token drawn")).collect();
        let params: Vec<SamplingParams> = chunks
            .iter()
            .map(|c| c.req.params)
            .chain(running.iter().map(|l| SamplingParams { step: l.tokens.len() as u64, ..l.req.params }))
            .collect();
        let running: Vec<SeqId> = running.iter().map(|l| l.seq).collect();
        let rows = seqs.len() + running.len();
        let began = self.now_s();
        let drawn = (|| -> Res<Vec<u32>> {
            let mut logits = Tensor::filled(gpu, &[rows, vocab], bf16::ZERO)?;
            if mixed {
                self.model.mixed(gpu, &seqs, &prompts, &running, &ids, &mut logits)?;
            } else {
                self.model.prefill(gpu, &seqs, &prompts, &mut logits)?;
            }
            let mut out = SampleOutput::new(gpu, rows, false)?;
            sample(gpu, &logits, &params, &mut out)?;
            Ok(out.tokens(gpu)?)
        })();
        let drawn = self.or_release(&seqs, drawn)?;
        let now = self.now_s();
        rec.prompt_steps += 1;
        rec.prompt_s += now - began;
        let (first, next) = drawn.split_at(seqs.len());
        if mixed {
            for (l, &id) in live.iter_mut().zip(next) {
                l.tokens.push(id);
                rec.itl_ms.push((now - l.last_s) * 1e3);
                l.last_s = now;
            }
            rec.steps += 1;
            rec.batch.push((now, live.len()));
        }
        for (c, &id) in chunks.into_iter().zip(first) {
            if c.to < c.req.prompt.len() {
                filling.push_back(Chunk { from: c.to, ..c });
                continue;
            }
            rec.ttft_ms.push((now - c.req.arrival_s) * 1e3);
            live.push(Live { req: c.req, seq: c.seq, tokens: vec![id], last_s: now });
        }
        Ok(())
    }

    /// This step's prompt tokens, at most `--prefill-tokens`: with `--chunked`,
    /// the next chunk of each prompt already started, then new arrivals, the
    /// last one cut where the budget ends; else whole new prompts (at least
    /// one). New prompts join only while fewer than `--max-batch` sequences are
    /// live or filling.
    fn plan_chunks(
        &mut self,
        queue: &mut VecDeque<Request>,
        live: usize,
        filling: &mut VecDeque<Chunk>,
    ) -> Res<Vec<Chunk>> {
        let (now, chunked) = (self.now_s(), self.cli.chunked);
        let mut budget = self.cli.prefill_tokens;
        let mut chunks = Vec::new();
        while chunked && budget > 0 {
            let Some(c) = filling.pop_front() else { break };
            let to = c.req.prompt.len().min(c.from + budget);
            budget -= to - c.from;
            chunks.push(Chunk { to, ..c });
        }
        // With a shared prefix a request starts as a fork past it.
        let from = self.prefix.map_or(0, |(_, n)| n);
        while let Some(r) = queue.front() {
            let own = r.prompt.len() - from;
            let fits = if chunked { budget > 0 } else { chunks.is_empty() || own <= budget };
            if r.arrival_s > now || live + filling.len() + chunks.len() >= self.cli.max_batch || !fits {
                break;
            }
            let req = queue.pop_front().expect("front exists");
            let to = if chunked { req.prompt.len().min(from + budget) } else { req.prompt.len() };
            budget = budget.saturating_sub(to - from);
            let seq = match self.prefix {
                Some((root, _)) => self.model.fork(self.gpu, root)?,
                None => self.model.add_sequence(),
            };
            chunks.push(Chunk { seq, from, to, req });
        }
        Ok(chunks)
    }

    /// The drawn tokens, or on an error the new sequences released and the error.
    fn or_release(&mut self, seqs: &[SeqId], drawn: Res<Vec<u32>>) -> Res<Vec<u32>> {
        if drawn.is_err() {
            for &s in seqs {
                self.model.release(s)?;
            }
        }
        drawn
    }

    /// One decode step of every live sequence through the graph of its batch size.
    fn decode(&mut self, live: &mut [Live]) -> Res<Vec<u32>> {
        let seqs: Vec<SeqId> = live.iter().map(|l| l.seq).collect();
        let ids: Vec<u32> = live.iter().map(|l| *l.tokens.last().expect("first token drawn")).collect();
        let params: Vec<SamplingParams> =
            live.iter().map(|l| SamplingParams { step: l.tokens.len() as u64, ..l.req.params }).collect();
        let g = match self.graphs.entry(seqs.len()) {
            std::collections::hash_map::Entry::Occupied(e) => {
                let g = e.into_mut();
                self.model.decode_graph_for(self.gpu, g, &seqs, &ids, &params)?;
                g
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(self.model.capture_decode(self.gpu, &seqs, &ids, &params)?)
            }
        };
        Ok(g.tokens(self.gpu)?)
    }

    /// Serves requests from `queue` (and from `more`, when given, until `steps`
    /// decode steps have run) until none is left.
    fn run(&mut self, queue: &mut VecDeque<Request>, mut more: Option<(&mut Traffic, u64)>) -> Res<Record> {
        let mut rec = Record::default();
        let mut live: Vec<Live> = Vec::new();
        let mut filling: VecDeque<Chunk> = VecDeque::new();
        loop {
            if let Some((traffic, steps)) = more.as_mut() {
                if rec.steps < *steps {
                    while queue.len() < self.cli.max_batch {
                        // The soak keeps the queue full: every request has arrived.
                        let r = Request { arrival_s: self.now_s(), ..traffic.next() };
                        queue.push_back(r);
                    }
                }
            }
            let chunks = self.plan_chunks(queue, live.len(), &mut filling)?;
            if !chunks.is_empty() && self.cli.mixed && !live.is_empty() {
                // This step decoded the live sequences too.
                self.prompt_step(chunks, true, &mut live, &mut filling, &mut rec)?;
                self.retire(&mut live, &mut rec)?;
                continue;
            }
            if !chunks.is_empty() {
                self.prompt_step(chunks, false, &mut live, &mut filling, &mut rec)?;
            }
            self.retire(&mut live, &mut rec)?;
            if live.is_empty() {
                if !filling.is_empty() {
                    continue;
                }
                match queue.front() {
                    None => return Ok(rec),
                    Some(r) => {
                        let wait = r.arrival_s - self.now_s();
                        if wait > 0.0 {
                            std::thread::sleep(std::time::Duration::from_secs_f64(wait));
                        }
                        continue;
                    }
                }
            }
            let ids = self.decode(&mut live)?;
            let now = self.now_s();
            rec.steps += 1;
            rec.batch.push((now, live.len()));
            for (l, id) in live.iter_mut().zip(ids) {
                l.tokens.push(id);
                rec.itl_ms.push((now - l.last_s) * 1e3);
                l.last_s = now;
            }
            self.retire(&mut live, &mut rec)?;
        }
    }

    /// Releases the sequences that reached their length or an end token.
    fn retire(&mut self, live: &mut Vec<Live>, rec: &mut Record) -> Res<()> {
        let mut i = 0;
        while i < live.len() {
            let l = &live[i];
            let last = *l.tokens.last().expect("first token drawn");
            if l.tokens.len() >= l.req.output || self.eos.contains(&last) {
                let l = live.swap_remove(i);
                self.model.release(l.seq)?;
                rec.tokens += l.tokens.len();
                if l.req.probe {
                    rec.probes.push(l.tokens);
                }
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// The probe alone: its tokens and each step's top-2 margin over its top
    /// logit (at least 1).
    fn alone(&mut self, probe: &Request) -> Res<(Vec<u32>, Vec<f32>)> {
        let (gpu, vocab) = (self.gpu, self.model.config().vocab_size);
        let seq = self.model.add_sequence();
        let mut logits = Tensor::filled(gpu, &[1, vocab], bf16::ZERO)?;
        self.model.prefill(gpu, &[seq], &[&probe.prompt], &mut logits)?;
        let (mut tokens, mut margins) = (Vec::new(), Vec::new());
        for _ in 0..probe.output {
            let row: Vec<f32> = logits.to_host(gpu)?.iter().map(|x| x.to_f32()).collect();
            let (id, margin) = top2(&row);
            tokens.push(id);
            margins.push(margin / row[id as usize].abs().max(1.0));
            if tokens.len() == probe.output {
                break;
            }
            self.model.decode(gpu, &[seq], &[id], &mut logits)?;
        }
        self.model.release(seq)?;
        Ok((tokens, margins))
    }
}

/// The argmax (first of ties) and its margin over the runner-up.
fn top2(row: &[f32]) -> (u32, f32) {
    let (mut best, mut second) = (0usize, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate().skip(1) {
        if v > row[best] {
            second = row[best];
            best = i;
        } else if v > second {
            second = v;
        }
    }
    (best as u32, row[best] - second)
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn summary(name: &str, rec: &mut Record, wall_s: f64) {
    println!(
        "{name}: {} tokens in {wall_s:.2} s = {:.1} tokens/s over {} decode steps (mean batch {:.1}) | TTFT p50 {:.1} ms p99 {:.1} ms | ITL p50 {:.2} ms p99 {:.2} ms max {:.2} ms | {} steps with prompt tokens, {:.2} s",
        rec.tokens,
        rec.tokens as f64 / wall_s,
        rec.steps,
        rec.batch.iter().map(|b| b.1).sum::<usize>() as f64 / rec.batch.len().max(1) as f64,
        percentile(&mut rec.ttft_ms, 0.5),
        percentile(&mut rec.ttft_ms, 0.99),
        percentile(&mut rec.itl_ms, 0.5),
        percentile(&mut rec.itl_ms, 0.99),
        percentile(&mut rec.itl_ms, 1.0),
        rec.prompt_steps,
        rec.prompt_s,
    );
}

/// Live sequences over time, and the latency distributions.
fn plot(path: &PathBuf, rec: &mut Record, title: &str) -> Res<()> {
    let root = SVGBackend::new(path, (900, 800)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(400);
    let t_end = rec.batch.last().map_or(1.0, |b| b.0).max(1e-3);
    let b_max = rec.batch.iter().map(|b| b.1).max().unwrap_or(1) as f64;
    let mut c = ChartBuilder::on(&top)
        .caption(title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..t_end, 0.0..b_max * 1.05)?;
    c.configure_mesh().x_desc("time (s)").y_desc("live sequences").draw()?;
    c.draw_series(LineSeries::new(rec.batch.iter().map(|&(t, b)| (t, b as f64)), &BLUE))?;
    rec.ttft_ms.sort_by(f64::total_cmp);
    rec.itl_ms.sort_by(f64::total_cmp);
    let x_max = rec.ttft_ms.last().copied().unwrap_or(1.0).max(rec.itl_ms.last().copied().unwrap_or(1.0));
    let mut c = ChartBuilder::on(&bottom)
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(50)
        .build_cartesian_2d((0.01..x_max * 1.1).log_scale(), 0.0..1.0)?;
    c.configure_mesh().x_desc("latency (ms)").y_desc("fraction").draw()?;
    for (v, color, name) in [(&rec.itl_ms, RED, "inter-token latency"), (&rec.ttft_ms, GREEN, "time to first token")] {
        let n = v.len().max(1) as f64;
        c.draw_series(LineSeries::new(v.iter().enumerate().map(|(i, &x)| (x.max(0.01), (i + 1) as f64 / n)), color))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    c.configure_series_labels().background_style(WHITE).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

fn run(cli: &Cli) -> Res<bool> {
    let ckpt = cli.model.as_ref().map(Checkpoint::open).transpose()?;
    let mut cfg = ckpt.as_ref().map_or_else(ModelConfig::llama3_8b, |c| c.config().clone());
    if let Some(n) = cli.layers {
        if ckpt.is_some() || n == 0 {
            return Err("--layers takes a positive count, and only for the random model".into());
        }
        cfg.num_hidden_layers = n;
    }
    if cli.max_batch == 0 || cli.prefill_tokens == 0 {
        return Err("--max-batch and --prefill-tokens must be at least 1".into());
    }
    if cli.soak_steps.is_some() && (cli.output.1 < 2 || cli.check_every == 0) {
        return Err("the soak needs outputs of 2 tokens or more and --check-every of 1 or more".into());
    }
    // The longest sequence: the shared prefix, its prompt and every new token but the last.
    let context = cli.shared_prefix + cli.prompt.1 + cli.output.1 - 1;
    let b = cli.max_batch;
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("serve_bench: no usable GPU ({e}); SKIPPED, nothing run");
            return Ok(true);
        }
    };
    let opts = ModelOptions::for_batch(b, context);
    let model = match &ckpt {
        Some(c) => Model::load(&gpu, c, opts, true)?,
        None => Model::random(&gpu, &cfg, cli.seed, opts)?,
    };
    let eos = ckpt.as_ref().and_then(|c| c.generation_config()).map(|g| g.eos_token_ids.clone()).unwrap_or_default();
    println!(
        "model: {} layers, d {}, vocab {} ({}); {:.2} GB of weights; batch ≤ {b}, context ≤ {context}",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        if ckpt.is_some() { "checkpoint" } else { "seeded random weights" },
        model.weight_bytes() as f64 / 1e9
    );
    let mut rng = StdRng::seed_from_u64(cli.seed);
    let prefix: Vec<u32> = (0..cli.shared_prefix).map(|_| rng.gen_range(0..cfg.vocab_size as u32)).collect();
    let mut traffic = Traffic { cli, rng, vocab: cfg.vocab_size, clock_s: 0.0, made: 0, prefix };
    let mut srv = Server { gpu: &gpu, model, graphs: HashMap::new(), eos, cli, start: Instant::now(), prefix: None };
    if cli.shared_prefix > 0 && !cli.unshared {
        let root = srv.model.add_sequence();
        let mut one = Tensor::filled(&gpu, &[1, cfg.vocab_size], bf16::ZERO)?;
        srv.model.prefill(&gpu, &[root], &[&traffic.prefix], &mut one)?;
        srv.prefix = Some((root, cli.shared_prefix));
        println!("shared prefix: {} tokens, prefilled once; every request forks it", cli.shared_prefix);
    }

    let mut probe = traffic.next();
    probe.params = SamplingParams::GREEDY;
    probe.output = cli.output.1.min(64);
    probe.probe = true;
    let (probe_ref, margins) = srv.alone(&probe)?;

    // Every batch size's graph first: captures stay out of the timed run.
    warm_graphs(&mut srv, b)?;
    traffic.clock_s = 0.0;
    let mut queue: VecDeque<Request> = (0..cli.requests).map(|_| traffic.next()).collect();
    srv.start = Instant::now();
    let mut rec = srv.run(&mut queue, None)?;
    let wall = srv.now_s();
    summary("serve", &mut rec, wall);
    if let Some(path) = &cli.svg {
        let title = format!("{} requests, batch ≤ {b}: {:.0} tokens/s", cli.requests, rec.tokens as f64 / wall);
        plot(path, &mut rec, &title)?;
        println!("plot: {}", path.display());
    }

    let Some(soak) = cli.soak_steps else { return Ok(true) };
    srv.model.trim(&gpu)?;
    let (free_before, total) = cust::memory::mem_get_info()?;
    let mut ok = true;
    let mut done = 0u64;
    let (mut probes, mut probe_fail) = (0, 0);
    let t0 = Instant::now();
    let mut curve = Vec::new();
    while done < soak {
        let chunk = cli.check_every.min(soak - done);
        let mut queue = VecDeque::from([Request { arrival_s: 0.0, ..probe.clone() }]);
        srv.start = Instant::now();
        let rec = srv.run(&mut queue, Some((&mut traffic, chunk)))?;
        if rec.steps == 0 {
            return Err("a soak chunk ran no decode step".into());
        }
        done += rec.steps;
        // Ten points of the run, trimmed as at the start.
        if curve.len() < (10 * done / soak) as usize {
            srv.model.trim(&gpu)?;
            curve.push((done, cust::memory::mem_get_info()?.0));
        }
        for got in &rec.probes {
            probes += 1;
            let first = got.iter().zip(&probe_ref).position(|(a, b)| a != b);
            if let Some(i) = first.filter(|&i| margins[i] > cli.tie_tolerance) {
                probe_fail += 1;
                println!(
                    "probe: token {i} differs from the lone run ({} vs {}), margin {:.4}",
                    got[i], probe_ref[i], margins[i]
                );
            }
        }
    }
    srv.model.trim(&gpu)?;
    let (free_after, _) = cust::memory::mem_get_info()?;
    // Where growth happened, if it did.
    let points: Vec<String> = curve.iter().map(|(s, f)| format!("{s}: {:+}", *f as i64 - free_before as i64)).collect();
    let (maps, map_bytes) = gpu.tensor_map_usage();
    println!("soak: free HBM vs the start, by step: {}; {maps} tensor maps in {map_bytes} bytes", points.join(", "));
    let growth = free_before as i64 - free_after as i64;
    ok &= growth <= 0 && probe_fail == 0;
    println!(
        "soak: {done} decode steps in {:.1} s, HBM free {} → {} bytes of {total} (growth {growth} bytes), probe {}/{probes} equal to the lone run: {}",
        t0.elapsed().as_secs_f64(),
        free_before,
        free_after,
        probes - probe_fail,
        if ok { "PASS" } else { "FAIL" }
    );
    Ok(ok)
}

/// Captures the graph of every batch size up to `b` not captured yet: for each,
/// that many fresh one-token sequences, one decode step, then released.
fn warm_graphs(srv: &mut Server, b: usize) -> Res<()> {
    let vocab = srv.model.config().vocab_size;
    let missing: Vec<usize> = (1..=b).filter(|n| !srv.graphs.contains_key(n)).collect();
    for n in missing {
        let (mut live, mut rec) = (Vec::new(), Record::default());
        let reqs: Vec<Request> = (0..n)
            .map(|i| Request {
                prompt: vec![(i % vocab) as u32],
                output: 2,
                arrival_s: 0.0,
                params: SamplingParams::GREEDY,
                probe: false,
            })
            .collect();
        let chunks = reqs.into_iter().map(|req| Chunk { seq: srv.model.add_sequence(), from: 0, to: 1, req }).collect();
        srv.prompt_step(chunks, false, &mut live, &mut VecDeque::new(), &mut rec)?;
        srv.decode(&mut live)?;
        for l in live {
            srv.model.release(l.seq)?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("serve_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
