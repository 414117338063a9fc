//! GPU tests of the tensor-core GEMM epilogues and the SwiGLU MLP against f64 references:
//! the shipped API on seeded random shapes, every dev version on ragged ones, and
//! every refused argument (before any launch).

use host::ops::gemm::{interleave_gate_up, plan_with, split_tail_stamps, SHAPES_OF_EVERY_CONFIGURATION};
use host::ops::{
    linear, linear_ex, linear_ex_with, linear_residual, linear_swiglu, linear_with, Epilogue, GemmVersion, MlpScratch,
    Overlap, SwiGluMlp,
};
use host::reference::{linear as linear_ref, rms_norm_rows, round_bf16, swiglu};
use host::{bf16, Arch, Error, Gpu, Tensor};
use lab::testing::ShapeRng;
use lab::testing::{cast, expect_close, quick, random_with_outliers, rel_l2_error, to_f64, tolerance, GpuTests};

fn e(err: Error) -> String {
    err.to_string()
}

fn rand_bf16(seed: u64, n: usize, scale: f32) -> Vec<bf16> {
    cast(&random_with_outliers(seed, n, scale))
}

/// Which API runs a GEMM: the shipped functions, or a dev version.
#[derive(Clone, Copy, Debug)]
enum Via {
    Shipped,
    Version(GemmVersion),
}

impl Via {
    fn run(
        self,
        gpu: &Gpu,
        x: &Tensor<bf16>,
        w: &Tensor<bf16>,
        residual: Option<&Tensor<bf16>>,
        out: &mut Tensor<bf16>,
        ep: Epilogue,
    ) -> Result<(), Error> {
        match (self, ep, residual) {
            (Via::Version(v), _, _) => linear_with(gpu, x, w, residual, out, ep, v),
            (Via::Shipped, Epilogue::Plain, None) => linear(gpu, x, w, out),
            (Via::Shipped, Epilogue::Residual, Some(r)) => linear_residual(gpu, x, w, r, out),
            (Via::Shipped, Epilogue::SwiGlu, None) => linear_swiglu(gpu, x, w, out),
            // SAFETY: no overlap, plain stream order.
            (Via::Shipped, _, _) => unsafe { linear_ex(gpu, x, w, residual, out, ep, Overlap::None) },
        }
    }
}

/// Plain, residual and SwiGLU epilogues of `[m, k] × [n, k]` into NaN-filled outputs,
/// each against the f64 reference.
fn check_gemm(gpu: &Gpu, m: usize, n: usize, k: usize, via: Via, seed: u64) -> Result<(), String> {
    let tol = tolerance::<bf16>();
    let x = rand_bf16(seed, m * k, 1.0);
    let w = rand_bf16(seed + 1, n * k, 0.05);
    let r = rand_bf16(seed + 2, m * n, 1.0);
    let (xt, wt, rt) = (
        Tensor::from_host(gpu, &x, &[m, k]).map_err(e)?,
        Tensor::from_host(gpu, &w, &[n, k]).map_err(e)?,
        Tensor::from_host(gpu, &r, &[m, n]).map_err(e)?,
    );
    let y_ref = linear_ref(&to_f64(&x), &to_f64(&w), m, n, k);
    let what = format!("{via:?} m{m} n{n} k{k}");

    let mut out = Tensor::<bf16>::filled(gpu, &[m, n], bf16::NAN).map_err(e)?;
    via.run(gpu, &xt, &wt, None, &mut out, Epilogue::Plain).map_err(e)?;
    expect_close(&format!("{what} plain"), rel_l2_error(&to_f64(&out.to_host(gpu).map_err(e)?), &y_ref), tol)?;

    out.fill(bf16::NAN).map_err(e)?;
    via.run(gpu, &xt, &wt, Some(&rt), &mut out, Epilogue::Residual).map_err(e)?;
    let res_ref: Vec<f64> = y_ref.iter().zip(to_f64(&r)).map(|(y, r)| y + r).collect();
    expect_close(&format!("{what} residual"), rel_l2_error(&to_f64(&out.to_host(gpu).map_err(e)?), &res_ref), tol)?;

    // SwiGLU: treat w as [gate; up] halves, interleave them, compare with the f64 form.
    let ff = n / 2;
    let (gate, up) = w.split_at(ff * k);
    let gu = interleave_gate_up(gate, up, k).map_err(e)?;
    let gut = Tensor::from_host(gpu, &gu, &[n, k]).map_err(e)?;
    let mut h = Tensor::<bf16>::filled(gpu, &[m, ff], bf16::NAN).map_err(e)?;
    via.run(gpu, &xt, &gut, None, &mut h, Epilogue::SwiGlu).map_err(e)?;
    let h_ref = swiglu(&to_f64(&x), &to_f64(gate), &to_f64(up), m, ff, k);
    expect_close(&format!("{what} swiglu"), rel_l2_error(&to_f64(&h.to_host(gpu).map_err(e)?), &h_ref), tol)
}

fn shapes() -> Vec<(usize, usize, usize)> {
    let mut s = vec![(1, 2, 8), (3, 100, 72), (17, 264, 136), (129, 4104, 200), (1, 4104, 4104)];
    if !quick() {
        s.extend([(2049, 256, 4096), (129, 4096, 14336), (17, 28672, 4096), (2049, 1026, 1032)]);
    }
    s
}

fn gemm_all(gpu: &Gpu) -> Result<(), String> {
    for (i, &(m, n, k)) in shapes().iter().enumerate() {
        check_gemm(gpu, m, n, k, Via::Shipped, 500 + 10 * i as u64)?;
    }
    Ok(())
}

