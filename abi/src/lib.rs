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
    RopeKvArgs,
    StreamArgs
);

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
    /// zeroes it again). 0: no split, the GEMM applies the epilogue itself.
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
}

/// The Hopper FlashAttention (TMA + wgmma): the arguments of the mma.sync kernels
/// plus the global addresses of 3-D `CUtensorMap`s over q `[total_q, n_heads, D]`
/// and k, v `[total_k, n_kv_heads, D]` (dims innermost first: D, heads, tokens),
/// bf16, 128-byte swizzle, boxes of 64 × 1 × the kernel's BM (q) or BN (k, v).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FlashTmaArgs {
    pub flash: FlashArgs,
    pub map_q: u64,
    pub map_k: u64,
    pub map_v: u64,
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
    }

    /// K/V tiles in flight: every kernel double-buffers them.
    pub const KV_STAGES: usize = 2;

    impl Tile {
        /// Bytes of the bf16 tiles at head dim `head_dim`: the Q tile, then
        /// [`KV_STAGES`] stages of a K and a V tile.
        pub const fn tile_bytes(&self, head_dim: usize) -> usize {
            (self.rows + 2 * KV_STAGES * self.keys) * head_dim * 2
        }
    }

    /// Query rows per block of the mma.sync kernels (`flash_v2`): 4 warps of 32.
    pub const V2_ROWS: usize = 128;
    pub const V2_THREADS: u32 = 128;

    /// The mma.sync kernel (`flash_v2`) with `keys`-key tiles.
    pub const fn v2(keys: usize) -> Tile {
        Tile { rows: V2_ROWS, keys, threads: V2_THREADS }
    }

    /// The portable kernel at head dim 64: the largest key tile that does not spill.
    pub const V2_HD64: Tile = v2(32);
    /// The portable kernel at head dim 128: the largest key tile that does not spill.
    pub const V2_HD128: Tile = v2(16);

    /// The Hopper kernels (sm_90a): two consumer warpgroups of 64 query rows,
    /// 128-key tiles by TMA.
    pub const HOPPER: Tile = Tile { rows: 128, keys: 128, threads: 256 };
    /// Shared memory the Hopper kernels take past their tiles: up to 1024 bytes to
    /// align the 128-byte-swizzled tiles, then the mbarriers.
    pub const HOPPER_ALIGN: usize = 1024;
    pub const HOPPER_BARRIER_BYTES: usize = 64;

    /// Dynamic shared memory of a Hopper kernel launch at head dim `head_dim`.
    pub const fn hopper_smem(head_dim: usize) -> usize {
        HOPPER.tile_bytes(head_dim) + HOPPER_ALIGN + HOPPER_BARRIER_BYTES
    }

    /// The tilings of the versions kept for comparison.
    pub mod dev {
        use super::{v2, Tile};

        /// v1: 64 query rows (16 per warp), 64-key tiles.
        pub const V1: Tile = Tile { rows: 64, keys: 64, threads: 128 };
        /// v2 with 64-key tiles.
        pub const V2_BN64: Tile = v2(64);
        /// v2 with 32-key tiles (head dim 128; at 64 it is the shipped [`super::V2_HD64`]).
        pub const V2_BN32: Tile = v2(32);
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
    /// [max_pos, head_dim / 2] f32: cos and sin of pos·θ^(−i/(head_dim/2)).
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
