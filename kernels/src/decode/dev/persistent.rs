//! The whole decode step of one sequence in one launch, every layer in order: a
//! persistent kernel (one block per SM), measured against the shipped CUDA graph
//! of separate launches.
//!
//! A producer warp streams the block's share of every weight matrix, in the order
//! the stages use them, through a ring of shared-memory slots by bulk copy.
//! Weights do not depend on activations, so the copies run on through the grid
//! barriers between stages and through attention. Eight consumer warps run each
//! layer's stages, with a grid barrier after each:
//! 1. RMSNorm of x (every block, redundantly), then the block's QKV rows;
//! 2. attention split by (KV head, key chunk), RoPE applied to q and to the new
//!    k, the new k and v written by the chunk that holds their position; each KV
//!    head's last block merges its splits;
//! 3. the block's O rows plus the residual: h;
//! 4. RMSNorm of h, then the block's gate/up row pairs: SiLU(g)·u;
//! 5. the block's down rows plus the residual: the next layer's x.
//!
//! Numerics follow the graph's kernels: one bf16 rounding per stored vector.

use crate::gemm::silu;
use crate::gpu::bf16::{bf16_to_f32, f32_to_bf16, pack_bf16x2, unpack_bf16x2};
use crate::gpu::math::{ex2, fma, fmax_nan, rcp_exact, rsqrt};
use crate::gpu::mem::{
    atom_add_acq_rel_u32, ld_acquire_u32, ld_global_cg_f32, ld_global_cg_u16, ld_global_cg_v4, ld_global_nc_v4,
    cp_async_16, cp_async_commit, cp_async_wait,
};
use crate::gpu::shared::{dynamic_shared_base, ld_shared_v2, ld_shared_v4, red_shared_add_f32, st_shared_v4, SharedWord};
use crate::gpu::thread::{
    block_idx_x, global_timer_ns, grid_dim_x, named_sync, nanosleep, sync_threads, thread_idx_x,
};
use crate::gpu::tma::{evict_first_policy, fence_barrier_init, load_bulk, Barrier};
use crate::gpu::warp::{shuffle_f32, shuffle_u32, sync_warp, warp_reduce_max, warp_reduce_sum};
use abi::persistent::{self as p, Layer};
use abi::PersistentDecodeArgs as Args;

const HD: usize = p::HEAD_DIM;
const G: usize = p::MAX_GROUP;
const WARPS: usize = p::CONSUMER_WARPS;
const CT: usize = p::CONSUMER_THREADS;
/// Most segments of one slot a warp takes.
const SEGS_PER_WARP: usize = (p::SLOT_BYTES / p::SEGMENT_BYTES).div_ceil(WARPS);
/// Keys one warp takes at a time: one per lane.
const KEYS: usize = 32;
const NEG_INF: f32 = f32::NEG_INFINITY;

#[inline(always)]
fn smem(offset: usize) -> u32 {
    dynamic_shared_base() + offset as u32
}

#[inline(always)]
fn full(s: usize) -> Barrier {
    Barrier(smem(p::BARRIERS + 8 * s))
}

#[inline(always)]
fn empty(s: usize) -> Barrier {
    Barrier(smem(p::BARRIERS + 8 * (p::STAGES + s)))
}

/// The consumer warps' barrier (the producer never joins it).
#[inline(always)]
fn consumers_sync() {
    named_sync(1, CT as u32);
}

#[inline(always)]
fn ld_f32(offset: usize) -> f32 {
    unsafe { f32::ld_shared(smem(offset)) }
}

#[inline(always)]
fn st_f32(offset: usize, v: f32) {
    unsafe { f32::st_shared(smem(offset), v) }
}

/// One weight matrix of a layer, `[rows, k]` bf16, K-contiguous.
#[derive(Clone, Copy)]
struct Matrix {
    w: u64,
    rows: usize,
    k: usize,
    /// Rows that stay together in one block (gate/up pairs).
    pair: usize,
}

impl Matrix {
    /// This block's rows: whole pairs, as even a share as they allow.
    #[inline(always)]
    fn share(self) -> (usize, usize) {
        let units = self.rows / self.pair;
        let (b, n) = (block_idx_x() as usize, grid_dim_x() as usize);
        (units * b / n * self.pair, units * (b + 1) / n * self.pair)
    }

