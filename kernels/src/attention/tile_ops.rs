//! Warp-scoped steps shared by the attention kernels, on mma.sync fragments
//! (layouts in `gpu::mma`): the ldmatrix address patterns for K and V tiles, the
//! online-softmax update, and the per-row finish.

use crate::gpu::bf16::pack_bf16x2;
use crate::gpu::math::{ex2, ex2_fma, fma, lg2, rcp_exact};
use crate::gpu::mma::{ldmatrix_x4, ldmatrix_x4_trans, mma_bf16_16816, FragA, FragC};
use crate::gpu::tile::SmemTile;
use crate::gpu::warp::{all_lanes, shuffle_xor_f32};
use abi::FlashArgs;

/// Max over the four lanes that share a row of a C fragment.
#[inline(always)]
pub fn quad_max(v: f32) -> f32 {
    let v = v.max(shuffle_xor_f32(v, 1));
    v.max(shuffle_xor_f32(v, 2))
}

/// Sum over the four lanes that share a row of a C fragment.
#[inline(always)]
pub fn quad_sum(v: f32) -> f32 {
    let v = v + shuffle_xor_f32(v, 1);
    v + shuffle_xor_f32(v, 2)
}

/// B fragments of keys `16·np .. 16·np+16`, k-step `kk`, for S = Q·Kᵀ:
/// registers 0,1 serve n-tile 2·np and 2,3 serve n-tile 2·np+1.
///
/// # Safety
/// `kt` must hold the loaded K tile; all 32 lanes call this.
#[inline(always)]
pub unsafe fn k_frags<const BN: usize, const D: usize>(
    kt: SmemTile<BN, D>,
    np: usize,
    kk: usize,
    lane: usize,
) -> [u32; 4] {
    ldmatrix_x4(kt.chunk_addr(np * 16 + lane % 8 + 8 * (lane / 16), 2 * kk + (lane / 8) % 2))
}

/// B fragments of V for keys `16·kk ..` and head-dim tiles 2·dp, 2·dp+1 (transposed
/// load: V is stored key-major).
///
/// # Safety
/// `vt` must hold the loaded V tile; all 32 lanes call this.
#[inline(always)]
pub unsafe fn v_frags<const BN: usize, const D: usize>(
    vt: SmemTile<BN, D>,
    kk: usize,
    dp: usize,
    lane: usize,
) -> [u32; 4] {
    ldmatrix_x4_trans(vt.chunk_addr(kk * 16 + lane % 8 + 8 * ((lane / 8) % 2), 2 * dp + lane / 16))
}

/// P as an A fragment straight from two S accumulator tiles (C layout → A layout).
#[inline(always)]
pub fn p_frag(lo: &FragC, hi: &FragC) -> FragA {
    [pack_bf16x2(lo[0], lo[1]), pack_bf16x2(lo[2], lo[3]), pack_bf16x2(hi[0], hi[1]), pack_bf16x2(hi[2], hi[3])]
}

/// Online softmax over one tile of scores for the lane's two rows: the running
/// max may grow, so the partial sum ℓ and O so far are rescaled by
/// 2^(m_old − m_new) before this tile's terms are added. Scores become P in place.
/// ℓ stays a per-lane partial sum; [`finish_row`] adds up the quad.
#[inline(always)]
pub fn online_softmax<const NT: usize, const DT: usize>(
    s: &mut [FragC; NT],
    o: &mut [FragC; DT],
    m: &mut [f32; 2],
    l: &mut [f32; 2],
    scale_log2: f32,
) {
    let corr = softmax_scores(s, m, l, scale_log2);
    rescale(o, corr);
}

/// [`online_softmax`] without touching O: returns each row's factor
/// 2^(m_old − m_new) for [`rescale`], for kernels whose O is still being
/// accumulated by an earlier tile's P·V when this tile's scores are ready.
#[inline(always)]
pub fn softmax_scores<const NT: usize>(s: &mut [FragC; NT], m: &mut [f32; 2], l: &mut [f32; 2], scale_log2: f32) -> [f32; 2] {
    scores_against::<NT, 1>(s, m, l, scale_log2, |old, tile| old.max(tile))
}

