//! Next-token sampling: one block per row of `[batch, vocab]` logits, each row
//! with its own temperature, top-k, top-p and (seed, step); one token id out per
//! row, and optionally its log-probability.
//!
//! Every decision is made on block-wide reductions in a fixed order, so a row
//! gives the same token on every run:
//! 1. Max: the largest logit and its lowest index ([`key`] orders logits and
//!    puts NaN below -inf). Temperature 0 stops here (greedy).
//! 2. Top-k: the k-th largest key, found bit by bit from the top: a bit stays
//!    set if at least k logits have keys at or above the candidate (one count
//!    reduction per key bit: 16 for bf16, 32 for f32). Ties at the k-th value
//!    are all kept. Counting keys instead of probabilities makes the set exact.
//! 3. Top-p: the same bit-by-bit search on Σ exp((x − max)/T) over the keys at
//!    or above the candidate, against p × the top-k set's mass: the largest
//!    threshold whose mass still reaches it, i.e. the smallest set of most
//!    probable tokens (ties at its edge kept) whose share is at least p.
//! 4. Draw: u from Philox-4x32-10 at (seed, step) ([`uniform`]), and the first
//!    kept token, in vocabulary order, whose running mass exceeds u × the kept
//!    mass: a block-wide prefix sum over tiles of `SCAN_CHUNK` contiguous logits
//!    per thread. A token of zero weight is never drawn; where rounding leaves
//!    the running sum short of the target, the last kept token of non-zero
//!    weight is drawn.
//!
//! The row stays in L2 between passes (a 256k-entry bf16 row is 512 KB).
//! A row whose logits are all NaN or -inf has no distribution: it gets token 0
//! and log-probability NaN. The log-probability is that of the model's own
//! distribution (temperature 1, no top-k or top-p).

use crate::gpu::math::{lg2, LOG2_E};
use crate::gpu::mem::{ld_global_v4, Vec4};
use crate::gpu::shared::SharedArray;
use crate::gpu::thread::{block_dim_x, block_idx_x, grid_dim_x, lane_id, sync_threads, thread_idx_x, warp_id};
use crate::gpu::warp::{shuffle_u32, shuffle_xor_f32};
use abi::sampling::{key, uniform, value, RowParams, NEG_INF_KEY};
pub use abi::SampleArgs;

/// Contiguous logits one thread takes per tile of the draw's prefix sum: a
/// longer chunk means fewer block scans per row.
const SCAN_CHUNK: u32 = 8;

/// How a logit element is read, and the lowest key bit its values can set.
trait Logit {
    const BYTES: usize;
    const KEY_LOW_BIT: u32;
    /// Logits per 16-byte word.
    const PER_VEC: u32 = 16 / Self::BYTES as u32;
    unsafe fn load(row: *const u8, i: u32) -> f32;
    /// Logit `j` (< [`Logit::PER_VEC`]) of a 16-byte word.
    fn unpack(v: Vec4, j: u32) -> f32;
}

struct Bf16;
struct F32;

impl Logit for Bf16 {
    const BYTES: usize = 2;
    const KEY_LOW_BIT: u32 = 16;
    #[inline(always)]
    unsafe fn load(row: *const u8, i: u32) -> f32 {
        f32::from_bits((*(row as *const u16).add(i as usize) as u32) << 16)
    }
    #[inline(always)]
    fn unpack(v: Vec4, j: u32) -> f32 {
        let w = v[(j / 2) as usize];
        f32::from_bits(if j % 2 == 0 { w << 16 } else { w & 0xffff_0000 })
    }
}

impl Logit for F32 {
    const BYTES: usize = 4;
    const KEY_LOW_BIT: u32 = 0;
    #[inline(always)]
    unsafe fn load(row: *const u8, i: u32) -> f32 {
        *(row as *const f32).add(i as usize)
    }
    #[inline(always)]
    fn unpack(v: Vec4, j: u32) -> f32 {
        f32::from_bits(v[j as usize])
    }
}

