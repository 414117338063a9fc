//! The pure part of a decode call: every argument checked, the kernel schedule
//! chosen, and the split count and launch shapes sized, before anything touches
//! the GPU (the blocks-per-SM figure the split count needs is an input).

use crate::error::{Error, Result};
use crate::runtime::Kernel;
use abi::decode::{merge, ring_bytes, KEY_TILE, MAX_Q_LEN, ROW_TILE, STAGES, WARP_THREADS, WIDE_WARPS};
use abi::DecodeArgs;

/// What a call's cache and batch say, for [`check`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operands {
    /// Whether the batch was made from this cache.
    pub same_cache: bool,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Sequences in the batch, and the shortest one's length.
    pub batch: usize,
    pub min_len: usize,
}

/// A decode call's checked geometry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Geometry {
    pub batch: usize,
    pub q_len: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// softmax scale × log2(e).
    pub scale_log2: f32,
}

impl Geometry {
    /// Blocks along x: each KV head's (query token, head) rows in tiles of 16.
    pub fn x_blocks(&self) -> usize {
        self.kv_heads * (self.group * self.q_len).div_ceil(ROW_TILE)
    }

    /// One query per sequence whose group fits one m16 row tile: the plain
    /// entries, compiled without the (token, head) row mapping and per-row
    /// causal limits; speculative steps and wider groups take the `spec` ones.
    pub fn one_tile(&self) -> bool {
        self.q_len == 1 && self.group <= ROW_TILE
    }
}

/// Checks a call's shapes: `q`, `out` `[batch, heads, head_dim]` with `lse`
/// `[batch, heads]`, or `[batch, q_len, heads, head_dim]` with `lse` `[batch,
/// q_len, heads]`; heads a multiple of the cache's KV heads; 1 ≤ q_len ≤
/// [`MAX_Q_LEN`], and with q_len > 1 no more than the shortest sequence holds;
/// a finite positive scale; and a batch made from this cache.
pub(crate) fn check(
    op: &str,
    o: &Operands,
    q: &[usize],
    out: &[usize],
    lse: &[usize],
    scale: Option<f32>,
) -> Result<Geometry> {
    if !o.same_cache {
        return Err(Error::ForeignBatch(format!(
            "{op}: the batch was made from another KV cache, or before pages of this one were freed"
        )));
    }
    let (b, q_len, h, d) = match *q {
        [b, h, d] => (b, 1, h, d),
        [b, t, h, d] => (b, t, h, d),
        _ => {
            return Err(Error::Shape(format!(
                "{op}: q must be [batch, heads, head_dim] or [batch, q_len, heads, head_dim], not {q:?}"
            )))
        }
    };
    crate::ops::same_shape(op, "output", q, out)?;
    let lse_shape: &[usize] = if q.len() == 3 { &[b, h] } else { &[b, q_len, h] };
    crate::ops::same_shape(op, "lse", lse_shape, lse)?;
    if b != o.batch || d != o.head_dim {
        return Err(Error::Shape(format!("{op}: q {q:?} vs a batch of {} and head_dim {}", o.batch, o.head_dim)));
    }
    if h == 0 || !h.is_multiple_of(o.n_kv_heads) {
        return Err(Error::Shape(format!("{op}: {h} query heads over {} KV heads", o.n_kv_heads)));
    }
    // (q_len = 1 keeps allowing an empty sequence: its row comes out 0, LSE −inf.)
    if q_len == 0 || q_len > MAX_Q_LEN || (q_len > 1 && o.min_len < q_len) {
        return Err(Error::InvalidArgument(format!(
            "{op}: {q_len} new queries per sequence (1 to {MAX_Q_LEN}, and no more than the shortest sequence's {})",
            o.min_len
        )));
    }
    let scale = scale.unwrap_or(1.0 / (d as f32).sqrt());
    if !scale.is_finite() || scale <= 0.0 {
        return Err(Error::InvalidArgument(format!("{op}: scale {scale}")));
    }
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    if !scale_log2.is_finite() {
        return Err(Error::InvalidArgument(format!("{op}: scale {scale}")));
    }
    Ok(Geometry { batch: b, q_len, heads: h, kv_heads: o.n_kv_heads, head_dim: d, group: h / o.n_kv_heads, scale_log2 })
}

