//! FlashAttention forward over packed variable-length sequences.
//!
//! Layout (row-major, what the fused layer's QKV projection writes):
//! - Q, O: `[total_q, n_heads, head_dim]`: token t, head h, element d at
//!   `(t·n_heads + h)·head_dim + d`.
//! - K, V: `[total_k, n_kv_heads, head_dim]`; query head h reads KV head
//!   `h / (n_heads / n_kv_heads)` (GQA/MQA).
//! - LSE: `[n_heads, total_q]` f32, natural log of each row's softmax denominator
//!   (scaled scores), -inf for a row that sees no key.
//!
//! Causal masks align bottom-right: in a sequence of `len_q` queries over `len_k`
//! keys, query i sees keys j ≤ i + len_k − len_q.
//!
//! The grid walks heads fastest, so the query heads of one KV group run side by
//! side and share each K/V tile through L2.
//!
//! [`flash_attention`] runs the shipped kernels: on sm_90a the Hopper ones (TMA +
//! wgmma), elsewhere the mma.sync ones with the key tiles that do not spill.
//! [`plan`] checks and sizes a call without a GPU.

mod batch;
#[cfg(feature = "dev")]
mod dev;
mod launch;
mod plan;

pub(crate) use batch::offsets_of_lengths;
pub use batch::{BatchDims, VarlenBatch, MAX_SEQUENCES, MAX_TOKENS};
#[cfg(feature = "dev")]
pub use dev::{flash_attention_on_walk, flash_attention_with, plan_with, plan_with_walk, FlashVersion};
#[cfg(feature = "dev")]
pub use plan::Walk;
pub use plan::{plan, AttentionOptions, FlashKernel, FlashPlan, HeadDim, Problem, Shapes, MAX_HEADS};

use crate::error::Result;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;

/// O = softmax(scale·Q·Kᵀ + mask)·V per sequence and head, and each row's LSE.
/// Every argument is checked before the launch.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention(
    gpu: &Gpu,
    q: &Tensor<bf16>,
    k: &Tensor<bf16>,
    v: &Tensor<bf16>,
    batch: &VarlenBatch,
    opts: AttentionOptions,
    o: &mut Tensor<bf16>,
    lse: &mut Tensor<f32>,
) -> Result<()> {
    let shapes = Shapes { q: q.shape(), k: k.shape(), v: v.shape(), o: o.shape(), lse: lse.shape() };
    let p = plan(gpu.info().arch, shapes, batch.dims(), opts)?;
    launch::launch(gpu, &p, launch::Operands { q, k, v, batch, o, lse })
}
