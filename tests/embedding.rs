//! GPU tests of the embedding lookup (bit-exact copies of table rows, zeros for
//! device-side ids past the table) and of the seeded normal fill (bit-exact
//! against the CPU's `normal_bf16`, which runs the same f32 operations).

use host::ops::embedding::check_ids;
use host::ops::random::{normal_bf16, OUTLIER_SCALE};
use host::ops::{
    embedding, embedding_device_ids, embedding_sampled, fill_random, fill_random_with_outliers, sample, SampleOutput,
    SamplingParams,
};
use host::{bf16, DType, Error, Gpu, Tensor};
use lab::testing::ShapeRng as Rng;
use lab::testing::{cast, quick, random_with_outliers, GpuTests};
use std::collections::hash_map::{Entry, HashMap};

fn e(e: Error) -> String {
    e.to_string()
}

fn poisoned(gpu: &Gpu, shape: &[usize]) -> Result<Tensor<bf16>, String> {
    Tensor::filled(gpu, shape, bf16::POISON).map_err(e)
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

// ---------------------------------------------------------------- embedding

/// A table on the GPU and how the CPU gets any of its rows: the host data for
/// small tables, the fill's reference for large ones (filled on the GPU, so
/// the CPU never generates or downloads a gigabyte).
struct Table {
    gpu: Tensor<bf16>,
    host: Option<Vec<bf16>>,
    seed: u64,
    d: usize,
}

/// Past this many elements a table is filled on the GPU.
const HOST_TABLE_MAX: usize = 1 << 22;
const TABLE_MEAN: f32 = 0.0;
const TABLE_STD: f32 = 0.02;

impl Table {
    fn new(gpu: &Gpu, vocab: usize, d: usize, seed: u64) -> Result<Table, String> {
        if vocab * d <= HOST_TABLE_MAX {
            let host: Vec<bf16> = cast(&random_with_outliers(seed, vocab * d, 1.0));
            Ok(Table { gpu: Tensor::from_host(gpu, &host, &[vocab, d]).map_err(e)?, host: Some(host), seed, d })
        } else {
            let mut t = poisoned(gpu, &[vocab, d])?;
            fill_random_with_outliers(gpu, &mut t, seed, TABLE_MEAN, TABLE_STD).map_err(e)?;
            Ok(Table { gpu: t, host: None, seed, d })
        }
    }

    fn row(&self, id: usize) -> Vec<u16> {
        let d = self.d;
        match &self.host {
            Some(h) => bits(&h[id * d..(id + 1) * d]),
            None => (0..d)
                .map(|c| normal_bf16(self.seed, (id * d + c) as u64, TABLE_MEAN, TABLE_STD, true).to_bits())
                .collect(),
        }
    }

    /// The expected output: each id's row, zeros past the table.
    fn gather(&self, ids: &[u32]) -> Vec<u16> {
        let vocab = self.gpu.shape()[0];
        ids.iter().flat_map(|&id| if (id as usize) < vocab { self.row(id as usize) } else { vec![0; self.d] }).collect()
    }
}

/// Rows that differ, as a readable message.
fn compare_rows(what: &str, got: &[bf16], want: &[u16], d: usize) -> Result<(), String> {
    let got = bits(got);
    let bad: Vec<usize> =
        (0..want.len() / d).filter(|&r| got[r * d..(r + 1) * d] != want[r * d..(r + 1) * d]).collect();
    if let Some(&r) = bad.first() {
        let c = (0..d).find(|&c| got[r * d + c] != want[r * d + c]).unwrap();
        return Err(format!(
            "{what}: {} of {} rows differ; row {r} column {c}: {:#06x}, expected {:#06x}",
            bad.len(),
            want.len() / d,
            got[r * d + c],
            want[r * d + c]
        ));
    }
    Ok(())
}

const NS: [usize; 10] = [1, 2, 3, 5, 7, 13, 31, 64, 127, 300];
const DS: [usize; 3] = [8, 64, 4096];
const VOCABS: [usize; 4] = [1, 7, 32000, 128256];

/// (n, vocab, d): every listed vocab × d first, then random ones.
fn shape(rng: &mut Rng, i: usize) -> (usize, usize, usize) {
    if i < VOCABS.len() * DS.len() {
        return (NS[i % NS.len()], VOCABS[i / DS.len()], DS[i % DS.len()]);
    }
    let d = if rng.below(2) == 0 { rng.pick(&DS) } else { 8 * (1 + rng.below(256)) };
    let n = if rng.below(2) == 0 { rng.pick(&NS) } else { 1 + rng.below(300) };
    (n, rng.pick(&VOCABS), d)
}

/// Ids with what the kernel must get right: the first and last rows, repeats.
fn random_ids(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| match (i, rng.below(8)) {
            (0, _) | (_, 0) => (vocab - 1) as u32,
            (1, _) | (_, 1) => 0,
            _ => rng.below(vocab) as u32,
        })
        .collect()
}

