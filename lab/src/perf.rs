//! Benchmark cases shared by `examples/perf.rs` (the PERF.md table) and the
//! criterion bench: each allocates its tensors once and exposes one launch.
//! Names match `torch_reference.py`, so the two outputs join on the name.

use half::bf16;
use host::data::{cast, random_with_outliers};
use host::error::{check, Result};
use host::ops::rmsnorm::{self, dev as rmsnorm_dev};
use host::ops::softmax::dev::{plan_tuned, softmax_tuned, SoftmaxDevType, SoftmaxVersion};
use host::ops::softmax::PREFERRED_THREADS;
use host::runtime::Gpu;
use host::tensor::{DType, Tensor};
use std::cell::RefCell;
use std::rc::Rc;

/// Device-to-device copy bandwidth (bytes read + written per second) is the
/// roofline for these memory-bound kernels; H200 measured about 4.2 TB/s.
/// One timed launch (or launch sequence) of a case.
type RunFn = Box<dyn FnMut(&Gpu) -> Result<()>>;

/// A case body calling `call(gpu, i)` on input set i = 0, 1, …, `sets` − 1 in
/// turn (more than one set: each call finds its inputs cold in L2). With `graph`,
/// each set's call is captured once, after a plain call (it allocates what a
/// capture may not), and replayed from then on: host launch costs off the clock.
fn rotating_run(sets: usize, graph: bool, mut call: impl FnMut(&Gpu, usize) -> Result<()> + 'static) -> RunFn {
    let (mut graphs, mut next) = (Vec::new(), 0usize);
    Box::new(move |gpu| {
        let i = next % sets;
        next += 1;
        if !graph {
            return call(gpu, i);
        }
        if graphs.len() <= i {
            call(gpu, i)?;
            graphs.push(gpu.capture(|| call(gpu, i))?);
        }
        // SAFETY: `call` owns set i's tensors, and the graphs live in this same closure.
        unsafe { gpu.launch_graph(&graphs[i]) }
    })
}

pub struct Case {
    pub name: String,
    /// Bytes that must cross HBM: each input read once, each output written once.
    pub bytes: usize,
    /// Floating-point operations (0 for memory-bound cases).
    pub flops: f64,
    run: RunFn,
}

impl Case {
    pub fn run(&mut self, gpu: &Gpu) -> Result<()> {
        (self.run)(gpu)
    }
}

/// Bracket tags that say how a case was measured rather than which kernel
/// version ran (as `scripts/compare.py` reads them).
const CONDITIONS: [&str; 6] = ["graph", "cold", "cold, graph", "page16", "contiguous", "spec"];

/// A case's name without its version tags: `attn ours hd128 s4096 b4 h16
/// causal0 [HopperTurns]` → `attn ours hd128 s4096 b4 h16 causal0`. Cases of
/// one shape and measuring condition share it, whatever kernel version they
/// run: a `[cold]` or `[graph]` row keeps its tag.
pub fn shape_of(name: &str) -> String {
    let mut parts = name.split(" [");
    let mut shape = parts.next().unwrap_or(name).to_string();
    for tag in parts {
        let tag = tag.trim_end_matches(']');
        if CONDITIONS.contains(&tag) {
            shape += &format!(" [{tag}]");
        }
    }
    shape
}

