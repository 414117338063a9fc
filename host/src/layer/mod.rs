//! The Llama-style decoder layer: configuration, weights (seeded random or from a
//! Hugging Face safetensors file) and the f64 CPU reference of its forward pass.
//! [`gpu::Layer`] assembles the kernels into the layer on the GPU.

pub mod block;
pub mod config;
pub mod gpu;
pub mod reference;
pub(crate) mod step_io;
pub mod weights;

pub use block::{Stage, StepOptions};
pub use config::LayerConfig;
pub use gpu::{DecodeGraph, GraphInput, Layer};
pub use weights::LayerWeights;
