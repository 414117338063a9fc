//! Kernel parameter blocks, compiled into both the nvptx kernels and the host, so
//! their `#[repr(C)]` layouts cannot drift apart. Device pointers are `u64`.
#![no_std]

/// A kernel's by-value parameter block. The host's typed kernel handles
/// (`Kernel<P>`) take one of these, so a launch passes exactly the struct its
/// entry point was declared with (`launch_bounds!(entry: P, …)`).
pub trait Params: Copy + 'static {}

macro_rules! params {
    ($($t:ident),*) => {$(impl Params for $t {})*};
}
params!(
    SoftmaxArgs,
    RmsNormArgs,
    FlashArgs,
    GemmArgs,
    GemmTmaArgs,
    FlashTmaArgs,
    DecodeArgs,
    KvAppendArgs,
    KvGatherArgs,
    RopeKvArgs,
    StreamArgs,
    SampleArgs,
    EmbeddingArgs,
    FillRandomArgs,
    PersistentDecodeArgs
);

/// The dev persistent decode step (batch 1, every layer in one launch): shared
/// memory layout and limits, which the host checks a model against.
pub mod persistent {
    /// Warps that run the stages; one more streams the weights.
    pub const CONSUMER_WARPS: usize = 7;
    pub const CONSUMER_THREADS: usize = CONSUMER_WARPS * 32;
    pub const THREADS: usize = CONSUMER_THREADS + 32;
    /// Bytes of one weight slot of the ring, one bulk copy.
    pub const SLOT_BYTES: usize = 32 * 1024;
    /// Slots in the ring: the weights already loaded when a grid barrier or the
    /// attention stage holds the consumers.
    pub const STAGES: usize = 5;
    /// Bytes each warp reads of a slot per step: 32 lanes × 16.
    pub const SEGMENT_BYTES: usize = 512;
    /// Matrices' input widths must be multiples of this (a segment never
    /// straddles two rows).
    pub const K_MULTIPLE: usize = SEGMENT_BYTES / 2;
    /// Widest GEMV input held in shared memory (bf16).
    pub const MAX_K: usize = 20480;
    /// Most output rows of one matrix per block.
    pub const MAX_ROWS: usize = 512;
    pub const HEAD_DIM: usize = 128;
    /// Most query heads per KV head.
    pub const MAX_GROUP: usize = 8;
    /// f32 per (KV head, split, query head) partial: O, then m (log2) and ℓ.
    pub const PARTIAL: usize = HEAD_DIM + 2;
    pub const RING: usize = 0;
    pub const X: usize = RING + STAGES * SLOT_BYTES;
    pub const ROW_SUMS: usize = X + MAX_K * 2;
    /// f32 scratch of the block-wide reductions and the attention's per-warp maxima.
    pub const REDUCE: usize = ROW_SUMS + MAX_ROWS * 4;
    pub const REDUCE_F32: usize = CONSUMER_WARPS * MAX_GROUP + MAX_GROUP;
    /// Full and empty mbarriers of each slot.
    pub const BARRIERS: usize = (REDUCE + REDUCE_F32 * 4).next_multiple_of(8);
    pub const SMEM_BYTES: usize = BARRIERS + 2 * STAGES * 8;
    const _: () = assert!(SMEM_BYTES <= 227 * 1024);
    /// The attention's per-block scratch in the X region: q (f32, pre-scaled)
    /// and the summed O, each `[MAX_GROUP, HEAD_DIM]`, then ℓ per head.
    pub const Q: usize = X;
    pub const O_SUM: usize = Q + MAX_GROUP * HEAD_DIM * 4;
    pub const L_SUM: usize = O_SUM + MAX_GROUP * HEAD_DIM * 4;
    const _: () = assert!(L_SUM + MAX_GROUP * 4 <= ROW_SUMS);
    /// Each consumer warp's K/V staging tile: 32 half key rows or 16 value rows.
    pub const KV_TILE: usize = (L_SUM + MAX_GROUP * 4).next_multiple_of(128);
    pub const KV_TILE_BYTES: usize = 4096;
    const _: () = assert!(KV_TILE + CONSUMER_WARPS * KV_TILE_BYTES <= ROW_SUMS);
    /// Most splits × group a KV head's merge takes: their (m, ℓ) fill O_SUM.
    pub const MERGE_SPLITS: usize = MAX_GROUP * HEAD_DIM / 2;

    /// Flags that break the result, to time parts of the step: the consumers
    /// release each weight slot unread; the attention stage does nothing.
    pub const SKIP_MATH: u32 = 1;
    pub const SKIP_ATTENTION: u32 = 2;
    /// The grid barrier's pause between polls.
    pub const POLL_NS: u32 = 100;
    /// Grid barriers per layer, one after each stage (norm + QKV, attention,
    /// O, norm + gate/up, down).
    pub const STAGES_PER_LAYER: usize = 5;
    /// Attention's inner times per layer in the trace: the first unit's q
    /// ready, its keys done, its partial counted; KV head 0's merge done; warp
    /// 0's first key group's QK, softmax and P·V done.
    pub const ATTENTION_STAMPS: usize = 7;

    /// One layer's device addresses, as the kernel reads them from a table.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct Layer {
        pub attn_norm: u64,
        /// `[(h + 2·kv)·hd, d]`
        pub w_qkv: u64,
        /// `[(h + 2·kv)·hd]` bf16, or 0
        pub qkv_bias: u64,
        /// `[d, h·hd]`
        pub w_o: u64,
        pub mlp_norm: u64,
        /// `[2·ff, d]`, gate and up rows interleaved
        pub w_gate_up: u64,
        /// `[d, ff]`
        pub w_down: u64,
        pub k_pool: u64,
        pub v_pool: u64,
    }

    impl Layer {
        /// The fields in their `repr(C)` order, for a table in device memory.
        pub fn words(self) -> [u64; 9] {
            [
                self.attn_norm,
                self.w_qkv,
                self.qkv_bias,
                self.w_o,
                self.mlp_norm,
                self.w_gate_up,
                self.w_down,
                self.k_pool,
                self.v_pool,
            ]
        }
    }
    const _: () = assert!(core::mem::size_of::<Layer>() == 9 * 8);
}

/// The dev persistent decode step: one sequence's next token through every
/// layer. Scratch vectors are bf16.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PersistentDecodeArgs {
    /// `[n_layers]` [`persistent::Layer`]
    pub layers: u64,
    /// `[d]`: the embedded token on entry, the last layer's output on exit.
    pub x: u64,
    /// `[d]`: after attention.
    pub h: u64,
    /// `[(h + 2·kv)·hd]`
    pub qkv: u64,
    /// `[h·hd]`: attention's output.
    pub o: u64,
    /// `[ff]`: SiLU(gate)·up.
    pub act: u64,
    /// `[kv, splits, group, PARTIAL]` f32
    pub partial: u64,
    /// u32, zero on entry: `[0]` the grid barrier's count, then one per
    /// (layer, KV head) counting its finished splits.
    pub counters: u64,
    /// `[max_pos, hd/2]` f32
    pub cos: u64,
    pub sin: u64,
    /// The sequence's `[max_pages]` u32 page ids.
    pub page_table: u64,
    /// `[1 + (STAGES_PER_LAYER + ATTENTION_STAMPS)·n_layers]` u64: block 0's
    /// global timer (ns) at the start and after each grid barrier, then per
    /// layer attention's inner times ([`persistent::ATTENTION_STAMPS`]), for a
    /// breakdown by stage.
    pub trace: u64,
    pub n_layers: u32,
    pub d: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub ff: u32,
    pub page_size: u32,
    /// The new token's position (its K and V are written there).
    pub pos: u32,
    pub splits: u32,
    /// Keys per split.
    pub chunk: u32,
    pub eps: f32,
    /// log2(e)/sqrt(hd)
    pub scale_log2: f32,
    /// Measurement only, 0 for a real step: [`persistent::SKIP_MATH`],
    /// [`persistent::SKIP_ATTENTION`].
    pub flags: u32,
}

