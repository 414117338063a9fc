//! The Hopper GEMM (sm_90a): Y = X·Wᵀ on `wgmma`, fed by TMA, warp-specialized.
//!
//! A block computes a 128×256 output tile with three warpgroups. Warpgroup 0 is
//! the producer: one thread walks K, and for each 64-deep K tile waits until a
//! ring stage is free, then has the copy engine load the X and W boxes into it
//! (128-byte swizzled, out-of-bounds rows and columns read as zeros). Warpgroups
//! 1 and 2 are consumers, 64 rows each: they wait for a stage to fill, issue four
//! m64n256k16 `wgmma` on it, and release the stage once the *previous* group of
//! `wgmma` has retired, so the tensor cores always have the next group queued.
//! Two barriers per stage carry the hand-off: `full` (producer → consumers,
//! completed by the copy engine's byte count) and `empty` (consumers → producer).
//! Epilogues as in the mma.sync kernels, 16 bytes a store ([`store_tile`]).
//! With a programmatic launch the first stages' W boxes load while the previous
//! kernel finishes; X, and every store, only once it has. Shipped persistent: one block per SM
//! walking the tiles, whole or with the last round's tiles split along K (the
//! `dev` entries take one block per tile, or split every tile). The tile and ring
//! sizes are `abi::gemm::tma`'s (`tma_n128`, `tma_n192`, `tma_n224` for the
//! narrower tiles), which the host's boxes and shared memory follow.

use super::quad_store::store_tile;
use super::{store_pair, tma_store};
use crate::gpu::mem::{
    atom_add_acq_rel_u32, atom_or_acq_rel_u32, atom_or_relaxed_u32, ld_acquire_u32, ld_global_cg_f32x4, red_add_f32x2,
    st_global_v4, warp_completes_count,
};
use crate::gpu::shared::dynamic_shared_base;
use crate::gpu::thread::{
    block_idx_x, global_timer_ns, grid_dim_x, launch_dependents, sm_id, sync_threads_unaligned, thread_idx_x,
    wait_for_prior_grids,
};
use crate::gpu::tma::{self, Barrier};
use crate::gpu::warp::{shuffle_u32, sync_warp};
use crate::gpu::wgmma;
use abi::gemm::tma::{
    split_tail, split_tail_stamps_at, ALIGN_SLACK, BARRIER_BYTES, BK, BM, BN, CONSUMERS, SPLIT_TAIL_COUNTERS,
    SPLIT_TAIL_MAX_BLOCKS, SPLIT_TAIL_SHARES_FROM, SPLIT_TAIL_STAMPS, STAGES, THREADS,
};
use abi::GemmTmaArgs;

const _: () = assert!(ALIGN_SLACK == 1024 && BARRIER_BYTES == 16 * STAGES && THREADS == 384);
// One counter per consumer warp: 2 warpgroups of 4.
const _: () = assert!(SPLIT_TAIL_COUNTERS == CONSUMERS * 4);
pub(crate) const X_BYTES: u32 = (BM * BK * 2) as u32;

/// The TMA GEMMs' ring of stages in dynamic shared memory: each an X box, then
/// a W box; after the last, a `full` and an `empty` mbarrier a stage.
#[derive(Clone, Copy)]
pub(crate) struct Ring {
    base: u32,
    bars: u32,
    stage_bytes: u32,
    x_bytes: u32,
    stages: usize,
}

impl Ring {
    /// The 128-byte swizzle is defined on 1024-byte atoms: the ring starts on
    /// one (the launch adds 1024 bytes of slack).
    #[inline(always)]
    pub(crate) fn new(stages: usize, stage_bytes: u32, x_bytes: u32) -> Self {
        let base = (dynamic_shared_base() + 1023) & !1023;
        Ring { base, bars: base + stages as u32 * stage_bytes, stage_bytes, x_bytes, stages }
    }
    /// Stage `s`'s X box.
    #[inline(always)]
    pub(crate) fn x(self, s: usize) -> u32 {
        self.base + s as u32 * self.stage_bytes
    }
    /// Stage `s`'s W box.
    #[inline(always)]
    pub(crate) fn w(self, s: usize) -> u32 {
        self.x(s) + self.x_bytes
    }
    /// Completed by the producer's arrival and the copy engine's bytes.
    #[inline(always)]
    pub(crate) fn full(self, s: usize) -> Barrier {
        Barrier(self.bars + 8 * s as u32)
    }
    /// Completed by the consumers' releases of the stage.
    #[inline(always)]
    pub(crate) fn empty(self, s: usize) -> Barrier {
        Barrier(self.bars + 8 * (self.stages + s) as u32)
    }
    /// Where the TMA-store epilogue's staging starts: past the barriers, on
    /// the next 1024 bytes (`abi::gemm::tma_store::BARRIER_BYTES`).
    #[inline(always)]
    pub(crate) fn staging(self) -> u32 {
        self.bars + abi::gemm::tma_store::BARRIER_BYTES as u32
    }
    /// The TMA-store epilogue's residual barrier of consumer `c`, after the
    /// stages' (in the padding before the staging).
    #[inline(always)]
    pub(crate) fn residual(self, c: usize) -> Barrier {
        Barrier(self.bars + 8 * (2 * self.stages + c) as u32)
    }
    /// One thread, before any use: `full` takes one arrival, `empty` `releases`.
    #[inline(always)]
    pub(crate) fn init(self, releases: u32) {
        for s in 0..self.stages {
            self.full(s).init(1);
            self.empty(s).init(releases);
        }
        tma::fence_barrier_init();
    }
}

