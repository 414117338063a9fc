//! GPU tests of the tensor-parallel layer (`TpLayer`).
//!
//! - TP = 1 through NCCL: a communicator of one rank, the real all-reduce on
//!   the stream and in the decode graph, bit for bit the plain layer's output.
//! - TP = 2 and 4 emulated on one GPU: every rank's `TpLayer` runs in turn with
//!   a stand-in group whose all-reduce sums the ranks' partial outputs on the
//!   host. A rank cannot wait for the others inside its step, so each step runs
//!   twice: the first pass collects every rank's attention partial and stops at
//!   its first all-reduce (the layer undoes the step's cache growth); the second
//!   hands each rank the sum there and collects its MLP partial at the second.
//!   Against the whole layer's f64 reference, the sharded CPU reference and the
//!   plain GPU layer; this exercises every slice and offset of `ShardPlan`.

use host::layer::reference::{layer_forward, RefCache};
use host::layer::{Layer, LayerConfig, LayerWeights};
use host::model::{Checkpoint, Model, ModelGraph, ModelOptions};
use host::ops::SeqId;
use host::ops::{SampleOutput, SamplingParams};
use host::tp::nccl::{Communicator, Nccl};
use host::tp::reference::{self as tp_ref, RankRef};
use host::tp::{AllReduce, DeviceSums, Reduction, ShardPlan, TpLayer};
use host::{bf16, Error, Gpu, Tensor};
use lab::testing::checkpoint::{write_checkpoint, TempDir};
use lab::testing::{cast, expect_close, random_with_outliers, rel_l2_error, to_f64, GpuTests};
use serde_json::json;
use std::cell::RefCell;
use std::rc::Rc;

fn e(err: Error) -> String {
    err.to_string()
}

fn config() -> LayerConfig {
    LayerConfig { d_model: 512, n_heads: 8, n_kv_heads: 4, head_dim: 64, d_ff: 1024, ..LayerConfig::default() }
}

/// The inputs of a prefill of two prompts of `lens` tokens, then three decode steps.
fn inputs(c: &LayerConfig, lens: &[usize]) -> (Vec<usize>, Vec<Vec<bf16>>) {
    let lens = lens.to_vec();
    let steps = 3;
    let prompt: usize = lens.iter().sum();
    let x: Vec<bf16> = cast(&random_with_outliers(22, (prompt + steps * lens.len()) * c.d_model, 1.0));
    let step_len = lens.len() * c.d_model;
    let chunks = std::iter::once(x[..prompt * c.d_model].to_vec())
        .chain(x[prompt * c.d_model..].chunks(step_len).map(<[bf16]>::to_vec))
        .collect();
    (lens, chunks)
}