/// How a call is launched: the split kernel's entry and block shape, and whether
/// it merges the splits itself (with the split counters) or `decode_merge` follows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Schedule {
    pub kernel: Kernel<DecodeArgs>,
    /// Warps per block, each with its own ring of `stages` K/V stages.
    pub warps: usize,
    pub stages: usize,
    pub fused: bool,
}

impl Schedule {
    pub fn threads(&self) -> u32 {
        (WARP_THREADS * self.warps) as u32
    }

    /// Dynamic shared memory of one block at head dim `d`.
    pub fn smem(&self, d: usize) -> u32 {
        (self.warps * ring_bytes(d, self.stages)) as u32
    }

    /// Keys of one whole round of the block's warps: chunks are multiples of it.
    pub fn key_unit(&self) -> usize {
        KEY_TILE * self.warps
    }
}

/// Whether a block of `warps` rings of `stages` stages at head dim `d` fits in
/// `smem_optin` bytes (1 KB left for statics): the wide blocks need 144–160 KB
/// at head dim 128, which GPUs with 99 KB per block (sm_86/89/120) lack.
pub(crate) fn fits(d: usize, warps: usize, stages: usize, smem_optin: u32) -> bool {
    warps * ring_bytes(d, stages) + 1024 <= smem_optin as usize
}

/// The shipped choice: 4-warp blocks that merge in the launch ([`wide`]) for one
/// query per sequence with G ≤ 16 where their shared memory fits, else the
/// one-warp split kernel and `decode_merge` ([`two_launch`]).
pub(crate) fn auto_schedule(g: &Geometry, smem_optin: u32) -> Schedule {
    if g.one_tile() && fits(g.head_dim, WIDE_WARPS, STAGES, smem_optin) {
        wide(g)
    } else {
        two_launch(g)
    }
}

/// One-warp blocks writing partials; `decode_merge` combines them.
pub(crate) fn two_launch(g: &Geometry) -> Schedule {
    use crate::kernels::{DECODE_SPLIT_HD128, DECODE_SPLIT_HD64, DECODE_SPLIT_SPEC_HD128, DECODE_SPLIT_SPEC_HD64};
    let kernel = match (g.head_dim == 64, g.one_tile()) {
        (true, true) => DECODE_SPLIT_HD64,
        (false, true) => DECODE_SPLIT_HD128,
        (true, false) => DECODE_SPLIT_SPEC_HD64,
        (false, false) => DECODE_SPLIT_SPEC_HD128,
    };
    Schedule { kernel, warps: 1, stages: STAGES, fused: false }
}

/// 4-warp blocks, each warp a quarter of the block's keys, combined in shared
/// memory and merged in the launch (one query per sequence, G ≤ 16 only).
pub(crate) fn wide(g: &Geometry) -> Schedule {
    let kernel = if g.head_dim == 64 { crate::kernels::DECODE_WIDE_HD64 } else { crate::kernels::DECODE_WIDE_HD128 };
    Schedule { kernel, warps: WIDE_WARPS, stages: STAGES, fused: true }
}

/// A call's launches, sized.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Plan {
    pub schedule: Schedule,
    /// (x blocks, splits, batch).
    pub grid: (u32, u32, u32),
    pub splits: usize,
    /// Tokens per split: whole rounds of the block's warps.
    pub chunk: usize,
    /// Partial rows (one per split of each (sequence, query token, head)), each
    /// head_dim f32 of O and one f32 LSE.
    pub partial_rows: usize,
    /// Split counters of the in-launch merge (0 for `decode_merge`).
    pub counters: usize,
    /// `decode_merge`'s grid and block size, when it follows.
    pub merge: Option<((u32, u32, u32), u32)>,
}