/// A consumer warpgroup's share of the output tile: 64 rows × `BN` columns on
/// m64n`BN`k16 `wgmma`, `ACC` f32 accumulators per thread; and the ring depth
/// its stages allow.
pub(crate) trait WideTile<const ACC: usize> {
    const BN: usize;
    const STAGES: usize;
    fn mma(acc: &mut [f32; ACC], desc_a: u64, desc_b: u64, accumulate: bool);
}

/// The shipped 128×256 tile (`abi::gemm::tma`).
pub(crate) struct Cols256;

impl WideTile<128> for Cols256 {
    const BN: usize = BN;
    const STAGES: usize = STAGES;
    #[inline(always)]
    fn mma(acc: &mut [f32; 128], desc_a: u64, desc_b: u64, accumulate: bool) {
        wgmma::mma_m64n256k16(acc, desc_a, desc_b, accumulate);
    }
}
/// Consecutive blocks walk down this many tile rows before moving right, so a
/// wave of blocks shares X rows and W columns in L2.
const GROUP_M: usize = 8;

/// (tile row, tile column) of block `id`: grouped raster order.
#[inline(always)]
pub(crate) fn tile_of(id: usize, m_tiles: usize, n_tiles: usize) -> (usize, usize) {
    let per_group = GROUP_M * n_tiles;
    let first_m = (id / per_group) * GROUP_M;
    let rows = (m_tiles - first_m).min(GROUP_M);
    let within = id % per_group;
    (first_m + within % rows, within / rows)
}

/// Which work units a block computes: output tiles, or with `SPLIT` (tile, K
/// slice) pairs whose sums meet in the workspace, or with `SPLIT_TAIL` whole
/// tiles and then slices of the last round's ([`SplitTail`]).
pub(crate) trait TileWalk {
    /// This block's units: (first, step, end) of the `units`; by default every
    /// grid-th from the block's index. Not asked with `SPLIT_TAIL`.
    #[inline(always)]
    fn walk(units: usize) -> (usize, usize, usize) {
        (block_idx_x() as usize, grid_dim_x() as usize, units)
    }
    /// Whether a block may go on to another unit: its producer may then be
    /// waiting for the current unit's last stage.
    const MORE_TILES: bool;
    /// K split in slices of `k_split` (the launch's workspace takes the sums).
    const SPLIT: bool = false;
    /// The last round's tiles split along K, finished in-kernel ([`SplitTailPart`]).
    const SPLIT_TAIL: bool = false;
    /// Dev, with `SPLIT_TAIL`: each block writes its timer stamps
    /// ([`abi::gemm::tma::SPLIT_TAIL_STAMPS`]) after the scratch's slots.
    const STAMPS: bool = false;
    /// Dev, with `SPLIT_TAIL`: the last slice's block in sums the whole tile
    /// ([`SplitTailPart::finish`]) at every slice count, never in shares; a
    /// walk over more blocks than are resident should: shares would wait
    /// (`SHARES_WAIT_NS`) for blocks that start only as others end.
    const WHOLE_FINISH: bool = false;
    /// With `SPLIT_TAIL`, summing in shares: how long a slice's block waits
    /// for the tile's others before it leaves its shares to the last one in.
    const SHARES_WAIT_NS: u64 = SplitTailPart::SHARES_WAIT_NS;
    /// Dev: whole tiles (no split) stored by TMA through a staging past the
    /// ring's barriers ([`super::tma_store`]), every epilogue.
    const TMA_STORE: bool = false;
}

/// A stamped launch's record of one block, written by its first consumer
/// thread; nothing where the walk does not stamp.
#[derive(Clone, Copy)]
struct Stamps(*mut u64);

impl Stamps {
    #[inline(always)]
    unsafe fn new<W: TileWalk>(scratch: u64, tid: usize) -> Stamps {
        if !W::STAMPS || tid != 128 {
            return Stamps(core::ptr::null_mut());
        }
        let at = split_tail_stamps_at(grid_dim_x() as usize);
        Stamps((scratch as *mut f32).add(at).cast::<u64>().add(block_idx_x() as usize * SPLIT_TAIL_STAMPS))
    }

    #[inline(always)]
    unsafe fn put(self, i: usize, v: u64) {
        if !self.0.is_null() {
            *self.0.add(i) = v;
        }
    }

    #[inline(always)]
    unsafe fn time(self, i: usize) {
        if !self.0.is_null() {
            *self.0.add(i) = global_timer_ns();
        }
    }
}

