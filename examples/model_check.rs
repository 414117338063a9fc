//! The GPU model against `transformers`: for each case folder written by
//! `scripts/model_reference.py make` (a checkpoint and its `reference.json`),
//! runs the prompt through `Model::prefill` for every position's logits, then
//! greedy decoding through the captured decode graph, and a teacher-forced run
//! (the reference's greedy tokens fed back one by one), and writes `ours.json`
//! (`prefill_logits` `[prompt, vocab]`, `greedy` `[steps]`, `decode_logits`
//! `[steps, vocab]`) for `scripts/model_reference.py compare`.
//!
//! cargo run --release -p lab --example model_check -- DIR [DIR …]

use host::model::{Checkpoint, Model, ModelOptions};
use host::ops::SamplingParams;
use host::{bf16, Gpu, Tensor};
use serde_json::{json, Value};
use std::path::Path;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn check(gpu: &Gpu, dir: &Path) -> Res<()> {
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
    let prompt: Vec<u32> = serde_json::from_value(reference["prompt"].clone())?;
    let forced: Vec<u32> = serde_json::from_value(reference["greedy"].clone())?;
    let steps = forced.len();
    let ckpt = Checkpoint::open(dir)?;
    let vocab = ckpt.config().vocab_size;
    let opts = ModelOptions::for_batch(2, (prompt.len() + steps + 1).next_multiple_of(64));
    let mut model = Model::load(gpu, &ckpt, opts, false)?;
    let seq = model.add_sequence();
    let mut logits = Tensor::filled(gpu, &[prompt.len(), vocab], bf16::ZERO)?;
    model.prefill(gpu, &[seq], &[&prompt], &mut logits)?;
    let rows = to_f32(&logits.to_host(gpu)?);
    let last = &rows[(prompt.len() - 1) * vocab..];
    // Greedy: the argmax, lowest index on ties (as the GPU sampler).
    let argmax = |r: &[f32]| r.iter().enumerate().fold(0, |best, (i, &v)| if v > r[best] { i } else { best }) as u32;
    let mut greedy = vec![argmax(last)];
    let graph_steps = steps.saturating_sub(1);
    if graph_steps > 0 {
        let g = &mut model.capture_decode(gpu, &[seq], &greedy, &[SamplingParams::GREEDY])?;
        greedy.push(g.tokens(gpu)?[0]);
        while greedy.len() < steps {
            model.decode_graph(gpu, g, None, &[SamplingParams::GREEDY])?;
            greedy.push(g.tokens(gpu)?[0]);
        }
    }
    // Teacher-forced: row 0 is the prompt's last position, row i the logits
    // after feeding the reference's token i - 1.
    let forced_seq = model.add_sequence();
    let mut last_row = Tensor::filled(gpu, &[1, vocab], bf16::ZERO)?;
    model.prefill(gpu, &[forced_seq], &[&prompt], &mut last_row)?;
    let mut decode_logits = vec![to_f32(&last_row.to_host(gpu)?)];
    if steps > 1 {
        let g = &mut model.capture_decode(gpu, &[forced_seq], &forced[..1], &[SamplingParams::GREEDY])?;
        decode_logits.push(to_f32(&g.logits().to_host(gpu)?));
        for &id in &forced[1..steps - 1] {
            model.decode_graph(gpu, g, Some(&[id]), &[SamplingParams::GREEDY])?;
            decode_logits.push(to_f32(&g.logits().to_host(gpu)?));
        }
    }
    let prefill: Vec<&[f32]> = rows.chunks(vocab).collect();
    let out = json!({ "prefill_logits": prefill, "greedy": greedy, "decode_logits": decode_logits });
    std::fs::write(dir.join("ours.json"), serde_json::to_string(&out)?)?;
    println!("{}: {} prompt tokens, {} greedy tokens", dir.display(), prompt.len(), greedy.len());
    Ok(())
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn main() -> Res<()> {
    let dirs: Vec<String> = std::env::args().skip(1).collect();
    if dirs.is_empty() {
        return Err("usage: model_check DIR [DIR …]".into());
    }
    let gpu = match Gpu::new() {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("model_check: no usable GPU ({e}); SKIPPED, nothing run");
            return Ok(());
        }
    };
    for d in dirs {
        check(&gpu, Path::new(&d))?;
    }
    Ok(())
}