/// The indices of `names` grouped by [`shape_of`], groups in order of first
/// appearance, each group's indices in order.
pub fn shape_groups(names: &[&str]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let shape = shape_of(name);
        match groups.iter_mut().find(|(s, _)| *s == shape) {
            Some((_, g)) => g.push(i),
            None => groups.push((shape, vec![i])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

/// The order of round `round` of `n` cases: a pair of rounds walks the cases
/// from one start, forward and then back, and each pair starts one case
/// further along. Every case comes first equally often and follows each of
/// its neighbours equally often (rotating every round instead, and reversing
/// every other, puts only even cases first when `n` is even).
pub fn round_order(round: usize, n: usize) -> Vec<usize> {
    let start = round / 2;
    let mut order: Vec<usize> = (0..n).map(|k| (start + k) % n).collect();
    if round % 2 == 1 {
        order.reverse();
    }
    order
}

/// The median time of each of `cases`, measured in rounds: each round times
/// one call of every case, alone between two events, in [`round_order`], so
/// that no case always comes first or follows the same one. Drift of the
/// clock or the temperature then falls on every case alike, which timing one
/// case's calls after another's does not. A case whose call fails (in warm-up
/// or later) is reported with its error and takes no further turns.
pub fn interleaved_medians(gpu: &Gpu, cases: &mut [&mut Case], warmup: usize, reps: usize) -> Vec<Result<f64>> {
    assert!(reps > 0, "interleaved_medians: no rounds");
    let mut out: Vec<Result<f64>> = Vec::with_capacity(cases.len());
    for case in cases.iter_mut() {
        out.push((0..warmup.max(1)).try_for_each(|_| case.run(gpu)).map(|_| 0.0));
    }
    if let Err(e) = gpu.synchronize() {
        return cases.iter().map(|_| Err(e.clone())).collect();
    }
    let n = cases.len();
    let mut times: Vec<Vec<f64>> = (0..n).map(|_| Vec::with_capacity(reps)).collect();
    for round in 0..reps {
        for i in round_order(round, n) {
            if out[i].is_err() {
                continue;
            }
            match gpu.time_ms(|| cases[i].run(gpu)) {
                Ok(ms) => times[i].push(ms as f64),
                Err(e) => out[i] = Err(e),
            }
        }
    }
    for (i, t) in times.iter_mut().enumerate() {
        if out[i].is_ok() {
            t.sort_by(f64::total_cmp);
            out[i] = Ok(t[t.len() / 2]);
        }
    }
    out
}

/// `perf --only`'s keys (a substring of the name, or `=name` exactly): the GEMM,
/// MLP, decode and layer groups build only the cases they keep, so a filtered call
/// spends no time uploading operands it will not time. Unset: every case.
static ONLY: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Sets the keys [`wanted`] checks (once per process; later calls are ignored).
pub fn set_only(keys: &[&str]) {
    let _ = ONLY.set(keys.iter().map(|k| k.to_string()).collect());
}

/// Whether a case of this name survives `--only` (always, without it).
pub fn wanted(name: &str) -> bool {
    ONLY.get().is_none_or(|keys| keys.iter().any(|k| key_keeps(k, name)))
}

/// Whether `--only` names this case exactly (`=name`): for cases that run
/// only when asked for.
pub fn only_names(name: &str) -> bool {
    ONLY.get().is_some_and(|keys| keys.iter().any(|k| k.strip_prefix('=') == Some(name)))
}

/// One `--only` key: a substring of the name, or `=name` for exactly that name.
fn key_keeps(key: &str, name: &str) -> bool {
    key.strip_prefix('=').map_or(name.contains(key), |exact| name == exact)
}

fn upload<T: DType>(gpu: &Gpu, seed: u64, shape: &[usize], scale: f32) -> Result<Tensor<T>> {
    let n = shape.iter().product();
    Tensor::from_host(gpu, &cast::<T>(&random_with_outliers(seed, n, scale)), shape)
}

pub fn softmax_case<T: SoftmaxDevType>(gpu: &Gpu, rows: usize, cols: usize, version: SoftmaxVersion) -> Result<Case> {
    Ok(softmax_cases::<T>(gpu, rows, cols, &[(version, PREFERRED_THREADS)])?.remove(0))
}

/// One case per (version, preferred block size), all on the same input and output.
pub fn softmax_cases<T: SoftmaxDevType>(
    gpu: &Gpu,
    rows: usize,
    cols: usize,
    configs: &[(SoftmaxVersion, u32)],
) -> Result<Vec<Case>> {
    let x = Rc::new(upload::<T>(gpu, 1, &[rows, cols], 3.0)?);
    let y = Rc::new(RefCell::new(Tensor::<T>::filled(gpu, &[rows, cols], T::POISON)?));
    Ok(configs
        .iter()
        .map(|&(version, preferred)| {
            let tag = match (version, preferred) {
                (SoftmaxVersion::Auto, PREFERRED_THREADS) => String::new(),
                (v, PREFERRED_THREADS) => format!(" [{v:?}]"),
                (v, p) => format!(" [{v:?}/{p}]"),
            };
            let (x, y) = (x.clone(), y.clone());
            Case {
                name: format!("softmax {} {rows}x{cols}{tag}", T::NAME),
                bytes: 2 * rows * cols * T::BYTES,
                flops: 0.0,
                run: Box::new(move |gpu| softmax_tuned(gpu, &x, &mut y.borrow_mut(), version, preferred)),
            }
        })
        .collect())
}

pub fn rmsnorm_case(gpu: &Gpu, rows: usize, cols: usize, fused: bool) -> Result<Case> {
    Ok(rmsnorm_cases(gpu, rows, cols, fused, &[(rmsnorm::preferred_threads(fused), rmsnorm_dev::SHIPPED)])?.remove(0))
}

/// One case per (preferred block size, kernel version), all on the same tensors.
pub fn rmsnorm_cases(
    gpu: &Gpu,
    rows: usize,
    cols: usize,
    fused: bool,
    configs: &[(u32, rmsnorm_dev::RmsNormVersion)],
) -> Result<Vec<Case>> {
    let x = Rc::new(upload::<bf16>(gpu, 2, &[rows, cols], 1.0)?);
    let r = Rc::new(upload::<bf16>(gpu, 3, &[rows, cols], 1.0)?);
    let w = Rc::new(upload::<bf16>(gpu, 4, &[cols], 0.5)?);
    let y = Rc::new(RefCell::new(Tensor::<bf16>::filled(gpu, &[rows, cols], bf16::POISON)?));
    let s = Rc::new(RefCell::new(Tensor::<bf16>::filled(gpu, &[rows, cols], bf16::POISON)?));
    Ok(configs
        .iter()
        .map(|&(threads, version)| {
            let tag = if (threads, version) == (rmsnorm::preferred_threads(fused), rmsnorm_dev::SHIPPED) {
                String::new()
            } else {
                format!(" [{version:?}/{threads}]")
            };
            let (x, r, w, y, s) = (x.clone(), r.clone(), w.clone(), y.clone(), s.clone());
            Case {
                name: format!("{}rmsnorm bf16 {rows}x{cols}{tag}", if fused { "add+" } else { "" }),
                bytes: if fused { 4 } else { 2 } * rows * cols * 2,
                flops: 0.0,
                run: Box::new(move |gpu| {
                    let mut s = s.borrow_mut();
                    let residual = fused.then_some((&*r, &mut *s));
                    rmsnorm_dev::rms_norm_tuned(gpu, &x, residual, &w, 1e-5, &mut y.borrow_mut(), threads, version)
                }),
            }
        })
        .collect())
}

/// A 2 GiB device-to-device copy: the bandwidth ceiling, measured in the same run.
pub fn copy_case(gpu: &Gpu) -> Result<Case> {
    copy_bytes_case(gpu, 1 << 31, "copy f32 2GiB d2d")
}

/// A driver device-to-device copy of `bytes`, timed per call like every case:
/// what any kernel moving as many bytes could reach by this measurement.
pub fn copy_bytes_case(gpu: &Gpu, bytes: usize, name: &str) -> Result<Case> {
    let n = bytes / 4;
    let a = Tensor::<f32>::filled(gpu, &[n], 1.5)?;
    let b = Tensor::<f32>::filled(gpu, &[n], f32::NAN)?;
    Ok(Case {
        name: name.into(),
        bytes: 2 * n * 4,
        flops: 0.0,
        run: Box::new(move |gpu| {
            let status = unsafe {
                cust::sys::cuMemcpyDtoDAsync_v2(b.device_ptr(), a.device_ptr(), n * 4, gpu.stream().as_inner())
            };
            check("cuMemcpyDtoDAsync", status)
        }),
    })
}

/// A read-only stream of `bytes` (bf16 1.5s, summed by `stream_sum`): the memory
/// ceiling of kernels that mostly read, timed like them (one call between events).
pub fn read_bytes_case(gpu: &Gpu, bytes: usize, name: &str) -> Result<Case> {
    let n = bytes / 2 / 8 * 8;
    // Filled on the GPU: perf builds every standard case on each run (and under ncu).
    let x = Tensor::<bf16>::filled(gpu, &[n], bf16::from_f32(1.5))?;
    let mut out = Tensor::<f32>::filled(gpu, &[1], 0.0)?;
    Ok(Case {
        name: name.into(),
        bytes: n * 2,
        flops: 0.0,
        run: Box::new(move |gpu| host::ops::stream::stream_sum(gpu, &x, &mut out)),
    })
}

/// The cases of the build-pipeline issue's table (and the reference's smaller ones).
pub fn standard_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    let mut cases = vec![copy_case(gpu)?];
    for (rows, cols) in [(32768, 4096), (4096, 32768), (65536, 1024), (1024, 262144)] {
        cases.push(softmax_case::<f32>(gpu, rows, cols, SoftmaxVersion::Auto)?);
        cases.push(softmax_case::<bf16>(gpu, rows, cols, SoftmaxVersion::Auto)?);
    }
    for rows in [1, 64, 16384] {
        cases.push(rmsnorm_case(gpu, rows, 4096, false)?);
        cases.push(rmsnorm_case(gpu, rows, 4096, true)?);
    }
    // The plain RMSNorm's bytes (read 16384×4096 bf16, write as many) as one copy.
    cases.push(copy_bytes_case(gpu, 16384 * 4096 * 2, "copy bf16 16384x4096 d2d")?);
    // Read-only ceilings at the decode sizes: the b16 L4096 KV cache (268 MB), the
    // MLP's weights (352 MB), the b64 L4096 KV cache (1074 MB).
    for (bytes, name) in [
        (268_435_456, "read bf16 268MB (decode b16 KV)"),
        (3 * 4096 * 14336 * 2, "read bf16 352MB (MLP weights)"),
        (1_073_741_824, "read bf16 1074MB (decode b64 KV)"),
    ] {
        cases.push(read_bytes_case(gpu, bytes, name)?);
    }
    Ok(cases)
}

/// Kernel versions and block sizes side by side on the target shapes (the
/// dev-area comparison that picks what `Auto` ships).
pub fn version_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    let mut cases = Vec::new();
    for (rows, cols) in [(32768, 4096), (4096, 32768), (65536, 1024)] {
        let shape = [rows, cols];
        let configs = |ok: &dyn Fn(SoftmaxVersion, u32) -> bool| {
            let mut c = Vec::new();
            for v in [SoftmaxVersion::V1, SoftmaxVersion::V2] {
                for p in [128, 256, 512] {
                    if ok(v, p) {
                        c.push((v, p));
                    }
                }
            }
            c
        };
        // A version that cannot hold the row is simply not in the table.
        let f32_configs = configs(&|v, p| plan_tuned::<f32>(&shape, &shape, v, p).is_ok());
        cases.extend(softmax_cases::<f32>(gpu, rows, cols, &f32_configs)?);
        let bf16_configs = configs(&|v, p| plan_tuned::<bf16>(&shape, &shape, v, p).is_ok());
        cases.extend(softmax_cases::<bf16>(gpu, rows, cols, &bf16_configs)?);
    }
    use rmsnorm_dev::RmsNormVersion::{V1, V5, V6};
    // V2, V3 and V4 measured slower than V1 (docs/PERF.md); they stay in the tests.
    // V6 (a warp per row): threads/32 rows per block.
    let rms = [(128, V1), (256, V1), (128, V5), (256, V5), (128, V6), (256, V6)];
    cases.extend(rmsnorm_cases(gpu, 16384, 4096, false, &rms)?);
    cases.extend(rmsnorm_cases(gpu, 16384, 4096, true, &rms)?);
    Ok(cases)
}

/// The FlashAttention sweep of `torch_reference.py attn`: batch × seqlen = 16k
/// tokens, hidden 2048, head dims 64 and 128 (and 256 on Hopper, its only arch),
/// causal and not; plus the reference layer's GQA prefill (32 query heads over 8
/// KV heads). FLOPs: 4·b·h·s²·d, halved for causal.
pub fn attention_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    use host::ops::FlashVersion;
    let hopper = gpu.info().arch == host::Arch::Sm90a;
    let inputs = SharedInputs::default();
    let mut cases =
        attention_sweep(gpu, &inputs, FlashVersion::Auto, if hopper { &[64, 128, 256] } else { &[64, 128] })?;
    // On Hopper the candidates for promotion over the whole sweep, beside Auto
    // (the rejected versions at s4096, in Auto's sweep).
    if hopper {
        for v in [
            FlashVersion::HopperOneTile,
            FlashVersion::HopperStrided,
            FlashVersion::HopperTurns,
            FlashVersion::HopperPersistent,
            FlashVersion::HopperCounter,
        ] {
            cases.extend(attention_sweep(gpu, &inputs, v, &[64, 128, 256])?);
        }
        cases.extend(attention_sweep(gpu, &inputs, FlashVersion::HopperTmaStores, &[64, 128])?);
        cases.extend(attention_sweep(gpu, &inputs, FlashVersion::HopperLatePv, &[64, 128, 256])?);
        cases.extend(attention_sweep(gpu, &inputs, FlashVersion::HopperLatePvTurns, &[64, 128, 256])?);
        cases.extend(attention_sweep(gpu, &inputs, FlashVersion::HopperIssueTurns, &[64, 128, 256])?);
        cases.extend(attention_sweep(gpu, &inputs, FlashVersion::HopperN176, &[64, 128])?);
        cases.extend(attention_sweep(gpu, &inputs, FlashVersion::HopperPersistentN176, &[64])?);
        cases.extend(attention_sweep(gpu, &inputs, FlashVersion::HopperM192, &[64])?);
        cases.extend(attention_sweep(gpu, &inputs, FlashVersion::HopperStages3, &[64, 128])?);
        cases.extend(attention_sweep(gpu, &inputs, FlashVersion::HopperN80, &[256])?);
        cases.extend(attention_sweep(gpu, &inputs, FlashVersion::HopperN64, &[256])?);
        cases.extend(attention_sweep(gpu, &inputs, FlashVersion::HopperN128Counter, &[256])?);
    }
    Ok(cases)
}

