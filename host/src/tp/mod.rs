//! Tensor parallelism over NCCL: the shard plan (which heads and FFN columns a
//! rank holds), each rank's weights sliced from the checkpoint, the CPU
//! reference of a sharded layer, the NCCL binding loaded at run time, and the
//! launcher of one process per GPU.

pub mod launch;
pub mod nccl;
mod plan;
pub mod reference;
mod weights;

pub use plan::ShardPlan;
