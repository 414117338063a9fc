//! GPU tests of split-KV decode attention over the paged KV cache: the shipped
//! path (`decode_attention`) on seeded random shapes against the f64 reference;
//! every version kept for comparison (`decode_attention_with`: two launches, the
//! in-launch merges); the K/V append, the gather and the RoPE + cache write; and the
//! refusals (bad arguments, another cache's batch), which launch nothing.

use host::layer::reference::{rope, rope_with_inv_freq};
use host::model::ModelConfig;
use host::ops::decode::{BatchBuffers, DecodeBatch, MAX_Q_LEN};
use host::ops::{
    decode_attention, decode_attention_with, flash_attention, linear, linear_rope_qkv_cache, rope_qkv_cache,
    AttentionOptions, DecodeVersion, PagedKvCache, RopeTable, SeqId, VarlenBatch,
};
use host::reference::{attention, linear as linear_ref, round_bf16};
use host::{bf16, Error, Gpu, Tensor};
use lab::testing::ShapeRng as Rng;
use lab::testing::{cast, expect_close, quick, random_with_outliers, rel_l2_error, to_f64, GpuTests};

fn e(err: Error) -> String {
    err.to_string()
}

const VERSIONS: [DecodeVersion; 6] = [
    DecodeVersion::Auto,
    DecodeVersion::TwoLaunch,
    DecodeVersion::Fused,
    DecodeVersion::Wide,
    DecodeVersion::Cluster,
    DecodeVersion::Wide8,
];

fn rand_bf16(seed: u64, n: usize) -> Vec<bf16> {
    cast(&random_with_outliers(seed, n, 1.0))
}

struct Setup {
    cache: PagedKvCache,
    seqs: Vec<SeqId>,
    k: Vec<Vec<bf16>>,
    v: Vec<Vec<bf16>>,
}

/// A cache holding `lens[i]` random tokens for sequence i (the last `hold_back`
/// of each are returned but not written).
fn setup(
    gpu: &Gpu,
    lens: &[usize],
    page: usize,
    kv: usize,
    d: usize,
    hold_back: usize,
    seed: u64,
) -> Result<Setup, String> {
    let data = |i: u64, n: usize| rand_bf16(seed + i, n);
    setup_with(gpu, lens, page, kv, d, hold_back, 3, data)
}

