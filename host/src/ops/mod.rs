//! Typed launch wrappers. Each validates shapes, dtypes, sizes and alignment and
//! returns an [`Error`](crate::Error) before anything is launched.

pub mod attention;
pub mod decode;
pub mod gemm;
pub mod mlp;
pub mod rmsnorm;
pub mod rope;
pub mod softmax;
pub mod stream;

pub use attention::{flash_attention, flash_attention_with, AttentionOptions, FlashVersion, VarlenBatch};
pub use decode::{
    decode_attention, decode_attention_with, DecodeBatch, DecodeVersion, PageAllocator, PagedKvCache, SeqId,
};
pub use gemm::{linear, linear_ex, linear_residual, linear_swiglu, Epilogue, Overlap};
#[cfg(feature = "dev")]
pub use gemm::{linear_ex_with, linear_with, GemmVersion};
pub use mlp::{MlpScratch, SwiGluMlp};
pub use rmsnorm::{add_rms_norm, rms_norm};
pub use softmax::{softmax, softmax_dyn, softmax_with, SoftmaxVersion};

use crate::error::{Error, Result};

/// One compiled instance of a row kernel: `vpt` packs per thread, launchable with at
/// most `max_threads` threads (its `launch_bounds!`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowEntry {
    pub name: &'static str,
    pub vpt: u32,
    pub max_threads: u32,
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
pub fn pick_resident(entries: &[RowEntry], npacks: usize, preferred: u32) -> Option<(RowEntry, u32)> {
    let fits = |e: &&RowEntry, cap: u32| threads_for(npacks, e.vpt) <= cap.min(e.max_threads) as usize;
    [preferred, SECOND_CHOICE_THREADS, u32::MAX]
        .iter()
        .find_map(|&cap| entries.iter().find(|e| fits(e, cap)))
        .map(|e| (*e, threads_for(npacks, e.vpt).max(32) as u32))
}

/// Rows × cols of a row operation, checked against what the kernels address.
pub(crate) fn rows_cols(op: &str, shape: &[usize]) -> Result<(u32, u32)> {
    let numel: usize = shape.iter().product();
    if numel == 0 {
        return Err(Error::Empty(format!("{op}: shape {shape:?} has no elements")));
    }
    let cols = shape.last().copied().unwrap_or(1);
    let rows = numel / cols;
    let limit = u32::MAX as usize;
    if cols > limit || rows > limit {
        return Err(Error::TooLarge(format!("{op}: {rows} rows × {cols} columns exceeds {limit} per dimension")));
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

/// Blocks for a grid-strided launch over `rows` rows (the y/z limits never bind).
pub(crate) fn row_grid(rows: u32) -> u32 {
    rows.min(1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENTRIES: [RowEntry; 4] = [
        RowEntry { name: "r1", vpt: 1, max_threads: 1024 },
        RowEntry { name: "r2", vpt: 2, max_threads: 1024 },
        RowEntry { name: "r4", vpt: 4, max_threads: 1024 },
        RowEntry { name: "r8", vpt: 8, max_threads: 512 },
    ];

    #[test]
    fn picks_fewest_packs_within_preferred_block() {
        assert_eq!(pick_resident(&ENTRIES, 1, 256).map(|(e, t)| (e.name, t)), Some(("r1", 32)));
        assert_eq!(pick_resident(&ENTRIES, 1024, 256).map(|(e, t)| (e.name, t)), Some(("r4", 256)));
        assert_eq!(pick_resident(&ENTRIES, 1025, 256).map(|(e, t)| (e.name, t)), Some(("r8", 160)));
        // Past the preferred size: 512 threads, then the entry's own bound.
        assert_eq!(pick_resident(&ENTRIES, 4096, 256).map(|(e, t)| (e.name, t)), Some(("r8", 512)));
        assert_eq!(pick_resident(&ENTRIES[..3], 4096, 256).map(|(e, t)| (e.name, t)), Some(("r4", 1024)));
        assert_eq!(pick_resident(&ENTRIES, 4097, 256), None);
    }

    #[test]
    fn rejects_empty_and_oversized() {
        assert!(matches!(rows_cols("op", &[0, 5]), Err(Error::Empty(_))));
        assert!(matches!(rows_cols("op", &[1 << 33]), Err(Error::TooLarge(_))));
        assert_eq!(rows_cols("op", &[2, 3, 5]).unwrap(), (6, 5));
        assert_eq!(rows_cols("op", &[]).unwrap(), (1, 1));
    }
}