/// Row softmax over `rows` rows of `cols` elements. Strides are in elements.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SoftmaxArgs {
    pub x: u64,
    pub y: u64,
    pub rows: u32,
    pub cols: u32,
    pub x_row_stride: u32,
    pub y_row_stride: u32,
}

/// RMSNorm over bf16 rows, optionally fused with a residual add.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RmsNormArgs {
    pub x: u64,
    /// Residual to add first, or 0 for the plain norm.
    pub residual: u64,
    pub weight: u64,
    pub y: u64,
    /// Where s = x + residual is written; unused when `residual` is 0.
    pub sum_out: u64,
    pub rows: u32,
    pub cols: u32,
    /// Row stride in elements of x, residual and sum_out.
    pub in_row_stride: u32,
    pub y_row_stride: u32,
    pub eps: f32,
}

/// FlashAttention forward over a packed variable-length batch.
/// Q, O: [total_q, n_heads, D]; K, V: [total_k, n_kv_heads, D]; bf16, row-major.
/// LSE: [n_heads, total_q] f32 (natural log). Grid: (n_heads, q tiles, batch).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FlashArgs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    /// batch + 1 cumulative offsets (u32) into the token dimension of Q / K.
    pub cu_seqlens_q: u64,
    pub cu_seqlens_k: u64,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub total_q: u32,
    /// 1 for causal (bottom-right aligned when q_len < kv_len), else 0.
    pub causal: u32,
    /// softmax scale × log2(e): scores go straight to ex2.
    pub scale_log2: f32,
    pub _pad: u32,
}

/// Tiles of the decode kernels (`kernels/src/decode/`) that the host sizes
/// grids, shared memory and split chunks by.
pub mod decode {
    /// Keys per K/V tile: the loader gives each lane of a warp one key row.
    pub const KEY_TILE: usize = 32;
    /// Query rows per block: one m16 tile of (query token, head) pairs of one KV head.
    pub const ROW_TILE: usize = 16;
    /// Threads per warp; a one-warp split block has this many.
    pub const WARP_THREADS: usize = 32;
    /// Warps per block of the many-warp (`decode_wide_*`) entries, each a share
    /// of the block's keys.
    pub const WIDE_WARPS: usize = 4;
    /// K/V stages in each warp's shared ring (the shipped entries).
    pub const STAGES: usize = 2;
    /// Most new query tokens per sequence in one step (speculative decoding).
    pub const MAX_Q_LEN: usize = 8;

    /// Bytes of one warp's shared ring at head dim `head_dim`: its Q tile and
    /// `stages` (K, V) tile pairs, bf16. A many-warp block has one per warp.
    pub const fn ring_bytes(head_dim: usize, stages: usize) -> usize {
        (ROW_TILE + 2 * stages * KEY_TILE) * head_dim * 2
    }

    /// How `decode_merge` divides a row's splits among its block: one group of
    /// head_dim threads per [`merge::BATCH`] splits, up to [`merge::MAX_GROUPS`].
    pub mod merge {
        /// Splits whose loads one thread issues before using any.
        pub const BATCH: usize = 16;
        /// Most split groups per block.
        pub const MAX_GROUPS: usize = 4;
        /// Largest head dim `decode_merge` takes (its shared sums).
        pub const MAX_HEAD_DIM: usize = 128;
        /// The block has head_dim × this many threads.
        pub const fn groups(splits: usize) -> usize {
            let g = splits.div_ceil(BATCH);
            if g < 1 {
                1
            } else if g > MAX_GROUPS {
                MAX_GROUPS
            } else {
                g
            }
        }
    }

    /// The versions kept for comparison (built only into the dev modules).
    pub mod dev {
        /// Warps per block of the `decode_wide8_*` entries, one K/V stage each
        /// (about the shared memory of [`super::WIDE_WARPS`] warps of two).
        pub const WIDE8_WARPS: usize = 8;
        /// K/V stages per warp of the `decode_wide8_*` entries.
        pub const WIDE8_STAGES: usize = 1;
    }
}

/// How `rope_qkv_cache` divides a token's work among threads.
pub mod rope {
    /// Rotated pairs (i, i + head_dim/2) one thread takes: 8-byte loads of q/k.
    pub const PAIRS: usize = 4;
    /// Elements of v one thread copies (16 bytes).
    pub const V_CHUNK: usize = 8;
    /// Threads (units of work) per token.
    pub const fn units(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> usize {
        (n_heads + n_kv_heads) * head_dim / 2 / PAIRS + n_kv_heads * head_dim / V_CHUNK
    }
}

/// How the RMSNorm kernels divide a row among threads.
pub mod rmsnorm {
    /// `rmsnorm_split_sums`: 8-column packs per thread (rows up to 8 × this × the
    /// block size).
    pub const SPLIT_SUMS_PACKS: usize = 4;
}

/// What a GEMM writes after the K loop.
pub mod epilogue {
    /// out = X·Wᵀ
    pub const PLAIN: u32 = 0;
    /// out = residual + X·Wᵀ
    pub const RESIDUAL: u32 = 1;
    /// W rows interleave gate and up (row 2i = gate_i, row 2i+1 = up_i);
    /// out[:, i] = SiLU(gate_i) · up_i, so out has N/2 columns.
    pub const SWIGLU: u32 = 2;
}

/// Y = X·Wᵀ with X [M, K] and W [N, K] bf16 row-major (nn.Linear layout), f32
/// accumulation, bf16 out [M, N] (or [M, N/2] for SwiGLU).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemmArgs {
    pub x: u64,
    pub w: u64,
    pub out: u64,
    /// [M, N] bf16, read by the RESIDUAL epilogue; 0 otherwise.
    pub residual: u64,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub epilogue: u32,
    /// Split-K: elements of K per `blockIdx.z` slice (a multiple of the K tile).
    pub k_split: u32,
    pub _pad: u32,
    /// Split-K: f32 [M, N] accumulation buffer, all zeros on entry; the blocks add
    /// their partial sums into it and `gemm_finalize` applies the epilogue (and
    /// zeroes it again). The split tail: its scratch
    /// (`gemm::tma::split_tail_scratch_len`). 0: no split, the GEMM applies the
    /// epilogue itself.
    pub workspace: u64,
}