/// Every mma.sync tile version (the Hopper-only ones are added where they run).
const MMA_SYNC_VERSIONS: [GemmVersion; 21] = {
    use GemmVersion::*;
    [
        V1,
        V2,
        V1SplitK,
        Skinny,
        SkinnySplitK,
        SkinnySplitKFixup,
        SkinnyStreamK,
        SkinnyStreamKPipelined,
        Skinny64StreamK,
        Skinny32StreamK,
        Gemv,
        Rows64,
        Rows64SplitK,
        SkinnyK128SplitK,
        SkinnyK128StreamK,
        SkinnyK128,
        SkinnyK128Fill,
        SkinnyK128SplitKFixup,
        SkinnyK128FillFixup,
        Skinny64,
        Skinny64SplitK,
    ]
};

/// The sm_90a-only versions.
const HOPPER_VERSIONS: [GemmVersion; 20] = {
    use GemmVersion::*;
    [
        WgmmaExperimental,
        Tma,
        TmaPersistent,
        TmaPersistentSplitK,
        TmaSplitTail,
        TmaPersistentN128,
        TmaPersistentN192,
        TmaPersistentN224,
        TmaSplitTailN192,
        TmaSplitTailStamped,
        TmaSplitTailN192Stamped,
        TmaSplitTailN192Waves,
        TmaSplitTailN192WavesStamped,
        TmaSplitTailWhole,
        TmaSplitTailN192Whole,
        TmaSplitTailGiveUp,
        TmaMulticast,
        TmaRows64,
        TmaRows64SplitK,
        TmaRows64Fill,
    ]
};

/// Whether this GPU gives a block the dynamic shared memory `v`'s tiles need (the
/// 128-deep `SkinnyK128*` tiles, 108 KB, do not fit the 99 KB of sm_86/89/120).
fn fits(gpu: &Gpu, v: GemmVersion) -> bool {
    let info = gpu.info();
    plan_with(&[1, 64], &[64, 64], &[1, 64], None, Epilogue::Plain, v, info.sm_count as usize, info.arch)
        // A version plan() refuses stays in, so the test reports it.
        .map_or(true, |p| p.smem <= info.max_shared_per_block_optin)
}

/// Every tile configuration on shapes with ragged M, N and K edges.
fn gemm_versions(gpu: &Gpu) -> Result<(), String> {
    let shapes: &[(usize, usize, usize)] =
        // (70, 264, 136): two 64-row tiles, the second ragged (and five 16-row ones).
        // (3, 264, 1160): 19 K tiles, so the split kernels really split, also under
        // the sanitizer's quick mode. (5, 65538, 72): 1026 stream-K iterations of
        // 2 K tiles over the resident blocks, so whole and partial tiles mix.
        if quick() {
            &[(17, 264, 136), (70, 264, 136), (3, 264, 1160), (5, 65538, 72)]
        } else {
            &[(17, 264, 136), (70, 264, 136), (129, 520, 1160), (3, 4096, 14336), (5, 65538, 72)]
        };
    let mut versions = MMA_SYNC_VERSIONS.to_vec();
    if gpu.info().arch == Arch::Sm90a {
        versions.extend(HOPPER_VERSIONS);
    }
    versions.retain(|&v| fits(gpu, v));
    for v in versions {
        for (i, &(m, n, k)) in shapes.iter().enumerate() {
            check_gemm(gpu, m, n, k, Via::Version(v), 700 + 10 * i as u64)?;
        }
    }
    Ok(())
}

/// The Hopper kernels on their own: tiny, ragged and many-tile shapes. Off Hopper
/// they must refuse cleanly.
fn gemm_hopper(gpu: &Gpu) -> Result<(), String> {
    if gpu.info().arch != Arch::Sm90a {
        let x = Tensor::<bf16>::filled(gpu, &[4, 64], bf16::ONE).map_err(e)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[4, 4], bf16::NAN).map_err(e)?;
        let w = Tensor::<bf16>::filled(gpu, &[4, 64], bf16::ONE).map_err(e)?;
        return match linear_with(gpu, &x, &w, None, &mut out, Epilogue::Plain, GemmVersion::Tma) {
            Err(Error::InvalidArgument(_)) => Ok(()),
            other => Err(format!("Tma off Hopper gave {other:?}")),
        };
    }
    let shapes: &[(usize, usize, usize)] = if quick() {
        &[
            (1, 2, 8),
            (130, 260, 200),
            (130, 520, 2048),
            (300, 4112, 136),
            (1100, 4100, 72),
            (1100, 7424, 576),
            (1025, 3840, 1032),
        ]
    } else {
        // 1100 × 4100: 153 tiles, more than the SMs, so persistent blocks take
        // several tiles and the ring's phases carry across tile boundaries.
        // The split tail takes them whole (6 K tiles are too few to slice).
        &[
            (1, 2, 8),
            (3, 100, 72),
            (128, 256, 64),
            (130, 260, 200),
            // 6 tiles of 32 K tiles: the split tails cut each in 4 slices and
            // sum them in shares, every epilogue.
            (130, 520, 2048),
            // N a multiple of 16 (the 16-byte stores, SwiGLU's too) ending in a
            // partial column tile; N = 260, 4100: a pair a store.
            (300, 4112, 136),
            (257, 1000, 4104),
            (1025, 2050, 1032),
            (1100, 4100, 328),
            // 261 tiles of 9 K tiles: the split tail takes a whole round, then
            // the other 129 tiles whole (a slice of 8 K tiles at least).
            (1100, 7424, 576),
            // 135 tiles of 17 K tiles: a whole round, then 3 tiles in 2 slices,
            // so a block goes from a whole tile to a slice in one ring.
            (1025, 3840, 1032),
        ]
    };
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        for v in [
            GemmVersion::Tma,
            GemmVersion::TmaPersistent,
            GemmVersion::TmaPersistentSplitK,
            GemmVersion::TmaSplitTail,
            GemmVersion::TmaPersistentN128,
            GemmVersion::TmaPersistentN192,
            GemmVersion::TmaPersistentN224,
            GemmVersion::TmaSplitTailN192,
            GemmVersion::TmaSplitTailN192Waves,
            GemmVersion::TmaSplitTailWhole,
            GemmVersion::TmaSplitTailN192Whole,
            GemmVersion::TmaSplitTailGiveUp,
            GemmVersion::TmaMulticast,
            GemmVersion::TmaRows64,
            GemmVersion::TmaRows64SplitK,
        ] {
            check_gemm(gpu, m, n, k, Via::Version(v), 300 + 10 * i as u64)?;
        }
    }
    Ok(())
}