/// [`softmax_scores`] with each row's max and sum kept in four partials, a
/// quarter of the dependent chain per row: the softmax runs between a
/// warpgroup's two GEMMs, so its latency is the warpgroup's idle time.
#[cfg_attr(not(all(target_feature = "sm_90a", feature = "dev")), allow(dead_code))]
#[inline(always)]
pub fn softmax_scores_split<const NT: usize>(
    s: &mut [FragC; NT],
    m: &mut [f32; 2],
    l: &mut [f32; 2],
    scale_log2: f32,
) -> [f32; 2] {
    scores_against::<NT, 4>(s, m, l, scale_log2, |old, tile| old.max(tile))
}

/// [`softmax_scores`] with every fourth C fragment's exponentials on the FMA
/// pipe ([`ex2_fma`]): a quarter of the SFU's work moved to pipes the softmax
/// leaves idler.
#[cfg_attr(not(all(target_feature = "sm_90a", feature = "dev")), allow(dead_code))]
#[inline(always)]
pub fn softmax_scores_fma_ex2<const NT: usize>(
    s: &mut [FragC; NT],
    m: &mut [f32; 2],
    l: &mut [f32; 2],
    scale_log2: f32,
) -> [f32; 2] {
    scores_in::<NT, 1, 4>(s, m, l, scale_log2, |old, tile| old.max(tile))
}

/// How far (log2) a tile's max may pass the running max before the reference
/// moves: up to it, P's terms reach 2^8, far from f32's or bf16's range.
#[cfg_attr(not(all(target_feature = "sm_90a", feature = "dev")), allow(dead_code))]
pub const MAX_SLACK_LOG2: f32 = 8.0;

/// [`softmax_scores`] whose reference max moves only when a tile's max passes it
/// by more than [`MAX_SLACK_LOG2`]; otherwise the factors are 1 and O needs no
/// rescale ([`rescale_if_moved`]). Exact after the final division: O and ℓ are
/// summed against the same reference, which cancels in O/ℓ, and the LSE adds it back.
#[cfg_attr(not(all(target_feature = "sm_90a", feature = "dev")), allow(dead_code))]
#[inline(always)]
pub fn softmax_scores_lazy<const NT: usize>(
    s: &mut [FragC; NT],
    m: &mut [f32; 2],
    l: &mut [f32; 2],
    scale_log2: f32,
) -> [f32; 2] {
    scores_against::<NT, 1>(s, m, l, scale_log2, |old, tile| if tile > old + MAX_SLACK_LOG2 { tile } else { old })
}

/// The online-softmax step against the reference `next(m_old, tile max)` picks,
/// each row's max and sum over `CHAINS` partials (C fragment i into partial
/// i % `CHAINS`).
#[inline(always)]
fn scores_against<const NT: usize, const CHAINS: usize>(
    s: &mut [FragC; NT],
    m: &mut [f32; 2],
    l: &mut [f32; 2],
    scale_log2: f32,
    next: impl Fn(f32, f32) -> f32,
) -> [f32; 2] {
    scores_in::<NT, CHAINS, 0>(s, m, l, scale_log2, next)
}

/// [`scores_against`], C fragment i's exponentials by [`ex2_fma`] where
/// `FMA_EVERY` > 0 and i % `FMA_EVERY` = `FMA_EVERY` − 1.
#[inline(always)]
fn scores_in<const NT: usize, const CHAINS: usize, const FMA_EVERY: usize>(
    s: &mut [FragC; NT],
    m: &mut [f32; 2],
    l: &mut [f32; 2],
    scale_log2: f32,
    next: impl Fn(f32, f32) -> f32,
) -> [f32; 2] {
    const { assert!(CHAINS >= 1) };
    let mut corr = [1.0f32; 2];
    for h in 0..2 {
        let m_new = next(m[h], quad_max(row_max::<NT, CHAINS>(s, h)) * scale_log2);
        let m_use;
        (m_use, corr[h]) = reference(m[h], m_new);
        let mut sum = [0.0f32; CHAINS];
        for (i, frag) in s.iter_mut().enumerate() {
            let on_fma = FMA_EVERY > 0 && i % FMA_EVERY == FMA_EVERY - 1;
            for e in 2 * h..2 * h + 2 {
                let x = fma(frag[e], scale_log2, -m_use);
                frag[e] = if on_fma { ex2_fma(x) } else { ex2(x) };
                sum[i % CHAINS] += frag[e];
            }
        }
        let sum = sum[1..].iter().fold(sum[0], |a, &b| a + b);
        l[h] = l[h] * corr[h] + sum;
        m[h] = m_new;
    }
    corr
}

