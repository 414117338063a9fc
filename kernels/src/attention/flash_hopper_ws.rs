//! FlashAttention forward for Hopper (sm_90a), warp-specialized: a producer
//! warpgroup and both GEMMs on `wgmma`.
//!
//! Warpgroup 0 produces: it gives registers back (`setmaxnreg`), and one thread
//! loads each Q tile once and streams K and V tiles through the ring by TMA (two
//! stages; one of K and one of V at head dim 256), refilling a stage once both
//! consumers have released it. Nothing
//! else runs there, so the consumers never wait on a refill of their own.
//! Warpgroups 1 and 2 take the registers (hd128: 64 S and 64 O accumulators per
//! thread) and 64 query rows each: S = Q·Kᵀ on m64n128k16 `wgmma` from shared
//! memory; the online softmax on the accumulators; then O += P·V on `wgmma` with
//! P in registers, packed to bf16 straight from S's accumulators (their layout is
//! the A fragment's), and V N-major from the same swizzled TMA tile. O's
//! accumulators have mma.sync's C layout, so `tile_ops` rescales and finishes
//! them as in `flash_v2`. At head dim 256 the key tile is 128 wide in one stage
//! of K and one of V (two of each would pass shared memory), S's 64
//! accumulators per thread beside O's 128; on the counter walk it is 64 wide in
//! two stages. A `Schedule` hands a block its
//! query tiles and a `Rescale` runs the softmax step (how O follows the max,
//! whether the consumers take turns at it, whether P·V runs a tile late): the
//! shipped entries take one tile per block, or walk the tile grid with at most
//! one block per SM, by stride or from a counter (`hopper_walk`), and rescale
//! on every tile; at head dim 128 with a causal mask the consumers also take
//! turns at their exponentials, and without one, from 2048 queries, they take
//! turns at issuing with P·V a tile late; at 256 they take turns at issuing,
//! P·V in order, off the counter walk; at 64 they take turns at their exponentials on the counter walk,
//! causal or not (`hopper_turns`), and on long sequences three consumers take
//! 192 query rows (512 threads)
//! (`dev::hopper_persistent` holds the others).

use super::hopper_tile::{KeyTile, QueryTile, TileSmem, HALF_COLS};
use super::hopper_walk::{Counter, Strided};
use super::tile_ops::{finish_row, lse, online_softmax, p_frag, rescale, softmax_scores};
use crate::gemm::quad_store::quad_transpose;
use crate::gpu::bf16::pack_bf16x2;
use crate::gpu::mem::st_global_v4;
use crate::gpu::mma::FragC;
use crate::gpu::shared::{st_shared_v4, SharedArray};
use crate::gpu::thread::{named_sync, sync_threads_unaligned, thread_idx_x};
use crate::gpu::tma;
use crate::gpu::wgmma::{self, SmemDesc};
use abi::attention::{HOPPER, HOPPER_BARRIER_BYTES, HOPPER_HD256, O_STORE_ROWS};
use abi::FlashTmaArgs;

/// Registers per thread after the hand-over, two consumer warpgroups:
/// 128 × 40 + 256 × 232 = 64512 of the SM's 65536.
const PRODUCER_REGS: u32 = 40;
const CONSUMER_REGS: u32 = 232;
/// Three consumer warpgroups: 128 × 24 + 384 × 160 = 64512.
const PRODUCER_REGS_3: u32 = 24;
const CONSUMER_REGS_3: u32 = 160;
/// Two consumers over one K/V stage (head dim 256 on 128-key tiles, S's 64
/// accumulators beside O's 128), or holding S, P and O at once at head dim 256
/// (P·V a tile late): 128 × 24 + 256 × 240 = 64512. The walks' producers spill
/// at 24 where they hold a second stage's state.
const PRODUCER_REGS_1: u32 = 24;
const CONSUMER_REGS_1: u32 = 240;

const _: () = assert!(HOPPER.threads == 384);
// Within what the block holds at launch (ptxas: 168 per thread at 384 threads,
// 128 at 512), or `setmaxnreg.inc` waits forever.
const _: () = assert!(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= 384 * 168);
const _: () = assert!(128 * PRODUCER_REGS_3 + 384 * CONSUMER_REGS_3 <= 512 * 128);
const _: () = assert!(128 * PRODUCER_REGS_1 + 256 * CONSUMER_REGS_1 <= 384 * 168);

/// O's accumulators as `[f32; ACC]` for `wgmma` and as C fragments for `tile_ops`.
pub(in crate::attention) trait PvMma<const DTILES: usize> {
    /// acc += P (16 keys, A fragment) · V (16 keys × D, N-major at `v`).
    fn pv(o: &mut [FragC; DTILES], p: [u32; 4], v: u64);
}

pub(in crate::attention) struct Hd64;
pub(in crate::attention) struct Hd128;
pub(in crate::attention) struct Hd256;

impl PvMma<8> for Hd64 {
    #[inline(always)]
    fn pv(o: &mut [FragC; 8], p: [u32; 4], v: u64) {
        // SAFETY: [FragC; 8] and [f32; 32] have the same layout.
        let acc = unsafe { &mut *(o as *mut [FragC; 8] as *mut [f32; 32]) };
        wgmma::mma_rs_m64n64k16(acc, p, v, true);
    }
}

impl PvMma<16> for Hd128 {
    #[inline(always)]
    fn pv(o: &mut [FragC; 16], p: [u32; 4], v: u64) {
        // SAFETY: [FragC; 16] and [f32; 64] have the same layout.
        let acc = unsafe { &mut *(o as *mut [FragC; 16] as *mut [f32; 64]) };
        wgmma::mma_rs_m64n128k16(acc, p, v, true);
    }
}

