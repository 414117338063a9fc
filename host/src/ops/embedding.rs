//! Embedding lookup (`embedding_gather`): `out[i, :] = table[ids[i], :]` for a
//! `[vocab, d]` bf16 table, `d` a multiple of 8 (16-byte vectors).
//!
//! [`embedding`] takes the ids from the host and refuses any id ≥ vocab before
//! anything is uploaded or launched. [`embedding_sampled`] and
//! [`embedding_device_ids`] read ids already on the GPU (the sampler's output,
//! possibly inside a CUDA graph), which the host cannot check: there the kernel
//! writes a row of zeros for an id ≥ vocab instead of reading past the table.

use super::decode::upload_async;
use super::sampling::SampleOutput;
use super::{row_grid, same_shape, MAX_ROWS};
use crate::error::{cuda, Error, Result};
use crate::kernels::EMBEDDING_GATHER;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use abi::EmbeddingArgs;
use cust::memory::DeviceBuffer;
use half::bf16;

/// Elements per 16-byte vector: rows are whole vectors.
const LANES: usize = 8;
/// Vectors one thread of the kernel loads before storing (its `UNROLL`).
const VECTORS_PER_THREAD: usize = 4;

/// A validated launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmbeddingPlan {
    pub n: u32,
    pub vocab: u32,
    pub d: u32,
    pub threads: u32,
    /// Blocks; past one per row, each block loops over rows.
    pub grid: u32,
}

/// Checks a lookup of `n` ids in a `[vocab, d]` table into `out` (`[n, d]`) and
/// sizes the launch. Pure: no GPU.
pub fn plan(table: &[usize], n: usize, out: &[usize]) -> Result<EmbeddingPlan> {
    let &[vocab, d] = table else {
        return Err(Error::Shape(format!("embedding: table of shape {table:?}, expected [vocab, d]")));
    };
    if vocab == 0 || d == 0 || n == 0 {
        return Err(Error::Empty(format!("embedding: {n} ids into a table of shape {table:?}")));
    }
    if !d.is_multiple_of(LANES) {
        return Err(Error::Alignment(format!("embedding: d {d} must be a multiple of {LANES} (16-byte rows)")));
    }
    if vocab > u32::MAX as usize || d > u32::MAX as usize || n > MAX_ROWS {
        return Err(Error::TooLarge(format!(
            "embedding: {n} ids into a table of shape {table:?}; at most {MAX_ROWS} ids, u32 vocab and d"
        )));
    }
    same_shape("embedding", "out", &[n, d], out)?;
    let per_pass = (d / LANES).div_ceil(VECTORS_PER_THREAD);
    let threads = (per_pass.div_ceil(32) * 32).min(EMBEDDING_GATHER.max_threads() as usize) as u32;
    Ok(EmbeddingPlan { n: n as u32, vocab: vocab as u32, d: d as u32, threads, grid: row_grid(n as u32) })
}

/// Every id below `vocab`.
pub fn check_ids(ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= vocab) {
        Some(i) => Err(Error::InvalidArgument(format!("embedding: id {} at {i} is not below vocab {vocab}", ids[i]))),
        None => Ok(()),
    }
}

/// `out[i, :] = table[ids[i], :]`: `table` `[vocab, d]`, `out` `[ids.len(), d]`.
/// Every id is checked against vocab before anything is uploaded or launched.
/// The ids go up in a stream-ordered buffer (allocated, copied and freed on the
/// GPU's stream: no synchronization).
pub fn embedding(gpu: &Gpu, table: &Tensor<bf16>, ids: &[u32], out: &mut Tensor<bf16>) -> Result<()> {
    let p = plan(table.shape(), ids.len(), out.shape())?;
    check_ids(ids, p.vocab as usize)?;
    let stream = gpu.stream();
    // SAFETY: u32 has no invalid bit patterns; every entry is uploaded below,
    // on the same stream, before the launch reads it.
    let buf =
        unsafe { DeviceBuffer::<u32>::uninitialized_async(ids.len(), stream) }.map_err(cuda("cuMemAllocAsync"))?;
    upload_async(gpu, &buf, ids)?;
    // SAFETY: buf holds ids.len() u32 and is freed on the stream after the launch.
    let launched = unsafe { launch(gpu, &p, table, buf.as_device_ptr().as_raw(), out) };
    buf.drop_async(stream).map_err(cuda("cuMemFreeAsync"))?;
    launched
}

/// [`embedding`] with the ids the sampler wrote (`tokens.batch()` of them, in
/// `out`'s rows); an id ≥ vocab (or a row the sampler has not written yet,
/// `u32::MAX`) gives a row of zeros. Stream-ordered after the sampling launch.
pub fn embedding_sampled(gpu: &Gpu, table: &Tensor<bf16>, tokens: &SampleOutput, out: &mut Tensor<bf16>) -> Result<()> {
    // SAFETY: the output owns its `batch` token ids and frees them with
    // cuMemFree, which synchronizes with queued work, as every tensor's drop does.
    unsafe { embedding_device_ids(gpu, table, tokens.tokens_ptr(), tokens.batch(), out) }
}