fn gather_random_shapes(gpu: &Gpu) -> Result<(), String> {
    let mut rng = Rng(0x5eed_e001);
    let cases = if quick() { 16 } else { 60 };
    let mut tables: HashMap<(usize, usize), Table> = HashMap::new();
    for i in 0..cases {
        let (n, vocab, d) = shape(&mut rng, i);
        // The sanitizer's run keeps to small tables.
        if quick() && vocab * d > 1 << 24 {
            continue;
        }
        let table = match tables.entry((vocab, d)) {
            Entry::Occupied(t) => t.into_mut(),
            Entry::Vacant(t) => t.insert(Table::new(gpu, vocab, d, rng.next_u64())?),
        };
        let ids = random_ids(&mut rng, n, vocab);
        let mut out = poisoned(gpu, &[n, d])?;
        embedding(gpu, &table.gpu, &ids, &mut out).map_err(e)?;
        let got = out.to_host(gpu).map_err(e)?;
        compare_rows(&format!("case {i}: {n} ids of [{vocab}, {d}]"), &got, &table.gather(&ids), d)?;
    }
    Ok(())
}

/// Ids past the table, wrong shapes and empty calls are refused before any
/// upload or launch, and the output keeps its poison.
fn refuses_bad_input(gpu: &Gpu) -> Result<(), String> {
    let table = Table::new(gpu, 7, 16, 1)?;
    let odd = Tensor::<bf16>::filled(gpu, &[7, 12], bf16::ZERO).map_err(e)?;
    let mut flat = Tensor::<bf16>::filled(gpu, &[7, 16], bf16::ZERO).map_err(e)?;
    flat.reshape(&[112]).map_err(e)?;
    let mut out = poisoned(gpu, &[3, 16])?;
    let mut out12 = poisoned(gpu, &[3, 12])?;
    let mut wide = poisoned(gpu, &[3, 32])?;
    let before = gpu.launch_count();
    let invalid = |r: host::Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
    let shape = |r: host::Result<()>| matches!(r, Err(Error::Shape(_)));
    let checks = [
        ("id = vocab", invalid(embedding(gpu, &table.gpu, &[0, 7, 1], &mut out))),
        ("id u32::MAX", invalid(embedding(gpu, &table.gpu, &[u32::MAX, 0, 1], &mut out))),
        ("two ids for three rows", shape(embedding(gpu, &table.gpu, &[0, 1], &mut out))),
        ("rows of 32 from a table of 16", shape(embedding(gpu, &table.gpu, &[0, 1, 2], &mut wide))),
        ("1-D table", shape(embedding(gpu, &flat, &[0, 1, 2], &mut out))),
        ("d 12", matches!(embedding(gpu, &odd, &[0, 1, 2], &mut out12), Err(Error::Alignment(_)))),
        ("no ids", matches!(embedding(gpu, &table.gpu, &[], &mut out), Err(Error::Empty(_)))),
        (
            "null device ids",
            // SAFETY: refused before any launch.
            matches!(unsafe { embedding_device_ids(gpu, &table.gpu, 0, 3, &mut out) }, Err(Error::Alignment(_))),
        ),
    ];
    if let Some((what, _)) = checks.iter().find(|c| !c.1) {
        return Err(format!("{what}: not refused with its error"));
    }
    if gpu.launch_count() != before {
        return Err(format!("{} launches on refused arguments", gpu.launch_count() - before));
    }
    if !out.to_host(gpu).map_err(e)?.iter().all(|x| x.is_nan()) {
        return Err("a refused call wrote its output".into());
    }
    check_ids(&[0, 6], 7).map_err(e)
}