/// Calls `f(i, logit i)` for this thread's share of a row of `n`, in increasing
/// index order: 16-byte words strided over the block where the row is 16-byte
/// aligned (a lone block reading 2-byte elements waits on a round trip per
/// 1 KB), then the ragged end one element at a time.
#[inline(always)]
unsafe fn for_each_logit<L: Logit>(x: *const u8, n: u32, mut f: impl FnMut(u32, f32)) {
    let (t, nt) = (thread_idx_x(), block_dim_x());
    let words = if (x as usize) % 16 == 0 { n / L::PER_VEC } else { 0 };
    // Four words in flight per thread, then visited in index order.
    let mut w = t;
    while w + 3 * nt < words {
        let v: [Vec4; 4] = core::array::from_fn(|u| ld_global_v4(x.add((w + u as u32 * nt) as usize * 16)));
        for (u, vu) in v.iter().enumerate() {
            for j in 0..L::PER_VEC {
                f((w + u as u32 * nt) * L::PER_VEC + j, L::unpack(*vu, j));
            }
        }
        w += 4 * nt;
    }
    while w < words {
        let v = ld_global_v4(x.add(w as usize * 16));
        for j in 0..L::PER_VEC {
            f(w * L::PER_VEC + j, L::unpack(v, j));
        }
        w += nt;
    }
    let mut i = words * L::PER_VEC + t;
    while i < n {
        f(i, L::load(x, i));
        i += nt;
    }
}

#[inline(always)]
fn shuffle_xor_bits(v: u32, mask: u32) -> u32 {
    shuffle_xor_f32(f32::from_bits(v), mask).to_bits()
}

#[inline(always)]
fn f32_add_bits(a: u32, b: u32) -> u32 {
    (f32::from_bits(a) + f32::from_bits(b)).to_bits()
}

/// Block-wide reductions and scans over 32-bit words. Each takes one barrier;
/// consecutive ones alternate between two scratch arrays, so a fast warp
/// writing the next one's slots cannot overwrite slots still being read.
struct Reducer {
    a: SharedArray<u32, 32>,
    b: SharedArray<u32, 32>,
    turn: bool,
    num_warps: u32,
}

impl Reducer {
    #[inline(always)]
    fn new() -> Reducer {
        Reducer {
            a: crate::shared_array!(sampling_scratch_a: [u32; 32]),
            b: crate::shared_array!(sampling_scratch_b: [u32; 32]),
            turn: false,
            num_warps: block_dim_x().div_ceil(32),
        }
    }

    #[inline(always)]
    fn next(&mut self) -> SharedArray<u32, 32> {
        self.turn = !self.turn;
        if self.turn {
            self.a
        } else {
            self.b
        }
    }

    /// Every thread gets op over the block. Butterfly order: every lane (and
    /// every warp, over the same slots) combines the same values in the same
    /// order, so a commutative op gives one bit pattern everywhere.
    #[inline(always)]
    fn reduce(&mut self, v: u32, identity: u32, op: impl Fn(u32, u32) -> u32 + Copy) -> u32 {
        let s = self.next();
        let warp = |mut v: u32| {
            let mut mask = 16;
            while mask > 0 {
                v = op(v, shuffle_xor_bits(v, mask));
                mask /= 2;
            }
            v
        };
        let v = warp(v);
        if lane_id() == 0 {
            s.store(warp_id() as usize, v);
        }
        sync_threads();
        let lane = lane_id();
        warp(if lane < self.num_warps { s.load(lane as usize) } else { identity })
    }

    #[inline(always)]
    fn max_u32(&mut self, v: u32) -> u32 {
        self.reduce(v, 0, |a, b| if a > b { a } else { b })
    }

    #[inline(always)]
    fn min_u32(&mut self, v: u32) -> u32 {
        self.reduce(v, u32::MAX, |a, b| if a < b { a } else { b })
    }

    #[inline(always)]
    fn sum_u32(&mut self, v: u32) -> u32 {
        self.reduce(v, 0, |a, b| a.wrapping_add(b))
    }

    #[inline(always)]
    fn sum_f32(&mut self, v: f32) -> f32 {
        f32::from_bits(self.reduce(v.to_bits(), 0, f32_add_bits))
    }

