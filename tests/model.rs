//! GPU tests of the whole model against an f64 reference built from the same
//! checkpoint: prefill logits (every position and last positions), decode steps
//! plain and through the captured graph, batched sequences against alone, a
//! prompt in chunks against it whole, forks of a prompt against prompts of their
//! own, decode steps of several tokens a sequence against chunks, GPU seeded
//! weights, and bad input refused before anything changes.

use host::layer::reference::{layer_forward, RefCache};
use host::layer::LayerWeights;
use host::model::{Checkpoint, Model, ModelConfig, ModelOptions};
use host::ops::SamplingParams;
use host::reference::{linear, rms_norm_rows, round_bf16};
use host::{bf16, Error, Gpu, Tensor};
use lab::testing::checkpoint::{write_checkpoint, TempDir};
use lab::testing::{expect_close, rel_l2_error, to_f64, GpuTests};
use serde_json::json;

fn e(err: Error) -> String {
    err.to_string()
}

/// A small Llama config: GQA 4:1, head dim 64, an odd vocabulary.
fn config(tied: bool, layers: usize) -> serde_json::Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 1031,
        "max_position_embeddings": 4096, "tie_word_embeddings": tied, "torch_dtype": "bfloat16"
    })
}

fn bf16_tensor(ckpt: &Checkpoint, name: &str) -> Vec<f64> {
    let t = ckpt.tensor(name).unwrap();
    t.data().chunks_exact(2).map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f64()).collect()
}

/// The f64 reference of the whole model over one sequence, keeping its caches:
/// the residual stream is rounded to bf16 between layers, as on the GPU.
struct Reference {
    cfg: ModelConfig,
    layers: Vec<LayerWeights>,
    embed: Vec<f64>,
    norm: Vec<f64>,
    head: Vec<f64>,
    caches: Vec<RefCache>,
}

impl Reference {
    fn new(ckpt: &Checkpoint) -> Reference {
        let cfg = ckpt.config().clone();
        let layers = (0..cfg.num_hidden_layers).map(|i| LayerWeights::from_checkpoint(ckpt, i).unwrap()).collect();
        Reference {
            layers,
            embed: bf16_tensor(ckpt, "model.embed_tokens.weight"),
            norm: bf16_tensor(ckpt, "model.norm.weight"),
            head: bf16_tensor(ckpt, ckpt.lm_head_name()),
            caches: vec![RefCache::default(); cfg.num_hidden_layers],
            cfg,
        }
    }

