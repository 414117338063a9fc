//! GPU tests of split-KV decode attention over the paged KV cache, for both
//! merge versions (a second kernel, and the fused last-block merge).

use host::ops::decode::{BatchBuffers, DecodeBatch, MAX_Q_LEN};
use host::ops::{
    decode_attention_with, flash_attention, AttentionOptions, DecodeVersion, PagedKvCache, SeqId, VarlenBatch,
};
use host::reference::attention;
use host::{bf16, Error, Gpu, Tensor};
use lab::testing::{cast, expect_close, quick, random_with_outliers, rel_l2_error, to_f64, GpuTests};

fn e(err: Error) -> String {
    err.to_string()
}

const VERSIONS: [DecodeVersion; 5] =
    [DecodeVersion::TwoLaunch, DecodeVersion::Fused, DecodeVersion::Wide, DecodeVersion::Cluster, DecodeVersion::Wide8];

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
    let pages: usize = lens.iter().map(|l| l.div_ceil(page)).sum::<usize>() + 3;
    let mut cache = PagedKvCache::new(gpu, pages, page, kv, d).map_err(e)?;
    let (mut seqs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
    for (i, &len) in lens.iter().enumerate() {
        let k = rand_bf16(seed + 2 * i as u64, len * kv * d);
        let v = rand_bf16(seed + 2 * i as u64 + 1, len * kv * d);
        let s = cache.alloc.add_sequence();
        let keep = (len - hold_back) * kv * d;
        cache.write(gpu, s, &k[..keep], &v[..keep]).map_err(e)?;
        seqs.push(s);
        ks.push(k);
        vs.push(v);
    }
    Ok(Setup { cache, seqs, k: ks, v: vs })
}

/// Page tables for `st`'s sequences: planned for their longest (None), or for
/// `plan_len` tokens (more splits, the extra ones empty), as a captured graph
/// does; then the batch reads the returned buffers, which must outlive it.
fn batch_for(gpu: &Gpu, st: &Setup, plan_len: Option<usize>) -> Result<(DecodeBatch, Option<BatchBuffers>), String> {
    let Some(plan) = plan_len else {
        return Ok((st.cache.batch(gpu, &st.seqs).map_err(e)?, None));
    };
    let page = st.cache.alloc.page_size();
    let lens = st.seqs.iter().map(|&s| st.cache.alloc.len(s)).collect::<Result<Vec<_>, _>>().map_err(e)?;
    let pages = lens.iter().map(|l| l.div_ceil(page)).max().unwrap_or(0).max(1);
    let bufs = BatchBuffers::new(st.seqs.len(), pages).map_err(e)?;
    let batch = st.cache.batch_into(gpu, &st.seqs, &bufs, plan).map_err(e)?;
    Ok((batch, Some(bufs)))
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
/// exactly −∞ (a relative error would be NaN there); NaN poison left anywhere fails.
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
    expect_close(&format!("{what} LSE"), rel_l2_error(&got, &want), 1e-3)
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
    let (batch, _bufs) = batch_for(gpu, st, plan_len)?;
    let qt = Tensor::from_host(gpu, q, &[lens.len(), h, d]).map_err(e)?;
    let (out, lse) = run_decode(gpu, st, &batch, &qt, version)?;
    check(&format!("{what} {version:?}"), &out, &lse, &reference(st, lens, q, 1, h, kv, d))
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

/// The fused kernels' split counters (`Fused`, `Wide`) are left zero: calls in a row on the same
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
    let (batch, _) = batch_for(gpu, &st, None)?;
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
        gpu.launch_graph(&graph).map_err(e)?;
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

fn bad_input(gpu: &Gpu) -> Result<(), String> {
    let mut cache = PagedKvCache::new(gpu, 2, 16, 1, 64).map_err(e)?;
    let (a, b) = (cache.alloc.add_sequence(), cache.alloc.add_sequence());
    let tok = rand_bf16(1, 16 * 64);
    cache.write(gpu, a, &tok, &tok).map_err(e)?;
    cache.write(gpu, b, &tok, &tok).map_err(e)?;
    // The pool is full: appending to both must fail and change nothing.
    let kn = Tensor::from_host(gpu, &rand_bf16(2, 2 * 64), &[2, 1, 64]).map_err(e)?;
    if !matches!(cache.append(gpu, &[a, b], &kn, &kn), Err(Error::TooLarge(_))) {
        return Err("append into a full pool did not fail".into());
    }
    if cache.alloc.len(a).map_err(e)? != 16 || cache.alloc.len(b).map_err(e)? != 16 {
        return Err("a failed append changed sequence lengths".into());
    }
    // More new queries than the shortest sequence holds, or than MAX_Q_LEN;
    // refused before anything is launched.
    let batch = cache.batch(gpu, &[a]).map_err(e)?;
    for version in VERSIONS {
        for q_len in [17, MAX_Q_LEN + 1] {
            let q = Tensor::<bf16>::filled(gpu, &[1, q_len, 4, 64], bf16::ONE).map_err(e)?;
            let mut out = Tensor::<bf16>::filled(gpu, &[1, q_len, 4, 64], bf16::NAN).map_err(e)?;
            let mut lse = Tensor::<f32>::filled(gpu, &[1, q_len, 4], f32::NAN).map_err(e)?;
            let launches = gpu.launch_count();
            if !matches!(
                decode_attention_with(gpu, &cache, &batch, &q, None, &mut out, &mut lse, version),
                Err(Error::InvalidArgument(_))
            ) {
                return Err(format!("{version:?}: {q_len} new queries on a 16-token sequence were not refused"));
            }
            if gpu.launch_count() != launches {
                return Err(format!("{version:?}: a refused call launched a kernel"));
            }
        }
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

fn main() {
    let mut t = GpuTests::new("decode");
    t.run("decode_paged_gqa_against_reference", against_reference);
    t.run("decode_split_counts_planned_long", split_counts);
    t.run("decode_one_split", one_split);
    t.run("decode_fused_repeats_and_graph_replays", fused_repeats);
    t.run("decode_cluster_merge", cluster_merge);
    t.run("decode_after_append_kernel", append_then_decode);
    t.run("decode_matches_prefill_last_row", matches_prefill);
    t.run("decode_speculative_q_len_up_to_8", speculative);
    t.run("decode_bad_input_and_full_pool", bad_input);
    t.finish();
}