/// The TMA-store epilogue (`TmaStore`) on ragged and many-tile shapes, every
/// epilogue: outputs clipped at the maps' edges, the staging reused across a
/// block's tiles, the residual loaded into it before the main loop ends (with
/// fewer K tiles than its lead, at the first); output rows that are not
/// 16-byte multiples refused before any launch. Off Hopper it must refuse
/// cleanly.
fn gemm_tma_store(gpu: &Gpu) -> Result<(), String> {
    let v = GemmVersion::TmaStore;
    let x = Tensor::<bf16>::filled(gpu, &[4, 64], bf16::ONE).map_err(e)?;
    let w = Tensor::<bf16>::filled(gpu, &[16, 64], bf16::ONE).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[4, 16], bf16::NAN).map_err(e)?;
    if gpu.info().arch != Arch::Sm90a {
        return match linear_with(gpu, &x, &w, None, &mut out, Epilogue::Plain, v) {
            Err(Error::InvalidArgument(_)) => Ok(()),
            other => Err(format!("TmaStore off Hopper gave {other:?}")),
        };
    }
    let launches = gpu.launch_count();
    let w24 = Tensor::<bf16>::filled(gpu, &[24, 64], bf16::ONE).map_err(e)?;
    let mut h12 = Tensor::<bf16>::filled(gpu, &[4, 12], bf16::NAN).map_err(e)?;
    let w12 = Tensor::<bf16>::filled(gpu, &[12, 64], bf16::ONE).map_err(e)?;
    let mut out12 = Tensor::<bf16>::filled(gpu, &[4, 12], bf16::NAN).map_err(e)?;
    let refused = [
        ("swiglu n = 24", linear_with(gpu, &x, &w24, None, &mut h12, Epilogue::SwiGlu, v)),
        ("n = 12", linear_with(gpu, &x, &w12, None, &mut out12, Epilogue::Plain, v)),
    ];
    for (what, got) in refused {
        if !matches!(got, Err(Error::Alignment(_))) {
            return Err(format!("TmaStore {what}: {got:?}"));
        }
    }
    if gpu.launch_count() != launches {
        return Err("TmaStore launched a refused call".into());
    }
    // N a multiple of 16 (SwiGLU's output rows 16-byte multiples too).
    let shapes: &[(usize, usize, usize)] = if quick() {
        &[(3, 112, 72), (130, 272, 200), (1100, 4112, 328)]
    } else {
        // 1100 × 4112: 153 tiles, so blocks store several tiles through one staging;
        // K = 4104: 65 K tiles, the residual loading 8 before the end.
        &[
            (1, 16, 8),
            (3, 112, 72),
            (128, 256, 64),
            (130, 272, 200),
            (300, 4112, 136),
            (257, 1008, 4104),
            (1100, 4112, 328),
        ]
    };
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        for launch in 0..2 {
            check_gemm(gpu, m, n, k, Via::Version(v), 900 + 10 * i as u64 + launch)?;
        }
    }
    // The same main loop and the same arithmetic a pair as the persistent
    // kernel's epilogue: the same bits, every epilogue; 153 tiles of 17 K
    // tiles, so blocks reuse their staging and the residual loads 8 K tiles
    // before the end, in both barrier phases.
    let (m, n, k) = (1100, 4112, 1032);
    let xt = Tensor::from_host(gpu, &rand_bf16(990, m * k, 1.0), &[m, k]).map_err(e)?;
    let wt = Tensor::from_host(gpu, &rand_bf16(991, n * k, 0.05), &[n, k]).map_err(e)?;
    let rt = Tensor::from_host(gpu, &rand_bf16(992, m * n, 1.0), &[m, n]).map_err(e)?;
    for ep in [Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu] {
        let cols = if ep == Epilogue::SwiGlu { n / 2 } else { n };
        let residual = (ep == Epilogue::Residual).then_some(&rt);
        let bits = |version| -> Result<Vec<u16>, String> {
            let mut out = Tensor::<bf16>::filled(gpu, &[m, cols], bf16::NAN).map_err(e)?;
            linear_with(gpu, &xt, &wt, residual, &mut out, ep, version).map_err(e)?;
            Ok(out.to_host(gpu).map_err(e)?.iter().map(|v| v.to_bits()).collect())
        };
        if bits(v)? != bits(GemmVersion::TmaPersistent)? {
            return Err(format!("TmaStore {ep:?}: not the persistent kernel's bits"));
        }
    }
    Ok(())
}