impl PvMma<32> for Hd256 {
    #[inline(always)]
    fn pv(o: &mut [FragC; 32], p: [u32; 4], v: u64) {
        // SAFETY: [FragC; 32] and [f32; 128] have the same layout.
        let acc = unsafe { &mut *(o as *mut [FragC; 32] as *mut [f32; 128]) };
        wgmma::mma_rs_m64n256k16(acc, p, v, true);
    }
}

/// How a schedule that picks tiles as it goes hands each tile's index from the
/// producer's first thread to the consumers: in `word`, stored before the
/// thread's arrival on `q_full` (the tile's Q barrier) releases it; the
/// consumers read it once that phase completes, and every consumer thread
/// arrives on `q_empty` once done with it, so the next store waits for every
/// read (mbarriers order each pair of threads, which racecheck follows).
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "dev"), allow(dead_code))]
pub(in crate::attention) struct Handoff {
    pub word: SharedArray<u32, 1>,
    pub q_full: tma::Barrier,
    pub q_empty: tma::Barrier,
}

/// The producer's announcement of tile `n`: a schedule that hands tiles over
/// sets `word` to the tile's index, one that does not leaves it `None`.
#[derive(Clone, Copy)]
pub(in crate::attention) struct Announce {
    pub h: Handoff,
    pub word: Option<u32>,
}

impl Announce {
    /// The producer's first thread, once `q_empty` says every consumer is
    /// done with the previous tile, and before its arrival on `q_full`.
    #[inline(always)]
    pub unsafe fn publish(self) {
        if let Some(t) = self.word {
            self.h.word.store(0, t);
        }
    }
}

/// How a block walks its query tiles: the producer's warp and the consumers
/// each call `each(tile, n)` on the block's tiles in the same order, `n`
/// counting them from 0; the producer's also takes the tile's [`Announce`].
pub(in crate::attention) trait Schedule {
    /// Whether tiles are handed over ([`Handoff`]): every consumer thread then
    /// arrives on `q_empty`, else each consumer warpgroup's first.
    const HANDS_OVER: bool = false;
    /// # Safety
    /// `a`'s offsets arrays must hold the launch's sequences.
    unsafe fn produce(a: &FlashTmaArgs, h: Handoff, rows: usize, each: impl FnMut(QueryTile, u32, Announce));
    /// # Safety
    /// As [`Schedule::produce`].
    unsafe fn consume(a: &FlashTmaArgs, h: Handoff, rows: usize, each: impl FnMut(QueryTile, u32));
}

/// One tile per block, the grid's (heads, query tiles, sequences).
pub(in crate::attention) struct OneTile;

impl OneTile {
    #[inline(always)]
    unsafe fn walk(a: &FlashTmaArgs, rows: usize, mut each: impl FnMut(QueryTile, u32)) {
        let tile = QueryTile::of_block(&a.flash, rows);
        if !tile.is_past_end() {
            each(tile, 0);
        }
    }
}

impl Schedule for OneTile {
    #[inline(always)]
    unsafe fn produce(a: &FlashTmaArgs, h: Handoff, rows: usize, mut each: impl FnMut(QueryTile, u32, Announce)) {
        OneTile::walk(a, rows, |tile, n| each(tile, n, Announce { h, word: None }))
    }
    #[inline(always)]
    unsafe fn consume(a: &FlashTmaArgs, _: Handoff, rows: usize, each: impl FnMut(QueryTile, u32)) {
        OneTile::walk(a, rows, each)
    }
}

/// Consumer warpgroup `c` of `count`; `anchor`, a shared address nothing stores
/// to, for the predicated-off stores that order work against a barrier
/// (`gpu::thread::named_sync_after`).
#[derive(Clone, Copy)]
pub(in crate::attention) struct Consumer {
    pub c: u32,
    pub count: u32,
    pub anchor: u32,
}

/// The softmax step of one key tile: how O follows the running max, whether
/// the consumers take turns at it, and whether P·V runs a tile late.
pub(in crate::attention) trait Rescale {
    /// Whether P·V runs one key tile late: S(j) = Q·K(j)ᵀ and then
    /// O += P(j−1)·V(j−1) are issued together, S(j)'s softmax runs while that
    /// P·V is in flight, and O takes S(j)'s factor just before P(j)·V(j) is
    /// issued; [`Rescale::online_softmax`] is then not called. K and V get
    /// barriers of their own, since V is held a tile longer than K.
    const LATE_PV: bool = false;
    /// Before a consumer's first key tile in the block.
    #[inline(always)]
    fn begin(_: Consumer) {}
    /// After its last; every consumer has run as many steps as the others.
    #[inline(always)]
    fn end(_: Consumer) {}
    /// Before and after the issue of a key tile's GEMMs (a turn at the tensor
    /// cores, where the consumers take turns there): where P·V runs late once
    /// for the pair, else once for S and once for P·V.
    #[inline(always)]
    fn before_issue(_: Consumer) {}
    #[inline(always)]
    fn after_issue(_: Consumer) {}
    /// O rescaled on every tile unless a rescale says otherwise.
    #[inline(always)]
    fn online_softmax<const NT: usize, const DT: usize>(
        s: &mut [FragC; NT],
        o: &mut [FragC; DT],
        m: &mut [f32; 2],
        l: &mut [f32; 2],
        scale_log2: f32,
        _who: Consumer,
    ) {
        online_softmax(s, o, m, l, scale_log2);
    }
}

/// O rescaled on every tile.
pub(in crate::attention) struct Eager;

impl Rescale for Eager {}

