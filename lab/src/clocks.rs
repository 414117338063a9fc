//! The SM clock and why the driver holds it down, read through NVML (loaded
//! at run time, as NCCL is): `perf` prints them beside each case, so a row
//! timed while the clock sagged under power or heat says so. Identical
//! kernels have read up to 8% apart in one sequential sweep; the clock tells
//! drift from a real difference.

use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CString};

const NVML_SUCCESS: c_int = 0;
const NVML_CLOCK_SM: c_int = 1;

/// The reasons NVML reports for a clock below its maximum that matter to a
/// timing (idle and application-clock settings left out).
const REASONS: [(c_ulonglong, &str); 5] = [
    (0x4, "power cap"),
    (0x8, "hardware slowdown"),
    (0x20, "thermal (software)"),
    (0x40, "thermal (hardware)"),
    (0x80, "power brake"),
];

type Device = *mut c_void;

/// One reading: the SM clock and the reasons it is held down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockSample {
    pub sm_mhz: u32,
    /// NVML's clock event reasons (`nvmlClocksEventReason*` bits).
    pub reasons: u64,
}

impl ClockSample {
    /// The reasons that slow a timed kernel, joined: empty when none.
    pub fn slowdowns(&self) -> String {
        let named: Vec<&str> = REASONS.iter().filter(|(bit, _)| self.reasons & bit != 0).map(|(_, n)| *n).collect();
        named.join(", ")
    }
}

/// The GPU's clocks through a loaded NVML.
pub struct Clocks {
    clock: unsafe extern "C" fn(Device, c_int, *mut c_uint) -> c_int,
    reasons: unsafe extern "C" fn(Device, *mut c_ulonglong) -> c_int,
    device: Device,
    // Last: the entry points above point into it.
    _lib: Library,
}

impl Clocks {
    /// NVML's handle of the device at `pci_bus_id` (`DeviceInfo::pci_bus_id`),
    /// or `None` where NVML is missing or does not know it: timings go on
    /// without clocks.
    pub fn open(pci_bus_id: &str) -> Option<Clocks> {
        // SAFETY: loading the driver's NVML runs no code of ours; each symbol
        // is given the signature of NVML's C API (nvml.h).
        unsafe {
            let lib = Library::new("libnvidia-ml.so.1").ok()?;
            let init: unsafe extern "C" fn() -> c_int = *lib.get(b"nvmlInit_v2\0").ok()?;
            let by_bus: unsafe extern "C" fn(*const c_char, *mut Device) -> c_int =
                *lib.get(b"nvmlDeviceGetHandleByPciBusId_v2\0").ok()?;
            let clock = *lib.get(b"nvmlDeviceGetClockInfo\0").ok()?;
            let reasons = match lib.get(b"nvmlDeviceGetCurrentClocksEventReasons\0") {
                Ok(f) => *f,
                Err(_) => *lib.get(b"nvmlDeviceGetCurrentClocksThrottleReasons\0").ok()?,
            };
            if init() != NVML_SUCCESS {
                return None;
            }
            let bus = CString::new(pci_bus_id).ok()?;
            let mut device: Device = std::ptr::null_mut();
            if by_bus(bus.as_ptr(), &mut device) != NVML_SUCCESS {
                return None;
            }
            Some(Clocks { clock, reasons, device, _lib: lib })
        }
    }

    /// The SM clock now, and why it is held down; `None` if NVML fails.
    pub fn sample(&self) -> Option<ClockSample> {
        let (mut mhz, mut reasons): (c_uint, c_ulonglong) = (0, 0);
        // SAFETY: a device handle NVML gave, out-parameters on the stack.
        let ok = unsafe {
            (self.clock)(self.device, NVML_CLOCK_SM, &mut mhz) == NVML_SUCCESS
                && (self.reasons)(self.device, &mut reasons) == NVML_SUCCESS
        };
        ok.then_some(ClockSample { sm_mhz: mhz, reasons })
    }
}

#[cfg(test)]
mod tests {
    use super::ClockSample;

    #[test]
    fn only_slowdowns_are_named() {
        // Idle (0x1) and application clocks (0x2) are not slowdowns of a timing.
        assert_eq!(ClockSample { sm_mhz: 1980, reasons: 0x3 }.slowdowns(), "");
        assert_eq!(ClockSample { sm_mhz: 1755, reasons: 0x4 | 0x20 }.slowdowns(), "power cap, thermal (software)");
    }
}