/// A one-rank NCCL group: prefill, plain decode steps and graph replays give
/// the plain layer's output bit for bit. Split-K sums of more than two slices
/// add by atomics in any order, so two runs of the plain layer agree bit for
/// bit only where no GEMM splits more than two ways: here FFN 512, a prefill
/// of 512 tokens (no GEMM splits) and decode steps of two sequences (two-way
/// splits). A second plain layer checks that premise.
fn one_rank_through_nccl_is_the_layer(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig { d_ff: 512, ..config() };
    let w = LayerWeights::random(&c, 21).map_err(e)?;
    let nccl = std::sync::Arc::new(Nccl::load().map_err(e)?);
    let comm = Communicator::new(&nccl, gpu, 1, 0, &nccl.unique_id().map_err(e)?).map_err(e)?;
    let mut tp = TpLayer::new(gpu, &c, &w, &comm, 1024, 16, 512).map_err(e)?;
    let mut plain = Layer::new(gpu, &c, &w, 1024, 16, 512).map_err(e)?;
    let mut again = Layer::new(gpu, &c, &w, 1024, 16, 512).map_err(e)?;
    // The ledger's account of a step's all-reduces: the second is the MLP's bf16 output.
    let [_, down] = tp.decode_all_reduces(gpu, 2).map_err(e)?;
    if down != (Reduction { elements: 2 * c.d_model, f32_sums: false }) {
        return Err(format!("a two-token decode step's second all-reduce is {down:?}"));
    }
    let (lens, chunks) = inputs(&c, &[300, 212]);
    let s_tp: Vec<SeqId> = lens.iter().map(|_| tp.add_sequence()).collect();
    let s_plain: Vec<SeqId> = lens.iter().map(|_| plain.add_sequence()).collect();
    let s_again: Vec<SeqId> = lens.iter().map(|_| again.add_sequence()).collect();
    let mut graph = None;
    for (i, x) in chunks.iter().enumerate() {
        let t = x.len() / c.d_model;
        let xt = Tensor::from_host(gpu, x, &[t, c.d_model]).map_err(e)?;
        let mut want = Tensor::filled(gpu, &[t, c.d_model], bf16::NAN).map_err(e)?;
        let mut got = Tensor::filled(gpu, &[t, c.d_model], bf16::NAN).map_err(e)?;
        let mut want_again = Tensor::filled(gpu, &[t, c.d_model], bf16::NAN).map_err(e)?;
        if i == 0 {
            plain.prefill(gpu, &s_plain, &lens, &xt, &mut want).map_err(e)?;
            again.prefill(gpu, &s_again, &lens, &xt, &mut want_again).map_err(e)?;
            tp.prefill(gpu, &s_tp, &lens, &xt, &mut got).map_err(e)?;
        } else {
            plain.decode(gpu, &s_plain, &xt, &mut want).map_err(e)?;
            again.decode(gpu, &s_again, &xt, &mut want_again).map_err(e)?;
            match (i, &mut graph) {
                (1, _) => tp.decode(gpu, &s_tp, &xt, &mut got).map_err(e)?,
                (_, None) => graph = Some(tp.capture_decode(gpu, &s_tp, &xt, &mut got).map_err(e)?),
                (_, Some(g)) => tp.decode_graph(gpu, g, &xt, &mut got).map_err(e)?,
            }
        }
        let (want, got) = (want.to_host(gpu).map_err(e)?, got.to_host(gpu).map_err(e)?);
        if want_again.to_host(gpu).map_err(e)? != want {
            return Err(format!("step {i}: two runs of the plain layer differ: the premise of bit identity fails"));
        }
        if got.iter().any(|v| v.is_nan()) {
            return Err(format!("step {i}: NaN in the TP = 1 output"));
        }
        if let Some(j) = (0..got.len()).find(|&j| got[j].to_bits() != want[j].to_bits()) {
            return Err(format!("step {i}: element {j} is {} through NCCL, {} plainly", got[j], want[j]));
        }
    }
    // A further chunk of both prompts (their keys gathered from each layer's
    // cache) gives the plain layer's output, within bf16 tolerance (its GEMMs
    // may split more than two ways).
    let x: Vec<bf16> = cast(&random_with_outliers(23, 57 * c.d_model, 1.0));
    let xt = Tensor::from_host(gpu, &x, &[57, c.d_model]).map_err(e)?;
    let mut want = Tensor::filled(gpu, &[57, c.d_model], bf16::NAN).map_err(e)?;
    let mut got = Tensor::filled(gpu, &[57, c.d_model], bf16::NAN).map_err(e)?;
    plain.prefill(gpu, &s_plain, &[40, 17], &xt, &mut want).map_err(e)?;
    tp.prefill(gpu, &s_tp, &[40, 17], &xt, &mut got).map_err(e)?;
    let (want, got) = (to_f64(&want.to_host(gpu).map_err(e)?), to_f64(&got.to_host(gpu).map_err(e)?));
    expect_close("a chunk after the decode steps", rel_l2_error(&got, &want), 1e-2)?;
    // A fork of the first sequence on each, then a decode step of all three.
    let (f_plain, f_tp) = (plain.fork(gpu, s_plain[0]).map_err(e)?, tp.fork(gpu, s_tp[0]).map_err(e)?);
    let x: Vec<bf16> = cast(&random_with_outliers(24, 3 * c.d_model, 1.0));
    let xt = Tensor::from_host(gpu, &x, &[3, c.d_model]).map_err(e)?;
    let mut want = Tensor::filled(gpu, &[3, c.d_model], bf16::NAN).map_err(e)?;
    let mut got = Tensor::filled(gpu, &[3, c.d_model], bf16::NAN).map_err(e)?;
    plain.decode(gpu, &[s_plain[0], s_plain[1], f_plain], &xt, &mut want).map_err(e)?;
    tp.decode(gpu, &[s_tp[0], s_tp[1], f_tp], &xt, &mut got).map_err(e)?;
    let (want, got) = (to_f64(&want.to_host(gpu).map_err(e)?), to_f64(&got.to_host(gpu).map_err(e)?));
    expect_close("a decode step with a fork", rel_l2_error(&got, &want), 1e-2)?;
    // A plan for another rank than the group's is refused before any upload.
    let other = ShardPlan::new(&c, 2, 1).map_err(e)?;
    let shard = w.shard(&c, &other).map_err(e)?;
    if TpLayer::from_shard(gpu, &c, other, &shard, &comm, 1024, 16, 256).is_ok() {
        return Err("a rank-1-of-2 plan was accepted in a one-rank group".into());
    }
    Ok(())
}