    #[inline(always)]
    fn bytes(self) -> usize {
        let (r0, r1) = self.share();
        (r1 - r0) * self.k * 2
    }
}

/// The layer's matrices in the order its stages use them: QKV, O, gate/up, down.
#[inline(always)]
unsafe fn layer(a: Args, l: usize) -> (Layer, [Matrix; 4]) {
    let lw = *(a.layers as *const Layer).add(l);
    let (d, h, kv, ff) = (a.d as usize, a.n_heads as usize, a.n_kv_heads as usize, a.ff as usize);
    let m = [
        Matrix { w: lw.w_qkv, rows: (h + 2 * kv) * HD, k: d, pair: 1 },
        Matrix { w: lw.w_o, rows: d, k: h * HD, pair: 1 },
        Matrix { w: lw.w_gate_up, rows: 2 * ff, k: d, pair: 2 },
        Matrix { w: lw.w_down, rows: d, k: ff, pair: 1 },
    ];
    (lw, m)
}

/// The producer: every slot of every matrix of every layer, each as soon as the
/// consumers have released its ring slot.
#[inline(always)]
unsafe fn produce(a: Args) {
    let policy = evict_first_policy();
    let mut slot = 0usize;
    let mut stream = |m: Matrix| {
        let src = (m.w as *const u8).add(m.share().0 * m.k * 2);
        let bytes = m.bytes();
        let mut off = 0;
        while off < bytes {
            let n = (bytes - off).min(p::SLOT_BYTES);
            let s = slot % p::STAGES;
            empty(s).wait(((slot / p::STAGES) & 1) as u32 ^ 1);
            full(s).arrive_expect_tx(n as u32);
            load_bulk(smem(p::RING + s * p::SLOT_BYTES), src.add(off), n as u32, full(s), policy);
            off += n;
            slot += 1;
        }
    };
    for l in 0..a.n_layers as usize {
        let (_, [qkv, wo, gate_up, down]) = layer(a, l);
        stream(qkv);
        stream(wo);
        stream(gate_up);
        stream(down);
    }
}

/// Σ w·x over 8 bf16 pairs, added to `acc`.
#[inline(always)]
fn dot8(w: [u32; 4], x: [u32; 4], acc: f32) -> f32 {
    let mut s = acc;
    for i in 0..4 {
        let (w0, w1) = unpack_bf16x2(w[i]);
        let (x0, x1) = unpack_bf16x2(x[i]);
        s = fma(w0, x0, fma(w1, x1, s));
    }
    s
}

/// Adds the warp's partial sum of `row` (of the block's share) to its row sum.
#[inline(always)]
unsafe fn add_row(row: usize, acc: f32) {
    let v = warp_reduce_sum(acc);
    if thread_idx_x() % 32 == 0 {
        red_shared_add_f32(smem(p::ROW_SUMS + 4 * row), v);
    }
}

/// A row's sum, taken and zeroed for the next matrix.
#[inline(always)]
fn take_row(row: usize) -> f32 {
    let v = ld_f32(p::ROW_SUMS + 4 * row);
    st_f32(p::ROW_SUMS + 4 * row, 0.0);
    v
}

