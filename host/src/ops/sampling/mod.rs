//! Next-token sampling on the GPU: `[batch, vocab]` logits (bf16 or f32) in,
//! `[batch]` u32 token ids out (and optionally their log-probabilities), with
//! no logits copied to the host.
//!
//! Per row ([`SamplingParams`]):
//! - temperature 0: the argmax, the lowest index on ties;
//! - otherwise one draw from softmax(logits / T) restricted to the top-k logits
//!   (ties at the k-th value all kept; 0 = off), then to the nucleus: the
//!   smallest set of most probable tokens of that restricted distribution whose
//!   mass is at least `top_p` (ties at its edge kept; 1 = off).
//!
//! The draw: u = the top 24 bits of Philox-4x32-10 (key = seed, counter =
//! (step, 0)) over 2^24 ([`abi::sampling::uniform`]); the token is the first
//! kept one, in vocabulary order, whose running mass exceeds u × the kept mass.
//! It depends on (seed, step) and the logits only, not on the row: a request
//! draws the same token wherever it sits in the batch.
//!
//! NaN logits are never chosen (they rank below -inf). A row with no logit
//! above -inf gets token 0 and log-probability NaN. The log-probability is
//! under the model's own distribution: log softmax(logits) at temperature 1,
//! without top-k or top-p.
//!
//! [`plan`] checks every argument without a GPU; [`sample`] uploads the
//! parameters (stream-ordered) and launches one kernel.

use super::decode::upload_async;
use super::{row_grid, MAX_ROWS};
use crate::error::{cuda, Error, Result};
use crate::kernels as k;
use crate::runtime::{Gpu, Kernel};
use crate::tensor::{DType, Tensor};
pub use abi::sampling::{key, philox4x32, uniform, value, RowParams, NEG_INF_KEY};
use abi::SampleArgs;
use cust::memory::{CopyDestination, DeviceBuffer};
use half::bf16;

/// How one request samples its next token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 for greedy (argmax); otherwise the softmax temperature (finite, > 0).
    pub temperature: f32,
    /// Keep only the `top_k` largest logits (ties at the k-th all kept); 0: off.
    pub top_k: u32,
    /// Keep the smallest most-probable set of mass ≥ `top_p`, in (0, 1]; 1: off.
    pub top_p: f32,
    /// The request's seed.
    pub seed: u64,
    /// The decoding step: a new step gives a new, independent draw.
    pub step: u64,
}

impl SamplingParams {
    /// The argmax, whatever the seed.
    pub const GREEDY: SamplingParams = SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0, step: 0 };

    /// Plain sampling at `temperature` from `seed` at `step`, no top-k or top-p.
    pub fn new(temperature: f32, seed: u64, step: u64) -> SamplingParams {
        SamplingParams { temperature, top_k: 0, top_p: 1.0, seed, step }
    }

    /// What the kernel reads for this row.
    pub fn row(&self) -> RowParams {
        let split = |v: u64| [v as u32, (v >> 32) as u32];
        RowParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            _pad: 0,
            seed: split(self.seed),
            step: split(self.step),
        }
    }

    /// The uniform in [0, 1) this request draws with (as the kernel computes it).
    pub fn uniform(&self) -> f32 {
        let r = self.row();
        abi::sampling::uniform(r.seed, r.step)
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams::GREEDY
    }
}

/// u32 words of one row's [`RowParams`] on the device.
const ROW_WORDS: usize = std::mem::size_of::<RowParams>() / 4;

fn row_words(p: &RowParams) -> [u32; ROW_WORDS] {
    [p.temperature.to_bits(), p.top_k, p.top_p.to_bits(), p._pad, p.seed[0], p.seed[1], p.step[0], p.step[1]]
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// Logit element types, each with its kernel (sealed: the kernel reads that size).
pub trait LogitType: DType + sealed::Sealed {
    const KERNEL: Kernel<SampleArgs>;
}

impl LogitType for bf16 {
    const KERNEL: Kernel<SampleArgs> = k::SAMPLE_BF16;
}

impl LogitType for f32 {
    const KERNEL: Kernel<SampleArgs> = k::SAMPLE_F32;
}

/// The longest row the kernels take: their u32 element indices step by at most
/// a tile past the row's end, which must not wrap.
pub const MAX_VOCAB: usize = 1 << 31;

/// A validated launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingPlan {
    pub kernel: Kernel<SampleArgs>,
    pub threads: u32,
    /// Blocks; past one per row, each block loops over rows.
    pub grid: u32,
    pub batch: u32,
    pub vocab: u32,
}