/// One GPU standing in for a group of `world` ranks. A rank cannot wait for
/// the others inside its step, so a step runs in passes: pass p hands each
/// rank the sums of all-reduces 0..p, learnt in earlier passes, then collects
/// every rank's partial at all-reduce p and stops its step there with an error
/// (which undoes the step's cache growth); the pass in which every rank
/// finishes is the step.
struct Emulated {
    world: usize,
    /// The sums of the step's all-reduces learnt so far, in order.
    known: RefCell<Vec<Vec<f32>>>,
    /// Each rank's partial at all-reduce `known.len()` (bf16 outputs or f32
    /// split-K sums, in f32), and how many all-reduces it has made this pass.
    parts: RefCell<Vec<(Option<Vec<f32>>, usize)>>,
}

struct EmulatedRank {
    group: Rc<Emulated>,
    rank: usize,
}

impl EmulatedRank {
    /// One all-reduce of this rank: `read` gives its partial; returns the sum
    /// to write back.
    fn reduce(&self, read: impl FnOnce() -> host::Result<Vec<f32>>) -> host::Result<Vec<f32>> {
        let mut parts = self.group.parts.borrow_mut();
        let (part, calls) = &mut parts[self.rank];
        *calls += 1;
        if let Some(sum) = self.group.known.borrow().get(*calls - 1) {
            return Ok(sum.clone());
        }
        *part = Some(read()?);
        Err(Error::InvalidArgument("emulated group: partial collected".into()))
    }
}

impl AllReduce for EmulatedRank {
    fn world(&self) -> usize {
        self.group.world
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn all_reduce_sum(&self, gpu: &Gpu, t: &mut Tensor<bf16>) -> host::Result<()> {
        let sum = self.reduce(|| Ok(t.to_host(gpu)?.iter().map(|v| v.to_f32()).collect()))?;
        t.copy_from_host(gpu, &sum.into_iter().map(bf16::from_f32).collect::<Vec<_>>())
    }

    fn all_reduce_sums(&self, gpu: &Gpu, sums: &mut DeviceSums) -> host::Result<()> {
        let sum = self.reduce(|| sums.to_host(gpu))?;
        sums.copy_from_host(gpu, &sum)
    }

    /// The sum of the first rank's tokens and the others' zeros (exact in f32
    /// below 2^24).
    fn broadcast_tokens(&self, gpu: &Gpu, tokens: &mut SampleOutput) -> host::Result<()> {
        let first = self.reduce(|| {
            let t = tokens.tokens(gpu)?;
            Ok(t.iter().map(|&id| if self.rank == 0 { id as f32 } else { 0.0 }).collect())
        })?;
        tokens.set_tokens(gpu, &first.iter().map(|&id| id as u32).collect::<Vec<_>>())
    }
}

impl Emulated {
    fn new(world: usize) -> Rc<Emulated> {
        Rc::new(Emulated { world, known: RefCell::new(Vec::new()), parts: RefCell::new(vec![(None, 0); world]) })
    }

    fn ranks(self: &Rc<Self>) -> Vec<EmulatedRank> {
        (0..self.world).map(|rank| EmulatedRank { group: self.clone(), rank }).collect()
    }

    /// The sum of the ranks' collected partials, in f32 in rank order.
    fn sum(&self) -> Result<Vec<f32>, String> {
        let parts = self.parts.borrow();
        let mut acc: Vec<f32> = Vec::new();
        for (r, (part, _)) in parts.iter().enumerate() {
            let part = part.as_ref().ok_or(format!("rank {r} made no all-reduce"))?;
            acc.resize(part.len(), 0.0);
            acc.iter_mut().zip(part).for_each(|(a, p)| *a += p);
        }
        Ok(acc)
    }