/// Random bf16 inputs by (seed, shape), uploaded on first use and shared by
/// every case that asks for the same: the versions of a sweep time the same Q and K.
#[derive(Default)]
struct SharedInputs(RefCell<Vec<(InputKey, Rc<Tensor<bf16>>)>>);

/// An input's seed and shape.
type InputKey = (u64, Vec<usize>);

impl SharedInputs {
    fn get(&self, gpu: &Gpu, seed: u64, shape: &[usize]) -> Result<Rc<Tensor<bf16>>> {
        let key = (seed, shape.to_vec());
        if let Some((_, t)) = self.0.borrow().iter().find(|(k, _)| *k == key) {
            return Ok(t.clone());
        }
        let t = Rc::new(upload::<bf16>(gpu, seed, shape, 1.0)?);
        self.0.borrow_mut().push((key, t.clone()));
        Ok(t)
    }
}

/// The sweep with `sweep` on every shape of `head_dims`; for `Auto`, the other
/// versions too at s4096; the GQA prefill where the head dims include 128.
/// Only the cases `--only` keeps are built, and their inputs uploaded.
fn attention_sweep(
    gpu: &Gpu,
    inputs: &SharedInputs,
    sweep: host::ops::FlashVersion,
    head_dims: &[usize],
) -> Result<Vec<Case>> {
    use host::ops::{flash_attention_with, AttentionOptions, FlashVersion, VarlenBatch};
    let mut cases = Vec::new();
    let tokens = 16384;
    let mut add = |name: String,
                   flops: f64,
                   (q_seed, q_shape): (u64, [usize; 3]),
                   (k_seed, k_shape): (u64, [usize; 3]),
                   lens: Vec<usize>,
                   causal: bool,
                   version: FlashVersion|
     -> Result<()> {
        if !wanted(&name) {
            return Ok(());
        }
        let (q, k) = (inputs.get(gpu, q_seed, &q_shape)?, inputs.get(gpu, k_seed, &k_shape)?);
        let batch = VarlenBatch::new(gpu, &lens, &lens)?;
        let [total, heads, _] = q_shape;
        let o = RefCell::new(Tensor::<bf16>::filled(gpu, &q_shape, bf16::POISON)?);
        let lse = RefCell::new(Tensor::<f32>::filled(gpu, &[heads, total], f32::NAN)?);
        let opts = AttentionOptions { causal, scale: None };
        cases.push(Case {
            name,
            bytes: 0,
            flops,
            run: Box::new(move |gpu| {
                flash_attention_with(gpu, &q, &k, &k, &batch, opts, &mut o.borrow_mut(), &mut lse.borrow_mut(), version)
            }),
        });
        Ok(())
    };
    for &hd in head_dims {
        let h = 2048 / hd;
        let (q, k) = ((11, [tokens, h, hd]), (12, [tokens, h, hd]));
        for s in [512usize, 1024, 2048, 4096, 8192, 16384] {
            let b = tokens / s;
            for causal in [false, true] {
                let flops = 4.0 * (b * h * s * s * hd) as f64 / if causal { 2.0 } else { 1.0 };
                let name = format!("attn ours hd{hd} s{s} b{b} h{h} causal{}", causal as u8);
                let tagged = if sweep == FlashVersion::Auto { name.clone() } else { format!("{name} [{sweep:?}]") };
                add(tagged, flops, q, k, vec![s; b], causal, sweep)?;
                if s == 4096 && sweep == FlashVersion::Auto && hd != 256 {
                    // The portable path (V2Bn32 at hd64, V2Bn16 at hd128) and the
                    // versions kept for comparison.
                    let mut versions = vec![FlashVersion::V1, FlashVersion::V2, FlashVersion::V2Bn32];
                    if hd == 128 {
                        versions.push(FlashVersion::V2Bn16);
                    }
                    if gpu.info().arch == host::Arch::Sm90a {
                        versions.extend([FlashVersion::Hopper, FlashVersion::HopperWsLazy, FlashVersion::HopperFmaEx2]);
                    }
                    for v in versions {
                        add(format!("{name} [{v:?}]"), flops, q, k, vec![s; b], causal, v)?;
                    }
                }
            }
        }
    }
    for s in [2048usize, 8192].into_iter().filter(|_| head_dims.contains(&128)) {
        let flops = 2.0 * (32 * s * s * 128) as f64;
        let tag = if sweep == FlashVersion::Auto { String::new() } else { format!(" [{sweep:?}]") };
        let (q, k) = ((13, [s, 32, 128]), (14, [s, 8, 128]));
        add(format!("attn ours gqa32/8 hd128 s{s} causal1{tag}"), flops, q, k, vec![s], true, sweep)?;
    }
    Ok(cases)
}

