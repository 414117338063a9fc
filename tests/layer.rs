//! GPU tests of the fused decoder layer against the f64 reference layer: prefill of
//! several prompts, decode steps with sequences joining and leaving, decode versus
//! a longer prefill, prompts in chunks, a forked prefix, decode steps of several
//! tokens a sequence, rows of the full reference config, and clean errors.

use host::layer::reference::{layer_forward, RefCache};
use host::layer::{Layer, LayerConfig, LayerWeights};
use host::ops::{DecodeVersion, GemmVersion};
use host::reference::round_bf16;
use host::{bf16, Arch, Error, Gpu, Tensor};
use lab::testing::{cast, expect_close, quick, random_with_outliers, rel_l2_error, to_f64, GpuTests};

fn e(err: Error) -> String {
    err.to_string()
}

/// Tokens as bf16 (what the GPU sees) and as f64 (what the reference sees).
fn tokens(seed: u64, n: usize, d: usize) -> (Vec<bf16>, Vec<f64>) {
    let x: Vec<bf16> = cast(&random_with_outliers(seed, n * d, 1.0));
    let x64 = to_f64(&x).into_iter().map(round_bf16).collect();
    (x, x64)
}

fn run_prefill(
    gpu: &Gpu,
    layer: &mut Layer,
    seqs: &[host::ops::SeqId],
    lens: &[usize],
    x: &[bf16],
) -> Result<Vec<f64>, String> {
    let (t, d) = (lens.iter().sum::<usize>(), layer.config().d_model);
    let xt = Tensor::from_host(gpu, x, &[t, d]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[t, d], bf16::NAN).map_err(e)?;
    layer.prefill(gpu, seqs, lens, &xt, &mut out).map_err(e)?;
    Ok(to_f64(&out.to_host(gpu).map_err(e)?))
}

fn run_decode(gpu: &Gpu, layer: &mut Layer, seqs: &[host::ops::SeqId], x: &[bf16]) -> Result<Vec<f64>, String> {
    let d = layer.config().d_model;
    let xt = Tensor::from_host(gpu, x, &[seqs.len(), d]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[seqs.len(), d], bf16::NAN).map_err(e)?;
    layer.decode(gpu, seqs, &xt, &mut out).map_err(e)?;
    Ok(to_f64(&out.to_host(gpu).map_err(e)?))
}

/// Prefill of two prompts, then decode steps where a third sequence joins (by
/// prefill) and the first leaves, each output checked against the reference.
fn continuous_batching(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig::small();
    let d = c.d_model;
    let w = LayerWeights::random(&c, 70).map_err(e)?;
    let mut layer = Layer::new(gpu, &c, &w, 4096, 16, 512).map_err(e)?;
    let lens = if quick() { [5usize, 17] } else { [37usize, 70] };
    let (a, b) = (layer.add_sequence(), layer.add_sequence());
    let (xa, xa64) = tokens(71, lens[0], d);
    let (xb, xb64) = tokens(72, lens[1], d);
    let got = run_prefill(gpu, &mut layer, &[a, b], &lens, &[xa.clone(), xb.clone()].concat())?;
    let (mut ca, mut cb, mut cc) = (RefCache::default(), RefCache::default(), RefCache::default());
    let want = [layer_forward(&c, &w, &xa64, &mut ca), layer_forward(&c, &w, &xb64, &mut cb)].concat();
    expect_close("prefill of two prompts", rel_l2_error(&got, &want), 1e-2)?;

    // Step 1: a and b.
    let (x1, x1_64) = tokens(73, 2, d);
    let got = run_decode(gpu, &mut layer, &[a, b], &x1)?;
    let want = [layer_forward(&c, &w, &x1_64[..d], &mut ca), layer_forward(&c, &w, &x1_64[d..], &mut cb)].concat();
    expect_close("decode step 1", rel_l2_error(&got, &want), 1e-2)?;

    // c joins while a and b are mid-generation.
    let cs = layer.add_sequence();
    let (xc, xc64) = tokens(74, 9, d);
    let got = run_prefill(gpu, &mut layer, &[cs], &[9], &xc)?;
    expect_close("prefill while others decode", rel_l2_error(&got, &layer_forward(&c, &w, &xc64, &mut cc)), 1e-2)?;

    // Step 2 in a shuffled order, then a leaves and step 3 runs on c and b.
    let (x2, x2_64) = tokens(75, 3, d);
    let got = run_decode(gpu, &mut layer, &[b, cs, a], &x2)?;
    let want = [
        layer_forward(&c, &w, &x2_64[..d], &mut cb),
        layer_forward(&c, &w, &x2_64[d..2 * d], &mut cc),
        layer_forward(&c, &w, &x2_64[2 * d..], &mut ca),
    ]
    .concat();
    expect_close("decode step 2 (shuffled)", rel_l2_error(&got, &want), 1e-2)?;
    let free = layer.cache().alloc().free_pages();
    layer.release(a).map_err(e)?;
    if layer.cache().alloc().free_pages() <= free {
        return Err("releasing a sequence returned no pages".into());
    }
    let (x3, x3_64) = tokens(76, 2, d);
    let got = run_decode(gpu, &mut layer, &[cs, b], &x3)?;
    let want = [layer_forward(&c, &w, &x3_64[..d], &mut cc), layer_forward(&c, &w, &x3_64[d..], &mut cb)].concat();
    expect_close("decode step 3 after a left", rel_l2_error(&got, &want), 1e-2)
}