/// The Hopper GEMM (TMA + wgmma): the GEMM's arguments plus the global addresses
/// of two `CUtensorMap`s (128 bytes each, 64-byte aligned) over X [M, K] and W [N, K],
/// bf16, 128-byte swizzle, boxes of 64 (K) × the kernel's BM and BN rows.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemmTmaArgs {
    pub gemm: GemmArgs,
    pub map_x: u64,
    pub map_w: u64,
    /// For the kernels that store the output by TMA, a map over `out` (`[m, n]`,
    /// `[m, n / 2]` for SwiGLU; boxes of 64 × [`gemm::tma_store::BOX_ROWS`],
    /// 128-byte swizzle), and under the residual epilogue one over `residual`
    /// `[m, n]` (the same boxes); else 0.
    pub map_out: u64,
    pub map_residual: u64,
}

/// The GEMM tile configurations, defined once for the kernels (which instantiate
/// them) and the host (which sizes grids, shared memory and K splits by them).
pub mod gemm {
    /// One mma.sync tile configuration: a `bm × bn` output tile per block of
    /// `threads` threads, `warps_n` warps across N (the rest across M), fed by
    /// `bk`-deep K tiles through a `stages`-deep cp.async ring in dynamic shared memory.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct MmaTile {
        pub bm: usize,
        pub bn: usize,
        pub bk: usize,
        pub warps_n: usize,
        pub stages: usize,
        pub threads: usize,
    }

    impl MmaTile {
        /// Warps across M.
        pub const fn warps_m(&self) -> usize {
            self.threads / 32 / self.warps_n
        }

        /// m16 fragments per warp along M (the kernels' WMT).
        pub const fn m16_per_warp(&self) -> usize {
            self.bm / 16 / self.warps_m()
        }

        /// n8 fragments per warp along N (the kernels' WNT).
        pub const fn n8_per_warp(&self) -> usize {
            self.bn / 8 / self.warps_n
        }

        /// Dynamic shared memory of the ring: `stages` × (X and W tiles), bf16.
        pub const fn smem_bytes(&self) -> usize {
            self.stages * (self.bm + self.bn) * self.bk * 2
        }

        /// Whether the warps cover the tile exactly, each a whole number of mma
        /// fragments (ldmatrix pairs of n8 fragments along N), and the loads are
        /// whole passes of the block.
        pub const fn is_consistent(&self) -> bool {
            let warps = self.threads / 32;
            self.threads.is_multiple_of(32)
                && self.warps_n > 0
                && warps.is_multiple_of(self.warps_n)
                && self.bm.is_multiple_of(16 * self.warps_m())
                && self.bn.is_multiple_of(8 * self.warps_n)
                && self.n8_per_warp().is_multiple_of(2)
                && self.bk.is_multiple_of(16)
                && self.stages >= 2
                && (self.bm * self.bk / 8).is_multiple_of(self.threads)
                && (self.bn * self.bk / 8).is_multiple_of(self.threads)
        }
    }

    /// 128×128, four warps of 64×64, three stages: prefill.
    pub const PREFILL_128X128: MmaTile = MmaTile { bm: 128, bn: 128, bk: 64, warps_n: 2, stages: 3, threads: 128 };
    /// 128×256, eight warps of 64×64, three stages (a dev version).
    pub const PREFILL_128X256: MmaTile = MmaTile { bm: 128, bn: 256, bk: 64, warps_n: 4, stages: 3, threads: 256 };
    /// 64×128, four warps of 64×32, four stages: 17 to 64 tokens read each weight
    /// tile once for all rows.
    pub const ROWS_64X128: MmaTile = MmaTile { bm: 64, bn: 128, bk: 64, warps_n: 4, stages: 4, threads: 128 };
    /// 16×128, four warps of 16×32, four stages: decode.
    pub const SKINNY_16X128: MmaTile = MmaTile { bm: 16, bn: 128, bk: 64, warps_n: 4, stages: 4, threads: 128 };
    /// 16×128 with 128-deep K tiles: each weight row streams 256 contiguous bytes
    /// per stage; three stages (108 KB), two blocks per SM.
    pub const SKINNY_16X128_K128: MmaTile = MmaTile { bm: 16, bn: 128, bk: 128, warps_n: 4, stages: 3, threads: 128 };
    /// 16×64, six stages (61 KB): three blocks per SM (a dev version).
    pub const SKINNY_16X64: MmaTile = MmaTile { bm: 16, bn: 64, bk: 64, warps_n: 4, stages: 6, threads: 128 };
    /// 16×32 on two warps, eight stages (48 KB): four blocks per SM (a dev version).
    pub const SKINNY_16X32: MmaTile = MmaTile { bm: 16, bn: 32, bk: 64, warps_n: 2, stages: 8, threads: 64 };

    /// `gemm_finalize`: threads per block, one pair of columns each.
    pub const FINALIZE_THREADS: usize = 256;

    /// The split-K workspace: `m·n` f32 sums; the entries that finish split tiles
    /// in-kernel (stream-K, the fixups) count each tile's finished parts in one
    /// u32 per output tile right after them. All zero between GEMMs.
    pub const fn workspace_len(m: usize, n: usize, counted_tiles: usize) -> usize {
        m * n + counted_tiles
    }

    /// Shared memory of a TMA kernel's ring: `stages` boxes of X (`bm` rows)
    /// and W (`bn` rows), `bk` bf16 elements deep, 1024 bytes of slack to align
    /// them to the swizzle's atoms, then a `full` and an `empty` mbarrier a stage.
    pub const fn tma_ring_smem_bytes(bm: usize, bn: usize, bk: usize, stages: usize) -> usize {
        stages * (bm + bn) * bk * 2 + 1024 + 2 * 8 * stages
    }

    /// The Hopper GEMM (`gemm_bf16_tma*`): TMA boxes and wgmma tiles.
    pub mod tma {
        /// Output rows per tile (the X box's rows).
        pub const BM: usize = 128;
        /// Output columns per tile (the W box's rows).
        pub const BN: usize = 256;
        /// K elements per box: one 128-byte swizzle row.
        pub const BK: usize = 64;
        pub const STAGES: usize = 4;
        /// The split tail's counters per split tile: one per consumer warp
        /// (each finishes its own 16 rows).
        pub const SPLIT_TAIL_COUNTERS: usize = 8;
        /// Blocks a split-tail launch may have: its scratch holds this many
        /// tiles' counters (the tiles it splits are fewer than its blocks).
        pub const SPLIT_TAIL_MAX_BLOCKS: usize = 1024;
        /// The split tail's scratch, f32: the counters (zero between launches:
        /// each tile's last contributor resets its own), then a slot of one
        /// tile's f32 a block, left as it was written, then room for the
        /// stamped dev versions' [`SPLIT_TAIL_STAMPS`] a block.
        pub const fn split_tail_scratch_len(blocks: usize) -> usize {
            split_tail_stamps_at(blocks) + blocks * 2 * SPLIT_TAIL_STAMPS
        }
        /// Where in the split tail's scratch (f32 offset, 8-byte aligned) a
        /// launch of `blocks` blocks keeps its stamps.
        pub const fn split_tail_stamps_at(blocks: usize) -> usize {
            SPLIT_TAIL_MAX_BLOCKS * SPLIT_TAIL_COUNTERS + blocks * BM * BN
        }
        /// u64 a block of a stamped split-tail launch (dev) writes: its SM,
        /// `%globaltimer` when its consumers start, when its first stage has
        /// arrived, when its last unit's main loop ends and after that unit's
        /// store, then its unit count and whether it summed a split tile.
        pub const SPLIT_TAIL_STAMPS: usize = 8;
        /// The fewest K tiles a slice of the split tail's last round takes: a
        /// shorter one costs more in its round trip through the scratch than it
        /// saves.
        pub const SPLIT_TAIL_MIN_PIECE: usize = 8;
        /// From this many slices a tile, every slice's block sums a share of
        /// the tile once all are in; below it, the last one in sums all of it.
        /// Shares pay for their wait where one block would read many slots.
        pub const SPLIT_TAIL_SHARES_FROM: u32 = 4;

        /// The split tail's walk over `tiles` output tiles of `k_tiles` K tiles
        /// on `blocks` blocks: (tiles computed whole, K slices per tile of the
        /// rest). The rest, fewer tiles than blocks, each cut into that many
        /// equal slices, one a block. In 32 bits, as the kernel walks (a 64-bit
        /// division there is a call); the host bounds the launch to fit.
        // The kernel walks with this very form (`checked_div` adds branches there).
        #[allow(clippy::manual_checked_ops)]
        pub const fn split_tail(tiles: u32, k_tiles: u32, blocks: u32) -> (u32, u32) {
            let tail = tiles % blocks;
            let most = k_tiles / SPLIT_TAIL_MIN_PIECE as u32;
            let pieces = if tail == 0 {
                1
            } else {
                // min(blocks / tail, most), at least 1.
                let fill = blocks / tail;
                let p = if fill < most { fill } else { most };
                if p > 1 {
                    p
                } else {
                    1
                }
            };
            (tiles - tail, pieces)
        }
        /// wgmma warpgroups, 64 rows each; one more warpgroup produces.
        pub const CONSUMERS: usize = 2;
        pub const THREADS: usize = 128 * (1 + CONSUMERS);
        /// The ring is aligned to the swizzle's 1024-byte atoms in the kernel.
        pub const ALIGN_SLACK: usize = 1024;
        /// A `full` and an `empty` mbarrier (8 bytes each) per stage, after the ring.
        pub const BARRIER_BYTES: usize = 2 * 8 * STAGES;
        pub const SMEM_BYTES: usize = super::tma_ring_smem_bytes(BM, BN, BK, STAGES);
        const _: () = assert!(ALIGN_SLACK == 1024 && BARRIER_BYTES == 2 * 8 * STAGES);
    }

    /// `gemm_bf16_tma_store` (dev): [`tma`]'s persistent kernel whose consumer
    /// warpgroups stage their 64 × 256 outputs in shared memory (past the
    /// ring's barriers, 1024-byte aligned) and store them by TMA, a box of 64
    /// columns at a time (the residual epilogue's residual loaded into the
    /// staging first); three stages leave room for the staging.
    pub mod tma_store {
        pub const BM: usize = super::tma::BM;
        pub const BN: usize = super::tma::BN;
        pub const BK: usize = super::tma::BK;
        pub const STAGES: usize = 3;
        pub const THREADS: usize = super::tma::THREADS;
        pub const ALIGN_SLACK: usize = super::tma::ALIGN_SLACK;
        /// Rows of a stored box: one consumer warpgroup's.
        pub const BOX_ROWS: usize = 64;
        /// The barriers (16 bytes a stage, and 8 a consumer warpgroup for its
        /// residual) padded to the swizzle's atom.
        pub const BARRIER_BYTES: usize = 1024;
        const _: () = assert!(2 * 8 * STAGES + 8 * super::tma::CONSUMERS <= BARRIER_BYTES);
        pub const SMEM_BYTES: usize = STAGES * (BM + BN) * BK * 2 + ALIGN_SLACK + BARRIER_BYTES + BM * BN * 2;
    }

    /// A tiling of [`tma`]'s kernel with other column tiles: its rows, K
    /// boxes, threads and slack, `BN` columns and a ring of `STAGES`.
    macro_rules! tma_tiling {
        ($(#[$doc:meta])* $name:ident, BN = $bn:literal, $(#[$stages_doc:meta])* STAGES = $stages:literal) => {
            $(#[$doc])*
            pub mod $name {
                pub const BM: usize = super::tma::BM;
                pub const BN: usize = $bn;
                pub const BK: usize = super::tma::BK;
                $(#[$stages_doc])*
                pub const STAGES: usize = $stages;
                pub const THREADS: usize = super::tma::THREADS;
                pub const ALIGN_SLACK: usize = super::tma::ALIGN_SLACK;
                pub const BARRIER_BYTES: usize = 2 * 8 * STAGES;
                pub const SMEM_BYTES: usize = super::tma_ring_smem_bytes(BM, BN, BK, STAGES);
            }
        };
    }

    tma_tiling!(
        /// `gemm_bf16_tma_persistent_n128`: [`tma`]'s kernel on 128×128 tiles, each
        /// consumer warpgroup 64 × 128, with a deeper ring in about the same shared
        /// memory.
        tma_n128,
        BN = 128,
        STAGES = 6
    );

    tma_tiling!(
        /// `gemm_bf16_tma_persistent_n192` and `gemm_bf16_tma_split_tail_n192`:
        /// [`tma`]'s kernel on 128×192 tiles, each consumer warpgroup 64 × 192.
        /// N = 6144 (a Llama-3-8B QKV) is 32 of them: 128 tiles at M = 512 for
        /// 132 SMs, where 128×256 tiles make 96.
        tma_n192,
        BN = 192,
        /// 40 KiB a stage: five fit beside the slack and barriers.
        STAGES = 5
    );

    tma_tiling!(
        /// `gemm_bf16_tma_persistent_n224`: 128×224 tiles, so N = 28672
        /// (Llama-3-8B's gate/up) is 128 column tiles where 256 makes 112.
        tma_n224,
        BN = 224,
        /// 44 KiB a stage: five fit beside the slack and barriers (226,384 bytes).
        STAGES = 5
    );

    /// `gemm_bf16_tma_rows64`, Hopper's GEMM for 17 to 64 tokens: a 64×128 tile
    /// per block, one wgmma warpgroup fed by a producer warp through TMA, two
    /// blocks per SM; K whole or split (the workspace decides).
    pub mod tma_rows64 {
        pub const BM: usize = 64;
        pub const BN: usize = 128;
        /// K elements per box: one 128-byte swizzle row.
        pub const BK: usize = 64;
        pub const STAGES: usize = 4;
        /// One consumer warpgroup (warps 0–3) and the producer warp (warp 4).
        pub const THREADS: usize = 128 + 32;
        pub const ALIGN_SLACK: usize = 1024;
        /// A `full` and an `empty` mbarrier per stage, after the ring.
        pub const BARRIER_BYTES: usize = 2 * 8 * STAGES;
        pub const SMEM_BYTES: usize = super::tma_ring_smem_bytes(BM, BN, BK, STAGES);
        const _: () = assert!(ALIGN_SLACK == 1024 && BARRIER_BYTES == 2 * 8 * STAGES);
    }

    /// `gemm_bf16_wgmma_exp`, the first Hopper GEMM (a dev version).
    pub mod wgmma_exp {
        pub const BM: usize = 64;
        pub const BN: usize = 128;
        pub const BK: usize = 64;
        pub const STAGES: usize = 4;
        pub const THREADS: usize = 128;
        /// The ring, aligned in the kernel to 1024 bytes.
        pub const SMEM_BYTES: usize = STAGES * (BM + BN) * BK * 2 + 1024;
    }

    /// `gemv_bf16_n16`, the decode GEMV (a dev version).
    pub mod gemv {
        /// Rows per block (one m16 fragment).
        pub const ROWS: usize = 16;
        /// n8 fragments per block.
        pub const N8_TILES: usize = 2;
        /// K elements per chunk: four lanes × 8 elements per weight row.
        pub const K_CHUNK: usize = 32;
        /// Columns per block.
        pub const COLS: usize = 8 * N8_TILES;
        pub const WARPS: usize = 8;
        pub const THREADS: usize = 32 * WARPS;
        /// K chunks of each lane's weights in flight before any is used.
        pub const BATCH: usize = 4;
        /// Every warp's f32 fragments, handed to warp 0 through shared memory.
        pub const SMEM_BYTES: usize = WARPS * N8_TILES * 32 * 16;
    }
}

/// The Hopper FlashAttention (TMA + wgmma): the arguments of the mma.sync kernels
/// plus the global addresses of 3-D `CUtensorMap`s over q `[total_q, n_heads, D]`
/// and k, v `[total_k, n_kv_heads, D]` (dims innermost first: D, heads, tokens),
/// bf16, 128-byte swizzle, boxes of 64 × 1 × the kernel's BM (q) or BN (k, v);
/// for the kernels that store O by TMA, one over o of q's shape, boxes of
/// 64 × 1 × [`attention::O_STORE_ROWS`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FlashTmaArgs {
    pub flash: FlashArgs,
    pub map_q: u64,
    pub map_k: u64,
    pub map_v: u64,
    /// The tile grid, (heads, `query_tiles`, `sequences`), for kernels that are
    /// launched on fewer blocks and walk it.
    pub query_tiles: u32,
    pub sequences: u32,
    /// Walking kernels: a u32 that is 0 at launch and that they leave at 0,
    /// from which blocks take their tiles after the first.
    pub tile_counter: u64,
    /// Walking kernels: (sequence, head) pairs per section of the walk, whose
    /// K and V fit in L2 together.
    pub section_pairs: u32,
    pub _pad: u32,
    /// The map over o, or 0 for kernels that store O from registers.
    pub map_o: u64,
}

impl FlashTmaArgs {
    /// The tiles of the grid a walking kernel walks.
    #[inline(always)]
    pub fn walk_tiles(&self) -> u32 {
        self.flash.n_heads * self.query_tiles * self.sequences
    }

    /// Tile `t` of a walk over the tile grid, as (sequence, head, query tile):
    /// the (sequence, head) pairs, heads fastest, in sections of
    /// `section_pairs`; within a section the query tiles from the last (under a
    /// causal mask the longest), the section's pairs fastest. `t` must be below
    /// the grid's tiles and `section_pairs` at least 1.
    #[inline(always)]
    pub fn walk_tile(&self, t: u32) -> (u32, u32, u32) {
        let (heads, tiles, width) = (self.flash.n_heads, self.query_tiles, self.section_pairs);
        let per_section = width * tiles;
        let section = t / per_section;
        let first = section * width;
        let width = width.min(heads * self.sequences - first);
        let rest = t - section * per_section;
        let pair = first + rest % width;
        (pair / heads, pair % heads, tiles - 1 - rest / width)
    }
}

/// How the FlashAttention forward kernels tile their work: the host sizes the
/// grid (query tiles), the block and the shared memory from these, and the
/// kernels check their own layout against them at compile time.
pub mod attention {
    /// One kernel's tiling.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Tile {
        /// Query rows per block: the grid has ⌈longest sequence / rows⌉ query tiles.
        pub rows: usize,
        /// Keys per K/V tile.
        pub keys: usize,
        /// Threads per block.
        pub threads: u32,
        /// K/V tiles in flight.
        pub stages: usize,
    }

    /// K/V tiles in flight in the shipped kernels: they double-buffer them.
    pub const KV_STAGES: usize = 2;

    impl Tile {
        /// Bytes of the bf16 tiles at head dim `head_dim`: the Q tile, then
        /// `stages` stages of a K and a V tile.
        pub const fn tile_bytes(&self, head_dim: usize) -> usize {
            (self.rows + 2 * self.stages * self.keys) * head_dim * 2
        }
    }

    /// Query rows per block of the mma.sync kernels (`flash_v2`): 4 warps of 32.
    pub const V2_ROWS: usize = 128;
    pub const V2_THREADS: u32 = 128;

    /// The mma.sync kernel (`flash_v2`) with `keys`-key tiles.
    pub const fn v2(keys: usize) -> Tile {
        Tile { rows: V2_ROWS, keys, threads: V2_THREADS, stages: KV_STAGES }
    }

    /// The portable kernel at head dim 64: the largest key tile that does not spill.
    pub const V2_HD64: Tile = v2(32);
    /// The portable kernel at head dim 128: the largest key tile that does not spill.
    pub const V2_HD128: Tile = v2(16);

    /// The Hopper kernel (sm_90a): a producer warpgroup and two consumer
    /// warpgroups of 64 query rows, 128-key tiles by TMA.
    pub const HOPPER: Tile = Tile { rows: 128, keys: 128, threads: 384, stages: KV_STAGES };
    /// The Hopper kernel at head dim 256 on the counter walk: as [`HOPPER`] with
    /// 64-key tiles, so O's 128 accumulators per thread fit beside S's.
    pub const HOPPER_HD256: Tile = Tile { rows: 128, keys: 64, threads: 384, stages: KV_STAGES };
    /// The Hopper kernel at head dim 256 on one tile per block and the strided
    /// walk: 128-key tiles in one stage of K and one of V, each on barriers of
    /// its own (two stages of both would take 256 KiB), half the per-tile steps
    /// of [`HOPPER_HD256`]'s; S's 64 accumulators beside O's 128. K's next tile
    /// loads under the softmax and P·V, V's under the next S.
    pub const HOPPER_HD256_N128: Tile = Tile { rows: 128, keys: 128, threads: 384, stages: 1 };
    /// The Hopper kernel at head dim 64 on long sequences: three consumer
    /// warpgroups over 192 query rows, so a third warpgroup's GEMMs run while
    /// the other two's softmax holds the SFU.
    pub const HOPPER_M192: Tile = Tile { rows: 192, keys: 128, threads: 512, stages: KV_STAGES };
    /// Shared memory the Hopper kernels take past their tiles: up to 1024 bytes to
    /// align the 128-byte-swizzled tiles, then the mbarriers.
    pub const HOPPER_ALIGN: usize = 1024;
    pub const HOPPER_BARRIER_BYTES: usize = 128;

    /// Dynamic shared memory of a Hopper kernel launch of `tile` at head dim `head_dim`.
    pub const fn hopper_smem(tile: Tile, head_dim: usize) -> usize {
        tile.tile_bytes(head_dim) + HOPPER_ALIGN + HOPPER_BARRIER_BYTES
    }

    /// Rows of O a consumer warpgroup stores by TMA at once: its own.
    pub const O_STORE_ROWS: usize = 64;
    /// Where the O staging of the kernels that store O by TMA starts past the
    /// tiles: after the barriers, at the next 1024 bytes (the swizzle's atom).
    pub const O_STAGING_OFFSET: usize = 1024;
    const _: () = assert!(HOPPER_BARRIER_BYTES <= O_STAGING_OFFSET);

    /// [`hopper_smem`] with O staged in shared memory for its TMA store: a
    /// bf16 tile of the block's query rows, after the barriers.
    pub const fn hopper_smem_staged_o(tile: Tile, head_dim: usize) -> usize {
        tile.tile_bytes(head_dim) + HOPPER_ALIGN + O_STAGING_OFFSET + tile.rows * head_dim * 2
    }

    /// The tilings of the versions kept for comparison.
    pub mod dev {
        use super::{v2, Tile, KV_STAGES};

        /// v1: 64 query rows (16 per warp), 64-key tiles.
        pub const V1: Tile = Tile { rows: 64, keys: 64, threads: 128, stages: KV_STAGES };
        /// v2 with 64-key tiles.
        pub const V2_BN64: Tile = v2(64);
        /// v2 with 32-key tiles (head dim 128; at 64 it is the shipped [`super::V2_HD64`]).
        pub const V2_BN32: Tile = v2(32);
        /// The first Hopper kernel: two consumer warpgroups of 64 query rows, thread 0
        /// also the producer; the shipped kernel's tiles and shared memory.
        pub const HOPPER_LOCKSTEP: Tile = Tile { rows: 128, keys: 128, threads: 256, stages: KV_STAGES };
        /// The shipped Hopper kernel with 176-key tiles (head dims 64 and 128):
        /// S's 88 accumulators per thread beside O's, and the per-tile steps
        /// (barriers, row reductions, O's rescale) over 1.375× the keys.
        pub const HOPPER_N176: Tile = Tile { rows: 128, keys: 176, threads: 384, stages: KV_STAGES };
        /// The shipped Hopper kernel at head dim 256 with 80-key tiles
        /// (FlashAttention-3's choice there) instead of 64: S's 40 accumulators
        /// per thread beside O's 128, and the per-tile steps over 1.25× the keys;
        /// two stages fill 224 KiB of shared memory.
        pub const HOPPER_N80: Tile = Tile { rows: 128, keys: 80, threads: 384, stages: KV_STAGES };
        /// The shipped Hopper kernel with three K/V stages instead of two (head
        /// dims 64 and 128): a stage both consumers have released has a tile and a
        /// half of their work to land before the first one needs it, not half a
        /// tile (112 KiB of shared memory at head dim 64, 224 KiB at 128).
        pub const HOPPER_STAGES3: Tile = Tile { rows: 128, keys: 128, threads: 384, stages: 3 };
    }
}