/// One block per SM walking the tiles `block, block + grid, …`: the producer
/// streams the next tile's K tiles into the ring while the consumers run this
/// tile's epilogue, and no block pays the ring's fill latency more than once.
pub(crate) struct Persistent;

impl TileWalk for Persistent {
    const MORE_TILES: bool = true;
}

/// A consumer thread's accumulator pairs in a 64-row warpgroup tile of `ACC`
/// accumulators: two rows 8 apart (`row0`, `row0 + 8`), a pair every 8 columns
/// from `col0`.
pub(crate) struct ThreadPairs {
    pub(crate) row0: usize,
    pub(crate) col0: usize,
    pub(crate) m: usize,
    pub(crate) n: usize,
}

impl ThreadPairs {
    /// `f(row, col, index of the pair's first accumulator)` over the pairs inside `[m, n]`.
    #[inline(always)]
    pub(crate) fn each<const ACC: usize>(&self, mut f: impl FnMut(usize, usize, usize)) {
        for h in 0..2 {
            let row = self.row0 + 8 * h;
            if row >= self.m {
                continue;
            }
            for j in 0..ACC / 4 {
                let col = self.col0 + j * 8;
                if col < self.n {
                    f(row, col, 4 * j + 2 * h);
                }
            }
        }
    }

    /// [`Self::each`] over the two pairs of accumulator chunk `j` (accumulators
    /// `4j..4j + 4`): `f(row, col, index of the pair's first accumulator in the chunk)`.
    #[inline(always)]
    pub(crate) fn chunk(&self, j: usize, mut f: impl FnMut(usize, usize, usize)) {
        let col = self.col0 + j * 8;
        for h in 0..2 {
            let row = self.row0 + 8 * h;
            if row < self.m && col < self.n {
                f(row, col, 2 * h);
            }
        }
    }
}

/// The split-tail walk: whole tiles in rounds of one per block while they fill
/// every block; the tiles left over (fewer than the blocks) are each cut along
/// K into `pieces` equal slices, one a block, so the last round keeps every SM
/// at work. The slices of tiles that share W's columns run side by side at the
/// same K offsets, so W's boxes are read from HBM once (a contiguous share of
/// the (tile, K tile) iterations each, stream-K's cut, staggers them and reads
/// W again). Unit `u` is tile `u` below `whole`, then slice `(u − whole) %
/// pieces` of tile `whole + (u − whole) / pieces`; block `b` takes units `b, b +
/// grid, …` below `whole`, then unit `whole + b`. In 32 bits (the host bounds
/// (tiles + blocks) × K tiles): a 64-bit division is a call, which the
/// producer's 40 registers do not hold.
#[derive(Clone, Copy)]
struct SplitTail {
    k_tiles: u32,
    blocks: u32,
    /// Tiles computed whole, and K slices per tile of the rest.
    whole: u32,
    pieces: u32,
    /// One past the last unit.
    end: u32,
}

impl SplitTail {
    /// The walk `abi::gemm::tma::split_tail` defines (the host's cost model too).
    #[inline(always)]
    fn new(tiles: usize, k_tiles: usize, blocks: usize) -> Self {
        let (tiles, k_tiles, blocks) = (tiles as u32, k_tiles as u32, blocks as u32);
        let (whole, pieces) = split_tail(tiles, k_tiles, blocks);
        SplitTail { k_tiles, blocks, whole, pieces, end: whole + (tiles - whole) * pieces }
    }

    /// (output tile, K tiles) of unit `u`.
    #[inline(always)]
    fn at(&self, u: usize) -> (usize, usize, usize) {
        let u = u as u32;
        if u < self.whole {
            return (u as usize, 0, self.k_tiles as usize);
        }
        let (i, k) = (u - self.whole, self.k_tiles);
        let (tile, p) = (self.whole + i / self.pieces, i % self.pieces);
        (tile as usize, (p * k / self.pieces) as usize, ((p + 1) * k / self.pieces) as usize)
    }

    /// Block `b`'s unit after `u`.
    #[inline(always)]
    fn next(&self, b: usize, u: usize) -> usize {
        let u = u as u32;
        (if u >= self.whole {
            self.end
        } else if u + self.blocks < self.whole {
            u + self.blocks
        } else {
            self.whole + b as u32
        }) as usize
    }
}

/// One consumer warp's K slice of a split tile: its K tiles `kt0..kt1` of the
/// tile's `k_tiles`.
///
/// The launch's scratch (`abi::gemm::tma::split_tail_scratch_len`) holds a
/// counter per split tile and consumer warp, then a slot a block (its slice's
/// f32 accumulators, 128×256, in fragment order). Every contributor stores its
/// accumulators into its slot and counts its K tiles; the one that completes
/// the count sums the slots into its registers, resets the counter and stores
/// the tile ([`Self::finish`]), or from `SPLIT_TAIL_SHARES_FROM` slices every
/// contributor counts its slice in, waits a bounded time for the others and
/// sums a share ([`Self::scatter`]). The slots are not cleared: each is written
/// before it is counted, and read only once counted.
struct SplitTailPart {
    tile: usize,
    kt0: usize,
    kt1: usize,
    /// Consumer warp 0..8 of the block (each holds 16 rows of the tile).
    warp: usize,
}