/// A prefill whose four projections store by TMA (`GemmVersion::TmaStore`:
/// plain QKV, residual O and down, SwiGLU gate/up) matches the reference, and
/// a decode step after it reads the cache it wrote (sm_90a; elsewhere the
/// version is refused and nothing grows).
fn prefill_on_tma_store_gemms(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig::small();
    let d = c.d_model;
    let w = LayerWeights::random(&c, 60).map_err(e)?;
    let mut layer = Layer::new(gpu, &c, &w, 4096, 16, 1024).map_err(e)?;
    layer.prefill_gemm = GemmVersion::TmaStore;
    let lens = if quick() { [5usize, 200] } else { [37usize, 300] };
    let seqs = [layer.add_sequence(), layer.add_sequence()];
    let (x0, x0_64) = tokens(61, lens[0], d);
    let (x1, x1_64) = tokens(62, lens[1], d);
    let got = run_prefill(gpu, &mut layer, &seqs, &lens, &[x0, x1].concat());
    if gpu.info().arch != Arch::Sm90a {
        let grew = layer.cache().alloc().len(seqs[0]).map_err(e)? != 0;
        return match got {
            Err(_) if !grew => Ok(()),
            other => Err(format!("TmaStore prefill off Hopper: {other:?} (grew: {grew})")),
        };
    }
    let (mut c0, mut c1) = (RefCache::default(), RefCache::default());
    let want = [layer_forward(&c, &w, &x0_64, &mut c0), layer_forward(&c, &w, &x1_64, &mut c1)].concat();
    expect_close("prefill on TmaStore GEMMs", rel_l2_error(&got?, &want), 1e-2)?;
    layer.prefill_gemm = GemmVersion::Auto;
    let (xs, xs64) = tokens(63, 2, d);
    let got = run_decode(gpu, &mut layer, &seqs, &xs)?;
    let want = [layer_forward(&c, &w, &xs64[..d], &mut c0), layer_forward(&c, &w, &xs64[d..], &mut c1)].concat();
    expect_close("decode after it", rel_l2_error(&got, &want), 1e-2)
}

/// Decoding k tokens after a prefill gives what a prefill of all of them gives.
fn decode_matches_longer_prefill(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig::small();
    let d = c.d_model;
    let w = LayerWeights::random(&c, 80).map_err(e)?;
    let mut layer = Layer::new(gpu, &c, &w, 1024, 64, 256).map_err(e)?;
    let (n, extra) = (23, 4);
    let (x, _) = tokens(81, n + extra, d);
    let long = layer.add_sequence();
    let full = run_prefill(gpu, &mut layer, &[long], &[n + extra], &x)?;
    let s = layer.add_sequence();
    run_prefill(gpu, &mut layer, &[s], &[n], &x[..n * d])?;
    let mut stepped = Vec::new();
    for i in 0..extra {
        stepped.extend(run_decode(gpu, &mut layer, &[s], &x[(n + i) * d..(n + i + 1) * d])?);
    }
    expect_close("decode vs longer prefill", rel_l2_error(&stepped, &full[n * d..]), 1e-2)
}