/// Split-KV decode attention over a paged KV cache (one new query per sequence).
/// Pools: [num_pages, page_size, n_kv_heads, D] bf16. Grid: (n_kv_heads, splits, batch);
/// each block handles the G = n_heads / n_kv_heads query heads of one KV head over
/// `chunk` tokens and writes a partial (O normalized in f32, LSE) for the merge
/// (`decode_merge`, or the split group's last block in the fused entries).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DecodeArgs {
    /// [batch, q_len, n_heads, D] bf16: the step's new query tokens, the last
    /// q_len positions of each sequence (q_len > 1: speculative decoding).
    pub q: u64,
    pub k_pool: u64,
    pub v_pool: u64,
    /// [batch, max_pages] u32 page ids
    pub page_table: u64,
    /// `[batch]` u32 tokens in each sequence
    pub seq_lens: u64,
    /// [batch, q_len, n_heads, splits, D] f32
    pub o_partial: u64,
    /// [batch, q_len, n_heads, splits] f32 (natural log; -inf for an empty chunk)
    pub lse_partial: u64,
    /// [batch, q_len, n_heads, D] bf16, written by the merge
    pub out: u64,
    /// [batch, q_len, n_heads] f32, written by the merge
    pub lse: u64,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub page_size: u32,
    pub max_pages: u32,
    /// Tokens per split (a multiple of the key tile).
    pub chunk: u32,
    pub splits: u32,
    pub scale_log2: f32,
    /// New query tokens per sequence (1 for plain decoding); query i sits at
    /// position seq_len − q_len + i and sees the keys up to it.
    pub q_len: u32,
    /// n_heads / n_kv_heads (query heads per KV head), so the kernel need not divide.
    pub group: u32,
    /// log2(page_size) where the page size is a power of two (page index and
    /// offset by shift and mask), else [`NO_PAGE_SHIFT`] (by division).
    pub page_shift: u32,
    /// [batch, grid x] u32, zero on entry and left zero: the fused entries count
    /// the finished splits of each block column here (0 for the two-launch path).
    pub counters: u64,
}