/// Where S = Q·Kᵀ reads Q from: the consumers' k16 fragments of it, loaded
/// once per query tile (none where `wgmma` reads Q from shared memory).
pub(in crate::attention) trait QOperand {
    /// Whether Q's buffer is free once [`QOperand::load`] returns in every
    /// thread of a warpgroup (else once its last S = Q·Kᵀ has retired).
    const RELEASED_AT_LOAD: bool;
    /// Fragments for up to 8 k16 steps (head dim 128); the unused ones vanish.
    type Frags: Copy;
    /// # Safety
    /// Q's tile must have arrived; every thread of consumer `c` calls it, `t` its index there.
    unsafe fn load<const HALVES: usize, const KEYS: usize, const ROWS: usize>(
        mem: &TileSmem<HALVES, KEYS, ROWS>,
        c: usize,
        t: usize,
    ) -> Self::Frags;
    /// Issues and commits S = Q·Kᵀ of consumer `c` against stage `s`.
    fn qk<const HALVES: usize, const KEYS: usize, const ROWS: usize, const SACC: usize, K: KeyTile<SACC>>(
        mem: &TileSmem<HALVES, KEYS, ROWS>,
        q: &Self::Frags,
        acc: &mut [f32; SACC],
        s: usize,
        c: usize,
    );
}

/// Q read from shared memory by every S = Q·Kᵀ.
pub(in crate::attention) struct SharedQ;

impl QOperand for SharedQ {
    const RELEASED_AT_LOAD: bool = false;
    type Frags = ();
    #[inline(always)]
    unsafe fn load<const HALVES: usize, const KEYS: usize, const ROWS: usize>(
        _: &TileSmem<HALVES, KEYS, ROWS>,
        _: usize,
        _: usize,
    ) {
    }
    #[inline(always)]
    fn qk<const HALVES: usize, const KEYS: usize, const ROWS: usize, const SACC: usize, K: KeyTile<SACC>>(
        mem: &TileSmem<HALVES, KEYS, ROWS>,
        _: &(),
        acc: &mut [f32; SACC],
        s: usize,
        c: usize,
    ) {
        mem.qk::<SACC, K>(acc, s, c);
    }
}

/// Q's fragments in registers ([`TileSmem::q_frags`]), loaded once per tile,
/// its buffer released at once: S = Q·Kᵀ reads only K from shared memory, a
/// third less traffic there per step (head dim 64; at 128, ptxas gives P the
/// registers of Q, still live, and the results are wrong).
pub(in crate::attention) struct RegisterQ;

impl QOperand for RegisterQ {
    const RELEASED_AT_LOAD: bool = true;
    type Frags = [[u32; 4]; 8];
    #[inline(always)]
    unsafe fn load<const HALVES: usize, const KEYS: usize, const ROWS: usize>(
        mem: &TileSmem<HALVES, KEYS, ROWS>,
        c: usize,
        t: usize,
    ) -> [[u32; 4]; 8] {
        mem.q_frags(c, t)
    }
    #[inline(always)]
    fn qk<const HALVES: usize, const KEYS: usize, const ROWS: usize, const SACC: usize, K: KeyTile<SACC>>(
        mem: &TileSmem<HALVES, KEYS, ROWS>,
        q: &[[u32; 4]; 8],
        acc: &mut [f32; SACC],
        s: usize,
        _: usize,
    ) {
        mem.qk_rs::<SACC, K>(acc, q, s);
    }
}

/// `ROWS` query rows, 64 per consumer warpgroup; `HALVES` = D/64; `DTILES` = D/8; `K`'s key tiles of `KEYS` = 2·`SACC` keys,
/// S in `NT` = `KEYS`/8 C fragments and P in `PK` = `KEYS`/16 A fragments; the
/// block's tiles as `S` hands them out, O kept by `R`, Q read as `Q` says.
#[inline(always)]
pub(in crate::attention) unsafe fn flash_hopper_ws<
    const ROWS: usize,
    const D: usize,
    const HALVES: usize,
    const DTILES: usize,
    P: PvMma<DTILES>,
    const KEYS: usize,
    const SACC: usize,
    const NT: usize,
    const PK: usize,
    K: KeyTile<SACC>,
    S: Schedule,
    R: Rescale,
    Q: QOperand,
    O: RowWriter,
