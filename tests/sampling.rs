//! GPU tests of next-token sampling against an f64 CPU reference that draws with
//! the same uniform. Greedy and top-k are exact (integer keys); the top-p edge
//! and the draw's crossing are compared in f64, and where the f32 sums on the
//! GPU could land on the other side (within `EPS` of the kept mass), either
//! neighbour is accepted.

use host::ops::sampling::{key, plan, LogitType, NEG_INF_KEY};
use host::ops::{sample, SampleOutput, SamplingParams};
use host::{bf16, DType, Error, Gpu, Tensor};
use lab::testing::ShapeRng as Rng;
use lab::testing::{cast, quick, random_with_outliers, GpuTests};

/// How far (relative to the kept mass) an f32 sum over a row may stray from the
/// f64 one: ex2.approx and f32 sums over up to 152k weights stay well inside it.
const EPS: f64 = 1e-4;

// ---------------------------------------------------------------- reference

/// The row's argmax (lowest index on ties), or None if nothing is above -inf.
fn argmax(keys: &[u32]) -> Option<usize> {
    let top = *keys.iter().max()?;
    (top > NEG_INF_KEY).then(|| keys.iter().position(|&k| k == top).unwrap())
}

/// log softmax(x)[tok] at temperature 1 over the non-NaN logits.
fn log_prob(x: &[f64], keys: &[u32], tok: usize) -> f64 {
    let m = x[argmax(keys).unwrap()];
    let w = weights(x, keys, m, 1.0);
    let sum: f64 = w.iter().sum();
    (if x[tok] == m { 0.0 } else { x[tok] - m }) - sum.ln()
}

/// exp((x − m)/T), 1 where x equals the max (the +inf limit), 0 for NaN.
fn weights(x: &[f64], keys: &[u32], m: f64, t: f64) -> Vec<f64> {
    x.iter()
        .zip(keys)
        .map(|(&v, &k)| {
            if k == 0 {
                0.0
            } else if v == m {
                1.0
            } else {
                ((v - m) / t).exp()
            }
        })
        .collect()
}

/// The k-th largest non-NaN key (1 if top-k is off or there are fewer than k).
fn top_k_key(keys: &[u32], k: u32) -> u32 {
    let k = k as usize;
    if k == 0 || k >= keys.len() {
        return 1;
    }
    let mut ks: Vec<u32> = keys.iter().copied().filter(|&k| k > 0).collect();
    if ks.len() < k {
        return 1;
    }
    ks.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    ks[k - 1].max(1)
}

/// One row's reference draw: the exact token, and every token the GPU may
/// return where f32 rounding could move the top-p edge or the crossing.
struct Draw {
    exact: usize,
    accepted: Vec<usize>,
}

fn reference_draw(x: &[f64], keys: &[u32], p: &SamplingParams) -> Option<Draw> {
    let top = argmax(keys)?;
    if p.temperature == 0.0 {
        return Some(Draw { exact: top, accepted: vec![top] });
    }
    let w = weights(x, keys, x[top], p.temperature as f64);
    let mass = |tau: u32| -> f64 { keys.iter().zip(&w).filter(|(&k, _)| k >= tau).map(|(_, &w)| w).sum() };
    let tau_k = top_k_key(keys, p.top_k);
    let mut taus = vec![tau_k];
    if p.top_p < 1.0 {
        let total = mass(tau_k);
        let goal = p.top_p as f64 * total;
        let eps = EPS * total;
        let mut distinct: Vec<u32> = keys.iter().copied().filter(|&k| k >= tau_k).collect();
        distinct.sort_unstable_by(|a, b| b.cmp(a));
        distinct.dedup();
        // Mass at or above each distinct key, from the top.
        let mut by_key: Vec<(u32, f64)> = Vec::new();
        let mut order: Vec<usize> = (0..keys.len()).filter(|&i| keys[i] >= tau_k).collect();
        order.sort_unstable_by(|&a, &b| keys[b].cmp(&keys[a]));
        let mut cum = 0.0;
        let mut j = 0;
        for &d in &distinct {
            while j < order.len() && keys[order[j]] >= d {
                cum += w[order[j]];
                j += 1;
            }
            by_key.push((d, cum));
        }
        let first_at = |g: f64| by_key.iter().find(|e| e.1 >= g).map(|e| e.0);
        let exact = first_at(goal).unwrap_or(tau_k);
        let hi = first_at(goal - eps).unwrap_or(tau_k);
        let lo = first_at(goal + eps).unwrap_or(*distinct.last().unwrap());
        taus = vec![exact];
        taus.extend(distinct.iter().copied().filter(|&d| d >= lo && d <= hi && d != exact));
    }
    let u = p.uniform() as f64;
    let mut exact = None;
    let mut accepted = Vec::new();
    for (n, &tau) in taus.iter().enumerate() {
        let s = mass(tau);
        let target = u * s;
        let eps = EPS * s;
        let mut cum = 0.0;
        let mut last_positive = top;
        for i in 0..keys.len() {
            if keys[i] < tau || w[i] == 0.0 {
                continue;
            }
            let before = cum;
            cum += w[i];
            last_positive = i;
            if n == 0 && exact.is_none() && cum > target {
                exact = Some(i);
            }
            if before - eps <= target && target < cum + eps {
                accepted.push(i);
            }
        }
        if n == 0 && exact.is_none() {
            exact = Some(last_positive);
        }
    }
    let exact = exact.unwrap();
    if !accepted.contains(&exact) {
        accepted.push(exact);
    }
    Some(Draw { exact, accepted })
}