impl SplitTailPart {
    /// f32 a slot holds: one 128×256 tile.
    const SLOT: usize = BM * BN;
    /// 16-byte loads in flight per slot and round trip while summing:
    /// `4 · BATCH · SLOTS` registers beside the accumulators.
    const BATCH: usize = 4;
    /// Most slots loaded a round trip.
    const MAX_SLOTS: usize = 4;
    /// Registers of a consumer thread that the accumulators and a round trip's
    /// loads share without a spill (of the 232 it takes).
    const SUM_REGISTERS: usize = 176;

    /// Slots a round trip loads beside `ACC` accumulators: `MAX_SLOTS` at most.
    #[inline(always)]
    const fn slots_fitting<const ACC: usize>() -> usize {
        let fit = (Self::SUM_REGISTERS - ACC) / (4 * Self::BATCH);
        if Self::MAX_SLOTS < fit {
            Self::MAX_SLOTS
        } else {
            fit
        }
    }

    /// This warp's accumulators in block `b`'s slot of the scratch.
    #[inline(always)]
    unsafe fn slot<const ACC: usize>(&self, scratch: *mut f32, b: usize) -> *mut f32 {
        scratch.add(SPLIT_TAIL_MAX_BLOCKS * SPLIT_TAIL_COUNTERS + b * Self::SLOT + self.warp * 32 * ACC)
    }

    /// Chunk `j` of a lane's accumulators (4 f32, 16 bytes) in a slot: fragment
    /// order, lane-interleaved 16-byte groups, coalesced per warp.
    #[inline(always)]
    unsafe fn chunk(slot: *mut f32, j: usize, lane: usize) -> *mut f32 {
        slot.add(j * 128 + lane * 4)
    }

    /// Stores this warp's accumulators into this block's slot: (the tile's
    /// counter for this warp, the split tile's index among the split ones, its
    /// slices).
    #[inline(always)]
    unsafe fn hand_over<const ACC: usize>(
        &self,
        scratch: *mut f32,
        walk: &SplitTail,
        acc: &[f32; ACC],
        lane: usize,
    ) -> (*mut u32, usize, usize) {
        let mine = self.slot::<ACC>(scratch, block_idx_x() as usize);
        for j in 0..ACC / 4 {
            let v = [acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]];
            st_global_v4(Self::chunk(mine, j, lane) as *mut u8, v.map(f32::to_bits));
        }
        // The split tiles are the last ones; tile `whole + r`'s slices are the
        // units of blocks `r · pieces` on.
        let (r, pieces) = (self.tile - walk.whole as usize, walk.pieces as usize);
        (scratch.cast::<u32>().add(r * SPLIT_TAIL_COUNTERS + self.warp), r, pieces)
    }

    /// Hands this warp's accumulators over, or (true) takes the others' into
    /// `acc`, which then holds the whole tile's sums. The finisher reads as many
    /// slots a round trip as registers allow: the sum is a chain of round trips
    /// to L2.
    #[inline(always)]
    unsafe fn finish<const ACC: usize>(&self, scratch: *mut f32, walk: &SplitTail, acc: &mut [f32; ACC]) -> bool {
        const { assert!(ACC % (4 * Self::BATCH) == 0) };
        let slots = Self::slots_fitting::<ACC>();
        let block = block_idx_x() as usize;
        let lane = thread_idx_x() as usize % 32;
        let at = |base: *mut f32, j: usize| Self::chunk(base, j, lane);
        let (counter, r, pieces) = self.hand_over(scratch, walk, acc, lane);
        if !warp_completes_count(counter, (self.kt1 - self.kt0) as u32, walk.k_tiles) {
            return false;
        }
        // Two addends round alike in either order; past two, every slot (this
        // block's stored above) is summed in block order, so the finisher that
        // happens to count last does not change the result's rounding.
        let ordered = pieces > 2;
        if ordered {
            *acc = [0.0; ACC];
        }
        let (first, end) = (r * pieces, (r + 1) * pieces);
        for batch in 0..ACC / (4 * Self::BATCH) {
            let j0 = batch * Self::BATCH;
            let mut b = first;
            while b < end {
                // Every load is issued before the first sum; a slot past the
                // tile's (or this block's, unordered) loads the first one and
                // is not added.
                let take: [bool; Self::MAX_SLOTS] =
                    core::array::from_fn(|s| s < slots && b + s < end && (ordered || b + s != block));
                let v: [[[f32; 4]; Self::BATCH]; Self::MAX_SLOTS] = core::array::from_fn(|s| {
                    let theirs = self.slot::<ACC>(scratch, if b + s < end { b + s } else { first });
                    core::array::from_fn(|i| if s < slots { ld_global_cg_f32x4(at(theirs, j0 + i)) } else { [0.0; 4] })
                });
                for (s, slot) in v.iter().enumerate() {
                    for (i, x) in slot.iter().enumerate() {
                        for (e, &y) in x.iter().enumerate() {
                            let a = &mut acc[4 * (j0 + i) + e];
                            *a = if take[s] { *a + y } else { *a };
                        }
                    }
                }
                b += slots;
            }
        }
        if lane == 0 {
            *counter = 0;
        }
        true
    }
}