>(
    a: FlashTmaArgs,
) {
    const {
        assert!(HALVES == D / HALF_COLS && DTILES == D / 8);
        assert!(K::BN == KEYS && SACC == 4 * NT && NT == 2 * PK && K::TILE.keys == KEYS);
        assert!(HALVES * (ROWS + K::TILE.stages * 2 * KEYS) * HALF_COLS * 2 == K::TILE.tile_bytes(D));
        // Q's two barriers, a full and an empty one per stage, the hand-over's
        // word, and V's own full and empty ones per stage where P·V runs late.
        assert!(8 * (3 + 4 * K::TILE.stages) <= HOPPER_BARRIER_BYTES);
        assert!(K::TILE.rows == ROWS && (ROWS == 128 || ROWS == 192));
        assert!(K::TILE.threads as usize == (1 + ROWS / 64) * 128);
    }
    let consumers = ROWS / 64;
    let f = a.flash;
    let tid = thread_idx_x() as usize;
    // K/V tiles in flight: the ring's stages. One stage holds K and V on
    // barriers of their own, so K's next tile loads once S has read this one.
    const { assert!(K::TILE.stages >= 2 || (K::TILE.stages == 1 && !R::LATE_PV)) };
    let stages = K::TILE.stages;
    let split_kv = R::LATE_PV || stages == 1;
    let mem = TileSmem::<HALVES, KEYS, ROWS>::new(stages);
    let (q_at, k_at, v_at) = (|h| mem.q(h), |s, h| mem.k(s, h), |s| mem.v(s));
    let (half_q, half_kv) = (TileSmem::<HALVES, KEYS, ROWS>::HALF_Q, TileSmem::<HALVES, KEYS, ROWS>::HALF_KV);
    let q_full = mem.barrier(0);
    let full = |s: usize| mem.barrier(1 + s);
    let empty = |s: usize| mem.barrier(1 + stages + s);
    let q_empty = mem.barrier(1 + 2 * stages);
    let handoff = Handoff { word: SharedArray::at(mem.barrier(2 + 2 * stages).0), q_full, q_empty };
    // Where K and V are split (P·V late, or one stage), `full` and `empty` are K's and V has its own.
    let v_full = |s: usize| mem.barrier(3 + 2 * stages + s);
    let v_empty = |s: usize| mem.barrier(3 + 3 * stages + s);
    // Every consumer thread where tiles are handed over, else each warpgroup's first.
    let q_releases = if S::HANDS_OVER { 128 * consumers } else { consumers };
    // Every consumer thread where P·V runs late: no branch may stand between
    // a `wgmma`'s issue and its wait (ptxas would serialize them).
    let kv_releases = if R::LATE_PV { 128 * consumers } else { consumers };

    if tid == 0 {
        q_full.init(1);
        q_empty.init(q_releases as u32);
        for s in 0..stages {
            full(s).init(1);
            empty(s).init(kv_releases as u32);
            if split_kv {
                v_full(s).init(1);
                v_empty(s).init(kv_releases as u32);
            }
        }
        tma::fence_barrier_init();
    }
    // The role split tests `tid` again: LLVM may thread it through this barrier.
    sync_threads_unaligned();

    // From lane 0, so ptxas knows it is warp-uniform and keeps what derives from
    // it (the wgmma descriptors) in uniform registers, not copied in per wgmma.
    let warpgroup = crate::gpu::warp::shuffle_u32(tid as u32 / 128, 0) as usize;
    // Whether the consumers take `CONSUMER_REGS_1` (see there), decided at compile time.
    let wide = const { ROWS == 128 && (K::TILE.stages == 1 || (R::LATE_PV && D == 256)) };
    if warpgroup == 0 {
        if wide {
            wgmma::setmaxnreg_dec::<PRODUCER_REGS_1>();
        } else if consumers == 2 {
            wgmma::setmaxnreg_dec::<PRODUCER_REGS>();
        } else {
            wgmma::setmaxnreg_dec::<PRODUCER_REGS_3>();
        }
        // One warp walks the tiles, so that a schedule's named barriers see it
        // whole; its first thread issues the loads.
        if tid >= 32 {
            return;
        }
        if tid == 0 {
            tma::acquire_map(a.map_q);
            tma::acquire_map(a.map_k);
            tma::acquire_map(a.map_v);
        }
        // K/V tiles loaded so far, over all of the block's query tiles: the
        // ring's stage and lap.
        let mut ring = 0usize;
        S::produce(&a, handoff, ROWS, #[inline(always)] |tile, n, announce| {
            let QueryTile { sp, head, q0, .. } = tile;
            let kv_head = tile.kv_head(&f);
            let mut load_kv = |j: usize| {
                let s = ring % stages;
                if ring >= stages {
                    // Lap (ring / stages - 1) of `empty`: both consumers are done with the stage's last tile.
                    empty(s).wait(((ring / stages) as u32 - 1) & 1);
                }
                let row = (sp.k_start as usize + j * KEYS) as i32;
                if split_kv {
                    full(s).arrive_expect_tx(HALVES as u32 * half_kv);
                    for h in 0..HALVES {
                        tma::load_3d(k_at(s, h), a.map_k, (h * HALF_COLS) as i32, kv_head as i32, row, full(s));
                    }
                    if ring >= stages {
                        v_empty(s).wait(((ring / stages) as u32 - 1) & 1);
                    }
                    v_full(s).arrive_expect_tx(HALVES as u32 * half_kv);
                    for h in 0..HALVES {
                        let col = (h * HALF_COLS) as i32;
                        tma::load_3d(v_at(s) + h as u32 * half_kv, a.map_v, col, kv_head as i32, row, v_full(s));
                    }
                } else {
                    full(s).arrive_expect_tx(2 * HALVES as u32 * half_kv);
                    for h in 0..HALVES {
                        let col = (h * HALF_COLS) as i32;
                        tma::load_3d(k_at(s, h), a.map_k, col, kv_head as i32, row, full(s));
                        tma::load_3d(v_at(s) + h as u32 * half_kv, a.map_v, col, kv_head as i32, row, full(s));
                    }
                }
                ring += 1;
            };
            let n_tiles = tile.key_tiles(KEYS);
            // After the first tile, one K/V tile loads while the consumers finish with Q.
            let early = if n > 0 { n_tiles.min(1) } else { 0 };
            if tid == 0 {
                for j in 0..early {
                    load_kv(j);
                }
                if n > 0 {
                    q_empty.wait((n - 1) & 1);
                }
                announce.publish();
                q_full.arrive_expect_tx(HALVES as u32 * half_q);
                let q_row = (sp.q_start as usize + q0) as i32;
                for h in 0..HALVES {
                    tma::load_3d(q_at(h), a.map_q, (h * HALF_COLS) as i32, head as i32, q_row, q_full);
                }
                for j in early..n_tiles {
                    load_kv(j);
                }
            }
        });
        return;
    }
    if wide {
        wgmma::setmaxnreg_inc::<CONSUMER_REGS_1>();
    } else if consumers == 2 {
        wgmma::setmaxnreg_inc::<CONSUMER_REGS>();
    } else {
        wgmma::setmaxnreg_inc::<CONSUMER_REGS_3>();
    }

    let c = warpgroup - 1;
    if O::STAGES_O && tid % 128 == 0 {
        tma::acquire_map(a.map_o);
    }
    // Q's buffer: TMA writes it, no thread stores to it.
    let who = Consumer { c: c as u32, count: consumers as u32, anchor: q_at(0) };
    let (warp, lane) = ((tid % 128) / 32, tid % 32);
    let mut ring = 0usize;
    // Where S's and O's accumulators take over 160 of the consumers' registers
    // (head dim 256 on 80- or 128-key tiles), ℓ's row sums must finish before
    // P·V's issue: left to sink under it, they keep S's exponentials live
    // beside P's fragments, and the consumers spill.
    let tight = SACC + 4 * DTILES > 160;
    R::begin(who);
    // Inlined, or a long tile's body is called with its captures on the stack.
    S::consume(&a, handoff, ROWS, #[inline(always)] |tile, n| {
        let QueryTile { sp, head, q0, .. } = tile;
        let row_in_seq = |h: usize| q0 + c * 64 + warp * 16 + lane / 4 + 8 * h;
        let mut m = [f32::NEG_INFINITY; 2];
        let mut l = [0.0f32; 2];
        let mut o: [FragC; DTILES] = [[0.0; 4]; DTILES];
        q_full.wait(n & 1);
        let qf = Q::load(&mem, c, tid % 128);
        if Q::RELEASED_AT_LOAD {
            if S::HANDS_OVER {
                q_empty.arrive();
            } else {
                // The whole warpgroup's loads are done before its release.
                named_sync(1 + c as u32, 128);
                if tid % 128 == 0 {
                    q_empty.arrive();
                }
            }
        }

        // S = Q·Kᵀ of the ring's stage `s` for this warpgroup's 64 rows (KEYS
        // keys, D/16 k-steps), issued in its turn and retired.
        let s_alone = #[inline(always)]
        |s: usize| -> [FragC; NT] {
            let mut acc = [0.0f32; SACC];
            R::before_issue(who);
            Q::qk::<HALVES, KEYS, ROWS, SACC, K>(&mem, &qf, &mut acc, s, c);
            R::after_issue(who);
            wgmma::wait_group::<0>();
            wgmma::fence_operands(&mut acc);
            // SAFETY: [f32; SACC] and [FragC; NT] have the same layout (SACC = 4·NT).
            *(&acc as *const [f32; SACC] as *const [FragC; NT])
        };
        if R::LATE_PV {
            let n_tiles = tile.key_tiles(KEYS);
            let phase = |r: usize| (r / stages) as u32 & 1;
            let mut corr = [1.0f32; 2];
            let mut p = [[0u32; 4]; PK];
            // The first tile's S and softmax: no P·V to run under them.
            if n_tiles > 0 {
                let s = ring % stages;
                full(s).wait(phase(ring));
                let mut sf = s_alone(s);
                empty(s).arrive();
                sp.mask(&mut sf, 0, KEYS, q0, row_in_seq, lane);
                corr = softmax_scores(&mut sf, &mut m, &mut l, f.scale_log2);
                p = core::array::from_fn(|kk| p_frag(&sf[2 * kk], &sf[2 * kk + 1]));
            }
            // O += P·V of the ring's tile `r`: O first takes P's factors.
            let pv = #[inline(always)]
            |o: &mut [FragC; DTILES], p: &[[u32; 4]; PK], corr: [f32; 2], r: usize| {
                let sv = r % stages;
                rescale(o, corr);
                v_full(sv).wait(phase(r));
                wgmma::fence_operands(o.as_flattened_mut());
                wgmma::fence();
                let v = SmemDesc::mn_major_sw128(v_at(sv), half_kv);
                for (kk, &pk) in p.iter().enumerate() {
                    P::pv(o, pk, v.at((kk * 2048) as u32));
                }
                wgmma::commit_group();
            };
            // Key tile j ≥ 1: S(j) and P(j−1)·V(j−1) issued, S(j)'s softmax
            // under that P·V. `masked` is a constant in each loop below, so
            // no branch stands between the issues and the waits.
            let mut step = #[inline(always)]
            |j: usize, masked: bool| {
                let r = ring + j;
                let s = r % stages;
                full(s).wait(phase(r));
                let mut acc = [0.0f32; SACC];
                R::before_issue(who);
                Q::qk::<HALVES, KEYS, ROWS, SACC, K>(&mem, &qf, &mut acc, s, c);
                pv(&mut o, &p, corr, r - 1);
                R::after_issue(who);
                wgmma::wait_group::<1>();
                wgmma::fence_operands(&mut acc);
                empty(s).arrive();
                // SAFETY: as above.
                let mut sf: [FragC; NT] = *(&acc as *const [f32; SACC] as *const [FragC; NT]);
                if masked {
                    sp.mask_each(&mut sf, j * KEYS, row_in_seq, lane);
                }
                corr = softmax_scores(&mut sf, &mut m, &mut l, f.scale_log2);
                // P(j−1)·V(j−1) has retired: its P registers and V's stage are free.
                wgmma::wait_group_after::<0>(l, who.anchor);
                wgmma::fence_operands(o.as_flattened_mut());
                wgmma::fence_operands_u32(p.as_flattened_mut());
                v_empty((r - 1) % stages).arrive();
                p = core::array::from_fn(|kk| p_frag(&sf[2 * kk], &sf[2 * kk + 1]));
            };
            let clear = sp.unmasked_tiles(q0, KEYS).clamp(1, n_tiles.max(1));
            for j in 1..clear {
                step(j, false);
            }
            for j in clear..n_tiles {
                step(j, true);
            }
            if n_tiles > 0 {
                let r = ring + n_tiles - 1;
                pv(&mut o, &p, corr, r);
                wgmma::wait_group::<0>();
                wgmma::fence_operands(o.as_flattened_mut());
                v_empty(r % stages).arrive();
            }
            ring += n_tiles;
        } else {
            // The tile index in 32 bits: one register less across the loop.
            for j in 0..tile.key_tiles(KEYS) as u32 {
                let j = j as usize;
                let (s, phase) = (ring % stages, (ring / stages) as u32 & 1);
                full(s).wait(phase);
                let mut sf = s_alone(s);
                if split_kv && tid % 128 == 0 {
                    empty(s).arrive();
                }

                sp.mask(&mut sf, j * KEYS, KEYS, q0, row_in_seq, lane);
                R::online_softmax(&mut sf, &mut o, &mut m, &mut l, f.scale_log2, who);
                if tight {
                    wgmma::fence_operands(&mut l);
                }

                // O += P·V: P from registers, 16 keys per step; V's k16 step is 16 rows
                // (2048 bytes) down its tile, its second 64 columns one half-tile on.
                // Every P fragment first: registers a queued wgmma reads must not be
                // written until it retires (ptxas fences between them otherwise).
                let p: [[u32; 4]; PK] = core::array::from_fn(|kk| p_frag(&sf[2 * kk], &sf[2 * kk + 1]));
                wgmma::fence_operands(o.as_flattened_mut());
                if split_kv {
                    v_full(s).wait(phase);
                }
                R::before_issue(who);
                wgmma::fence();
                let v = SmemDesc::mn_major_sw128(if stages == 1 { mem.unhoisted().v(s) } else { v_at(s) }, half_kv);
                for (kk, &pk) in p.iter().enumerate() {
                    P::pv(&mut o, pk, v.at((kk * 2048) as u32));
                }
                wgmma::commit_group();
                R::after_issue(who);
                wgmma::wait_group::<0>();
                wgmma::fence_operands(o.as_flattened_mut());
                // Both GEMMs of this warpgroup on the stage have retired.
                if tid % 128 == 0 {
                    if split_kv {
                        v_empty(s).arrive();
                    } else {
                        empty(s).arrive();
                    }
                }
                ring += 1;
            }
        }
        // Every S = Q·Kᵀ of the tile has retired: Q's buffer may take the next tile.
        if !Q::RELEASED_AT_LOAD && (S::HANDS_OVER || tid % 128 == 0) {
            q_empty.arrive();
        }
        let rows = Rows {
            f: &f,
            m: &m,
            l: &l,
            head,
            q_start: sp.q_start as usize,
            len_q: sp.len_q as usize,
            row_in_seq,
            lane,
            staged: if O::STAGES_O {
                StagedO { t: tid % 128, c, first_row: q0 + c * 64, staging: mem.staged_o(c), map_o: a.map_o }
            } else {
                StagedO::NONE
            },
        };
        O::write::<D, DTILES, _>(&o, rows);
    });
    R::end(who);
    if O::STAGES_O {
        O::finish(tid % 128);
    }
}