/// CUDA-graph decode steps give what plain decode steps give, on twin sequences.
fn graph_matches_plain_decode(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig::small();
    let d = c.d_model;
    let w = LayerWeights::random(&c, 85).map_err(e)?;
    let mut layer = Layer::new(gpu, &c, &w, 4096, 16, 256).map_err(e)?;
    let lens = [13usize, 40];
    let (p0, _) = tokens(86, lens[0], d);
    let (p1, _) = tokens(87, lens[1], d);
    let prompt = [p0, p1].concat();
    let plain = [layer.add_sequence(), layer.add_sequence()];
    let graph = [layer.add_sequence(), layer.add_sequence()];
    run_prefill(gpu, &mut layer, &plain, &lens, &prompt)?;
    run_prefill(gpu, &mut layer, &graph, &lens, &prompt)?;
    let mut g = None;
    for step in 0..4 {
        let (x, _) = tokens(88 + step, 2, d);
        let want = run_decode(gpu, &mut layer, &plain, &x)?;
        let xt = Tensor::from_host(gpu, &x, &[2, d]).map_err(e)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[2, d], bf16::NAN).map_err(e)?;
        match g.as_mut() {
            None => g = Some(layer.capture_decode(gpu, &graph, &xt, &mut out).map_err(e)?),
            Some(g) => layer.decode_graph(gpu, g, &xt, &mut out).map_err(e)?,
        }
        let got = to_f64(&out.to_host(gpu).map_err(e)?);
        expect_close(&format!("graph decode step {step}"), rel_l2_error(&got, &want), 1e-2)?;
    }
    // In place: the graph's own input written (from the host, then from a
    // tensor), its own output read, no copies around the replay.
    let in_place = g.as_mut().ok_or("no graph")?;
    for step in 0..2 {
        let (x, _) = tokens(92 + step, 2, d);
        let want = run_decode(gpu, &mut layer, &plain, &x)?;
        if step == 0 {
            in_place.input().copy_from_host(gpu, &x).map_err(e)?;
        } else {
            in_place.input().copy_from(gpu, &Tensor::from_host(gpu, &x, &[2, d]).map_err(e)?).map_err(e)?;
        }
        layer.replay_decode(gpu, in_place).map_err(e)?;
        let got = to_f64(&in_place.output().to_host(gpu).map_err(e)?);
        expect_close(&format!("graph replay in place, step {step}"), rel_l2_error(&got, &want), 1e-2)?;
    }
    // Dropped and captured again, this time with the split-KV merge fused into the
    // split kernel (one-warp, then 4-warp blocks; the graph keeps the version, plain
    // steps stay on two launches): each new graph still matches.
    drop(g);
    let versions = [DecodeVersion::Fused, DecodeVersion::Wide, DecodeVersion::Cluster, DecodeVersion::Wide8];
    for (i, version) in versions.into_iter().enumerate() {
        let (x, _) = tokens(95 + 2 * i as u64, 2, d);
        let want = run_decode(gpu, &mut layer, &plain, &x)?;
        let xt = Tensor::from_host(gpu, &x, &[2, d]).map_err(e)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[2, d], bf16::NAN).map_err(e)?;
        layer.decode_version = version;
        let captured = layer.capture_decode(gpu, &graph, &xt, &mut out);
        layer.decode_version = DecodeVersion::Auto;
        let mut g = captured.map_err(e)?;
        let got = to_f64(&out.to_host(gpu).map_err(e)?);
        expect_close(&format!("recaptured step ({version:?})"), rel_l2_error(&got, &want), 1e-2)?;
        let (x, _) = tokens(96 + 2 * i as u64, 2, d);
        let want = run_decode(gpu, &mut layer, &plain, &x)?;
        let xt = Tensor::from_host(gpu, &x, &[2, d]).map_err(e)?;
        layer.decode_graph(gpu, &mut g, &xt, &mut out).map_err(e)?;
        let got = to_f64(&out.to_host(gpu).map_err(e)?);
        expect_close(&format!("replay after recapture ({version:?})"), rel_l2_error(&got, &want), 1e-2)?;
    }
    Ok(())
}