/// The split tail run again and again gives the same bits: which block finishes
/// a tile varies from run to run, and must not change the rounding. 128×256
/// tiles at 4 slices a tile (32 tiles of 224 K tiles on 132 SMs, summed in
/// shares; 3 on 114, summed whole), and 128×192 at 6 (22 tiles, in shares); on
/// two waves at 12, and the dev versions that sum whole tiles, whose finisher
/// loads 3 and 4 slots a round trip. Shares give the bits of the whole sums
/// (past two slices both sum every slot in block order), also where every
/// block gives up waiting and the last one in sums the shares left.
fn split_tail_reproducible(gpu: &Gpu) -> Result<(), String> {
    if gpu.info().arch != Arch::Sm90a {
        return Ok(());
    }
    let mut whole: Vec<(GemmVersion, Vec<u16>)> = Vec::new();
    for (m, v) in [
        (256, GemmVersion::TmaSplitTail),
        (128, GemmVersion::TmaSplitTailN192),
        (128, GemmVersion::TmaSplitTailN192Waves),
        (256, GemmVersion::TmaSplitTailWhole),
        (128, GemmVersion::TmaSplitTailN192Whole),
        (256, GemmVersion::TmaSplitTailGiveUp),
    ] {
        let (n, k) = (4096, 14336);
        let x = Tensor::from_host(gpu, &rand_bf16(41, m * k, 1.0), &[m, k]).map_err(e)?;
        let w = Tensor::from_host(gpu, &rand_bf16(42, n * k, 0.05), &[n, k]).map_err(e)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[m, n], bf16::NAN).map_err(e)?;
        let mut first: Option<Vec<u16>> = None;
        for run in 0..if quick() { 8 } else { 32 } {
            out.fill(bf16::NAN).map_err(e)?;
            linear_with(gpu, &x, &w, None, &mut out, Epilogue::Plain, v).map_err(e)?;
            let bits: Vec<u16> = out.to_host(gpu).map_err(e)?.iter().map(|v| v.to_bits()).collect();
            match &first {
                None => first = Some(bits),
                Some(f) => {
                    if let Some(i) = f.iter().zip(&bits).position(|(a, b)| a != b) {
                        return Err(format!(
                            "{v:?} run {run}: element {i} is {:#06x}, run 0 gave {:#06x}",
                            bits[i], f[i]
                        ));
                    }
                }
            }
        }
        let bits = first.expect("at least one run");
        let twin = match v {
            GemmVersion::TmaSplitTailWhole | GemmVersion::TmaSplitTailGiveUp => Some(GemmVersion::TmaSplitTail),
            GemmVersion::TmaSplitTailN192Whole => Some(GemmVersion::TmaSplitTailN192),
            _ => None,
        };
        if let Some((_, theirs)) = whole.iter().find(|(t, _)| Some(*t) == twin) {
            if let Some(i) = theirs.iter().zip(&bits).position(|(a, b)| a != b) {
                return Err(format!("{v:?}: element {i} is {:#06x}, {twin:?} gave {:#06x}", bits[i], theirs[i]));
            }
        }
        whole.push((v, bits));
    }
    Ok(())
}

/// The stamped split tails record a timeline per block that holds together:
/// every block with a unit starts, gets its first stage, ends its main loop and
/// finishes in that order, on an SM the GPU has; each split tile is summed by
/// exactly one block; and the product is still right.
fn split_tail_stamps_in_order(gpu: &Gpu) -> Result<(), String> {
    if gpu.info().arch != Arch::Sm90a {
        return Ok(());
    }
    // 32 tiles of 128×256 in 4 slices; 22 of 128×192 in 6, and in 12 on two waves.
    for (m, version, split_tiles) in [
        (256, GemmVersion::TmaSplitTailStamped, 32),
        (128, GemmVersion::TmaSplitTailN192Stamped, 22),
        (128, GemmVersion::TmaSplitTailN192WavesStamped, 22),
    ] {
        let (n, k) = (4096, 14336);
        let xh = rand_bf16(43, m * k, 1.0);
        let wh = rand_bf16(44, n * k, 0.05);
        let x = Tensor::from_host(gpu, &xh, &[m, k]).map_err(e)?;
        let w = Tensor::from_host(gpu, &wh, &[n, k]).map_err(e)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[m, n], bf16::NAN).map_err(e)?;
        let blocks = split_tail_stamps(gpu, &x, &w, None, &mut out, Epilogue::Plain, version).map_err(e)?;
        let sms = gpu.info().sm_count;
        for b in blocks.iter().filter(|b| b.units > 0) {
            let ordered = b.start <= b.first_data && b.first_data <= b.loop_end && b.loop_end <= b.done;
            if !ordered || b.sm >= sms || b.start == 0 {
                return Err(format!("m{m} {version:?}: block {b:?}"));
            }
        }
        let summed = blocks.iter().filter(|b| b.summed).count();
        if summed != split_tiles {
            return Err(format!("m{m} {version:?}: {summed} blocks summed a split tile, {split_tiles} tiles split"));
        }
        let y_ref = linear_ref(&to_f64(&xh), &to_f64(&wh), m, n, k);
        let err = rel_l2_error(&to_f64(&out.to_host(gpu).map_err(e)?), &y_ref);
        expect_close(&format!("stamped split tail m{m} {version:?}"), err, tolerance::<bf16>())?;
    }
    Ok(())
}

