//! CPU references with f64 accumulation, shared by tests, examples and benches.
//! They define the semantics the kernels must match, edge cases included.

use half::bf16;

/// Row softmax over `cols`-long rows. All -inf row → zeros; +inf entries share the
/// mass equally; a NaN makes its whole row NaN.
pub fn softmax_rows(x: &[f64], cols: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(cols) {
        if row.iter().any(|v| v.is_nan()) {
            out.extend(std::iter::repeat_n(f64::NAN, row.len()));
            continue;
        }
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            out.extend(std::iter::repeat_n(0.0, row.len()));
            continue;
        }
        let e: Vec<f64> = row.iter().map(|&v| if v == m { 1.0 } else { (v - m).exp() }).collect();
        let s: f64 = e.iter().sum();
        out.extend(e.iter().map(|v| v / s));
    }
    out
}

/// Rounds to bf16 and back, as a bf16 store would.
pub fn round_bf16(v: f64) -> f64 {
    bf16::from_f64(v).to_f64()
}

/// RMSNorm of `cols`-long rows: y = s · (mean(s²) + eps)^-½ · w, where s = x, or
/// s = bf16(x + r) when a residual is given. Returns (y, s).
pub fn rms_norm_rows(x: &[f64], residual: Option<&[f64]>, weight: &[f64], eps: f64) -> (Vec<f64>, Vec<f64>) {
    let cols = weight.len();
    let s: Vec<f64> = match residual {
        Some(r) => x.iter().zip(r).map(|(a, b)| round_bf16(a + b)).collect(),
        None => x.to_vec(),
    };
    let mut y = Vec::with_capacity(s.len());
    for row in s.chunks(cols) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / cols as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        y.extend(row.iter().zip(weight).map(|(v, w)| v * inv * w));
    }
    (y, s)
}

/// Attention over a packed batch, f64, in the kernels' layouts: q `[total_q, h, d]`,
/// k/v `[total_k, h_kv, d]`; `q_lens`/`k_lens` per sequence. Causal masks align
/// bottom-right (query i sees keys j ≤ i + k_len − q_len). Returns
/// (o `[total_q, h, d]`, lse `[h, total_q]`, natural log; -inf for rows with no key).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    q_lens: &[usize],
    k_lens: &[usize],
    heads: usize,
    kv_heads: usize,
    d: usize,
    causal: bool,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let total_q: usize = q_lens.iter().sum();
    let group = heads / kv_heads;
    let per_head: Vec<(Vec<f64>, Vec<f64>)> = std::thread::scope(|scope| {
        let jobs: Vec<_> = (0..heads)
            .map(|h| {
                scope.spawn(move || {
                    let mut o = vec![0.0; total_q * d];
                    let mut lse = vec![f64::NEG_INFINITY; total_q];
                    let (mut q0, mut k0) = (0, 0);
                    for (&lq, &lk) in q_lens.iter().zip(k_lens) {
                        let diag = lk as isize - lq as isize;
                        let mut s = vec![0.0; lk];
                        for i in 0..lq {
                            let qi = &q[((q0 + i) * heads + h) * d..][..d];
                            let visible =
                                if causal { (i as isize + diag + 1).clamp(0, lk as isize) as usize } else { lk };
                            if visible == 0 {
                                continue;
                            }
                            let mut m = f64::NEG_INFINITY;
                            for (j, sj) in s.iter_mut().enumerate().take(visible) {
                                let kj = &k[((k0 + j) * kv_heads + h / group) * d..][..d];
                                *sj = scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                                m = m.max(*sj);
                            }
                            let mut l = 0.0;
                            let oi = &mut o[(q0 + i) * d..][..d];
                            for (j, &sj) in s.iter().enumerate().take(visible) {
                                let p = (sj - m).exp();
                                l += p;
                                let vj = &v[((k0 + j) * kv_heads + h / group) * d..][..d];
                                for (acc, &x) in oi.iter_mut().zip(vj) {
                                    *acc += p * x;
                                }
                            }
                            oi.iter_mut().for_each(|x| *x /= l);
                            lse[q0 + i] = m + l.ln();
                        }
                        q0 += lq;
                        k0 += lk;
                    }
                    (o, lse)
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let mut o = vec![0.0; total_q * heads * d];
    let mut lse = Vec::with_capacity(heads * total_q);
    for (h, (oh, lh)) in per_head.into_iter().enumerate() {
        for t in 0..total_q {
            o[(t * heads + h) * d..][..d].copy_from_slice(&oh[t * d..][..d]);
        }
        lse.extend(lh);
    }
    (o, lse)
}

/// x·wᵀ in f64 for x `[m, k]`, w `[n, k]`; rows spread over threads.
pub fn linear(x: &[f64], w: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    let threads = std::thread::available_parallelism().map(|t| t.get()).unwrap_or(4);
    let rows_per = m.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (chunk_idx, chunk) in out.chunks_mut(rows_per * n).enumerate() {
            scope.spawn(move || {
                for (r, row) in chunk.chunks_mut(n).enumerate() {
                    let xr = &x[(chunk_idx * rows_per + r) * k..][..k];
                    for (j, o) in row.iter_mut().enumerate() {
                        *o = xr.iter().zip(&w[j * k..(j + 1) * k]).map(|(a, b)| a * b).sum();
                    }
                }
            });
        }
    });
    out
}

pub fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// SiLU(x·W_gateᵀ) ⊙ (x·W_upᵀ), rounded to bf16 as the kernel stores it.
pub fn swiglu(x: &[f64], w_gate: &[f64], w_up: &[f64], m: usize, ff: usize, d: usize) -> Vec<f64> {
    let g = linear(x, w_gate, m, ff, d);
    let u = linear(x, w_up, m, ff, d);
    g.iter().zip(&u).map(|(&g, &u)| round_bf16(silu(g) * u)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one_and_handles_edges() {
        let y = softmax_rows(&[1.0, 2.0, 3.0, 1000.0, 1000.0, -1000.0], 3);
        assert!((y[..3].iter().sum::<f64>() - 1.0).abs() < 1e-15);
        assert!((y[2] - 3f64.exp() / (1f64.exp() + 2f64.exp() + 3f64.exp())).abs() < 1e-15);
        assert_eq!(&y[3..], &[0.5, 0.5, 0.0]);
        let inf = f64::INFINITY;
        assert_eq!(softmax_rows(&[-inf, -inf], 2), vec![0.0, 0.0]);
        assert_eq!(softmax_rows(&[inf, 1.0, inf], 3), vec![0.5, 0.0, 0.5]);
        assert!(softmax_rows(&[f64::NAN, 1.0, 2.0, 3.0], 2).iter().take(2).all(|v| v.is_nan()));
        assert!(!softmax_rows(&[f64::NAN, 1.0, 2.0, 3.0], 2)[2].is_nan());
    }

    #[test]
    fn rms_norm_matches_hand_computation() {
        let (y, s) = rms_norm_rows(&[3.0, 4.0], None, &[1.0, 2.0], 0.0);
        let rms = (12.5f64).sqrt();
        assert_eq!(s, vec![3.0, 4.0]);
        assert!((y[0] - 3.0 / rms).abs() < 1e-15 && (y[1] - 8.0 / rms).abs() < 1e-15);
        let (_, s) = rms_norm_rows(&[1.0, 2.0], Some(&[0.00390625, 1.0]), &[1.0, 1.0], 1e-5);
        // 1 + 2^-8 is not a bf16 (8 significant bits): the sum is rounded to even.
        assert_eq!(s, vec![1.0, 3.0]);
    }
}