/// Consumers: the block's rows of W·x, x being `m.k` bf16 at `X`, summed in
/// `ROW_SUMS` slot by slot as the ring fills. Each warp takes a contiguous run
/// of 512-byte segments of each slot; a segment never straddles two rows.
#[inline(always)]
unsafe fn gemv(a: Args, m: Matrix, slot: &mut usize) {
    let (warp, lane) = (thread_idx_x() as usize / 32, thread_idx_x() as usize % 32);
    let (bytes, row_bytes) = (m.bytes(), (m.k * 2) as u32);
    let mut off = 0;
    while off < bytes {
        let n = (bytes - off).min(p::SLOT_BYTES);
        let s = *slot % p::STAGES;
        full(s).wait(((*slot / p::STAGES) & 1) as u32);
        let segs = if a.flags & p::SKIP_MATH != 0 { 0 } else { n / p::SEGMENT_BYTES };
        let (g0, g1) = (segs * warp / WARPS, segs * (warp + 1) / WARPS);
        if g0 < g1 {
            let first = (off + g0 * p::SEGMENT_BYTES) as u32;
            let (mut row, mut col) = ((first / row_bytes) as usize, first % row_bytes);
            let w_at = smem(p::RING + s * p::SLOT_BYTES + 16 * lane);
            // Every segment's loads first, then their dot products side by side,
            // then the sums in order, a row's flushed where it ends.
            let (mut w, mut x) = ([[0u32; 4]; SEGS_PER_WARP], [[0u32; 4]; SEGS_PER_WARP]);
            let mut ends = 0u32;
            for j in 0..SEGS_PER_WARP {
                if g0 + j < g1 {
                    w[j] = ld_shared_v4(w_at + ((g0 + j) * p::SEGMENT_BYTES) as u32);
                    x[j] = ld_shared_v4(smem(p::X + 16 * lane) + col);
                    col += p::SEGMENT_BYTES as u32;
                    if col == row_bytes {
                        ends |= 1 << j;
                        col = 0;
                    }
                }
            }
            let part: [f32; SEGS_PER_WARP] = core::array::from_fn(|j| dot8(w[j], x[j], 0.0));
            let mut acc = 0.0f32;
            for (j, &pj) in part.iter().enumerate() {
                if g0 + j < g1 {
                    acc += pj;
                    if ends & (1 << j) != 0 {
                        add_row(row, acc);
                        acc = 0.0;
                        row += 1;
                    }
                }
            }
            if col != 0 {
                add_row(row, acc);
            }
        }
        // Every consumer thread releases the slot after its own reads.
        empty(s).arrive();
        off += n;
        *slot += 1;
    }
    consumers_sync();
}

/// Sum over the consumers; every one gets it.
#[inline(always)]
fn block_sum(v: f32) -> f32 {
    let v = warp_reduce_sum(v);
    let warp = thread_idx_x() as usize / 32;
    if thread_idx_x() % 32 == 0 {
        st_f32(p::REDUCE + 4 * warp, v);
    }
    consumers_sync();
    let mut s = 0.0;
    for w in 0..WARPS {
        s += ld_f32(p::REDUCE + 4 * w);
    }
    consumers_sync();
    s
}

/// X ← `n` bf16 from `src` (written in this launch).
#[inline(always)]
unsafe fn copy_into_x(src: u64, n: usize) {
    let mut c = thread_idx_x() as usize;
    while c < n / 8 {
        st_shared_v4(smem(p::X + 16 * c), ld_global_cg_v4((src as *const u8).add(16 * c)));
        c += CT;
    }
    consumers_sync();
}

/// X ← RMSNorm(`src`) · `weight`, `n` bf16, in f32 with one rounding.
#[inline(always)]
unsafe fn norm_into_x(src: u64, weight: u64, n: usize, eps: f32) {
    let tid = thread_idx_x() as usize;
    let mut ss = 0.0f32;
    let mut c = tid;
    while c < n / 8 {
        let v = ld_global_cg_v4((src as *const u8).add(16 * c));
        st_shared_v4(smem(p::X + 16 * c), v);
        for w in v {
            let (x0, x1) = unpack_bf16x2(w);
            ss = fma(x0, x0, fma(x1, x1, ss));
        }
        c += CT;
    }
    let inv = rsqrt(block_sum(ss) / n as f32 + eps);
    // Each thread rescales the chunks it wrote.
    c = tid;
    while c < n / 8 {
        let v = ld_shared_v4(smem(p::X + 16 * c));
        let wv = ld_global_nc_v4((weight as *const u8).add(16 * c));
        let mut y = [0u32; 4];
        for i in 0..4 {
            let ((x0, x1), (w0, w1)) = (unpack_bf16x2(v[i]), unpack_bf16x2(wv[i]));
            y[i] = pack_bf16x2(x0 * inv * w0, x1 * inv * w1);
        }
        st_shared_v4(smem(p::X + 16 * c), y);
        c += CT;
    }
    consumers_sync();
}