/// GEMMs of `torch_reference.py gemm` and the SwiGLU MLP of `mlp` (no norm, as
/// there): FLOPs 2·m·n·k; MLP FLOPs 6·t·d·ff and weight bytes 3·d·ff·2.
pub fn gemm_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    use host::ops::{linear_with, Epilogue, GemmVersion};
    let mut cases = Vec::new();
    // Auto is the persistent TMA kernel on Hopper; V1 the portable mma.sync path.
    let versions = [
        GemmVersion::Auto,
        GemmVersion::Tma,
        GemmVersion::TmaSplitTail,
        GemmVersion::TmaMulticast,
        GemmVersion::TmaStore,
        GemmVersion::V1,
    ];
    let name = |m, n, k, v: GemmVersion| {
        let tag = if v == GemmVersion::Auto { String::new() } else { format!(" [{v:?}]") };
        format!("gemm bf16 x@w.T m{m} n{n} k{k}{tag}")
    };
    for (m, n, k) in [(4096usize, 4096usize, 4096usize), (8192, 8192, 8192), (2048, 28672, 4096), (2048, 4096, 14336)] {
        if !versions.iter().any(|&v| wanted(&name(m, n, k, v))) {
            continue;
        }
        let x = Rc::new(upload::<bf16>(gpu, 21, &[m, k], 1.0)?);
        let w = Rc::new(upload::<bf16>(gpu, 22, &[n, k], 0.02)?);
        let out = Rc::new(RefCell::new(Tensor::<bf16>::filled(gpu, &[m, n], bf16::POISON)?));
        for v in versions {
            if !wanted(&name(m, n, k, v)) {
                continue;
            }
            let (x, w, out) = (x.clone(), w.clone(), out.clone());
            cases.push(Case {
                name: name(m, n, k, v),
                bytes: 0,
                flops: 2.0 * (m * n * k) as f64,
                run: Box::new(move |gpu| linear_with(gpu, &x, &w, None, &mut out.borrow_mut(), Epilogue::Plain, v)),
            });
        }
    }
    cases.extend(projection_cases(gpu)?);
    cases.extend(mlp_cases(gpu)?);
    Ok(cases)
}

/// The Llama-3-8B projections at serving sizes (32–1024 tokens, named as
/// `torch_reference.py gemm` names its cuBLAS rows), in each tile configuration
/// that may take them: bytes are the weight's, streamed once.
fn projection_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    use host::ops::{linear_with, Epilogue, GemmVersion as V};
    let versions = [
        V::Auto,
        V::Rows64SplitK,
        V::TmaRows64,
        V::TmaRows64SplitK,
        V::Tma,
        V::TmaPersistent,
        V::TmaPersistentSplitK,
        V::TmaSplitTail,
        V::TmaPersistentN128,
        V::TmaPersistentN192,
        V::TmaPersistentN224,
        V::TmaSplitTailN192,
        V::TmaSplitTailN192Waves,
        V::TmaSplitTailWhole,
        V::TmaSplitTailN192Whole,
        V::TmaSplitTailGiveUp,
        V::TmaMulticast,
        V::TmaStore,
        V::V1SplitK,
    ];
    let name = |m, n, k, v: V| {
        let tag = if v == V::Auto { String::new() } else { format!(" [{v:?}]") };
        format!("gemm bf16 x@w.T m{m} n{n} k{k}{tag}")
    };
    let mut cases = Vec::new();
    for m in [32usize, 64, 128, 256, 512, 1024] {
        for (n, k) in [(6144usize, 4096usize), (4096, 4096), (28672, 4096), (4096, 14336)] {
            // `[Auto again]`, asked for by name only: Auto a second time, last in
            // its group, to tell whether a case's place in the group or its
            // path reads slower (the twin gap between Auto and its version).
            let again = format!("{} [Auto again]", name(m, n, k, V::Auto));
            let named: Vec<(String, V)> = versions
                .iter()
                .map(|&v| (name(m, n, k, v), v))
                .chain([(again.clone(), V::Auto)])
                .filter(|(name, _)| wanted(name) && (*name != again || only_names(name)))
                .collect();
            if named.is_empty() {
                continue;
            }
            let x = Rc::new(upload::<bf16>(gpu, 23, &[m, k], 1.0)?);
            let w = Rc::new(upload::<bf16>(gpu, 24, &[n, k], 0.02)?);
            let out = Rc::new(RefCell::new(Tensor::<bf16>::filled(gpu, &[m, n], bf16::POISON)?));
            for (name, v) in named {
                let (x, w, out) = (x.clone(), w.clone(), out.clone());
                cases.push(Case {
                    name,
                    bytes: n * k * 2,
                    flops: 2.0 * (m * n * k) as f64,
                    run: Box::new(move |gpu| linear_with(gpu, &x, &w, None, &mut out.borrow_mut(), Epilogue::Plain, v)),
                });
            }
        }
    }
    Ok(cases)
}