/// `SwiGluMlp::forward` on `t` tokens of a `d` → `ff` → `d` MLP (with its RMSNorm
/// where `norm`) into a NaN-filled output, against the f64 reference.
fn check_mlp(gpu: &Gpu, t: usize, d: usize, ff: usize, norm: bool, seed: u64) -> Result<(), String> {
    let x = rand_bf16(seed, t * d, 1.0);
    let (wg, wu, wd) =
        (rand_bf16(seed + 1, ff * d, 0.02), rand_bf16(seed + 2, ff * d, 0.02), rand_bf16(seed + 3, d * ff, 0.02));
    let gamma = rand_bf16(seed + 4, d, 1.0);
    let mlp = SwiGluMlp::new(gpu, d, ff, &wg, &wu, &wd, norm.then_some((&gamma[..], 1e-5))).map_err(e)?;
    let mut scratch = MlpScratch::new(gpu, &mlp, t).map_err(e)?;
    let xt = Tensor::from_host(gpu, &x, &[t, d]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[t, d], bf16::NAN).map_err(e)?;
    mlp.forward(gpu, &xt, &mut scratch, &mut out).map_err(e)?;
    let x64 = to_f64(&x);
    let input = if norm {
        let (normed, _) = rms_norm_rows(&x64, None, &to_f64(&gamma), 1e-5);
        normed.into_iter().map(round_bf16).collect()
    } else {
        x64.clone()
    };
    let h = swiglu(&input, &to_f64(&wg), &to_f64(&wu), t, ff, d);
    let down = linear_ref(&h, &to_f64(&wd), t, d, ff);
    let want: Vec<f64> = down.iter().zip(&x64).map(|(a, b)| a + b).collect();
    let got = to_f64(&out.to_host(gpu).map_err(e)?);
    let what = format!("mlp t{t} d{d} ff{ff}{}", if norm { " norm" } else { "" });
    expect_close(&what, rel_l2_error(&got, &want), tolerance::<bf16>())
}

fn mlp(gpu: &Gpu) -> Result<(), String> {
    let sizes: &[(usize, usize, usize)] =
        if quick() { &[(3, 64, 96)] } else { &[(1, 256, 688), (17, 256, 688), (129, 512, 1376), (3, 4096, 14336)] };
    for (i, &(t, d, ff)) in sizes.iter().enumerate() {
        check_mlp(gpu, t, d, ff, true, 900 + 10 * i as u64)?;
    }
    Ok(())
}

/// The random shapes: a seeded stream ([`ShapeRng`]) with GEMM's size rules.
struct Shapes(ShapeRng);

impl Shapes {
    /// One of `list`.
    fn pick(&mut self, list: &[usize]) -> usize {
        self.0.pick(list)
    }

    /// Log-uniform in `1..=hi`, so small sizes are as common as large ones.
    fn log_uniform(&mut self, hi: usize) -> usize {
        ((hi as f64).powf(self.0.unit()) as usize).clamp(1, hi)
    }

    /// A size up to `hi` in steps of `step`: a special size half the time.
    fn size(&mut self, special: &[usize], step: usize, hi: usize) -> usize {
        if self.0.next_u64().is_multiple_of(2) {
            self.pick(special)
        } else {
            self.log_uniform(hi / step) * step
        }
    }
}

/// Rows: 1, primes, and one past every row tile (16, 64, 128).
const SPECIAL_M: &[usize] = &[1, 2, 3, 5, 7, 13, 16, 17, 31, 63, 64, 65, 127, 128, 129, 257, 1021, 2053, 4093, 4096];
/// Output columns (even: stores go in pairs): one pair past the 128- and 256-wide tiles.
const SPECIAL_N: &[usize] = &[2, 4, 6, 30, 126, 128, 130, 254, 256, 258, 382, 514, 1030];
/// d_in (multiples of 8: 16-byte rows): one 16-byte chunk past the 64- and 128-deep K tiles.
const SPECIAL_K: &[usize] = &[8, 16, 24, 56, 64, 72, 120, 128, 136, 200, 1032];
/// Most multiply-adds per random shape, so the f64 references stay fast.
const MAX_MNK: usize = 1 << 25;

/// `count` seeded shapes for the shipped GEMM: the decode, prefill and ragged
/// sizes that pick each of its tile configurations (`plan`'s unit tests check
/// which), then random ones; only random ones under the sanitizer.
fn random_gemm_shapes(count: usize) -> Vec<(usize, usize, usize)> {
    let mut shapes = if quick() { Vec::new() } else { SHAPES_OF_EVERY_CONFIGURATION.to_vec() };
    let mut rng = Shapes(ShapeRng(0x6e6d_6d21));
    while shapes.len() < count {
        let m = rng.size(SPECIAL_M, 1, 4096);
        let (mut n, mut k) = (rng.size(SPECIAL_N, 2, 4096), rng.size(SPECIAL_K, 8, 4096));
        while m * n * k > MAX_MNK && (n > 2 || k > 8) {
            if n >= k && n > 2 {
                n = (n / 4).max(1) * 2;
            } else {
                k = (k / 16).max(1) * 8;
            }
        }
        shapes.push((m, n, k));
    }
    shapes
}