/// A few rows of the reference layer (Llama-3-8B sizes): prefill of 3 tokens and
/// one decode step.
fn reference_config_rows(gpu: &Gpu) -> Result<(), String> {
    if quick() {
        return Ok(());
    }
    let c = LayerConfig::default();
    let d = c.d_model;
    let w = LayerWeights::random(&c, 90).map_err(e)?;
    let mut layer = Layer::new(gpu, &c, &w, 256, 64, 256).map_err(e)?;
    let s = layer.add_sequence();
    let (x, x64) = tokens(91, 4, d);
    let got = run_prefill(gpu, &mut layer, &[s], &[3], &x[..3 * d])?;
    let mut cache = RefCache::default();
    expect_close(
        "reference config prefill",
        rel_l2_error(&got, &layer_forward(&c, &w, &x64[..3 * d], &mut cache)),
        1e-2,
    )?;
    let got = run_decode(gpu, &mut layer, &[s], &x[3 * d..])?;
    expect_close("reference config decode", rel_l2_error(&got, &layer_forward(&c, &w, &x64[3 * d..], &mut cache)), 1e-2)
}

/// A pool too small for a prompt or for a prompt's next chunk, a decode on an
/// empty sequence and a sequence twice in one step all fail before any launch,
/// changing nothing.
fn bad_input(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig::small();
    let d = c.d_model;
    let w = LayerWeights::random(&c, 60).map_err(e)?;
    let mut layer = Layer::new(gpu, &c, &w, 64, 16, 128).map_err(e)?;
    let (a, b) = (layer.add_sequence(), layer.add_sequence());
    let free = layer.cache().alloc().free_pages();
    let (x, _) = tokens(61, 80, d);
    let xt = Tensor::from_host(gpu, &x, &[80, d]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[80, d], bf16::NAN).map_err(e)?;
    let launches = gpu.launch_count();
    match layer.prefill(gpu, &[a, b], &[40, 40], &xt, &mut out) {
        Err(Error::TooLarge(_)) => {}
        other => return Err(format!("80 tokens into a 64-token pool gave {other:?}")),
    }
    if layer.cache().alloc().free_pages() != free
        || layer.cache().alloc().len(a).map_err(e)? != 0
        || gpu.launch_count() != launches
    {
        return Err("a refused prefill changed the cache or launched".into());
    }
    let (x1, _) = tokens(62, 1, d);
    let x1t = Tensor::from_host(gpu, &x1, &[1, d]).map_err(e)?;
    let mut o1 = Tensor::<bf16>::filled(gpu, &[1, d], bf16::NAN).map_err(e)?;
    if !matches!(layer.decode(gpu, &[a], &x1t, &mut o1), Err(Error::InvalidArgument(_))) {
        return Err("decode before any prompt was not refused".into());
    }
    let xt5 = Tensor::from_host(gpu, &x[..5 * d], &[5, d]).map_err(e)?;
    let mut o5 = Tensor::<bf16>::filled(gpu, &[5, d], bf16::NAN).map_err(e)?;
    layer.prefill(gpu, &[a], &[5], &xt5, &mut o5).map_err(e)?;
    let xt60 = Tensor::from_host(gpu, &x[..60 * d], &[60, d]).map_err(e)?;
    let mut o60 = Tensor::<bf16>::filled(gpu, &[60, d], bf16::NAN).map_err(e)?;
    let launches = gpu.launch_count();
    if !matches!(layer.prefill(gpu, &[a], &[60], &xt60, &mut o60), Err(Error::TooLarge(_)))
        || layer.cache().alloc().len(a).map_err(e)? != 5
        || gpu.launch_count() != launches
    {
        return Err("a next chunk past the pool was not refused, or changed the sequence".into());
    }
    let x2t = Tensor::from_host(gpu, &x[..2 * d], &[2, d]).map_err(e)?;
    let mut o2 = Tensor::<bf16>::filled(gpu, &[2, d], bf16::NAN).map_err(e)?;
    if !matches!(layer.decode(gpu, &[a, a], &x2t, &mut o2), Err(Error::InvalidArgument(_))) {
        return Err("a sequence twice in one step was not refused".into());
    }
    Ok(())
}

