//! A whole model's host side: a Hugging Face Llama-family checkpoint folder, its
//! configuration, its tokenizer and its chat template, read and checked on the CPU before anything
//! goes to the GPU.

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod gpu;
mod load;
pub mod speculate;
pub mod tokenizer;

pub use chat::{ChatTemplate, Message};
pub use checkpoint::{expected_tensors, Checkpoint, ExpectedTensor};
pub use config::{GenerationConfig, ModelConfig, ModelType, RopeScaling, WeightDType};
pub use gpu::{Model, ModelGraph, ModelOptions};
pub use safetensors::{tensor::TensorView, Dtype};
pub use speculate::{GreedyCheck, PromptLookup};
pub use tokenizer::Tokenizer;