/// Ids on the GPU are not checked by the host: past the table, a row of zeros.
fn device_ids_past_the_table_write_zeros(gpu: &Gpu) -> Result<(), String> {
    let (vocab, d) = (32000, 64);
    let table = Table::new(gpu, vocab, d, 7)?;
    let ids: Vec<u32> = vec![5, vocab as u32, 31999, u32::MAX, 0, vocab as u32 + 17, 12345, 1 << 31];
    let dev = cust::memory::DeviceBuffer::from_slice(&ids).map_err(|x| x.to_string())?;
    let mut out = poisoned(gpu, &[ids.len(), d])?;
    // SAFETY: `dev` holds ids.len() u32 and outlives the launch (to_host waits).
    unsafe { embedding_device_ids(gpu, &table.gpu, dev.as_device_ptr().as_raw(), ids.len(), &mut out) }.map_err(e)?;
    let got = out.to_host(gpu).map_err(e)?;
    compare_rows("device ids", &got, &table.gather(&ids), d)?;
    if (0..d).any(|c| got[d + c].to_bits() != 0) {
        return Err("id = vocab did not give +0 zeros".into());
    }
    Ok(())
}

/// The sampler's tokens feed the lookup on the GPU: rows of zeros before any
/// draw (tokens u32::MAX), then the argmax rows.
fn sampled_tokens_feed_the_lookup(gpu: &Gpu) -> Result<(), String> {
    let (vocab, d, batch) = (1000, 128, 5);
    let table = Table::new(gpu, vocab, d, 9)?;
    let mut tokens = SampleOutput::new(gpu, batch, false).map_err(e)?;
    let mut out = poisoned(gpu, &[batch, d])?;
    embedding_sampled(gpu, &table.gpu, &tokens, &mut out).map_err(e)?;
    compare_rows("before sampling", &out.to_host(gpu).map_err(e)?, &vec![0; batch * d], d)?;
    let want: Vec<u32> = vec![3, 999, 0, 3, 512];
    let mut logits = vec![0.0f32; batch * vocab];
    for (r, &t) in want.iter().enumerate() {
        logits[r * vocab + t as usize] = 5.0;
    }
    let x = Tensor::from_host(gpu, &logits, &[batch, vocab]).map_err(e)?;
    let mut out = poisoned(gpu, &[batch, d])?;
    sample(gpu, &x, &[SamplingParams::GREEDY; 5], &mut tokens).map_err(e)?;
    embedding_sampled(gpu, &table.gpu, &tokens, &mut out).map_err(e)?;
    compare_rows("sampled", &out.to_host(gpu).map_err(e)?, &table.gather(&want), d)
}

// ---------------------------------------------------------------- fill

fn fill(gpu: &Gpu, n: usize, seed: u64, mean: f32, std: f32, outliers: bool) -> Result<Vec<bf16>, String> {
    let mut t = poisoned(gpu, &[n])?;
    if outliers {
        fill_random_with_outliers(gpu, &mut t, seed, mean, std).map_err(e)?;
    } else {
        fill_random(gpu, &mut t, seed, mean, std).map_err(e)?;
    }
    t.to_host(gpu).map_err(e)
}

