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
    let addr = *ENTRY.get_or_init(|| {
        let mut pfn: *mut c_void = std::ptr::null_mut();
        // SAFETY: a NUL-terminated name and a valid out-pointer.
        let status = unsafe { cust::sys::cuGetProcAddress(c"cuLaunchKernelEx".as_ptr(), &mut pfn, 12000, 0) };
        (status == cust::sys::CUresult::CUDA_SUCCESS && !pfn.is_null()).then_some(pfn as usize)
    });
    // SAFETY: the driver's entry point of that name has this signature (cuda.h).
    addr.map(|a| unsafe { std::mem::transmute::<usize, LaunchKernelEx>(a) })
}

/// Whether the driver can launch with attributes (programmatic dependent launch).
pub(crate) fn available() -> bool {
    launch_kernel_ex().is_some()
}

/// Launches `f` allowed to overlap the previous kernel in `stream` (see module doc).
///
/// # Safety
/// As `cuLaunchKernel`; and the kernel must call `griddepcontrol.wait` before it
/// reads what earlier kernels write or writes what they read.
pub(crate) unsafe fn launch_programmatic(
    f: CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    stream: CUstream,
    params: *mut *mut c_void,
) -> CUresult {
    let mut value = [0u32; 16];
    value[0] = 1;
    let mut attr = LaunchAttribute { id: PROGRAMMATIC_STREAM_SERIALIZATION, _pad: [0; 4], value };
    let config = LaunchConfig {
        grid: [grid.0, grid.1, grid.2],
        block: [block, 1, 1],
        shared_mem_bytes: smem,
        stream,
        attrs: &mut attr,
        num_attrs: 1,
    };
    match launch_kernel_ex() {
        Some(launch) => launch(&config, f, params, std::ptr::null_mut()),
        None => CUresult::CUDA_ERROR_NOT_SUPPORTED,
    }
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
