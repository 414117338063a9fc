//! Typed launch wrappers. Each validates shapes, dtypes, sizes and alignment and
//! returns an [`crate::Error`] before anything is launched.

pub mod attention;
pub mod decode;
pub mod embedding;
pub mod gemm;
pub mod mlp;
pub mod random;
pub mod rmsnorm;
pub mod rope;
pub mod sampling;
pub mod softmax;
#[cfg(feature = "dev")]
pub mod stream;

pub use attention::{flash_attention, AttentionOptions, VarlenBatch};
#[cfg(feature = "dev")]
pub use attention::{flash_attention_with, FlashVersion};
pub use decode::{decode_attention, BatchBuffers, DecodeBatch, KvLayer, PageAllocator, PagedKvCache, SeqId};
#[cfg(feature = "dev")]
pub use decode::{decode_attention_with, DecodeVersion};
pub use embedding::{embedding, embedding_device_ids, embedding_sampled};
pub use gemm::{linear, linear_ex, linear_residual, linear_swiglu, Epilogue, Overlap};
#[cfg(feature = "dev")]
pub use gemm::{linear_ex_with, linear_with, GemmVersion};
pub use mlp::{MlpScratch, SwiGluMlp};
pub use random::{fill_random, fill_random_with_outliers};
pub use rmsnorm::{add_rms_norm, rms_norm};
#[cfg(feature = "dev")]
pub use rope::linear_rope_qkv_cache;
pub use rope::{rope_qkv_cache, RopeTable};
pub use sampling::{sample, SampleOutput, SamplingParams};
#[cfg(feature = "dev")]
pub use softmax::dev::{softmax_with, SoftmaxVersion};
pub use softmax::{softmax, softmax_dyn};

use crate::error::{Error, Result};
use crate::runtime::Kernel;

/// One compiled instance of a row kernel: `vpt` packs per thread (the `_rN` of
/// its name), launchable with at most `kernel.max_threads()` threads.
pub struct RowEntry<A> {
    pub kernel: Kernel<A>,
    pub vpt: u32,
}

impl<A> Clone for RowEntry<A> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<A> Copy for RowEntry<A> {}

impl<A> std::fmt::Debug for RowEntry<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} ({} per thread)", self.kernel, self.vpt)
    }
}

/// Threads for a row of `npacks` packs at `vpt` per thread, rounded up to whole warps.
fn threads_for(npacks: usize, vpt: u32) -> usize {
    npacks.div_ceil(vpt as usize).div_ceil(32) * 32
}

/// Block size tried when a row does not fit the preferred one: 512-thread blocks
/// still let two blocks share an SM, so one can load while the other reduces.
const SECOND_CHOICE_THREADS: u32 = 512;

/// The entry that holds a row of `npacks` packs with the fewest packs per thread
/// while the block stays within `preferred` threads; failing that, within 512
/// threads; failing that, the first that fits its own launch bound. `None`: the
/// row is too long to hold on chip.
pub fn pick_resident<A: abi::Params>(
    entries: &[RowEntry<A>],
    npacks: usize,
    preferred: u32,
) -> Option<(RowEntry<A>, u32)> {
    let fits = |e: &&RowEntry<A>, cap: u32| threads_for(npacks, e.vpt) <= cap.min(e.kernel.max_threads()) as usize;
    [preferred, SECOND_CHOICE_THREADS, u32::MAX]
        .iter()
        .find_map(|&cap| entries.iter().find(|e| fits(e, cap)))
        .map(|e| (*e, threads_for(npacks, e.vpt).max(32) as u32))
}

/// The most rows a row operation takes: the kernels step a u32 row index by the
/// grid size (`row_grid`'s cap at most), which must not wrap past `u32::MAX`.
pub const MAX_ROWS: usize = (u32::MAX - MAX_ROW_BLOCKS) as usize;
/// The most columns a row operation takes (the kernels' u32 column count).
pub const MAX_COLS: usize = u32::MAX as usize;

/// Rows × cols of a row operation, checked against what the kernels address.
pub(crate) fn rows_cols(op: &str, shape: &[usize]) -> Result<(u32, u32)> {
    let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let Some(numel) = numel else {
        return Err(Error::TooLarge(format!("{op}: shape {shape:?} overflows usize")));
    };
    if numel == 0 {
        return Err(Error::Empty(format!("{op}: shape {shape:?} has no elements")));
    }
    let cols = shape.last().copied().unwrap_or(1);
    let rows = numel / cols;
    if cols > MAX_COLS || rows > MAX_ROWS {
        return Err(Error::TooLarge(format!(
            "{op}: {rows} rows × {cols} columns; at most {MAX_ROWS} rows and {MAX_COLS} columns"
        )));
    }
    Ok((rows as u32, cols as u32))
}

pub(crate) fn same_shape(op: &str, what: &str, expected: &[usize], got: &[usize]) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::Shape(format!("{op}: {what} has shape {got:?}, expected {expected:?}")))
    }
}

/// Most blocks of a grid-strided row launch: past it the kernels loop over rows.
const MAX_ROW_BLOCKS: u32 = 1 << 20;

/// Blocks for a grid-strided launch over `rows` rows (the y/z limits never bind).
pub(crate) fn row_grid(rows: u32) -> u32 {
    rows.min(MAX_ROW_BLOCKS)
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn entry(name: &'static str, vpt: u32, max_threads: u32) -> RowEntry<abi::SoftmaxArgs> {
        RowEntry { kernel: Kernel::new(name, max_threads), vpt }
    }
    const ENTRIES: [RowEntry<abi::SoftmaxArgs>; 4] =
        [entry("r1", 1, 1024), entry("r2", 2, 1024), entry("r4", 4, 1024), entry("r8", 8, 512)];

    fn pick(entries: &[RowEntry<abi::SoftmaxArgs>], npacks: usize, preferred: u32) -> Option<(&'static str, u32)> {
        pick_resident(entries, npacks, preferred).map(|(e, t)| (e.kernel.name(), t))
    }

    #[test]
    fn picks_fewest_packs_within_preferred_block() {
        assert_eq!(pick(&ENTRIES, 1, 256), Some(("r1", 32)));
        assert_eq!(pick(&ENTRIES, 1024, 256), Some(("r4", 256)));
        assert_eq!(pick(&ENTRIES, 1025, 256), Some(("r8", 160)));
        // Past the preferred size: 512 threads, then the entry's own bound.
        assert_eq!(pick(&ENTRIES, 4096, 256), Some(("r8", 512)));
        assert_eq!(pick(&ENTRIES[..3], 4096, 256), Some(("r4", 1024)));
        assert_eq!(pick(&ENTRIES, 4097, 256), None);
    }

    #[test]
    fn rejects_empty_and_oversized() {
        assert!(matches!(rows_cols("op", &[0, 5]), Err(Error::Empty(_))));
        assert!(matches!(rows_cols("op", &[1 << 33]), Err(Error::TooLarge(_))));
        assert!(matches!(rows_cols("op", &[usize::MAX, 2, 0]), Err(Error::TooLarge(_))));
        assert!(matches!(rows_cols("op", &[MAX_ROWS + 1, 1]), Err(Error::TooLarge(_))));
        assert_eq!(rows_cols("op", &[MAX_ROWS, 1]).unwrap(), (MAX_ROWS as u32, 1));
        assert!(matches!(rows_cols("op", &[1, MAX_COLS + 1]), Err(Error::TooLarge(_))));
        assert_eq!(rows_cols("op", &[2, 3, 5]).unwrap(), (6, 5));
        assert_eq!(rows_cols("op", &[]).unwrap(), (1, 1));
    }
}