/// The SwiGLU MLP of `torch_reference.py mlp` alone (`perf --mlp`: no GEMM
/// operands of a GB built first), at 1 to 8192 tokens.
pub fn mlp_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    use host::ops::{GemmVersion, MlpScratch, SwiGluMlp};
    let mut cases = Vec::new();
    let (d, ff) = (4096, 14336);
    let tokens = [1usize, 16, 32, 64, 128, 256, 512, 2048, 8192];
    // Decode sizes also with stream-K and split-K (equal weight bytes per
    // resident block, or per split), and without the programmatic launch.
    let versions = |t: usize| -> &'static [(GemmVersion, bool)] {
        if t <= 16 {
            &[
                (GemmVersion::Auto, true),
                (GemmVersion::Auto, false),
                (GemmVersion::SkinnyStreamK, true),
                (GemmVersion::SkinnyStreamKPipelined, true),
                (GemmVersion::Skinny64StreamK, true),
                (GemmVersion::Skinny32StreamK, true),
                (GemmVersion::Gemv, true),
                (GemmVersion::SkinnySplitK, true),
                (GemmVersion::SkinnyK128SplitK, true),
                (GemmVersion::SkinnyK128StreamK, true),
                (GemmVersion::SkinnyK128, true),
                (GemmVersion::SkinnyK128SplitKFixup, true),
                (GemmVersion::SkinnyK128FillFixup, true),
            ]
        } else if t == 64 {
            // 64 tokens: Auto against the mma.sync 64-row tiles and the 16-row ones.
            &[(GemmVersion::Auto, true), (GemmVersion::Rows64SplitK, true), (GemmVersion::SkinnySplitK, true)]
        } else if t >= 2048 {
            // Prefill: both GEMMs (SwiGLU, residual) also storing by TMA.
            &[(GemmVersion::Auto, true), (GemmVersion::Auto, false), (GemmVersion::TmaStore, true)]
        } else {
            &[(GemmVersion::Auto, true), (GemmVersion::Auto, false)]
        }
    };
    let name = |t: usize, v: GemmVersion, overlap: bool| {
        let tag = if v == GemmVersion::Auto { String::new() } else { format!(" [{v:?}]") };
        format!("swiglu mlp+residual t{t}{tag}{}", if overlap { "" } else { " [no overlap]" })
    };
    let graph_name = |t: usize| format!("swiglu mlp+residual t{t} [graph]");
    let wanted_at =
        |t: usize| versions(t).iter().any(|&(v, o)| wanted(&name(t, v, o))) || (t <= 16 && wanted(&graph_name(t)));
    if !tokens.iter().any(|&t| wanted_at(t)) {
        return Ok(cases);
    }
    let weights = |seed| cast::<bf16>(&random_with_outliers(seed, d * ff, 0.02));
    let mlp = Rc::new(SwiGluMlp::new(gpu, d, ff, &weights(31), &weights(32), &weights(33), None)?);
    for t in tokens.into_iter().filter(|&t| wanted_at(t)) {
        for &(v, overlap) in versions(t) {
            if !wanted(&name(t, v, overlap)) {
                continue;
            }
            let x = upload::<bf16>(gpu, 34, &[t, d], 1.0)?;
            let mut out = Tensor::<bf16>::filled(gpu, &[t, d], bf16::POISON)?;
            let mut scratch = MlpScratch::new(gpu, &mlp, t)?;
            let mlp = mlp.clone();
            cases.push(Case {
                name: name(t, v, overlap),
                bytes: mlp.weight_bytes(),
                flops: 6.0 * (t * d * ff) as f64,
                run: Box::new(move |gpu| {
                    gpu.with_programmatic_launch(overlap, || mlp.forward_with(gpu, &x, &mut scratch, &mut out, v))
                }),
            });
        }
        if t > 16 || !wanted(&graph_name(t)) {
            continue;
        }
        // Auto replayed as a CUDA graph, as a decode step runs it: the host's launch
        // costs off the clock, the weights still streamed from HBM on every call.
        let x = upload::<bf16>(gpu, 34, &[t, d], 1.0)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[t, d], bf16::POISON)?;
        let mut scratch = MlpScratch::new(gpu, &mlp, t)?;
        let mlp = mlp.clone();
        cases.push(Case {
            name: graph_name(t),
            bytes: mlp.weight_bytes(),
            flops: 6.0 * (t * d * ff) as f64,
            run: rotating_run(1, true, move |gpu, _| mlp.forward(gpu, &x, &mut scratch, &mut out)),
        });
    }
    Ok(cases)
}

/// Decode attention of `torch_reference.py decode`: GQA 32/8, head dim 128, one
/// query per sequence; bytes are the K and V read (2·b·8·L·128·2), FLOPs 4·b·32·L·128.
/// Pages of 64 tokens; b16 L4096 also with pages of 16 and with one page per
/// sequence (a contiguous cache) for the paged-versus-contiguous comparison, and
/// with 4 new queries per sequence (speculative decoding: the `spec` kernel; FLOPs
/// ×4, bytes the same; no PyTorch row). ` [fused]` rows: the same calls with the
/// merge in the one-warp split kernel ([`DecodeVersion::Fused`](host::ops::DecodeVersion));
/// ` [two-launch]` rows: split kernel then `decode_merge` (Auto takes the 4-warp `Wide`).
pub fn decode_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    use host::ops::{decode_attention_with, DecodeVersion, PagedKvCache};
    let (h, kv, d) = (32usize, 8usize, 128usize);
    let block = cast::<bf16>(&random_with_outliers(41, 1 << 20, 1.0));
    let mut cases = Vec::new();
    // Whether b1 L4096's 8 clusters of 16 splits fit at once (else `[cluster]` rows run `Wide`).
    println!("decode: clusters of 16 that fit at once: {}", host::ops::decode::cluster_capacity(gpu, 16)?);
    let configs = [
        (1usize, 4096usize, 64usize, 1usize, ""),
        // The layer's decode steps run at 4097+: 33 key units of 128 for `Wide`.
        (1, 4097, 64, 1, ""),
        (16, 4096, 64, 1, ""),
        (64, 4096, 64, 1, ""),
        (8, 32768, 64, 1, ""),
        (1, 131072, 64, 1, ""),
        (16, 4096, 16, 1, " [page16]"),
        (16, 4096, 4096, 1, " [contiguous]"),
        (16, 4096, 64, 4, " q4 [spec]"),
    ];
    for (b, len, page, q_len, tag) in configs {
        let fused_too = tag.is_empty()
            && matches!((b, len), (1, 4096) | (1, 4097) | (16, 4096) | (64, 4096) | (8, 32768) | (1, 131072));
        let versions: &[(DecodeVersion, &str)] = if fused_too {
            &[
                (DecodeVersion::Auto, ""),
                (DecodeVersion::Fused, " [fused]"),
                (DecodeVersion::TwoLaunch, " [two-launch]"),
                (DecodeVersion::Cluster, " [cluster]"),
                (DecodeVersion::Wide8, " [wide8]"),
            ]
        } else {
            &[(DecodeVersion::Auto, "")]
        };
        let graph_too = tag.is_empty() && (len == 4096 || len == 4097) && b <= 16;
        let name = |vtag: &str| format!("decode attn gqa32/8 b{b} L{len}{tag}{vtag}");
        let graph_name = |vtag: &str| format!("decode attn gqa32/8 b{b} L{len}{vtag} [graph]");
        if !versions.iter().any(|&(_, vt)| wanted(&name(vt)) || (graph_too && wanted(&graph_name(vt)))) {
            continue;
        }
        let mut cache = PagedKvCache::new(gpu, b * len.div_ceil(page), page, kv, d)?;
        let data: Vec<bf16> = block.iter().copied().cycle().take(len * kv * d).collect();
        let mut seqs = Vec::new();
        for _ in 0..b {
            let s = cache.add_sequence();
            cache.write(gpu, s, &data, &data)?;
            seqs.push(s);
        }
        let batch = cache.batch(gpu, &seqs)?;
        let (q_shape, lse_shape) =
            if q_len == 1 { (vec![b, h, d], vec![b, h]) } else { (vec![b, q_len, h, d], vec![b, q_len, h]) };
        let q = upload::<bf16>(gpu, 42, &q_shape, 1.0)?;
        let (bytes, flops) = (2 * b * kv * len * d * 2, 4.0 * (b * q_len * h * len * d) as f64);
        let (cache, batch, q) = (Rc::new(cache), Rc::new(batch), Rc::new(q));
        for &(version, vtag) in versions {
            let out = Rc::new(RefCell::new(Tensor::<bf16>::filled(gpu, &q_shape, bf16::POISON)?));
            let lse = Rc::new(RefCell::new(Tensor::<f32>::filled(gpu, &lse_shape, f32::NAN)?));
            let (c2, b2, q2, o2, l2) = (cache.clone(), batch.clone(), q.clone(), out.clone(), lse.clone());
            cases.push(Case {
                name: name(vtag),
                bytes,
                flops,
                run: Box::new(move |gpu| {
                    let (mut o, mut l) = (o2.borrow_mut(), l2.borrow_mut());
                    decode_attention_with(gpu, &*c2, &b2, &q2, None, &mut o, &mut l, version)
                }),
            });
            // The same call launched without the programmatic-dependent-launch
            // attribute (plain `cuLaunchKernel`): what the attribute costs a lone call.
            if b == 1 && len == 4096 && version == DecodeVersion::Auto && wanted(&name(" [plain launch]")) {
                let (c2, b2, q2, o2, l2) = (cache.clone(), batch.clone(), q.clone(), out.clone(), lse.clone());
                cases.push(Case {
                    name: name(" [plain launch]"),
                    bytes,
                    flops,
                    run: Box::new(move |gpu| {
                        let (mut o, mut l) = (o2.borrow_mut(), l2.borrow_mut());
                        gpu.with_programmatic_launch(false, || {
                            decode_attention_with(gpu, &*c2, &b2, &q2, None, &mut o, &mut l, version)
                        })
                    }),
                });
            }
            if !graph_too || !wanted(&graph_name(vtag)) {
                continue;
            }
            // The same call replayed as a CUDA graph: launch overhead off the clock
            // (b1 L4096 moves 17 MB; host launch costs dominate it).
            let (cache, batch, q) = (cache.clone(), batch.clone(), q.clone());
            cases.push(Case {
                name: graph_name(vtag),
                bytes,
                flops,
                run: rotating_run(1, true, move |gpu, _| {
                    let (mut o, mut l) = (out.borrow_mut(), lse.borrow_mut());
                    decode_attention_with(gpu, &*cache, &batch, &q, None, &mut o, &mut l, version)
                }),
            });
        }
    }
    cases.extend(decode_cold_cases(gpu, &block)?);
    cases.extend(decode_floor_cases(gpu)?);
    Ok(cases)
}

