//! TMA tensor maps (`CUtensorMap`) for the Hopper kernels: encoded by the driver,
//! kept in device memory, and cached per (address, shape, box), so a repeated
//! launch on the same tensors costs no encode and no copy.
//!
//! cust 0.3's bindings predate CUDA 12, so the driver entry point is declared here.

use crate::error::{check, cuda, Error, Result};
use cust::memory::DeviceBuffer;
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

/// Device-resident maps, by what they describe, in slots of a few large
/// allocations: a new map reuses a slot instead of allocating, so HBM stays
/// bounded however many shapes and addresses a long-running server sees.
#[derive(Default)]
pub struct MapCache {
    chunks: Vec<DeviceBuffer<u64>>,
    slots: Slots,
}

/// Maps held before unpinned ones make room: every weight of a large model and
/// a few activations each.
const CACHE_LIMIT: usize = 4096;
/// Maps fetched this recently (in fetches) are never evicted: an op fetches
/// the maps of all its launches (a few GEMMs and an attention: a dozen or so)
/// before the first, and a slot reused under a fetched map would hand a later
/// launch of the op another tensor's map.
const RECENT: u64 = 256;
/// Slots per allocation (512 KiB): the first holds the whole limit, so only
/// pinned maps past it ever allocate again.
const CHUNK_SLOTS: usize = CACHE_LIMIT;
const MAP_WORDS: usize = 16;

impl MapCache {
    /// The global address of the map for `b`, encoded and uploaded on first use
    /// by `upload` (its 32 words to the slot's address, ordered on the GPU's
    /// stream before the launches that read it). While a graph is recorded
    /// (`capturing`) a map is only found, never made (an upload there is
    /// refused: the step runs once before its capture), and it is pinned: the
    /// graph keeps its address, so it is never evicted while the process lives.
    pub fn get(&mut self, b: MapKey, capturing: bool, upload: impl FnOnce(u64, &[u32]) -> Result<()>) -> Result<u64> {
        self.slots.tick();
        if let Some(slot) = self.slots.hit(&b, capturing) {
            return Ok(self.address(slot));
        }
        if capturing {
            return Err(Error::InvalidArgument(
                "a tensor map made while a graph is recorded: run the step once before capturing it".into(),
            ));
        }
        let map = match b {
            MapKey::Rows(r) => encode_bf16_sw128(r)?,
            MapKey::Heads(h) => encode_heads_sw128(h)?,
        };
        let mut slot = self.slots.take_free();
        if slot.is_none() && self.slots.len() >= CACHE_LIMIT {
            // Queued kernels may still read unpinned maps: wait before reusing their slots.
            cust::context::CurrentContext::synchronize().map_err(cuda("cuCtxSynchronize"))?;
            self.slots.evict_stale();
            slot = self.slots.take_free();
        }
        let slot = match slot {
            Some(s) => s,
            None => {
                // No zeroing memset: it would run on the legacy stream, unordered
                // with the uploads on ours; every slot is written before its use.
                // SAFETY: u64 has no invalid bit patterns.
                let chunk = unsafe { DeviceBuffer::<u64>::uninitialized(CHUNK_SLOTS * MAP_WORDS) }
                    .map_err(cuda("cuMemAlloc"))?;
                self.chunks.push(chunk);
                self.slots.add(CHUNK_SLOTS);
                self.slots.take_free().expect("slots were just added")
            }
        };
        let words: Vec<u32> = map.0.iter().flat_map(|&w| [w as u32, (w >> 32) as u32]).collect();
        if let Err(e) = upload(self.address(slot), &words) {
            self.slots.release(slot);
            return Err(e);
        }
        // Made outside a capture: pinned only once a capture finds it.
        self.slots.insert(b, slot, false);
        Ok(self.address(slot))
    }

    /// Maps cached now, and device bytes their slots take.
    pub fn usage(&self) -> (usize, usize) {
        (self.slots.len(), self.chunks.len() * CHUNK_SLOTS * MAP_WORDS * 8)
    }