/// [`setup`] with `spare` free pages, and sequence i's K and V from `data(2i,
/// n)` and `data(2i + 1, n)`.
#[allow(clippy::too_many_arguments)]
fn setup_with(
    gpu: &Gpu,
    lens: &[usize],
    page: usize,
    kv: usize,
    d: usize,
    hold_back: usize,
    spare: usize,
    mut data: impl FnMut(u64, usize) -> Vec<bf16>,
) -> Result<Setup, String> {
    let pages: usize = lens.iter().map(|l| l.div_ceil(page)).sum::<usize>() + spare;
    let mut cache = PagedKvCache::new(gpu, pages, page, kv, d).map_err(e)?;
    let (mut seqs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
    for (i, &len) in lens.iter().enumerate() {
        let k = data(2 * i as u64, len * kv * d);
        let v = data(2 * i as u64 + 1, len * kv * d);
        let s = cache.add_sequence();
        let keep = (len - hold_back) * kv * d;
        cache.write(gpu, s, &k[..keep], &v[..keep]).map_err(e)?;
        seqs.push(s);
        ks.push(k);
        vs.push(v);
    }
    Ok(Setup { cache, seqs, k: ks, v: vs })
}

/// Runs `f` on `st`'s batch: planned for its longest sequence (`None`), or for
/// `plan_len` tokens in fixed buffers (more splits, the extra ones empty), as a
/// captured graph plans it.
fn with_batch<R>(
    gpu: &Gpu,
    st: &Setup,
    plan_len: Option<usize>,
    f: impl FnOnce(&DecodeBatch) -> Result<R, String>,
) -> Result<R, String> {
    let Some(plan) = plan_len else {
        return f(&st.cache.batch(gpu, &st.seqs).map_err(e)?);
    };
    let page = st.cache.page_size();
    let lens = st.seqs.iter().map(|&s| st.cache.alloc().len(s)).collect::<Result<Vec<_>, _>>().map_err(e)?;
    let pages = lens.iter().map(|l| l.div_ceil(page)).max().unwrap_or(0).max(1);
    let mut bufs = BatchBuffers::new(st.seqs.len(), pages).map_err(e)?;
    let batch = st.cache.batch_into(gpu, &st.seqs, &mut bufs, plan).map_err(e)?;
    f(&batch)
}

/// The f64 reference for `q` (`[batch, q_len, heads, d]`, each sequence's last
/// q_len positions): O as `[batch·q_len, heads, d]`, LSE as `[heads, batch·q_len]`.
struct Reference {
    o: Vec<f64>,
    lse: Vec<f64>,
    rows: usize,
    h: usize,
}

#[allow(clippy::too_many_arguments)]
fn reference(st: &Setup, lens: &[usize], q: &[bf16], q_len: usize, h: usize, kv: usize, d: usize) -> Reference {
    let k: Vec<f64> = st.k.iter().flat_map(|x| to_f64(x)).collect();
    let v: Vec<f64> = st.v.iter().flat_map(|x| to_f64(x)).collect();
    let scale = 1.0 / (d as f64).sqrt();
    let b = lens.len();
    let (o, lse) = attention(&to_f64(q), &k, &v, &vec![q_len; b], lens, h, kv, d, true, scale);
    Reference { o, lse, rows: b * q_len, h }
}

/// Outputs against the reference. Rows with no visible key must have LSE
/// exactly −∞ (a relative error would be NaN there); NaN poison left anywhere
/// fails. LSE errors are relative to the LSEs' L2 norm, or absolute where the
/// LSEs are all near 0 (below 1 on average), where a relative error means nothing.
fn check(what: &str, out: &[bf16], lse: &[f32], r: &Reference) -> Result<(), String> {
    expect_close(&format!("{what} O"), rel_l2_error(&to_f64(out), &r.o), 1e-2)?;
    // Ours: [batch·q_len, heads]; the reference: [heads, batch·q_len].
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for hh in 0..r.h {
        for row in 0..r.rows {
            let (x, y) = (lse[row * r.h + hh] as f64, r.lse[hh * r.rows + row]);
            if y == f64::NEG_INFINITY {
                if x != f64::NEG_INFINITY {
                    return Err(format!("{what}: LSE of row {row} head {hh} (no keys) is {x}, not -inf"));
                }
            } else {
                got.push(x);
                want.push(y);
            }
        }
    }
    let diff = got.iter().zip(&want).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let norm = want.iter().map(|y| y * y).sum::<f64>().sqrt().max((want.len() as f64).sqrt());
    let err = if got.iter().all(|x| x.is_finite()) { diff / norm } else { f64::NAN };
    expect_close(&format!("{what} LSE"), if want.is_empty() { 0.0 } else { err }, 1e-3)
}

/// Runs `version` on fresh NaN-poisoned outputs; returns them.
fn run_decode(
    gpu: &Gpu,
    st: &Setup,
    batch: &DecodeBatch,
    q: &Tensor<bf16>,
    version: DecodeVersion,
) -> Result<(Vec<bf16>, Vec<f32>), String> {
    let shape = q.shape().to_vec();
    let mut out = Tensor::<bf16>::filled(gpu, &shape, bf16::NAN).map_err(e)?;
    let mut lse = Tensor::<f32>::filled(gpu, &shape[..shape.len() - 1], f32::NAN).map_err(e)?;
    decode_attention_with(gpu, &st.cache, batch, q, None, &mut out, &mut lse, version).map_err(e)?;
    Ok((out.to_host(gpu).map_err(e)?, lse.to_host(gpu).map_err(e)?))
}

/// One query per sequence against the f64 reference.
#[allow(clippy::too_many_arguments)]
fn compare(
    gpu: &Gpu,
    st: &Setup,
    lens: &[usize],
    h: usize,
    kv: usize,
    d: usize,
    q: &[bf16],
    what: &str,
    version: DecodeVersion,
    plan_len: Option<usize>,
) -> Result<(), String> {
    let qt = Tensor::from_host(gpu, q, &[lens.len(), h, d]).map_err(e)?;
    let (out, lse) = with_batch(gpu, st, plan_len, |batch| run_decode(gpu, st, batch, &qt, version))?;
    check(&format!("{what} {version:?}"), &out, &lse, &reference(st, lens, q, 1, h, kv, d))
}

/// One random decode call.
#[derive(Debug)]
struct Shape {
    lens: Vec<usize>,
    q_len: usize,
    h: usize,
    kv: usize,
    d: usize,
    page: usize,
    /// Planned for this many tokens through fixed buffers (as a graph is), or
    /// for the longest sequence.
    plan: Option<usize>,
}

/// Σ lengths × q_len × heads × head_dim a shape may cost the f64 reference.
const MAX_WORK: usize = 40_000_000;
/// Tokens a shape's cache may hold in all.
const MAX_TOKENS: usize = 12_000;

/// A shape with batch 1 to 64, lengths 1 to 5000 (1, primes, one past a page,
/// one past a key tile and a 4-warp round, past a split of 4096), pages of 16,
/// 48 (not a power of two: key tiles straddle pages), 64 and others, head dim
/// 64 or 128, GQA groups 1 to 32 (past 16: rows span m16 tiles), q_len 1 to
/// [`MAX_Q_LEN`]. Sizes shrink so the reference stays cheap.
fn random_shape(rng: &mut Rng) -> Shape {
    let d = rng.pick(&[64, 128]);
    let group = rng.pick(&[1, 1, 2, 4, 4, 5, 8, 16, 17, 24, 32]);
    let kv = rng.pick(&[1, 2, 4, 8]).min((64 / group).max(1));
    let h = kv * group;
    let q_len = if rng.below(2) == 0 { 1 } else { 1 + rng.below(MAX_Q_LEN) };
    let b = match rng.below(4) {
        0 => 1,
        1 => 1 + rng.below(4),
        2 => 1 + rng.below(16),
        _ => 1 + rng.below(64),
    };
    let page = rng.pick(&[16, 16, 48, 48, 64, 64, 5, 32, 128, 256]);
    let cap = 5000.min(MAX_TOKENS / b).min(MAX_WORK / (b * q_len * h * d)).max(q_len);
    let special =
        [1, 2, 3, 7, 31, 32, 33, 97, 127, 128, 129, 257, 1009, 4093, 4096, 4097, 5000, page + 1, 2 * page + 1];
    let lens = (0..b)
        .map(|_| {
            let len = match rng.below(10) {
                0..=3 => rng.pick(&special),
                _ => 1 + rng.below(cap),
            };
            len.min(cap).max(q_len)
        })
        .collect::<Vec<_>>();
    let longest = lens.iter().copied().max().unwrap_or(1);
    let plan = (rng.below(4) == 0).then(|| longest * (1 + rng.below(8)));
    Shape { lens, q_len, h, kv, d, page, plan }
}

/// `decode_attention` (the shipped path) on at least 200 seeded random shapes
/// (20 with `GPU_TEST_QUICK`), each against the f64 reference, outputs
/// NaN-poisoned before the call.
fn random_shapes(gpu: &Gpu) -> Result<(), String> {
    let mut rng = Rng(0x5EED_DEC0);
    // K, V and q come from windows of one random block (its values repeat
    // across shapes; the reference sees the same).
    let block = rand_bf16(31, 6 << 20);
    let shapes = if quick() { 20 } else { 220 };
    for n in 0..shapes {
        let s = random_shape(&mut rng);
        let (b, hd) = (s.lens.len(), s.h * s.d);
        let mut window = |_: u64, len: usize| {
            let at = rng.below(block.len() - len + 1);
            block[at..at + len].to_vec()
        };
        let st = setup_with(gpu, &s.lens, s.page, s.kv, s.d, 0, 3, &mut window)?;
        let q = window(0, b * s.q_len * hd);
        let shape = if s.q_len == 1 { vec![b, s.h, s.d] } else { vec![b, s.q_len, s.h, s.d] };
        let qt = Tensor::from_host(gpu, &q, &shape).map_err(e)?;
        let (out, lse) = with_batch(gpu, &st, s.plan, |batch| {
            let mut out = Tensor::<bf16>::filled(gpu, &shape, bf16::NAN).map_err(e)?;
            let mut lse = Tensor::<f32>::filled(gpu, &shape[..shape.len() - 1], f32::NAN).map_err(e)?;
            decode_attention(gpu, &st.cache, batch, &qt, None, &mut out, &mut lse).map_err(e)?;
            Ok((out.to_host(gpu).map_err(e)?, lse.to_host(gpu).map_err(e)?))
        })?;
        let want = reference(&st, &s.lens, &q, s.q_len, s.h, s.kv, s.d);
        check(&format!("shape {n} {s:?}"), &out, &lse, &want)?;
    }
    Ok(())
}

fn configs() -> Vec<(usize, usize, usize)> {
    vec![(32, 8, 128), (8, 2, 64), (4, 4, 128)]
}

/// Lengths 1, primes, one past a key tile, long; and an empty sequence (its row
/// comes out 0 with LSE −∞).
fn lens() -> Vec<usize> {
    if quick() {
        vec![1, 17, 0, 100]
    } else {
        vec![1, 17, 0, 33, 100, 1000, 4097, 33000]
    }
}

fn against_reference(gpu: &Gpu) -> Result<(), String> {
    for (ci, &(h, kv, d)) in configs().iter().enumerate() {
        // 48: not a power of two (the kernels' division path; key tiles straddle pages).
        for page in [16, 48, 64] {
            let lens = lens();
            let st = setup(gpu, &lens, page, kv, d, 0, 100 + ci as u64)?;
            let q = rand_bf16(7 + ci as u64, lens.len() * h * d);
            for version in VERSIONS {
                compare(gpu, &st, &lens, h, kv, d, &q, &format!("h{h}/{kv} d{d} page{page}"), version, None)?;
            }
        }
    }
    Ok(())
}

/// Split counts from 1 to many: the batches are planned for longer sequences
/// than they hold (as a captured graph is), so most splits of the short ones
/// are empty.
fn split_counts(gpu: &Gpu) -> Result<(), String> {
    let lens = vec![1, 0, 31, 33, 300];
    for (ci, &(h, kv, d)) in [(32, 8, 128), (8, 2, 64)].iter().enumerate() {
        let st = setup(gpu, &lens, 16, kv, d, 0, 700 + ci as u64)?;
        let q = rand_bf16(710 + ci as u64, lens.len() * h * d);
        for plan in [300, 1000, 4096, 65536, 1 << 20] {
            for version in VERSIONS {
                let what = format!("h{h}/{kv} d{d} planned for {plan}");
                compare(gpu, &st, &lens, h, kv, d, &q, &what, version, Some(plan))?;
            }
        }
    }
    Ok(())
}

/// Key tiles of one split only (every length ≤ 32): the fused kernel writes the
/// output directly, without partials or counters.
fn one_split(gpu: &Gpu) -> Result<(), String> {
    for (ci, lens) in [vec![20], vec![32], vec![0, 5], vec![1, 7, 32, 0]].iter().enumerate() {
        for &(h, kv, d) in &configs() {
            let st = setup(gpu, lens, 16, kv, d, 0, 800 + ci as u64)?;
            let q = rand_bf16(810 + ci as u64, lens.len() * h * d);
            for version in VERSIONS {
                compare(gpu, &st, lens, h, kv, d, &q, &format!("lens {lens:?} h{h}/{kv} d{d}"), version, None)?;
            }
        }
    }
    Ok(())
}

/// The in-launch merges' split counters (`Fused`, `Wide`, `Cluster`, `Wide8`) are left zero: calls in a row on the same
/// buffers, and replays of a captured graph, all give the first call's output.
fn fused_repeats(gpu: &Gpu) -> Result<(), String> {
    for version in [DecodeVersion::Fused, DecodeVersion::Wide, DecodeVersion::Cluster, DecodeVersion::Wide8] {
        repeats(gpu, version)?;
    }
    Ok(())
}

fn repeats(gpu: &Gpu, version: DecodeVersion) -> Result<(), String> {
    let (h, kv, d) = (32, 8, 128);
    let lens = vec![4097, 300, 1];
    let st = setup(gpu, &lens, 64, kv, d, 0, 900)?;
    let q = rand_bf16(901, lens.len() * h * d);
    let batch = st.cache.batch(gpu, &st.seqs).map_err(e)?;
    let qt = Tensor::from_host(gpu, &q, &[lens.len(), h, d]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[lens.len(), h, d], bf16::NAN).map_err(e)?;
    let mut lse = Tensor::<f32>::filled(gpu, &[lens.len(), h], f32::NAN).map_err(e)?;
    let fused = |out: &mut Tensor<bf16>, lse: &mut Tensor<f32>| {
        decode_attention_with(gpu, &st.cache, &batch, &qt, None, out, lse, version)
    };
    let mut results = Vec::new();
    for _ in 0..3 {
        out.fill(bf16::NAN).map_err(e)?;
        lse.fill(f32::NAN).map_err(e)?;
        fused(&mut out, &mut lse).map_err(e)?;
        results.push((out.to_host(gpu).map_err(e)?, lse.to_host(gpu).map_err(e)?));
    }
    let graph = gpu.capture(|| fused(&mut out, &mut lse)).map_err(e)?;
    for _ in 0..3 {
        out.fill(bf16::NAN).map_err(e)?;
        lse.fill(f32::NAN).map_err(e)?;
        // SAFETY: `out`, `lse` and everything `fused` points into outlive `graph`.
        unsafe { gpu.launch_graph(&graph) }.map_err(e)?;
        results.push((out.to_host(gpu).map_err(e)?, lse.to_host(gpu).map_err(e)?));
    }
    drop(graph);
    check(&format!("{version:?} first call"), &results[0].0, &results[0].1, &reference(&st, &lens, &q, 1, h, kv, d))?;
    let bits = |r: &(Vec<bf16>, Vec<f32>)| {
        (r.0.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), r.1.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
    };
    for (i, r) in results.iter().enumerate().skip(1) {
        if bits(r) != bits(&results[0]) {
            return Err(format!("{version:?} call {} (3 direct, then 3 graph replays) differs from the first", i + 1));
        }
    }
    // And the two-launch version still agrees afterwards.
    compare(gpu, &st, &lens, h, kv, d, &q, "after the repeats", DecodeVersion::TwoLaunch, None)
}

/// `Cluster` where it applies (Hopper): the splits of one KV head in one
/// cluster, as many as let all 8 clusters fit at once (b1 L4096, the reference
/// layer's heads), and odd lengths whose split counts give clusters of 2 to 16.
fn cluster_merge(gpu: &Gpu) -> Result<(), String> {
    let fit: Vec<_> = (2..=16)
        .map(|s| host::ops::decode::cluster_capacity(gpu, s).map(|n| (s, n)))
        .collect::<Result<_, _>>()
        .map_err(e)?;
    println!("  (cluster size, clusters that fit at once): {fit:?}");
    if gpu.info().arch == host::runtime::Arch::Sm90a && !fit.iter().any(|&(s, n)| s >= 8 && n >= 8) {
        return Err("no cluster of 8 or more splits fits 8 times: b1 L4096 would not take the cluster kernel".into());
    }
    let (h, kv, d) = (32, 8, 128);
    for (ci, lens) in [vec![4096], vec![4097], vec![1000], vec![129], vec![3000, 0]].iter().enumerate() {
        let st = setup(gpu, lens, 64, kv, d, 0, 950 + ci as u64)?;
        let q = rand_bf16(960 + ci as u64, lens.len() * h * d);
        compare(gpu, &st, lens, h, kv, d, &q, &format!("cluster lens {lens:?}"), DecodeVersion::Cluster, None)?;
    }
    Ok(())
}

/// The last token goes in through the append kernel.
fn append_then_decode(gpu: &Gpu) -> Result<(), String> {
    let (h, kv, d, page) = (32, 8, 128, 16);
    let lens = vec![1, 16, 17, 300];
    let mut st = setup(gpu, &lens, page, kv, d, 1, 300)?;
    let per = kv * d;
    let last = |all: &Vec<Vec<bf16>>| -> Vec<bf16> {
        all.iter().zip(&lens).flat_map(|(x, &l)| x[(l - 1) * per..l * per].to_vec()).collect()
    };
    let kn = Tensor::from_host(gpu, &last(&st.k), &[lens.len(), kv, d]).map_err(e)?;
    let vn = Tensor::from_host(gpu, &last(&st.v), &[lens.len(), kv, d]).map_err(e)?;
    let seqs = st.seqs.clone();
    st.cache.append(gpu, &seqs, &kn, &vn).map_err(e)?;
    let q = rand_bf16(301, lens.len() * h * d);
    for version in VERSIONS {
        compare(gpu, &st, &lens, h, kv, d, &q, "append", version, None)?;
    }
    Ok(())
}

/// Decode of the last token equals the last row of a causal prefill.
fn matches_prefill(gpu: &Gpu) -> Result<(), String> {
    let (h, kv, d, len) = (32, 8, 128, 777);
    let st = setup(gpu, &[len], 64, kv, d, 0, 400)?;
    let q = rand_bf16(401, len * h * d);
    let batch = VarlenBatch::new(gpu, &[len], &[len]).map_err(e)?;
    let qt = Tensor::from_host(gpu, &q, &[len, h, d]).map_err(e)?;
    let kt = Tensor::from_host(gpu, &st.k[0], &[len, kv, d]).map_err(e)?;
    let vt = Tensor::from_host(gpu, &st.v[0], &[len, kv, d]).map_err(e)?;
    let mut o = Tensor::<bf16>::filled(gpu, &[len, h, d], bf16::NAN).map_err(e)?;
    let mut l = Tensor::<f32>::filled(gpu, &[h, len], f32::NAN).map_err(e)?;
    flash_attention(gpu, &qt, &kt, &vt, &batch, AttentionOptions { causal: true, scale: None }, &mut o, &mut l)
        .map_err(e)?;
    let prefill_last = to_f64(&o.to_host(gpu).map_err(e)?[(len - 1) * h * d..]);
    let q_last = Tensor::from_host(gpu, &q[(len - 1) * h * d..], &[1, h, d]).map_err(e)?;
    let db = st.cache.batch(gpu, &st.seqs).map_err(e)?;
    for version in VERSIONS {
        let (out, _) = run_decode(gpu, &st, &db, &q_last, version)?;
        let what = format!("decode ({version:?}) vs prefill last row");
        expect_close(&what, rel_l2_error(&to_f64(&out), &prefill_last), 1e-2)?;
    }
    Ok(())
}

/// Speculative decoding: q_len new queries per sequence, each seeing the keys up
/// to its own position (causal, bottom-right aligned), with query-head groups of
/// 4 to 32 (up to 16 rows of (token, head) per block, so G·q_len > 16 spans blocks).
/// The q_len = 1 cases in the 4-D layout check the kernel choice: G = 16 takes the
/// plain entry (a full row tile), G = 32 the spec entry with one query.
fn speculative(gpu: &Gpu) -> Result<(), String> {
    let lens = if quick() { vec![8, 40] } else { vec![8, 33, 300, 4100] };
    let cases = [
        (32, 8, 128, 2, 16),
        (8, 2, 64, 5, 64),
        (32, 1, 64, 3, 16),
        (16, 4, 128, 8, 64),
        (16, 1, 128, 1, 16),
        (32, 1, 64, 1, 64),
    ];
    for (ci, &(h, kv, d, q_len, page)) in cases.iter().enumerate() {
        let b = lens.len();
        let st = setup(gpu, &lens, page, kv, d, 0, 500 + 10 * ci as u64)?;
        let q = rand_bf16(600 + ci as u64, b * q_len * h * d);
        let want = reference(&st, &lens, &q, q_len, h, kv, d);
        let batch = st.cache.batch(gpu, &st.seqs).map_err(e)?;
        let qt = Tensor::from_host(gpu, &q, &[b, q_len, h, d]).map_err(e)?;
        for version in VERSIONS {
            let (out, lse) = run_decode(gpu, &st, &batch, &qt, version)?;
            check(&format!("speculative q_len {q_len} h{h}/{kv} d{d} page{page} {version:?}"), &out, &lse, &want)?;
        }
    }
    Ok(())
}

/// Every refused decode argument returns its typed error, for the shipped path
/// and every version, and launches nothing.
fn bad_decode_input(gpu: &Gpu) -> Result<(), String> {
    let (kv, d) = (2, 64);
    let mut cache = PagedKvCache::new(gpu, 4, 16, kv, d).map_err(e)?;
    let (a, b) = (cache.add_sequence(), cache.add_sequence());
    let tok = rand_bf16(1, 16 * kv * d);
    cache.write(gpu, a, &tok, &tok).map_err(e)?;
    cache.write(gpu, b, &tok[..5 * kv * d], &tok[..5 * kv * d]).map_err(e)?;
    let batch = cache.batch(gpu, &[a, b]).map_err(e)?;
    let mut other = PagedKvCache::new(gpu, 4, 16, kv, d).map_err(e)?;
    let (c, dd) = (other.add_sequence(), other.add_sequence());
    other.write(gpu, c, &tok, &tok).map_err(e)?;
    other.write(gpu, dd, &tok, &tok).map_err(e)?;
    let foreign = other.batch(gpu, &[c, dd]).map_err(e)?;
    type Case<'a> = (&'a str, Vec<usize>, Vec<usize>, Vec<usize>, Option<f32>, bool, fn(&Error) -> bool);
    let shape: fn(&Error) -> bool = |err| matches!(err, Error::Shape(_));
    let invalid: fn(&Error) -> bool = |err| matches!(err, Error::InvalidArgument(_));
    let foreign_err: fn(&Error) -> bool = |err| matches!(err, Error::ForeignBatch(_));
    let cases: Vec<Case> = vec![
        ("q of rank 2", vec![2, 4 * d], vec![2, 4 * d], vec![2], None, false, shape),
        ("q of rank 5", vec![2, 1, 1, 4, d], vec![2, 1, 1, 4, d], vec![2, 1, 4], None, false, shape),
        ("out unlike q", vec![2, 4, d], vec![2, 2, d], vec![2, 4], None, false, shape),
        ("lse unlike q", vec![2, 4, d], vec![2, 4, d], vec![2, 2], None, false, shape),
        ("3-D lse for 3-D q", vec![2, 4, d], vec![2, 4, d], vec![2, 1, 4], None, false, shape),
        ("head_dim 128 on a 64 cache", vec![2, 4, 128], vec![2, 4, 128], vec![2, 4], None, false, shape),
        ("3 heads over 2 KV heads", vec![2, 3, d], vec![2, 3, d], vec![2, 3], None, false, shape),
        ("batch of 3 for 2 sequences", vec![3, 4, d], vec![3, 4, d], vec![3, 4], None, false, shape),
        (
            "q_len past MAX_Q_LEN",
            vec![2, MAX_Q_LEN + 1, 4, d],
            vec![2, MAX_Q_LEN + 1, 4, d],
            vec![2, MAX_Q_LEN + 1, 4],
            None,
            false,
            invalid,
        ),
        ("q_len past the shortest sequence", vec![2, 6, 4, d], vec![2, 6, 4, d], vec![2, 6, 4], None, false, invalid),
        ("scale 0", vec![2, 4, d], vec![2, 4, d], vec![2, 4], Some(0.0), false, invalid),
        ("negative scale", vec![2, 4, d], vec![2, 4, d], vec![2, 4], Some(-1.0), false, invalid),
        ("NaN scale", vec![2, 4, d], vec![2, 4, d], vec![2, 4], Some(f32::NAN), false, invalid),
        ("infinite scale", vec![2, 4, d], vec![2, 4, d], vec![2, 4], Some(f32::INFINITY), false, invalid),
        ("another cache's batch", vec![2, 4, d], vec![2, 4, d], vec![2, 4], None, true, foreign_err),
    ];
    for (what, q_shape, out_shape, lse_shape, scale, use_foreign, expected) in cases {
        let q = Tensor::<bf16>::filled(gpu, &q_shape, bf16::ONE).map_err(e)?;
        let mut out = Tensor::<bf16>::filled(gpu, &out_shape, bf16::NAN).map_err(e)?;
        let mut lse = Tensor::<f32>::filled(gpu, &lse_shape, f32::NAN).map_err(e)?;
        let batch = if use_foreign { &foreign } else { &batch };
        for version in VERSIONS {
            let launches = gpu.launch_count();
            let got = if version == DecodeVersion::Auto {
                decode_attention(gpu, &cache, batch, &q, scale, &mut out, &mut lse)
            } else {
                decode_attention_with(gpu, &cache, batch, &q, scale, &mut out, &mut lse, version)
            };
            match got {
                Err(err) if expected(&err) => {}
                other => return Err(format!("{what} ({version:?}): {other:?}")),
            }
            if gpu.launch_count() != launches {
                return Err(format!("{what} ({version:?}): a refused call launched a kernel"));
            }
        }
    }
    // And the same call with the right batch goes through.
    let q = Tensor::<bf16>::filled(gpu, &[2, 4, d], bf16::ONE).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[2, 4, d], bf16::NAN).map_err(e)?;
    let mut lse = Tensor::<f32>::filled(gpu, &[2, 4], f32::NAN).map_err(e)?;
    decode_attention(gpu, &cache, &batch, &q, None, &mut out, &mut lse).map_err(e)
}