    /// Logits `[ids, vocab]` of the next tokens `ids`.
    fn forward(&mut self, ids: &[u32]) -> Vec<f64> {
        let (d, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let lc = self.cfg.layer_config();
        let mut x: Vec<f64> = ids.iter().flat_map(|&i| self.embed[i as usize * d..][..d].to_vec()).collect();
        for (w, cache) in self.layers.iter().zip(&mut self.caches) {
            x = layer_forward(&lc, w, &x, cache);
        }
        let (n, _) = rms_norm_rows(&x, None, &self.norm, self.cfg.rms_norm_eps as f64);
        let n: Vec<f64> = n.into_iter().map(round_bf16).collect();
        linear(&n, &self.head, ids.len(), v, d)
    }
}

fn logits_of(gpu: &Gpu, t: &Tensor<bf16>) -> Result<Vec<f64>, String> {
    let v = to_f64(&t.to_host(gpu).map_err(e)?);
    if v.iter().any(|x| x.is_nan()) {
        return Err("NaN in the logits".into());
    }
    Ok(v)
}

fn argmax(row: &[f64]) -> u32 {
    row.iter().enumerate().fold(0, |b, (i, &x)| if x > row[b] { i } else { b }) as u32
}

fn open(tied: bool, layers: usize, name: &str) -> (TempDir, Checkpoint) {
    let dir = TempDir::new(&format!("model-{name}"));
    write_checkpoint(&dir.0, &config(tied, layers));
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    (dir, ckpt)
}

/// Prefill of every position, then decode steps through the plain path and the
/// graph, all against the reference (tied and untied heads).
fn matches_reference(gpu: &Gpu, tied: bool) -> Result<(), String> {
    let (_dir, ckpt) = open(tied, 3, if tied { "tied" } else { "untied" });
    let vocab = ckpt.config().vocab_size;
    let mut model = Model::load(gpu, &ckpt, ModelOptions::for_batch(2, 512), false).map_err(e)?;
    let mut reference = Reference::new(&ckpt);
    let prompt: Vec<u32> = (0..37u32).map(|i| (i * 7919 + 13) % vocab as u32).collect();
    let seq = model.add_sequence();
    let mut logits = Tensor::filled(gpu, &[prompt.len(), vocab], bf16::NAN).map_err(e)?;
    model.prefill(gpu, &[seq], &[&prompt], &mut logits).map_err(e)?;
    let ours = logits_of(gpu, &logits)?;
    let want = reference.forward(&prompt);
    expect_close("prefill logits", rel_l2_error(&ours, &want), 1e-2)?;
    // Plain decode steps, each fed the reference's own argmax.
    let mut next = argmax(&want[(prompt.len() - 1) * vocab..]);
    let mut one = Tensor::filled(gpu, &[1, vocab], bf16::NAN).map_err(e)?;
    for _ in 0..3 {
        model.decode(gpu, &[seq], &[next], &mut one).map_err(e)?;
        let want = reference.forward(&[next]);
        expect_close("decode logits", rel_l2_error(&logits_of(gpu, &one)?, &want), 1e-2)?;
        next = argmax(&want);
    }
    // Graph steps: greedy, so the draw is the argmax of the graph's logits.
    let mut g = model.capture_decode(gpu, &[seq], &[next], &[SamplingParams::GREEDY]).map_err(e)?;
    for step in 0..4 {
        if step > 0 {
            model.decode_graph(gpu, &mut g, None, &[SamplingParams::GREEDY]).map_err(e)?;
        }
        let want = reference.forward(&[next]);
        let got = logits_of(gpu, g.logits())?;
        expect_close("graph logits", rel_l2_error(&got, &want), 1e-2)?;
        let drawn = g.tokens(gpu).map_err(e)?[0];
        if drawn != argmax(&got) {
            return Err(format!("graph step {step}: drew {drawn}, argmax {}", argmax(&got)));
        }
        next = drawn;
    }
    Ok(())
}

/// Two prompts prefilled together (last positions only) and decoded together
/// equal each alone; a sequence leaves and its pages return.
fn batched_equals_alone(gpu: &Gpu) -> Result<(), String> {
    let (_dir, ckpt) = open(false, 2, "batched");
    let vocab = ckpt.config().vocab_size;
    let mut model = Model::load(gpu, &ckpt, ModelOptions::for_batch(4, 512), false).map_err(e)?;
    let prompts: [Vec<u32>; 2] = [(0..17).collect(), (100..401).map(|i| i % vocab as u32).collect()];
    let (a, b) = (model.add_sequence(), model.add_sequence());
    let mut two = Tensor::filled(gpu, &[2, vocab], bf16::NAN).map_err(e)?;
    model.prefill(gpu, &[a, b], &[&prompts[0], &prompts[1]], &mut two).map_err(e)?;
    let together = logits_of(gpu, &two)?;
    for (i, p) in prompts.iter().enumerate() {
        let s = model.add_sequence();
        let mut one = Tensor::filled(gpu, &[1, vocab], bf16::NAN).map_err(e)?;
        model.prefill(gpu, &[s], &[p], &mut one).map_err(e)?;
        let alone = logits_of(gpu, &one)?;
        expect_close("batched prefill row", rel_l2_error(&together[i * vocab..][..vocab], &alone), 1e-2)?;
        model.release(s).map_err(e)?;
    }
    let free = model.cache().alloc().free_pages();
    model.decode(gpu, &[a, b], &[5, 6], &mut two).map_err(e)?;
    model.release(b).map_err(e)?;
    if model.cache().alloc().free_pages() <= free {
        return Err("released pages did not return".into());
    }
    Ok(())
}

/// A mixed step (a new prompt and two running sequences' next tokens) against
/// a prefill and a decode step on the same checkpoint in a second model: equal
/// logits within bf16 tolerance, and the next decode step equal too.
fn mixed_step_equals_prefill_and_decode(gpu: &Gpu) -> Result<(), String> {
    let (_dir, ckpt) = open(false, 2, "mixed");
    let vocab = ckpt.config().vocab_size as u32;
    let opts = ModelOptions::for_batch(4, 512);
    let (mut apart, mut mixed) =
        (Model::load(gpu, &ckpt, opts, false).map_err(e)?, Model::load(gpu, &ckpt, opts, false).map_err(e)?);
    let running: [Vec<u32>; 2] = [(3..12).collect(), (40..161).map(|i| i % vocab).collect()];
    let prompt: Vec<u32> = (7..300).map(|i| (i * 13) % vocab).collect();
    let mut ids = Vec::new();
    for m in [&mut apart, &mut mixed] {
        let r = [m.add_sequence(), m.add_sequence()];
        let mut two = Tensor::filled(gpu, &[2, vocab as usize], bf16::NAN).map_err(e)?;
        m.prefill(gpu, &r, &[&running[0], &running[1]], &mut two).map_err(e)?;
        ids.push((r, m.add_sequence()));
    }
    let ((ra, pa), (rm, pm)) = (ids[0], ids[1]);
    let logits = |rows: usize| Tensor::<bf16>::filled(gpu, &[rows, vocab as usize], bf16::NAN).map_err(e);
    let (mut one, mut two, mut three) = (logits(1)?, logits(2)?, logits(3)?);
    apart.prefill(gpu, &[pa], &[&prompt], &mut one).map_err(e)?;
    apart.decode(gpu, &ra, &[5, 6], &mut two).map_err(e)?;
    mixed.mixed(gpu, &[pm], &[&prompt], &rm, &[5, 6], &mut three).map_err(e)?;
    let got = logits_of(gpu, &three)?;
    let v = vocab as usize;
    expect_close("mixed step, prompt row", rel_l2_error(&got[..v], &logits_of(gpu, &one)?), 1e-2)?;
    expect_close("mixed step, running rows", rel_l2_error(&got[v..], &logits_of(gpu, &two)?), 1e-2)?;
    let mut next = |m: &mut Model, seqs: [host::ops::SeqId; 3]| -> Result<Vec<f64>, String> {
        m.decode(gpu, &seqs, &[8, 9, 10], &mut three).map_err(e)?;
        logits_of(gpu, &three)
    };
    let (a, b) = (next(&mut apart, [pa, ra[0], ra[1]])?, next(&mut mixed, [pm, rm[0], rm[1]])?);
    expect_close("decode after the mixed step", rel_l2_error(&b, &a), 1e-2)
}

/// A prompt prefilled in chunks (1, 16, 17 and the rest tokens; the third
/// chunk in a mixed step with a running sequence) gives the logits of the
/// prompt prefilled whole, for every position, and the same decode step after.
fn chunked_prefill_equals_whole(gpu: &Gpu) -> Result<(), String> {
    let (_dir, ckpt) = open(false, 2, "chunked");
    let vocab = ckpt.config().vocab_size;
    let opts = ModelOptions::for_batch(3, 512);
    let (mut whole, mut chunked) =
        (Model::load(gpu, &ckpt, opts, false).map_err(e)?, Model::load(gpu, &ckpt, opts, false).map_err(e)?);
    let prompt: Vec<u32> = (0..300).map(|i| (i * 29 + 3) % vocab as u32).collect();
    let running: Vec<u32> = (5..17).collect();
    let logits = |rows: usize| Tensor::<bf16>::filled(gpu, &[rows, vocab], bf16::NAN).map_err(e);
    let (pw, rw) = (whole.add_sequence(), whole.add_sequence());
    let (pc, rc) = (chunked.add_sequence(), chunked.add_sequence());
    let mut one = logits(1)?;
    for (m, r) in [(&mut whole, rw), (&mut chunked, rc)] {
        m.prefill(gpu, &[r], &[&running], &mut one).map_err(e)?;
    }
    let mut all = logits(prompt.len())?;
    whole.prefill(gpu, &[pw], &[&prompt], &mut all).map_err(e)?;
    let want = logits_of(gpu, &all)?;
    let mut at = 0;
    for (i, n) in [1usize, 16, 17, prompt.len() - 34].into_iter().enumerate() {
        let chunk = &prompt[at..at + n];
        let got = if i == 2 {
            let mut two = logits(2)?;
            chunked.mixed(gpu, &[pc], &[chunk], &[rc], &[7], &mut two).map_err(e)?;
            whole.decode(gpu, &[rw], &[7], &mut one).map_err(e)?;
            let got = logits_of(gpu, &two)?;
            expect_close("the mixed step's running row", rel_l2_error(&got[vocab..], &logits_of(gpu, &one)?), 1e-2)?;
            got[..vocab].to_vec()
        } else {
            let mut rows = logits(n)?;
            chunked.prefill(gpu, &[pc], &[chunk], &mut rows).map_err(e)?;
            let got = logits_of(gpu, &rows)?;
            got[(n - 1) * vocab..].to_vec()
        };
        let last = &want[(at + n - 1) * vocab..(at + n) * vocab];
        expect_close(&format!("chunk {i}: its last position"), rel_l2_error(&got, last), 1e-2)?;
        at += n;
    }
    let mut two = logits(2)?;
    whole.decode(gpu, &[pw, rw], &[11, 12], &mut two).map_err(e)?;
    let a = logits_of(gpu, &two)?;
    chunked.decode(gpu, &[pc, rc], &[11, 12], &mut two).map_err(e)?;
    expect_close("decode after the chunks", rel_l2_error(&logits_of(gpu, &two)?, &a), 1e-2)
}

/// Forks share a prompt prefilled once: a fork decodes as a sequence whose
/// prompt was prefilled on its own, the parent as another twin, step after
/// step; a truncate of the fork inside a shared page (then a decode) leaves the
/// parent as its twin.
fn forks_decode_as_their_own_prompts(gpu: &Gpu) -> Result<(), String> {
    let (_dir, ckpt) = open(false, 2, "fork");
    let vocab = ckpt.config().vocab_size;
    let mut m = Model::load(gpu, &ckpt, ModelOptions::for_batch(4, 128), false).map_err(e)?;
    // 33 tokens: pages 0 and 1 whole (16 tokens each), a third partial.
    let prompt: Vec<u32> = (0..33).map(|i| (i * 7 + 1) % vocab as u32).collect();
    let mut one = Tensor::filled(gpu, &[1, vocab], bf16::NAN).map_err(e)?;
    let (a, c, d) = (m.add_sequence(), m.add_sequence(), m.add_sequence());
    for s in [a, c, d] {
        m.prefill(gpu, &[s], &[&prompt], &mut one).map_err(e)?;
    }
    let b = m.fork(gpu, a).map_err(e)?;
    if m.len(b).map_err(e)? != 33 {
        return Err(format!("the fork holds {:?} tokens", m.len(b)));
    }
    let mut four = Tensor::filled(gpu, &[4, vocab], bf16::NAN).map_err(e)?;
    // Rows: a, b (its fork), c (b's twin), d (a's twin).
    let mut step = |m: &mut Model, ids: [u32; 4], what: &str| -> Result<(), String> {
        m.decode(gpu, &[a, b, c, d], &ids, &mut four).map_err(e)?;
        let got = logits_of(gpu, &four)?;
        let row = |i: usize| &got[i * vocab..(i + 1) * vocab];
        expect_close(&format!("{what}: the fork against its twin"), rel_l2_error(row(1), row(2)), 1e-2)?;
        expect_close(&format!("{what}: the parent against its twin"), rel_l2_error(row(0), row(3)), 1e-2)
    };
    step(&mut m, [5, 9, 9, 5], "first step")?;
    step(&mut m, [6, 2, 2, 6], "second step")?;
    // Back to 30 tokens: inside page 1, shared by a and b.
    m.truncate(gpu, b, 30).map_err(e)?;
    m.truncate(gpu, c, 30).map_err(e)?;
    step(&mut m, [7, 3, 3, 7], "after the fork's cut")?;
    step(&mut m, [8, 4, 4, 8], "a step later")?;
    // The caches themselves, every layer: a row the fork wrote into a page it
    // still shared would stand out here (a whole row of 36), not only in logits.
    for layer in 0..m.cache().layers() {
        for (x, y, what) in [(a, d, "the parent"), (b, c, "the fork")] {
            let (xk, xv) = m.cache().read_layer(gpu, layer, x).map_err(e)?;
            let (yk, yv) = m.cache().read_layer(gpu, layer, y).map_err(e)?;
            for (p, q, kind) in [(xk, yk, "K"), (xv, yv, "V")] {
                let err = rel_l2_error(&to_f64(&p), &to_f64(&q));
                expect_close(&format!("layer {layer} {kind}: {what} against its twin"), err, 1e-2)?;
            }
        }
    }
    Ok(())
}

/// Speculative decoding's verification step: 4 tokens of each of two
/// sequences in one decode step give the logits of the same tokens prefilled
/// as a next chunk on twin sequences, at every position; after the rejected
/// drafts go (truncate), a one-token step agrees with the twins'.
fn decode_several_tokens(gpu: &Gpu) -> Result<(), String> {
    let (_dir, ckpt) = open(false, 2, "verify");
    let vocab = ckpt.config().vocab_size;
    let mut m = Model::load(gpu, &ckpt, ModelOptions::for_batch(4, 256), false).map_err(e)?;
    let prompts: [Vec<u32>; 2] = [(1..30).collect(), (100..140).collect()];
    let logits = |rows: usize| Tensor::<bf16>::filled(gpu, &[rows, vocab], bf16::NAN).map_err(e);
    let seqs: Vec<_> = (0..4).map(|_| m.add_sequence()).collect();
    let (a, b, ta, tb) = (seqs[0], seqs[1], seqs[2], seqs[3]);
    let mut two = logits(2)?;
    for pair in [[a, b], [ta, tb]] {
        m.prefill(gpu, &pair, &[&prompts[0], &prompts[1]], &mut two).map_err(e)?;
    }
    let drafts: [u32; 8] = [7, 8, 9, 10, 11, 12, 13, 14];
    let (mut verified, mut chunked) = (logits(8)?, logits(8)?);
    m.decode_tokens(gpu, &[a, b], 4, &drafts, &mut verified).map_err(e)?;
    m.prefill(gpu, &[ta, tb], &[&drafts[..4], &drafts[4..]], &mut chunked).map_err(e)?;
    let (got, want) = (logits_of(gpu, &verified)?, logits_of(gpu, &chunked)?);
    expect_close("4 tokens a sequence against the same as a chunk", rel_l2_error(&got, &want), 1e-2)?;
    // a keeps 2 of its 4, b 1.
    for (s, len) in [(a, 31), (ta, 31), (b, 41), (tb, 41)] {
        m.truncate(gpu, s, len).map_err(e)?;
    }
    let mut four = logits(4)?;
    m.decode(gpu, &[a, b, ta, tb], &[5, 6, 5, 6], &mut four).map_err(e)?;
    let got = logits_of(gpu, &four)?;
    let row = |i: usize| &got[i * vocab..(i + 1) * vocab];
    expect_close("after the rejections, a against its twin", rel_l2_error(row(0), row(2)), 1e-2)?;
    expect_close("after the rejections, b against its twin", rel_l2_error(row(1), row(3)), 1e-2)?;
    // a's cut from 33 to 31 tokens gave back its third page (16 tokens a page).
    if m.cache().alloc().pages(a).map_err(e)?.len() != 2 {
        return Err(format!("a holds pages {:?} after its cut", m.cache().alloc().pages(a)));
    }
    // Each sequence's last position only: 8 tokens a sequence (two row tiles of the kernel).
    let drafts: Vec<u32> = (20..36).collect();
    let (mut verified, mut chunked) = (logits(2)?, logits(2)?);
    m.decode_tokens(gpu, &[a, b], 8, &drafts, &mut verified).map_err(e)?;
    m.prefill(gpu, &[ta, tb], &[&drafts[..8], &drafts[8..]], &mut chunked).map_err(e)?;
    let (got, want) = (logits_of(gpu, &verified)?, logits_of(gpu, &chunked)?);
    expect_close("8 tokens a sequence, last positions", rel_l2_error(&got, &want), 1e-2)
}

/// Greedy speculation emits what plain greedy decoding does: drafts that are
/// the plain run's next tokens are all kept, a wrong second draft keeps one,
/// and prompt lookup's own guesses run to the same tokens. Where the two
/// paths first differ, the plain logits must be a near-tie there.
fn speculative_greedy_matches_plain(gpu: &Gpu) -> Result<(), String> {
    let (_dir, ckpt) = open(false, 2, "speculate");
    let vocab = ckpt.config().vocab_size;
    let mut m = Model::load(gpu, &ckpt, ModelOptions::for_batch(2, 256), false).map_err(e)?;
    // A prompt that repeats, so prompt lookup finds n-grams in it.
    let prompt: Vec<u32> = (0..3).flat_map(|_| (40..57u32).collect::<Vec<_>>()).collect();
    let mut one = Tensor::filled(gpu, &[1, vocab], bf16::NAN).map_err(e)?;
    let first = |m: &mut Model, one: &mut Tensor<bf16>| -> Result<(host::ops::SeqId, u32), String> {
        let s = m.add_sequence();
        m.prefill(gpu, &[s], &[&prompt], one).map_err(e)?;
        Ok((s, argmax(&logits_of(gpu, one)?)))
    };
    // The plain run: each token, and its logits' top-2 margin relative to the top.
    const N: usize = 30;
    let (p, mut id) = first(&mut m, &mut one)?;
    let (mut plain, mut margin) = (vec![id], vec![f64::INFINITY]);
    while plain.len() < N {
        m.decode(gpu, &[p], &[id], &mut one).map_err(e)?;
        let row = logits_of(gpu, &one)?;
        id = argmax(&row);
        let mut top = row.clone();
        top.sort_by(|a, b| b.total_cmp(a));
        margin.push((top[0] - top[1]) / top[0].abs().max(1.0));
        plain.push(id);
    }
    m.release(p).map_err(e)?;
    let check = |what: &str, got: &[u32]| -> Result<(), String> {
        match got.iter().zip(&plain).position(|(a, b)| a != b) {
            None => Ok(()),
            Some(i) if margin[i] < 0.02 => Ok(()),
            Some(i) => Err(format!(
                "{what}: token {i} is {} where plain greedy gives {} (margin {:.3})",
                got[i], plain[i], margin[i]
            )),
        }
    };
    // Oracle drafts: the plain run's next three; on odd steps the second is wrong.
    let mut check_step = host::model::GreedyCheck::new();
    let (s, id0) = first(&mut m, &mut one)?;
    let (mut got, mut step) = (vec![id0], 0);
    while got.len() < N {
        let g = got.len();
        let mut drafts: Vec<u32> = plain[g..(g + 3).min(N)].to_vec();
        let wrong = step % 2 == 1 && drafts.len() > 1;
        if wrong {
            drafts[1] = (drafts[1] + 1) % vocab as u32;
        }
        let before = m.len(s).map_err(e)?;
        let new = check_step.step(gpu, &mut m, s, *got.last().expect("first"), &drafts).map_err(e)?;
        // While both runs agree and no near-tie lies ahead, every right draft is kept.
        let clear = got[..] == plain[..g] && margin[g..(g + drafts.len() + 1).min(N)].iter().all(|&x| x >= 0.02);
        let want = if wrong { 2 } else { drafts.len() + 1 };
        if clear && new.len() != want {
            return Err(format!("step {step}: {} new tokens for {drafts:?}, expected {want}", new.len()));
        }
        // The cache holds the prompt, and every emitted token but the newest.
        if m.len(s).map_err(e)? != before + new.len() {
            return Err(format!(
                "step {step}: {} cached after {before} and {} new tokens",
                m.len(s).map_err(e)?,
                new.len()
            ));
        }
        got.extend(new);
        step += 1;
    }
    got.truncate(N);
    check("oracle drafts", &got)?;
    if step >= N - 1 {
        return Err(format!("oracle drafts took {step} steps for {N} tokens: none kept"));
    }
    m.release(s).map_err(e)?;
    // Prompt lookup's own guesses.
    let lookup = host::model::PromptLookup::new(3, 4).map_err(e)?;
    let (s, id0) = first(&mut m, &mut one)?;
    let mut context: Vec<u32> = prompt.iter().copied().chain([id0]).collect();
    while context.len() < prompt.len() + N {
        let drafts = lookup.propose(&context).to_vec();
        let new = check_step.step(gpu, &mut m, s, *context.last().expect("first"), &drafts).map_err(e)?;
        context.extend(new);
    }
    check("prompt lookup", &context[prompt.len()..prompt.len() + N])
}

/// Seeded GPU weights: the same seed gives the same logits bit for bit.
fn random_weights_are_reproducible(gpu: &Gpu) -> Result<(), String> {
    let cfg = ModelConfig::from_json(&config(false, 2).to_string()).map_err(e)?;
    let run = |seed| -> Result<Vec<f64>, String> {
        let mut m = Model::random(gpu, &cfg, seed, ModelOptions::for_batch(1, 128)).map_err(e)?;
        let s = m.add_sequence();
        let mut l = Tensor::filled(gpu, &[1, cfg.vocab_size], bf16::NAN).map_err(e)?;
        m.prefill(gpu, &[s], &[&[1, 2, 3, 4, 5]], &mut l).map_err(e)?;
        logits_of(gpu, &l)
    };
    let (x, y, z) = (run(7)?, run(7)?, run(8)?);
    if x != y || x == z {
        return Err("seeded weights: same seed differs or another seed agrees".into());
    }
    Ok(())
}

/// Prompts of ever new lengths leave HBM where a prompt of the same length left
/// it (a prefill's buffers go when a prefill of another bucket of lengths
/// comes), lengths of one bucket share its buffers, and a captured graph still
/// replays right after them.
fn prefill_buffers_bounded(gpu: &Gpu) -> Result<(), String> {
    let (_dir, ckpt) = open(false, 2, "bounded");
    let vocab = ckpt.config().vocab_size;
    let mut model = Model::load(gpu, &ckpt, ModelOptions::for_batch(3, 256), false).map_err(e)?;
    let (a, twin) = (model.add_sequence(), model.add_sequence());
    let mut one = Tensor::filled(gpu, &[1, vocab], bf16::NAN).map_err(e)?;
    for s in [a, twin] {
        model.prefill(gpu, &[s], &[&[1, 2, 3]], &mut one).map_err(e)?;
    }
    let mut g = model.capture_decode(gpu, &[a], &[4], &[SamplingParams::GREEDY]).map_err(e)?;
    model.decode(gpu, &[twin], &[4], &mut one).map_err(e)?;
    let prompt = |len: usize| -> Vec<u32> { (0..len as u32).map(|i| (i * 31 + 7) % vocab as u32).collect() };
    let mut free_at_150 = Vec::new();
    // A length each: one prompt (last position); then two prompts (last
    // positions, 2 head rows) and one prompt with every position's logits.
    for len in [1usize, 17, 150, 31, 2, 150, 64, 129, 150] {
        let s = model.add_sequence();
        model.prefill(gpu, &[s], &[&prompt(len)], &mut one).map_err(e)?;
        model.release(s).map_err(e)?;
        if len == 150 {
            free_at_150.push(cust::memory::mem_get_info().map_err(|x| x.to_string())?.0);
        }
        let (s, t) = (model.add_sequence(), model.add_sequence());
        let mut two = Tensor::filled(gpu, &[2, vocab], bf16::NAN).map_err(e)?;
        model.prefill(gpu, &[s, t], &[&prompt(len + 2), &prompt(5)], &mut two).map_err(e)?;
        model.release(t).map_err(e)?;
        model.release(s).map_err(e)?;
        let s = model.add_sequence();
        let mut every = Tensor::filled(gpu, &[len + 3, vocab], bf16::NAN).map_err(e)?;
        model.prefill(gpu, &[s], &[&prompt(len + 3)], &mut every).map_err(e)?;
        model.release(s).map_err(e)?;
    }
    if free_at_150.windows(2).any(|w| w[1] < w[0]) {
        return Err(format!("free HBM after each 150-token prefill fell: {free_at_150:?}"));
    }
    // Lengths of one bucket (129..=160) reuse its buffers, whichever comes first.
    let mut held = Vec::new();
    for len in [150usize, 131, 160, 129] {
        let s = model.add_sequence();
        model.prefill(gpu, &[s], &[&prompt(len)], &mut one).map_err(e)?;
        model.release(s).map_err(e)?;
        held.push(model.activation_bytes());
    }
    if held.windows(2).any(|w| w[1] != w[0]) {
        return Err(format!("activation bytes after prefills of 150, 131, 160, 129 tokens: {held:?}"));
    }
    let drawn = g.tokens(gpu).map_err(e)?[0];
    model.decode_graph(gpu, &mut g, None, &[SamplingParams::GREEDY]).map_err(e)?;
    model.decode(gpu, &[twin], &[drawn], &mut one).map_err(e)?;
    expect_close("graph after prefills", rel_l2_error(&logits_of(gpu, g.logits())?, &logits_of(gpu, &one)?), 1e-2)
}

/// Bad input is refused before anything changes.
fn bad_input(gpu: &Gpu) -> Result<(), String> {
    let (_dir, ckpt) = open(true, 1, "bad");
    let vocab = ckpt.config().vocab_size;
    let mut model = Model::load(gpu, &ckpt, ModelOptions::for_batch(1, 64), false).map_err(e)?;
    let s = model.add_sequence();
    let mut l = Tensor::filled(gpu, &[1, vocab], bf16::NAN).map_err(e)?;
    let launches = gpu.launch_count();
    let refused = [
        model.prefill(gpu, &[s], &[&[vocab as u32]], &mut l).is_err(),
        model.prefill(gpu, &[s], &[&[]], &mut l).is_err(),
        model.prefill(gpu, &[s], &[&vec![1; 65]], &mut l).is_err(),
        model.decode(gpu, &[s], &[1], &mut l).is_err(),
        model.prefill(gpu, &[s], &[&[1, 2]], &mut Tensor::filled(gpu, &[3, vocab], bf16::NAN).map_err(e)?).is_err(),
        model.capture_decode(gpu, &[s], &[1], &[SamplingParams::GREEDY]).is_err(),
    ];
    if refused.contains(&false) || gpu.launch_count() != launches || model.len(s).map_err(e)? != 0 {
        return Err(format!("refused {refused:?}; launches or lengths changed"));
    }
    Ok(())
}

/// Graph steps queued ahead (each step's tokens read by `queue_tokens` /
/// `read_tokens` after the next step is queued) draw the same tokens as steps
/// collected one by one on a twin model; misuse of the reads is refused.
fn pipelined_steps_equal_synchronous(gpu: &Gpu) -> Result<(), String> {
    let (_dir, ckpt) = open(false, 2, "pipelined");
    let vocab = ckpt.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..29u32).map(|i| (i * 131 + 7) % vocab).collect();
    let params = [SamplingParams::GREEDY, SamplingParams::GREEDY];
    let steps = 9;
    let run = |pipelined: bool| -> Result<Vec<Vec<u32>>, String> {
        let mut model = Model::load(gpu, &ckpt, ModelOptions::for_batch(2, 256), false).map_err(e)?;
        let seqs = [model.add_sequence(), model.add_sequence()];
        let mut logits = Tensor::filled(gpu, &[2, vocab as usize], bf16::NAN).map_err(e)?;
        model.prefill(gpu, &seqs, &[&prompt, &prompt[3..]], &mut logits).map_err(e)?;
        let mut g = model.capture_decode(gpu, &seqs, &[1, 2], &params).map_err(e)?;
        let mut drawn = vec![g.tokens(gpu).map_err(e)?];
        if !pipelined {
            for _ in 0..steps + 1 {
                model.decode_graph(gpu, &mut g, None, &params).map_err(e)?;
                drawn.push(g.tokens(gpu).map_err(e)?);
            }
            return Ok(drawn);
        }
        let mut pending = None;
        for _ in 0..steps {
            model.decode_graph(gpu, &mut g, None, &params).map_err(e)?;
            let read = g.queue_tokens(gpu).map_err(e)?;
            if let Some(prev) = pending.replace(read) {
                drawn.push(g.read_tokens(prev).map_err(e)?);
            }
        }
        // One more step makes two reads pending: a third is refused.
        model.decode_graph(gpu, &mut g, None, &params).map_err(e)?;
        let last = g.queue_tokens(gpu).map_err(e)?;
        if g.queue_tokens(gpu).is_ok() {
            return Err("a third pending read was accepted".into());
        }
        drawn.push(g.read_tokens(pending.take().expect("queued")).map_err(e)?);
        drawn.push(g.read_tokens(last).map_err(e)?);
        // A read dropped uncollected frees its slot.
        let (kept, dropped) = (g.queue_tokens(gpu).map_err(e)?, g.queue_tokens(gpu).map_err(e)?);
        drop(dropped);
        let again = g.queue_tokens(gpu).map_err(e)?;
        for read in [kept, again] {
            if g.read_tokens(read).map_err(e)? != *drawn.last().expect("drawn") {
                return Err("a repeated read of the last step differs".into());
            }
        }
        Ok(drawn)
    };
    let (plain, piped) = (run(false)?, run(true)?);
    if plain != piped {
        return Err(format!("pipelined tokens {piped:?} against {plain:?}"));
    }
    Ok(())
}