// ---------------------------------------------------------------- cases

/// One GPU call: logits `[batch, vocab]`, one parameter row per logit row.
struct Case<T> {
    batch: usize,
    vocab: usize,
    logits: Vec<T>,
    params: Vec<SamplingParams>,
}

/// What came back.
struct Outcome {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
}

fn run<T: LogitType>(gpu: &Gpu, c: &Case<T>) -> Result<Outcome, String> {
    let e = |e: Error| e.to_string();
    let x = Tensor::from_host(gpu, &c.logits, &[c.batch, c.vocab]).map_err(e)?;
    let mut out = SampleOutput::new(gpu, c.batch, true).map_err(e)?;
    sample(gpu, &x, &c.params, &mut out).map_err(e)?;
    let tokens = out.tokens(gpu).map_err(e)?;
    let logprobs = out.logprobs(gpu).map_err(e)?.ok_or("no log-probabilities")?;
    Ok(Outcome { tokens, logprobs })
}

/// Seeded logits with what the kernels must get right: ties at the max,
/// -inf and NaN entries, and now and then a row with nothing above -inf.
fn logits<T: DType>(rng: &mut Rng, batch: usize, vocab: usize) -> Vec<T> {
    let scale = rng.pick(&[0.5f32, 2.0, 6.0]);
    let mut x = random_with_outliers(rng.next_u64(), batch * vocab, scale);
    for row in x.chunks_mut(vocab) {
        match rng.below(10) {
            0 => {
                // Coarse values: many ties, also at the top.
                row.iter_mut().for_each(|v| *v = (*v * 2.0).round() / 2.0);
            }
            1 => {
                for _ in 0..=vocab / 8 {
                    row[rng.below(vocab)] = f32::NEG_INFINITY;
                    row[rng.below(vocab)] = f32::NAN;
                }
            }
            2 if rng.below(4) == 0 => {
                let fill = rng.pick(&[f32::NEG_INFINITY, f32::NAN]);
                row.iter_mut().for_each(|v| *v = if rng.below(2) == 0 { fill } else { f32::NEG_INFINITY });
            }
            3 => {
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                row[rng.below(vocab)] = m;
                row[rng.below(vocab)] = f32::NAN;
            }
            _ => {}
        }
    }
    cast(&x)
}

const VOCABS: [usize; 16] = [1, 2, 3, 7, 31, 32, 33, 509, 1021, 4093, 4097, 8191, 32000, 65537, 128256, 151936];

/// A random shape: large vocabularies with few rows (the reference's time).
fn shape(rng: &mut Rng, i: usize) -> (usize, usize) {
    let vocab = if i < VOCABS.len() {
        VOCABS[i]
    } else if rng.below(3) == 0 {
        rng.pick(&VOCABS)
    } else {
        1 + rng.below(5000)
    };
    let batch = if vocab > 20000 { 1 + rng.below(4) } else { 1 + rng.below(64) };
    (batch, vocab)
}