/// A batch made from one cache, given with another of the same geometry (so
/// every shape check passes): refused with `ForeignBatch` by decode attention
/// and the RoPE + cache write, before any launch; likewise a batch from a cache
/// dropped since, against a new one.
fn foreign_batch(gpu: &Gpu) -> Result<(), String> {
    let (h, kv, d, len) = (8, 2, 128, 300);
    let a = setup(gpu, &[len, 40], 16, kv, d, 0, 1000)?;
    let b = setup(gpu, &[len, 40], 16, kv, d, 0, 1010)?;
    let batch_a = a.cache.batch(gpu, &a.seqs).map_err(e)?;
    let q = Tensor::<bf16>::filled(gpu, &[2, h, d], bf16::ONE).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[2, h, d], bf16::NAN).map_err(e)?;
    let mut lse = Tensor::<f32>::filled(gpu, &[2, h], f32::NAN).map_err(e)?;
    let refused = |r: Result<(), Error>, what: &str, launches: u64| match r {
        Err(Error::ForeignBatch(_)) if gpu.launch_count() == launches => Ok(()),
        Err(Error::ForeignBatch(_)) => Err(format!("{what}: refused, but a kernel was launched")),
        other => Err(format!("{what}: another cache's batch gave {other:?}")),
    };
    let launches = gpu.launch_count();
    refused(decode_attention(gpu, &b.cache, &batch_a, &q, None, &mut out, &mut lse), "decode_attention", launches)?;
    for version in VERSIONS {
        let r = decode_attention_with(gpu, &b.cache, &batch_a, &q, None, &mut out, &mut lse, version);
        refused(r, &format!("decode_attention_with {version:?}"), launches)?;
    }
    let table = RopeTable::new(gpu, d, 10000.0, 1024).map_err(e)?;
    let qkv = Tensor::<bf16>::filled(gpu, &[1, (h + 2 * kv) * d], bf16::ONE).map_err(e)?;
    let mut q_out = Tensor::<bf16>::filled(gpu, &[1, h, d], bf16::NAN).map_err(e)?;
    let r = rope_qkv_cache(gpu, &qkv, None, &table, &b.cache, &batch_a, &[0], &[0], &mut q_out, None);
    refused(r, "rope_qkv_cache", launches)?;
    // A batch outliving its cache: ids are never reused.
    let gone = setup(gpu, &[len, 40], 16, kv, d, 0, 1020)?;
    let batch_gone = gone.cache.batch(gpu, &gone.seqs).map_err(e)?;
    drop(gone);
    let c = setup(gpu, &[len, 40], 16, kv, d, 0, 1030)?;
    let launches = gpu.launch_count();
    refused(decode_attention(gpu, &c.cache, &batch_gone, &q, None, &mut out, &mut lse), "dropped cache", launches)?;
    // A batch made before pages went back to the free list (they may be another
    // sequence's by now) is refused too; a fresh one decodes.
    let mut c = c;
    let stale = c.cache.batch(gpu, &c.seqs).map_err(e)?;
    let extra = c.cache.add_sequence();
    c.cache.grow_all(&[extra], &[1]).map_err(e)?;
    c.cache.release(extra).map_err(e)?;
    let launches = gpu.launch_count();
    refused(decode_attention(gpu, &c.cache, &stale, &q, None, &mut out, &mut lse), "stale batch", launches)?;
    let fresh = c.cache.batch(gpu, &c.seqs).map_err(e)?;
    decode_attention(gpu, &c.cache, &fresh, &q, None, &mut out, &mut lse).map_err(e)?;
    // Each cache with its own batch still decodes.
    decode_attention(gpu, &a.cache, &batch_a, &q, None, &mut out, &mut lse).map_err(e)
}