/// What any single call costs at b1 L4096, timed like the decode rows: a one-block
/// `stream_sum` of 8 elements (the launch itself), and `stream_sum` reading the
/// decode call's 16.8 MB (the read ceiling for its bytes), each as a plain call
/// and as a graph replay, the read also over [`COLD_CACHES`] buffers (cold in L2).
fn decode_floor_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    use host::ops::stream::stream_sum;
    let kv_bytes = 2 * 8 * 4096 * 128 * 2;
    let mut cases = Vec::new();
    for (what, elems, buffers) in [
        ("launch, 1 block", 8usize, 1usize),
        ("read 16.8 MB", kv_bytes / 2, 1),
        ("read 16.8 MB cold", kv_bytes / 2, COLD_CACHES),
    ] {
        for graph in [false, true] {
            let name = format!("decode floor b1 L4096: {what}{}", if graph { " [graph]" } else { "" });
            if !wanted(&name) {
                continue;
            }
            let xs = (0..buffers)
                .map(|_| Tensor::<bf16>::filled(gpu, &[elems], bf16::from_f32(1.5)))
                .collect::<Result<Vec<_>>>()?;
            let mut out = Tensor::<f32>::filled(gpu, &[1], 0.0)?;
            cases.push(Case {
                name,
                bytes: elems * 2,
                flops: 0.0,
                run: rotating_run(buffers, graph, move |gpu, i| stream_sum(gpu, &xs[i], &mut out)),
            });
        }
    }
    Ok(cases)
}

/// b1 L4096 with its 16.8 MB of KV cold in L2: the calls rotate over
/// [`COLD_CACHES`] caches (84 MB against the H200's 60 MB of L2), as a decode
/// step finds its cache after the rest of the layer has passed through L2. The
/// rows above re-read one cache, which may stay in L2 between calls.
fn decode_cold_cases(gpu: &Gpu, block: &[bf16]) -> Result<Vec<Case>> {
    use host::ops::{decode_attention_with, DecodeBatch, DecodeVersion, PagedKvCache};
    let (b, len, page, h, kv, d) = (1usize, 4096usize, 64usize, 32usize, 8usize, 128usize);
    let versions = [(DecodeVersion::Auto, ""), (DecodeVersion::Wide8, " [wide8]")];
    let name = |vtag: &str, graph: bool| {
        format!("decode attn gqa32/8 b{b} L{len}{vtag} [cold{}]", if graph { ", graph" } else { "" })
    };
    let mut cases = Vec::new();
    if !versions.iter().any(|&(_, vt)| wanted(&name(vt, false)) || wanted(&name(vt, true))) {
        return Ok(cases);
    }
    let data: Vec<bf16> = block.iter().copied().cycle().take(len * kv * d).collect();
    let mut sets: Vec<(PagedKvCache, DecodeBatch)> = Vec::new();
    for _ in 0..COLD_CACHES {
        let mut cache = PagedKvCache::new(gpu, b * len.div_ceil(page), page, kv, d)?;
        let s = cache.add_sequence();
        cache.write(gpu, s, &data, &data)?;
        let batch = cache.batch(gpu, &[s])?;
        sets.push((cache, batch));
    }
    let sets = Rc::new(sets);
    let q = Rc::new(upload::<bf16>(gpu, 42, &[b, h, d], 1.0)?);
    let (bytes, flops) = (2 * b * kv * len * d * 2, 4.0 * (b * h * len * d) as f64);
    for (version, vtag) in versions {
        for graph in [false, true] {
            if !wanted(&name(vtag, graph)) {
                continue;
            }
            let mut out = Tensor::<bf16>::filled(gpu, &[b, h, d], bf16::POISON)?;
            let mut lse = Tensor::<f32>::filled(gpu, &[b, h], f32::NAN)?;
            let (sets, q) = (sets.clone(), q.clone());
            cases.push(Case {
                name: name(vtag, graph),
                bytes,
                flops,
                run: rotating_run(COLD_CACHES, graph, move |gpu, i| {
                    let (cache, batch) = &sets[i];
                    decode_attention_with(gpu, cache, batch, &q, None, &mut out, &mut lse, version)
                }),
            });
        }
    }
    Ok(cases)
}

