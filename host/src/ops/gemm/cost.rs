//! The tile choice on sm_90a past 16 tokens, by cost model: each TMA
//! configuration that can run the shape is sized as it would launch, and its time
//! estimated from its pipeline fill, rounds of resident blocks at a per-SM tensor
//! rate, the HBM bytes it moves (W once per row tile that does not run beside
//! another), the bytes L2 feeds the SMs (each tile's X and W panels) and
//! split-K's round trip through the workspace or the split tail's through its
//! scratch; the cheapest wins. Pure: no GPU needed. The tensor rates and fills
//! are fitted to every configuration timed interleaved on the Llama-3-8B
//! projections at M = 128 to 1024 (H100, the H200's SMs; docs/NOTES.md); the
//! HBM rates are the H200's.

use super::plan::{
    size, Schedule, Tiles, TMA_PERSISTENT, TMA_PERSISTENT_N128, TMA_PERSISTENT_N192, TMA_PERSISTENT_N224, TMA_ROWS64,
    TMA_ROWS64_SPLIT, TMA_SPLIT_TAIL, TMA_SPLIT_TAIL_N192,
};
use super::Epilogue;
use abi::gemm::{
    self as shapes,
    tma::{split_tail, SPLIT_TAIL_SHARES_FROM},
};

/// A launch's fixed cost, seconds.
const LAUNCH_S: f64 = 3.0e-6;
/// Pipeline fill and epilogue of a round of co-resident 64-row blocks, seconds.
const RAMP_S: f64 = 9.0e-6;
/// Rate at which split partial sums are added into the f32 workspace (bytes/s).
const SUM_BPS: f64 = 1.1e12;
/// L2's feed of the SMs' loads, bytes/s, shared by the SMs that load at once:
/// every tile streams its X and W panels through it. It caps the 64-row tiles
/// where they fill every SM; the wider tiles' rates already sit under it.
const L2_BPS: f64 = 9.9e12;
/// `gemm_finalize`'s copy rate: f32 sums in, bf16 out (bytes/s).
const COPY_BPS: f64 = 4.2e12;
/// The split tail's round trip through its scratch, seconds: fixed (the slots'
/// stores drained before the count, the last slice's loads), and per K slice
/// of a tile (the last to finish reads the others' one by one).
const TAIL_FIXUP_S: f64 = 8.4e-6;
const TAIL_SLICE_S: f64 = 1.8e-6;
/// The same from `SPLIT_TAIL_SHARES_FROM` slices, where every slice's block
/// sums a share: a slice adds less (each reads its share of every slot), but
/// every block waits for the last slice. At K = 4096, 16-K-tile slices, that
/// wait shows: M = 128 QKV and O on the 128×192 tail read 37.1 and 29.1 µs
/// run alone, the 64-row tiles 30.8 and 26.4, where the fit at K = 14336
/// priced the tail ahead.
const TAIL_SHARES_FIXUP_S: f64 = 10.4e-6;
const TAIL_SHARES_SLICE_S: f64 = 1.4e-6;

/// What a configuration sustains on one SM, and its HBM streaming rate.
struct Rates {
    /// Tensor FLOP/s of an SM whose resident blocks are all busy.
    sm_flops: f64,
    /// A persistent launch's fill of its rings and its last tile's epilogue,
    /// which no next tile hides, seconds.
    fill_s: f64,
    hbm_bps: f64,
}

fn rates(t: &Tiles) -> Rates {
    let wide = |sm_flops, fill_s| Rates { sm_flops, fill_s, hbm_bps: 3.3e12 };
    match t.bn {
        // One 64-row tile and 128 columns a block, two blocks an SM: their
        // fill is `RAMP_S` a round.
        _ if t.bm == TMA_ROWS64.bm => Rates { sm_flops: 3.8e12, fill_s: 0.0, hbm_bps: 3.45e12 },
        // 128 rows by 256, 224, 192 or 128 columns, two consumer warpgroups. The
        // wider the tile the more FLOPs a loaded byte; the longer its epilogue.
        shapes::tma::BN => wide(7.2e12, 8.9e-6),
        shapes::tma_n224::BN => wide(6.9e12, 8.1e-6),
        shapes::tma_n192::BN => wide(6.8e12, 6.8e-6),
        _ => wide(5.3e12, 3.2e-6),
    }
}