impl Plan {
    /// The launches of `schedule` with `splits` splits of `chunk` tokens.
    pub fn new(g: &Geometry, schedule: Schedule, splits: usize, chunk: usize) -> Result<Plan> {
        let op = "decode_attention";
        let x_blocks = g.x_blocks();
        if x_blocks > i32::MAX as usize || g.batch * g.q_len > 65535 || g.batch > 65535 {
            return Err(Error::TooLarge(format!(
                "{op}: grid for {} sequences × {} queries × {} heads",
                g.batch, g.q_len, g.heads
            )));
        }
        if splits == 0 || splits > 65535 || chunk == 0 || chunk > u32::MAX as usize {
            return Err(Error::TooLarge(format!("{op}: {splits} splits of {chunk} tokens")));
        }
        // Each warp of a block takes chunk / warps keys: whole key tiles, none left over.
        if !chunk.is_multiple_of(schedule.key_unit()) {
            return Err(Error::InvalidArgument(format!("{op}: chunk {chunk} in units of {}", schedule.key_unit())));
        }
        let rows = g.batch * g.q_len * g.heads * splits;
        // The in-launch merge passes partial-row indices between lanes as u32.
        if (schedule.fused && rows > u32::MAX as usize) || rows.checked_mul(g.head_dim + 1).is_none() {
            return Err(Error::TooLarge(format!("{op}: {rows} partial rows")));
        }
        let merge = (!schedule.fused).then(|| {
            let threads = (g.head_dim * merge::groups(splits)) as u32;
            ((g.heads as u32, (g.batch * g.q_len) as u32, 1), threads)
        });
        Ok(Plan {
            schedule,
            grid: (x_blocks as u32, splits as u32, g.batch as u32),
            splits,
            chunk,
            partial_rows: rows,
            counters: if schedule.fused { g.batch * x_blocks } else { 0 },
            merge,
        })
    }

    /// f32 of the partials: rows × (head_dim + 1).
    pub fn partial_floats(&self, head_dim: usize) -> usize {
        self.partial_rows * (head_dim + 1)
    }
}

/// Sizes `schedule` for a batch planned for `plan_len` tokens on `sm_count` SMs
/// holding `per_sm` of its blocks each: many-warp blocks one per SM split by
/// whole waves' cost ([`choose_splits_waves`]), others by the fill of the last
/// wave ([`choose_splits`]).
pub(crate) fn plan(g: &Geometry, schedule: Schedule, plan_len: usize, sm_count: usize, per_sm: usize) -> Result<Plan> {
    let (x, unit) = (g.x_blocks(), schedule.key_unit());
    let (splits, chunk) = if schedule.warps > 1 && per_sm <= 1 {
        choose_splits_waves(g.batch, x, plan_len, sm_count, unit)
    } else {
        choose_splits(g.batch, x, plan_len, sm_count, per_sm.max(1), unit)
    };
    Plan::new(g, schedule, splits, chunk)
}

/// [`DecodeArgs::page_shift`] for pages of `page_size` tokens.
pub(crate) fn page_shift(page_size: usize) -> u32 {
    if page_size.is_power_of_two() {
        page_size.trailing_zeros()
    } else {
        abi::NO_PAGE_SHIFT
    }
}

/// (splits, tokens per split, a multiple of `tile` keys) for a batch whose sequences each need
/// `blocks_per_seq` blocks per split (KV heads × row tiles), given how many blocks fit on the
/// GPU at once (`sm_count × blocks_per_sm`). Blocks do equal work, so time goes
/// by whole waves: the split count that fills its last wave best wins (fewest
/// splits among near-ties: less to merge). A grid of 1.13 waves ran at 2.5 TB/s
/// where one full wave ran at 3.5 (docs/PERF.md).
pub fn choose_splits(
    batch: usize,
    blocks_per_seq: usize,
    max_len: usize,
    sm_count: usize,
    blocks_per_sm: usize,
    tile: usize,
) -> (usize, usize) {
    let units = (batch * blocks_per_seq).max(1);
    let capacity = (sm_count * blocks_per_sm).max(1);
    // Lower is better: the last wave's fill, negated; near-ties go to fewer splits.
    let unfilled = |splits: usize, _chunk_tiles: usize| {
        let blocks = units * splits;
        -(blocks as f64 / (blocks.div_ceil(capacity) * capacity) as f64)
    };
    pick_splits(max_len, tile, units, capacity, unfilled, 0.01)
}