/// Caches [`decode_cold_cases`] rotates over: 5 × 16.8 MB, past the H200's 60 MB L2.
const COLD_CACHES: usize = 5;

/// The experimental sm_90a `wgmma` GEMM on the `gemm` shapes (see
/// `kernels/src/gemm/dev/wgmma_exp.rs`); separate so a fault there cannot cut a run short.
pub fn wgmma_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    use host::ops::{linear_with, Epilogue, GemmVersion};
    let mut cases = Vec::new();
    for (m, n, k) in [(4096usize, 4096usize, 4096usize), (8192, 8192, 8192), (2048, 28672, 4096), (2048, 4096, 14336)] {
        let x = upload::<bf16>(gpu, 21, &[m, k], 1.0)?;
        let w = upload::<bf16>(gpu, 22, &[n, k], 0.02)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[m, n], bf16::POISON)?;
        cases.push(Case {
            name: format!("gemm bf16 x@w.T m{m} n{n} k{k} [WgmmaExperimental]"),
            bytes: 0,
            flops: 2.0 * (m * n * k) as f64,
            run: Box::new(move |gpu| {
                linear_with(gpu, &x, &w, None, &mut out, Epilogue::Plain, GemmVersion::WgmmaExperimental)
            }),
        });
    }
    Ok(cases)
}

/// The reference layer (Llama-3-8B sizes, seeded weights) as `torch_reference.py
/// layer` times it: prefill of one t-token prompt, and one decode step of b
/// sequences holding about L tokens (each timed step appends one, so L grows by
/// the 35 warm-up and timed steps). Decode bytes: weights + the K and V read.
pub fn layer_cases(gpu: &Gpu) -> Result<Vec<Case>> {
    use host::layer::{Layer, LayerConfig, LayerWeights};
    use host::ops::{DecodeVersion, GemmVersion};
    let (prefill_tokens, len, batches) = ([128usize, 256, 512, 1024, 2048, 8192], 4096, [1usize, 16, 64, 128]);
    let prefill_name = |t: usize| format!("layer prefill t{t}");
    // The decode step plain, then as a CUDA graph (captured on the first, warm-up,
    // call) with and without programmatic launches (the overlap is recorded at
    // capture), and with the one-warp fused decode and the two-launch one (Auto:
    // 4-warp blocks).
    // And with the QKV and O projections finished by `gemm_finalize` launches of
    // their own rather than by the RoPE and RMSNorm kernels.
    let graphs = [
        (true, DecodeVersion::Auto, true, ""),
        (false, DecodeVersion::Auto, true, ", no overlap"),
        (true, DecodeVersion::Fused, true, ", fused merge"),
        (true, DecodeVersion::TwoLaunch, true, ", two-launch decode"),
        (true, DecodeVersion::Auto, false, ", finalize launches"),
        (true, DecodeVersion::Wide8, true, ", wide8 decode"),
    ];
    let decode_name = |b: usize| format!("layer decode b{b} L{len}");
    let graph_name = |b: usize, tag: &str| format!("layer decode b{b} L{len} [graph{tag}]");
    let decode_wanted = |b: usize| wanted(&decode_name(b)) || graphs.iter().any(|g| wanted(&graph_name(b, g.3)));
    // Chunked prefill's mixed step: a 512-token prompt with 16 running sequences'
    // next tokens, against `layer prefill t512` plus `layer decode b16` apart.
    let mixed_name = format!("layer mixed t512 + b16 L{len}");
    // Chunked prefill: the last 512-token chunk of a 4096-token prompt (its keys
    // gathered from the cache), against `layer prefill t512`.
    let (chunk, held) = (512usize, len - 512);
    let chunk_name = format!("layer prefill chunk t{chunk} after {held}");
    let mut cases = Vec::new();
    if !prefill_tokens.iter().any(|&t| wanted(&prefill_name(t)))
        && !batches.iter().any(|&b| decode_wanted(b))
        && !wanted(&mixed_name)
        && !wanted(&chunk_name)
    {
        return Ok(cases);
    }
    let c = LayerConfig::default();
    let w = LayerWeights::random(&c, 51)?;
    let weight_elems = c.d_model * (c.q_dim() + 2 * c.kv_dim() + c.q_dim() + 3 * c.d_ff);
    if wanted(&mixed_name) {
        let (chunk, b) = (512usize, 16usize);
        let mut layer = Layer::new(gpu, &c, &w, b * (len + 64) + chunk + 64, 64, len + 64)?;
        let running: Vec<_> = (0..b).map(|_| layer.add_sequence()).collect();
        let prompt = upload::<bf16>(gpu, 55, &[b * (len - 1), c.d_model], 1.0)?;
        let mut sink = Tensor::<bf16>::filled(gpu, &[b * (len - 1), c.d_model], bf16::POISON)?;
        layer.prefill(gpu, &running, &vec![len - 1; b], &prompt, &mut sink)?;
        drop((prompt, sink));
        let x = upload::<bf16>(gpu, 56, &[chunk + b, c.d_model], 1.0)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[chunk + b, c.d_model], bf16::POISON)?;
        cases.push(Case {
            name: mixed_name,
            bytes: 0,
            flops: (2 * (chunk + b) * weight_elems) as f64 + 2.0 * (c.n_heads * chunk * chunk * c.head_dim) as f64,
            run: Box::new(move |gpu| {
                let s = layer.add_sequence();
                layer.mixed(gpu, &[s], &[chunk], &running, &x, &mut out)?;
                layer.release(s)
            }),
        });
    }
    if wanted(&chunk_name) {
        let mut layer = Layer::new(gpu, &c, &w, len + 64, 64, len + 64)?;
        let s = layer.add_sequence();
        let prompt = upload::<bf16>(gpu, 57, &[held, c.d_model], 1.0)?;
        let mut sink = Tensor::<bf16>::filled(gpu, &[held, c.d_model], bf16::POISON)?;
        layer.prefill(gpu, &[s], &[held], &prompt, &mut sink)?;
        drop((prompt, sink));
        let x = upload::<bf16>(gpu, 58, &[chunk, c.d_model], 1.0)?;
        let mut out = Tensor::<bf16>::filled(gpu, &[chunk, c.d_model], bf16::POISON)?;
        // Causal: query j of the chunk sees held + j + 1 keys.
        let attn = 4.0 * (c.n_heads * chunk * c.head_dim) as f64 * (held as f64 + chunk as f64 / 2.0);
        cases.push(Case {
            name: chunk_name,
            bytes: 0,
            flops: (2 * chunk * weight_elems) as f64 + attn,
            run: Box::new(move |gpu| {
                layer.prefill(gpu, &[s], &[chunk], &x, &mut out)?;
                layer.truncate(gpu, s, held)
            }),
        });
    }
    // One layer serves every prompt length (built only if one is wanted).
    let mut prefill = None;
    for t in prefill_tokens.into_iter().filter(|&t| wanted(&prefill_name(t))) {
        let layer = match &prefill {
            Some(layer) => Rc::clone(layer),
            None => prefill.insert(Rc::new(RefCell::new(Layer::new(gpu, &c, &w, 8192 + 64, 64, 8192)?))).clone(),
        };
        // Also in plain stream order (no kernel starts before the previous one
        // ends), and from 2048 tokens with every projection storing by TMA.
        let tma_store = (t >= 2048).then_some((true, GemmVersion::TmaStore));
        for (overlap, gemm) in [(true, GemmVersion::Auto), (false, GemmVersion::Auto)].into_iter().chain(tma_store) {
            let tag = match (overlap, gemm) {
                (_, GemmVersion::TmaStore) => " [TmaStore]",
                (false, _) => " [no overlap]",
                _ => "",
            };
            let name = format!("{}{tag}", prefill_name(t));
            if !wanted(&name) {
                continue;
            }
            let (layer, x) = (layer.clone(), upload::<bf16>(gpu, 52, &[t, c.d_model], 1.0)?);
            let mut out = Tensor::<bf16>::filled(gpu, &[t, c.d_model], bf16::POISON)?;
            cases.push(Case {
                name,
                bytes: 0,
                flops: (2 * t * weight_elems) as f64 + 2.0 * (c.n_heads * t * t * c.head_dim) as f64,
                run: Box::new(move |gpu| {
                    gpu.with_programmatic_launch(overlap, || {
                        let mut l = layer.borrow_mut();
                        let s = l.add_sequence();
                        l.prefill_gemm = gemm;
                        let r = l.prefill(gpu, &[s], &[t], &x, &mut out);
                        l.prefill_gemm = GemmVersion::Auto;
                        r?;
                        l.release(s)
                    })
                }),
            });
        }
    }
    for b in batches.into_iter().filter(|&b| decode_wanted(b)) {
        // Room for the plain and the six graph cases' 35 steps each (245 of 256).
        let layer = Rc::new(RefCell::new(Layer::new(gpu, &c, &w, b * (len + 256), 64, len + 256)?));
        let mut l = layer.borrow_mut();
        let seqs: Vec<_> = (0..b).map(|_| l.add_sequence()).collect();
        // The contexts, 16 sequences per prefill (b128's in one would take ~40 GB of scratch).
        let group = if b % 16 == 0 { 16 } else { b };
        let prompt = upload::<bf16>(gpu, 53, &[group * (len - 1), c.d_model], 1.0)?;
        let mut sink = Tensor::<bf16>::filled(gpu, &[group * (len - 1), c.d_model], bf16::POISON)?;
        for part in seqs.chunks(group) {
            l.prefill(gpu, part, &vec![len - 1; part.len()], &prompt, &mut sink)?;
        }
        drop((prompt, sink, l));
        let bytes = 2 * weight_elems + 2 * (b * len * c.kv_dim()) * 2;
        let x = Rc::new(upload::<bf16>(gpu, 54, &[b, c.d_model], 1.0)?);
        let out = Rc::new(RefCell::new(Tensor::<bf16>::filled(gpu, &[b, c.d_model], bf16::POISON)?));
        let (lp, sp, xp, op) = (layer.clone(), seqs.clone(), x.clone(), out.clone());
        cases.push(Case {
            name: decode_name(b),
            bytes,
            flops: 0.0,
            run: Box::new(move |gpu| lp.borrow_mut().decode(gpu, &sp, &xp, &mut op.borrow_mut())),
        });
        for (overlap, version, fuse, tag) in graphs {
            let (layer, seqs, x, out) = (layer.clone(), seqs.clone(), x.clone(), out.clone());
            let mut graph = None;
            cases.push(Case {
                name: graph_name(b, tag),
                bytes,
                flops: 0.0,
                run: Box::new(move |gpu| {
                    let mut l = layer.borrow_mut();
                    let mut o = out.borrow_mut();
                    match graph.as_mut() {
                        None => {
                            let was = (l.decode_version, l.fuse_split_finishes);
                            (l.decode_version, l.fuse_split_finishes) = (version, fuse);
                            let g = gpu.with_programmatic_launch(overlap, || l.capture_decode(gpu, &seqs, &x, &mut o));
                            (l.decode_version, l.fuse_split_finishes) = was;
                            graph = Some(g?);
                        }
                        // In place, as PyTorch replays its graph: the graph's own input
                        // (x since the capture) and output, no copies.
                        Some(g) => l.replay_decode(gpu, g)?,
                    }
                    Ok(())
                }),
            });
        }
    }
    Ok(cases)
}