fn random_params(rng: &mut Rng, vocab: usize) -> SamplingParams {
    let temperature = match rng.below(8) {
        0 => 0.0,
        1 => 0.05,
        2 => 3.0,
        _ => (0.2 + 1.5 * rng.unit()) as f32,
    };
    let top_k = match rng.below(5) {
        0 | 1 => 0,
        2 => rng.pick(&[1, 2, 5, 50]).min(vocab as u32),
        3 => vocab as u32,
        _ => 1 + rng.below(vocab) as u32,
    };
    let top_p = match rng.below(5) {
        0 | 1 => 1.0,
        2 => rng.pick(&[0.9f32, 0.5, 1e-3]),
        _ => (0.05 + 0.95 * rng.unit()) as f32,
    };
    SamplingParams { temperature, top_k, top_p, seed: rng.next_u64(), step: rng.next_u64() >> rng.below(64) }
}

fn cases() -> usize {
    if quick() {
        20
    } else {
        200
    }
}

fn row_of<T: DType>(c: &Case<T>, r: usize) -> (Vec<f64>, Vec<u32>) {
    let row = &c.logits[r * c.vocab..(r + 1) * c.vocab];
    let x: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
    let keys = x.iter().map(|&v| key(v as f32)).collect();
    (x, keys)
}

/// Checks one row's token and log-probability against the reference.
fn check_row<T: DType>(c: &Case<T>, r: usize, got: &Outcome, what: &str) -> Result<bool, String> {
    let (x, keys) = row_of(c, r);
    let p = &c.params[r];
    let (tok, lp) = (got.tokens[r], got.logprobs[r]);
    let Some(d) = reference_draw(&x, &keys, p) else {
        return if tok == 0 && lp.is_nan() {
            Ok(false)
        } else {
            Err(format!("{what} row {r}: no logit above -inf, got token {tok} log-prob {lp}"))
        };
    };
    if !d.accepted.contains(&(tok as usize)) {
        return Err(format!(
            "{what} row {r} ({p:?}): token {tok}, expected {} (accepted {:?})",
            d.exact,
            &d.accepted[..d.accepted.len().min(8)]
        ));
    }
    let want = log_prob(&x, &keys, tok as usize);
    let close =
        (lp as f64 - want).abs() <= 2e-3 + 1e-4 * want.abs() || (want == f64::NEG_INFINITY && lp == f32::NEG_INFINITY);
    if !close {
        return Err(format!("{what} row {r}: token {tok} log-prob {lp}, expected {want}"));
    }
    Ok(tok as usize != d.exact)
}

// ---------------------------------------------------------------- tests

/// Temperature 0 on every row: the argmax, exactly.
fn greedy_random_shapes<T: LogitType>(gpu: &Gpu) -> Result<(), String> {
    let mut rng = Rng(0x5eed_0001 + T::BYTES as u64);
    for i in 0..cases() {
        let (batch, vocab) = shape(&mut rng, i);
        let params = (0..batch).map(|_| SamplingParams { seed: rng.next_u64(), ..SamplingParams::GREEDY }).collect();
        let c = Case { batch, vocab, logits: logits::<T>(&mut rng, batch, vocab), params };
        let got = run(gpu, &c)?;
        for r in 0..batch {
            check_row(&c, r, &got, &format!("{} greedy {batch}x{vocab} case {i}", T::NAME))?;
        }
    }
    Ok(())
}