impl SplitTailPart {
    /// A thread's accumulator chunks (16 bytes, 4 f32 each) a share holds.
    const SHARE: usize = 4;
    /// Slots a round trip loads while summing a share: `16 · SHARE_SLOTS`
    /// registers, which the dead accumulators leave free.
    const SHARE_SLOTS: usize = 8;
    /// With shares, a tile's word per consumer warp counts its slices in
    /// (these bits),
    const SLICES_IN: u32 = 0xff;
    /// then done with the slots and the word (8 bits from this one),
    const SLICES_DONE_AT: u32 = 8;
    /// holds the shares claimed (a bit each, at most 8, from this one),
    const CLAIMED_AT: u32 = 16;
    /// and whether a contributor stopped waiting and left its shares.
    const GAVE_UP: u32 = 1 << 24;
    /// The most slices a tile may have to be summed in shares: each count
    /// fits its 8 bits.
    pub(crate) const SHARES_MAX_PIECES: u32 = Self::SLICES_IN;
    /// How long a contributor waits for the tile's other slices before it
    /// leaves its shares to the last one in. In a full launch the slices come
    /// in within some 20 µs of each other; a block may wait far longer only
    /// where some of the launch's blocks are not resident (another stream's
    /// kernels on the SMs): then waiting without end could deadlock.
    pub(crate) const SHARES_WAIT_NS: u64 = 200_000;

    /// Hands this warp's accumulators over and, once every slice of the tile
    /// has, finishes shares of the tile: the `SHARE`-chunk shares of a
    /// thread's accumulators are dealt round the tile's contributors, so the
    /// sums run on all of its blocks where [`Self::finish`] runs them on the
    /// last. Each share sums every slot in block order from zero, as `finish`
    /// does past two slices: the same bits, whichever block sums it.
    /// `store(j, v)` writes chunk `j`.
    ///
    /// A contributor waits for the others at most `wait_ns` ([`Self::shares`]),
    /// so the launch finishes even where not all its blocks can be resident.
    #[inline(always)]
    unsafe fn scatter<const ACC: usize>(
        &self,
        scratch: *mut f32,
        walk: &SplitTail,
        acc: &[f32; ACC],
        wait_ns: u64,
        mut store: impl FnMut(usize, [f32; 4]),
    ) {
        const { assert!(ACC % (4 * Self::SHARE) == 0 && ACC / (4 * Self::SHARE) <= 8) };
        let shares = ACC / (4 * Self::SHARE);
        let block = block_idx_x() as usize;
        let lane = thread_idx_x() as usize % 32;
        let at = |base: *mut f32, j: usize| Self::chunk(base, j, lane);
        let (word, r, pieces) = self.hand_over(scratch, walk, acc, lane);
        let (first, end) = (r * pieces, (r + 1) * pieces);
        let every = (1u32 << shares) - 1;
        let own = (0..shares).filter(|s| s % pieces == block - first).fold(0u32, |m, s| m | 1 << s);
        sync_warp();
        let mut mine = 0;
        if lane == 0 {
            mine = Self::shares(word, walk.pieces, own, every, wait_ns);
        }
        let mut mine = shuffle_u32(mine, 0);
        sync_warp();
        while mine != 0 {
            let j0 = mine.trailing_zeros() as usize * Self::SHARE;
            mine &= mine - 1;
            let mut sum = [[0.0f32; 4]; Self::SHARE];
            let mut b = first;
            while b < end {
                // Every load is issued before the first sum; a slot past the
                // tile's is not addressed nor loaded (the same for the whole
                // warp), nor added.
                let v: [[[f32; 4]; Self::SHARE]; Self::SHARE_SLOTS] = core::array::from_fn(|s| {
                    core::array::from_fn(|i| {
                        if b + s < end {
                            ld_global_cg_f32x4(at(self.slot::<ACC>(scratch, b + s), j0 + i))
                        } else {
                            [0.0; 4]
                        }
                    })
                });
                for (s, slot) in v.iter().enumerate() {
                    for (i, x) in slot.iter().enumerate() {
                        for (e, &y) in x.iter().enumerate() {
                            sum[i][e] = if b + s < end { sum[i][e] + y } else { sum[i][e] };
                        }
                    }
                }
                b += Self::SHARE_SLOTS;
            }
            for (i, &v) in sum.iter().enumerate() {
                store(j0 + i, v);
            }
        }
        // Counted again once done with the slots and the word; the last
        // clears the word, when every contributor has.
        sync_warp();
        if lane == 0 {
            let old = atom_add_acq_rel_u32(word, 1 << Self::SLICES_DONE_AT);
            if (old >> Self::SLICES_DONE_AT) & Self::SLICES_IN == walk.pieces - 1 {
                *word = 0;
            }
        }
    }