    /// (Σ of v over threads before this one in thread order, Σ over the block).
    /// A thread's prefix is never below the one of a thread before it.
    #[inline(always)]
    fn scan_f32(&mut self, v: f32) -> (f32, f32) {
        let s = self.next();
        let lane = lane_id();
        let mut incl = v;
        let mut d = 1;
        while d < 32 {
            let up = f32::from_bits(shuffle_u32(incl.to_bits(), lane.saturating_sub(d)));
            if lane >= d {
                incl += up;
            }
            d *= 2;
        }
        let before = f32::from_bits(shuffle_u32(incl.to_bits(), lane.saturating_sub(1)));
        let excl_in_warp = if lane == 0 { 0.0 } else { before };
        if lane == 31 {
            s.store(warp_id() as usize, incl.to_bits());
        }
        sync_threads();
        let (mut offset, mut total) = (0.0f32, 0.0f32);
        let me = warp_id();
        for w in 0..self.num_warps {
            if w == me {
                offset = total;
            }
            total += f32::from_bits(s.load(w as usize));
        }
        (offset + excl_in_warp, total)
    }
}

/// One row's probability weights: exp((x − m)/T) as 2^((x − m)·c), c = log2(e)/T.
#[derive(Clone, Copy)]
struct Weights {
    /// The row's largest logit (finite or +inf).
    m: f32,
    c: f32,
}

impl Weights {
    /// The weight of logit `x` (whose key is above NaN's): a logit equal to the
    /// max weighs 1, which also gives +inf logits their limit when m is +inf.
    #[inline(always)]
    fn of(self, x: f32) -> f32 {
        if x == self.m {
            1.0
        } else {
            crate::gpu::math::ex2((x - self.m) * self.c)
        }
    }
}

/// This thread's share of the row's mass over keys at or above `tau` (≥ 1, so
/// NaN is never counted), in a fixed order.
#[inline(always)]
unsafe fn thread_mass<L: Logit>(x: *const u8, n: u32, tau: u32, w: Weights) -> f32 {
    let mut s = 0.0;
    for_each_logit::<L>(x, n, |_, v| {
        if key(v) >= tau {
            s += w.of(v);
        }
    });
    s
}

/// This thread's count of logits with keys at or above `tau`.
#[inline(always)]
unsafe fn thread_count<L: Logit>(x: *const u8, n: u32, tau: u32) -> u32 {
    let mut c = 0;
    for_each_logit::<L>(x, n, |_, v| c += (key(v) >= tau) as u32);
    c
}

/// The largest key (a multiple of 2^KEY_LOW_BIT) that `holds`, built one bit at
/// a time from the top; `holds` must be monotone (true below some key, false
/// above). Calls `holds` once per key bit, from every thread.
#[inline(always)]
fn search_key<L: Logit>(mut holds: impl FnMut(u32) -> bool) -> u32 {
    let mut tau = 0u32;
    // Each step is a pass over the row; unrolled, the 16 or 32 copies of it
    // would only cost registers.
    let mut bit = crate::gpu::opaque_u32(31);
    loop {
        let cand = tau | (1 << bit);
        if holds(cand) {
            tau = cand;
        }
        if bit == L::KEY_LOW_BIT {
            return tau;
        }
        bit -= 1;
    }
}

/// The kept token (key ≥ `tau`) where the running mass in vocabulary order
/// first exceeds `target`; if rounding leaves it short, the last kept token of
/// non-zero weight.
#[inline(always)]
unsafe fn draw<L: Logit>(red: &mut Reducer, x: *const u8, n: u32, tau: u32, w: Weights, target: f32) -> u32 {
    let (t, nt) = (thread_idx_x(), block_dim_x());
    let tile = nt * SCAN_CHUNK;
    let mut running = 0.0f32;
    let mut last_positive = 0u32;
    let mut base = 0u32;
    while base < n {
        let start = base + t * SCAN_CHUNK;
        let mut ws = [0.0f32; SCAN_CHUNK as usize];
        let mut local = 0.0;
        for (j, wj) in ws.iter_mut().enumerate() {
            let i = start + j as u32;
            if i < n {
                let v = L::load(x, i);
                if key(v) >= tau {
                    *wj = w.of(v);
                }
            }
            local += *wj;
        }
        let (before, total) = red.scan_f32(local);
        let mut c = running + before;
        let mut mine = u32::MAX;
        for (j, &wj) in ws.iter().enumerate() {
            c += wj;
            if wj > 0.0 {
                let i = start + j as u32;
                last_positive = i;
                if c > target && mine == u32::MAX {
                    mine = i;
                }
            }
        }
        // Rounding may let two threads both see the crossing: the earlier wins.
        let pick = red.min_u32(mine);
        if pick != u32::MAX {
            return pick;
        }
        running += total;
        base += tile;
    }
    red.max_u32(last_positive)
}