/// [`online_softmax`] with the exponentials and the sums between `take` and
/// `give`: each row's new max and O's factor come first, O's rescale after.
/// `take` gets the references the exponentials use and hands them back (so it
/// can order them against its barrier), `give` gets the sums.
/// Consumer warpgroups that hand a turn around these calls never run their ex2
/// at once, so each runs at the SFU's full rate while another's GEMMs keep the
/// tensor cores busy, and the warpgroups stay half a tile apart.
#[cfg_attr(not(target_feature = "sm_90a"), allow(dead_code))]
#[inline(always)]
pub fn online_softmax_in_turn<const NT: usize, const DT: usize>(
    s: &mut [FragC; NT],
    o: &mut [FragC; DT],
    m: &mut [f32; 2],
    l: &mut [f32; 2],
    scale_log2: f32,
    take: impl FnOnce([f32; 2]) -> [f32; 2],
    give: impl FnOnce([f32; 2]),
) {
    let mut corr = [1.0f32; 2];
    let mut m_use = [0.0f32; 2];
    for h in 0..2 {
        let m_new = m[h].max(quad_max(row_max::<NT, 1>(s, h)) * scale_log2);
        (m_use[h], corr[h]) = reference(m[h], m_new);
        m[h] = m_new;
    }
    let m_use = take(m_use);
    for frag in s.iter_mut() {
        for (e, v) in frag.iter_mut().enumerate() {
            *v = ex2(fma(*v, scale_log2, -m_use[e / 2]));
        }
    }
    let sums: [f32; 2] = core::array::from_fn(|h| s.iter().fold(0.0f32, |a, frag| a + frag[2 * h] + frag[2 * h + 1]));
    give(sums);
    for h in 0..2 {
        l[h] = l[h] * corr[h] + sums[h];
    }
    rescale(o, corr);
}

/// The reference a row's exponentials subtract for the new max `m_new`, and
/// O's and ℓ's factor 2^(m_old − reference). A row with no visible key yet
/// keeps m = −∞; its reference is 0, so no −∞ − (−∞).
#[inline(always)]
fn reference(m_old: f32, m_new: f32) -> (f32, f32) {
    let m_use = if m_new == f32::NEG_INFINITY { 0.0 } else { m_new };
    (m_use, ex2(m_old - m_use))
}

/// The lane's max of row half `h` over the tile, in `CHAINS` partials (C
/// fragment i into partial i % `CHAINS`).
#[inline(always)]
fn row_max<const NT: usize, const CHAINS: usize>(s: &[FragC; NT], h: usize) -> f32 {
    let mut mx = [f32::NEG_INFINITY; CHAINS];
    for (i, frag) in s.iter().enumerate() {
        let c = &mut mx[i % CHAINS];
        *c = c.max(frag[2 * h]).max(frag[2 * h + 1]);
    }
    mx[1..].iter().fold(mx[0], |a, &b| a.max(b))
}

/// [`rescale`], skipped by a warp none of whose rows' reference moved.
#[cfg_attr(not(all(target_feature = "sm_90a", feature = "dev")), allow(dead_code))]
#[inline(always)]
pub fn rescale_if_moved<const DT: usize>(o: &mut [FragC; DT], corr: [f32; 2]) {
    if !all_lanes(corr[0] == 1.0 && corr[1] == 1.0) {
        rescale(o, corr);
    }
}

/// O's rows times [`softmax_scores`]'s factors.
#[inline(always)]
pub fn rescale<const DT: usize>(o: &mut [FragC; DT], corr: [f32; 2]) {
    for frag in o.iter_mut() {
        for (e, v) in frag.iter_mut().enumerate() {
            *v *= corr[e / 2];
        }
    }
}

