//! What the Hopper attention kernels share: the query tile a block takes, and
//! the layout of its shared memory.

use super::tile_ops::SeqSpan;
use crate::gpu::shared::dynamic_shared_base;
use crate::gpu::tma::Barrier;
use crate::gpu::mma::ldmatrix_x4;
use crate::gpu::wgmma::{self, SmemDesc};
use abi::attention::{Tile, HOPPER, HOPPER_ALIGN, HOPPER_HD256, O_STAGING_OFFSET, O_STORE_ROWS};
use abi::{FlashArgs, FlashTmaArgs};

/// Query rows per tile (every Hopper kernel's), and the 128-key tiles of head
/// dims 64 and 128.
pub const BM: usize = HOPPER.rows;
pub const BN: usize = HOPPER.keys;
/// A 64-column half of a tile: rows of 128 bytes, the TMA box and wgmma layout.
pub const HALF_COLS: usize = 64;

/// A key-tile width with its S = Q·Kᵀ step: m64n`BN`k16 into `SACC` = `BN`/2
/// f32 accumulators per thread, and the launch's tiling.
pub trait KeyTile<const SACC: usize> {
    const BN: usize;
    const TILE: Tile;
    fn qk_mma(acc: &mut [f32; SACC], desc_a: u64, desc_b: u64, accumulate: bool);
    /// As `qk_mma` with A, a k16 slice of Q, in registers (its A fragment).
    fn qk_mma_rs(acc: &mut [f32; SACC], a: [u32; 4], desc_b: u64, accumulate: bool);
}

/// 128 keys: head dims 64 and 128.
pub struct Keys128;

impl KeyTile<64> for Keys128 {
    const BN: usize = BN;
    const TILE: Tile = HOPPER;
    #[inline(always)]
    fn qk_mma(acc: &mut [f32; 64], desc_a: u64, desc_b: u64, accumulate: bool) {
        wgmma::mma_m64n128k16(acc, desc_a, desc_b, accumulate);
    }
    #[inline(always)]
    fn qk_mma_rs(acc: &mut [f32; 64], a: [u32; 4], desc_b: u64, accumulate: bool) {
        wgmma::mma_rs_kmajor_m64n128k16(acc, a, desc_b, accumulate);
    }
}

/// 80 keys: head dim 256 with longer key tiles than [`Keys64`].
#[cfg_attr(not(feature = "dev"), allow(dead_code))]
pub struct Keys80;

impl KeyTile<40> for Keys80 {
    const BN: usize = abi::attention::dev::HOPPER_N80.keys;
    const TILE: Tile = abi::attention::dev::HOPPER_N80;
    #[inline(always)]
    fn qk_mma(acc: &mut [f32; 40], desc_a: u64, desc_b: u64, accumulate: bool) {
        wgmma::mma_m64n80k16(acc, desc_a, desc_b, accumulate);
    }
    #[inline(always)]
    fn qk_mma_rs(acc: &mut [f32; 40], a: [u32; 4], desc_b: u64, accumulate: bool) {
        wgmma::mma_rs_kmajor_m64n80k16(acc, a, desc_b, accumulate);
    }
}

/// 176 keys: head dims 64 and 128 with fewer, longer key tiles.
#[cfg_attr(not(feature = "dev"), allow(dead_code))]
pub struct Keys176;

impl KeyTile<88> for Keys176 {
    const BN: usize = abi::attention::dev::HOPPER_N176.keys;
    const TILE: Tile = abi::attention::dev::HOPPER_N176;
    #[inline(always)]
    fn qk_mma(acc: &mut [f32; 88], desc_a: u64, desc_b: u64, accumulate: bool) {
        wgmma::mma_m64n176k16(acc, desc_a, desc_b, accumulate);
    }
    #[inline(always)]
    fn qk_mma_rs(acc: &mut [f32; 88], a: [u32; 4], desc_b: u64, accumulate: bool) {
        wgmma::mma_rs_kmajor_m64n176k16(acc, a, desc_b, accumulate);
    }
}