/// A consumer warpgroup's rows of O to write, and where: `f`'s O and LSE at
/// `head` for the sequence at `q_start` of `len_q` queries, the lane's row h
/// being `row_in_seq(h)`; `m` and `l` its rows' max and partial sums.
pub(in crate::attention) struct Rows<'a, R: Fn(usize) -> usize> {
    pub f: &'a abi::FlashArgs,
    pub m: &'a [f32; 2],
    pub l: &'a [f32; 2],
    pub head: usize,
    pub q_start: usize,
    pub len_q: usize,
    pub row_in_seq: R,
    pub lane: usize,
    /// For writers that stage O ([`RowWriter::STAGES_O`]), else zeros.
    #[cfg_attr(not(feature = "dev"), allow(dead_code))]
    pub staged: StagedO,
}

/// Where a warpgroup stages its rows of O for a TMA store.
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "dev"), allow(dead_code))]
pub(in crate::attention) struct StagedO {
    /// The thread's index in its warpgroup, and the warpgroup's consumer index.
    pub t: usize,
    pub c: usize,
    /// The warpgroup's first row in the sequence (`row_in_seq` of its thread 0).
    pub first_row: usize,
    /// The warpgroup's staging in shared memory, and the map over O.
    pub staging: u32,
    pub map_o: u64,
}