/// A captured decode graph replays only on the layer that captured it, and only
/// while its sequences live: otherwise the step is refused before anything is
/// launched or any sequence grows (its addresses point into that layer's
/// buffers and pages).
fn graph_refusals(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig::small();
    let d = c.d_model;
    let w = LayerWeights::random(&c, 110).map_err(e)?;
    let mut layer = Layer::new(gpu, &c, &w, 1024, 16, 128).map_err(e)?;
    let mut other = Layer::new(gpu, &c, &w, 1024, 16, 128).map_err(e)?;
    let seqs = [layer.add_sequence(), layer.add_sequence()];
    let (prompt, _) = tokens(111, 10, d);
    run_prefill(gpu, &mut layer, &seqs, &[3, 7], &prompt)?;
    let _ = other.add_sequence();
    let (x, _) = tokens(112, 2, d);
    let xt = Tensor::from_host(gpu, &x, &[2, d]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[2, d], bf16::NAN).map_err(e)?;
    let mut g = layer.capture_decode(gpu, &seqs, &xt, &mut out).map_err(e)?;
    let lens = |l: &Layer| seqs.iter().map(|&s| l.cache().alloc().len(s)).collect::<Result<Vec<_>, _>>();
    let before = lens(&layer).map_err(e)?;
    let launches = gpu.launch_count();
    if !matches!(other.decode_graph(gpu, &mut g, &xt, &mut out), Err(Error::InvalidArgument(_))) {
        return Err("a graph replayed on another layer".into());
    }
    layer.release(seqs[1]).map_err(e)?;
    if !matches!(layer.decode_graph(gpu, &mut g, &xt, &mut out), Err(Error::InvalidArgument(_))) {
        return Err("a graph replayed after one of its sequences was released".into());
    }
    if gpu.launch_count() != launches || layer.cache().alloc().len(seqs[0]).map_err(e)? != before[0] {
        return Err("a refused graph step launched or grew a sequence".into());
    }
    Ok(())
}

/// A mixed step (a new prompt plus one token of each running sequence) against
/// the same work as a prefill and a decode step on a twin layer: equal outputs
/// within bf16 tolerance, and a decode step after it equal too (the cache got
/// the same K and V). Under `quick()` a short prompt.
fn mixed_step_matches_prefill_and_decode(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig::small();
    let d = c.d_model;
    let w = LayerWeights::random(&c, 95).map_err(e)?;
    let (mut apart, mut mixed) =
        (Layer::new(gpu, &c, &w, 2048, 16, 640).map_err(e)?, Layer::new(gpu, &c, &w, 2048, 16, 640).map_err(e)?);
    let (running_lens, chunk) = if quick() { ([7usize, 20], 33) } else { ([13usize, 300], 512) };
    let (xr, _) = tokens(96, running_lens.iter().sum(), d);
    let (xp, _) = tokens(97, chunk, d);
    let (xn, _) = tokens(98, 2, d);
    let (xs, _) = tokens(99, 3, d);
    let mut seqs = Vec::new();
    for layer in [&mut apart, &mut mixed] {
        let r = [layer.add_sequence(), layer.add_sequence()];
        run_prefill(gpu, layer, &r, &running_lens, &xr)?;
        seqs.push((r, layer.add_sequence()));
    }
    let ((ra, pa), (rm, pm)) = (seqs[0], seqs[1]);
    let want_p = run_prefill(gpu, &mut apart, &[pa], &[chunk], &xp)?;
    let want_r = run_decode(gpu, &mut apart, &ra, &xn)?;

    let t = chunk + 2;
    let x: Vec<bf16> = xp.iter().chain(&xn).copied().collect();
    let xt = Tensor::from_host(gpu, &x, &[t, d]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[t, d], bf16::NAN).map_err(e)?;
    mixed.mixed(gpu, &[pm], &[chunk], &rm, &xt, &mut out).map_err(e)?;
    let got = to_f64(&out.to_host(gpu).map_err(e)?);
    let tol = 1e-2;
    expect_close("mixed step, prompt rows", rel_l2_error(&got[..chunk * d], &want_p), tol)?;
    expect_close("mixed step, running rows", rel_l2_error(&got[chunk * d..], &want_r), tol)?;

    let next_a = run_decode(gpu, &mut apart, &[pa, ra[0], ra[1]], &xs)?;
    let next_m = run_decode(gpu, &mut mixed, &[pm, rm[0], rm[1]], &xs)?;
    expect_close("decode after the mixed step", rel_l2_error(&next_m, &next_a), tol)?;
    // Two more mixed steps, three running rows each (the layer's tail buffers
    // made again for the new count, then reused), each with a new prompt.
    for (round, len) in [(0u64, 5usize), (1, 17)] {
        let (xq, _) = tokens(100 + round, len, d);
        let (xr3, _) = tokens(110 + round, 3, d);
        let (qa, qm) = (apart.add_sequence(), mixed.add_sequence());
        let want_q = run_prefill(gpu, &mut apart, &[qa], &[len], &xq)?;
        let want_r3 = run_decode(gpu, &mut apart, &[pa, ra[0], ra[1]], &xr3)?;
        let x: Vec<bf16> = xq.iter().chain(&xr3).copied().collect();
        let xt = Tensor::from_host(gpu, &x, &[len + 3, d]).map_err(e)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[len + 3, d], bf16::NAN).map_err(e)?;
        mixed.mixed(gpu, &[qm], &[len], &[pm, rm[0], rm[1]], &xt, &mut out).map_err(e)?;
        let got = to_f64(&out.to_host(gpu).map_err(e)?);
        expect_close(&format!("mixed step {round}, prompt rows"), rel_l2_error(&got[..len * d], &want_q), tol)?;
        expect_close(&format!("mixed step {round}, running rows"), rel_l2_error(&got[len * d..], &want_r3), tol)?;
    }
    // A sequence cannot be both.
    let x3 = Tensor::from_host(gpu, &xs, &[3, d]).map_err(e)?;
    let mut out3 = Tensor::<bf16>::filled(gpu, &[3, d], bf16::NAN).map_err(e)?;
    let both = mixed.mixed(gpu, &[rm[0]], &[1], &rm, &x3, &mut out3);
    match both {
        Err(Error::InvalidArgument(_)) => Ok(()),
        other => Err(format!("a sequence both prompt and running gave {other:?}")),
    }
}