/// Checks one row's parameters against a vocabulary of `vocab`.
pub fn check_params(row: usize, p: &SamplingParams, vocab: usize) -> Result<()> {
    let bad = |what: String| Err(Error::InvalidArgument(format!("sample: row {row}: {what}")));
    if !(p.temperature.is_finite() && p.temperature >= 0.0) {
        return bad(format!("temperature {} (must be finite and ≥ 0)", p.temperature));
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        return bad(format!("top_p {} (must be in (0, 1])", p.top_p));
    }
    if p.top_k as usize > vocab {
        return bad(format!("top_k {} above the vocabulary of {vocab}", p.top_k));
    }
    Ok(())
}

/// Validates a call on `[batch, vocab]` logits with one [`SamplingParams`] per
/// row into an output of `out_batch` rows, and sizes the launch. Pure: no GPU.
pub fn plan<T: LogitType>(logits_shape: &[usize], params: &[SamplingParams], out_batch: usize) -> Result<SamplingPlan> {
    let &[batch, vocab] = logits_shape else {
        return Err(Error::Shape(format!("sample: logits of shape {logits_shape:?}, expected [batch, vocab]")));
    };
    if batch == 0 || vocab == 0 {
        return Err(Error::Empty(format!("sample: logits of shape {logits_shape:?}")));
    }
    if batch > MAX_ROWS || vocab > MAX_VOCAB {
        return Err(Error::TooLarge(format!(
            "sample: {batch} rows × {vocab} logits; at most {MAX_ROWS} rows of {MAX_VOCAB}"
        )));
    }
    if params.len() != batch {
        return Err(Error::Shape(format!("sample: {} parameter rows for {batch} logit rows", params.len())));
    }
    if out_batch != batch {
        return Err(Error::Shape(format!("sample: an output of {out_batch} rows for {batch} logit rows")));
    }
    for (row, p) in params.iter().enumerate() {
        check_params(row, p, vocab)?;
    }
    let kernel = T::KERNEL;
    // Short rows take fewer warps: every threshold step is a block reduction.
    let threads = (vocab.div_ceil(32) * 32).min(kernel.max_threads() as usize) as u32;
    Ok(SamplingPlan { kernel, threads, grid: row_grid(batch as u32), batch: batch as u32, vocab: vocab as u32 })
}

/// Device buffers of one sampling call: the rows' parameters, the `[batch]`
/// u32 token ids and, if asked for, the `[batch]` f32 log-probabilities. New
/// buffers hold token `u32::MAX` and log-probability NaN until a call writes them.
pub struct SampleOutput {
    params: DeviceBuffer<u32>,
    tokens: DeviceBuffer<u32>,
    logprobs: Option<DeviceBuffer<f32>>,
    batch: usize,
}