/// (ℓ, 1/ℓ) for row half `h` once all keys are done (all 32 lanes call this); a
/// row that saw no key has ℓ = 0 and gets 1/ℓ = 0, so its output is exactly 0.
#[inline(always)]
pub fn finish_row(l: &[f32; 2], h: usize) -> (f32, f32) {
    let total = quad_sum(l[h]);
    (total, if total > 0.0 { rcp_exact(total) } else { 0.0 })
}

/// The row's log-sum-exp in natural log from its log2-domain max and ℓ.
#[inline(always)]
pub fn lse(m: f32, total: f32) -> f32 {
    if total > 0.0 {
        (m + lg2(total)) * core::f32::consts::LN_2
    } else {
        f32::NEG_INFINITY
    }
}

/// One block's sequence in a packed varlen batch: token offsets, lengths, and the
/// causal diagonal (bottom-right aligned: query i sees keys j ≤ i + diag).
/// Used by the Hopper kernel only (compiled for sm_90a). In 32 bits, as token
/// counts fit: the span lives across the tile loops, where registers are short.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_feature = "sm_90a"), allow(dead_code))]
pub struct SeqSpan {
    pub q_start: u32,
    pub k_start: u32,
    pub len_q: u32,
    pub len_k: u32,
    pub causal: bool,
    pub diag: i32,
}

#[cfg_attr(not(target_feature = "sm_90a"), allow(dead_code))]
impl SeqSpan {
    /// Sequence `batch` of the launch.
    ///
    /// # Safety
    /// The offsets arrays of `a` must hold `batch + 2` entries.
    #[inline(always)]
    pub unsafe fn of(a: &FlashArgs, batch: usize) -> SeqSpan {
        let (cu_q, cu_k) = (a.cu_seqlens_q as *const u32, a.cu_seqlens_k as *const u32);
        let (q_start, k_start) = (*cu_q.add(batch), *cu_k.add(batch));
        let len_q = *cu_q.add(batch + 1) - q_start;
        let len_k = *cu_k.add(batch + 1) - k_start;
        SeqSpan { q_start, k_start, len_q, len_k, causal: a.causal != 0, diag: len_k as i32 - len_q as i32 }
    }

    /// Key tiles of `bn` that query rows `q0 .. q0 + bm` need.
    #[inline(always)]
    pub fn key_tiles(&self, q0: usize, bm: usize, bn: usize) -> usize {
        let kv_end = if self.causal {
            (q0 as i32 + bm as i32 + self.diag).clamp(0, self.len_k as i32) as usize
        } else {
            self.len_k as usize
        };
        kv_end.div_ceil(bn)
    }

    /// Leading key tiles of `bn` that every row from `q0` on sees whole: none of
    /// their keys is past the sequence or, under the causal mask, past row q0's
    /// diagonal.
    #[cfg_attr(not(feature = "dev"), allow(dead_code))]
    #[inline(always)]
    pub fn unmasked_tiles(&self, q0: usize, bn: usize) -> usize {
        let whole = self.len_k as usize / bn;
        if self.causal {
            whole.min((q0 as i32 + self.diag + 1).max(0) as usize / bn)
        } else {
            whole
        }
    }

    /// Sets to −∞ the scores of keys past the sequence or, under the causal mask,
    /// past a row's diagonal, for the key tile at `kv0` of the block whose rows
    /// start at `q0`; `row(h)` is the lane's row h (g or g + 8) in the sequence.
    #[inline(always)]
    pub fn mask<const NT: usize>(
        &self,
        s: &mut [FragC; NT],
        kv0: usize,
        bn: usize,
        q0: usize,
        row: impl Fn(usize) -> usize,
        lane: usize,
    ) {
        // In 32 bits, as `mask_each`: fewer registers live across a tile loop.
        let last = (kv0 + bn - 1) as i32;
        let ragged = last >= self.len_k as i32;
        let on_diagonal = self.causal && last > q0 as i32 + self.diag;
        if ragged || on_diagonal {
            self.mask_each(s, kv0, row, lane);
        }
    }

