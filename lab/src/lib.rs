//! The dev wing, after llm.c's `dev/cuda`: every version of every kernel family
//! side by side, each checked against the f64 CPU reference and benchmarked; the
//! winner is promoted into `host`'s shipped path. Turns on `host/dev`.

pub mod clocks;
pub mod perf;
pub mod testing;