    fn address(&self, slot: usize) -> u64 {
        let base = self.chunks[slot / CHUNK_SLOTS].as_device_ptr().as_raw();
        base + ((slot % CHUNK_SLOTS) * MAP_WORDS * 8) as u64
    }
}

/// Which slot holds which map, apart from the device memory.
#[derive(Default)]
struct Slots {
    index: std::collections::HashMap<MapKey, Entry>,
    free: Vec<usize>,
    total: usize,
    /// Fetches so far.
    fetches: u64,
}

#[derive(Clone, Copy)]
struct Entry {
    slot: usize,
    pinned: bool,
    /// The fetch that last handed it out.
    last: u64,
}

impl Slots {
    /// Counts a fetch.
    fn tick(&mut self) {
        self.fetches += 1;
    }

    fn hit(&mut self, k: &MapKey, pin: bool) -> Option<usize> {
        let e = self.index.get_mut(k)?;
        e.pinned |= pin;
        e.last = self.fetches;
        Some(e.slot)
    }

    fn len(&self) -> usize {
        self.index.len()
    }

    fn take_free(&mut self) -> Option<usize> {
        self.free.pop()
    }

    fn release(&mut self, slot: usize) {
        self.free.push(slot);
    }

    /// `n` new slots after the last one.
    fn add(&mut self, n: usize) {
        self.free.extend((self.total..self.total + n).rev());
        self.total += n;
    }

    fn insert(&mut self, k: MapKey, slot: usize, pinned: bool) {
        self.index.insert(k, Entry { slot, pinned, last: self.fetches });
    }

    /// Frees every slot that no captured graph holds and that was not handed
    /// out in the last [`RECENT`] fetches.
    fn evict_stale(&mut self) {
        let (free, now) = (&mut self.free, self.fetches);
        self.index.retain(|_, e| {
            let keep = e.pinned || now - e.last < RECENT;
            if !keep {
                free.push(e.slot);
            }
            keep
        });
    }
}

#[cfg(test)]
mod tests {
    use super::{Bf16Box, MapKey, Slots, RECENT};

    fn key(ptr: u64) -> MapKey {
        MapKey::Rows(Bf16Box { ptr, rows: 64, cols: 64, box_rows: 64 })
    }

    #[test]
    fn eviction_spares_the_maps_of_the_last_fetches() {
        let mut s = Slots::default();
        s.add(2);
        s.tick();
        let slot = s.take_free().unwrap();
        s.insert(key(0), slot, false);
        for _ in 0..RECENT - 2 {
            s.tick();
        }
        s.tick();
        let slot = s.take_free().unwrap();
        s.insert(key(256), slot, false);
        // Fetch RECENT sees the first as RECENT − 1 fetches old: both stay.
        s.evict_stale();
        assert_eq!(s.len(), 2);
        // One fetch more: the first goes, the second stays.
        s.tick();
        s.evict_stale();
        assert_eq!((s.len(), s.hit(&key(0), false), s.take_free()), (1, None, Some(0)));
    }

    #[test]
    fn eviction_frees_unpinned_slots_only() {
        let mut s = Slots::default();
        s.add(3);
        for (i, pin) in [(0, false), (1, true), (2, false)] {
            let slot = s.take_free().unwrap();
            assert_eq!(slot, i, "slots are handed out in order");
            s.insert(key(i as u64 * 256), slot, pin);
        }
        assert_eq!(s.take_free(), None);
        // A hit while capturing pins the map it finds.
        assert_eq!(s.hit(&key(512), true), Some(2));
        s.insert(key(4096), 3, false);
        for _ in 0..RECENT {
            s.tick();
        }
        s.evict_stale();
        assert_eq!(s.len(), 2);
        assert_eq!(s.hit(&key(256), false), Some(1));
        assert_eq!(s.hit(&key(512), false), Some(2));
        assert_eq!(s.hit(&key(0), false), None);
        let mut freed: Vec<usize> = std::iter::from_fn(|| s.take_free()).collect();
        freed.sort();
        assert_eq!(freed, [0, 3]);
    }
}