#[inline(always)]
fn ln(x: f32) -> f32 {
    lg2(x) * core::f32::consts::LN_2
}

#[inline(always)]
unsafe fn sample_rows<L: Logit>(a: SampleArgs) {
    let t = thread_idx_x();
    let mut red = Reducer::new();
    let mut row = block_idx_x();
    while row < a.batch {
        let x = (a.logits as usize + row as usize * a.row_stride as usize * L::BYTES) as *const u8;
        let p = *((a.params as usize + row as usize * core::mem::size_of::<RowParams>()) as *const RowParams);
        let n = a.vocab;

        // Largest key, then the lowest index holding it (threads walk their
        // indices upwards and keep the first of their largest).
        let (mut best_key, mut best_i) = (0u32, 0u32);
        for_each_logit::<L>(x, n, |i, v| {
            let k = key(v);
            if k > best_key {
                best_key = k;
                best_i = i;
            }
        });
        let max_key = red.max_u32(best_key);
        let argmax = red.min_u32(if best_key == max_key { best_i } else { u32::MAX });

        let (token, logprob) = if max_key <= NEG_INF_KEY {
            (0, f32::NAN)
        } else {
            let m = value(max_key);
            let token = if p.temperature > 0.0 {
                let w = Weights { m, c: LOG2_E / p.temperature };
                let mut tau = 1u32;
                if p.top_k != 0 && p.top_k < n {
                    let kth = search_key::<L>(|cand| red.sum_u32(thread_count::<L>(x, n, cand)) >= p.top_k);
                    tau = if kth > 1 { kth } else { 1 };
                }
                let mut mass = red.sum_f32(thread_mass::<L>(x, n, tau, w));
                if p.top_p < 1.0 {
                    // Keys below tau hold at least the top-k mass, so the search
                    // ends at or above tau: the nucleus lies inside the top-k set.
                    let goal = p.top_p * mass;
                    tau = search_key::<L>(|cand| {
                        let s = red.sum_f32(thread_mass::<L>(x, n, cand, w));
                        if s >= goal {
                            mass = s;
                        }
                        s >= goal
                    });
                }
                draw::<L>(&mut red, x, n, tau, w, uniform(p.seed, p.step) * mass)
            } else {
                argmax
            };
            let logprob = if a.logprobs != 0 {
                let sum = red.sum_f32(thread_mass::<L>(x, n, 1, Weights { m, c: LOG2_E }));
                let xt = L::load(x, token);
                (if xt == m { 0.0 } else { xt - m }) - ln(sum)
            } else {
                0.0
            };
            (token, logprob)
        };
        if t == 0 {
            *((a.tokens as usize + row as usize * 4) as *mut u32) = token;
            if a.logprobs != 0 {
                *((a.logprobs as usize + row as usize * 4) as *mut f32) = logprob;
            }
        }
        row += grid_dim_x();
    }
}

#[no_mangle]
pub unsafe extern "ptx-kernel" fn sample_bf16(a: SampleArgs) {
    sample_rows::<Bf16>(a)
}
crate::launch_bounds!(sample_bf16: SampleArgs, 512);

#[no_mangle]
pub unsafe extern "ptx-kernel" fn sample_f32(a: SampleArgs) {
    sample_rows::<F32>(a)
}
crate::launch_bounds!(sample_f32: SampleArgs, 512);