/// Chunked prefill: a prompt run in chunks of 1, 16, 17 and the rest, each
/// chunk attending to the ones before it, against the reference fed the same
/// chunks: the second chunk beside a new prompt in one prefill, the third in a
/// mixed step with a running sequence; the last one again after a truncate;
/// then a decode step over all three.
fn chunked_prefill(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig::small();
    let d = c.d_model;
    let w = LayerWeights::random(&c, 120).map_err(e)?;
    let mut layer = Layer::new(gpu, &c, &w, 4096, 16, 1024).map_err(e)?;
    let total = if quick() { 100 } else { 437 };
    let chunks = [1usize, 16, 17, total - 34];
    let (a, b, r) = (layer.add_sequence(), layer.add_sequence(), layer.add_sequence());
    let (mut ca, mut cb, mut cr) = (RefCache::default(), RefCache::default(), RefCache::default());
    let (xa, xa64) = tokens(121, total, d);
    let (xr, xr64) = tokens(122, 10, d);
    let got = run_prefill(gpu, &mut layer, &[r], &[9], &xr[..9 * d])?;
    expect_close("running prompt", rel_l2_error(&got, &layer_forward(&c, &w, &xr64[..9 * d], &mut cr)), 1e-2)?;
    let (mut at, mut last_want) = (0, Vec::new());
    for (i, &n) in chunks.iter().enumerate() {
        let (x, x64) = (&xa[at * d..(at + n) * d], &xa64[at * d..(at + n) * d]);
        let want_a = layer_forward(&c, &w, x64, &mut ca);
        last_want.clone_from(&want_a);
        let what = format!("chunk {i} ({n} tokens after {at})");
        match i {
            1 => {
                let (xb, xb64) = tokens(123, 5, d);
                let got = run_prefill(gpu, &mut layer, &[a, b], &[n, 5], &[x, &xb[..]].concat())?;
                let want = [want_a, layer_forward(&c, &w, &xb64, &mut cb)].concat();
                expect_close(&format!("{what} beside a new prompt"), rel_l2_error(&got, &want), 1e-2)?;
            }
            2 => {
                let xt = Tensor::from_host(gpu, &[x, &xr[9 * d..]].concat(), &[n + 1, d]).map_err(e)?;
                let mut out = Tensor::<bf16>::filled(gpu, &[n + 1, d], bf16::NAN).map_err(e)?;
                layer.mixed(gpu, &[a], &[n], &[r], &xt, &mut out).map_err(e)?;
                let got = to_f64(&out.to_host(gpu).map_err(e)?);
                expect_close(&format!("{what} in a mixed step"), rel_l2_error(&got[..n * d], &want_a), 1e-2)?;
                let want_r = layer_forward(&c, &w, &xr64[9 * d..], &mut cr);
                expect_close("the mixed step's running row", rel_l2_error(&got[n * d..], &want_r), 1e-2)?;
            }
            _ => expect_close(&what, rel_l2_error(&run_prefill(gpu, &mut layer, &[a], &[n], x)?, &want_a), 1e-2)?,
        }
        at += n;
    }
    if layer.cache().alloc().len(a).map_err(e)? != total {
        return Err(format!("the chunks left {:?} tokens, not {total}", layer.cache().alloc().len(a)));
    }
    // A mixed step whose running sequence holds no prompt is refused, and the
    // continuing prompt's length is as before (nothing launched).
    let empty = layer.add_sequence();
    let xt = Tensor::from_host(gpu, &xa[..3 * d], &[3, d]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[3, d], bf16::NAN).map_err(e)?;
    let launches = gpu.launch_count();
    if layer.mixed(gpu, &[a], &[2], &[empty], &xt, &mut out).is_ok()
        || layer.cache().alloc().len(a).map_err(e)? != total
        || gpu.launch_count() != launches
    {
        return Err("a refused mixed step changed its continuing prompt or launched".into());
    }
    // The last chunk truncated away and run again; a truncate past the length refused.
    let last = chunks[3];
    layer.truncate(gpu, a, total - last).map_err(e)?;
    let again = run_prefill(gpu, &mut layer, &[a], &[last], &xa[(total - last) * d..])?;
    expect_close("the last chunk again after a truncate", rel_l2_error(&again, &last_want), 1e-2)?;
    if layer.truncate(gpu, a, total + 1).is_ok() || layer.cache().alloc().len(a).map_err(e)? != total {
        return Err("a truncate past the sequence's length was not refused".into());
    }
    let (xs, xs64) = tokens(124, 3, d);
    let got = run_decode(gpu, &mut layer, &[a, b, r], &xs)?;
    let want = [
        layer_forward(&c, &w, &xs64[..d], &mut ca),
        layer_forward(&c, &w, &xs64[d..2 * d], &mut cb),
        layer_forward(&c, &w, &xs64[2 * d..], &mut cr),
    ]
    .concat();
    expect_close("decode after the chunks", rel_l2_error(&got, &want), 1e-2)
}