/// The append kernel on random batches: each sequence gets its new row at its
/// new last position (read back from the cache exactly), and nothing else moves.
fn append_random(gpu: &Gpu) -> Result<(), String> {
    let mut rng = Rng(0xA99E);
    for round in 0..if quick() { 4 } else { 24 } {
        let (kv, d) = (rng.pick(&[1, 2, 8]), rng.pick(&[64, 128]));
        let page = rng.pick(&[1, 5, 16, 48, 64]);
        let b = 1 + rng.below(12);
        let lens: Vec<usize> = (0..b)
            .map(|_| {
                let any = rng.below(300);
                rng.pick(&[0, 1, page - 1, page, page + 1, any])
            })
            .collect();
        // A spare page for every sequence's new token.
        let data = |i: u64, n: usize| rand_bf16(2000 + 100 * round + i, n);
        let mut st = setup_with(gpu, &lens, page, kv, d, 0, b, data)?;
        // A random subset, in random order.
        let mut seqs: Vec<usize> = (0..b).filter(|_| rng.below(3) != 0).collect();
        if seqs.is_empty() {
            seqs.push(0);
        }
        for i in (1..seqs.len()).rev() {
            seqs.swap(i, rng.below(i + 1));
        }
        let ids: Vec<SeqId> = seqs.iter().map(|&i| st.seqs[i]).collect();
        let (kn, vn) = (rand_bf16(2100 + round, seqs.len() * kv * d), rand_bf16(2200 + round, seqs.len() * kv * d));
        let kt = Tensor::from_host(gpu, &kn, &[seqs.len(), kv, d]).map_err(e)?;
        let vt = Tensor::from_host(gpu, &vn, &[seqs.len(), kv, d]).map_err(e)?;
        let batch = st.cache.append(gpu, &ids, &kt, &vt).map_err(e)?;
        let row = kv * d;
        for (j, &i) in seqs.iter().enumerate() {
            st.k[i].extend_from_slice(&kn[j * row..(j + 1) * row]);
            st.v[i].extend_from_slice(&vn[j * row..(j + 1) * row]);
            if batch.lens()[j] as usize != lens[i] + 1 {
                return Err(format!("round {round}: sequence {i}'s batch length {}", batch.lens()[j]));
            }
        }
        let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (i, &s) in st.seqs.iter().enumerate() {
            let (k, v) = st.cache.read(gpu, s).map_err(e)?;
            if bits(&k) != bits(&st.k[i]) || bits(&v) != bits(&st.v[i]) {
                return Err(format!("round {round} (page {page}, kv {kv}, d {d}): sequence {i}'s cache rows differ"));
            }
        }
    }
    Ok(())
}

