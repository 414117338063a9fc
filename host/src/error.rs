//! One error type for the whole API. Argument errors are found before any launch.

use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// No CUDA device (or no driver) on this machine.
    NoDevice,
    /// The device is older than the oldest PTX we ship (sm_80).
    UnsupportedArch { major: i32, minor: i32 },
    /// A CUDA call failed.
    Cuda { call: &'static str, detail: String },
    /// Tensor shapes do not fit the operation.
    Shape(String),
    /// A tensor has the wrong element type.
    DType(String),
    /// An operation was given a tensor with no elements.
    Empty(String),
    /// A size or pointer does not meet an alignment requirement.
    Alignment(String),
    /// A size exceeds what the kernels or the launch grid can address.
    TooLarge(String),
    /// Another invalid argument (e.g. a non-finite epsilon).
    InvalidArgument(String),
    /// A decode batch given with a KV cache other than the one it was made from
    /// (its page ids index that cache's pools, not this one's), or made before
    /// pages of its cache went back to the free list (they may be another's now).
    ForeignBatch(String),
    /// A checkpoint folder is unreadable, incomplete, or configured for what the
    /// kernels do not support; the message names the file, field or tensor.
    Checkpoint(String),
    /// NCCL could not be loaded, or one of its calls failed; the message names
    /// the library paths tried or the call and NCCL's own error string.
    Nccl(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoDevice => write!(f, "no CUDA device found (no NVIDIA driver, or no GPU)"),
            Error::UnsupportedArch { major, minor } => {
                write!(f, "compute capability {major}.{minor} is not supported; sm_80 or newer is required")
            }
            Error::Cuda { call, detail } => write!(f, "CUDA error in {call}: {detail}"),
            Error::Shape(m) => write!(f, "shape error: {m}"),
            Error::DType(m) => write!(f, "dtype error: {m}"),
            Error::Empty(m) => write!(f, "empty tensor: {m}"),
            Error::Alignment(m) => write!(f, "alignment error: {m}"),
            Error::TooLarge(m) => write!(f, "too large: {m}"),
            Error::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            Error::ForeignBatch(m) => write!(f, "foreign batch: {m}"),
            Error::Checkpoint(m) => write!(f, "checkpoint: {m}"),
            Error::Nccl(m) => write!(f, "NCCL: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// Wraps a cust error with the name of the call that produced it.
pub(crate) fn cuda(call: &'static str) -> impl FnOnce(cust::error::CudaError) -> Error {
    move |e| match e {
        cust::error::CudaError::NoDevice => Error::NoDevice,
        e => Error::Cuda { call, detail: e.to_string() },
    }
}

/// Checks a raw driver-API status code.
pub fn check(call: &'static str, status: cust::sys::CUresult) -> Result<()> {
    if status == cust::sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda { call, detail: format!("{status:?}") })
    }
}