/// [`embedding`] with `n` ids already on the GPU at `ids_ptr`, which the host
/// does not read: an id ≥ vocab gives a row of zeros. The launch may overlap
/// the previous kernel's tail (programmatic dependent launch); it reads the ids
/// only once that kernel has finished.
///
/// # Safety
/// `ids_ptr` must address `n` u32 in device memory of this GPU's context that
/// stay allocated until the launch has run, and that no launch running
/// concurrently with it writes.
pub unsafe fn embedding_device_ids(
    gpu: &Gpu,
    table: &Tensor<bf16>,
    ids_ptr: u64,
    n: usize,
    out: &mut Tensor<bf16>,
) -> Result<()> {
    let p = plan(table.shape(), n, out.shape())?;
    if ids_ptr == 0 || !ids_ptr.is_multiple_of(4) {
        return Err(Error::Alignment(format!("embedding: ids at {ids_ptr:#x} (must be non-null, 4-byte aligned)")));
    }
    launch(gpu, &p, table, ids_ptr, out)
}

/// # Safety
/// `p` is `plan`'s for these tensors, and `ids` addresses `p.n` u32 (the
/// caller's contract).
unsafe fn launch(gpu: &Gpu, p: &EmbeddingPlan, table: &Tensor<bf16>, ids: u64, out: &mut Tensor<bf16>) -> Result<()> {
    let args = EmbeddingArgs {
        table: table.device_ptr(),
        ids,
        out: out.device_ptr(),
        n: p.n,
        vocab: p.vocab,
        d: p.d,
        _pad: 0,
    };
    // SAFETY: the plan checked table [vocab, d] and out [n, d], whole 16-byte
    // rows (buffers start 256-byte aligned); the kernel reads a table row only
    // for an id below vocab. It waits for earlier kernels before reading the
    // ids or writing out: it may overlap them.
    gpu.launch_after(EMBEDDING_GATHER, (p.grid, 1, 1), p.threads, 0, &args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_fit_the_row() {
        let p = plan(&[128256, 4096], 5, &[5, 4096]).unwrap();
        assert_eq!(p, EmbeddingPlan { n: 5, vocab: 128256, d: 4096, threads: 128, grid: 5 });
        assert_eq!(plan(&[7, 8], 1, &[1, 8]).unwrap().threads, 32);
        assert_eq!(plan(&[7, 8192], 1, &[1, 8192]).unwrap().threads, 256);
        assert_eq!(plan(&[7, 65536], 1, &[1, 65536]).unwrap().threads, 256);
        // More rows than row_grid's cap: the blocks loop.
        let rows = (1 << 20) + 3;
        assert_eq!(plan(&[2, 8], rows, &[rows, 8]).unwrap().grid, 1 << 20);
    }

    #[test]
    fn rejects_bad_shapes() {
        let shape = |r: Result<EmbeddingPlan>| matches!(r, Err(Error::Shape(_)));
        assert!(shape(plan(&[7], 1, &[1, 8])));
        assert!(shape(plan(&[7, 8, 1], 1, &[1, 8])));
        assert!(shape(plan(&[7, 8], 2, &[1, 8])));
        assert!(shape(plan(&[7, 8], 2, &[2, 16])));
        assert!(shape(plan(&[7, 8], 2, &[16])));
        assert!(matches!(plan(&[0, 8], 1, &[1, 8]), Err(Error::Empty(_))));
        assert!(matches!(plan(&[7, 0], 1, &[1, 0]), Err(Error::Empty(_))));
        assert!(matches!(plan(&[7, 8], 0, &[0, 8]), Err(Error::Empty(_))));
        assert!(matches!(plan(&[7, 12], 1, &[1, 12]), Err(Error::Alignment(_))));
        assert!(matches!(plan(&[1 << 32, 8], 1, &[1, 8]), Err(Error::TooLarge(_))));
        assert!(matches!(plan(&[7, 8], MAX_ROWS + 1, &[MAX_ROWS + 1, 8]), Err(Error::TooLarge(_))));
    }

    #[test]
    fn ids_stay_below_vocab() {
        assert!(check_ids(&[0, 6, 3], 7).is_ok());
        assert!(check_ids(&[], 1).is_ok());
        assert!(matches!(check_ids(&[0, 7, 3], 7), Err(Error::InvalidArgument(m)) if m.contains("at 1")));
        assert!(matches!(check_ids(&[u32::MAX], 128256), Err(Error::InvalidArgument(_))));
    }
}
