//! The MLP on an explicit GEMM version, for benchmarks and tests.

use super::{MlpScratch, SwiGluMlp};
use crate::error::Result;
use crate::ops::gemm::{plan_with, GemmVersion};
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;

impl SwiGluMlp {
    /// [`forward`](Self::forward) with both GEMMs on `version`.
    pub fn forward_with(
        &self,
        gpu: &Gpu,
        x: &Tensor<bf16>,
        scratch: &mut MlpScratch,
        out: &mut Tensor<bf16>,
        version: GemmVersion,
    ) -> Result<()> {
        let (sm_count, arch) = (gpu.info().sm_count as usize, gpu.info().arch);
        self.run(gpu, x, scratch, out, false, false, &|x, w, o, r, ep| {
            plan_with(x, w, o, r, ep, version, sm_count, arch)
        })
        .map(|_| ())
    }
}