/// The shipped `linear`, `linear_residual` and `linear_swiglu` on 200 seeded
/// shapes (20 under the sanitizer).
fn gemm_random_shapes(gpu: &Gpu) -> Result<(), String> {
    let shapes = random_gemm_shapes(if quick() { 20 } else { 200 });
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        check_gemm(gpu, m, n, k, Via::Shipped, 2000 + 10 * i as u64)?;
    }
    Ok(())
}

/// `SwiGluMlp::forward` on seeded shapes, with and without its norm: tokens as
/// the GEMMs' rows, d and ff multiples of 8 (both are some GEMM's d_in).
fn mlp_random_shapes(gpu: &Gpu) -> Result<(), String> {
    let count = if quick() { 4 } else { 24 };
    let mut rng = Shapes(ShapeRng(0x6d6c_7021));
    for i in 0..count {
        let t = rng.size(&[1, 2, 16, 17, 64, 65, 129], 1, 512);
        let (mut d, mut ff) = (rng.size(&[8, 64, 72, 136], 8, 1024), rng.size(&[8, 64, 72, 136, 264], 8, 2048));
        while t * d * ff > MAX_MNK / 2 && (d > 8 || ff > 8) {
            if ff >= d {
                ff = (ff / 16).max(1) * 8;
            } else {
                d = (d / 16).max(1) * 8;
            }
        }
        check_mlp(gpu, t, d, ff, i % 2 == 0, 3000 + 10 * i as u64)?;
    }
    Ok(())
}

/// One pair of the overlapped chain: y1 poisoned, then y1 = x·w1ᵀ, then `out`
/// from y1 and `w` (with y1 as its residual too for `Epilogue::Residual`)
/// launched to overlap it, checked against `want`.
///
/// # Safety
/// As `linear_ex_with` with `Overlap::ResidentWeights`: no kernel writes `w`.
#[allow(clippy::too_many_arguments)]
unsafe fn chain_pair(
    gpu: &Gpu,
    (x, w1, y1): (&Tensor<bf16>, &Tensor<bf16>, &mut Tensor<bf16>),
    w: &Tensor<bf16>,
    ep: Epilogue,
    out: &mut Tensor<bf16>,
    v: GemmVersion,
    want: &[f64],
    what: &str,
) -> Result<(), String> {
    y1.fill(bf16::NAN).map_err(e)?;
    out.fill(bf16::NAN).map_err(e)?;
    linear(gpu, x, w1, y1).map_err(e)?;
    let residual = (ep == Epilogue::Residual).then_some(&*y1);
    linear_ex_with(gpu, y1, w, residual, out, ep, v, Overlap::ResidentWeights).map_err(e)?;
    expect_close(what, rel_l2_error(&to_f64(&out.to_host(gpu).map_err(e)?), want), 1e-2)
}

/// A GEMM launched to overlap the one before it (programmatic dependent launch on
/// Hopper) must read that one's output only once it is complete: y2 = (x·w1ᵀ)·w2ᵀ,
/// and z = (x·w1ᵀ)·w1ᵀ + x·w1ᵀ, whose residual is the previous kernel's output
/// too, every tile version. y1 is poisoned before each pair and every pair's
/// result is checked, so a read before the wait shows as NaN.
fn overlapped_chain(gpu: &Gpu) -> Result<(), String> {
    use GemmVersion::*;
    // On Hopper the overlap must really be on (the driver entry point was found).
    if gpu.info().arch == Arch::Sm90a && !gpu.programmatic_launch() {
        return Err("sm_90a without programmatic dependent launch (cuLaunchKernelEx not found)".into());
    }
    // Auto, then every mma.sync version, and on Hopper the TMA kernels that wait.
    let mut versions: Vec<GemmVersion> = std::iter::once(Auto).chain(MMA_SYNC_VERSIONS).collect();
    if gpu.info().arch == Arch::Sm90a {
        versions.extend([TmaRows64, TmaRows64SplitK, TmaRows64Fill]);
        versions.extend([TmaPersistent, TmaSplitTail, TmaPersistentN128, TmaSplitTailN192, TmaStore]);
    }
    // (300, 4112, 1160): 51 tiles of 128×256, each cut in two by the split tail.
    // (130, 520, 2048): 6 tiles for y2 and 16 for z, each in 4 slices summed in
    // shares, whose blocks wait for each other under the overlap.
    let shapes: &[(usize, usize, usize)] = if quick() {
        &[(3, 264, 1160), (300, 4112, 1160), (130, 520, 2048)]
    } else {
        &[(1, 4104, 4104), (17, 1032, 14336), (129, 4096, 1160), (300, 4112, 1160), (130, 520, 2048)]
    };
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        let seed = 1300 + 10 * i as u64;
        let x = Tensor::from_host(gpu, &rand_bf16(seed, m * k, 1.0), &[m, k]).map_err(e)?;
        let w1h = rand_bf16(seed + 1, k * k, 0.05);
        let w1 = Tensor::from_host(gpu, &w1h, &[k, k]).map_err(e)?;
        let w2h = rand_bf16(seed + 2, n * k, 0.05);
        let w2 = Tensor::from_host(gpu, &w2h, &[n, k]).map_err(e)?;
        let mut y1 = Tensor::<bf16>::filled(gpu, &[m, k], bf16::NAN).map_err(e)?;
        let mut y2 = Tensor::<bf16>::filled(gpu, &[m, n], bf16::NAN).map_err(e)?;
        let mut z = Tensor::<bf16>::filled(gpu, &[m, k], bf16::NAN).map_err(e)?;
        // y1 comes from Auto every time, the same bits: the references once a shape.
        linear(gpu, &x, &w1, &mut y1).map_err(e)?;
        let y1h = to_f64(&y1.to_host(gpu).map_err(e)?);
        let want_y2 = linear_ref(&y1h, &to_f64(&w2h), m, n, k);
        // The residual check where its reference (m·k² products) stays quick.
        let residual = m * k * k <= 1 << 30;
        let want_z: Vec<f64> = if residual {
            linear_ref(&y1h, &to_f64(&w1h), m, k, k).iter().zip(&y1h).map(|(a, b)| a + b).collect()
        } else {
            Vec::new()
        };
        for v in versions.iter().copied().filter(|&v| fits(gpu, v)) {
            // Several pairs back to back: the second GEMM of each pair may start
            // while the first still runs.
            for pair in 0..3 {
                let what = format!("overlapped {v:?} m{m} n{n} k{k} pair {pair}");
                // SAFETY: w2 is uploaded once, before the loop; no kernel writes it.
                unsafe { chain_pair(gpu, (&x, &w1, &mut y1), &w2, Epilogue::Plain, &mut y2, v, &want_y2, &what)? };
                if residual {
                    // SAFETY: w1 is uploaded once; the kernel before reads it, none writes it.
                    let what = format!("overlapped residual {v:?} m{m} k{k} pair {pair}");
                    unsafe { chain_pair(gpu, (&x, &w1, &mut y1), &w1, Epilogue::Residual, &mut z, v, &want_z, &what)? };
                }
            }
        }
    }
    Ok(())
}