impl StagedO {
    pub(in crate::attention) const NONE: StagedO = StagedO { t: 0, c: 0, first_row: 0, staging: 0, map_o: 0 };
}

/// How a consumer warpgroup writes its rows of O, divided by ℓ, in bf16, and
/// their LSE; rows past the sequence are not written.
pub(in crate::attention) trait RowWriter {
    /// Whether it stages O in shared memory (the launch sized for it by
    /// `hopper_smem_staged_o`, the map over O given): only then is
    /// [`Rows::staged`] filled in and [`RowWriter::finish`] called.
    const STAGES_O: bool = false;

    /// # Safety
    /// `rows.f`'s outputs must hold the rows; every thread of the warpgroup calls it.
    unsafe fn write<const D: usize, const DTILES: usize, R: Fn(usize) -> usize>(o: &[FragC; DTILES], rows: Rows<R>);

    /// After the warpgroup's last tile, every thread (`t` its index in the warpgroup).
    #[inline(always)]
    fn finish(_t: usize) {}
}

/// 16-byte stores: the quad's pairs of four C fragments transposed across its
/// lanes ([`quad_transpose`]), so each lane holds eight consecutive outputs of
/// its row, as the GEMM's epilogue does; a quarter of the stores, each filling
/// its sectors. O is a tensor's whole allocation, so its rows are 16-byte aligned.
#[cfg_attr(not(feature = "dev"), allow(dead_code))]
pub(in crate::attention) struct QuadStores;

