//! GPU tests of split-KV decode attention over the paged KV cache.

use host::ops::decode::MAX_Q_LEN;
use host::ops::{decode_attention, flash_attention, AttentionOptions, PagedKvCache, SeqId, VarlenBatch};
use host::reference::attention;
use host::testing::{cast, expect_close, quick, random_with_outliers, rel_l2_error, to_f64, GpuTests};
use host::{bf16, Error, Gpu, Tensor};

fn e(err: Error) -> String {
    err.to_string()
}

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
) -> Result<(), String> {
    let b = lens.len();
    let batch = st.cache.batch(gpu, &st.seqs).map_err(e)?;
    let qt = Tensor::from_host(gpu, q, &[b, h, d]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[b, h, d], bf16::NAN).map_err(e)?;
    let mut lse = Tensor::<f32>::filled(gpu, &[b, h], f32::NAN).map_err(e)?;
    decode_attention(gpu, &st.cache, &batch, &qt, None, &mut out, &mut lse).map_err(e)?;
    let k: Vec<f64> = st.k.iter().flat_map(|x| to_f64(x)).collect();
    let v: Vec<f64> = st.v.iter().flat_map(|x| to_f64(x)).collect();
    let scale = 1.0 / (d as f64).sqrt();
    let (o_ref, lse_ref) = attention(&to_f64(q), &k, &v, &vec![1; b], lens, h, kv, d, false, scale);
    let o = to_f64(&out.to_host(gpu).map_err(e)?);
    expect_close(&format!("{what} O"), rel_l2_error(&o, &o_ref), 1e-2)?;
    // LSE comes out [batch, heads]; the reference is [heads, batch].
    let lse_got = lse.to_host(gpu).map_err(e)?;
    let lse_t: Vec<f64> =
        (0..h).flat_map(|hh| (0..b).map(move |bb| (bb, hh))).map(|(bb, hh)| lse_got[bb * h + hh] as f64).collect();
    expect_close(&format!("{what} LSE"), rel_l2_error(&lse_t, &lse_ref), 1e-3)
}

fn configs() -> Vec<(usize, usize, usize)> {
    vec![(32, 8, 128), (8, 2, 64), (4, 4, 128)]
}

fn lens() -> Vec<usize> {
    if quick() {
        vec![1, 17, 100]
    } else {
        vec![1, 17, 100, 1000, 4097, 33000]
    }
}

fn against_reference(gpu: &Gpu) -> Result<(), String> {
    for (ci, &(h, kv, d)) in configs().iter().enumerate() {
        for page in [16, 64] {
            let lens = lens();
            let st = setup(gpu, &lens, page, kv, d, 0, 100 + ci as u64)?;
            let q = rand_bf16(7 + ci as u64, lens.len() * h * d);
            compare(gpu, &st, &lens, h, kv, d, &q, &format!("h{h}/{kv} d{d} page{page}"))?;
        }
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
    compare(gpu, &st, &lens, h, kv, d, &q, "append")
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
    let mut out = Tensor::<bf16>::filled(gpu, &[1, h, d], bf16::NAN).map_err(e)?;
    let mut lse = Tensor::<f32>::filled(gpu, &[1, h], f32::NAN).map_err(e)?;
    let db = st.cache.batch(gpu, &st.seqs).map_err(e)?;
    decode_attention(gpu, &st.cache, &db, &q_last, None, &mut out, &mut lse).map_err(e)?;
    expect_close(
        "decode vs prefill last row",
        rel_l2_error(&to_f64(&out.to_host(gpu).map_err(e)?), &prefill_last),
        1e-2,
    )
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
    // More new queries than the shortest sequence holds, or than MAX_Q_LEN.
    let batch = cache.batch(gpu, &[a]).map_err(e)?;
    for q_len in [17, MAX_Q_LEN + 1] {
        let q = Tensor::<bf16>::filled(gpu, &[1, q_len, 4, 64], bf16::ONE).map_err(e)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[1, q_len, 4, 64], bf16::NAN).map_err(e)?;
        let mut lse = Tensor::<f32>::filled(gpu, &[1, q_len, 4], f32::NAN).map_err(e)?;
        if !matches!(
            decode_attention(gpu, &cache, &batch, &q, None, &mut out, &mut lse),
            Err(Error::InvalidArgument(_))
        ) {
            return Err(format!("{q_len} new queries on a 16-token sequence were not refused"));
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
        let batch = st.cache.batch(gpu, &st.seqs).map_err(e)?;
        let qt = Tensor::from_host(gpu, &q, &[b, q_len, h, d]).map_err(e)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[b, q_len, h, d], bf16::NAN).map_err(e)?;
        let mut lse = Tensor::<f32>::filled(gpu, &[b, q_len, h], f32::NAN).map_err(e)?;
        decode_attention(gpu, &st.cache, &batch, &qt, None, &mut out, &mut lse).map_err(e)?;
        let k: Vec<f64> = st.k.iter().flat_map(|x| to_f64(x)).collect();
        let v: Vec<f64> = st.v.iter().flat_map(|x| to_f64(x)).collect();
        let scale = 1.0 / (d as f64).sqrt();
        let (o_ref, lse_ref) = attention(&to_f64(&q), &k, &v, &vec![q_len; b], &lens, h, kv, d, true, scale);
        let what = format!("speculative q_len {q_len} h{h}/{kv} d{d} page{page}");
        expect_close(&format!("{what} O"), rel_l2_error(&to_f64(&out.to_host(gpu).map_err(e)?), &o_ref), 1e-2)?;
        // Ours: [batch·q_len, heads]; the reference: [heads, batch·q_len].
        let got = lse.to_host(gpu).map_err(e)?;
        let rows = b * q_len;
        let got_t: Vec<f64> =
            (0..h).flat_map(|hh| (0..rows).map(move |r| (r, hh))).map(|(r, hh)| got[r * h + hh] as f64).collect();
        expect_close(&format!("{what} LSE"), rel_l2_error(&got_t, &lse_ref), 1e-3)?;
    }
    Ok(())
}

fn main() {
    let mut t = GpuTests::new("decode");
    t.run("decode_paged_gqa_against_reference", against_reference);
    t.run("decode_after_append_kernel", append_then_decode);
    t.run("decode_matches_prefill_last_row", matches_prefill);
    t.run("decode_speculative_q_len_up_to_8", speculative);
    t.run("decode_bad_input_and_full_pool", bad_input);
    t.finish();
}