/// A shared prefix: a system prompt prefilled once (37 tokens: two whole
/// pages and a partial one), forked, then each sequence's own suffix as a next
/// chunk in one prefill (its keys gathered from pages both hold), then a decode
/// step; all against the reference continuing one copy of the prefix's cache each.
fn forked_prefix_then_suffixes(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig::small();
    let d = c.d_model;
    let w = LayerWeights::random(&c, 130).map_err(e)?;
    let mut layer = Layer::new(gpu, &c, &w, 2048, 16, 512).map_err(e)?;
    let a = layer.add_sequence();
    let (xp, xp64) = tokens(131, 37, d);
    let mut ca = RefCache::default();
    let got = run_prefill(gpu, &mut layer, &[a], &[37], &xp)?;
    expect_close("the prefix", rel_l2_error(&got, &layer_forward(&c, &w, &xp64, &mut ca)), 1e-2)?;
    let b = layer.fork(gpu, a).map_err(e)?;
    let mut cb = ca.clone();
    let (xs, xs64) = tokens(132, 20 + 9, d);
    let got = run_prefill(gpu, &mut layer, &[a, b], &[20, 9], &xs)?;
    let want =
        [layer_forward(&c, &w, &xs64[..20 * d], &mut ca), layer_forward(&c, &w, &xs64[20 * d..], &mut cb)].concat();
    expect_close("two suffixes after a shared prefix", rel_l2_error(&got, &want), 1e-2)?;
    let (xn, xn64) = tokens(133, 2, d);
    let got = run_decode(gpu, &mut layer, &[b, a], &xn)?;
    let want = [layer_forward(&c, &w, &xn64[..d], &mut cb), layer_forward(&c, &w, &xn64[d..], &mut ca)].concat();
    expect_close("a decode step after the suffixes", rel_l2_error(&got, &want), 1e-2)
}

