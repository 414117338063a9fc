//! GPU tests of FlashAttention forward against the f64 CPU reference.

use host::ops::attention::{flash_attention_on_walk, Walk, MAX_HEADS, MAX_SEQUENCES};
use host::ops::{flash_attention, flash_attention_with, AttentionOptions, FlashVersion, VarlenBatch};
use host::reference::attention;
use host::{bf16, Arch, Error, Gpu, Tensor};
use lab::testing::ShapeRng as Rng;
use lab::testing::{cast, expect_close, quick, random_with_outliers, rel_l2_error, to_f64, tolerance, GpuTests};

#[derive(Clone, Debug)]
struct Case {
    q_lens: Vec<usize>,
    k_lens: Vec<usize>,
    heads: usize,
    kv_heads: usize,
    d: usize,
    causal: bool,
    /// `None`: the default 1/√d.
    scale: Option<f32>,
}

impl Case {
    fn self_attention(lens: &[usize], heads: usize, kv_heads: usize, d: usize, causal: bool) -> Case {
        Case { q_lens: lens.to_vec(), k_lens: lens.to_vec(), heads, kv_heads, d, causal, scale: None }
    }

    fn describe(&self) -> String {
        format!(
            "q{:?} k{:?} h{}/{} d{} causal{} scale {:?}",
            self.q_lens, self.k_lens, self.heads, self.kv_heads, self.d, self.causal as u8, self.scale
        )
    }

    fn opts(&self) -> AttentionOptions {
        AttentionOptions { causal: self.causal, scale: self.scale }
    }
}

/// A case's inputs (seeded, with outliers) and its f64 reference.
struct Inputs {
    q: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
    o_ref: Vec<f64>,
    lse_ref: Vec<f64>,
}

impl Inputs {
    fn new(c: &Case, seed: u64) -> Inputs {
        let (tq, tk) = (c.q_lens.iter().sum::<usize>(), c.k_lens.iter().sum::<usize>());
        let q: Vec<bf16> = cast(&random_with_outliers(seed, tq * c.heads * c.d, 1.0));
        let k: Vec<bf16> = cast(&random_with_outliers(seed + 1, tk * c.kv_heads * c.d, 1.0));
        let v: Vec<bf16> = cast(&random_with_outliers(seed + 2, tk * c.kv_heads * c.d, 1.0));
        let (o_ref, lse_ref) = reference(c, &to_f64(&q), &to_f64(&k), &to_f64(&v));
        Inputs { q, k, v, o_ref, lse_ref }
    }
}

/// A reference piece: its index, O and LSE.
type Piece = (usize, Vec<f64>, Vec<f64>);

/// `host::reference::attention` (threads per head) over pieces of at most 256
/// queries of each sequence on every core, so long sequences cost seconds.
fn reference(c: &Case, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    const PIECE: usize = 256;
    let (h, hkv, d) = (c.heads, c.kv_heads, c.d);
    let total_q: usize = c.q_lens.iter().sum();
    // (first query token, queries, first key token, keys) of each piece. Under a
    // causal mask, query i of a sequence sees keys j ≤ i + len_k − len_q; a piece
    // that ends at query i1 keeps the keys up to i1 + len_k − len_q, which puts
    // its own diagonal in the same place.
    let mut pieces = Vec::new();
    let (mut q0, mut k0) = (0, 0);
    for (&lq, &lk) in c.q_lens.iter().zip(&c.k_lens) {
        for i0 in (0..lq).step_by(PIECE) {
            let i1 = (i0 + PIECE).min(lq);
            let keys = if c.causal { (lk + i1).saturating_sub(lq).min(lk) } else { lk };
            pieces.push((q0 + i0, i1 - i0, k0, keys));
        }
        q0 += lq;
        k0 += lk;
    }
    let workers = std::thread::available_parallelism().map_or(4, |n| n.get()).div_ceil(h).max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done: Vec<Vec<Piece>> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(qt, nq, kt, nk)) = pieces.get(i) else { break };
                        let (o, lse) = attention(
                            &q[qt * h * d..(qt + nq) * h * d],
                            &k[kt * hkv * d..(kt + nk) * hkv * d],
                            &v[kt * hkv * d..(kt + nk) * hkv * d],
                            &[nq],
                            &[nk],
                            h,
                            hkv,
                            d,
                            c.causal,
                            c.scale.map_or(1.0 / (d as f64).sqrt(), |s| s as f64),
                        );
                        out.push((i, o, lse));
                    }
                    out
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let mut o = vec![0.0; total_q * h * d];
    let mut lse = vec![0.0; h * total_q];
    for (i, po, plse) in done.into_iter().flatten() {
        let (qt, nq, _, _) = pieces[i];
        o[qt * h * d..(qt + nq) * h * d].copy_from_slice(&po);
        for head in 0..h {
            lse[head * total_q + qt..][..nq].copy_from_slice(&plse[head * nq..][..nq]);
        }
    }
    (o, lse)
}

