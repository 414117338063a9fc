//! Kernel parameter blocks, compiled into both the nvptx kernels and the host, so
//! their `#[repr(C)]` layouts cannot drift apart. Device pointers are `u64`.
#![no_std]

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