#[cfg(test)]
mod tests {
    use super::{key_keeps, round_order, shape_groups, shape_of};

    #[test]
    fn rounds_put_every_case_first_and_after_its_neighbours_alike() {
        for n in [2usize, 3, 4, 5, 18] {
            let rounds = 2 * n;
            let (mut first, mut after) = (vec![0; n], vec![vec![0; n]; n]);
            let mut prev: Option<usize> = None;
            for r in 0..rounds {
                let order = round_order(r, n);
                let mut sorted = order.clone();
                sorted.sort();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "round {r} of {n}");
                first[order[0]] += 1;
                for &i in &order {
                    if let Some(p) = prev.filter(|&p| p != i) {
                        after[i][p] += 1;
                    }
                    prev = Some(i);
                }
            }
            assert!(first.iter().all(|&f| f == 2), "{n} cases: firsts {first:?}");
            // Case 0 follows case 1 as often as case n − 1, give or take the
            // turn between the first and the last round.
            if n > 2 {
                let (a, b): (i32, i32) = (after[0][1], after[0][n - 1]);
                assert!((a - b).abs() <= 1, "{n} cases: after 1 {a}, after {} {b}", n - 1);
            }
        }
    }

    #[test]
    fn only_keys_take_substrings_or_exact_names() {
        assert!(key_keeps("mlp+residual t1", "swiglu mlp+residual t16 [graph]"));
        assert!(key_keeps("=swiglu mlp+residual t16", "swiglu mlp+residual t16"));
        assert!(!key_keeps("=swiglu mlp+residual t16", "swiglu mlp+residual t16 [graph]"));
        assert!(!key_keeps("decode attn", "layer decode b1 L4096"));
    }

    #[test]
    fn versions_of_one_shape_group_together_in_order() {
        let names = [
            "attn ours hd128 s4096 b4 h16 causal0",
            "attn ours hd128 s4096 b4 h16 causal1",
            "attn ours hd128 s4096 b4 h16 causal0 [HopperTurns]",
            "gemm bf16 x@w.T m512 n4096 k4096 [Tma]",
            "attn ours hd128 s4096 b4 h16 causal1 [HopperOneTile]",
        ];
        assert_eq!(shape_of(names[2]), names[0]);
        // Measuring conditions stay: a cold row is not timed among warm ones.
        assert_eq!(shape_of("decode attn b1 L4096 [Wide] [cold, graph]"), "decode attn b1 L4096 [cold, graph]");
        assert_eq!(shape_groups(&["d [cold]", "d", "d [V1] [cold]"]), vec![vec![0, 2], vec![1]]);
        assert_eq!(shape_groups(&names), vec![vec![0, 2], vec![1, 4], vec![3]]);
    }
}