/// `PagedKvCache::gather` (`kv_gather`) on random ranges of random sequences:
/// the rows come back bit for bit, in range order, into poisoned outputs; and a
/// range past its sequence, outputs of the wrong shape or a count mismatch are
/// refused before any launch.
fn gather_random(gpu: &Gpu) -> Result<(), String> {
    let mut rng = Rng(0x6A7E);
    for round in 0..if quick() { 4 } else { 24 } {
        let (kv, d) = (rng.pick(&[1, 2, 8]), rng.pick(&[64, 128]));
        let page = rng.pick(&[1, 5, 16, 48, 64]);
        let b = 1 + rng.below(6);
        let lens: Vec<usize> = (0..b)
            .map(|_| {
                let any = 1 + rng.below(1100);
                rng.pick(&[1, page, page + 1, 17, any])
            })
            .collect();
        let data = |i: u64, n: usize| rand_bf16(3000 + 100 * round + i, n);
        let st = setup_with(gpu, &lens, page, kv, d, 0, 1, data)?;
        // Ranges of a random subset in random order, a sequence maybe twice.
        let picks: Vec<usize> = (0..1 + rng.below(2 * b)).map(|_| rng.below(b)).collect();
        let ranges: Vec<std::ops::Range<usize>> = picks
            .iter()
            .map(|&i| {
                let any = rng.below(lens[i]);
                let start = rng.pick(&[0, 0, any]);
                start..start + 1 + rng.below(lens[i] - start)
            })
            .collect();
        let seqs: Vec<SeqId> = picks.iter().map(|&i| st.seqs[i]).collect();
        let rows: usize = ranges.iter().map(|r| r.len()).sum();
        let row = kv * d;
        let mut k = Tensor::<bf16>::filled(gpu, &[rows, kv, d], bf16::NAN).map_err(e)?;
        let mut v = Tensor::<bf16>::filled(gpu, &[rows, kv, d], bf16::NAN).map_err(e)?;
        st.cache.gather(gpu, 0, &seqs, &ranges, &mut k, &mut v).map_err(e)?;
        let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let want = |all: &[Vec<bf16>]| -> Vec<bf16> {
            picks.iter().zip(&ranges).flat_map(|(&i, r)| all[i][r.start * row..r.end * row].to_vec()).collect()
        };
        if bits(&k.to_host(gpu).map_err(e)?) != bits(&want(&st.k))
            || bits(&v.to_host(gpu).map_err(e)?) != bits(&want(&st.v))
        {
            return Err(format!("round {round} (page {page}, kv {kv}, d {d}, ranges {ranges:?}): rows differ"));
        }
    }
    let st = setup(gpu, &[5, 20], 16, 2, 64, 0, 3100)?;
    let mut k = Tensor::<bf16>::filled(gpu, &[6, 2, 64], bf16::NAN).map_err(e)?;
    let mut v = Tensor::<bf16>::filled(gpu, &[6, 2, 64], bf16::NAN).map_err(e)?;
    let mut short = Tensor::<bf16>::filled(gpu, &[5, 2, 64], bf16::NAN).map_err(e)?;
    let launches = gpu.launch_count();
    let seqs = st.seqs.clone();
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = [0..1, 6..1];
    // Six rows each but for the shape case, so each is refused for its own reason.
    let cases: [(&str, Result<(), Error>, &str); 5] = [
        ("a range that runs backwards", st.cache.gather(gpu, 0, &seqs, &backwards, &mut k, &mut v), "InvalidArgument"),
        (
            "a range past its sequence",
            st.cache.gather(gpu, 0, &seqs, &[0..1, 16..21], &mut k, &mut v),
            "InvalidArgument",
        ),
        ("more rows than the outputs", st.cache.gather(gpu, 0, &seqs, &[0..5, 0..2], &mut k, &mut short), "Shape"),
        (
            "more ranges than sequences",
            st.cache.gather(gpu, 0, &seqs, &[0..3, 0..3, 0..0], &mut k, &mut v),
            "InvalidArgument",
        ),
        ("a layer the cache lacks", st.cache.gather(gpu, 1, &seqs, &[0..1, 0..5], &mut k, &mut v), "InvalidArgument"),
    ];
    for (what, got, want) in cases {
        let kind = match &got {
            Err(Error::InvalidArgument(_)) => "InvalidArgument",
            Err(Error::Shape(_)) => "Shape",
            Err(_) => "another error",
            Ok(()) => "nothing",
        };
        if kind != want {
            return Err(format!("kv_gather: {what} gave {kind} ({got:?}), not {want}"));
        }
    }
    if gpu.launch_count() != launches {
        return Err("a refused gather launched".into());
    }
    Ok(())
}

/// `PagedKvCache::fork`: the fork reads the parent's rows (whole pages shared,
/// the partial one copied); each then writes rows of its own that the other
/// never sees (and the public RoPE op may not write a shared page); a
/// truncate inside a shared page detaches it first, so the
/// parent keeps its rows; a fork or a truncate that needs a page from a full
/// pool is refused, changing nothing; and the pages go back to the pool with
/// their last holder (the child's rows outlive the parent).
fn fork_and_truncate(gpu: &Gpu) -> Result<(), String> {
    let (kv, d, page) = (2, 64, 16);
    let row = kv * d;
    let mut st = setup_with(gpu, &[37], page, kv, d, 0, 4, |i, n| rand_bf16(3200 + i, n))?;
    let parent = st.seqs[0];
    let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let free = st.cache.alloc().free_pages();
    let child = st.cache.fork(gpu, parent).map_err(e)?;
    // Pages 0 and 1 shared, page 2 (5 rows) copied into a page of the child's own.
    if st.cache.alloc().free_pages() != free - 1 || st.cache.alloc().pages(child).map_err(e)?[..2] != [0, 1] {
        return Err(format!("fork: pages {:?}", st.cache.alloc().pages(child)));
    }
    let (k, v) = st.cache.read(gpu, child).map_err(e)?;
    if bits(&k) != bits(&st.k[0]) || bits(&v) != bits(&st.v[0]) {
        return Err("the fork does not read the parent's rows".into());
    }
    // The public RoPE op may place a token anywhere below the length: not in a
    // shared page (position 0 of the child), and nothing is launched.
    let table = RopeTable::new(gpu, d, 10000.0, 64).map_err(e)?;
    let qkv = Tensor::<bf16>::filled(gpu, &[1, (2 + 2 * kv) * d], bf16::ONE).map_err(e)?;
    let mut q_out = Tensor::<bf16>::filled(gpu, &[1, 2, d], bf16::NAN).map_err(e)?;
    let batch = st.cache.batch(gpu, &[child]).map_err(e)?;
    let launches = gpu.launch_count();
    let shared = rope_qkv_cache(gpu, &qkv, None, &table, &st.cache, &batch, &[0], &[0], &mut q_out, None);
    if !matches!(shared, Err(Error::InvalidArgument(_))) || gpu.launch_count() != launches {
        return Err(format!("a RoPE write into a shared page gave {shared:?}"));
    }
    drop(batch);
    let (ck, cv) = (rand_bf16(3210, 5 * row), rand_bf16(3211, 5 * row));
    let (pk, pv) = (rand_bf16(3212, 20 * row), rand_bf16(3213, 20 * row));
    st.cache.write(gpu, child, &ck, &cv).map_err(e)?;
    st.cache.write(gpu, parent, &pk, &pv).map_err(e)?;
    let expect = |c: &PagedKvCache, what: &str, seq, k: Vec<bf16>, v: Vec<bf16>| -> Result<(), String> {
        let (gk, gv) = c.read(gpu, seq).map_err(e)?;
        if bits(&gk) != bits(&k) || bits(&gv) != bits(&v) {
            return Err(format!("{what}: rows differ"));
        }
        Ok(())
    };
    expect(&st.cache, "the child after both wrote", child, [&st.k[0][..], &ck].concat(), [&st.v[0][..], &cv].concat())?;
    let (parent_k, parent_v) = ([&st.k[0][..], &pk].concat(), [&st.v[0][..], &pv].concat());
    expect(&st.cache, "the parent after both wrote", parent, parent_k.clone(), parent_v.clone())?;
    // A cut at 20 falls inside page 1, shared: the child gets a copy of it.
    st.cache.truncate(gpu, child, 20).map_err(e)?;
    let (tk, tv) = (rand_bf16(3214, 3 * row), rand_bf16(3215, 3 * row));
    st.cache.write(gpu, child, &tk, &tv).map_err(e)?;
    expect(
        &st.cache,
        "the child after a cut and 3 rows",
        child,
        [&st.k[0][..20 * row], &tk].concat(),
        [&st.v[0][..20 * row], &tv].concat(),
    )?;
    expect(&st.cache, "the parent after the child's cut", parent, parent_k, parent_v)?;
    // With the pool full, a fork or a cut that needs a page is refused and
    // changes nothing: the child's partial page, the parent's 57 tokens (a
    // partial page), a cut of the parent inside page 0 (still shared).
    let filler = st.cache.add_sequence();
    let zeros = vec![bf16::ZERO; st.cache.alloc().free_pages() * page * row];
    st.cache.write(gpu, filler, &zeros, &zeros).map_err(e)?;
    let state = |c: &PagedKvCache| -> Result<_, String> {
        let pages = |s| c.alloc().pages(s).map(<[u32]>::to_vec).map_err(e);
        Ok((pages(parent)?, pages(child)?, c.alloc().len(parent).map_err(e)?, c.alloc().free_pages()))
    };
    let before = state(&st.cache)?;
    let full = |r: Result<(), Error>| matches!(r, Err(Error::TooLarge(_)));
    let refused = [
        full(st.cache.fork(gpu, child).map(drop)),
        full(st.cache.fork(gpu, parent).map(drop)),
        full(st.cache.truncate(gpu, parent, 5)),
    ];
    if refused.contains(&false) || state(&st.cache)? != before {
        return Err(format!("with the pool full: refused {refused:?}, state {:?} → {:?}", before, state(&st.cache)?));
    }
    // The parent's pages go back but for page 0, still the child's: a new
    // sequence takes every free page, and the child's rows are as they were.
    st.cache.release(filler).map_err(e)?;
    st.cache.release(parent).map_err(e)?;
    let newcomer = st.cache.add_sequence();
    let ones = vec![bf16::ONE; st.cache.alloc().free_pages() * page * row];
    st.cache.write(gpu, newcomer, &ones, &ones).map_err(e)?;
    if st.cache.alloc().pages(newcomer).map_err(e)?.contains(&0) {
        return Err("page 0 went back to the pool while the child held it".into());
    }
    let (child_k, child_v) = ([&st.k[0][..20 * row], &tk].concat(), [&st.v[0][..20 * row], &tv].concat());
    expect(&st.cache, "the child after its parent left", child, child_k, child_v)?;
    // The pages go back with their last holder.
    for s in [newcomer, child] {
        st.cache.release(s).map_err(e)?;
    }
    if st.cache.alloc().free_pages() != st.cache.alloc().num_pages() {
        return Err(format!(
            "{} of {} pages free at the end",
            st.cache.alloc().free_pages(),
            st.cache.alloc().num_pages()
        ));
    }
    Ok(())
}