    /// Lane 0: counts this warp's slice in among the tile's `pieces` and
    /// returns the shares (bits of `every`) the warp sums: its `own` once all
    /// slices are in; the last one in, those of contributors that gave up
    /// waiting too. A contributor that waited `wait_ns` in vain sums none.
    /// Shares are claimed in the word only where some contributor gave up
    /// before the count became whole (which every later reader of the count
    /// sees); otherwise each sums its own, as without the bound.
    #[inline(always)]
    unsafe fn shares(word: *mut u32, pieces: u32, own: u32, every: u32, wait_ns: u64) -> u32 {
        let claim = |bits: u32| bits & !(atom_or_relaxed_u32(word, bits << Self::CLAIMED_AT) >> Self::CLAIMED_AT);
        let old = atom_add_acq_rel_u32(word, 1);
        if old & Self::SLICES_IN == pieces - 1 {
            return if old & Self::GAVE_UP == 0 { own } else { own | claim(every & !own) };
        }
        let start = global_timer_ns();
        let whole = loop {
            let now = ld_acquire_u32(word);
            if now & Self::SLICES_IN == pieces {
                break now;
            }
            if global_timer_ns() - start >= wait_ns {
                let now = atom_or_acq_rel_u32(word, Self::GAVE_UP);
                if now & Self::SLICES_IN == pieces {
                    break now;
                }
                return 0;
            }
        };
        if whole & Self::GAVE_UP == 0 {
            own
        } else {
            claim(own)
        }
    }
}

