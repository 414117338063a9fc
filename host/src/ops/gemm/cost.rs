//! A GEMM tile choice by cost model rather than by hand-written rules (a dev
//! version until it is measured against `Auto`): every compiled configuration
//! that can run the shape is sized as it would launch, and its time estimated
//! from waves of resident blocks, per-block work, bytes and the split's
//! round trip; the cheapest wins. Pure: no GPU needed.

use super::plan::{
    size, Schedule, Tiles, ROWS64_SPLIT, SKINNY_K128, SKINNY_K128_SPLIT, SKINNY_SPLIT, SKINNY_STREAMK, TMA_PERSISTENT,
    TMA_ROWS64, TMA_ROWS64_SPLIT, V1, V1_SPLIT,
};
use super::Epilogue;
use crate::runtime::Arch;

/// The device copy rate (bytes/s): HBM reads of unique operand bytes.
const COPY_BPS: f64 = 4.2e12;
/// L2 → SM rate (bytes/s) for tiles re-read by other blocks and for split-K's adds.
const L2_BPS: f64 = 10.0e12;
/// A launch's fixed cost (first wave's ramp included), seconds.
const LAUNCH_S: f64 = 3.0e-6;

/// What a configuration sustains: tensor work per SM when its resident blocks
/// are all busy, and the weight-streaming rate of the whole chip when the GEMM
/// is bound by reading W once (H200 figures from `docs/PERF.md` and NOTES where
/// measured; `TMA_ROWS64`'s compute rate is an estimate until measured).
struct Rates {
    flops_per_sm: f64,
    stream_bps: f64,
}

fn rates(t: &Tiles) -> Rates {
    let (flops_per_sm, stream_bps) = match t.name() {
        // 700 TFLOP/s at m2048 over 132 SMs; m64 gate/up 3245 GB/s.
        "gemm_bf16_tma_persistent" | "gemm_bf16_tma_persistent_splitk" => (5.3e12, 3.25e12),
        // Half the N of the persistent tile, one consumer warpgroup per block;
        // m64 gate/up whole-K 3448 GB/s.
        "gemm_bf16_tma_rows64" => (4.0e12, 3.45e12),
        // mma.sync 128×128: 320–375 TFLOP/s; m64 gate/up split 1940 GB/s.
        "gemm_bf16_v1" | "gemm_bf16_v1_splitk" => (2.65e12, 1.94e12),
        // mma.sync 64×128: m64 gate/up 3150 GB/s whole K (dev), down split 2689.
        "gemm_bf16_rows64_splitk" => (2.4e12, 2.7e12),
        // 16-row tiles: the MLP t1 at 92–96% of copy.
        "gemm_bf16_skinny_k128" | "gemm_bf16_skinny_k128_splitk" => (1.2e12, 3.95e12),
        _ => (1.0e12, 3.7e12),
    };
    Rates { flops_per_sm, stream_bps }
}

/// The configurations that can run on `arch`, each for the token counts where
/// its tile rows are not mostly padding.
fn candidates(m: usize, arch: Arch) -> Vec<Tiles> {
    let mut c = Vec::new();
    if arch == Arch::Sm90a {
        if m <= 16 {
            c.extend([SKINNY_K128, SKINNY_K128_SPLIT]);
        }
        c.extend([TMA_ROWS64, TMA_ROWS64_SPLIT]);
        if m > 64 {
            c.extend([TMA_PERSISTENT, super::dev::TMA_PERSISTENT_SPLIT]);
        }
    } else {
        if m <= 16 {
            c.extend([SKINNY_SPLIT, SKINNY_STREAMK]);
        }
        if m <= 64 {
            c.push(ROWS64_SPLIT);
        }
    }
    if m > 64 {
        c.extend([V1, V1_SPLIT]);
    }
    c
}

/// Estimated seconds of `tiles` on a checked `[m, k] × [n, k]` over `sm_count` SMs.
pub(crate) fn estimate(tiles: Tiles, m: usize, n: usize, k: usize, sm_count: usize) -> Option<f64> {
    let p = size(tiles, Epilogue::Plain, m, n, k, sm_count).ok()?;
    let r = rates(&tiles);
    let sm = sm_count.max(1) as f64;
    let (m_tiles, n_tiles) = (m.div_ceil(tiles.bm), n.div_ceil(tiles.bn));
    let tile_count = (m_tiles * n_tiles) as f64;
    let flops = 2.0 * (m * n * k) as f64;
    let resident = tiles.resident_per_sm.max(1) as f64;
    // A wave: every resident slot runs one block; a slot runs at its share of the SM.
    let slot_rate = r.flops_per_sm / resident;
    let (blocks, waves, per_block) = match tiles.schedule {
        // Equal shares of the iterations over resident blocks: one wave, no quantization.
        Schedule::StreamK => {
            let b = p.grid.0 as f64;
            (b, 1.0, flops / b)
        }
        // One block per SM walking tiles: rounds of `sm` tiles.
        Schedule::TmaPersistent => {
            (tile_count, (tile_count / sm).ceil(), 2.0 * (tiles.bm * tiles.bn) as f64 * k as f64)
        }
        // The same over (tile, K slice) units.
        Schedule::TmaPersistentSplit => {
            let units = (p.grid.0 as f64).max(tile_count * k.div_ceil(p.k_split as usize) as f64);
            (units, (units / sm).ceil(), 2.0 * (tiles.bm * tiles.bn) as f64 * p.k_split as f64)
        }
        _ => {
            let b = (p.grid.0 * p.grid.1 * p.grid.2) as f64;
            (b, (b / (resident * sm)).ceil(), 2.0 * (tiles.bm * tiles.bn) as f64 * p.k_split as f64)
        }
    };
    let compute = waves * per_block / slot_rate;
    // Unique bytes from HBM at the configuration's streaming rate; every block's
    // operand tiles through L2 (the HBM reads among them), overlapped.
    let unique = 2.0 * (n * k + m * k + m * n) as f64;
    let k_per_block = match tiles.schedule {
        Schedule::StreamK => (m_tiles * n_tiles * k) as f64 / blocks,
        Schedule::TmaPersistent => k as f64,
        Schedule::TmaPersistentSplit => p.k_split as f64,
        _ => p.k_split as f64,
    };
    let tile_bytes = blocks * 2.0 * (tiles.bm + tiles.bn) as f64 * k_per_block;
    let memory = (unique / r.stream_bps).max(tile_bytes / L2_BPS);
    // Split-K: each split adds its f32 tile in L2, then a finalize reads the sums
    // and writes the output; stream-K's partial tiles meet the same way.
    let splits = match tiles.schedule {
        Schedule::TmaPersistentSplit => k.div_ceil(p.k_split as usize) as f64,
        _ if tiles.uses_workspace() => p.grid.2.max(1) as f64,
        _ => 1.0,
    };
    let sums = if tiles.leaves_sums() {
        4.0 * (m * n) as f64 * splits / L2_BPS + LAUNCH_S + 10.0 * (m * n) as f64 / COPY_BPS
    } else if tiles.counts_tiles() {
        4.0 * (m * n) as f64 * 2.0 / L2_BPS
    } else {
        0.0
    };
    Some(LAUNCH_S + compute.max(memory) + sums)
}