impl RowWriter for QuadStores {
    #[inline(always)]
    unsafe fn write<const D: usize, const DTILES: usize, R: Fn(usize) -> usize>(o: &[FragC; DTILES], r: Rows<R>) {
        const { assert!(DTILES % 4 == 0 && D == 8 * DTILES) };
        let f = r.f;
        let (o_stride, q) = (f.n_heads as usize * D * 2, r.lane % 4);
        for h in 0..2 {
            let (total, inv) = finish_row(r.l, h);
            let row = (r.row_in_seq)(h);
            // Lanes past the sequence still shuffle: only their stores are skipped.
            let inside = row < r.len_q;
            let token = r.q_start + row;
            let dst = (f.o as *mut u8).wrapping_add(token * o_stride + r.head * D * 2);
            for grp in 0..DTILES / 4 {
                let word = |j: usize| {
                    let frag = &o[4 * grp + j];
                    pack_bf16x2(frag[2 * h] * inv, frag[2 * h + 1] * inv)
                };
                // Lane q: fragment 4·grp + q's pairs of the quad, columns 32·grp + 8q on.
                let v = quad_transpose([word(0), word(1), word(2), word(3)], q);
                if inside {
                    st_global_v4(dst.add((32 * grp + 8 * q) * 2), v);
                }
            }
            if inside && q == 0 {
                *(f.lse as *mut f32).add(r.head * f.total_q as usize + token) = lse(r.m[h], total);
            }
        }
    }
}

/// O staged in shared memory and stored by TMA, a box of 64 rows by 64
/// columns a half, issued by the warpgroup's first thread: the copy runs on
/// while the warpgroup starts its next tile. A warpgroup whose rows reach past
/// the sequence writes them by [`QuadStores`] instead, since a box would
/// write the next sequence's rows. LSE as the others write it. Needs the
/// staging past the barriers (`hopper_smem_staged_o`) and the map over O.
#[cfg_attr(not(feature = "dev"), allow(dead_code))]
pub(in crate::attention) struct TmaStores;

impl RowWriter for TmaStores {
    const STAGES_O: bool = true;

    #[inline(always)]
    unsafe fn write<const D: usize, const DTILES: usize, R: Fn(usize) -> usize>(o: &[FragC; DTILES], r: Rows<R>) {
        const { assert!(DTILES % 4 == 0 && D == 8 * DTILES && D % HALF_COLS == 0) };
        let g = r.staged;
        if g.first_row + O_STORE_ROWS > r.len_q {
            return QuadStores::write::<D, DTILES, R>(o, r);
        }
        let (f, q, leader) = (r.f, r.lane % 4, g.t == 0);
        // The staging is free once the last box stored from it has been read out.
        if leader {
            tma::store_wait_read::<0>();
        }
        let barrier = 1 + g.c as u32;
        named_sync(barrier, 128);
        let half_bytes = O_STORE_ROWS * HALF_COLS * 2;
        for h in 0..2 {
            let (total, inv) = finish_row(r.l, h);
            // The thread's row among the warpgroup's 64.
            let row = (g.t / 32) * 16 + r.lane / 4 + 8 * h;
            for grp in 0..DTILES / 4 {
                let word = |j: usize| {
                    let frag = &o[4 * grp + j];
                    pack_bf16x2(frag[2 * h] * inv, frag[2 * h + 1] * inv)
                };
                // Lane q: columns 32·grp + 8q on, one 16-byte chunk of its row,
                // XORed with the row's place in its 8-row group (the swizzle).
                let v = quad_transpose([word(0), word(1), word(2), word(3)], q);
                let col = 32 * grp + 8 * q;
                let chunk = ((col % HALF_COLS) / 8) ^ (row % 8);
                st_shared_v4(g.staging + ((col / HALF_COLS) * half_bytes + row * 128 + chunk * 16) as u32, v);
            }
            if q == 0 {
                let token = r.q_start + g.first_row + row;
                *(f.lse as *mut f32).add(r.head * f.total_q as usize + token) = lse(r.m[h], total);
            }
        }
        // Each thread's stores before the copy engine reads them.
        wgmma::fence_proxy_async_shared();
        named_sync(barrier, 128);
        if leader {
            for half in 0..D / HALF_COLS {
                let src = g.staging + (half * half_bytes) as u32;
                let token = (r.q_start + g.first_row) as i32;
                tma::store_3d(g.map_o, (half * HALF_COLS) as i32, r.head as i32, token, src);
            }
            tma::store_commit();
        }
    }

    #[inline(always)]
    fn finish(t: usize) {
        // The copies have read the staging and written O before the block ends.
        if t == 0 {
            tma::store_wait::<0>();
        }
    }
}

