//! The tile choice on sm_90a past 16 tokens, by cost model: each TMA
//! configuration that can run the shape is sized as it would launch, and its time
//! estimated from rounds of resident blocks at a per-SM tensor rate, the HBM
//! bytes it moves (W once per row tile that does not run beside another), the
//! bytes L2 feeds the SMs (each tile's X and W panels) and
//! split-K's round trip through the workspace or the split tail's through its
//! scratch; the cheapest wins. Pure: no GPU needed. The rates are H200 figures:
//! they reproduce, within 3%, the best configuration measured on the Llama-3-8B
//! projections at M = 32 to 1024 and the prefill shapes (docs/NOTES.md).

use super::plan::{
    size, Schedule, Tiles, TMA_PERSISTENT, TMA_PERSISTENT_N128, TMA_ROWS64, TMA_ROWS64_SPLIT, TMA_SPLIT_TAIL,
    TMA_SPLIT_TAIL_N192,
};
use super::Epilogue;
use abi::gemm::tma::split_tail;

/// A launch's fixed cost, seconds.
const LAUNCH_S: f64 = 3.0e-6;
/// Pipeline fill and epilogue of a round of co-resident 64-row blocks, seconds.
const RAMP_S: f64 = 2.0e-6;
/// Rate at which split partial sums are added into the f32 workspace (bytes/s).
const SUM_BPS: f64 = 5.0e12;
/// L2's feed of the SMs' loads, bytes/s, shared by the SMs that load at once:
/// every tile streams its X and W panels through it. It caps the 64-row tiles
/// where they fill every SM (M = 256 O: 31 µs for 128 blocks against 26 for 64
/// of the same size); the wider tiles' rates already sit under it.
const L2_BPS: f64 = 8.4e12;
/// `gemm_finalize`'s copy rate: f32 sums in, bf16 out (bytes/s).
const COPY_BPS: f64 = 4.2e12;
/// The split tail's round trip through its scratch, seconds: fixed (the slots'
/// stores drained before the count, the last slice's loads), and per K slice
/// of a tile (the last to finish reads the others' one by one).
const TAIL_FIXUP_S: f64 = 9.5e-6;
const TAIL_SLICE_S: f64 = 0.8e-6;

/// What a configuration sustains on one SM, and its HBM streaming rate.
struct Rates {
    /// Tensor FLOP/s of an SM whose resident blocks are all busy.
    sm_flops: f64,
    /// The same with a single block on the SM.
    sm_flops_alone: f64,
    hbm_bps: f64,
}

fn rates(t: &Tiles) -> Rates {
    match t.schedule {
        // 128×256 tiles, two consumer warpgroups: 700 TFLOP/s at m2048 over 132
        // SMs; bound by the weight stream at m128 gate/up (419 TFLOP/s).
        Schedule::TmaPersistent | Schedule::TmaSplitTail if t.bn == TMA_PERSISTENT.bn => {
            Rates { sm_flops: 5.4e12, sm_flops_alone: 5.4e12, hbm_bps: 3.3e12 }
        }
        // 128×192 tiles: 4.6–5.0 TFLOP/s per SM (m512 QKV one round: 555
        // TFLOP/s; m1024 QKV two rounds: 618).
        Schedule::TmaPersistent | Schedule::TmaSplitTail if t.bn == TMA_SPLIT_TAIL_N192.bn => {
            Rates { sm_flops: 4.8e12, sm_flops_alone: 4.8e12, hbm_bps: 3.3e12 }
        }
        // 128×128 tiles: 3.4–3.9 TFLOP/s per SM (m512 O one round: 407 TFLOP/s;
        // m512 down: 489).
        Schedule::TmaPersistent => Rates { sm_flops: 3.6e12, sm_flops_alone: 3.6e12, hbm_bps: 3.3e12 },
        // 64×128 tiles, one consumer warpgroup, two blocks per SM: 3.4 TFLOP/s per
        // SM with both busy (m512 down: 443 TFLOP/s), 3.1 with one.
        _ => Rates { sm_flops: 3.4e12, sm_flops_alone: 3.1e12, hbm_bps: 3.45e12 },
    }
}