/// [`DecodeArgs::page_shift`] for a page size that is not a power of two.
pub const NO_PAGE_SHIFT: u32 = u32::MAX;

/// Appends one token's K and V per sequence at position `seq_lens[b] - 1`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvAppendArgs {
    /// [batch, n_kv_heads, D] bf16
    pub k_new: u64,
    pub v_new: u64,
    pub k_pool: u64,
    pub v_pool: u64,
    pub page_table: u64,
    pub seq_lens: u64,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub page_size: u32,
    pub max_pages: u32,
}

/// Copies rows of a paged cache's K and V into contiguous tensors: row r is
/// position `token_pos[r]` of the sequence in page-table row `token_seq[r]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvGatherArgs {
    /// [num_pages, page_size, n_kv_heads, head_dim] bf16
    pub k_pool: u64,
    pub v_pool: u64,
    /// [n_seqs, max_pages] u32
    pub page_table: u64,
    /// `[rows]` u32: each row's page-table row and position.
    pub token_seq: u64,
    pub token_pos: u64,
    /// [rows, n_kv_heads, head_dim] bf16
    pub k_out: u64,
    pub v_out: u64,
    pub rows: u32,
    /// 16-byte units of one row (`n_kv_heads · head_dim / 8`).
    pub row_units: u32,
    pub page_size: u32,
    pub max_pages: u32,
}