/// `rope_qkv_cache` on random tokens of random sequences, every other round with
/// a QKV bias: q, k (rotated) and v against the f64 reference, and each token's k
/// and v at its slot of the cache.
fn rope_random(gpu: &Gpu) -> Result<(), String> {
    let mut rng = Rng(0x0707E);
    let theta = 10000.0;
    for round in 0..if quick() { 4 } else { 30 } {
        let d = rng.pick(&[64, 128]);
        let kv = rng.pick(&[1, 2, 4, 8]);
        let h = kv * rng.pick(&[1, 3, 4, 8]);
        let page = rng.pick(&[1, 5, 16, 48, 64]);
        let lens: Vec<usize> = (0..1 + rng.below(5)).map(|_| 1 + rng.below(300)).collect();
        let max_pos = lens.iter().copied().max().unwrap_or(1) + rng.below(3);
        let (cache, seqs) = grown_cache(gpu, &lens, page, kv, d)?;
        // Distinct (sequence, position) slots.
        let t = 1 + rng.below(48);
        let mut slots: Vec<(u32, u32)> = Vec::new();
        while slots.len() < t {
            let s = rng.below(lens.len());
            let slot = (s as u32, rng.below(lens[s]) as u32);
            if !slots.contains(&slot) {
                slots.push(slot);
            }
            if slots.len() == lens.iter().sum::<usize>() {
                break;
            }
        }
        let t = slots.len();
        let (seq, pos): (Vec<u32>, Vec<u32>) = slots.iter().copied().unzip();
        let width = (h + 2 * kv) * d;
        let qkv = rand_bf16(3000 + round, t * width);
        let bias = (round % 2 == 1).then(|| rand_bf16(3500 + round, width));
        let bias_t = bias.as_ref().map(|b| Tensor::from_host(gpu, b, &[width])).transpose().map_err(e)?;
        let table = RopeTable::new(gpu, d, theta, max_pos).map_err(e)?;
        let batch = cache.batch(gpu, &seqs).map_err(e)?;
        let qkv_t = Tensor::from_host(gpu, &qkv, &[t, width]).map_err(e)?;
        let mut q_out = Tensor::<bf16>::filled(gpu, &[t, h, d], bf16::NAN).map_err(e)?;
        let mut k_out = Tensor::<bf16>::filled(gpu, &[t, kv, d], bf16::NAN).map_err(e)?;
        let mut v_out = Tensor::<bf16>::filled(gpu, &[t, kv, d], bf16::NAN).map_err(e)?;
        let kv_out = Some((&mut k_out, &mut v_out));
        rope_qkv_cache(gpu, &qkv_t, bias_t.as_ref(), &table, &cache, &batch, &seq, &pos, &mut q_out, kv_out)
            .map_err(e)?;
        let (mut q, mut k, v) = split_qkv(&to_f64(&qkv), bias.as_deref(), h, kv, d);
        let positions: Vec<usize> = pos.iter().map(|&p| p as usize).collect();
        rope(&mut q, h, d, &positions, theta);
        rope(&mut k, kv, d, &positions, theta);
        let what = format!("round {round} (t {t}, h {h}/{kv}, d {d}, page {page}, bias {})", bias.is_some());
        let (qg, kg, vg) =
            (q_out.to_host(gpu).map_err(e)?, k_out.to_host(gpu).map_err(e)?, v_out.to_host(gpu).map_err(e)?);
        expect_close(&format!("{what} q"), rel_l2_error(&to_f64(&qg), &q), 1e-2)?;
        expect_close(&format!("{what} k"), rel_l2_error(&to_f64(&kg), &k), 1e-2)?;
        expect_close(&format!("{what} v"), rel_l2_error(&to_f64(&vg), &v), 0.0)?;
        let rows: Vec<(Vec<bf16>, Vec<bf16>)> =
            seqs.iter().map(|&s| cache.read(gpu, s)).collect::<Result<_, _>>().map_err(e)?;
        let row = kv * d;
        for (i, &(s, p)) in slots.iter().enumerate() {
            let (ck, cv) = &rows[s as usize];
            let at = p as usize * row..(p as usize + 1) * row;
            if ck[at.clone()] != kg[i * row..(i + 1) * row] || cv[at] != vg[i * row..(i + 1) * row] {
                return Err(format!("{what}: token {i}'s cache slot ({s}, {p}) differs from its k/v"));
            }
        }
    }
    Ok(())
}

/// q, k and v of `[tokens, (h + 2·kv)·d]` rows, each element plus its `bias`
/// (none: zero) rounded to bf16, as the projection hands them to the rotation.
fn split_qkv(x: &[f64], bias: Option<&[bf16]>, h: usize, kv: usize, d: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let width = (h + 2 * kv) * d;
    let bias = bias.map_or(vec![0.0; width], to_f64);
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for row in x.chunks(width) {
        let row: Vec<f64> = row.iter().zip(&bias).map(|(x, b)| round_bf16(x + b)).collect();
        q.extend_from_slice(&row[..h * d]);
        k.extend_from_slice(&row[h * d..(h + kv) * d]);
        v.extend_from_slice(&row[(h + kv) * d..]);
    }
    (q, k, v)
}

/// A paged cache of `kv` heads of `d` holding sequences of `lens`, full.
fn grown_cache(
    gpu: &Gpu,
    lens: &[usize],
    page: usize,
    kv: usize,
    d: usize,
) -> Result<(PagedKvCache, Vec<SeqId>), String> {
    let mut cache = PagedKvCache::new(gpu, lens.iter().map(|l| l.div_ceil(page)).sum(), page, kv, d).map_err(e)?;
    let seqs: Vec<SeqId> = lens.iter().map(|_| cache.add_sequence()).collect();
    cache.grow_all(&seqs, lens).map_err(e)?;
    Ok((cache, seqs))
}