/// The configurations considered at `m` tokens: 64-row tiles, whole or split K,
/// and past 64 tokens the persistent kernel on 128×256 or 128×128 tiles and
/// the split tail on 128×192, and past 128 the split tail on 128×256. In a
/// chain the 64-row tiles load W while the previous kernel ends (they wait,
/// the TMA walks do not): that beat the 128×256 split tail in the MLP at t128,
/// but not the 128×192 one (docs/NOTES.md).
fn candidates(m: usize) -> impl Iterator<Item = Tiles> {
    let persistent = (m > TMA_ROWS64.bm).then_some([TMA_PERSISTENT, TMA_PERSISTENT_N128, TMA_SPLIT_TAIL_N192]);
    let tail = (m > 2 * TMA_ROWS64.bm).then_some(TMA_SPLIT_TAIL);
    [TMA_ROWS64, TMA_ROWS64_SPLIT].into_iter().chain(persistent.into_iter().flatten()).chain(tail)
}

/// Estimated seconds of `tiles` on a checked `[m, k] × [n, k]` over `sm_count` SMs.
pub(crate) fn estimate(tiles: Tiles, m: usize, n: usize, k: usize, sm_count: usize) -> Option<f64> {
    let p = size(tiles, Epilogue::Plain, m, n, k, sm_count).ok()?;
    let r = rates(&tiles);
    let sm = sm_count.max(1);
    let (m_tiles, n_tiles) = (m.div_ceil(tiles.bm), n.div_ceil(tiles.bn));
    let splits = p.grid.2.max(1) as usize;
    let block_flops = 2.0 * (tiles.bm * tiles.bn) as f64 * p.k_split as f64;
    // An SM's rate, at most what its share of L2's feed sustains when `active`
    // SMs load at once: a tile does bm·bn/(bm + bn) FLOPs per byte it loads.
    let capped = |rate: f64, active: usize| {
        let per_byte = (tiles.bm * tiles.bn) as f64 / (tiles.bm + tiles.bn) as f64;
        rate.min(L2_BPS / active.clamp(1, sm) as f64 * per_byte)
    };
    let (compute, w_reads) = match tiles.schedule {
        // One block per SM walking the tiles down each column panel: W read once.
        Schedule::TmaPersistent => {
            let rate = capped(r.sm_flops, p.grid.0 as usize);
            ((m_tiles * n_tiles).div_ceil(sm) as f64 * block_flops / rate, 1)
        }
        // Whole rounds, then one K slice of a tail tile a block.
        Schedule::TmaSplitTail => {
            let k_tiles = k.div_ceil(tiles.bk);
            // `size` bounded the launch to 32 bits, as the kernel walks it.
            let (whole, pieces) = split_tail((m_tiles * n_tiles) as u32, k_tiles as u32, p.grid.0);
            let (whole, pieces) = (whole as usize, pieces as usize);
            let tail = m_tiles * n_tiles > whole;
            let iterations = whole / p.grid.0 as usize * k_tiles + if tail { k_tiles.div_ceil(pieces) } else { 0 };
            // The round trip moves slots of one tile's f32: priced at 128×256.
            let slot = (tiles.bm * tiles.bn) as f64 / (TMA_SPLIT_TAIL.bm * TMA_SPLIT_TAIL.bn) as f64;
            let fixup = if pieces > 1 { slot * (TAIL_FIXUP_S + TAIL_SLICE_S * pieces as f64) } else { 0.0 };
            let iteration_flops = 2.0 * (tiles.bm * tiles.bn * tiles.bk) as f64;
            (iterations as f64 * iteration_flops / capped(r.sm_flops, p.grid.0 as usize) + fixup, 1)
        }
        _ => {
            let blocks = m_tiles * n_tiles * splits;
            let per_sm = blocks.div_ceil(sm);
            let rate = capped(if per_sm == 1 { r.sm_flops_alone } else { r.sm_flops }, blocks);
            let ramps = per_sm.div_ceil(tiles.resident_per_sm.max(1)) as f64 * RAMP_S;
            // Row tiles resident together share W's tiles through L2; each further
            // group of them streams W again.
            let together = (tiles.resident_per_sm * sm / (n_tiles * splits)).max(1);
            (per_sm as f64 * block_flops / rate + ramps, m_tiles.div_ceil(together))
        }
    };
    let bytes = 2.0 * (n * k * w_reads + m * k + m * n) as f64;
    let memory = bytes / r.hbm_bps;
    let sums = if tiles.leaves_sums() {
        4.0 * (m * n * splits) as f64 / SUM_BPS + LAUNCH_S + 10.0 * (m * n) as f64 / COPY_BPS
    } else {
        0.0
    };
    Some(LAUNCH_S + compute.max(memory) + sums)
}