/// RoPE on the QKV projection's output, and the K/V write into a paged cache.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RopeKvArgs {
    /// [tokens, (n_heads + 2·n_kv_heads)·head_dim] bf16: q, k, v of each token.
    pub qkv: u64,
    /// [tokens, n_heads, head_dim] bf16, q after RoPE.
    pub q_out: u64,
    /// [tokens, n_kv_heads, head_dim] bf16, k after RoPE and v, for prefill
    /// attention; 0 to skip (decode reads the cache).
    pub k_out: u64,
    pub v_out: u64,
    /// [num_pages, page_size, n_kv_heads, head_dim] bf16
    pub k_pool: u64,
    pub v_pool: u64,
    /// [n_seqs, max_pages] u32
    pub page_table: u64,
    /// `[tokens]` u32: the token's row of the page table, and its position.
    pub token_seq: u64,
    pub token_pos: u64,
    /// [max_pos, head_dim / 2] f32: cos and sin of `pos·inv_freq[i]`.
    pub cos: u64,
    pub sin: u64,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub page_size: u32,
    pub max_pages: u32,
    pub _pad: u32,
    /// [tokens, (n_heads + 2·n_kv_heads)·head_dim] f32: the QKV projection's
    /// split-K sums (the GEMM workspace), read instead of `qkv` when non-zero and
    /// zeroed after reading: the kernel then also finishes the split GEMM.
    pub qkv_sums: u64,
    /// [(n_heads + 2·n_kv_heads)·head_dim] bf16 added to every token's q, k and v
    /// before the rotation (Qwen2's projection bias), or 0 for none.
    pub bias: u64,
}