    /// One step of every rank (`step(r, rank)` runs rank r's prefill or decode), in passes.
    fn step<R>(&self, ranks: &mut [R], mut step: impl FnMut(usize, &mut R) -> host::Result<()>) -> Result<(), String> {
        self.known.borrow_mut().clear();
        loop {
            self.parts.borrow_mut().iter_mut().for_each(|p| *p = (None, 0));
            let mut finished = 0;
            for (r, rank) in ranks.iter_mut().enumerate() {
                match step(r, rank) {
                    Ok(()) => finished += 1,
                    Err(_) if self.parts.borrow()[r].0.is_some() => {}
                    Err(err) => return Err(format!("rank {r}: {err}")),
                }
            }
            match finished {
                0 => {
                    let sum = self.sum()?;
                    self.known.borrow_mut().push(sum);
                }
                n if n == ranks.len() => return Ok(()),
                n => return Err(format!("{n} of {} ranks finished a pass", ranks.len())),
            }
        }
    }
}

/// TP 2 and 4 (GQA 8/4, head dim 64, FFN 1024): a prefill of two prompts,
/// then three decode steps, against the f64 references and the plain layer;
/// the ranks' caches together hold every KV head of the whole layer's cache.
/// With `fuse`, the decode step's O projection leaves split-K sums the group
/// sums in f32 (the shipped step); without, its bf16 outputs are summed.
fn emulated_tp_matches_the_layer(gpu: &Gpu, fuse: bool) -> Result<(), String> {
    let c = config();
    let w = LayerWeights::random(&c, 21).map_err(e)?;
    let (lens, chunks) = inputs(&c, &[37, 5]);
    let d = c.d_model;
    let mut caches: Vec<RefCache> = lens.iter().map(|_| RefCache::default()).collect();
    let mut plain = Layer::new(gpu, &c, &w, 1024, 16, 256).map_err(e)?;
    plain.fuse_split_finishes = fuse;
    let plain_seqs: Vec<SeqId> = lens.iter().map(|_| plain.add_sequence()).collect();
    let mut wants = Vec::new();
    for (i, x) in chunks.iter().enumerate() {
        let rows = if i == 0 { lens.clone() } else { vec![1; lens.len()] };
        let want = per_sequence(x, &rows, d, |s, x| layer_forward(&c, &w, &to_f64(x), &mut caches[s]));
        let xt = Tensor::from_host(gpu, x, &[x.len() / d, d]).map_err(e)?;
        let mut out = Tensor::filled(gpu, &[x.len() / d, d], bf16::NAN).map_err(e)?;
        match i {
            0 => plain.prefill(gpu, &plain_seqs, &lens, &xt, &mut out).map_err(e)?,
            _ => plain.decode(gpu, &plain_seqs, &xt, &mut out).map_err(e)?,
        }
        wants.push((want, to_f64(&out.to_host(gpu).map_err(e)?)));
    }
    for world in [2, 4] {
        let group = Emulated::new(world);
        let members = group.ranks();
        let mut ranks = Vec::new();
        // The sharded reference: every rank's slice, per sequence (each its own caches).
        let mut refs: Vec<Vec<RankRef>> = lens.iter().map(|_| Vec::new()).collect();
        for m in &members {
            let p = ShardPlan::new(&c, world, m.rank).map_err(e)?;
            let (sc, sw) = (p.shard_config(&c), w.shard(&c, &p).map_err(e)?);
            let mut rank = TpLayer::from_shard(gpu, &c, p, &sw, m, 1024, 16, 256).map_err(e)?;
            rank.set_fuse_split_finishes(fuse);
            ranks.push(rank);
            for seq_refs in &mut refs {
                seq_refs.push(RankRef { config: sc.clone(), weights: sw.clone(), cache: RefCache::default() });
            }
        }
        let seqs: Vec<Vec<SeqId>> = ranks.iter_mut().map(|r| lens.iter().map(|_| r.add_sequence()).collect()).collect();
        for (i, (x, (want, plain_out))) in chunks.iter().zip(&wants).enumerate() {
            let t = x.len() / d;
            let xt = Tensor::from_host(gpu, x, &[t, d]).map_err(e)?;
            let mut out = Tensor::filled(gpu, &[t, d], bf16::NAN).map_err(e)?;
            group.step(&mut ranks, |r, layer| match i {
                0 => layer.prefill(gpu, &seqs[r], &lens, &xt, &mut out),
                _ => layer.decode(gpu, &seqs[r], &xt, &mut out),
            })?;
            let got = out.to_host(gpu).map_err(e)?;
            let got = to_f64(&got);
            if got.iter().any(|v| v.is_nan()) {
                return Err(format!("TP {world}, step {i}: NaN in the output"));
            }
            let rows = if i == 0 { lens.clone() } else { vec![1; lens.len()] };
            let sharded = per_sequence(x, &rows, d, |s, x| tp_ref::layer_forward(&mut refs[s], &to_f64(x)));
            expect_close(&format!("TP {world} step {i} vs the layer"), rel_l2_error(&got, want), 1e-2)?;
            expect_close(&format!("TP {world} step {i} vs the sharded reference"), rel_l2_error(&got, &sharded), 1e-2)?;
            expect_close(&format!("TP {world} step {i} vs the plain GPU layer"), rel_l2_error(&got, plain_out), 1e-2)?;
        }
        let kv_values = |r: &TpLayer, s: &[SeqId]| -> Result<usize, String> {
            s.iter().map(|&q| r.layer().cache().read(gpu, q).map(|(k, _)| k.len()).map_err(e)).sum()
        };
        let held: usize = ranks.iter().zip(&seqs).map(|(r, s)| kv_values(r, s)).sum::<Result<usize, String>>()?;
        let whole: usize = caches.iter().map(|c| c.k.len()).sum();
        if held != whole {
            return Err(format!("TP {world}: the ranks' caches hold {held} K values, the layer's {whole}"));
        }
    }
    Ok(())
}

/// A two-layer Llama checkpoint whose 4 KV heads and 704 FFN columns split
/// over 4 ranks.
fn model_config() -> serde_json::Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 1031,
        "max_position_embeddings": 4096, "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    })
}

