//! `cuLaunchKernelEx` (CUDA 12), declared here: cust 0.3's bindings are CUDA 11.4.
//! Used for programmatic dependent launch on Hopper: a kernel launched this way may
//! start while the previous kernel in the stream finishes, and waits for it in
//! device code (`griddepcontrol.wait`) before touching its results.

use cust::sys::{CUfunction, CUresult, CUstream};
use std::ffi::c_void;

/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`
const PROGRAMMATIC_STREAM_SERIALIZATION: u32 = 6;

#[repr(C, align(8))]
struct LaunchAttribute {
    id: u32,
    _pad: [u8; 4],
    /// A 64-byte union in cuda.h; this attribute reads its first int.
    value: [u32; 16],
}

#[repr(C)]
struct LaunchConfig {
    grid: [u32; 3],
    block: [u32; 3],
    shared_mem_bytes: u32,
    stream: CUstream,
    attrs: *mut LaunchAttribute,
    num_attrs: u32,
}

type LaunchKernelEx =
    unsafe extern "C" fn(*const LaunchConfig, CUfunction, *mut *mut c_void, *mut *mut c_void) -> CUresult;

/// `cuLaunchKernelEx` from the driver, looked up at run time (drivers before CUDA
/// 12 lack it; linking it directly would keep the program from starting there).
fn launch_kernel_ex() -> Option<LaunchKernelEx> {
    static ENTRY: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    // SAFETY: the driver's entry point of that name has this signature (cuda.h).
    driver_entry(c"cuLaunchKernelEx", &ENTRY).map(|a| unsafe { std::mem::transmute::<usize, LaunchKernelEx>(a) })
}

/// Whether the driver can launch with attributes (programmatic dependent launch).
pub(crate) fn available() -> bool {
    launch_kernel_ex().is_some()
}

/// `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`
const CLUSTER_DIMENSION: u32 = 4;
/// `CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED` (CUDA 12; not in cust's enum).
const NON_PORTABLE_CLUSTER_SIZE_ALLOWED: i32 = 14;

fn attribute(id: u32, words: &[u32]) -> LaunchAttribute {
    let mut value = [0u32; 16];
    value[..words.len()].copy_from_slice(words);
    LaunchAttribute { id, _pad: [0; 4], value }
}

/// Launches `f` allowed to overlap the previous kernel in `stream` (see module doc)
/// when `programmatic`, and as clusters of `cluster` blocks when given.
///
/// # Safety
/// As `cuLaunchKernel`; with `programmatic`, the kernel must call
/// `griddepcontrol.wait` before it reads what earlier kernels write or writes what
/// they read; with `cluster`, each grid dimension must be a multiple of it and the
/// kernel must allow its size ([`allow_non_portable_clusters`] past 8).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn launch_with(
    f: CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    stream: CUstream,
    params: *mut *mut c_void,
    programmatic: bool,
    cluster: Option<(u32, u32, u32)>,
) -> CUresult {
    let mut attrs = Vec::with_capacity(2);
    if programmatic {
        attrs.push(attribute(PROGRAMMATIC_STREAM_SERIALIZATION, &[1]));
    }
    if let Some((x, y, z)) = cluster {
        attrs.push(attribute(CLUSTER_DIMENSION, &[x, y, z]));
    }
    let mut config = config(grid, block, smem, stream);
    config.attrs = attrs.as_mut_ptr();
    config.num_attrs = attrs.len() as u32;
    match launch_kernel_ex() {
        Some(launch) => launch(&config, f, params, std::ptr::null_mut()),
        None => CUresult::CUDA_ERROR_NOT_SUPPORTED,
    }
}

fn config(grid: (u32, u32, u32), block: u32, smem: u32, stream: CUstream) -> LaunchConfig {
    LaunchConfig {
        grid: [grid.0, grid.1, grid.2],
        block: [block, 1, 1],
        shared_mem_bytes: smem,
        stream,
        attrs: std::ptr::null_mut(),
        num_attrs: 0,
    }
}

/// A driver entry point by name (CUDA 12), looked up once.
fn driver_entry(name: &'static std::ffi::CStr, slot: &'static std::sync::OnceLock<Option<usize>>) -> Option<usize> {
    *slot.get_or_init(|| {
        let mut pfn: *mut c_void = std::ptr::null_mut();
        // SAFETY: a NUL-terminated name and a valid out-pointer.
        let status = unsafe { cust::sys::cuGetProcAddress(name.as_ptr(), &mut pfn, 12000, 0) };
        (status == CUresult::CUDA_SUCCESS && !pfn.is_null()).then_some(pfn as usize)
    })
}

/// Lets `f` launch with clusters of more than 8 blocks (Hopper allows 16).
pub(crate) fn allow_non_portable_clusters(f: CUfunction) -> CUresult {
    type SetAttribute = unsafe extern "C" fn(CUfunction, i32, i32) -> CUresult;
    static ENTRY: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    match driver_entry(c"cuFuncSetAttribute", &ENTRY) {
        // SAFETY: cuFuncSetAttribute(CUfunction, CUfunction_attribute (an int), int).
        Some(a) => unsafe { std::mem::transmute::<usize, SetAttribute>(a)(f, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1) },
        None => CUresult::CUDA_ERROR_NOT_SUPPORTED,
    }
}

/// Clusters of `cluster` blocks (each `block` threads, `smem` dynamic bytes) of
/// `f` that can be resident at once (`cuOccupancyMaxActiveClusters`); None where
/// the driver lacks it.
pub(crate) fn max_active_clusters(
    f: CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    cluster: (u32, u32, u32),
) -> Option<i32> {
    type MaxActiveClusters = unsafe extern "C" fn(*mut i32, CUfunction, *const LaunchConfig) -> CUresult;
    static ENTRY: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let entry = driver_entry(c"cuOccupancyMaxActiveClusters", &ENTRY)?;
    let mut attr = attribute(CLUSTER_DIMENSION, &[cluster.0, cluster.1, cluster.2]);
    let mut config = config(grid, block, smem, std::ptr::null_mut());
    config.attrs = &mut attr;
    config.num_attrs = 1;
    let mut n = 0i32;
    // SAFETY: the signature of cuda.h; `config` and `attr` outlive the call.
    let status = unsafe { std::mem::transmute::<usize, MaxActiveClusters>(entry)(&mut n, f, &config) };
    (status == CUresult::CUDA_SUCCESS).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_cuda_h() {
        assert_eq!(std::mem::size_of::<LaunchAttribute>(), 72);
        assert_eq!(std::mem::offset_of!(LaunchConfig, stream), 32);
        assert_eq!(std::mem::offset_of!(LaunchConfig, attrs), 40);
        assert_eq!(std::mem::size_of::<LaunchConfig>(), 56);
    }
}