/// `RopeTable::from_inv_freq` with Llama-3.1's (head dim 128, factor 8) and
/// Llama-3.2's (head dim 64, factor 32) scaled frequencies from
/// `ModelConfig::rope_inv_freq`, at positions up to past the original 8192-token
/// context, without and with a QKV bias: q, k and v against the f64 reference
/// rotated by the same frequencies, which plain θ misses by far.
fn rope_scaled(gpu: &Gpu) -> Result<(), String> {
    let mut rng = Rng(0x5CA1E);
    let (h, kv, page, theta) = (8, 2, 64, 500000.0);
    let lens = [9000usize, 3000];
    for (d, factor) in [(128usize, 8.0f64), (64, 32.0)] {
        let config = format!(
            r#"{{"model_type": "llama", "hidden_size": {}, "intermediate_size": 8192, "num_hidden_layers": 1,
                "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": {d}, "vocab_size": 100,
                "max_position_embeddings": 131072, "rope_theta": {theta:?},
                "rope_scaling": {{"rope_type": "llama3", "factor": {factor:?}, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#,
            16 * d
        );
        let inv_freq = ModelConfig::from_json(&config).map_err(e)?.rope_inv_freq();
        let table = RopeTable::from_inv_freq(gpu, d, &inv_freq, lens[0]).map_err(e)?;
        let (cache, seqs) = grown_cache(gpu, &lens, page, kv, d)?;
        let batch = cache.batch(gpu, &seqs).map_err(e)?;
        // The ends of the sequences and of the original context, then random slots.
        let mut slots: Vec<(u32, u32)> = vec![(0, 0), (0, 8191), (0, 8192), (0, 8999), (1, 2999)];
        while slots.len() < 48 {
            let s = rng.below(lens.len());
            let slot = (s as u32, rng.below(lens[s]) as u32);
            if !slots.contains(&slot) {
                slots.push(slot);
            }
        }
        let t = slots.len();
        let (seq, pos): (Vec<u32>, Vec<u32>) = slots.iter().copied().unzip();
        let positions: Vec<usize> = pos.iter().map(|&p| p as usize).collect();
        let width = (h + 2 * kv) * d;
        for with_bias in [false, true] {
            let seed = 5000 + d as u64 + with_bias as u64;
            let qkv = rand_bf16(seed, t * width);
            let bias = with_bias.then(|| rand_bf16(seed + 100, width));
            let bias_t = bias.as_ref().map(|b| Tensor::from_host(gpu, b, &[width])).transpose().map_err(e)?;
            let qkv_t = Tensor::from_host(gpu, &qkv, &[t, width]).map_err(e)?;
            let mut q_out = Tensor::<bf16>::filled(gpu, &[t, h, d], bf16::NAN).map_err(e)?;
            let mut k_out = Tensor::<bf16>::filled(gpu, &[t, kv, d], bf16::NAN).map_err(e)?;
            let mut v_out = Tensor::<bf16>::filled(gpu, &[t, kv, d], bf16::NAN).map_err(e)?;
            let kv_out = Some((&mut k_out, &mut v_out));
            rope_qkv_cache(gpu, &qkv_t, bias_t.as_ref(), &table, &cache, &batch, &seq, &pos, &mut q_out, kv_out)
                .map_err(e)?;
            let (mut q, mut k, v) = split_qkv(&to_f64(&qkv), bias.as_deref(), h, kv, d);
            let mut q_plain = q.clone();
            rope_with_inv_freq(&mut q, h, d, &positions, &inv_freq);
            rope_with_inv_freq(&mut k, kv, d, &positions, &inv_freq);
            rope(&mut q_plain, h, d, &positions, theta);
            let what = format!("head dim {d}, factor {factor}, bias {with_bias}");
            let (qg, kg, vg) =
                (q_out.to_host(gpu).map_err(e)?, k_out.to_host(gpu).map_err(e)?, v_out.to_host(gpu).map_err(e)?);
            expect_close(&format!("{what} q"), rel_l2_error(&to_f64(&qg), &q), 1e-2)?;
            expect_close(&format!("{what} k"), rel_l2_error(&to_f64(&kg), &k), 1e-2)?;
            expect_close(&format!("{what} v"), rel_l2_error(&to_f64(&vg), &v), 0.0)?;
            // The test tells the scaling apart from plain θ.
            let apart = rel_l2_error(&q_plain, &q);
            if apart < 0.1 {
                return Err(format!("{what}: scaled and plain rotations only {apart:.3e} apart"));
            }
        }
    }
    Ok(())
}

/// The decode step's fused path (`linear_rope_qkv_cache`), where the RoPE kernel
/// finishes the QKV GEMM's split-K sums, without and with a bias (added before
/// the sums' one rounding): against the f64 reference (projection plus bias
/// rounded once, then rotated), against the bf16 path (the GEMM, then
/// `rope_qkv_cache`: one rounding more), and run again (the first run must have
/// left the sums zero).
fn rope_split_sums(gpu: &Gpu) -> Result<(), String> {
    let (dm, h, kv, d, page, theta) = (4096, 32, 8, 128, 16, 500000.0);
    let width = (h + 2 * kv) * d;
    let w = cast::<bf16>(&random_with_outliers(6000, width * dm, 0.02));
    let (w_t, w) = (Tensor::from_host(gpu, &w, &[width, dm]).map_err(e)?, to_f64(&w));
    let lens = [37usize, 300, 5, 64];
    let (cache, seqs) = grown_cache(gpu, &lens, page, kv, d)?;
    let table = RopeTable::new(gpu, d, theta, 512).map_err(e)?;
    let tokens: &[usize] = if quick() { &[1] } else { &[1, 4] };
    for &t in tokens {
        // Decode: one token per sequence, at its last position.
        let batch = cache.batch(gpu, &seqs[..t]).map_err(e)?;
        let seq: Vec<u32> = (0..t as u32).collect();
        let pos: Vec<u32> = lens[..t].iter().map(|&l| l as u32 - 1).collect();
        let positions: Vec<usize> = pos.iter().map(|&p| p as usize).collect();
        for with_bias in [false, true] {
            let seed = 6100 + 10 * t as u64 + with_bias as u64;
            let x = rand_bf16(seed, t * dm);
            let x_t = Tensor::from_host(gpu, &x, &[t, dm]).map_err(e)?;
            let bias = with_bias.then(|| rand_bf16(seed + 5, width));
            let bias_t = bias.as_ref().map(|b| Tensor::from_host(gpu, b, &[width])).transpose().map_err(e)?;
            let what = format!("{t} tokens, bias {with_bias}");
            let outs = || -> Result<[Tensor<bf16>; 3], String> {
                Ok([
                    Tensor::<bf16>::filled(gpu, &[t, h, d], bf16::NAN).map_err(e)?,
                    Tensor::<bf16>::filled(gpu, &[t, kv, d], bf16::NAN).map_err(e)?,
                    Tensor::<bf16>::filled(gpu, &[t, kv, d], bf16::NAN).map_err(e)?,
                ])
            };
            let host = |o: &[Tensor<bf16>; 3]| -> Result<Vec<Vec<f64>>, String> {
                o.iter().map(|t| t.to_host(gpu).map(|v| to_f64(&v)).map_err(e)).collect()
            };
            let fused = |o: &mut [Tensor<bf16>; 3]| -> Result<(), String> {
                let mut qkv = Tensor::<bf16>::filled(gpu, &[t, width], bf16::NAN).map_err(e)?;
                let [q_out, k_out, v_out] = o;
                let kv_out = Some((k_out, v_out));
                let sums = linear_rope_qkv_cache(
                    gpu,
                    &x_t,
                    &w_t,
                    bias_t.as_ref(),
                    &mut qkv,
                    &table,
                    &cache,
                    &batch,
                    &seq,
                    &pos,
                    q_out,
                    kv_out,
                )
                .map_err(e)?;
                if sums {
                    Ok(())
                } else {
                    Err(format!("{what}: the QKV GEMM took no split-K sums here; pick a shape that does"))
                }
            };
            let mut first = outs()?;
            fused(&mut first)?;
            let got = host(&first)?;
            let (mut q, mut k, v) = split_qkv(&linear_ref(&to_f64(&x), &w, t, width, dm), bias.as_deref(), h, kv, d);
            rope(&mut q, h, d, &positions, theta);
            rope(&mut k, kv, d, &positions, theta);
            for (name, g, r) in [("q", &got[0], &q), ("k", &got[1], &k), ("v", &got[2], &v)] {
                expect_close(&format!("{what}: {name} against the reference"), rel_l2_error(g, r), 1e-2)?;
            }
            // The bf16 path: the projection rounded, then the bias added.
            let mut qkv = Tensor::<bf16>::filled(gpu, &[t, width], bf16::NAN).map_err(e)?;
            linear(gpu, &x_t, &w_t, &mut qkv).map_err(e)?;
            let mut plain = outs()?;
            let [q_out, k_out, v_out] = &mut plain;
            rope_qkv_cache(gpu, &qkv, bias_t.as_ref(), &table, &cache, &batch, &seq, &pos, q_out, Some((k_out, v_out)))
                .map_err(e)?;
            let plain = host(&plain)?;
            for (name, i) in [("q", 0), ("k", 1), ("v", 2)] {
                let err = rel_l2_error(&got[i], &plain[i]);
                expect_close(&format!("{what}: {name} against the bf16 path"), err, 1e-2)?;
            }
            let mut again = outs()?;
            fused(&mut again)?;
            let again = host(&again)?;
            for (name, i) in [("q", 0), ("k", 1), ("v", 2)] {
                expect_close(&format!("{what}: {name} of a second run"), rel_l2_error(&again[i], &got[i]), 1e-3)?;
            }
        }
    }
    Ok(())
}

/// The append and the RoPE + cache write refuse every bad argument with its
/// typed error before any launch, changing nothing.
fn bad_append_and_rope_input(gpu: &Gpu) -> Result<(), String> {
    let (kv, d) = (1, 64);
    let mut cache = PagedKvCache::new(gpu, 2, 16, kv, d).map_err(e)?;
    let (a, b) = (cache.add_sequence(), cache.add_sequence());
    let tok = rand_bf16(1, 16 * kv * d);
    cache.write(gpu, a, &tok, &tok).map_err(e)?;
    cache.write(gpu, b, &tok, &tok).map_err(e)?;
    let released = cache.add_sequence();
    cache.release(released).map_err(e)?;
    let row = |n: usize| Tensor::from_host(gpu, &rand_bf16(2, n * kv * d), &[n, kv, d]).map_err(e);
    let (k2, k1) = (row(2)?, row(1)?);
    let wide = Tensor::<bf16>::filled(gpu, &[2, kv, 2 * d], bf16::ONE).map_err(e)?;
    let free = cache.alloc().free_pages();
    let too_large: fn(&Error) -> bool = |x| matches!(x, Error::TooLarge(_));
    let shape: fn(&Error) -> bool = |x| matches!(x, Error::Shape(_));
    let invalid: fn(&Error) -> bool = |x| matches!(x, Error::InvalidArgument(_));
    type AppendCase<'a> = (&'a str, Vec<SeqId>, &'a Tensor<bf16>, &'a Tensor<bf16>, fn(&Error) -> bool);
    let append_cases: Vec<AppendCase> = vec![
        ("a full pool", vec![a, b], &k2, &k2, too_large),
        ("no sequences", vec![], &k1, &k1, invalid),
        ("a sequence twice", vec![a, a], &k2, &k2, invalid),
        ("a released sequence", vec![released], &k1, &k1, invalid),
        ("k rows for another batch", vec![a], &k2, &k1, shape),
        ("v of another head dim", vec![a, b], &k2, &wide, shape),
    ];
    for (what, seqs, k, v, expected) in append_cases {
        let launches = gpu.launch_count();
        match cache.append(gpu, &seqs, k, v) {
            Err(err) if expected(&err) => {}
            other => return Err(format!("append with {what}: {:?}", other.map(|_| ()))),
        }
        let lens = (cache.alloc().len(a).map_err(e)?, cache.alloc().len(b).map_err(e)?);
        if gpu.launch_count() != launches || lens != (16, 16) || cache.alloc().free_pages() != free {
            return Err(format!("append with {what}: refused, but launched or changed the cache"));
        }
    }

    let h = 2;
    let table = RopeTable::new(gpu, d, 10000.0, 20).map_err(e)?;
    let table128 = RopeTable::new(gpu, 128, 10000.0, 20).map_err(e)?;
    let small = RopeTable::new(gpu, d, 10000.0, 10).map_err(e)?;
    let batch = cache.batch(gpu, &[a, b]).map_err(e)?;
    let mut other = PagedKvCache::new(gpu, 2, 16, kv, d).map_err(e)?;
    let c = other.add_sequence();
    other.grow_all(&[c], &[16]).map_err(e)?;
    let foreign = other.batch(gpu, &[c]).map_err(e)?;
    let width = (h + 2 * kv) * d;
    let qkv = Tensor::<bf16>::filled(gpu, &[2, width], bf16::ONE).map_err(e)?;
    let qkv_short = Tensor::<bf16>::filled(gpu, &[2, width - d], bf16::ONE).map_err(e)?;
    let mut q_out = Tensor::<bf16>::filled(gpu, &[2, h, d], bf16::NAN).map_err(e)?;
    let mut q_bad = Tensor::<bf16>::filled(gpu, &[2, 3, d], bf16::NAN).map_err(e)?;
    let mut k_out = Tensor::<bf16>::filled(gpu, &[2, kv, d], bf16::NAN).map_err(e)?;
    let mut v_out = Tensor::<bf16>::filled(gpu, &[1, kv, d], bf16::NAN).map_err(e)?;
    let check = |what: &str, r: Result<(), Error>, expected: &dyn Fn(&Error) -> bool, launches: u64| match r {
        Err(err) if expected(&err) && gpu.launch_count() == launches => Ok(()),
        other => Err(format!("rope with {what}: {other:?} (launches {})", gpu.launch_count() - launches)),
    };
    let n = gpu.launch_count();
    let rope_with = |batch: &DecodeBatch, table: &RopeTable, seq: &[u32], pos: &[u32], q_out: &mut Tensor<bf16>| {
        rope_qkv_cache(gpu, &qkv, None, table, &cache, batch, seq, pos, q_out, None)
    };
    check(
        "a foreign batch",
        rope_with(&foreign, &table, &[0, 0], &[0, 1], &mut q_out),
        &|x| matches!(x, Error::ForeignBatch(_)),
        n,
    )?;
    check("a row past the batch", rope_with(&batch, &table, &[0, 2], &[0, 1], &mut q_out), &invalid, n)?;
    check("a position past its sequence", rope_with(&batch, &table, &[0, 1], &[0, 16], &mut q_out), &invalid, n)?;
    check("a position past the table", rope_with(&batch, &small, &[0, 1], &[0, 12], &mut q_out), &invalid, n)?;
    check("slots for 1 of 2 tokens", rope_with(&batch, &table, &[0], &[0], &mut q_out), &shape, n)?;
    check("rows and positions apart", rope_with(&batch, &table, &[0, 1], &[0], &mut q_out), &shape, n)?;
    check("q_out of 3 heads for a qkv of 2", rope_with(&batch, &table, &[0, 1], &[0, 1], &mut q_bad), &shape, n)?;
    check("a table of another head dim", rope_with(&batch, &table128, &[0, 1], &[0, 1], &mut q_out), &shape, n)?;
    let r = rope_qkv_cache(gpu, &qkv_short, None, &table, &cache, &batch, &[0, 1], &[0, 1], &mut q_out, None);
    check("a short qkv", r, &shape, n)?;
    let kv_out = Some((&mut k_out, &mut v_out));
    let r = rope_qkv_cache(gpu, &qkv, None, &table, &cache, &batch, &[0, 1], &[0, 1], &mut q_out, kv_out);
    check("v_out for 1 token", r, &shape, n)?;
    for (what, len) in [("a bias of a short row", width - d), ("a bias of a long row", width + 8)] {
        let bias = Tensor::<bf16>::filled(gpu, &[len], bf16::ONE).map_err(e)?;
        let n = gpu.launch_count();
        let r = rope_qkv_cache(gpu, &qkv, Some(&bias), &table, &cache, &batch, &[0, 1], &[0, 1], &mut q_out, None);
        check(what, r, &shape, n)?;
    }
    let bias2d = Tensor::<bf16>::filled(gpu, &[1, width], bf16::ONE).map_err(e)?;
    let n = gpu.launch_count();
    let r = rope_qkv_cache(gpu, &qkv, Some(&bias2d), &table, &cache, &batch, &[0, 1], &[0, 1], &mut q_out, None);
    check("a [1, width] bias", r, &shape, n)?;
    let half = d / 2;
    let mut freqs = vec![0.5; half];
    for (what, f, max_pos) in
        [("one frequency short", &freqs[1..], 20), ("no positions", &freqs[..], 0), ("an odd head dim", &freqs[..], 20)]
    {
        let hd = if what == "an odd head dim" { d + 1 } else { d };
        if !matches!(RopeTable::from_inv_freq(gpu, hd, f, max_pos), Err(Error::InvalidArgument(_))) {
            return Err(format!("RopeTable::from_inv_freq with {what} was not refused"));
        }
    }
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        freqs[3] = bad;
        if !matches!(RopeTable::from_inv_freq(gpu, d, &freqs, 20), Err(Error::InvalidArgument(_))) {
            return Err(format!("RopeTable::from_inv_freq with an inverse frequency {bad} was not refused"));
        }
    }
    rope_with(&batch, &table, &[0, 1], &[3, 15], &mut q_out).map_err(e)
}