/// The configurations considered at `m` tokens: 64-row tiles, whole or split K,
/// and past 64 tokens the persistent kernel on 128-row tiles 256, 224, 192 or
/// 128 wide and the split tail on 128×192, and past 128 the split tail on
/// 128×256.
fn candidates(m: usize) -> impl Iterator<Item = Tiles> {
    let persistent = (m > TMA_ROWS64.bm).then_some([
        TMA_PERSISTENT,
        TMA_PERSISTENT_N224,
        TMA_PERSISTENT_N192,
        TMA_PERSISTENT_N128,
        TMA_SPLIT_TAIL_N192,
    ]);
    let tail = (m > 2 * TMA_ROWS64.bm).then_some(TMA_SPLIT_TAIL);
    [TMA_ROWS64, TMA_ROWS64_SPLIT].into_iter().chain(persistent.into_iter().flatten()).chain(tail)
}

/// Estimated seconds of `tiles` on a checked `[m, k] × [n, k]` over `sm_count`
/// SMs, and how many block slots its rounds leave without work.
pub(crate) fn estimate(tiles: Tiles, m: usize, n: usize, k: usize, sm_count: usize) -> Option<(f64, usize)> {
    let p = size(tiles, Epilogue::Plain, m, n, k, sm_count).ok()?;
    let r = rates(&tiles);
    let sm = sm_count.max(1);
    let (m_tiles, n_tiles) = (m.div_ceil(tiles.bm), n.div_ceil(tiles.bn));
    let splits = p.grid.2.max(1) as usize;
    let block_flops = 2.0 * (tiles.bm * tiles.bn) as f64 * p.k_split as f64;
    // An SM's rate, at most what its share of L2's feed sustains when `active`
    // SMs load at once: a tile does bm·bn/(bm + bn) FLOPs per byte it loads.
    let capped = |active: usize| {
        let per_byte = (tiles.bm * tiles.bn) as f64 / (tiles.bm + tiles.bn) as f64;
        r.sm_flops.min(L2_BPS / active.clamp(1, sm) as f64 * per_byte)
    };
    let (compute, w_reads, idle) = match tiles.schedule {
        // One block per SM walking the tiles down each column panel: W read once.
        Schedule::TmaPersistent => {
            let rounds = (m_tiles * n_tiles).div_ceil(sm);
            let idle = rounds * sm - m_tiles * n_tiles;
            (r.fill_s + rounds as f64 * block_flops / capped(p.grid.0 as usize), 1, idle)
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
            let fixup = match pieces {
                1 => 0.0,
                p if p >= SPLIT_TAIL_SHARES_FROM as usize => {
                    slot * (TAIL_SHARES_FIXUP_S + TAIL_SHARES_SLICE_S * p as f64)
                }
                p => slot * (TAIL_FIXUP_S + TAIL_SLICE_S * p as f64),
            };
            let iteration_flops = 2.0 * (tiles.bm * tiles.bn * tiles.bk) as f64;
            // Blocks past the last slice have nothing to load.
            let grid = p.grid.0 as usize;
            let units = whole + (m_tiles * n_tiles - whole) * pieces;
            let idle = (whole / grid + usize::from(tail)) * grid - units;
            (r.fill_s + iterations as f64 * iteration_flops / capped(units.min(grid)) + fixup, 1, idle)
        }
        _ => {
            let blocks = m_tiles * n_tiles * splits;
            let per_sm = blocks.div_ceil(sm);
            let ramps = per_sm.div_ceil(tiles.resident_per_sm.max(1)) as f64 * RAMP_S;
            // Row tiles resident together share W's tiles through L2; each further
            // group of them streams W again.
            let together = (tiles.resident_per_sm * sm / (n_tiles * splits)).max(1);
            let slots = tiles.resident_per_sm * sm;
            let idle = blocks.div_ceil(slots) * slots - blocks;
            (per_sm as f64 * block_flops / capped(blocks) + ramps, m_tiles.div_ceil(together), idle)
        }
    };
    let bytes = 2.0 * (n * k * w_reads + m * k + m * n) as f64;
    let memory = bytes / r.hbm_bps;
    let sums = if tiles.leaves_sums() {
        4.0 * (m * n * splits) as f64 / SUM_BPS + 10.0 * (m * n) as f64 / COPY_BPS
    } else {
        0.0
    };
    Some((LAUNCH_S + compute.max(memory) + sums, idle))
}