/// `call` must fail with an error `is_expected` accepts, before any launch.
fn refused(
    gpu: &Gpu,
    what: &str,
    is_expected: fn(&Error) -> bool,
    call: impl FnOnce() -> Result<(), Error>,
) -> Result<(), String> {
    let before = gpu.launch_count();
    match call() {
        Err(err) if is_expected(&err) => {}
        other => return Err(format!("{what}: gave {other:?}")),
    }
    match gpu.launch_count() - before {
        0 => Ok(()),
        n => Err(format!("{what}: refused after {n} launches")),
    }
}

fn shape(err: &Error) -> bool {
    matches!(err, Error::Shape(_))
}

fn alignment(err: &Error) -> bool {
    matches!(err, Error::Alignment(_))
}

fn invalid(err: &Error) -> bool {
    matches!(err, Error::InvalidArgument(_))
}

fn too_large(err: &Error) -> bool {
    matches!(err, Error::TooLarge(_))
}

/// Every refused argument of every op returns its typed error before any launch;
/// a split-K GEMM afterwards still finds its workspace zeroed.
fn bad_input(gpu: &Gpu) -> Result<(), String> {
    let t = |shape: &[usize]| Tensor::<bf16>::filled(gpu, shape, bf16::ONE).map_err(e);
    let (x, w, r) = (t(&[4, 72])?, t(&[8, 72])?, t(&[4, 8])?);
    let (x70, w70, w_odd, x3) = (t(&[4, 70])?, t(&[8, 70])?, t(&[7, 72])?, t(&[4, 72, 1])?);
    let (mut out, mut out_wide, mut out_half) = (t(&[4, 8])?, t(&[4, 9])?, t(&[4, 4])?);
    let mut out_odd = t(&[4, 7])?;
    refused(gpu, "linear d_in 70", alignment, || linear(gpu, &x70, &w70, &mut out))?;
    refused(gpu, "linear odd d_out", alignment, || linear(gpu, &x, &w_odd, &mut out_odd))?;
    refused(gpu, "linear d_in mismatch", shape, || linear(gpu, &x70, &w, &mut out))?;
    refused(gpu, "linear 3-D x", shape, || linear(gpu, &x3, &w, &mut out))?;
    refused(gpu, "linear out shape", shape, || linear(gpu, &x, &w, &mut out_wide))?;
    refused(gpu, "linear_residual residual shape", shape, || linear_residual(gpu, &x, &w, &out_half, &mut out))?;
    refused(gpu, "linear_residual out shape", shape, || linear_residual(gpu, &x, &w, &r, &mut out_wide))?;
    refused(gpu, "linear_swiglu out [m, n]", shape, || linear_swiglu(gpu, &x, &w, &mut out))?;
    refused(gpu, "linear_swiglu odd d_out", alignment, || linear_swiglu(gpu, &x, &w_odd, &mut out_half))?;
    // SAFETY (both): refused before any launch.
    refused(gpu, "linear_ex residual without the residual epilogue", invalid, || unsafe {
        linear_ex(gpu, &x, &w, Some(&r), &mut out, Epilogue::Plain, Overlap::None)
    })?;
    refused(gpu, "linear_ex residual epilogue without a residual", invalid, || unsafe {
        linear_ex(gpu, &x, &w, None, &mut out, Epilogue::Residual, Overlap::ResidentWeights)
    })?;
    // One 16-row block per 16 tokens: 65535 of them at most.
    let rows = 65535 * 16 + 1;
    let (x_tall, mut out_tall) = (t(&[rows, 8])?, t(&[rows, 2])?);
    let w2 = t(&[2, 8])?;
    refused(gpu, "linear too many rows", too_large, || linear(gpu, &x_tall, &w2, &mut out_tall))?;
    if gpu.info().arch != Arch::Sm90a {
        refused(gpu, "Tma off Hopper", invalid, || {
            linear_with(gpu, &x, &w, None, &mut out, Epilogue::Plain, GemmVersion::Tma)
        })?;
    }

    // The MLP checks its whole pass before the norm's launch.
    let (d, ff) = (64, 96);
    let weights = |seed| rand_bf16(seed, d * ff, 0.02);
    let gamma = rand_bf16(1, d, 1.0);
    let mlp = SwiGluMlp::new(gpu, d, ff, &weights(2), &weights(3), &weights(4), Some((&gamma[..], 1e-5))).map_err(e)?;
    let mut scratch = MlpScratch::new(gpu, &mlp, 3).map_err(e)?;
    let (xm, mut outm) = (t(&[3, d])?, t(&[3, d])?);
    let (mut out_short, mut out_narrow, x_narrow, x_more) =
        (t(&[2, d])?, t(&[3, d - 8])?, t(&[3, d - 8])?, t(&[5, d])?);
    refused(gpu, "mlp out rows", shape, || mlp.forward(gpu, &xm, &mut scratch, &mut out_short))?;
    refused(gpu, "mlp out features", shape, || mlp.forward(gpu, &xm, &mut scratch, &mut out_narrow))?;
    refused(gpu, "mlp x features", shape, || mlp.forward(gpu, &x_narrow, &mut scratch, &mut out_narrow))?;
    let mut out_more = t(&[5, d])?;
    refused(gpu, "mlp scratch for fewer tokens", shape, || mlp.forward(gpu, &x_more, &mut scratch, &mut out_more))?;
    refused(gpu, "mlp weights", shape, || {
        SwiGluMlp::new(gpu, d, ff, &weights(2), &weights(3), &gamma, None).map(|_| ())
    })?;
    mlp.forward(gpu, &xm, &mut scratch, &mut outm).map_err(e)?;

    // 19 K tiles over 3 rows: split-K everywhere, through a workspace that must be zero.
    check_gemm(gpu, 3, 264, 1160, Via::Shipped, 1700)
}