/// A read-only stream over `n_vec` 16-byte vectors of bf16 at `src`, summed into
/// the f32 at `out` (which the caller zeroes): the memory ceiling of kernels that
/// mostly read.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StreamArgs {
    pub src: u64,
    pub n_vec: u64,
    pub out: u64,
}

/// Next-token sampling: one block per row of `[batch, vocab]` logits, each row
/// with its own [`sampling::RowParams`]; writes one u32 token id per row.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SampleArgs {
    /// `[batch, vocab]` logits (bf16 or f32, by entry), rows `row_stride` elements apart.
    pub logits: u64,
    /// `[batch]` [`sampling::RowParams`].
    pub params: u64,
    /// `[batch]` u32 token ids.
    pub tokens: u64,
    /// `[batch]` f32 log-probabilities of the chosen tokens, or 0 for none.
    pub logprobs: u64,
    pub batch: u32,
    pub vocab: u32,
    pub row_stride: u32,
    pub _pad: u32,
}

/// What the sampling kernels and the host agree on.
pub mod sampling {
    /// One row's sampling parameters, as the kernel reads them from device memory.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq)]
    pub struct RowParams {
        /// 0 takes the argmax; otherwise logits are divided by it.
        pub temperature: f32,
        /// Keep the `top_k` largest logits (ties at the k-th value all kept); 0: all.
        pub top_k: u32,
        /// Keep the highest-probability tokens whose mass reaches `top_p`; 1: all.
        pub top_p: f32,
        pub _pad: u32,
        /// The request's seed, low and high words (the Philox key).
        pub seed: [u32; 2],
        /// The decoding step, low and high words (the Philox counter).
        pub step: [u32; 2],
    }

    /// Philox-4x32 multipliers and Weyl key increments (Salmon et al., SC'11).
    pub const PHILOX_M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
    pub const PHILOX_W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];
    pub const PHILOX_ROUNDS: usize = 10;

    /// Philox-4x32-10 of counter `ctr` under `key`: the generator both the
    /// kernel and the CPU reference draw from, so a test can recompute a row's
    /// uniform exactly.
    #[inline(always)]
    pub fn philox4x32(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
        let (mut c, mut k) = (ctr, key);
        let mut r = 0;
        while r < PHILOX_ROUNDS {
            let p0 = (PHILOX_M[0] as u64) * (c[0] as u64);
            let p1 = (PHILOX_M[1] as u64) * (c[2] as u64);
            let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
            let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
            c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
            k = [k[0].wrapping_add(PHILOX_W[0]), k[1].wrapping_add(PHILOX_W[1])];
            r += 1;
        }
        c
    }

    /// The uniform in [0, 1) a row draws at (seed, step): the top 24 bits of
    /// Philox's first word, exact in f32. It depends on neither the row nor the
    /// batch, so a request draws the same token wherever it sits in the batch.
    #[inline(always)]
    pub fn uniform(seed: [u32; 2], step: [u32; 2]) -> f32 {
        let w = philox4x32([step[0], step[1], 0, 0], seed)[0];
        (w >> 8) as f32 * (1.0 / 16_777_216.0)
    }

    /// A total order on logits as u32 keys (larger value, larger key) that puts
    /// NaN at 0, below -inf, so NaN never wins a max nor enters a kept set; -0
    /// and +0 share a key. Keys offset the magnitude's bits from 2^31, so a bf16
    /// value (which widens to f32 exactly) has a key whose low 16 bits are 0,
    /// and a search over bf16 keys needs only the high 16.
    #[inline(always)]
    pub fn key(x: f32) -> u32 {
        if x.is_nan() {
            return 0;
        }
        let b = x.to_bits();
        let mag = b & 0x7FFF_FFFF;
        if b & 0x8000_0000 != 0 {
            0x8000_0000 - mag
        } else {
            0x8000_0000 + mag
        }
    }

    /// The key of -inf: keys at or below it carry no probability.
    pub const NEG_INF_KEY: u32 = 0x0080_0000;

    /// The logit a key stands for (the inverse of [`key`] above NaN's 0).
    #[inline(always)]
    pub fn value(k: u32) -> f32 {
        if k >= 0x8000_0000 {
            f32::from_bits(k - 0x8000_0000)
        } else {
            f32::from_bits((0x8000_0000 - k) | 0x8000_0000)
        }
    }
}

/// Embedding lookup: `out[i, :] = table[ids[i], :]`, zeros where `ids[i] >= vocab`.
/// Grid: one block per row of `out`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EmbeddingArgs {
    /// `[vocab, d]` bf16
    pub table: u64,
    /// `[n]` u32 token ids
    pub ids: u64,
    /// `[n, d]` bf16
    pub out: u64,
    pub n: u32,
    pub vocab: u32,
    /// Row length in elements, a multiple of 8 (16-byte vectors).
    pub d: u32,
    pub _pad: u32,
}

/// Seeded normal bf16 values: `out[i] = mean + std · z(seed, i)` for `i < n`,
/// with `z` from [`random::pair`]. Grid-strided over [`random::CHUNK`]-element chunks.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FillRandomArgs {
    /// `[n]` bf16, 16-byte aligned.
    pub out: u64,
    pub n: u32,
    /// Outlier threshold of [`random::pair`] ([`random::OUTLIER_BELOW`], or 0 for none).
    pub outlier_below: u32,
    /// The seed, low and high words (the Philox key).
    pub seed: [u32; 2],
    pub mean: f32,
    pub std: f32,
}

/// Seeded standard normals that `fill_random_bf16` and the CPU compute bit for
/// bit alike: both run this code, built from f32 additions, multiplications and
/// one division only (IEEE-rounded on both sides; the nvptx backend emits them
/// with `.rn`, so ptxas cannot fuse them into FMAs), with no library `ln`,
/// `sqrt` or `sin` whose last bits could differ.
///
/// Element `i` belongs to pair `i / 2`; the pair's Philox-4x32-10 block (key =
/// seed, counter = (pair low word, pair high word, [`random::STREAM`], 0))
/// gives a Box–Muller pair from words 0 and 1, and each element's outlier test
/// from word 2 or 3.
pub mod random {
    use crate::sampling::philox4x32;

    /// Counter word 2: sets these draws apart from the sampler's (which uses 0)
    /// under the same seed.
    pub const STREAM: u32 = 0x6e6f_726d;
    /// Elements per Philox block: one Box–Muller pair.
    pub const PER_CALL: usize = 2;
    /// Elements one thread of `fill_random_bf16` writes per step: one 16-byte store.
    pub const CHUNK: usize = 8;
    /// An element is an outlier when its word is below this (p = 2⁻¹⁰).
    pub const OUTLIER_BELOW: u32 = 1 << 22;
    /// What an outlier's z is multiplied by.
    pub const OUTLIER_SCALE: f32 = 8.0;

