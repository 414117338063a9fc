//! GPU tests of FlashAttention forward against the f64 CPU reference.

use host::ops::{flash_attention, flash_attention_with, AttentionOptions, FlashVersion, VarlenBatch};
use host::reference::attention;
use host::{bf16, Arch, Error, Gpu, Tensor};
use lab::testing::{cast, expect_close, quick, random_with_outliers, rel_l2_error, to_f64, GpuTests};

struct Case {
    q_lens: Vec<usize>,
    k_lens: Vec<usize>,
    heads: usize,
    kv_heads: usize,
    d: usize,
    causal: bool,
}

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

fn check(gpu: &Gpu, c: &Case, version: FlashVersion, seed: u64) -> Result<(), String> {
    let e = |e: Error| e.to_string();
    let (tq, tk) = (c.q_lens.iter().sum::<usize>(), c.k_lens.iter().sum::<usize>());
    let q: Vec<bf16> = cast(&random_with_outliers(seed, tq * c.heads * c.d, 1.0));
    let k: Vec<bf16> = cast(&random_with_outliers(seed + 1, tk * c.kv_heads * c.d, 1.0));
    let v: Vec<bf16> = cast(&random_with_outliers(seed + 2, tk * c.kv_heads * c.d, 1.0));
    let batch = VarlenBatch::new(gpu, &c.q_lens, &c.k_lens).map_err(e)?;
    let qt = Tensor::from_host(gpu, &q, &[tq, c.heads, c.d]).map_err(e)?;
    let kt = Tensor::from_host(gpu, &k, &[tk, c.kv_heads, c.d]).map_err(e)?;
    let vt = Tensor::from_host(gpu, &v, &[tk, c.kv_heads, c.d]).map_err(e)?;
    let mut ot = Tensor::<bf16>::filled(gpu, &[tq, c.heads, c.d], bf16::NAN).map_err(e)?;
    let mut lt = Tensor::<f32>::filled(gpu, &[c.heads, tq], f32::NAN).map_err(e)?;
    let opts = AttentionOptions { causal: c.causal, scale: None };
    flash_attention_with(gpu, &qt, &kt, &vt, &batch, opts, &mut ot, &mut lt, version).map_err(e)?;
    let scale = 1.0 / (c.d as f64).sqrt();
    let (o_ref, lse_ref) = attention(
        &to_f64(&q),
        &to_f64(&k),
        &to_f64(&v),
        &c.q_lens,
        &c.k_lens,
        c.heads,
        c.kv_heads,
        c.d,
        c.causal,
        scale,
    );
    let what = format!(
        "{version:?} q{:?} k{:?} h{}/{} d{} causal{}",
        c.q_lens, c.k_lens, c.heads, c.kv_heads, c.d, c.causal as u8
    );
    let o = to_f64(&ot.to_host(gpu).map_err(e)?);
    expect_close(&format!("{what} O"), rel_l2_error(&o, &o_ref), 1e-2)?;
    expect_close(&format!("{what} LSE"), lse_error(&lt.to_host(gpu).map_err(e)?, &lse_ref), 1e-3)
}

fn cases(d: usize) -> Vec<Case> {
    let mut out = Vec::new();
    let lens: Vec<Vec<usize>> =
        if quick() { vec![vec![1, 17, 100], vec![65]] } else { vec![vec![1, 17, 100, 1000], vec![4097]] };
    for causal in [false, true] {
        for (heads, kv_heads) in [(4, 4), (8, 2), (8, 1)] {
            for l in &lens {
                out.push(Case { q_lens: l.clone(), k_lens: l.clone(), heads, kv_heads, d, causal });
            }
        }
        // Fewer queries than keys (cached prefix): causal aligns bottom-right.
        out.push(Case { q_lens: vec![1, 17, 64], k_lens: vec![9, 40, 200], heads: 4, kv_heads: 2, d, causal });
        // More queries than keys: the first rows see nothing under causal.
        out.push(Case { q_lens: vec![70], k_lens: vec![5], heads: 2, kv_heads: 1, d, causal });
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

/// The experimental Hopper kernel (sm_90a only): the same cases; elsewhere it must
/// refuse cleanly.
fn hopper(d: usize) -> impl FnOnce(&Gpu) -> Result<(), String> {
    move |gpu| {
        if gpu.info().arch != Arch::Sm90a {
            let e = |e: Error| e.to_string();
            let batch = VarlenBatch::new(gpu, &[4], &[4]).map_err(e)?;
            let q = Tensor::<bf16>::filled(gpu, &[4, 2, d], bf16::ONE).map_err(e)?;
            let mut o = Tensor::<bf16>::filled(gpu, &[4, 2, d], bf16::NAN).map_err(e)?;
            let mut lse = Tensor::<f32>::filled(gpu, &[2, 4], f32::NAN).map_err(e)?;
            let opts = AttentionOptions::default();
            return match flash_attention_with(gpu, &q, &q, &q, &batch, opts, &mut o, &mut lse, FlashVersion::Hopper) {
                Err(Error::InvalidArgument(_)) => Ok(()),
                other => Err(format!("Hopper off sm_90a gave {other:?}")),
            };
        }
        run_cases(d, FlashVersion::Hopper)(gpu)
    }
}

fn bad_input(gpu: &Gpu) -> Result<(), String> {
    let e = |e: Error| e.to_string();
    let batch = VarlenBatch::new(gpu, &[4], &[4]).map_err(e)?;
    let q = Tensor::<bf16>::filled(gpu, &[4, 6, 64], bf16::ONE).map_err(e)?;
    let k = Tensor::<bf16>::filled(gpu, &[4, 4, 64], bf16::ONE).map_err(e)?;
    let mut o = Tensor::<bf16>::filled(gpu, &[4, 6, 64], bf16::NAN).map_err(e)?;
    let mut lse = Tensor::<f32>::filled(gpu, &[6, 4], f32::NAN).map_err(e)?;
    match flash_attention(gpu, &q, &k, &k, &batch, AttentionOptions::default(), &mut o, &mut lse) {
        Err(Error::Shape(_)) => Ok(()),
        other => Err(format!("6 heads over 4 KV heads gave {other:?}")),
    }
}

fn main() {
    let mut t = GpuTests::new("attention");
    t.run("flash_hd64_causal_noncausal_gqa_varlen", run_cases(64, FlashVersion::Auto));
    t.run("flash_hd128_causal_noncausal_gqa_varlen", run_cases(128, FlashVersion::Auto));
    t.run("flash_v1_hd64", run_cases(64, FlashVersion::V1));
    t.run("flash_v1_hd128", run_cases(128, FlashVersion::V1));
    t.run("flash_v2_bn64_hd128", run_cases(128, FlashVersion::V2));
    t.run("flash_v2_bn32_hd64", run_cases(64, FlashVersion::V2Bn32));
    t.run("flash_v2_bn16_hd128", run_cases(128, FlashVersion::V2Bn16));
    t.run("flash_bad_input_fails_before_launch", bad_input);
    // Last: the experimental kernel, so a fault there leaves the others reported.
    t.run("flash_hopper_hd64", hopper(64));
    t.run("flash_hopper_hd128", hopper(128));
    t.finish();
}