/// Two prompts (37 and 5 tokens), then the next tokens of two decode steps.
fn model_inputs() -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let prompt = |n: usize, salt: u32| (0..n as u32).map(|i| (i * 131 + salt) % 1031).collect::<Vec<u32>>();
    (vec![prompt(37, 3), prompt(5, 17)], vec![vec![7, 11], vec![1030, 0]])
}

/// Rank r's step of a model into the logits.
type ModelStep<'a> = dyn FnMut(usize, &mut Model, &mut Tensor<bf16>) -> host::Result<()> + 'a;

/// Logits of a prefill of every prompt position, then of each decode step,
/// from `models` (one model, or the ranks of `group`).
fn model_logits(gpu: &Gpu, models: &mut [Model], group: Option<&Emulated>) -> Result<Vec<Vec<f64>>, String> {
    let (prompts, steps) = model_inputs();
    let vocab = models[0].config().vocab_size;
    let seqs: Vec<Vec<SeqId>> = models.iter_mut().map(|m| prompts.iter().map(|_| m.add_sequence()).collect()).collect();
    let refs: Vec<&[u32]> = prompts.iter().map(|p| &p[..]).collect();
    let rows: usize = prompts.iter().map(Vec::len).sum();
    let mut run = |rows: usize, f: &mut ModelStep| {
        let mut logits = Tensor::filled(gpu, &[rows, vocab], bf16::NAN).map_err(e)?;
        match group {
            None => f(0, &mut models[0], &mut logits).map_err(e)?,
            Some(g) => g.step(models, |r, m| f(r, m, &mut logits))?,
        }
        let got = to_f64(&logits.to_host(gpu).map_err(e)?);
        match got.iter().any(|v| v.is_nan()) {
            true => Err("NaN in the logits".to_string()),
            false => Ok(got),
        }
    };
    let mut out = vec![run(rows, &mut |r, m, l| m.prefill(gpu, &seqs[r], &refs, l))?];
    for ids in &steps {
        out.push(run(ids.len(), &mut |r, m, l| m.decode(gpu, &seqs[r], ids, l))?);
    }
    Ok(out)
}