impl SampleOutput {
    pub fn new(_gpu: &Gpu, batch: usize, with_logprobs: bool) -> Result<SampleOutput> {
        if batch == 0 {
            return Err(Error::Empty("sample: an output of 0 rows".into()));
        }
        if batch > MAX_ROWS {
            return Err(Error::TooLarge(format!("sample: an output of {batch} rows; at most {MAX_ROWS}")));
        }
        // SAFETY: u32 and f32 have no invalid bit patterns; the parameters are
        // uploaded in full before every launch, the outputs set just below.
        let mut tokens = unsafe { DeviceBuffer::<u32>::uninitialized(batch) }.map_err(cuda("cuMemAlloc"))?;
        tokens.set_32(u32::MAX).map_err(cuda("cuMemsetD32"))?;
        let logprobs = if with_logprobs {
            let mut l = unsafe { DeviceBuffer::<f32>::uninitialized(batch) }.map_err(cuda("cuMemAlloc"))?;
            l.set_32(f32::NAN.to_bits()).map_err(cuda("cuMemsetD32"))?;
            Some(l)
        } else {
            None
        };
        let params = unsafe { DeviceBuffer::<u32>::uninitialized(batch * ROW_WORDS) }.map_err(cuda("cuMemAlloc"))?;
        // The memsets run on the legacy stream, unordered with ours: finish them.
        cust::context::CurrentContext::synchronize().map_err(cuda("cuCtxSynchronize"))?;
        Ok(SampleOutput { params, tokens, logprobs, batch })
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Device address of the `[batch]` u32 token ids (for the next step's
    /// embedding lookup).
    pub fn tokens_ptr(&self) -> u64 {
        self.tokens.as_device_ptr().as_raw()
    }

    /// The drawn tokens' buffer, for a collective that replaces them.
    pub(crate) fn tokens_mut(&mut self) -> &mut DeviceBuffer<u32> {
        &mut self.tokens
    }

    /// Sets the token ids (stream-ordered): a step's input when the ids come
    /// from the host rather than from the previous step's draw.
    pub fn set_tokens(&self, gpu: &Gpu, ids: &[u32]) -> Result<()> {
        if ids.len() != self.batch {
            return Err(Error::Shape(format!("{} token ids into an output of {} rows", ids.len(), self.batch)));
        }
        upload_async(gpu, &self.tokens, ids)
    }

    /// Downloads the token ids (waits for the GPU's stream).
    pub fn tokens(&self, gpu: &Gpu) -> Result<Vec<u32>> {
        gpu.synchronize()?;
        let mut v = vec![0u32; self.batch];
        self.tokens.copy_to(&mut v[..]).map_err(cuda("cuMemcpyDtoH"))?;
        Ok(v)
    }

    /// Downloads the log-probabilities, if this output keeps them.
    pub fn logprobs(&self, gpu: &Gpu) -> Result<Option<Vec<f32>>> {
        let Some(l) = &self.logprobs else { return Ok(None) };
        gpu.synchronize()?;
        let mut v = vec![0f32; self.batch];
        l.copy_to(&mut v[..]).map_err(cuda("cuMemcpyDtoH"))?;
        Ok(Some(v))
    }
}

/// Samples one token per row of `logits` (`[batch, vocab]`) with `params[row]`
/// into `out`, which must have `batch` rows. Every argument is checked before
/// anything is uploaded or launched.
pub fn sample<T: LogitType>(
    gpu: &Gpu,
    logits: &Tensor<T>,
    params: &[SamplingParams],
    out: &mut SampleOutput,
) -> Result<()> {
    let p = stage::<T>(gpu, logits.shape(), params, out)?;
    // SAFETY: staged just above for this shape and output, on the same stream.
    unsafe { launch(gpu, &p, logits, out) }
}

/// The first half of [`sample`]: checks a call and uploads its rows'
/// parameters into `out` (stream-ordered). A captured graph replays only the
/// launch, so its parameters are staged anew before every replay.
pub(crate) fn stage<T: LogitType>(
    gpu: &Gpu,
    logits_shape: &[usize],
    params: &[SamplingParams],
    out: &SampleOutput,
) -> Result<SamplingPlan> {
    let p = plan::<T>(logits_shape, params, out.batch)?;
    let words: Vec<u32> = params.iter().flat_map(|r| row_words(&r.row())).collect();
    upload_async(gpu, &out.params, &words)?;
    Ok(p)
}

/// The second half of [`sample`].
///
/// # Safety
/// `p` comes from [`stage`] for `logits`' shape and this `out`.
pub(crate) unsafe fn launch<T: LogitType>(
    gpu: &Gpu,
    p: &SamplingPlan,
    logits: &Tensor<T>,
    out: &mut SampleOutput,
) -> Result<()> {
    let args = SampleArgs {
        logits: logits.device_ptr(),
        params: out.params.as_device_ptr().as_raw(),
        tokens: out.tokens_ptr(),
        logprobs: out.logprobs.as_ref().map_or(0, |l| l.as_device_ptr().as_raw()),
        batch: p.batch,
        vocab: p.vocab,
        row_stride: p.vocab,
        _pad: 0,
    };
    // SAFETY: the plan checked that logits holds batch × vocab contiguous
    // elements of T (T's own kernel reads that size) and that `out` has batch
    // rows: batch parameter rows (uploaded by `stage`, on the same stream), batch
    // token ids and, where its pointer is non-zero, batch log-probabilities.
    unsafe { gpu.launch(p.kernel, (p.grid, 1, 1), p.threads, 0, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(p: SamplingParams) -> Vec<SamplingParams> {
        vec![p; 3]
    }

    #[test]
    fn philox_matches_known_answers() {
        // Random123's known-answer vectors for Philox-4x32-10.
        assert_eq!(philox4x32([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniform_is_in_range_and_depends_on_seed_and_step() {
        let u = |seed, step| SamplingParams::new(1.0, seed, step).uniform();
        assert_eq!(u(0, 0), (0x6627e8d5u32 >> 8) as f32 / 16_777_216.0);
        let mut seen = std::collections::HashSet::new();
        for seed in 0..50u64 {
            for step in 0..50u64 {
                let v = u(seed << 40 | seed, step << 33 | step);
                assert!((0.0..1.0).contains(&v));
                seen.insert(v.to_bits());
            }
        }
        assert!(seen.len() > 2490, "{} distinct of 2500", seen.len());
        // 40000 draws: the mean's standard deviation is 0.0014; allow 5 of them.
        let mean: f64 = (1..5u64).flat_map(|seed| (0..10000u64).map(move |s| u(seed, s) as f64)).sum::<f64>() / 40000.0;
        assert!((mean - 0.5).abs() < 0.0072, "mean {mean}");
    }

    #[test]
    fn keys_order_values_and_put_nan_lowest() {
        let vals = [f32::NEG_INFINITY, -3e38, -1.5, -1e-40, 0.0, 1e-40, 2.0, 3e38, f32::INFINITY];
        for w in vals.windows(2) {
            assert!(key(w[0]) < key(w[1]), "{w:?}");
        }
        for v in vals {
            assert_eq!(value(key(v)), v);
            assert!(key(v) > 0);
        }
        assert_eq!(key(-0.0), key(0.0));
        assert_eq!(key(f32::NEG_INFINITY), NEG_INF_KEY);
        assert_eq!(key(f32::NAN), 0);
        assert_eq!(key(-f32::NAN), 0);
        // bf16 values: keys with 16 zero low bits.
        for b in [0x0000u16, 0x8000, 0x3f80, 0xbf80, 0xff80, 0x7f80, 0x0001, 0x8001, 0xc2f7] {
            let k = key(f32::from_bits((b as u32) << 16));
            assert_eq!(k & 0xffff, 0, "{b:#x}");
        }
    }

    #[test]
    fn plans_fit_the_row() {
        let p = plan::<bf16>(&[4, 151936], &ok(SamplingParams::GREEDY)[..1].repeat(4), 4).unwrap();
        assert_eq!((p.kernel.name(), p.threads, p.grid, p.batch, p.vocab), ("sample_bf16", 512, 4, 4, 151936));
        let p = plan::<f32>(&[1, 1], &[SamplingParams::new(0.7, 1, 2)], 1).unwrap();
        assert_eq!((p.kernel.name(), p.threads), ("sample_f32", 32));
        let p = plan::<f32>(&[2, 33], &[SamplingParams::GREEDY; 2], 2).unwrap();
        assert_eq!(p.threads, 64);
        // More rows than row_grid's cap: the blocks loop.
        let rows = (1 << 20) + 1;
        let p = plan::<bf16>(&[rows, 8], &vec![SamplingParams::GREEDY; rows], rows);
        assert!(p.is_ok_and(|p| p.grid == 1 << 20 && p.batch == rows as u32));
    }

    #[test]
    fn rejects_bad_arguments() {
        let g = SamplingParams::GREEDY;
        let shape = |e: Result<SamplingPlan>| matches!(e, Err(Error::Shape(_)));
        let invalid = |e: Result<SamplingPlan>| matches!(e, Err(Error::InvalidArgument(_)));
        assert!(shape(plan::<f32>(&[3], &ok(g), 3)));
        assert!(shape(plan::<f32>(&[1, 3, 5], &ok(g), 3)));
        assert!(matches!(plan::<f32>(&[0, 5], &[], 0), Err(Error::Empty(_))));
        assert!(matches!(plan::<f32>(&[3, 0], &ok(g), 3), Err(Error::Empty(_))));
        assert!(matches!(plan::<f32>(&[3, MAX_VOCAB + 1], &ok(g), 3), Err(Error::TooLarge(_))));
        assert!(matches!(plan::<f32>(&[MAX_ROWS + 1, 2], &ok(g), 3), Err(Error::TooLarge(_))));
        assert!(shape(plan::<f32>(&[3, 5], &ok(g)[..2], 3)));
        assert!(shape(plan::<f32>(&[3, 5], &ok(g), 4)));
        for bad in [
            SamplingParams { temperature: -0.5, ..g },
            SamplingParams { temperature: f32::NAN, ..g },
            SamplingParams { temperature: f32::INFINITY, ..g },
            SamplingParams { top_p: 0.0, ..g },
            SamplingParams { top_p: 1.01, ..g },
            SamplingParams { top_p: f32::NAN, ..g },
            SamplingParams { top_k: 6, ..g },
        ] {
            let mut rows = ok(g);
            rows[2] = bad;
            assert!(invalid(plan::<bf16>(&[3, 5], &rows, 3)), "{bad:?}");
        }
        assert!(plan::<bf16>(&[3, 5], &ok(SamplingParams { top_k: 5, top_p: 1e-6, ..g }), 3).is_ok());
    }

    #[test]
    fn rows_keep_their_words() {
        let p = SamplingParams { temperature: 0.5, top_k: 40, top_p: 0.9, seed: 0x1_0000_0002, step: 0x3_0000_0004 };
        let r = p.row();
        assert_eq!((r.seed, r.step), ([2, 1], [4, 3]));
        assert_eq!(row_words(&r), [0.5f32.to_bits(), 40, 0.9f32.to_bits(), 0, 2, 1, 4, 3]);
        assert_eq!(ROW_WORDS, 8);
    }
}