/// Every consumer of every block arrives; none leaves until all have.
#[inline(always)]
unsafe fn grid_sync(a: Args, epoch: &mut u32) {
    *epoch += 1;
    consumers_sync();
    if thread_idx_x() == 0 {
        let c = a.counters as *mut u32;
        atom_add_acq_rel_u32(c, 1);
        let target = *epoch * grid_dim_x();
        // Polling with a pause between reads.
        while ld_acquire_u32(c) < target {
            nanosleep(p::POLL_NS);
        }
        if block_idx_x() == 0 {
            *(a.trace as *mut u64).add(*epoch as usize) = global_timer_ns();
        }
    }
    consumers_sync();
}

/// Attention's inner times for the breakdown (thread 0; see `Args::trace`).
#[inline(always)]
unsafe fn stamp(a: Args, l: usize, i: usize) {
    if thread_idx_x() == 0 {
        let at = 1 + p::STAGES_PER_LAYER * a.n_layers as usize + p::ATTENTION_STAMPS * l + i;
        *(a.trace as *mut u64).add(at) = global_timer_ns();
    }
}

/// The pair (i, i + hd/2) of the head at element `head` of qkv, rotated to
/// position `pos` (rotate-half convention), each result rounded to bf16.
#[inline(always)]
unsafe fn rope(a: Args, head: usize, i: usize) -> (u16, u16) {
    let qkv = (a.qkv as *const u16).add(head + i);
    let (x0, x1) = (ld_global_cg_u16(qkv), ld_global_cg_u16(qkv.add(HD / 2)));
    let at = a.pos as usize * (HD / 2) + i;
    let (c, s) = (*(a.cos as *const f32).add(at), *(a.sin as *const f32).add(at));
    let (x0, x1) = (bf16_to_f32(x0), bf16_to_f32(x1));
    (f32_to_bf16(x0 * c - x1 * s), f32_to_bf16(x0 * s + x1 * c))
}

/// Cache row (page slot) of key `key`.
#[inline(always)]
unsafe fn cache_row(a: Args, key: usize) -> usize {
    let ps = a.page_size as usize;
    *(a.page_table as *const u32).add(key / ps) as usize * ps + key % ps
}