/// Random temperature, top-k, top-p and seeds (greedy rows mixed in): the
/// reference's token, or a neighbour where f32 rounding makes the edge ambiguous.
fn sampling_random_cases<T: LogitType>(gpu: &Gpu) -> Result<(), String> {
    let mut rng = Rng(0x5eed_0002 + T::BYTES as u64);
    let (mut rows, mut neighbours) = (0, 0);
    for i in 0..cases() {
        let (batch, vocab) = shape(&mut rng, i);
        let params = (0..batch).map(|_| random_params(&mut rng, vocab)).collect();
        let c = Case { batch, vocab, logits: logits::<T>(&mut rng, batch, vocab), params };
        plan::<T>(&[batch, vocab], &c.params, batch).map_err(|e| e.to_string())?;
        let got = run(gpu, &c)?;
        for r in 0..batch {
            rows += 1;
            neighbours += check_row(&c, r, &got, &format!("{} sample {batch}x{vocab} case {i}", T::NAME))? as usize;
        }
    }
    println!("    {rows} rows, {neighbours} drew an accepted neighbour of the exact token");
    // Neighbours only where the crossing falls within EPS of a token's edge: rare.
    if neighbours * 50 > rows {
        return Err(format!("{neighbours} of {rows} rows differ from the exact draw"));
    }
    Ok(())
}

/// Many seeds on one small row: the frequencies match the probabilities.
fn frequencies_match_probabilities(gpu: &Gpu) -> Result<(), String> {
    let row: Vec<f32> = vec![
        2.0,
        1.5,
        1.0,
        0.5,
        0.0,
        -0.5,
        -1.0,
        1.5,
        f32::NEG_INFINITY,
        f32::NAN,
        0.25,
        -2.0,
        -3.0,
        0.75,
        1.25,
        -0.25,
    ];
    let vocab = row.len();
    let batch = if quick() { 1024 } else { 4096 };
    let rounds = if quick() { 2 } else { 6 };
    let keys: Vec<u32> = row.iter().map(|&v| key(v)).collect();
    let x: Vec<f64> = row.iter().map(|&v| v as f64).collect();
    for (n, (t, k, p)) in [(1.0f32, 0u32, 1.0f32), (0.7, 5, 1.0), (1.5, 0, 0.8), (1.2, 6, 0.7)].into_iter().enumerate()
    {
        // The kept set and its probabilities, from the reference.
        let w = weights(&x, &keys, 2.0, t as f64);
        let tau_k = top_k_key(&keys, k);
        let mut probs: Vec<f64> = (0..vocab).map(|i| if keys[i] >= tau_k { w[i] } else { 0.0 }).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        if p < 1.0 {
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|&a, &b| keys[b].cmp(&keys[a]));
            let (mut cum, mut cut) = (0.0, u32::MAX);
            for &i in &order {
                if cum >= p as f64 && keys[i] < cut {
                    break;
                }
                cum += probs[i];
                cut = keys[i];
            }
            probs.iter_mut().zip(&keys).for_each(|(q, &kk)| {
                if kk < cut {
                    *q = 0.0
                }
            });
            let s: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|q| *q /= s);
        }
        let mut counts = vec![0usize; vocab];
        for round in 0..rounds {
            let params: Vec<SamplingParams> = (0..batch)
                .map(|r| SamplingParams {
                    temperature: t,
                    top_k: k,
                    top_p: p,
                    seed: (n * 1_000_003 + r) as u64,
                    step: round as u64,
                })
                .collect();
            let c = Case { batch, vocab, logits: row.repeat(batch), params };
            for tok in run(gpu, &c)?.tokens {
                *counts.get_mut(tok as usize).ok_or(format!("token {tok} out of range"))? += 1;
            }
        }
        let draws = (batch * rounds) as f64;
        for i in 0..vocab {
            let f = counts[i] as f64 / draws;
            let q = probs[i];
            let sigma = (q * (1.0 - q) / draws).sqrt();
            if (q == 0.0 && counts[i] > 0) || (f - q).abs() > 5.0 * sigma + 1e-3 {
                return Err(format!("T {t} k {k} p {p}: token {i} drawn {f:.4} of the time, probability {q:.4}"));
            }
        }
    }
    Ok(())
}