    /// [`SeqSpan::mask`]'s per-score test on every score, with no branch around
    /// it: for code that runs while a `wgmma` is in flight, where ptxas
    /// serializes the `wgmma`s rather than wait for them in a divergent path.
    /// Index math in 32 bits: token counts fit, and it halves the compares.
    #[inline(always)]
    pub fn mask_each<const NT: usize>(&self, s: &mut [FragC; NT], kv0: usize, row: impl Fn(usize) -> usize, lane: usize) {
        let (len_k, diag) = (self.len_k as i32, self.diag);
        let first = (kv0 + 2 * (lane % 4)) as i32;
        let limits = [row(0) as i32 + diag, row(1) as i32 + diag];
        for (nt, frag) in s.iter_mut().enumerate() {
            for (e, v) in frag.iter_mut().enumerate() {
                let col = first + (nt * 8 + e % 2) as i32;
                if col >= len_k || (self.causal && col > limits[e / 2]) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// The attention kernels' shared memory: a Q tile of `QROWS` rows, then two
/// stages of (K, V) tiles of `BN` keys, all `D` wide.
#[derive(Clone, Copy)]
pub struct KvRing<const QROWS: usize, const BN: usize, const D: usize> {
    base: u32,
}

impl<const QROWS: usize, const BN: usize, const D: usize> KvRing<QROWS, BN, D> {
    /// The ring's size: the Q tile and two (K, V) stages.
    pub const BYTES: u32 = SmemTile::<QROWS, D>::BYTES + 4 * SmemTile::<BN, D>::BYTES;

    /// # Safety
    /// `base` must be a 128-byte aligned shared-window address with room for the ring.
    #[inline(always)]
    pub unsafe fn at(base: u32) -> Self {
        KvRing { base }
    }

    #[inline(always)]
    pub fn q(&self) -> SmemTile<QROWS, D> {
        unsafe { SmemTile::at(self.base) }
    }

    #[inline(always)]
    pub fn k(&self, stage: usize) -> SmemTile<BN, D> {
        unsafe { SmemTile::at(self.base + SmemTile::<QROWS, D>::BYTES + stage as u32 * 2 * SmemTile::<BN, D>::BYTES) }
    }

    #[inline(always)]
    pub fn v(&self, stage: usize) -> SmemTile<BN, D> {
        unsafe {
            SmemTile::at(self.base + SmemTile::<QROWS, D>::BYTES + (stage as u32 * 2 + 1) * SmemTile::<BN, D>::BYTES)
        }
    }
}

/// S = Q·Kᵀ for one m16 tile whose Q fragments are in registers.
///
/// # Safety
/// `kt` must hold the loaded K tile; all 32 lanes call this.
#[inline(always)]
pub unsafe fn qk_tile<const KSTEPS: usize, const NT: usize, const BN: usize, const D: usize>(
    qf: &[FragA; KSTEPS],
    kt: SmemTile<BN, D>,
    lane: usize,
) -> [FragC; NT] {
    let mut s: [FragC; NT] = [[0.0; 4]; NT];
    for (kk, qa) in qf.iter().enumerate() {
        for np in 0..NT / 2 {
            let b = k_frags(kt, np, kk, lane);
            mma_bf16_16816(&mut s[2 * np], qa, b[0], b[1]);
            mma_bf16_16816(&mut s[2 * np + 1], qa, b[2], b[3]);
        }
    }
    s
}

/// O += P·V for one m16 tile, with P taken straight from the S registers.
///
/// # Safety
/// `vt` must hold the loaded V tile; all 32 lanes call this.
#[inline(always)]
pub unsafe fn pv_tile<const NT: usize, const DTILES: usize, const BN: usize, const D: usize>(
    s: &[FragC; NT],
    vt: SmemTile<BN, D>,
    o: &mut [FragC; DTILES],
    lane: usize,
) {
    for kk in 0..NT / 2 {
        let p = p_frag(&s[2 * kk], &s[2 * kk + 1]);
        for dp in 0..DTILES / 2 {
            let b = v_frags(vt, kk, dp, lane);
            mma_bf16_16816(&mut o[2 * dp], &p, b[0], b[1]);
            mma_bf16_16816(&mut o[2 * dp + 1], &p, b[2], b[3]);
        }
    }
}