/// Stage 2: the block's (KV head, split) units of decode attention, for up to
/// `GR` query heads per KV head (registers are held for `GR`).
#[inline(always)]
unsafe fn attention<const GR: usize>(a: Args, l: usize, lw: &Layer) {
    let tid = thread_idx_x() as usize;
    let (warp, lane) = (tid / 32, tid % 32);
    let (h, kv) = (a.n_heads as usize, a.n_kv_heads as usize);
    let group = h / kv;
    let (pos, splits, chunk) = (a.pos as usize, a.splits as usize, a.chunk as usize);
    let ctx = pos + 1;
    let half = HD / 2;
    let qkv = a.qkv as *const u16;
    let mut u = block_idx_x() as usize;
    while u < kv * splits {
        let (kh, sp) = (u / splits, u % splits);
        let (c0, c1) = (sp * chunk, ((sp + 1) * chunk).min(ctx));
        // q of the group's heads, rotated and pre-scaled; the sums zeroed.
        let mut t = tid;
        while t < group * half {
            let (g, i) = (t / half, t % half);
            let (y0, y1) = rope(a, (kh * group + g) * HD, i);
            st_f32(p::Q + 4 * (g * HD + i), bf16_to_f32(y0) * a.scale_log2);
            st_f32(p::Q + 4 * (g * HD + i + half), bf16_to_f32(y1) * a.scale_log2);
            t += CT;
        }
        t = tid;
        while t < G * HD + G {
            st_f32(p::O_SUM + 4 * t, 0.0);
            t += CT;
        }
        // The new token's k (rotated) and v go into the cache first.
        if c1 == ctx {
            let row = cache_row(a, pos);
            let (kb, vb) = ((lw.k_pool as *mut u16).add((row * kv + kh) * HD), (lw.v_pool as *mut u16).add((row * kv + kh) * HD));
            if tid < half {
                let (y0, y1) = rope(a, (h + kh) * HD, tid);
                *kb.add(tid) = y0;
                *kb.add(tid + half) = y1;
            } else if tid < half + HD {
                let e = tid - half;
                *vb.add(e) = ld_global_cg_u16(qkv.add((h + kv + kh) * HD + e));
            }
        }
        consumers_sync();
        if block_idx_x() == 0 {
            stamp(a, l, 0);
        }

        let mut m = [NEG_INF; GR];
        let mut lsum = [0.0f32; GR];
        let mut o = [[0.0f32; 4]; GR];
        let key_groups = (c1 - c0).div_ceil(KEYS);
        let mut kg = warp;
        while kg < key_groups {
            let k0 = c0 + kg * KEYS;
            let valid = k0 + lane < c1;
            let row = if valid { cache_row(a, k0 + lane) } else { 0 };
            let at = ((row * kv + kh) * HD * 2) as u32;
            // Keys and values go through the warp's shared tile by cp.async: all
            // of a pass's copies are in flight at once and hold no registers.
            let tile = smem(p::KV_TILE + warp * p::KV_TILE_BYTES);
            // Chunk c of the lane's half row, XOR-swizzled: conflict-free reads.
            let k_at = |c: usize| tile + (lane * 128 + ((c ^ (lane & 7)) * 16)) as u32;
            let mut s = [0.0f32; GR];
            for half in 0..2 {
                if valid {
                    for c in 0..8 {
                        cp_async_16(k_at(c), (lw.k_pool as *const u8).add(at as usize + 128 * half + 16 * c));
                    }
                }
                cp_async_commit();
                cp_async_wait::<0>();
                sync_warp();
                for c in 0..8 {
                    let k = ld_shared_v4(k_at(c));
                    let d0 = 64 * half + 8 * c;
                    for (g, sg) in s.iter_mut().enumerate() {
                        if g < group {
                            let q0 = ld_shared_v4(smem(p::Q + 4 * (g * HD + d0)));
                            let q1 = ld_shared_v4(smem(p::Q + 4 * (g * HD + d0 + 4)));
                            for i in 0..4 {
                                let (ka, kb) = unpack_bf16x2(k[i]);
                                let (qa, qb) =
                                    if i < 2 { (q0[2 * i], q0[2 * i + 1]) } else { (q1[2 * i - 4], q1[2 * i - 3]) };
                                *sg = fma(f32::from_bits(qa), ka, fma(f32::from_bits(qb), kb, *sg));
                            }
                        }
                    }
                }
                sync_warp();
            }
            let first = block_idx_x() == 0 && kg == warp && warp == 0;
            if first {
                stamp(a, l, 4);
            }
            for g in 0..GR {
                if g < group {
                    let sg = if valid { s[g] } else { NEG_INF };
                    let m_new = fmax_nan(m[g], warp_reduce_max(sg));
                    let alpha = ex2(m[g] - m_new);
                    let pg = ex2(sg - m_new);
                    lsum[g] = lsum[g] * alpha + pg;
                    for e in o[g].iter_mut() {
                        *e *= alpha;
                    }
                    m[g] = m_new;
                    s[g] = pg;
                }
            }
            if first {
                stamp(a, l, 5);
            }
            // V, 16 rows a pass: each lane copies 16 bytes of 8 of them (by
            // the other lanes' row offsets), then takes its four dims of each.
            for vh in 0..2 {
                for i in 0..8 {
                    let r = lane / 16 + 2 * i;
                    let j = 16 * vh + r;
                    let rj = shuffle_u32(at, j as u32);
                    if k0 + j < c1 {
                        let ch = 16 * (lane % 16);
                        cp_async_16(tile + (r * 256 + ch) as u32, (lw.v_pool as *const u8).add(rj as usize + ch));
                    }
                }
                cp_async_commit();
                cp_async_wait::<0>();
                sync_warp();
                for r in 0..16 {
                    let j = 16 * vh + r;
                    // Past c1 the tile holds stale rows (p is 0, but 0·NaN is not).
                    if k0 + j < c1 {
                        let v = ld_shared_v2(tile + (r * 256 + 8 * lane) as u32);
                        let (v0, v1) = unpack_bf16x2(v[0]);
                        let (v2, v3) = unpack_bf16x2(v[1]);
                        for g in 0..GR {
                            if g < group {
                                let pj = shuffle_f32(s[g], j as u32);
                                o[g][0] = fma(pj, v0, o[g][0]);
                                o[g][1] = fma(pj, v1, o[g][1]);
                                o[g][2] = fma(pj, v2, o[g][2]);
                                o[g][3] = fma(pj, v3, o[g][3]);
                            }
                        }
                    }
                }
                sync_warp();
            }
            if first {
                stamp(a, l, 6);
            }
            kg += WARPS;
        }

        if block_idx_x() == 0 {
            stamp(a, l, 1);
        }
        // The warps' partials, rescaled to the block's maximum and summed.
        if lane == 0 {
            for (g, &mg) in m.iter().enumerate() {
                st_f32(p::REDUCE + 4 * (warp * G + g), mg);
            }
        }
        consumers_sync();
        let block_max = |g: usize| {
            let mut mb = NEG_INF;
            for w in 0..WARPS {
                mb = fmax_nan(mb, ld_f32(p::REDUCE + 4 * (w * G + g)));
            }
            mb
        };
        for g in 0..GR {
            if g < group {
                let sc = ex2(m[g] - block_max(g));
                let l = warp_reduce_sum(lsum[g]) * sc;
                if lane == 0 {
                    red_shared_add_f32(smem(p::L_SUM + 4 * g), l);
                }
                for (e, &v) in o[g].iter().enumerate() {
                    red_shared_add_f32(smem(p::O_SUM + 4 * (g * HD + 4 * lane + e)), v * sc);
                }
            }
        }
        consumers_sync();
        let partial = |s: usize, g: usize| (a.partial as *mut f32).add(((kh * splits + s) * group + g) * p::PARTIAL);
        t = tid;
        while t < group * p::PARTIAL {
            let (g, e) = (t / p::PARTIAL, t % p::PARTIAL);
            let v = match e {
                _ if e < HD => ld_f32(p::O_SUM + 4 * (g * HD + e)),
                _ if e == HD => block_max(g),
                _ => ld_f32(p::L_SUM + 4 * g),
            };
            *partial(sp, g).add(e) = v;
            t += CT;
        }
        // The KV head's last split to finish merges them all.
        consumers_sync();
        if tid == 0 {
            let done = atom_add_acq_rel_u32((a.counters as *mut u32).add(1 + l * kv + kh), 1);
            st_f32(p::REDUCE + 4 * G * WARPS, if done + 1 == splits as u32 { 1.0 } else { 0.0 });
        }
        consumers_sync();
        if block_idx_x() == 0 {
            stamp(a, l, 2);
        }
        if ld_f32(p::REDUCE + 4 * G * WARPS) != 0.0 {
            // Each split's (m, ℓ) into shared memory (O_SUM is free again).
            t = tid;
            while t < splits * group {
                let (s, g) = (t / group, t % group);
                st_f32(p::O_SUM + 4 * t, ld_global_cg_f32(partial(s, g).add(HD)));
                st_f32(p::O_SUM + 4 * (p::MERGE_SPLITS + t), ld_global_cg_f32(partial(s, g).add(HD + 1)));
                t += CT;
            }
            consumers_sync();
            t = tid;
            while t < group * HD {
                let (g, e) = (t / HD, t % HD);
                let mut mm = NEG_INF;
                for s in 0..splits {
                    mm = fmax_nan(mm, ld_f32(p::O_SUM + 4 * (s * group + g)));
                }
                let (mut num, mut den) = (0.0f32, 0.0f32);
                // Eight splits' loads in flight at a time, not one.
                let mut s0 = 0;
                while s0 < splits {
                    let o: [f32; 8] = core::array::from_fn(|j| {
                        if s0 + j < splits {
                            ld_global_cg_f32(partial(s0 + j, g).add(e))
                        } else {
                            0.0
                        }
                    });
                    for (j, &oj) in o.iter().enumerate() {
                        if s0 + j < splits {
                            let s = s0 + j;
                            let w = ex2(ld_f32(p::O_SUM + 4 * (s * group + g)) - mm);
                            den = fma(w, ld_f32(p::O_SUM + 4 * (p::MERGE_SPLITS + s * group + g)), den);
                            num = fma(w, oj, num);
                        }
                    }
                    s0 += 8;
                }
                *(a.o as *mut u16).add((kh * group + g) * HD + e) = f32_to_bf16(num * rcp_exact(den));
                t += CT;
            }
            if kh == 0 {
                stamp(a, l, 3);
            }
        }
        consumers_sync();
        u += grid_dim_x() as usize;
    }
}