/// The cheapest TMA configuration for an `[m, k] × [n, k]` GEMM on `sm_count`
/// SMs. Where HBM bounds several equally, the one whose rounds leave the
/// fewest slots idle: at M = 128 gate/up 128×224 tiles (128 in one round)
/// read 2–4% faster than 128×128 (224 in two) and 128×256 (112 in one) in two
/// jobs.
pub(crate) fn hopper_tiles(m: usize, n: usize, k: usize, sm_count: usize) -> Tiles {
    candidates(m)
        .filter_map(|t| estimate(t, m, n, k, sm_count).map(|e| (t, e)))
        .min_by(|(_, (a, a_idle)), (_, (b, b_idle))| a.total_cmp(b).then(a_idle.cmp(b_idle)))
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
        let (r64, r64s, tma, tail, t192) =
            (TMA_ROWS64, TMA_ROWS64_SPLIT, TMA_PERSISTENT, TMA_SPLIT_TAIL, TMA_SPLIT_TAIL_N192);
        let (n128, n192, n224) = (TMA_PERSISTENT_N128, TMA_PERSISTENT_N192, TMA_PERSISTENT_N224);
        // 32 and 64 tokens: 64-row tiles, whole K where they fill a wave (gate/up).
        assert_eq!(picks(32), [r64s, r64s, r64, r64s]);
        assert_eq!(picks(64), [r64s, r64s, r64, r64s]);
        // The tile whose count fills the SMs best, each the fastest timed there
        // or within 4% of it (M = 512 down: the tail 96.4 µs, 128×128 92.8):
        // at M = 128 the 64-row tiles for QKV and O (96 and 64 blocks, whole K),
        // at 256 and 512 the 128-row tiles 128 wide (96 and 128 tiles for 132
        // SMs), 192 wide for QKV at 512 and 1024 (128 and 256 tiles, where 256
        // wide makes 96 and 192), gate/up on 128×224 tiles (128 a row of tiles).
        // Down's long K goes in slices where whole tiles leave SMs idle: the
        // 128×192 split tail at M = 128 and 256, the 128×256 one at 512.
        assert_eq!(picks(128), [r64, r64, n224, t192]);
        assert_eq!(picks(256), [n128, n128, n224, t192]);
        assert_eq!(picks(512), [n192, n128, n224, tail]);
        assert_eq!(picks(1024), [n192, tma, tma, tma]);
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
        assert!(tail.unwrap().0 < 0.7 * walk.unwrap().0, "{tail:?} {walk:?}");
        assert_eq!(split_tail(64, 224, 132), (0, 2));
        // Too short a K for slices of 8 K tiles: whole tiles.
        assert_eq!(split_tail(64, 15, 132), (0, 1));
        assert_eq!(split_tail(448, 64, 132), (396, 2));
    }

    #[test]
    fn a_second_round_of_tiles_costs_about_a_round() {
        let one = estimate(TMA_PERSISTENT, 128 * 132, 256, 4096, 132).unwrap().0;
        let two = estimate(TMA_PERSISTENT, 128 * 133, 256, 4096, 132).unwrap().0;
        let fixed = LAUNCH_S + rates(&TMA_PERSISTENT).fill_s;
        assert!(two - fixed > 1.9 * (one - fixed), "{one} {two}");
    }

    #[test]
    fn every_estimate_is_finite_and_positive() {
        for m in [17, 65, 129, 1000, 4093, 65536] {
            for (n, k) in [(8, 8), (1026, 8), (640, 136), (27264, 200), (4100, 328)] {
                for t in candidates(m) {
                    let (s, idle) = estimate(t, m, n, k, 132).unwrap();
                    assert!(idle < 2 * 132, "{} m{m} n{n} k{k}: {idle} idle slots", t.name());
                    assert!(s.is_finite() && s > 0.0, "{} m{m} n{n} k{k}: {s}", t.name());
                }
            }
        }
    }
}
