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

pub use layer::{Reduction, TpLayer};
pub use plan::ShardPlan;

use crate::error::{Error, Result};
use crate::ops::SampleOutput;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;
use std::marker::PhantomData;

/// A tensor-parallel group as one rank sees it: collectives over the ranks, in
/// place, queued on the GPU's stream (and so captured into a graph with the
/// rest of a step). [`nccl::Communicator`] is the real one; tests may stand in
/// for it.
///
/// Every rank must make the same calls in the same order, with the same
/// element counts: a rank that makes another waits for the others forever.
/// An implementation works on the buffers it is given and keeps no pointer
/// to them past the work it queues.
pub trait AllReduce {
    fn world(&self) -> usize;
    fn rank(&self) -> usize;
    /// `t` ← Σ over the ranks of their `t`, identical on every rank afterwards.
    fn all_reduce_sum(&self, gpu: &Gpu, t: &mut Tensor<bf16>) -> Result<()>;
    /// The same over f32 partial sums a split-K GEMM left in the GPU's workspace.
    fn all_reduce_sums(&self, gpu: &Gpu, sums: &mut DeviceSums) -> Result<()>;
    /// Every rank's drawn tokens ← the first rank's. Each rank samples from
    /// logits it computed itself; where a launch on the way adds in no fixed
    /// order, a near tie may draw differently, and the ranks' sequences (and
    /// their collectives) would part.
    fn broadcast_tokens(&self, gpu: &Gpu, tokens: &mut SampleOutput) -> Result<()>;
}

/// A rank's f32 partial sums in device memory (a split-K GEMM's, in the GPU's
/// workspace), lent to an all-reduce before the launch that finishes them.
pub struct DeviceSums<'a> {
    ptr: u64,
    len: usize,
    _lent: PhantomData<&'a mut [f32]>,
}

impl DeviceSums<'_> {
    /// # Safety
    /// `ptr` holds `len` f32 on this process's GPU, untouched by anything else
    /// while the view lives.
    pub(crate) unsafe fn new(ptr: u64, len: usize) -> Self {
        DeviceSums { ptr, len, _lent: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Downloads the sums (synchronously; waits for the GPU).
    pub fn to_host(&self, gpu: &Gpu) -> Result<Vec<f32>> {
        gpu.synchronize()?;
        let mut host = vec![f32::NAN; self.len];
        // SAFETY: `ptr` holds `len` f32 (`new`'s contract), the host side as many.
        let status = unsafe {
            cust::sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), self.ptr, self.len * std::mem::size_of::<f32>())
        };
        crate::error::check("cuMemcpyDtoH", status)?;
        Ok(host)
    }

    /// Replaces the sums with `data` (synchronously).
    pub fn copy_from_host(&mut self, gpu: &Gpu, data: &[f32]) -> Result<()> {
        if data.len() != self.len {
            return Err(Error::Shape(format!("{} sums into a view of {}", data.len(), self.len)));
        }
        gpu.synchronize()?;
        // SAFETY: as in `to_host`, the other way.
        let status = unsafe {
            cust::sys::cuMemcpyHtoD_v2(self.ptr, data.as_ptr().cast(), self.len * std::mem::size_of::<f32>())
        };
        crate::error::check("cuMemcpyHtoD", status)?;
        // From pageable memory the copy may land after it returns, unordered
        // with our stream: wait for the whole context.
        cust::context::CurrentContext::synchronize().map_err(crate::error::cuda("cuCtxSynchronize"))
    }
}

impl AllReduce for nccl::Communicator {
    fn world(&self) -> usize {
        nccl::Communicator::world(self)
    }

    fn rank(&self) -> usize {
        nccl::Communicator::rank(self)
    }

    fn all_reduce_sum(&self, gpu: &Gpu, t: &mut Tensor<bf16>) -> Result<()> {
        nccl::Communicator::all_reduce_sum(self, gpu, t)
    }

    fn all_reduce_sums(&self, gpu: &Gpu, sums: &mut DeviceSums) -> Result<()> {
        nccl::Communicator::all_reduce_sums(self, gpu, sums)
    }

    fn broadcast_tokens(&self, gpu: &Gpu, tokens: &mut SampleOutput) -> Result<()> {
        nccl::Communicator::broadcast_tokens(self, gpu, tokens)
    }
}