fn main() {
    let mut t = GpuTests::new("decode");
    t.run("decode_random_shapes_against_reference", random_shapes);
    t.run("decode_paged_gqa_against_reference", against_reference);
    t.run("decode_split_counts_planned_long", split_counts);
    t.run("decode_one_split", one_split);
    t.run("decode_fused_repeats_and_graph_replays", fused_repeats);
    t.run("decode_cluster_merge", cluster_merge);
    t.run("decode_after_append_kernel", append_then_decode);
    t.run("decode_matches_prefill_last_row", matches_prefill);
    t.run("decode_speculative_q_len_up_to_8", speculative);
    t.run("decode_bad_input_launches_nothing", bad_decode_input);
    t.run("decode_foreign_batch_refused", foreign_batch);
    t.run("kv_append_random_batches", append_random);
    t.run("kv_gather_random_ranges", gather_random);
    t.run("kv_cache_fork_and_truncate", fork_and_truncate);
    t.run("rope_qkv_cache_random_against_reference", rope_random);
    t.run("rope_qkv_cache_llama3_scaled_frequencies", rope_scaled);
    t.run("rope_qkv_cache_finishes_split_sums_with_bias", rope_split_sums);
    t.run("kv_append_and_rope_bad_input_launch_nothing", bad_append_and_rope_input);
    t.finish();
}