/// The model as TP 1 through a one-rank NCCL communicator, and as TP 2 and 4
/// emulated, each loading only its slices of the checkpoint: prefill and
/// decode logits against the unsharded model's; the TP 1 model's decode graph
/// (all-reduces captured) against the unsharded model's graph.
fn model_tp_matches_the_model(gpu: &Gpu) -> Result<(), String> {
    let dir = TempDir::new("tp-model");
    write_checkpoint(&dir.0, &model_config());
    let ckpt = Checkpoint::open(&dir.0).map_err(e)?;
    let opts = ModelOptions::for_batch(2, 128);
    let mut plain = [Model::load(gpu, &ckpt, opts, false).map_err(e)?];
    let want = model_logits(gpu, &mut plain, None)?;
    let check = |what: &str, got: &[Vec<f64>]| -> Result<(), String> {
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            expect_close(&format!("{what}, step {i}, logits vs the unsharded model"), rel_l2_error(g, w), 1e-2)?;
        }
        Ok(())
    };
    let nccl = std::sync::Arc::new(Nccl::load().map_err(e)?);
    let comm = Communicator::new(&nccl, gpu, 1, 0, &nccl.unique_id().map_err(e)?).map_err(e)?;
    let mut one = [Model::load_shard(gpu, &ckpt, Box::new(comm), opts).map_err(e)?];
    check("TP 1 through NCCL", &model_logits(gpu, &mut one, None)?)?;
    // The decode graph, captured with its all-reduces, beside the unsharded one.
    let greedy = [SamplingParams::GREEDY; 2];
    let mut graphs = Vec::new();
    for m in [&mut plain[0], &mut one[0]] {
        let seqs: Vec<SeqId> = (0..2).map(|_| m.add_sequence()).collect();
        let mut l = Tensor::filled(gpu, &[9, m.config().vocab_size], bf16::NAN).map_err(e)?;
        m.prefill(gpu, &seqs, &[&[5, 6, 7, 8], &[9, 10, 11, 12, 13]], &mut l).map_err(e)?;
        let mut g = m.capture_decode(gpu, &seqs, &[21, 22], &greedy).map_err(e)?;
        m.decode_graph(gpu, &mut g, Some(&[23, 24]), &greedy).map_err(e)?;
        graphs.push(g);
    }
    let logits = |g: &ModelGraph| g.logits().to_host(gpu).map(|l| to_f64(&l)).map_err(e);
    let (l0, l1) = (logits(&graphs[0])?, logits(&graphs[1])?);
    expect_close("TP 1 graph step vs the unsharded graph", rel_l2_error(&l1, &l0), 1e-2)?;
    // A graph outliving its model keeps the communicator: NCCL's destroy waits
    // for every graph holding its collectives, so the other order would hang.
    drop(one);
    drop(graphs);
    for world in [2, 4] {
        let group = Emulated::new(world);
        let mut ranks: Vec<Model> = group
            .ranks()
            .into_iter()
            .map(|r| Model::load_shard(gpu, &ckpt, Box::new(r), opts))
            .collect::<host::Result<_>>()
            .map_err(e)?;
        let heads = ranks[0].config().num_key_value_heads;
        if heads * world != 4 {
            return Err(format!("TP {world}: a rank holds {heads} KV heads"));
        }
        check(&format!("TP {world} emulated"), &model_logits(gpu, &mut ranks, Some(&group))?)?;
        // Each rank drew its own tokens; all take the first rank's.
        let mut drawn = Vec::new();
        for r in 0..world as u32 {
            let out = SampleOutput::new(gpu, 2, false).map_err(e)?;
            out.set_tokens(gpu, &[100 + r, 1000 - r]).map_err(e)?;
            drawn.push(out);
        }
        let no_group = || Error::InvalidArgument("a shard's model has no group".into());
        group.step(&mut ranks, |r, m| m.group().ok_or_else(no_group)?.broadcast_tokens(gpu, &mut drawn[r]))?;
        for (r, out) in drawn.iter().enumerate() {
            if out.tokens(gpu).map_err(e)? != [100, 1000] {
                return Err(format!("TP {world} emulated: rank {r} kept its own draw"));
            }
        }
    }
    Ok(())
}

/// `f(i, rows of sequence i)` over the rows of `x` (`rows[i]` rows of width
/// `d` each, in order), concatenated.
fn per_sequence(x: &[bf16], rows: &[usize], d: usize, mut f: impl FnMut(usize, &[bf16]) -> Vec<f64>) -> Vec<f64> {
    let mut start = 0;
    let mut y = Vec::with_capacity(x.len());
    for (i, &n) in rows.iter().enumerate() {
        y.extend(f(i, &x[start * d..(start + n) * d]));
        start += n;
    }
    y
}

fn main() {
    let mut t = GpuTests::new("tp");
    t.run("tp_one_rank_through_nccl_is_the_layer", one_rank_through_nccl_is_the_layer);
    t.run("tp_emulated_on_one_gpu_matches_the_layer", |gpu| emulated_tp_matches_the_layer(gpu, true));
    t.run("tp_emulated_unfused_matches_the_layer", |gpu| emulated_tp_matches_the_layer(gpu, false));
    t.run("tp_model_matches_the_model", model_tp_matches_the_model);
    t.finish();
}