/// The split count (and tokens per split, a multiple of `tile`) with the lowest
/// `score(splits, key tiles per split)` among 1 to 4 waves' worth of splits, a
/// later candidate winning only by more than `margin`.
fn pick_splits(
    max_len: usize,
    tile: usize,
    units: usize,
    capacity: usize,
    score: impl Fn(usize, usize) -> f64,
    margin: f64,
) -> (usize, usize) {
    let tiles = max_len.div_ceil(tile).max(1);
    let max_splits = tiles.min(4 * capacity / units + 1).max(1);
    let mut best = (f64::INFINITY, tiles);
    for want in 1..=max_splits {
        let chunk_tiles = tiles.div_ceil(want);
        let v = score(tiles.div_ceil(chunk_tiles), chunk_tiles);
        if v < best.0 - margin {
            best = (v, chunk_tiles);
        }
    }
    let chunk = best.1 * tile;
    (max_len.div_ceil(chunk).max(1), chunk)
}

/// [`choose_splits`] for kernels with one block per SM (the wide ones), where a
/// second wave costs a whole block's latency: the split count with the least
/// waves × (key tiles per block + `WAVE_COST_TILES`) wins (fewest splits among
/// ties). The fill rule took 33 splits (two full waves: ncu 17.8 µs) over 16
/// (one wave at 97%: 11.4 µs) at b1 L4097 in the layer; with this rule b1 L4097
/// ran 12.8 µs in a graph against 16.3, and b1 L131072 (16 splits against 33)
/// 4078 GB/s against 3733.
pub fn choose_splits_waves(
    batch: usize,
    blocks_per_seq: usize,
    max_len: usize,
    sm_count: usize,
    tile: usize,
) -> (usize, usize) {
    let units = (batch * blocks_per_seq).max(1);
    let capacity = sm_count.max(1);
    let cost = |splits: usize, chunk_tiles: usize| {
        ((units * splits).div_ceil(capacity) * (chunk_tiles + WAVE_COST_TILES)) as f64
    };
    pick_splits(max_len, tile, units, capacity, cost, 0.0)
}

/// A wave's fixed cost in key tiles of one block (launch, page table, merge), for
/// [`choose_splits_waves`]: a guess that measured well.
const WAVE_COST_TILES: usize = 2;

#[cfg(test)]
mod tests {
    use super::*;

    fn operands(batch: usize, min_len: usize) -> Operands {
        Operands { same_cache: true, n_kv_heads: 8, head_dim: 128, batch, min_len }
    }