/// A key tile of 128 keys ([`Keys128`]'s wgmma) under another tiling of the block.
macro_rules! keys128_under {
    ($(#[$doc:meta])* $name:ident, $tile:expr) => {
        $(#[$doc])*
        #[cfg_attr(not(feature = "dev"), allow(dead_code))]
        pub struct $name;

        impl KeyTile<64> for $name {
            const BN: usize = BN;
            const TILE: Tile = $tile;
            #[inline(always)]
            fn qk_mma(acc: &mut [f32; 64], desc_a: u64, desc_b: u64, accumulate: bool) {
                Keys128::qk_mma(acc, desc_a, desc_b, accumulate);
            }
            #[inline(always)]
            fn qk_mma_rs(acc: &mut [f32; 64], a: [u32; 4], desc_b: u64, accumulate: bool) {
                Keys128::qk_mma_rs(acc, a, desc_b, accumulate);
            }
        }
    };
}

keys128_under!(
    /// 128 keys under 192 query rows (three consumer warpgroups): head dim 64.
    Keys128Rows192,
    abi::attention::HOPPER_M192
);
keys128_under!(
    /// 128 keys at head dim 256, one stage of K and one of V.
    Keys128Hd256,
    abi::attention::HOPPER_HD256_N128
);
keys128_under!(
    /// 128 keys in three K/V stages: head dims 64 and 128.
    Keys128Stages3,
    abi::attention::dev::HOPPER_STAGES3
);

/// 64 keys: head dim 256 on the counter walk and in the dev versions, where O
/// takes 128 accumulators per thread.
pub struct Keys64;

impl KeyTile<32> for Keys64 {
    const BN: usize = HOPPER_HD256.keys;
    const TILE: Tile = HOPPER_HD256;
    #[inline(always)]
    fn qk_mma(acc: &mut [f32; 32], desc_a: u64, desc_b: u64, accumulate: bool) {
        wgmma::mma_m64n64k16(acc, desc_a, desc_b, accumulate);
    }
    #[inline(always)]
    fn qk_mma_rs(acc: &mut [f32; 32], a: [u32; 4], desc_b: u64, accumulate: bool) {
        wgmma::mma_rs_kmajor_m64n64k16(acc, a, desc_b, accumulate);
    }
}

/// A block's tile: `rows` query rows of one head of one sequence.
#[derive(Clone, Copy)]
pub struct QueryTile {
    pub sp: SeqSpan,
    pub head: usize,
    pub q0: usize,
    pub rows: usize,
}

impl QueryTile {
    /// This block's tile (grid: heads, query tiles, sequences). Last query tiles
    /// first: under a causal mask they have the most keys.
    ///
    /// # Safety
    /// `f`'s offsets arrays must hold the grid's sequences.
    #[inline(always)]
    pub unsafe fn of_block(f: &FlashArgs, rows: usize) -> QueryTile {
        use crate::gpu::thread::{block_idx_x, block_idx_y, block_idx_z, grid_dim_y};
        let head = block_idx_x() as usize;
        let sp = SeqSpan::of(f, block_idx_z() as usize);
        QueryTile { sp, head, q0: (grid_dim_y() - 1 - block_idx_y()) as usize * rows, rows }
    }

    /// Tile `t` of a walk over the launch's tile grid ([`FlashTmaArgs::walk_tile`]).
    ///
    /// # Safety
    /// `a`'s offsets arrays must hold tile `t`'s sequence.
    #[cfg_attr(not(feature = "dev"), allow(dead_code))]
    #[inline(always)]
    pub unsafe fn of_walk(a: &FlashTmaArgs, t: u32, rows: usize) -> QueryTile {
        let (seq, head, tile) = a.walk_tile(t);
        let sp = SeqSpan::of(&a.flash, seq as usize);
        QueryTile { sp, head: head as usize, q0: tile as usize * rows, rows }
    }

    /// Whether the tile starts past its sequence's end (the block has nothing to do).
    #[inline(always)]
    pub fn is_past_end(&self) -> bool {
        self.q0 >= self.sp.len_q as usize
    }

    /// The KV head the query head reads.
    #[inline(always)]
    pub fn kv_head(&self, f: &FlashArgs) -> usize {
        self.head / (f.n_heads / f.n_kv_heads) as usize
    }

    /// The key tiles of `bn` its rows see.
    #[inline(always)]
    pub fn key_tiles(&self, bn: usize) -> usize {
        self.sp.key_tiles(self.q0, self.rows, bn)
    }
}

/// Shared memory at head dim `HALVES` × 64 with `ROWS`-row Q and `KEYS`-key tiles, 1024-byte
/// aligned (the launch adds the slack): the Q halves, then per stage (`stages` of them)
/// the K halves and the V halves, then 8-byte barriers.
#[derive(Clone, Copy)]
pub struct TileSmem<const HALVES: usize, const KEYS: usize, const ROWS: usize = BM> {
    base: u32,
    stages: usize,
}

impl<const HALVES: usize, const KEYS: usize, const ROWS: usize> TileSmem<HALVES, KEYS, ROWS> {
    pub const HALF_Q: u32 = (ROWS * HALF_COLS * 2) as u32;
    pub const HALF_KV: u32 = (KEYS * HALF_COLS * 2) as u32;

    /// The layout with `stages` K/V stages (a constant of the kernel: its tile's).
    #[inline(always)]
    pub fn new(stages: usize) -> Self {
        let align = HOPPER_ALIGN as u32;
        TileSmem { base: (dynamic_shared_base() + (align - 1)) & !(align - 1), stages }
    }

    /// This layout from a base LLVM cannot hoist: addresses and descriptors
    /// taken from it are computed where they are used. With one K/V stage every
    /// tile's descriptors are the same, and LLVM would otherwise hold them all
    /// across the key loop beside S and O.
    #[inline(always)]
    pub fn unhoisted(&self) -> Self {
        TileSmem { base: crate::gpu::unhoisted_u32(self.base), ..*self }
    }

    /// Q's half `h`.
    #[inline(always)]
    pub fn q(&self, h: usize) -> u32 {
        self.base + h as u32 * Self::HALF_Q
    }

    /// Stage `s`'s K half `h`.
    #[inline(always)]
    pub fn k(&self, s: usize, h: usize) -> u32 {
        self.base + HALVES as u32 * Self::HALF_Q + (s * 2 * HALVES + h) as u32 * Self::HALF_KV
    }

    /// Stage `s`'s V, its halves `HALF_KV` apart.
    #[inline(always)]
    pub fn v(&self, s: usize) -> u32 {
        self.k(s, 0) + HALVES as u32 * Self::HALF_KV
    }

    /// The `i`-th barrier past the tiles.
    #[inline(always)]
    pub fn barrier(&self, i: usize) -> Barrier {
        Barrier(self.tiles_end() + 8 * i as u32)
    }

    #[inline(always)]
    fn tiles_end(&self) -> u32 {
        self.base + HALVES as u32 * (Self::HALF_Q + self.stages as u32 * 2 * Self::HALF_KV)
    }

    /// Consumer `c`'s O staging for its TMA store, past the barriers: its
    /// [`O_STORE_ROWS`] rows, a swizzled 64-column half after another (only
    /// in launches sized by `hopper_smem_staged_o`).
    #[inline(always)]
    pub fn staged_o(&self, c: usize) -> u32 {
        // The swizzle's 1024-byte atoms: the tiles end on one.
        const { assert!(Self::HALF_Q % 1024 == 0 && Self::HALF_KV % 1024 == 0) };
        self.tiles_end() + (O_STAGING_OFFSET + c * HALVES * O_STORE_ROWS * HALF_COLS * 2) as u32
    }

    /// Warpgroup-scoped: issues and commits S = Q·Kᵀ for consumer `c`'s 64 query
    /// rows against stage `s`'s `KEYS` keys (D/16 k-steps of `K`'s wgmma).
    #[inline(always)]
    pub fn qk<const SACC: usize, K: KeyTile<SACC>>(&self, acc: &mut [f32; SACC], s: usize, c: usize) {
        const { assert!(K::BN == KEYS && 2 * SACC == KEYS) };
        let mem = if K::TILE.stages == 1 { self.unhoisted() } else { *self };
        wgmma::fence();
        for h in 0..HALVES {
            let (q, k) = (SmemDesc::k_major_sw128(mem.q(h)), SmemDesc::k_major_sw128(mem.k(s, h)));
            for kk in 0..HALF_COLS / 16 {
                // Consumer c's rows start 64 rows (8 KiB) into Q; a k16 step is 32
                // bytes along the swizzled rows.
                K::qk_mma(acc, q.at((c * 64 * 128 + kk * 32) as u32), k.at((kk * 32) as u32), h > 0 || kk > 0);
            }
        }
        wgmma::commit_group();
    }

    /// Consumer `c`'s 64 rows of Q as the A fragments of its D/16 k16 steps, by
    /// `ldmatrix` from the swizzled tile, in the first of 8 slots (head dim 128
    /// at most); `t` is the thread's index in the warpgroup. Every thread of the
    /// warpgroup calls it.
    #[inline(always)]
    pub unsafe fn q_frags(&self, c: usize, t: usize) -> [[u32; 4]; 8] {
        const { assert!(HALVES <= 2) };
        let lane = t % 32;
        // Lanes 8i..8i+7 address matrix i: rows +8 for i odd, columns +8 for i ≥ 2.
        let row = c * 64 + (t / 32) * 16 + (lane / 8 % 2) * 8 + lane % 8;
        core::array::from_fn(|k| {
            let (h, kk) = (k / (HALF_COLS / 16), k % (HALF_COLS / 16));
            // 16-byte chunk of the 128-byte row, XORed with the row's place in its 8-row group.
            let chunk = (2 * kk + lane / 16) ^ (row % 8);
            if h < HALVES {
                ldmatrix_x4(self.q(h) + (row * 128 + chunk * 16) as u32)
            } else {
                [0; 4]
            }
        })
    }

    /// [`TileSmem::qk`] with Q's A fragments from registers ([`TileSmem::q_frags`]).
    #[inline(always)]
    pub fn qk_rs<const SACC: usize, K: KeyTile<SACC>>(&self, acc: &mut [f32; SACC], q: &[[u32; 4]; 8], s: usize) {
        const { assert!(K::BN == KEYS && 2 * SACC == KEYS && HALVES <= 2) };
        wgmma::fence();
        let keys: [SmemDesc; HALVES] = core::array::from_fn(|h| SmemDesc::k_major_sw128(self.k(s, h)));
        for (k, &a) in q.iter().enumerate().take(HALVES * HALF_COLS / 16) {
            let (h, kk) = (k / (HALF_COLS / 16), k % (HALF_COLS / 16));
            K::qk_mma_rs(acc, a, keys[h].at((kk * 32) as u32), k > 0);
        }
        wgmma::commit_group();
    }
}