/// The cheapest TMA configuration for an `[m, k] × [n, k]` GEMM on `sm_count` SMs.
pub(crate) fn hopper_tiles(m: usize, n: usize, k: usize, sm_count: usize) -> Tiles {
    candidates(m)
        .filter_map(|t| estimate(t, m, n, k, sm_count).map(|s| (t, s)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(TMA_ROWS64_SPLIT, |(t, _)| t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Llama-3-8B projections: QKV, O, gate/up (interleaved), down.
    const PROJECTIONS: [(usize, usize); 4] = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)];

    fn picks(m: usize) -> [Tiles; 4] {
        PROJECTIONS.map(|(n, k)| hopper_tiles(m, n, k, 132))
    }

    #[test]
    fn choices_for_the_llama_projections() {
        let (r64, r64s, tma) = (TMA_ROWS64, TMA_ROWS64_SPLIT, TMA_PERSISTENT);
        let (tail, t192) = (TMA_SPLIT_TAIL, TMA_SPLIT_TAIL_N192);
        // 32 and 64 tokens: 64-row tiles, whole K where they fill a wave (gate/up).
        assert_eq!(picks(32), [r64s, r64s, r64, r64s]);
        assert_eq!(picks(64), [r64s, r64s, r64, r64s]);
        // Gate/up's 128×256 tiles stream W once; 64-row tiles would read it per
        // row tile. From 128 tokens QKV takes 128×192 tiles (N = 6144: 32
        // columns), split along K where they leave SMs idle (M = 128: 32 tiles
        // in 4 slices; M = 512: 128 tiles whole), and so do O and down up to
        // 256 tokens (22 columns, the last a third full); the split tail on
        // 128×256 where those leave SMs idle in a last round through a long
        // enough K: down at M = 256 and 512 (32 and 64 tiles of 224 K tiles in 4
        // and 2), M = 512 O and gate/up (3 rounds and 52 tiles in 2 slices).
        assert_eq!(picks(128), [t192, t192, tma, t192]);
        assert_eq!(picks(256), [t192, t192, tma, tail]);
        assert_eq!(picks(512), [t192, tail, tail, tail]);
        assert_eq!(picks(1024), [t192, tma, tma, tma]);
        // Prefill: the persistent kernel, whole K; at M = 8192 gate/up the 40
        // tiles past 54 rounds go in 3 slices.
        assert_eq!(picks(2048), [tma; 4]);
        assert_eq!(picks(8192), [tma, tma, tail, tma]);
    }

    #[test]
    fn the_split_tail_matches_the_walk_where_rounds_are_full_and_wins_where_they_are_not() {
        // 128 tiles of 128×256 for 132 SMs: one whole round either way.
        let full = (1024, 4096, 4096);
        assert_eq!(
            estimate(TMA_SPLIT_TAIL, full.0, full.1, full.2, 132),
            estimate(TMA_PERSISTENT, full.0, full.1, full.2, 132)
        );
        // 64 tiles of 224 K tiles: two slices each, 112 K tiles a block.
        let (walk, tail) =
            (estimate(TMA_PERSISTENT, 512, 4096, 14336, 132), estimate(TMA_SPLIT_TAIL, 512, 4096, 14336, 132));
        assert!(tail.unwrap() < 0.7 * walk.unwrap(), "{tail:?} {walk:?}");
        assert_eq!(split_tail(64, 224, 132), (0, 2));
        // Too short a K for slices of 8 K tiles: whole tiles.
        assert_eq!(split_tail(64, 15, 132), (0, 1));
        assert_eq!(split_tail(448, 64, 132), (396, 2));
    }

    #[test]
    fn a_second_round_of_tiles_costs_about_a_round() {
        let one = estimate(TMA_PERSISTENT, 128 * 132, 256, 4096, 132).unwrap();
        let two = estimate(TMA_PERSISTENT, 128 * 133, 256, 4096, 132).unwrap();
        assert!(two > 1.8 * one - 2.0 * LAUNCH_S, "{one} {two}");
    }

    #[test]
    fn every_estimate_is_finite_and_positive() {
        for m in [17, 65, 129, 1000, 4093, 65536] {
            for (n, k) in [(8, 8), (1026, 8), (640, 136), (27264, 200), (4100, 328)] {
                for t in candidates(m) {
                    let s = estimate(t, m, n, k, 132).unwrap();
                    assert!(s.is_finite() && s > 0.0, "{} m{m} n{n} k{k}: {s}", t.name());
                }
            }
        }
    }
}
