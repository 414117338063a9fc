//! The launch of a checked plan: the kernel's parameter block, and for the
//! Hopper kernels the TMA tensor maps over q, k and v.

use super::batch::VarlenBatch;
use super::plan::{FlashKernel, FlashPlan};
use crate::error::Result;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use crate::tensor_map::HeadsBox;
use half::bf16;

/// The tensors of one call, in the layouts of the module doc.
pub(super) struct Operands<'a> {
    pub q: &'a Tensor<bf16>,
    pub k: &'a Tensor<bf16>,
    pub v: &'a Tensor<bf16>,
    pub batch: &'a VarlenBatch<'a>,
    pub o: &'a mut Tensor<bf16>,
    pub lse: &'a mut Tensor<f32>,
}

/// Launches `p`, which [`super::plan`] (or the dev planner) made for the GPU's
/// architecture from exactly these operands' shapes and batch.
pub(super) fn launch(gpu: &Gpu, p: &FlashPlan, t: Operands) -> Result<()> {
    let (cu_q, cu_k) = t.batch.device_offsets();
    let dims = t.batch.dims();
    let args = abi::FlashArgs {
        q: t.q.device_ptr(),
        k: t.k.device_ptr(),
        v: t.v.device_ptr(),
        o: t.o.device_ptr(),
        lse: t.lse.device_ptr(),
        cu_seqlens_q: cu_q,
        cu_seqlens_k: cu_k,
        n_heads: p.problem.heads as u32,
        n_kv_heads: p.problem.kv_heads as u32,
        total_q: dims.total_q as u32,
        causal: p.problem.causal as u32,
        scale_log2: p.problem.scale * std::f32::consts::LOG2_E,
        _pad: 0,
    };
    match p.kernel {
        // SAFETY: the plan checked q, k, v, o and lse against the batch whose
        // offsets the kernel reads, so every token row and head it addresses lies
        // within them; the offsets live in `t.batch`, which outlives the call.
        FlashKernel::Mma(kernel) => unsafe { gpu.launch(kernel, p.grid, p.threads, p.smem, &args) },
        FlashKernel::Tma(kernel) | FlashKernel::TmaPersistent(kernel) => {
            let head_dim = p.problem.head_dim.elements();
            let map = |ptr, tokens, heads, box_tokens| {
                gpu.heads_tensor_map(HeadsBox { ptr, tokens, heads, head_dim, box_tokens })
            };
            let (rows, keys) = (p.tile.rows as u32, p.tile.keys as u32);
            let o_rows = abi::attention::O_STORE_ROWS as u32;
            let args = abi::FlashTmaArgs {
                flash: args,
                map_q: map(t.q.device_ptr(), dims.total_q, p.problem.heads, rows)?,
                map_k: map(t.k.device_ptr(), dims.total_k, p.problem.kv_heads, keys)?,
                map_v: map(t.v.device_ptr(), dims.total_k, p.problem.kv_heads, keys)?,
                query_tiles: p.grid.1,
                sequences: p.grid.2,
                tile_counter: gpu.tile_counter(),
                section_pairs: p.section_pairs(dims),
                _pad: 0,
                map_o: if p.stages_o { map(t.o.device_ptr(), dims.total_q, p.problem.heads, o_rows)? } else { 0 },
            };
            let grid = match p.kernel {
                FlashKernel::TmaPersistent(_) => (p.tiles().min(gpu.info().sm_count as u64) as u32, 1, 1),
                _ => p.grid,
            };
            // SAFETY: as above; the maps describe exactly q, k, v and o (address,
            // shape, box), and the TMA fills rows past a tensor's end with zeros
            // (and stores none there); a kernel that stores O by TMA stores only
            // boxes of rows inside their sequence.
            // A persistent kernel walks exactly the plan's tile grid, taking
            // tiles from the GPU's counter, which only the launches of this
            // stream use, one at a time.
            unsafe { gpu.launch(kernel, grid, p.threads, p.smem, &args) }
        }
    }
}