/// The dev persistent decode step (every layer in one launch) against the
/// shipped decode step on the same model: two sequences with the same prompt,
/// one through each, equal logits within bf16 tolerance at every step. Prompts
/// of 1 token (one split), 37 (pages of 16 crossed) and 1500 (many splits);
/// a Llama config (4 query heads per KV head) and a Qwen2 one (8, QKV bias).
/// Off Hopper the step is refused with an error naming what it needs.
fn persistent_step_equals_shipped(gpu: &Gpu) -> Result<(), String> {
    if gpu.info().arch != host::Arch::Sm90a {
        let cfg = ModelConfig::llama3_8b();
        let small = ModelConfig { num_hidden_layers: 1, ..cfg };
        let m = Model::random(gpu, &small, 1, ModelOptions::for_batch(1, 64)).map_err(e)?;
        return match m.persistent_decode(gpu) {
            Err(Error::InvalidArgument(msg)) if msg.contains("sm_90a") => Ok(()),
            other => Err(format!("off Hopper: expected a refusal naming sm_90a, got {:?}", other.err())),
        };
    }
    let llama = json!({
        "model_type": "llama", "hidden_size": 512, "intermediate_size": 768, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "vocab_size": 1031, "max_position_embeddings": 4096, "tie_word_embeddings": false
    });
    let qwen = json!({
        "model_type": "qwen2", "hidden_size": 768, "intermediate_size": 1280, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "vocab_size": 1031, "max_position_embeddings": 4096, "tie_word_embeddings": true
    });
    for (name, cfg) in [("llama", llama), ("qwen2", qwen)] {
        let cfg = ModelConfig::from_json(&cfg.to_string()).map_err(e)?;
        let mut m = Model::random(gpu, &cfg, 11, ModelOptions::for_batch(2, 2048)).map_err(e)?;
        let mut pd = m.persistent_decode(gpu).map_err(e)?;
        let v = cfg.vocab_size;
        for plen in [1usize, 37, 1500] {
            let prompt: Vec<u32> = (0..plen as u32).map(|i| (i * 7 + 3) % v as u32).collect();
            let (a, b) = (m.add_sequence(), m.add_sequence());
            let mut two = Tensor::filled(gpu, &[2, v], bf16::NAN).map_err(e)?;
            m.prefill(gpu, &[a, b], &[&prompt, &prompt], &mut two).map_err(e)?;
            let mut id = argmax(&logits_of(gpu, &two)?[..v]);
            for step in 0..12 {
                let mut shipped = Tensor::filled(gpu, &[1, v], bf16::NAN).map_err(e)?;
                let mut ours = Tensor::filled(gpu, &[1, v], bf16::NAN).map_err(e)?;
                m.decode(gpu, &[a], &[id], &mut shipped).map_err(e)?;
                m.decode_persistent(gpu, &mut pd, b, id, &mut ours).map_err(e)?;
                let want = logits_of(gpu, &shipped)?;
                let what = format!("{name}, prompt {plen}, step {step}");
                expect_close(&what, rel_l2_error(&logits_of(gpu, &ours)?, &want), 1e-2)?;
                id = argmax(&want);
            }
            m.release(a).map_err(e)?;
            m.release(b).map_err(e)?;
        }
    }
    // Head dim 64 is outside the kernel: refused before anything is allocated.
    let cfg = ModelConfig::from_json(&config(false, 1).to_string()).map_err(e)?;
    let m = Model::random(gpu, &cfg, 1, ModelOptions::for_batch(1, 64)).map_err(e)?;
    match m.persistent_decode(gpu) {
        Err(Error::InvalidArgument(_)) => Ok(()),
        other => Err(format!("head dim 64: expected a refusal, got {:?}", other.err())),
    }
}

fn main() {
    let mut t = GpuTests::new("model");
    t.run("model_untied_matches_reference", |g| matches_reference(g, false));
    t.run("model_tied_matches_reference", |g| matches_reference(g, true));
    t.run("model_batched_equals_alone", batched_equals_alone);
    t.run("model_random_weights_reproducible", random_weights_are_reproducible);
    t.run("model_prefill_buffers_bounded", prefill_buffers_bounded);
    t.run("model_mixed_step_equals_prefill_and_decode", mixed_step_equals_prefill_and_decode);
    t.run("model_chunked_prefill_equals_whole", chunked_prefill_equals_whole);
    t.run("model_forks_decode_as_their_own_prompts", forks_decode_as_their_own_prompts);
    t.run("model_decode_several_tokens_a_sequence", decode_several_tokens);
    t.run("model_speculative_greedy_matches_plain", speculative_greedy_matches_plain);
    t.run("model_pipelined_steps_equal_synchronous", pipelined_steps_equal_synchronous);
    t.run("model_bad_input_refused", bad_input);
    t.run("model_persistent_step_equals_shipped", persistent_step_equals_shipped);
    t.finish();
}