/// The block's output tiles of `T`'s width, in the order `W` walks them.
#[inline(always)]
pub(crate) unsafe fn gemm_tma<W: TileWalk, const ACC: usize, T: WideTile<ACC>>(a: GemmTmaArgs) {
    // The launch's shared memory: `stages` ring stages, the slack, then 16 bytes
    // of barriers a stage (`abi::gemm::tma*::SMEM_BYTES`); with `TMA_STORE`,
    // two residual barriers after them, padded to 1024 bytes, and the output's staging.
    const { assert!(ACC * 2 == T::BN) };
    // The TMA-store epilogue stores whole 64-column boxes, SwiGLU's half-wide rows too.
    const { assert!(!W::TMA_STORE || ACC % 64 == 0) };
    // The next kernel may start its own prologue as SMs free up.
    launch_dependents();
    let (bn, stages) = (T::BN, T::STAGES);
    let stage_bytes = ((BM + bn) * BK * 2) as u32;
    let g = a.gemm;
    let tid = thread_idx_x() as usize;
    let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
    let (m_tiles, n_tiles) = (m.div_ceil(BM), n.div_ceil(bn));
    let k_tiles = k.div_ceil(BK);
    // K tiles per slice, and slices per tile (one without a split).
    let per_split = if W::SPLIT { (g.k_split as usize / BK).max(1) } else { k_tiles };
    let splits = if W::SPLIT { k_tiles.div_ceil(per_split) } else { 1 };
    let block = block_idx_x() as usize;
    let tail = SplitTail::new(m_tiles * n_tiles, k_tiles, grid_dim_x() as usize);
    let (first, step, end) = if W::SPLIT_TAIL { (block, 0, tail.end as usize) } else { W::walk(m_tiles * n_tiles * splits) };
    // The unit at `u`: its output tile (row, column, index), its K tiles, and
    // the next unit's position.
    let unit = |u: usize| {
        let (tile, kt0, kt1, next) = if W::SPLIT_TAIL {
            let (tile, kt0, kt1) = tail.at(u);
            (tile, kt0, kt1, tail.next(block, u))
        } else {
            let (tile, z) = (u / splits, u % splits);
            (tile, z * per_split, k_tiles.min((z + 1) * per_split), u + step)
        };
        let (tm, tn) = tile_of(tile, m_tiles, n_tiles);
        (tm, tn, tile, kt0, kt1, next)
    };

    let ring = Ring::new(stages, stage_bytes, X_BYTES);
    // The TMA-store epilogue's residual tiles, loaded into its staging.
    let residual_by_tma = W::TMA_STORE && g.epilogue == abi::epilogue::RESIDUAL;
    if tid == 0 {
        if W::TMA_STORE {
            for c in 0..CONSUMERS {
                ring.residual(c).init(1);
            }
        }
        ring.init(CONSUMERS as u32);
    }
    // The role split below tests `tid == 0` again, so LLVM threads the branch
    // through this barrier: it must tolerate lanes arriving from two copies.
    sync_threads_unaligned();

    let warpgroup = tid / 128;
    if warpgroup == 0 {
        // The epilogue's transposes and the split walks' unit arithmetic need
        // more than the 168 registers a thread gets at 384: the producer hands
        // its spares over.
        wgmma::setmaxnreg_dec::<40>();
        if tid == 0 {
            tma::acquire_map(a.map_x);
            tma::acquire_map(a.map_w);
            // `it` counts K tiles across all of this block's output tiles: it
            // names the ring stage and the barrier phase.
            let mut it = 0;
            let mut u = first;
            // Weights are resident: the first unit's first stages load them
            // before the previous kernel ends, X (its output) only after.
            let early = if u < end {
                let (_, tn, _, kt0, kt1, _) = unit(u);
                let early = (kt1 - kt0).min(stages);
                for s in 0..early {
                    ring.full(s).arrive_expect_tx(stage_bytes);
                    tma::load_2d(ring.w(s), a.map_w, ((kt0 + s) * BK) as i32, (tn * bn) as i32, ring.full(s));
                }
                early
            } else {
                0
            };
            wait_for_prior_grids();
            while u < end {
                let (tm, tn, _, kt0, kt1, next) = unit(u);
                for kt in kt0..kt1 {
                    let s = it % stages;
                    if it >= stages {
                        // Phase (it / stages - 1) of `empty`: the consumers' release
                        // of this stage's previous K tile.
                        ring.empty(s).wait(((it / stages) as u32 - 1) & 1);
                    }
                    let k0 = (kt * BK) as i32;
                    if it >= early {
                        ring.full(s).arrive_expect_tx(stage_bytes);
                        tma::load_2d(ring.w(s), a.map_w, k0, (tn * bn) as i32, ring.full(s));
                    }
                    tma::load_2d(ring.x(s), a.map_x, k0, (tm * BM) as i32, ring.full(s));
                    it += 1;
                }
                u = next;
            }
        }
        return;
    }

    // 128 · 40 + 256 · 232 fit the SM's 65536.
    wgmma::setmaxnreg_inc::<232>();
    // The output, the residual and the split tail's scratch are earlier
    // kernels' too; X arrives only after the producer's wait anyway.
    wait_for_prior_grids();
    let c = warpgroup - 1;
    let (warp, lane) = ((tid % 128) / 32, tid % 32);
    let stamps = Stamps::new::<W>(g.workspace, tid);
    if W::STAMPS {
        stamps.put(0, sm_id() as u64);
    }
    stamps.time(1);
    let mut acc = [0.0f32; ACC];
    let mut it = 0;
    let mut units = 0u64;
    let mut u = first;
    let stage_out = if W::TMA_STORE { tma_store::staging(ring.staging(), c, bn) } else { 0 };
    if W::TMA_STORE && tid % 128 == 0 {
        // This thread stores each tile's boxes and loads the residual's.
        tma::acquire_map(a.map_out);
        if residual_by_tma {
            tma::acquire_map(a.map_residual);
        }
    }
    while u < end {
        let (tm, tn, tile, kt0, kt1, next) = unit(u);
        // The K tile under which the residual starts loading into the staging.
        let residual_at = if W::TMA_STORE { kt1 - (kt1 - kt0).min(tma_store::RESIDUAL_LEAD) } else { 0 };
        for kt in kt0..kt1 {
            let s = it % stages;
            ring.full(s).wait((it / stages) as u32 & 1);
            if it == 0 {
                stamps.time(2);
            }
            wgmma::fence();
            for kk in 0..BK / 16 {
                // This consumer's 64 rows of X start 64 rows (8 KiB) into the box;
                // one k16 step is 32 bytes along the swizzled rows.
                let da = wgmma::desc_k_major_sw128(ring.x(s) + (c * 64 * 128 + kk * 32) as u32);
                let db = wgmma::desc_k_major_sw128(ring.w(s) + (kk * 32) as u32);
                T::mma(&mut acc, da, db, kt > kt0 || kk > 0);
            }
            wgmma::commit_group();
            if residual_by_tma && kt == residual_at && tid % 128 == 0 {
                tma_store::load_residual(a.map_residual, stage_out, ring.residual(c), c, tm, tn, bn);
            }
            // Keep this K tile's group in flight; the previous one has now read its stage.
            wgmma::wait_group::<1>();
            if kt > kt0 && tid % 128 == 0 {
                ring.empty((it - 1) % stages).arrive();
            }
            it += 1;
        }
        wgmma::wait_group::<0>();
        stamps.time(3);
        // The tile's last stage is free too: the producer may be waiting for it
        // to load the next tile.
        if W::MORE_TILES && tid % 128 == 0 {
            ring.empty((it - 1) % stages).arrive();
        }

        let ws = g.workspace as *mut f32;
        let pairs = ThreadPairs { row0: tm * BM + c * 64 + warp * 16 + lane / 4, col0: tn * bn + 2 * (lane % 4), m, n };
        units += 1;
        stamps.put(5, units);
        if W::SPLIT_TAIL && (kt0 > 0 || kt1 < k_tiles) {
            let part = SplitTailPart { tile, kt0, kt1, warp: c * 4 + warp };
            if !W::WHOLE_FINISH
                && tail.pieces >= SPLIT_TAIL_SHARES_FROM
                && tail.pieces <= SplitTailPart::SHARES_MAX_PIECES
            {
                // A slice is a block's last unit: `acc` is dead past its slot.
                part.scatter(ws, &tail, &acc, W::SHARES_WAIT_NS, |j, v| {
                    pairs.chunk(j, |row, col, i| store_pair(g, row, col, v[i], v[i + 1]))
                });
                stamps.time(4);
                break;
            }
            let finished = part.finish(ws, &tail, &mut acc);
            stamps.put(6, finished as u64);
            if !finished {
                stamps.time(4);
                u = next;
                continue;
            }
        }
        if W::SPLIT {
            // col and n are even: every pair is 8-byte aligned.
            pairs.each::<ACC>(|row, col, i| red_add_f32x2(ws.add(row * n + col), acc[i], acc[i + 1]));
        } else if W::TMA_STORE {
            // One residual load a tile: its barrier's phase is the tile's count.
            let residual = residual_by_tma.then(|| (ring.residual(c), (units - 1) as u32 & 1));
            let s = tma_store::TileStore {
                map_out: a.map_out,
                epilogue: g.epilogue,
                stage: stage_out,
                c,
                t: tid % 128,
                tm,
                tn,
                bn,
                residual,
            };
            tma_store::store_tile_tma(s, &acc);
        } else {
            store_tile(g, &pairs, &acc);
        }
        stamps.time(4);
        u = next;
    }
    if W::TMA_STORE {
        tma_store::store_tile_done(tid % 128);
    }
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_persistent(a: GemmTmaArgs) {
    gemm_tma::<Persistent, 128, Cols256>(a)
}
crate::launch_bounds!(gemm_bf16_tma_persistent: GemmTmaArgs, 384, 1);

/// [`Persistent`]'s walk, the last partial round's tiles split along K
/// ([`SplitTail`]): where the tiles leave SMs idle in their last round.
pub(crate) struct PersistentSplitTail;

impl TileWalk for PersistentSplitTail {
    const MORE_TILES: bool = true;
    const SPLIT_TAIL: bool = true;
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_split_tail(a: GemmTmaArgs) {
    gemm_tma::<PersistentSplitTail, 128, Cols256>(a)
}
crate::launch_bounds!(gemm_bf16_tma_split_tail: GemmTmaArgs, 384, 1);

/// 128×128 tiles (`abi::gemm::tma_n128`): each consumer 64 × 128 on
/// m64n128k16, a ring of more stages in the same shared memory; twice the
/// tiles of 128×256 where those leave SMs idle.
struct Cols128;

impl WideTile<64> for Cols128 {
    const BN: usize = abi::gemm::tma_n128::BN;
    const STAGES: usize = abi::gemm::tma_n128::STAGES;
    #[inline(always)]
    fn mma(acc: &mut [f32; 64], desc_a: u64, desc_b: u64, accumulate: bool) {
        wgmma::mma_m64n128k16(acc, desc_a, desc_b, accumulate);
    }
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_persistent_n128(a: GemmTmaArgs) {
    gemm_tma::<Persistent, 64, Cols128>(a)
}
crate::launch_bounds!(gemm_bf16_tma_persistent_n128: GemmTmaArgs, 384, 1);

/// 128×192 tiles (`abi::gemm::tma_n192`): each consumer 64 × 192 on
/// m64n192k16, a 5-stage ring; for widths that 192 divides and 256 does not
/// fill the SMs with (N = 6144: 32 column tiles, not 24).
pub(crate) struct Cols192;

impl WideTile<96> for Cols192 {
    const BN: usize = abi::gemm::tma_n192::BN;
    const STAGES: usize = abi::gemm::tma_n192::STAGES;
    #[inline(always)]
    fn mma(acc: &mut [f32; 96], desc_a: u64, desc_b: u64, accumulate: bool) {
        wgmma::mma_m64n192k16(acc, desc_a, desc_b, accumulate);
    }
}

/// 128×224 tiles (`abi::gemm::tma_n224`): each consumer 64 × 224 on
/// m64n224k16, a 5-stage ring; N = 28672 in 128 column tiles, one round on
/// 132 SMs at M = 128 where 128×256 tiles leave 20 idle.
pub(crate) struct Cols224;

impl WideTile<112> for Cols224 {
    const BN: usize = abi::gemm::tma_n224::BN;
    const STAGES: usize = abi::gemm::tma_n224::STAGES;
    #[inline(always)]
    fn mma(acc: &mut [f32; 112], desc_a: u64, desc_b: u64, accumulate: bool) {
        wgmma::mma_m64n224k16(acc, desc_a, desc_b, accumulate);
    }
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_persistent_n192(a: GemmTmaArgs) {
    gemm_tma::<Persistent, 96, Cols192>(a)
}
crate::launch_bounds!(gemm_bf16_tma_persistent_n192: GemmTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_persistent_n224(a: GemmTmaArgs) {
    gemm_tma::<Persistent, 112, Cols224>(a)
}
crate::launch_bounds!(gemm_bf16_tma_persistent_n224: GemmTmaArgs, 384, 1);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn gemm_bf16_tma_split_tail_n192(a: GemmTmaArgs) {
    gemm_tma::<PersistentSplitTail, 96, Cols192>(a)
}
crate::launch_bounds!(gemm_bf16_tma_split_tail_n192: GemmTmaArgs, 384, 1);