/// The three head dims' entries of one schedule and rescale, 384 threads each:
/// 128-key tiles at 64 (Q read as `$q64` reads it) and 128, 64-key tiles at 256,
/// where O's 128 accumulators per thread fit beside S's 32 and P's 16 in the
/// consumers' 232 registers; Q from shared memory at 128 and 256. The dev
/// versions' (the shipped entries take 128-key tiles at 256).
#[cfg_attr(not(feature = "dev"), allow(unused_macros))]
macro_rules! hopper_entries {
    ($schedule:ty, $rescale:ty, $q64:ty, $hd64:ident, $hd128:ident, $hd256:ident) => {
        $crate::attention::flash_hopper_ws::hopper_entries!(
            $schedule,
            $rescale,
            $q64,
            $crate::attention::flash_hopper_ws::QuadStores,
            $hd64,
            $hd128,
            $hd256
        );
    };
    ($schedule:ty, $rescale:ty, $q64:ty, $writer:ty, $hd64:ident, $hd128:ident, $hd256:ident) => {
        $crate::attention::flash_hopper_ws::hopper_entry!(64, $hd64, $schedule, $rescale, $q64, $writer);
        $crate::attention::flash_hopper_ws::hopper_entry!(128, $hd128, $schedule, $rescale, $writer);
        $crate::attention::flash_hopper_ws::hopper_entry!(256, $hd256, $schedule, $rescale, $writer);
    };
}

/// One entry of [`hopper_entries`]' kind at one head dim: `64` with its Q
/// operand, `128` and `256` with Q from shared memory; `256 keys128` on
/// 128-key tiles in one stage of K and one of V.
macro_rules! hopper_entry {
    (64, $name:ident, $schedule:ty, $rescale:ty, $q64:ty, $writer:ty) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: FlashTmaArgs) {
            use $crate::attention::flash_hopper_ws::{flash_hopper_ws, Hd64};
            use $crate::attention::hopper_tile::{Keys128, BM, BN};
            flash_hopper_ws::<BM, 64, 1, 8, Hd64, BN, 64, 16, 8, Keys128, $schedule, $rescale, $q64, $writer>(a)
        }
        $crate::launch_bounds!($name: FlashTmaArgs, 384, 1);
    };
    (128, $name:ident, $schedule:ty, $rescale:ty, $writer:ty) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: FlashTmaArgs) {
            use $crate::attention::flash_hopper_ws::{flash_hopper_ws, Hd128, SharedQ};
            use $crate::attention::hopper_tile::{Keys128, BM, BN};
            flash_hopper_ws::<BM, 128, 2, 16, Hd128, BN, 64, 16, 8, Keys128, $schedule, $rescale, SharedQ, $writer>(a)
        }
        $crate::launch_bounds!($name: FlashTmaArgs, 384, 1);
    };
    (256, $name:ident, $schedule:ty, $rescale:ty, $writer:ty) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: FlashTmaArgs) {
            use $crate::attention::flash_hopper_ws::{flash_hopper_ws, Hd256, SharedQ};
            use $crate::attention::hopper_tile::{Keys64, BM};
            flash_hopper_ws::<BM, 256, 4, 32, Hd256, 64, 32, 8, 4, Keys64, $schedule, $rescale, SharedQ, $writer>(a)
        }
        $crate::launch_bounds!($name: FlashTmaArgs, 384, 1);
    };
    (256 keys128, $name:ident, $schedule:ty, $rescale:ty, $writer:ty) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: FlashTmaArgs) {
            use $crate::attention::flash_hopper_ws::{flash_hopper_ws, Hd256, SharedQ};
            use $crate::attention::hopper_tile::{Keys128Hd256, BM};
            flash_hopper_ws::<BM, 256, 4, 32, Hd256, 128, 64, 16, 8, Keys128Hd256, $schedule, $rescale, SharedQ, $writer>(a)
        }
        $crate::launch_bounds!($name: FlashTmaArgs, 384, 1);
    };
}
pub(in crate::attention) use hopper_entry;
#[cfg_attr(not(feature = "dev"), allow(unused_imports))]
pub(in crate::attention) use hopper_entries;

const _: () = assert!(HOPPER_HD256.threads == 384 && HOPPER_HD256.keys == 64);

// The shipped entries with free consumers: one tile per block, the strided walk
// and the counter walk, as the host's `plan::walk` picks; at head dim 64 Q in
// registers (there the counter walk's consumers take turns: `hopper_turns`);
// at 256 only the counter walk's 64-key tiles in two stages, which it takes for
// short causal sequences (on its 128-key tiles the consumers take turns at
// issuing: `hopper_turns`).
hopper_entry!(64, flash_fwd_hopper_ws_hd64, OneTile, Eager, RegisterQ, QuadStores);
hopper_entry!(128, flash_fwd_hopper_ws_hd128, OneTile, Eager, QuadStores);
hopper_entry!(64, flash_fwd_hopper_ws_walk_hd64, Strided, Eager, RegisterQ, QuadStores);
hopper_entry!(128, flash_fwd_hopper_ws_walk_hd128, Strided, Eager, QuadStores);
hopper_entry!(128, flash_fwd_hopper_ws_counter_hd128, Counter, Eager, QuadStores);
hopper_entry!(256, flash_fwd_hopper_ws_counter_hd256, Counter, Eager, QuadStores);

// Head dim 64 on long sequences: three consumers over 192 rows, Q from shared
// memory (in registers it spills at their 160 registers). On the counter walk
// they take turns (`hopper_turns`).
#[no_mangle]
pub unsafe extern "ptx-kernel" fn flash_fwd_hopper_ws_m192_hd64(a: FlashTmaArgs) {
    use crate::attention::hopper_tile::{Keys128Rows192, BN};
    flash_hopper_ws::<192, 64, 1, 8, Hd64, BN, 64, 16, 8, Keys128Rows192, OneTile, Eager, SharedQ, QuadStores>(a)
}
crate::launch_bounds!(flash_fwd_hopper_ws_m192_hd64: FlashTmaArgs, 512, 1);