/// The same (seed, step) gives the same token, wherever the row sits in the
/// batch and on every call; new steps give new draws that follow the reference.
fn reproducible_draws(gpu: &Gpu) -> Result<(), String> {
    let mut rng = Rng(0x5eed_0003);
    let (batch, vocab) = (24, 32000);
    let row: Vec<bf16> = logits(&mut rng, 1, vocab);
    let p = SamplingParams { temperature: 0.9, top_k: 200, top_p: 0.95, seed: 42, step: 7 };
    let c = Case { batch, vocab, logits: row.repeat(batch), params: vec![p; batch] };
    let a = run(gpu, &c)?;
    let b = run(gpu, &c)?;
    if a.tokens.iter().any(|&t| t != a.tokens[0]) {
        return Err(format!("one (seed, step) in {batch} rows drew {:?}", a.tokens));
    }
    if a.tokens != b.tokens || a.logprobs.iter().zip(&b.logprobs).any(|(x, y)| x.to_bits() != y.to_bits()) {
        return Err("two calls on the same input differ".into());
    }
    // One row per step: the draws vary, and each is the reference's.
    let flat = Case {
        batch: 64,
        vocab: 1000,
        logits: vec![bf16::ZERO; 64 * 1000],
        params: (0..64).map(|s| SamplingParams::new(1.0, 42, s)).collect(),
    };
    let got = run(gpu, &flat)?;
    let distinct: std::collections::HashSet<u32> = got.tokens.iter().copied().collect();
    if distinct.len() < 50 {
        return Err(format!("64 steps drew only {} distinct tokens of 1000", distinct.len()));
    }
    for r in 0..64 {
        check_row(&flat, r, &got, "flat row")?;
    }
    Ok(())
}

/// NaN, ±inf and ties, greedy and sampled.
fn special_values(gpu: &Gpu) -> Result<(), String> {
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let rows: Vec<(Vec<f32>, Vec<usize>)> = vec![
        (vec![nan; 5], vec![0]),
        (vec![f32::NEG_INFINITY; 5], vec![0]),
        (vec![nan, f32::NEG_INFINITY, -3.0, nan, f32::NEG_INFINITY], vec![2]),
        (vec![1.0, 3.0, nan, 3.0, 2.0], vec![1, 3]),
        (vec![nan, inf, 0.0, inf, 1e30], vec![1, 3]),
        (vec![-1e30, -1e30, nan, -1e30, f32::NEG_INFINITY], vec![0, 1, 3]),
    ];
    for params in [
        SamplingParams::GREEDY,
        SamplingParams::new(1.0, 3, 4),
        SamplingParams { top_k: 1, ..SamplingParams::new(2.0, 5, 6) },
    ] {
        let vocab = 5;
        let c = Case {
            batch: rows.len(),
            vocab,
            logits: rows.iter().flat_map(|r| r.0.clone()).collect::<Vec<f32>>(),
            params: vec![params; rows.len()],
        };
        let got = run(gpu, &c)?;
        for (r, (_, allowed)) in rows.iter().enumerate() {
            let tok = got.tokens[r] as usize;
            // Greedy takes the first maximum; top-k 1 keeps every tie of it;
            // plain sampling may take any token above -inf (`check_row`).
            let ok =
                if params.temperature == 0.0 { tok == allowed[0] } else { params.top_k != 1 || allowed.contains(&tok) };
            // A row with nothing above -inf gets token 0 by definition, NaN or not.
            let degenerate = rows[r].0.iter().all(|x| x.is_nan() || *x == f32::NEG_INFINITY);
            if !ok || (!degenerate && c.logits[r * vocab + tok].is_nan()) {
                return Err(format!("{params:?} row {r}: token {tok}, expected one of {allowed:?}"));
            }
            check_row(&c, r, &got, "special")?;
        }
    }
    Ok(())
}

