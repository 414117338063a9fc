//! Tensor parallelism over NCCL: the shard plan (which heads and FFN columns a
//! rank holds), each rank's weights sliced from the checkpoint, the CPU
//! reference of a sharded layer, the NCCL binding loaded at run time, the
//! sharded layer, and the launcher of one process per GPU.

pub mod launch;
mod layer;
pub mod nccl;
mod plan;
pub mod reference;
mod weights;

pub use layer::TpLayer;
pub use plan::ShardPlan;

use crate::error::Result;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;

/// A tensor-parallel group as one rank sees it: the sum of a tensor over the
/// ranks, in place, queued on the GPU's stream. [`nccl::Communicator`] is the
/// real one; tests may stand in for it.
pub trait AllReduce {
    fn world(&self) -> usize;
    fn rank(&self) -> usize;
    /// `t` ← Σ over the ranks of their `t`, identical on every rank afterwards.
    fn all_reduce_sum(&self, gpu: &Gpu, t: &mut Tensor<bf16>) -> Result<()>;
}

impl AllReduce for nccl::Communicator<'_> {
    fn world(&self) -> usize {
        nccl::Communicator::world(self)
    }

    fn rank(&self) -> usize {
        nccl::Communicator::rank(self)
    }

    fn all_reduce_sum(&self, gpu: &Gpu, t: &mut Tensor<bf16>) -> Result<()> {
        nccl::Communicator::all_reduce_sum(self, gpu, t)
    }
}