/// The consumers' part: every stage of every layer.
#[inline(always)]
unsafe fn consume(a: Args) {
    let tid = thread_idx_x() as usize;
    let (d, ff) = (a.d as usize, a.ff as usize);
    let (mut slot, mut epoch) = (0usize, 0u32);
    let bf16_at = |v: u64, i: usize| ld_global_cg_u16((v as *const u16).add(i));
    let put = |v: u64, i: usize, x: f32| *(v as *mut u16).add(i) = f32_to_bf16(x);
    // out = residual + the block's rows of the matrix just summed.
    let plus_residual = |m: Matrix, residual: u64, out: u64| {
        let (r0, r1) = m.share();
        let mut r = tid;
        while r < r1 - r0 {
            put(out, r0 + r, bf16_to_f32(bf16_at(residual, r0 + r)) + take_row(r));
            r += CT;
        }
    };
    for l in 0..a.n_layers as usize {
        let (lw, [qkv, wo, gate_up, down]) = layer(a, l);

        norm_into_x(a.x, lw.attn_norm, d, a.eps);
        gemv(a, qkv, &mut slot);
        let (r0, r1) = qkv.share();
        let mut r = tid;
        while r < r1 - r0 {
            let b = if lw.qkv_bias != 0 { bf16_to_f32(*(lw.qkv_bias as *const u16).add(r0 + r)) } else { 0.0 };
            put(a.qkv, r0 + r, take_row(r) + b);
            r += CT;
        }
        grid_sync(a, &mut epoch);

        if a.flags & p::SKIP_ATTENTION != 0 {
        } else if a.n_heads / a.n_kv_heads <= 4 {
            attention::<4>(a, l, &lw);
        } else {
            attention::<G>(a, l, &lw);
        }
        grid_sync(a, &mut epoch);

        copy_into_x(a.o, wo.k);
        gemv(a, wo, &mut slot);
        plus_residual(wo, a.x, a.h);
        grid_sync(a, &mut epoch);

        norm_into_x(a.h, lw.mlp_norm, d, a.eps);
        gemv(a, gate_up, &mut slot);
        let (r0, r1) = gate_up.share();
        r = tid;
        while r < (r1 - r0) / 2 {
            let (g, up) = (take_row(2 * r), take_row(2 * r + 1));
            put(a.act, r0 / 2 + r, silu(g) * up);
            r += CT;
        }
        grid_sync(a, &mut epoch);

        copy_into_x(a.act, ff);
        gemv(a, down, &mut slot);
        plus_residual(down, a.h, a.x);
        grid_sync(a, &mut epoch);
    }
}

/// One block per SM, all resident at once (the grid barriers need every block).
#[no_mangle]
pub unsafe extern "ptx-kernel" fn persistent_decode_b1(a: Args) {
    let tid = thread_idx_x() as usize;
    if tid == 0 {
        if block_idx_x() == 0 {
            *(a.trace as *mut u64) = global_timer_ns();
        }
        for s in 0..p::STAGES {
            full(s).init(1);
            empty(s).init(CT as u32);
        }
        fence_barrier_init();
    }
    let mut r = tid;
    while r < p::MAX_ROWS {
        st_f32(p::ROW_SUMS + 4 * r, 0.0);
        r += p::THREADS;
    }
    sync_threads();
    if tid >= CT {
        if tid == CT {
            produce(a);
        }
        return;
    }
    consume(a);
}
const _: () = assert!(p::THREADS == 256 && HD % 64 == 0);
crate::launch_bounds!(persistent_decode_b1: PersistentDecodeArgs, 256, 1);