/// Every refused argument returns its error before any upload or launch.
fn bad_input(gpu: &Gpu) -> Result<(), String> {
    let x = Tensor::<f32>::from_host(gpu, &[0.5; 15], &[3, 5]).map_err(|e| e.to_string())?;
    let mut flat = Tensor::<f32>::from_host(gpu, &[0.5; 15], &[3, 5]).map_err(|e| e.to_string())?;
    flat.reshape(&[15]).map_err(|e| e.to_string())?;
    let deep = Tensor::<bf16>::filled(gpu, &[3, 5, 1], bf16::ZERO).map_err(|e| e.to_string())?;
    let mut out = SampleOutput::new(gpu, 3, true).map_err(|e| e.to_string())?;
    let mut out4 = SampleOutput::new(gpu, 4, false).map_err(|e| e.to_string())?;
    let g = SamplingParams::GREEDY;
    let with = |row: SamplingParams| vec![g, g, row];
    let before = gpu.launch_count();
    let shape = |r: host::Result<()>| matches!(r, Err(Error::Shape(_)));
    let invalid = |r: host::Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
    let checks = [
        ("two parameter rows", shape(sample(gpu, &x, &[g, g], &mut out))),
        ("output of 4 rows", shape(sample(gpu, &x, &[g; 3], &mut out4))),
        ("1-D logits", shape(sample(gpu, &flat, &[g; 3], &mut out))),
        ("3-D logits", shape(sample(gpu, &deep, &[g; 3], &mut out))),
        ("negative temperature", invalid(sample(gpu, &x, &with(SamplingParams { temperature: -1.0, ..g }), &mut out))),
        ("NaN temperature", invalid(sample(gpu, &x, &with(SamplingParams { temperature: f32::NAN, ..g }), &mut out))),
        ("top_p 0", invalid(sample(gpu, &x, &with(SamplingParams { top_p: 0.0, ..g }), &mut out))),
        ("top_p above 1", invalid(sample(gpu, &x, &with(SamplingParams { top_p: 1.5, ..g }), &mut out))),
        ("top_k above the vocabulary", invalid(sample(gpu, &x, &with(SamplingParams { top_k: 6, ..g }), &mut out))),
        ("empty output", matches!(SampleOutput::new(gpu, 0, false), Err(Error::Empty(_)))),
    ];
    if let Some((what, _)) = checks.iter().find(|c| !c.1) {
        return Err(format!("{what}: not refused with its error"));
    }
    if gpu.launch_count() != before {
        return Err(format!("{} launches on refused arguments", gpu.launch_count() - before));
    }
    if out.tokens(gpu).map_err(|e| e.to_string())? != vec![u32::MAX; 3] {
        return Err("a refused call wrote tokens".into());
    }
    Ok(())
}

/// The shape list and the reference hold what they promise (also without a GPU).
fn check_reference() {
    let mut rng = Rng(1);
    let shapes: Vec<_> = (0..200).map(|i| shape(&mut rng, i)).collect();
    assert!(VOCABS.iter().all(|v| shapes.iter().any(|s| s.1 == *v)));
    assert!(shapes.iter().all(|&(b, v)| (1..=64).contains(&b) && v >= 1));
    // Flat row: the draw is floor(u · vocab) (exact in f64 for these u).
    let keys = vec![key(0.0); 10];
    let x = vec![0.0; 10];
    for s in 0..20 {
        let p = SamplingParams::new(1.0, 9, s);
        let d = reference_draw(&x, &keys, &p).unwrap();
        assert_eq!(d.exact, (p.uniform() as f64 * 10.0) as usize);
    }
    // Top-k keeps ties at the k-th value; top-p the smallest set reaching p.
    let xs = [3.0, 1.0, 2.0, 2.0, 0.0];
    let keys: Vec<u32> = xs.iter().map(|&v| key(v)).collect();
    assert_eq!(top_k_key(&keys, 2), key(2.0));
    let x: Vec<f64> = xs.iter().map(|&v| v as f64).collect();
    let p = SamplingParams { top_p: 1e-3, ..SamplingParams::new(1.0, 1, 1) };
    assert_eq!(reference_draw(&x, &keys, &p).unwrap().exact, 0);
    assert_eq!(argmax(&[0, NEG_INF_KEY, 0]), None);
}

fn main() {
    check_reference();
    let mut t = GpuTests::new("sampling");
    t.run("sampling_greedy_bf16_random_shapes", greedy_random_shapes::<bf16>);
    t.run("sampling_greedy_f32_random_shapes", greedy_random_shapes::<f32>);
    t.run("sampling_bf16_random_cases", sampling_random_cases::<bf16>);
    t.run("sampling_f32_random_cases", sampling_random_cases::<f32>);
    t.run("sampling_frequencies_match_probabilities", frequencies_match_probabilities);
    t.run("sampling_reproducible_draws", reproducible_draws);
    t.run("sampling_special_values", special_values);
    t.run("sampling_bad_input_fails_before_launch", bad_input);
    t.finish();
}