    const LN2: f32 = core::f32::consts::LN_2;
    /// 2π / 2²⁴: one step of the 24-bit angle, in radians.
    const ANGLE_STEP: f32 = core::f32::consts::TAU / 16_777_216.0;

    /// The pair's Philox block (the seed as the key).
    #[inline(always)]
    pub fn block(seed: [u32; 2], pair: u64) -> [u32; 4] {
        philox4x32([pair as u32, (pair >> 32) as u32, STREAM, 0], seed)
    }

    /// Standard normals of elements 2·`pair` and 2·`pair` + 1, each times
    /// [`OUTLIER_SCALE`] where its outlier word is below `outlier_below`.
    #[inline(always)]
    pub fn pair(seed: [u32; 2], pair: u64, outlier_below: u32) -> [f32; 2] {
        let w = block(seed, pair);
        let (z0, z1) = box_muller(w[0], w[1]);
        let scale = |word: u32| if word < outlier_below { OUTLIER_SCALE } else { 1.0 };
        [z0 * scale(w[2]), z1 * scale(w[3])]
    }

    /// mean + std·z, as the kernel computes it before rounding to bf16.
    #[inline(always)]
    pub fn affine(z: f32, mean: f32, std: f32) -> f32 {
        mean + std * z
    }

    /// Element `index` of a fill with these arguments, as bf16 bits (the CPU
    /// reference of `fill_random_bf16`).
    pub fn normal_bf16(seed: u64, index: u64, mean: f32, std: f32, outlier_below: u32) -> u16 {
        let z = pair([seed as u32, (seed >> 32) as u32], index / 2, outlier_below)[(index % 2) as usize];
        bf16_bits(affine(z, mean, std))
    }

    /// f32 → bf16 bits, rounding to nearest even (as `cvt.rn.bf16.f32`); NaN stays NaN.
    #[inline(always)]
    pub fn bf16_bits(x: f32) -> u16 {
        let b = x.to_bits();
        if x.is_nan() {
            return ((b >> 16) | 0x40) as u16;
        }
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }

    /// Box–Muller: r = √(−2 ln u) with u = (k + ½)/2²³ from the top 23 bits of
    /// `w0` (never 0 nor 1), and the angle from the top 24 bits of `w1`.
    /// Returns (r cos θ, r sin θ).
    #[inline(always)]
    pub fn box_muller(w0: u32, w1: u32) -> (f32, f32) {
        let r = sqrt(-2.0 * ln_unit((w0 >> 9) * 2 + 1));
        let (s, c) = sin_cos_turns(w1 >> 8);
        (r * c, r * s)
    }

    /// ln(m / 2²⁴) for 1 ≤ m < 2²⁴: m = f·2ᵉ with f in [√½, √2), so the result
    /// is (e − 24)·ln 2 + ln f, the integer part exact (no cancellation next to
    /// 1), and ln f = 2 atanh(s) with s = (f − 1)/(f + 1), |s| ≤ 0.172, to s⁹
    /// (the series' error is below f32's rounding).
    #[inline(always)]
    pub fn ln_unit(m: u32) -> f32 {
        let bits = (m as f32).to_bits();
        let mut e = (bits >> 23) as i32 - 127 - 24;
        let mut f = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
        if f > core::f32::consts::SQRT_2 {
            f *= 0.5;
            e += 1;
        }
        let s = (f - 1.0) / (f + 1.0);
        let z = s * s;
        let p = ((z * (1.0 / 9.0) + 1.0 / 7.0) * z + 1.0 / 5.0) * z + 1.0 / 3.0;
        e as f32 * LN2 + (2.0 * s + 2.0 * s * z * p)
    }

    /// √x for x > 0 (not subnormal): x·(1/√x), the reciprocal root from the
    /// bit-pattern estimate (3.4% off) and three Newton steps (each squares the
    /// error: 2·10⁻⁷ relative at the end, f32's rounding).
    #[inline(always)]
    pub fn sqrt(x: f32) -> f32 {
        let mut y = f32::from_bits(0x5f37_5a86 - (x.to_bits() >> 1));
        let h = 0.5 * x;
        for _ in 0..3 {
            y = y * (1.5 - h * y * y);
        }
        x * y
    }

    /// (sin θ, cos θ) of θ = 2π·t/2²⁴ for a 24-bit `t`: the quarter turn is
    /// taken off in integers (exact), leaving |a| ≤ π/4 for the polynomials
    /// (Cephes' `sinf`/`cosf` coefficients).
    #[inline(always)]
    pub fn sin_cos_turns(t: u32) -> (f32, f32) {
        let q = (t + (1 << 21)) >> 22;
        let a = (t as i32 - (q << 22) as i32) as f32 * ANGLE_STEP;
        let z = a * a;
        let s = a + a * z * ((-1.951_529_6e-4 * z + 8.332_161e-3) * z - 1.666_665_5e-1);
        let c = 1.0 - 0.5 * z + z * z * ((2.443_315_7e-5 * z - 1.388_731_6e-3) * z + 4.166_664_6e-2);
        // Rotations by q quarter turns, as selects (a `match` becomes an indirect jump).
        let (s, c) = if q & 1 != 0 { (c, -s) } else { (s, c) };
        if q & 2 != 0 {
            (-s, -c)
        } else {
            (s, c)
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::vec::Vec;

    fn walk(heads: u32, query_tiles: u32, sequences: u32, section_pairs: u32) -> FlashTmaArgs {
        let flash = FlashArgs {
            q: 0,
            k: 0,
            v: 0,
            o: 0,
            lse: 0,
            cu_seqlens_q: 0,
            cu_seqlens_k: 0,
            n_heads: heads,
            n_kv_heads: 1,
            total_q: 0,
            causal: 1,
            scale_log2: 1.0,
            _pad: 0,
        };
        FlashTmaArgs {
            flash,
            map_q: 0,
            map_k: 0,
            map_v: 0,
            query_tiles,
            sequences,
            tile_counter: 0,
            section_pairs,
            _pad: 0,
            map_o: 0,
        }
    }

    #[test]
    fn a_walk_takes_every_tile_once_longest_first_in_sections() {
        for (heads, tiles, seqs, width) in [(16, 32, 4, 16), (3, 5, 7, 4), (1, 1, 1, 1), (8, 9, 2, 1), (5, 3, 2, 100)] {
            let a = walk(heads, tiles, seqs, width.min(heads * seqs));
            let total = heads * tiles * seqs;
            let order: Vec<_> = (0..total).map(|t| a.walk_tile(t)).collect();
            let mut seen = order.clone();
            seen.sort();
            seen.dedup();
            assert_eq!(seen.len(), total as usize, "{heads} {tiles} {seqs} {width}");
            assert!(seen.iter().all(|&(s, h, q)| s < seqs && h < heads && q < tiles));
            for w in order.windows(2) {
                let pair = |(s, h, _): (u32, u32, u32)| s * heads + h;
                let (a, b) = (pair(w[0]) / a.section_pairs, pair(w[1]) / a.section_pairs);
                // Sections in order; in one, query tiles never grow.
                assert!(a < b || (a == b && w[0].2 >= w[1].2), "{w:?}");
            }
        }
    }
}