/// Tensor-map slots are reused once the cache is full, but never those a captured
/// graph holds: a graph of a TMA GEMM captured first replays right after
/// thousands of other maps went through the cache, and the cache's memory stays
/// at its first allocation.
fn tensor_map_slots(gpu: &Gpu) -> Result<(), String> {
    if gpu.info().arch != Arch::Sm90a {
        return Ok(());
    }
    let (m, n, k) = (40, 520, 200);
    let (x, w) = (rand_bf16(1500, m * k, 1.0), rand_bf16(1501, n * k, 0.05));
    let xt = Tensor::from_host(gpu, &x, &[m, k]).map_err(e)?;
    let wt = Tensor::from_host(gpu, &w, &[n, k]).map_err(e)?;
    let mut out = Tensor::<bf16>::filled(gpu, &[m, n], bf16::NAN).map_err(e)?;
    let want = linear_ref(&to_f64(&x), &to_f64(&w), m, n, k);
    let run = |out: &mut Tensor<bf16>| linear_with(gpu, &xt, &wt, None, out, Epilogue::Plain, GemmVersion::TmaRows64);
    // Warm (maps made), then captured: its maps are pinned.
    run(&mut out).map_err(e)?;
    let graph = gpu.capture(|| run(&mut out)).map_err(e)?;
    let (_, bytes_before) = gpu.tensor_map_usage();
    // Thousands of other maps over the same buffer: the cache fills and evicts.
    for rows in 1..=6000usize {
        let b =
            host::tensor_map::Bf16Box { ptr: xt.device_ptr(), rows: rows.min(m), cols: 8 * (1 + rows), box_rows: 64 };
        gpu.tensor_map(b).map_err(e)?;
    }
    let (maps, bytes_after) = gpu.tensor_map_usage();
    if bytes_after != bytes_before || maps > 4096 {
        return Err(format!("tensor maps: {maps} maps in {bytes_after} bytes (before: {bytes_before})"));
    }
    out.fill(bf16::NAN).map_err(e)?;
    // SAFETY: every tensor the graph recorded is alive with its shape.
    unsafe { gpu.launch_graph(&graph) }.map_err(e)?;
    let got = to_f64(&out.to_host(gpu).map_err(e)?);
    expect_close("graph after map eviction", rel_l2_error(&got, &want), tolerance::<bf16>())?;
    // And the evicted maps come back on use.
    out.fill(bf16::NAN).map_err(e)?;
    run(&mut out).map_err(e)?;
    expect_close(
        "eager after map eviction",
        rel_l2_error(&to_f64(&out.to_host(gpu).map_err(e)?), &want),
        tolerance::<bf16>(),
    )
}

fn main() {
    let mut t = GpuTests::new("gemm");
    t.run("gemm_hopper_tma_wgmma", gemm_hopper);
    t.run("gemm_tma_store_epilogue", gemm_tma_store);
    t.run("gemm_split_tail_bit_reproducible", split_tail_reproducible);
    t.run("gemm_split_tail_stamps_in_order", split_tail_stamps_in_order);
    t.run("gemm_plain_residual_swiglu_odd_shapes", gemm_all);
    t.run("gemm_random_shapes_against_reference", gemm_random_shapes);
    t.run("gemm_every_tile_version", gemm_versions);
    t.run("swiglu_mlp_against_reference", mlp);
    t.run("swiglu_mlp_random_shapes", mlp_random_shapes);
    t.run("gemm_overlapped_with_previous_kernel", overlapped_chain);
    t.run("gemm_bad_input_fails_before_launch", bad_input);
    t.run("gemm_tensor_map_slots_reused_not_pinned_ones", tensor_map_slots);
    t.finish();
}
