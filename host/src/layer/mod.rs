//! The Llama-style decoder layer: configuration, weights (seeded random or from a
//! Hugging Face safetensors file) and the f64 CPU reference of its forward pass.
//! The GPU layer that assembles the kernels builds on these.

pub mod config;
pub mod reference;
pub mod weights;

pub use config::LayerConfig;
pub use weights::LayerWeights;