    #[test]
    fn splits_fill_whole_waves() {
        // 6 blocks per SM on 132 SMs: 792 at once.
        let waves = |b: usize, len: usize| {
            let (splits, chunk) = choose_splits(b, 8, len, 132, 6, KEY_TILE);
            assert_eq!(chunk % KEY_TILE, 0);
            assert!((splits - 1) * chunk < len && splits * chunk >= len, "b{b} L{len}: {splits} × {chunk}");
            (b * 8 * splits) as f64 / 792.0
        };
        // b16: 6 splits (768 blocks, one wave) rather than 7 (896: 1.13 waves).
        assert_eq!(choose_splits(16, 8, 4096, 132, 6, KEY_TILE).0, 6);
        for (b, len) in [(16, 4096), (64, 4096), (8, 32768), (1, 131072)] {
            let w = waves(b, len);
            assert!(w.fract() == 0.0 || w.fract() > 0.9 || (w < 1.0 && w > 0.9), "b{b} L{len}: {w} waves");
        }
        assert_eq!(choose_splits(1, 8, 1, 132, 6, KEY_TILE), (1, 32));
        assert_eq!(choose_splits(1, 8, 4096, 132, 6, KEY_TILE).0, 64);
        // Wide blocks (one per SM, 4 × 32-key sub-chunks): 16 splits of 256 keys.
        assert_eq!(choose_splits(1, 8, 4096, 132, 1, KEY_TILE * WIDE_WARPS), (16, 256));
        // The fill rule's two full waves at b1 L4097 (the layer's steps), three at L131072.
        assert_eq!(choose_splits(1, 8, 4097, 132, 1, KEY_TILE * WIDE_WARPS).0, 33);
        assert_eq!(choose_splits(1, 8, 131072, 132, 1, KEY_TILE * WIDE_WARPS).0, 49);
        // The wave-cost rule: one wave wherever one wave holds the work.
        let waves = |b: usize, len: usize| choose_splits_waves(b, 8, len, 132, KEY_TILE * WIDE_WARPS);
        assert_eq!(waves(1, 4096), (16, 256));
        assert_eq!(waves(1, 4097), (11, 384));
        assert_eq!(waves(1, 131072).0, 16);
        assert_eq!(waves(8, 32768).0, 2);
        assert_eq!(waves(16, 4096).0, 1);
        assert_eq!(waves(64, 4096).0, 1);
        assert_eq!(waves(1, 1), (1, 128));
        // Eight one-tile warps per block: b1 L4096 gives each warp one key tile.
        assert_eq!(choose_splits_waves(1, 8, 4096, 132, KEY_TILE * 8), (16, 256));
    }

    #[test]
    fn splits_always_cover_the_planned_length() {
        for len in [0usize, 1, 31, 32, 33, 127, 128, 129, 4095, 4096, 4097, 100_003, 1 << 20] {
            for (b, x, per_sm, tile) in [(1, 8, 6, 32), (3, 24, 2, 32), (64, 8, 1, 128), (1, 1, 1, 256)] {
                for (splits, chunk) in
                    [choose_splits(b, x, len, 132, per_sm, tile), choose_splits_waves(b, x, len, 132, tile)]
                {
                    assert!(chunk > 0 && chunk % tile == 0, "L{len}: chunk {chunk}");
                    assert!(splits >= 1 && splits * chunk >= len && (splits - 1) * chunk < len.max(1));
                }
            }
        }
    }

    #[test]
    fn checks_shapes_lengths_and_the_cache() {
        let o = operands(2, 5);
        let g = check("op", &o, &[2, 32, 128], &[2, 32, 128], &[2, 32], None).unwrap();
        assert_eq!((g.batch, g.q_len, g.heads, g.group), (2, 1, 32, 4));
        let g = check("op", &o, &[2, 5, 32, 128], &[2, 5, 32, 128], &[2, 5, 32], Some(0.5)).unwrap();
        assert_eq!((g.q_len, g.scale_log2), (5, 0.5 * std::f32::consts::LOG2_E));
        let bad = |q: &[usize], out: &[usize], lse: &[usize], scale: Option<f32>, o: Operands| {
            check("op", &o, q, out, lse, scale).unwrap_err()
        };
        let (q3, l2) = ([2usize, 32, 128], [2usize, 32]);
        assert!(matches!(bad(&[2, 32], &[2, 32], &[2], None, o), Error::Shape(_)));
        assert!(matches!(bad(&q3, &[2, 32, 64], &l2, None, o), Error::Shape(_)));
        assert!(matches!(bad(&q3, &q3, &[2, 31], None, o), Error::Shape(_)));
        assert!(matches!(bad(&q3, &q3, &[2, 1, 32], None, o), Error::Shape(_)));
        assert!(matches!(bad(&[3, 32, 128], &[3, 32, 128], &[3, 32], None, o), Error::Shape(_)));
        assert!(matches!(bad(&[2, 32, 64], &[2, 32, 64], &l2, None, o), Error::Shape(_)));
        assert!(matches!(bad(&[2, 12, 128], &[2, 12, 128], &[2, 12], None, o), Error::Shape(_)));
        assert!(matches!(bad(&[2, 0, 128], &[2, 0, 128], &[2, 0], None, o), Error::Shape(_)));
        // More new queries than MAX_Q_LEN or than the shortest sequence holds.
        let q9 = [2usize, 9, 32, 128];
        assert!(matches!(bad(&q9, &q9, &[2, 9, 32], None, operands(2, 100)), Error::InvalidArgument(_)));
        let q6 = [2usize, 6, 32, 128];
        assert!(matches!(bad(&q6, &q6, &[2, 6, 32], None, o), Error::InvalidArgument(_)));
        let q0 = [2usize, 0, 32, 128];
        assert!(matches!(bad(&q0, &q0, &[2, 0, 32], None, o), Error::InvalidArgument(_)));
        for s in [0.0, -1.0, f32::NAN, f32::INFINITY, f32::MAX] {
            assert!(matches!(bad(&q3, &q3, &l2, Some(s), o), Error::InvalidArgument(_)), "scale {s}");
        }
        let foreign = Operands { same_cache: false, ..o };
        assert!(matches!(bad(&q3, &q3, &l2, None, foreign), Error::ForeignBatch(_)));
        // q_len = 1 allows empty sequences.
        assert!(check("op", &operands(2, 0), &q3, &q3, &l2, None).is_ok());
    }