/// Speculative decoding's verification: a decode step of 3 tokens of each of
/// two sequences (each token seeing its cache and the step's tokens before it)
/// against the reference; 2 of one sequence's rejected by a truncate, then a
/// one-token step; and 9 tokens a sequence (past the kernel's 8) refused,
/// launching nothing.
fn decode_several_tokens(gpu: &Gpu) -> Result<(), String> {
    let c = LayerConfig::small();
    let d = c.d_model;
    let w = LayerWeights::random(&c, 140).map_err(e)?;
    let mut layer = Layer::new(gpu, &c, &w, 2048, 16, 512).map_err(e)?;
    let seqs = [layer.add_sequence(), layer.add_sequence()];
    let (xp, xp64) = tokens(141, 20 + 37, d);
    let (mut c0, mut c1) = (RefCache::default(), RefCache::default());
    run_prefill(gpu, &mut layer, &seqs, &[20, 37], &xp)?;
    layer_forward(&c, &w, &xp64[..20 * d], &mut c0);
    layer_forward(&c, &w, &xp64[20 * d..], &mut c1);
    let (xs, xs64) = tokens(142, 6, d);
    let xt = Tensor::from_host(gpu, &xs, &[6, d]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[6, d], bf16::NAN).map_err(e)?;
    layer.decode_tokens(gpu, &seqs, 3, &xt, &mut out).map_err(e)?;
    let got = to_f64(&out.to_host(gpu).map_err(e)?);
    // The reference before sequence 1's rejection: a copy to cut back.
    let want = [layer_forward(&c, &w, &xs64[..3 * d], &mut c0), layer_forward(&c, &w, &xs64[3 * d..], &mut c1.clone())];
    expect_close("3 tokens a sequence in one decode step", rel_l2_error(&got, &want.concat()), 1e-2)?;
    // Sequence 1 keeps only the first of its 3.
    layer.truncate(gpu, seqs[1], 38).map_err(e)?;
    layer_forward(&c, &w, &xs64[3 * d..4 * d], &mut c1);
    let (xn, xn64) = tokens(143, 2, d);
    let got = run_decode(gpu, &mut layer, &seqs, &xn)?;
    let want = [layer_forward(&c, &w, &xn64[..d], &mut c0), layer_forward(&c, &w, &xn64[d..], &mut c1)].concat();
    expect_close("a step after a rejection", rel_l2_error(&got, &want), 1e-2)?;
    let x9 = Tensor::from_host(gpu, &vec![bf16::ONE; 18 * d], &[18, d]).map_err(e)?;
    let mut o9 = Tensor::<bf16>::filled(gpu, &[18, d], bf16::NAN).map_err(e)?;
    let (launches, len) = (gpu.launch_count(), layer.cache().alloc().len(seqs[0]).map_err(e)?);
    let refused = layer.decode_tokens(gpu, &seqs, 9, &x9, &mut o9);
    if !matches!(refused, Err(Error::InvalidArgument(_)))
        || gpu.launch_count() != launches
        || layer.cache().alloc().len(seqs[0]).map_err(e)? != len
    {
        return Err(format!("9 tokens a sequence gave {refused:?}, or changed something"));
    }
    Ok(())
}

fn main() {
    let mut t = GpuTests::new("layer");
    t.run("layer_prefill_and_continuous_batching", continuous_batching);
    t.run("layer_decode_matches_longer_prefill", decode_matches_longer_prefill);
    t.run("layer_prefill_on_tma_store_gemms", prefill_on_tma_store_gemms);
    t.run("layer_cuda_graph_decode_matches_plain", graph_matches_plain_decode);
    t.run("layer_reference_config_rows", reference_config_rows);
    t.run("layer_bad_input_fails_cleanly", bad_input);
    t.run("layer_decode_graph_refusals", graph_refusals);
    t.run("layer_mixed_step_matches_prefill_and_decode", mixed_step_matches_prefill_and_decode);
    t.run("layer_chunked_prefill_against_reference", chunked_prefill);
    t.run("layer_forked_prefix_then_suffixes", forked_prefix_then_suffixes);
    t.run("layer_decode_several_tokens_a_sequence", decode_several_tokens);
    t.finish();
}