/// Every element bit for bit as the CPU computes it, at lengths around the
/// 8-element chunk (the partial last chunk) and past a million.
fn fill_matches_reference(gpu: &Gpu) -> Result<(), String> {
    let big = if quick() { 100_003 } else { (1 << 20) + 1 };
    let lens = [1usize, 2, 7, 8, 9, 15, 16, 17, 63, 65, 8 * 1237 + 1, 8 * 1237 + 7, big];
    let args = [(0.0f32, 1.0f32), (0.5, 0.02), (-3.0, 10.0), (1.0, 0.0)];
    for (i, &n) in lens.iter().enumerate() {
        let (mean, std) = args[i % args.len()];
        for outliers in [false, true] {
            let seed = 0x5eed_f000 + i as u64 * 0x1_0000_0001;
            let got = fill(gpu, n, seed, mean, std, outliers)?;
            let bad: Vec<usize> = (0..n)
                .filter(|&k| got[k].to_bits() != normal_bf16(seed, k as u64, mean, std, outliers).to_bits())
                .collect();
            if let Some(&k) = bad.first() {
                let want = normal_bf16(seed, k as u64, mean, std, outliers);
                return Err(format!(
                    "n {n} mean {mean} std {std} outliers {outliers}: {} of {n} differ; element {k}: {} ({:#06x}), \
                     expected {want} ({:#06x})",
                    bad.len(),
                    got[k],
                    got[k].to_bits(),
                    want.to_bits()
                ));
            }
        }
    }
    Ok(())
}

/// The same seed gives the same bits, whatever the length; another seed others.
fn fill_is_deterministic(gpu: &Gpu) -> Result<(), String> {
    let n = 100_001;
    let a = bits(&fill(gpu, n, 42, 0.0, 1.0, true)?);
    let b = bits(&fill(gpu, n, 42, 0.0, 1.0, true)?);
    let short = bits(&fill(gpu, 37, 42, 0.0, 1.0, true)?);
    let other = bits(&fill(gpu, n, 43, 0.0, 1.0, true)?);
    if a != b {
        return Err("two fills with one seed differ".into());
    }
    if short[..] != a[..37] {
        return Err("a shorter fill is not the longer one's prefix".into());
    }
    let same = a.iter().zip(&other).filter(|(x, y)| x == y).count();
    // Two independent normals land on one bf16 value about 1% of the time.
    if same * 20 > n {
        return Err(format!("seeds 42 and 43 agree on {same} of {n} elements"));
    }
    Ok(())
}

/// Mean and standard deviation within 5 standard errors over about a million
/// elements; with outliers, the wider variance and the outliers' share.
fn fill_statistics(gpu: &Gpu) -> Result<(), String> {
    let n = (1 << 20) + 3;
    let (mean, std) = (0.25f32, 1.5f32);
    for outliers in [false, true] {
        let x: Vec<f64> = fill(gpu, n, 7, mean, std, outliers)?.iter().map(|v| v.to_f64()).collect();
        let nf = n as f64;
        let m = x.iter().sum::<f64>() / nf;
        let var = x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (nf - 1.0);
        let p = 1.0 / 1024.0;
        let scale2 = (OUTLIER_SCALE as f64).powi(2);
        // Var(z) and E[z⁴] of the (possibly) scaled normal.
        let (vz, ez4) =
            if outliers { (1.0 + p * (scale2 - 1.0), 3.0 * (1.0 + p * (scale2 * scale2 - 1.0))) } else { (1.0, 3.0) };
        let s2 = (std as f64).powi(2);
        let se_mean = (s2 * vz / nf).sqrt();
        let se_var = s2 * ((ez4 - vz * vz) / nf).sqrt();
        if (m - mean as f64).abs() > 5.0 * se_mean {
            return Err(format!("outliers {outliers}: mean {m}, expected {mean} ± {se_mean:.2e}"));
        }
        if (var - s2 * vz).abs() > 5.0 * se_var {
            return Err(format!("outliers {outliers}: variance {var}, expected {} ± {se_var:.2e}", s2 * vz));
        }
        // Past 6σ: none of a normal's (2·10⁻⁹), 45% of the outliers' (|8z| > 6).
        let far = x.iter().filter(|&&v| (v - mean as f64).abs() > 6.0 * std as f64).count() as f64;
        let want_far = if outliers { nf * p * 0.453_255 } else { 0.0 };
        if (far - want_far).abs() > 5.0 * want_far.sqrt() + 2.0 {
            return Err(format!("outliers {outliers}: {far} elements past 6σ, expected {want_far:.0}"));
        }
    }
    Ok(())
}

