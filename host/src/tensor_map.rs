//! TMA tensor maps (`CUtensorMap`) for the Hopper kernels: encoded by the driver,
//! kept in device memory, and cached per (address, shape, box), so a repeated
//! launch on the same tensors costs no encode and no copy.
//!
//! cust 0.3's bindings predate CUDA 12, so the driver entry point is declared here.

use crate::error::{check, cuda, Error, Result};
use cust::memory::{CopyDestination, DeviceBuffer};
use cust::sys::CUresult;
use std::ffi::c_void;

/// The driver's opaque 128-byte tensor map.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TensorMap(pub [u64; 16]);

#[link(name = "cuda")]
extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn cuTensorMapEncodeTiled(
        map: *mut TensorMap,
        data_type: u32,
        rank: u32,
        global_address: *mut c_void,
        global_dim: *const u64,
        global_strides: *const u64,
        box_dim: *const u32,
        element_strides: *const u32,
        interleave: u32,
        swizzle: u32,
        l2_promotion: u32,
        oob_fill: u32,
    ) -> CUresult;
}

// CUtensorMap* enums (cuda.h, CUDA 12).
const DATA_TYPE_BFLOAT16: u32 = 9;
const INTERLEAVE_NONE: u32 = 0;
const SWIZZLE_128B: u32 = 3;
const L2_PROMOTION_256B: u32 = 3;
const OOB_FILL_ZEROS: u32 = 0;

/// A row-major bf16 matrix `[rows, cols]` at `ptr`, read in boxes of `box_rows` ×
/// 64 columns (128 bytes: one swizzle row).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Bf16Box {
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
    pub box_rows: u32,
}

/// A `[tokens, heads, head_dim]` bf16 tensor at `ptr` (the attention layout), read
/// in boxes of 64 columns × one head × `box_tokens` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadsBox {
    pub ptr: u64,
    pub tokens: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub box_tokens: u32,
}

/// What a cached map describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MapKey {
    Rows(Bf16Box),
    Heads(HeadsBox),
}

/// Encodes the map for `b` on the host.
pub fn encode_bf16_sw128(b: Bf16Box) -> Result<TensorMap> {
    if !b.cols.is_multiple_of(8) || b.rows >= 1 << 31 || b.cols >= 1 << 31 {
        return Err(Error::Alignment(format!("tensor map: rows must be 16-byte multiples below 2^31 ({b:?})")));
    }
    encode(b.ptr, &[b.cols as u64, b.rows as u64], &[b.cols as u64 * 2], &[64, b.box_rows])
}

/// Encodes the 3-D map for `b` (dims innermost first: head_dim, heads, tokens).
pub fn encode_heads_sw128(b: HeadsBox) -> Result<TensorMap> {
    let (d, h, t) = (b.head_dim as u64, b.heads as u64, b.tokens as u64);
    if !b.head_dim.is_multiple_of(64) || h == 0 || t >= 1 << 31 || h >= 1 << 16 {
        return Err(Error::Shape(format!("tensor map: {b:?} (head_dim a multiple of 64)")));
    }
    encode(b.ptr, &[d, h, t], &[d * 2, h * d * 2], &[64, 1, b.box_tokens])
}

fn encode(ptr: u64, dims: &[u64], strides: &[u64], boxes: &[u32]) -> Result<TensorMap> {
    let op = "tensor map";
    if !ptr.is_multiple_of(16) || strides.iter().any(|s| !s.is_multiple_of(16)) {
        return Err(Error::Alignment(format!(
            "{op}: address {ptr:#x} and strides {strides:?} must be 16-byte aligned"
        )));
    }
    if boxes.iter().any(|&b| b == 0 || b > 256) {
        return Err(Error::TooLarge(format!("{op}: box {boxes:?}")));
    }
    let mut map = TensorMap([0; 16]);
    let unit = [1u32; 3];
    // SAFETY: dims/boxes have `rank` entries and strides `rank - 1`; the driver
    // only writes `map`.
    let status = unsafe {
        cuTensorMapEncodeTiled(
            &mut map,
            DATA_TYPE_BFLOAT16,
            dims.len() as u32,
            ptr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            unit.as_ptr(),
            INTERLEAVE_NONE,
            SWIZZLE_128B,
            L2_PROMOTION_256B,
            OOB_FILL_ZEROS,
        )
    };
    check("cuTensorMapEncodeTiled", status)?;
    Ok(map)
}

/// Device-resident maps, by what they describe.
#[derive(Default)]
pub struct MapCache {
    maps: std::collections::HashMap<MapKey, DeviceBuffer<u64>>,
    retired: Vec<DeviceBuffer<u64>>,
}

/// Enough for every weight of a large model and a few activations each.
const CACHE_LIMIT: usize = 4096;

impl MapCache {
    /// The global address of the map for `b`, encoded and uploaded on first use.
    pub fn get(&mut self, b: MapKey) -> Result<u64> {
        if let Some(buf) = self.maps.get(&b) {
            return Ok(buf.as_device_ptr().as_raw());
        }
        if self.maps.len() >= CACHE_LIMIT {
            // Queued kernels or a captured graph may still read these maps: keep
            // them alive (128 bytes each), just out of the lookup.
            self.retired.extend(self.maps.drain().map(|(_, buf)| buf));
        }
        let map = match b {
            MapKey::Rows(r) => encode_bf16_sw128(r)?,
            MapKey::Heads(h) => encode_heads_sw128(h)?,
        };
        let mut buf = unsafe { DeviceBuffer::<u64>::uninitialized(16) }.map_err(cuda("cuMemAlloc"))?;
        buf.copy_from(&map.0[..]).map_err(cuda("cuMemcpyHtoD"))?;
        // From pageable memory the copy may still be in flight when it returns, and
        // our stream does not order against it: wait, once per new map.
        cust::context::CurrentContext::synchronize().map_err(cuda("cuCtxSynchronize"))?;
        let ptr = buf.as_device_ptr().as_raw();
        self.maps.insert(b, buf);
        Ok(ptr)
    }
}