/// The cheapest configuration for an `[m, k] × [n, k]` GEMM on `sm_count` SMs of `arch`.
pub fn cost_model_tiles(m: usize, n: usize, k: usize, sm_count: usize, arch: Arch) -> Tiles {
    candidates(m, arch)
        .into_iter()
        .filter_map(|t| estimate(t, m, n, k, sm_count).map(|s| (t, s)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(if m > 64 { V1_SPLIT } else { SKINNY_SPLIT }, |(t, _)| t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Llama-3-8B projections: QKV, O, gate/up (interleaved), down.
    const PROJECTIONS: [(usize, usize); 4] = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)];

    fn picks(m: usize, arch: Arch) -> [&'static str; 4] {
        PROJECTIONS.map(|(n, k)| cost_model_tiles(m, n, k, 132, arch).name())
    }

    #[test]
    fn hopper_choices_for_the_llama_projections() {
        let (k128, k128s) = ("gemm_bf16_skinny_k128", "gemm_bf16_skinny_k128_splitk");
        let (r64, tma) = ("gemm_bf16_tma_rows64", "gemm_bf16_tma_persistent");
        // Decode: 16-row tiles, split where their tiles leave a wave idle.
        assert_eq!(picks(1, Arch::Sm90a), [k128s, k128s, k128, k128s]);
        assert_eq!(picks(16, Arch::Sm90a), [k128s, k128s, k128, k128s]);
        // 64 tokens: 64-row wgmma tiles (one entry; split or whole K).
        assert_eq!(picks(64, Arch::Sm90a), [r64; 4]);
        // Serving sizes, where whole 128×256 tiles leave SMs idle: 64-row tiles
        // while their L2 re-reads (43 FLOP per byte against 85) cost less than
        // the persistent kernel's K split, then the split.
        let split = "gemm_bf16_tma_persistent_splitk";
        assert_eq!(picks(128, Arch::Sm90a), [split, r64, r64, r64]);
        assert_eq!(picks(256, Arch::Sm90a), [split, split, tma, split]);
        assert_eq!(picks(512, Arch::Sm90a), [tma, split, tma, split]);
        // Prefill: the persistent 128×256 kernel, whole K.
        for m in [1024, 2048, 8192] {
            assert_eq!(picks(m, Arch::Sm90a), [tma; 4], "m{m}");
        }
    }

    #[test]
    fn whole_k_where_the_tiles_fill_the_sms_split_where_they_do_not() {
        let at = |m, n, k| cost_model_tiles(m, n, k, 132, Arch::Sm90a);
        // 64 tokens: gate/up's 224 tiles whole K, O's 32 split.
        assert_eq!(at(64, 28672, 4096).schedule, Schedule::Tiles);
        assert_eq!(at(64, 4096, 4096).schedule, Schedule::SplitK);
        // M = 128, O: 64 tiles of 64×128 split over the SMs; M = 512, O: 64 tiles
        // of 128×256 in two K slices, one round.
        assert_eq!(at(128, 4096, 4096), TMA_ROWS64_SPLIT);
        assert_eq!(at(512, 4096, 4096), super::super::dev::TMA_PERSISTENT_SPLIT);
    }

    #[test]
    fn off_hopper_no_tma_and_no_128_deep_tiles() {
        for m in [1, 16, 64, 512, 4096] {
            for (n, k) in PROJECTIONS {
                let t = cost_model_tiles(m, n, k, 132, Arch::Sm80);
                assert!(!t.name().contains("tma") && !t.name().contains("k128"), "m{m} n{n}: {}", t.name());
            }
        }
        assert_eq!(cost_model_tiles(4096, 4096, 4096, 132, Arch::Sm80), V1);
    }

    #[test]
    fn estimates_count_waves() {
        // One more tile than a wave of the persistent kernel costs a second round.
        let one = estimate(TMA_PERSISTENT, 128 * 132, 256, 4096, 132).unwrap();
        let two = estimate(TMA_PERSISTENT, 128 * 133, 256, 4096, 132).unwrap();
        assert!(two > 1.8 * one - 2.0 * LAUNCH_S, "{one} {two}");
    }
}