/// Relative L2 error of the LSE; a row that sees no key must be exactly -inf.
fn lse_error(out: &[f32], reference: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (&o, &r) in out.iter().zip(reference) {
        if r == f64::NEG_INFINITY {
            if o != f32::NEG_INFINITY {
                return f64::INFINITY;
            }
            continue;
        }
        if !o.is_finite() {
            return f64::INFINITY;
        }
        num += (o as f64 - r).powi(2);
        den += r * r;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Runs `version` on poisoned outputs and compares O (bf16 tolerance) and the LSE
/// (f32 tolerance: it is computed in f32 from the unrounded probabilities).
fn check_inputs(gpu: &Gpu, c: &Case, x: &Inputs, version: Option<FlashVersion>) -> Result<(), String> {
    check_on(gpu, c, x, version, None)
}

/// [`check_inputs`] with the version on `walk` where one is named
/// (`flash_attention_on_walk`), else on the walk its plan picks.
fn check_on(gpu: &Gpu, c: &Case, x: &Inputs, version: Option<FlashVersion>, walk: Option<Walk>) -> Result<(), String> {
    let e = |e: Error| e.to_string();
    let (tq, tk) = (c.q_lens.iter().sum::<usize>(), c.k_lens.iter().sum::<usize>());
    let batch = VarlenBatch::new(gpu, &c.q_lens, &c.k_lens).map_err(e)?;
    let qt = Tensor::from_host(gpu, &x.q, &[tq, c.heads, c.d]).map_err(e)?;
    let kt = Tensor::from_host(gpu, &x.k, &[tk, c.kv_heads, c.d]).map_err(e)?;
    let vt = Tensor::from_host(gpu, &x.v, &[tk, c.kv_heads, c.d]).map_err(e)?;
    let mut ot = Tensor::<bf16>::filled(gpu, &[tq, c.heads, c.d], bf16::NAN).map_err(e)?;
    let mut lt = Tensor::<f32>::filled(gpu, &[c.heads, tq], f32::NAN).map_err(e)?;
    match (version, walk) {
        (None, _) => flash_attention(gpu, &qt, &kt, &vt, &batch, c.opts(), &mut ot, &mut lt),
        (Some(v), None) => flash_attention_with(gpu, &qt, &kt, &vt, &batch, c.opts(), &mut ot, &mut lt, v),
        (Some(v), Some(w)) => flash_attention_on_walk(gpu, &qt, &kt, &vt, &batch, c.opts(), &mut ot, &mut lt, v, w),
    }
    .map_err(e)?;
    let on = walk.map_or(String::new(), |w| format!(" on {w:?}"));
    let what = format!("{}{on} {}", version.map_or("shipped".into(), |v| format!("{v:?}")), c.describe());
    let o = to_f64(&ot.to_host(gpu).map_err(e)?);
    expect_close(&format!("{what} O"), rel_l2_error(&o, &x.o_ref), tolerance::<bf16>())?;
    let lse = lt.to_host(gpu).map_err(e)?;
    expect_close(&format!("{what} LSE"), lse_error(&lse, &x.lse_ref), tolerance::<f32>())
}

fn check(gpu: &Gpu, c: &Case, version: FlashVersion, seed: u64) -> Result<(), String> {
    check_inputs(gpu, c, &Inputs::new(c, seed), Some(version))
}

/// Fixed cases: GQA groups, varlen with 1 and tile edges, a cached prefix, and
/// more queries than keys.
fn cases(d: usize) -> Vec<Case> {
    let mut out = Vec::new();
    let lens: Vec<Vec<usize>> =
        if quick() { vec![vec![1, 17, 100], vec![65]] } else { vec![vec![1, 17, 100, 1000], vec![4097]] };
    for causal in [false, true] {
        for (heads, kv_heads) in [(4, 4), (8, 2), (8, 1)] {
            for l in &lens {
                out.push(Case::self_attention(l, heads, kv_heads, d, causal));
            }
        }
        // Fewer queries than keys (cached prefix): causal aligns bottom-right.
        let prefix =
            Case { q_lens: vec![1, 17, 64], k_lens: vec![9, 40, 200], ..Case::self_attention(&[], 4, 2, d, causal) };
        out.push(prefix);
        // More queries than keys: the first rows see nothing under causal.
        out.push(Case { q_lens: vec![70], k_lens: vec![5], ..Case::self_attention(&[], 2, 1, d, causal) });
    }
    out
}

fn run_cases(d: usize, version: FlashVersion) -> impl FnOnce(&Gpu) -> Result<(), String> {
    move |gpu| {
        for (i, c) in cases(d).iter().enumerate() {
            check(gpu, c, version, 1000 + i as u64)?;
        }
        Ok(())
    }
}

/// A version's tests at each head dim of `dims`, named `flash_hopper_{name}_…_hd{d}`:
/// the fixed and random cases, every walk, and walks past the SM count with the
/// causal mask and without.
fn on_walks_suite(t: &mut GpuTests, name: &str, version: FlashVersion, dims: &[usize]) {
    for &d in dims {
        t.run(&format!("flash_hopper_{name}_hd{d}"), hopper(d, version));
        t.run(&format!("flash_hopper_{name}_on_every_walk_hd{d}"), on_every_walk(d, version));
        t.run(&format!("flash_hopper_{name}_walks_many_tiles_hd{d}"), walks_many_tiles(d, version, true));
        t.run(&format!("flash_hopper_{name}_walks_many_tiles_noncausal_hd{d}"), walks_many_tiles(d, version, false));
    }
}

const PRIMES: [usize; 12] = [2, 3, 5, 7, 13, 31, 61, 127, 257, 509, 1021, 2053];
/// Query and key tiles of the shipped kernels (16 and 32 keys on sm_80, 128 rows
/// and keys on sm_90a, 192 rows at head dim 64 on long sequences) and of the dev
/// versions (64); 256 is two Hopper tiles.
const TILES: [usize; 5] = [16, 32, 64, 128, 256];

/// A sequence length: 1, a prime, a tile size or one off it, or up to 400.
fn length(rng: &mut Rng) -> usize {
    match rng.below(8) {
        0 => 1,
        1 => rng.pick(&PRIMES[..10]),
        2 | 3 => rng.pick(&TILES) + rng.pick(&[0, 1, 1, 2]) - 1,
        _ => 1 + rng.below(400),
    }
}

/// Random shape `i`: 1 to 8 sequences, some with cached keys, fewer keys than
/// queries, or none at all; GQA groups 1/2/4/8; an explicit scale at times.
fn random_case(rng: &mut Rng) -> Case {
    let sequences = if rng.below(4) == 0 { 1 } else { 1 + rng.below(8) };
    let (mut q_lens, mut k_lens) = (Vec::new(), Vec::new());
    for _ in 0..sequences {
        let lq = if rng.below(40) == 0 { 0 } else { length(rng) };
        let lk = match rng.below(10) {
            0 => lq + length(rng),
            1 => lq / 2,
            2 if sequences > 1 => 0,
            _ => lq,
        };
        q_lens.push(lq);
        k_lens.push(lk);
    }
    if q_lens.iter().all(|&l| l == 0) {
        q_lens[0] = 1;
    }
    if k_lens.iter().all(|&l| l == 0) {
        k_lens[0] = 1;
    }
    let kv_heads = rng.pick(&[1, 1, 2, 3]);
    let group = rng.pick(&[1, 2, 4, 8]);
    let scale = if rng.below(8) == 0 { Some(0.02 + rng.below(200) as f32 / 1000.0) } else { None };
    Case {
        q_lens,
        k_lens,
        heads: kv_heads * group,
        kv_heads,
        d: rng.pick(&[64, 128]),
        causal: rng.below(2) == 0,
        scale,
    }
}

/// Long sequences (2k–8k), with few heads so the CPU reference stays in seconds.
fn long_cases() -> Vec<Case> {
    let mut out = vec![
        Case::self_attention(&[2049], 8, 1, 128, false),
        Case::self_attention(&[8192], 4, 2, 128, true),
        Case::self_attention(&[3, 4099], 8, 1, 64, true),
        Case { k_lens: vec![5003 + 700], ..Case::self_attention(&[5003], 2, 1, 64, true) },
        Case::self_attention(&[2053, 3001, 1], 2, 2, 128, false),
        Case::self_attention(&[6007], 4, 1, 64, false),
    ];
    if quick() {
        out.truncate(1);
    }
    out
}

/// At least 200 seeded random shapes (about 20 under `quick()`) and the long
/// ones, each against the f64 reference: the shipped kernel for this GPU through
/// `flash_attention`, and on sm_90a also the sm_80 module's shipped kernels
/// (through their versions) and the other Hopper versions, on the same inputs.
fn random_shapes(gpu: &Gpu) -> Result<(), String> {
    let mut rng = Rng(0x5eed_a77e);
    let count = if quick() { 20 } else { 200 };
    let mut all: Vec<Case> = (0..count).map(|_| random_case(&mut rng)).collect();
    all.extend(long_cases());
    let mut failures = Vec::new();
    for (i, c) in all.iter().enumerate() {
        let inputs = Inputs::new(c, 7000 + 3 * i as u64);
        let mut versions = vec![None];
        if gpu.info().arch == Arch::Sm90a {
            versions.push(Some(if c.d == 64 { FlashVersion::V2Bn32 } else { FlashVersion::V2Bn16 }));
            versions.push(Some(FlashVersion::Hopper));
            versions.push(Some(FlashVersion::HopperWsLazy));
            versions.push(Some(FlashVersion::HopperWsSplit));
            versions.push(Some(FlashVersion::HopperOneTile));
            versions.push(Some(FlashVersion::HopperStrided));
            versions.push(Some(FlashVersion::HopperTurns));
            versions.push(Some(FlashVersion::HopperFmaEx2));
            versions.push(Some(FlashVersion::HopperTmaStores));
            versions.push(Some(FlashVersion::HopperLatePv));
            versions.push(Some(FlashVersion::HopperIssueTurns));
            versions.push(Some(FlashVersion::HopperLatePvTurns));
            if c.d != 256 {
                versions.push(Some(FlashVersion::HopperStages3));
            }
            versions.push(Some(FlashVersion::HopperN176));
            if c.d == 64 {
                versions.push(Some(FlashVersion::HopperPersistentN176));
                versions.push(Some(FlashVersion::HopperM192));
            }
            versions.push(Some(FlashVersion::HopperPersistent));
            versions.push(Some(FlashVersion::HopperCounter));
            versions.push(Some(FlashVersion::HopperPersistentLazy));
        }
        for v in versions {
            if let Err(msg) = check_inputs(gpu, c, &inputs, v) {
                failures.push(format!("shape {i}: {msg}"));
            }
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        let shown = failures.iter().take(5).cloned().collect::<Vec<_>>().join("\n  ");
        Err(format!("{} of {} shapes failed:\n  {shown}", failures.len(), all.len()))
    }
}

/// The Hopper kernels by version (sm_90a only): the same cases; elsewhere the
/// version must refuse cleanly.
fn hopper(d: usize, version: FlashVersion) -> impl FnOnce(&Gpu) -> Result<(), String> {
    move |gpu| {
        if gpu.info().arch != Arch::Sm90a {
            let e = |e: Error| e.to_string();
            let batch = VarlenBatch::new(gpu, &[4], &[4]).map_err(e)?;
            let q = Tensor::<bf16>::filled(gpu, &[4, 2, d], bf16::ONE).map_err(e)?;
            let mut o = Tensor::<bf16>::filled(gpu, &[4, 2, d], bf16::NAN).map_err(e)?;
            let mut lse = Tensor::<f32>::filled(gpu, &[2, 4], f32::NAN).map_err(e)?;
            let opts = AttentionOptions::default();
            return match flash_attention_with(gpu, &q, &q, &q, &batch, opts, &mut o, &mut lse, version) {
                Err(Error::InvalidArgument(_)) => Ok(()),
                other => Err(format!("{version:?} off sm_90a gave {other:?}")),
            };
        }
        run_cases(d, version)(gpu)
    }
}

/// The O writers of the shipped kernel (16-byte stores) and `HopperTmaStores`
/// (staged, a TMA box a warpgroup, 16-byte stores at the end of a sequence)
/// compute each output alike: the same bits of O and LSE, on
/// varlen batches whose sequences end inside and on warpgroup boundaries, on
/// every walk (the strided one at head dim 64 and one tile a block at 128 are
/// walks the shipped choice takes for none of these shapes).
fn writers_agree_bit_for_bit(d: usize) -> impl FnOnce(&Gpu) -> Result<(), String> {
    move |gpu| {
        if gpu.info().arch != Arch::Sm90a {
            return Ok(());
        }
        let e = |e: Error| e.to_string();
        for causal in [false, true] {
            let c = Case::self_attention(&[1, 17, 64, 300, 1029], 8, 2, d, causal);
            // The writers against each other: no f64 reference needed.
            let (tq, tk) = (c.q_lens.iter().sum::<usize>(), c.k_lens.iter().sum::<usize>());
            let random = |seed, n| -> Vec<bf16> { cast(&random_with_outliers(seed, n, 1.0)) };
            let batch = VarlenBatch::new(gpu, &c.q_lens, &c.k_lens).map_err(e)?;
            let qt = Tensor::from_host(gpu, &random(777, tq * c.heads * c.d), &[tq, c.heads, c.d]).map_err(e)?;
            let kt = Tensor::from_host(gpu, &random(778, tk * c.kv_heads * c.d), &[tk, c.kv_heads, c.d]).map_err(e)?;
            let vt = Tensor::from_host(gpu, &random(779, tk * c.kv_heads * c.d), &[tk, c.kv_heads, c.d]).map_err(e)?;
            let run = |version: FlashVersion, walk: Walk| -> Result<(Vec<u16>, Vec<u32>), String> {
                let mut ot = Tensor::<bf16>::filled(gpu, &[tq, c.heads, c.d], bf16::NAN).map_err(e)?;
                let mut lt = Tensor::<f32>::filled(gpu, &[c.heads, tq], f32::NAN).map_err(e)?;
                let (o, l) = (&mut ot, &mut lt);
                flash_attention_on_walk(gpu, &qt, &kt, &vt, &batch, c.opts(), o, l, version, walk).map_err(e)?;
                let o = ot.to_host(gpu).map_err(e)?.iter().map(|v| v.to_bits()).collect();
                Ok((o, lt.to_host(gpu).map_err(e)?.iter().map(|v| v.to_bits()).collect()))
            };
            // Every walk, those the shipped choice never takes here included.
            for walk in [Walk::OneTile, Walk::Strided, Walk::Counter] {
                let shipped = run(FlashVersion::Auto, walk)?;
                if run(FlashVersion::HopperTmaStores, walk)? != shipped {
                    return Err(format!("HopperTmaStores on {walk:?} {}: not the shipped kernel's bits", c.describe()));
                }
            }
        }
        Ok(())
    }
}

/// A walking kernel over more tiles than the GPU has SMs (most of them taken
/// from its counter where it has one), three launches in a row: each one must
/// do every tile, so the counter is back at 0 after each.
fn walks_many_tiles(d: usize, version: FlashVersion, causal: bool) -> impl FnOnce(&Gpu) -> Result<(), String> {
    move |gpu| {
        if gpu.info().arch != Arch::Sm90a {
            return hopper(d, version)(gpu);
        }
        let c = Case { q_lens: vec![400, 3, 700, 129], ..Case::self_attention(&[], 16, 4, d, causal) };
        let c = Case { k_lens: c.q_lens.clone(), ..c };
        for launch in 0..3 {
            check(gpu, &c, version, 500 + launch).map_err(|e| format!("launch {launch}: {e}"))?;
        }
        Ok(())
    }
}

/// The shipped kernel where its consumers take turns (head dim 128, causal, from
/// 4096 queries): a varlen GQA batch one past a tile and a single token, on the
/// counter walk, and a sequence past its reach, on one tile per block.
fn shipped_turns_causal_long(gpu: &Gpu) -> Result<(), String> {
    let counter = Case::self_attention(&[4097, 1], 2, 1, 128, true);
    check(gpu, &counter, FlashVersion::Auto, 901)?;
    if quick() {
        return Ok(());
    }
    check(gpu, &Case::self_attention(&[8193], 2, 1, 128, true), FlashVersion::Auto, 902)
}

/// The shipped kernel's three consumers over 192 rows (head dim 64, from 2048
/// queries without a mask, 8192 with one). On the counter walk: a varlen GQA
/// batch of 2049 queries (ten 192-row tiles and 129 rows), a single token and a
/// short sequence, more tiles than SMs, then again with more keys than
/// queries (a cached prefix; the second launch also finds the tile counter
/// reset), and causal at the walk's last length, 8192. On one tile per block:
/// a sequence past the walk's reach, and in the full run causal.
fn shipped_three_consumers_long(gpu: &Gpu) -> Result<(), String> {
    check(gpu, &Case::self_attention(&[2049, 1, 130], 16, 4, 64, false), FlashVersion::Auto, 905)?;
    let prefix =
        Case { q_lens: vec![2049, 1, 130], k_lens: vec![2100, 5, 131], ..Case::self_attention(&[], 16, 4, 64, false) };
    check(gpu, &prefix, FlashVersion::Auto, 909)?;
    let heads = if quick() { 1 } else { 2 };
    check(gpu, &Case::self_attention(&[8192, 1], heads, 1, 64, true), FlashVersion::Auto, 907)?;
    check(gpu, &Case::self_attention(&[4097, 17], 2, 1, 64, false), FlashVersion::Auto, 906)?;
    if quick() {
        return Ok(());
    }
    check(gpu, &Case::self_attention(&[8193], 2, 1, 64, true), FlashVersion::Auto, 908)
}

/// The shipped kernel where its consumers take turns at issuing, P·V one tile
/// late (head dim 128, no mask, from 2048 queries, the strided walk): a varlen
/// GQA batch one past a tile with a single token and a short sequence, and in
/// the full run longer ones.
fn shipped_late_pv_turns_long(gpu: &Gpu) -> Result<(), String> {
    let strided = Case::self_attention(&[2049, 1, 130], 4, 2, 128, false);
    check(gpu, &strided, FlashVersion::Auto, 903)?;
    if quick() {
        return Ok(());
    }
    check(gpu, &Case::self_attention(&[4097, 2048, 17], 2, 1, 128, false), FlashVersion::Auto, 904)
}

/// The shipped kernel where its consumers take turns at issuing, P·V in order
/// (head dim 256): without a mask on the strided walk, a varlen GQA batch one
/// past a tile with a single token and a short sequence; with one past 2048
/// queries on one tile per block, one past a tile and a single token; in the
/// full run longer ones.
fn shipped_issue_turns_long(gpu: &Gpu) -> Result<(), String> {
    check(gpu, &Case::self_attention(&[2049, 1, 130], 4, 2, 256, false), FlashVersion::Auto, 910)?;
    check(gpu, &Case::self_attention(&[2049, 1], 2, 1, 256, true), FlashVersion::Auto, 911)?;
    if quick() {
        return Ok(());
    }
    check(gpu, &Case::self_attention(&[4097, 2048, 17], 2, 1, 256, false), FlashVersion::Auto, 912)?;
    check(gpu, &Case::self_attention(&[4097, 300], 2, 1, 256, true), FlashVersion::Auto, 913)
}

/// A version that follows the shipped kernel's walks on each of them, those
/// the shipped choice never takes for these shapes included: varlen GQA
/// batches with sequences of one tile, one past a tile and many tiles, causal
/// and not, and a cached prefix.
fn on_every_walk(d: usize, version: FlashVersion) -> impl FnOnce(&Gpu) -> Result<(), String> {
    move |gpu| {
        if gpu.info().arch != Arch::Sm90a {
            return hopper(d, version)(gpu);
        }
        let lens: &[usize] = if quick() { &[1, 129, 700] } else { &[1, 17, 129, 400, 1029, 3000] };
        // At head dim 256 these versions have no counter walk, but the turns at issuing.
        let walks: &[Walk] = if d == 256 && version != FlashVersion::HopperIssueTurns {
            &[Walk::OneTile, Walk::Strided]
        } else {
            &[Walk::OneTile, Walk::Strided, Walk::Counter]
        };
        for causal in [false, true] {
            let prefix = Case {
                q_lens: vec![1, 17, 64],
                k_lens: vec![9, 300, 200],
                ..Case::self_attention(&[], 4, 2, d, causal)
            };
            for (i, c) in [Case::self_attention(lens, 8, 2, d, causal), prefix].iter().enumerate() {
                let x = Inputs::new(c, 1300 + i as u64);
                for &walk in walks {
                    check_on(gpu, c, &x, Some(version), Some(walk))?;
                }
            }
        }
        Ok(())
    }
}

/// Every refused argument returns its typed error, and nothing is launched.
fn bad_input(gpu: &Gpu) -> Result<(), String> {
    let e = |e: Error| e.to_string();
    let bf = |shape: &[usize]| Tensor::<bf16>::filled(gpu, shape, bf16::ONE).map_err(e);
    let f32s = |shape: &[usize]| Tensor::<f32>::filled(gpu, shape, f32::NAN).map_err(e);
    let launches = gpu.launch_count();
    let kind = |r: &Result<(), Error>| match r {
        Err(Error::Shape(_)) => "Shape",
        Err(Error::Empty(_)) => "Empty",
        Err(Error::TooLarge(_)) => "TooLarge",
        Err(Error::InvalidArgument(_)) => "InvalidArgument",
        Err(_) => "another error",
        Ok(()) => "Ok",
    };
    let mut wrong = Vec::new();
    let mut expect = |what: &str, want: &str, r: Result<(), Error>| {
        if kind(&r) != want {
            wrong.push(format!("{what}: {r:?}, expected {want}"));
        }
    };

    // The batch: lengths, offsets.
    expect("3 query vs 2 key lengths", "Shape", VarlenBatch::new(gpu, &[1, 2, 3], &[1, 2]).map(drop));
    expect("no sequence", "Empty", VarlenBatch::new(gpu, &[], &[]).map(drop));
    let many = vec![1; MAX_SEQUENCES + 1];
    expect("too many sequences", "TooLarge", VarlenBatch::new(gpu, &many, &many).map(drop));
    expect("offsets not from 0", "InvalidArgument", VarlenBatch::from_offsets(gpu, &[1, 4], &[0, 4]).map(drop));
    expect("decreasing offsets", "InvalidArgument", VarlenBatch::from_offsets(gpu, &[0, 4, 2], &[0, 2, 4]).map(drop));
    expect("offset counts differ", "Shape", VarlenBatch::from_offsets(gpu, &[0, 4], &[0, 2, 4]).map(drop));
    expect("huge batch", "TooLarge", VarlenBatch::new(gpu, &[1 << 31], &[1]).map(drop));

    // The call: a batch of 2 sequences of 3 + 1 tokens, 4 heads over 2 KV heads.
    let batch = VarlenBatch::from_offsets(gpu, &[0, 3, 4], &[0, 3, 4]).map_err(e)?;
    let (q, k) = (bf(&[4, 4, 64])?, bf(&[4, 2, 64])?);
    let (mut o, mut lse) = (bf(&[4, 4, 64])?, f32s(&[4, 4])?);
    let opts = AttentionOptions::default();
    let fa = |q: &Tensor<bf16>, k: &Tensor<bf16>, v: &Tensor<bf16>, o: &mut Tensor<bf16>, lse: &mut Tensor<f32>| {
        flash_attention(gpu, q, k, v, &batch, opts, o, lse)
    };
    expect("the valid call", "Ok", fa(&q, &k, &k, &mut o, &mut lse));
    let launches_ok = gpu.launch_count();
    for scale in [f32::NAN, f32::INFINITY, 0.0, -0.5] {
        let bad = AttentionOptions { scale: Some(scale), ..opts };
        let r = flash_attention(gpu, &q, &k, &k, &batch, bad, &mut o, &mut lse);
        expect(&format!("scale {scale}"), "InvalidArgument", r);
    }
    expect("q of rank 2", "Shape", fa(&bf(&[4, 256])?, &k, &k, &mut o, &mut lse));
    expect("k of rank 4", "Shape", fa(&q, &bf(&[4, 2, 64, 1])?, &k, &mut o, &mut lse));
    expect("v unlike k", "Shape", fa(&q, &k, &bf(&[4, 1, 64])?, &mut o, &mut lse));
    expect("o unlike q", "Shape", fa(&q, &k, &k, &mut bf(&[4, 4, 128])?, &mut lse));
    expect("lse of the wrong shape", "Shape", fa(&q, &k, &k, &mut o, &mut f32s(&[4, 5])?));
    let (q5, mut o5, mut lse5) = (bf(&[5, 4, 64])?, bf(&[5, 4, 64])?, f32s(&[4, 5])?);
    expect("q tokens beyond the batch", "Shape", fa(&q5, &k, &k, &mut o5, &mut lse5));
    let k5 = bf(&[5, 2, 64])?;
    expect("k tokens beyond the batch", "Shape", fa(&q, &k5, &k5, &mut o, &mut lse));
    let k128 = bf(&[4, 2, 128])?;
    expect("head dims differ", "Shape", fa(&q, &k128, &k128, &mut o, &mut lse));
    let (q96, k96) = (bf(&[4, 4, 96])?, bf(&[4, 2, 96])?);
    expect("head dim 96", "Shape", fa(&q96, &k96, &k96, &mut bf(&[4, 4, 96])?, &mut lse));
    let k3 = bf(&[4, 3, 64])?;
    expect("4 heads over 3 KV heads", "Shape", fa(&q, &k3, &k3, &mut o, &mut lse));
    let k0 = bf(&[4, 0, 64])?;
    expect("no KV heads", "Empty", fa(&q, &k0, &k0, &mut o, &mut lse));
    let h = MAX_HEADS + 1;
    let (qh, kh) = (bf(&[4, h, 64])?, bf(&[4, 1, 64])?);
    expect("too many heads", "TooLarge", fa(&qh, &kh, &kh, &mut bf(&[4, h, 64])?, &mut f32s(&[h, 4])?));
    // No key in the whole batch.
    let no_keys = VarlenBatch::new(gpu, &[4], &[0]).map_err(e)?;
    let k_none = bf(&[0, 2, 64])?;
    expect("no keys", "Empty", flash_attention(gpu, &q, &k_none, &k_none, &no_keys, opts, &mut o, &mut lse));

    // Dev versions without a kernel for the call.
    let v2bn16 = flash_attention_with(gpu, &q, &k, &k, &batch, opts, &mut o, &mut lse, FlashVersion::V2Bn16);
    expect("V2Bn16 at head dim 64", "InvalidArgument", v2bn16);
    if gpu.info().arch != Arch::Sm90a {
        let hopper = flash_attention_with(gpu, &q, &k, &k, &batch, opts, &mut o, &mut lse, FlashVersion::Hopper);
        expect("Hopper off sm_90a", "InvalidArgument", hopper);
    }

    if launches_ok != launches + 1 {
        wrong.push(format!("the valid call made {} launches", launches_ok - launches));
    }
    if gpu.launch_count() != launches_ok {
        wrong.push(format!("refused calls launched {} kernels", gpu.launch_count() - launches_ok));
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(wrong.join("; "))
    }
}

fn main() {
    let mut t = GpuTests::new("attention");
    t.run("flash_bad_input_fails_before_launch", bad_input);
    t.run("flash_random_shapes_vs_reference", random_shapes);
    t.run("flash_hd64_causal_noncausal_gqa_varlen", run_cases(64, FlashVersion::Auto));
    t.run("flash_hd128_causal_noncausal_gqa_varlen", run_cases(128, FlashVersion::Auto));
    t.run("flash_v1_hd64", run_cases(64, FlashVersion::V1));
    t.run("flash_v1_hd128", run_cases(128, FlashVersion::V1));
    t.run("flash_v2_bn64_hd64", run_cases(64, FlashVersion::V2));
    t.run("flash_v2_bn64_hd128", run_cases(128, FlashVersion::V2));
    t.run("flash_v2_bn32_hd64", run_cases(64, FlashVersion::V2Bn32));
    t.run("flash_v2_bn32_hd128", run_cases(128, FlashVersion::V2Bn32));
    t.run("flash_v2_bn16_hd128", run_cases(128, FlashVersion::V2Bn16));
    // The Hopper versions by name (HopperWs is the shipped kernel on sm_90a); elsewhere they must refuse.
    t.run("flash_hopper_hd64", hopper(64, FlashVersion::Hopper));
    t.run("flash_hopper_hd128", hopper(128, FlashVersion::Hopper));
    t.run("flash_hopper_ws_hd64", hopper(64, FlashVersion::HopperWs));
    t.run("flash_hopper_ws_hd128", hopper(128, FlashVersion::HopperWs));
    t.run("flash_hopper_ws_hd256", hopper(256, FlashVersion::Auto));
    for d in [64, 128, 256] {
        t.run(&format!("flash_hopper_lazy_hd{d}"), hopper(d, FlashVersion::HopperWsLazy));
        t.run(&format!("flash_hopper_split_hd{d}"), hopper(d, FlashVersion::HopperWsSplit));
        t.run(&format!("flash_hopper_persistent_hd{d}"), hopper(d, FlashVersion::HopperPersistent));
        t.run(&format!("flash_hopper_counter_hd{d}"), hopper(d, FlashVersion::HopperCounter));
        t.run(&format!("flash_hopper_persistent_lazy_hd{d}"), hopper(d, FlashVersion::HopperPersistentLazy));
    }
    for d in [64, 128, 256] {
        t.run(&format!("flash_hopper_onetile_hd{d}"), hopper(d, FlashVersion::HopperOneTile));
        t.run(&format!("flash_hopper_strided_hd{d}"), hopper(d, FlashVersion::HopperStrided));
        t.run(&format!("flash_hopper_turns_hd{d}"), hopper(d, FlashVersion::HopperTurns));
        t.run(&format!("flash_hopper_fma_ex2_hd{d}"), hopper(d, FlashVersion::HopperFmaEx2));
    }
    for d in [64, 128] {
        t.run(&format!("flash_hopper_writers_agree_bit_for_bit_hd{d}"), writers_agree_bit_for_bit(d));
        t.run(&format!("flash_hopper_tma_stores_hd{d}"), hopper(d, FlashVersion::HopperTmaStores));
        t.run(
            &format!("flash_hopper_tma_stores_walks_many_tiles_hd{d}"),
            walks_many_tiles(d, FlashVersion::HopperTmaStores, true),
        );
        t.run(
            &format!("flash_hopper_tma_stores_walks_many_tiles_noncausal_hd{d}"),
            walks_many_tiles(d, FlashVersion::HopperTmaStores, false),
        );
    }
    on_walks_suite(&mut t, "late_pv", FlashVersion::HopperLatePv, &[64, 128, 256]);
    on_walks_suite(&mut t, "late_pv_turns", FlashVersion::HopperLatePvTurns, &[64, 128, 256]);
    on_walks_suite(&mut t, "issue_turns", FlashVersion::HopperIssueTurns, &[64, 128, 256]);
    // The shipped three consumers' one-tile entry, on the fixed cases' short sequences.
    t.run("flash_hopper_m192_hd64", hopper(64, FlashVersion::HopperM192));
    on_walks_suite(&mut t, "stages3", FlashVersion::HopperStages3, &[64, 128]);
    t.run("flash_hopper_n176_hd64", hopper(64, FlashVersion::HopperN176));
    t.run("flash_hopper_n176_hd128", hopper(128, FlashVersion::HopperN176));
    t.run("flash_hopper_persistent_n176_hd64", hopper(64, FlashVersion::HopperPersistentN176));
    t.run("flash_hopper_n80_hd256", hopper(256, FlashVersion::HopperN80));
    t.run("flash_hopper_n80_walks_many_tiles_hd256", walks_many_tiles(256, FlashVersion::HopperN80, false));
    t.run("flash_hopper_n64_hd256", hopper(256, FlashVersion::HopperN64));
    t.run("flash_hopper_n64_walks_many_tiles_hd256", walks_many_tiles(256, FlashVersion::HopperN64, false));
    t.run("flash_hopper_n128_counter_hd256", hopper(256, FlashVersion::HopperN128Counter));
    t.run(
        "flash_hopper_n128_counter_walks_many_tiles_hd256",
        walks_many_tiles(256, FlashVersion::HopperN128Counter, true),
    );
    for d in [64, 128, 256] {
        t.run(
            &format!("flash_hopper_strided_walks_many_tiles_hd{d}"),
            walks_many_tiles(d, FlashVersion::HopperStrided, true),
        );
        t.run(
            &format!("flash_hopper_persistent_walks_many_tiles_hd{d}"),
            walks_many_tiles(d, FlashVersion::HopperPersistent, true),
        );
        t.run(&format!("flash_hopper_shipped_walks_many_tiles_hd{d}"), walks_many_tiles(d, FlashVersion::Auto, true));
    }
    // Without a mask head dim 256 takes the strided walk on 128-key tiles.
    t.run("flash_hopper_shipped_walks_many_tiles_noncausal_hd256", walks_many_tiles(256, FlashVersion::Auto, false));
    t.run("flash_hopper_shipped_turns_causal_long_hd128", shipped_turns_causal_long);
    t.run("flash_hopper_shipped_late_pv_turns_long_hd128", shipped_late_pv_turns_long);
    t.run("flash_hopper_shipped_issue_turns_long_hd256", shipped_issue_turns_long);
    t.run("flash_hopper_shipped_three_consumers_long_hd64", shipped_three_consumers_long);
    // Without a causal mask at head dim 128, the one place these take the walk.
    t.run("flash_hopper_turns_walks_many_tiles_hd128", walks_many_tiles(128, FlashVersion::HopperTurns, false));
    // Turns on head dim 256's 128-key tiles, on the strided walk.
    t.run("flash_hopper_turns_walks_many_tiles_hd256", walks_many_tiles(256, FlashVersion::HopperTurns, true));
    t.run(
        "flash_hopper_turns_walks_many_tiles_noncausal_hd256",
        walks_many_tiles(256, FlashVersion::HopperTurns, false),
    );
    // Turns on the counter walk at head dim 64, causal and not.
    t.run("flash_hopper_turns_walks_many_tiles_hd64", walks_many_tiles(64, FlashVersion::HopperTurns, true));
    t.run("flash_hopper_turns_walks_many_tiles_noncausal_hd64", walks_many_tiles(64, FlashVersion::HopperTurns, false));
    t.run("flash_hopper_fma_ex2_walks_many_tiles_hd128", walks_many_tiles(128, FlashVersion::HopperFmaEx2, false));
    t.finish();
}