    #[test]
    fn auto_takes_wide_where_it_applies() {
        let g = |q_len: usize, h: usize, d: usize| {
            let o = Operands { same_cache: true, n_kv_heads: 8, head_dim: d, batch: 1, min_len: 8 };
            let q = if q_len == 1 { vec![1, h, d] } else { vec![1, q_len, h, d] };
            let lse = if q_len == 1 { vec![1, h] } else { vec![1, q_len, h] };
            check("op", &o, &q, &q, &lse, None).unwrap()
        };
        let h200 = 232448;
        assert_eq!(auto_schedule(&g(1, 32, 128), h200).kernel, crate::kernels::DECODE_WIDE_HD128);
        assert_eq!(auto_schedule(&g(1, 128, 64), h200).kernel, crate::kernels::DECODE_WIDE_HD64);
        // G = 32 or q_len > 1: the spec split entry and decode_merge.
        let s = auto_schedule(&g(1, 256, 128), h200);
        assert_eq!((s.kernel, s.fused), (crate::kernels::DECODE_SPLIT_SPEC_HD128, false));
        assert_eq!(auto_schedule(&g(2, 32, 64), h200).kernel, crate::kernels::DECODE_SPLIT_SPEC_HD64);
        // 99 KB per block: the plain split entry.
        assert_eq!(auto_schedule(&g(1, 32, 128), 101376).kernel, crate::kernels::DECODE_SPLIT_HD128);
        assert_eq!(auto_schedule(&g(1, 128, 64), 101376).kernel, crate::kernels::DECODE_WIDE_HD64);
        assert!(fits(128, WIDE_WARPS, STAGES, 148480) && !fits(128, WIDE_WARPS, STAGES, 148479));
    }

    #[test]
    fn plans_grids_partials_and_merges() {
        let o = operands(3, 40);
        let g = check("op", &o, &[3, 2, 32, 128], &[3, 2, 32, 128], &[3, 2, 32], None).unwrap();
        // G·q_len = 8 rows: one row tile per KV head.
        assert_eq!(g.x_blocks(), 8);
        let p = plan(&g, two_launch(&g), 4096, 132, 6).unwrap();
        assert_eq!(p.grid, (8, p.splits as u32, 3));
        assert_eq!(p.partial_rows, 3 * 2 * 32 * p.splits);
        assert_eq!(p.merge, Some(((32, 6, 1), (128 * merge::groups(p.splits)) as u32)));
        assert_eq!(p.counters, 0);
        let g1 = check("op", &o, &[3, 32, 128], &[3, 32, 128], &[3, 32], None).unwrap();
        let p = plan(&g1, wide(&g1), 4097, 132, 1).unwrap();
        assert_eq!((p.chunk % 128, p.counters, p.merge), (0, 3 * 8, None));
        assert!(Plan::new(&g1, wide(&g1), 2, 96).is_err());
        assert!(Plan::new(&g1, wide(&g1), 0, 128).is_err());
    }
}
