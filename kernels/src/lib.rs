//! Transformer-layer GPU kernels in `#![no_std]` Rust, built to PTX by `cargo xtask build-ptx`.
//!
//! `gpu` is the device-support layer (the role `cuda_std` would play); it holds all
//! inline PTX so the kernel modules read like their algorithms.
#![no_std]
// stmt_expr_attributes: `#[inline(always)]` on closures that LLVM would outline.
#![feature(abi_ptx, stdarch_nvptx, asm_experimental_arch, stmt_expr_attributes)]
#![allow(clippy::missing_safety_doc)]

pub mod attention;
pub mod decode;
pub mod embedding;
pub mod gemm;
pub mod gpu;
pub mod random;
pub mod rmsnorm;
pub mod rope;
pub mod sampling;
pub mod softmax;
pub mod stream;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    gpu::trap()
}