/// The largest tensor of an 8B model (128256 × 4096): timed, and spot-checked.
fn fill_is_fast(gpu: &Gpu) -> Result<(), String> {
    let n = if quick() { 1 << 24 } else { 128256 * 4096 };
    let mut t = poisoned(gpu, &[n])?;
    fill_random(gpu, &mut t, 1, 0.0, 0.02).map_err(e)?;
    let ms = gpu.time_ms(|| fill_random(gpu, &mut t, 2, 0.0, 0.02)).map_err(e)?;
    let gbs = (n * 2) as f64 / (ms as f64 * 1e6);
    println!("    {n} elements in {ms:.3} ms: {gbs:.0} GB/s written");
    let got = t.to_host(gpu).map_err(e)?;
    for k in [0, 1, 7, n / 3, n - 9, n - 1] {
        if got[k].to_bits() != normal_bf16(2, k as u64, 0.0, 0.02, false).to_bits() {
            return Err(format!("element {k} differs from the reference"));
        }
    }
    // 16 GB (an 8B model) at this rate must take well under a few seconds.
    if !quick() && gbs < 100.0 {
        return Err(format!("{gbs:.0} GB/s: 16 GB would take {:.1} s", 16.0 / gbs));
    }
    Ok(())
}

/// Refused fills launch nothing and leave the output as it was.
fn fill_refuses_bad_input(gpu: &Gpu) -> Result<(), String> {
    let mut t = poisoned(gpu, &[5, 3])?;
    let before = gpu.launch_count();
    let invalid = |r: host::Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
    let checks = [
        ("NaN mean", invalid(fill_random(gpu, &mut t, 1, f32::NAN, 1.0))),
        ("infinite std", invalid(fill_random(gpu, &mut t, 1, 0.0, f32::INFINITY))),
        ("infinite mean", invalid(fill_random_with_outliers(gpu, &mut t, 1, f32::NEG_INFINITY, 1.0))),
    ];
    if let Some((what, _)) = checks.iter().find(|c| !c.1) {
        return Err(format!("{what}: not refused with its error"));
    }
    if gpu.launch_count() != before || !t.to_host(gpu).map_err(e)?.iter().all(|x| x.is_nan()) {
        return Err("a refused fill launched or wrote".into());
    }
    Ok(())
}

/// The shape list covers what it promises (also without a GPU).
fn check_shapes() {
    let mut rng = Rng(1);
    let shapes: Vec<_> = (0..60).map(|i| shape(&mut rng, i)).collect();
    for v in VOCABS {
        for d in DS {
            assert!(shapes.iter().any(|s| s.1 == v && s.2 == d), "vocab {v} d {d}");
        }
    }
    assert!(shapes.iter().all(|&(n, v, d)| (1..=300).contains(&n) && v >= 1 && d % 8 == 0));
    let ids = random_ids(&mut rng, 300, 7);
    assert!(ids.iter().all(|&i| i < 7) && ids.contains(&0) && ids.contains(&6));
}

fn main() {
    check_shapes();
    let mut t = GpuTests::new("embedding");
    t.run("embedding_random_shapes", gather_random_shapes);
    t.run("embedding_bad_input_fails_before_launch", refuses_bad_input);
    t.run("embedding_device_ids_past_the_table_write_zeros", device_ids_past_the_table_write_zeros);
    t.run("embedding_sampled_tokens", sampled_tokens_feed_the_lookup);
    t.run("fill_random_matches_reference", fill_matches_reference);
    t.run("fill_random_is_deterministic", fill_is_deterministic);
    t.run("fill_random_statistics", fill_statistics);
    t.run("fill_random_is_fast", fill_is_fast);
    t.run("fill_random_bad_input_fails_before_launch", fill_refuses_bad_input);
    t.finish();
}
