//! CPU-side checks of the embedded PTX and cubins: the right targets, every typed
//! kernel handle names an entry with the launch bound and parameter size it
//! claims, and each cubin holds its PTX's entries.

use host::kernels::{dev, SHIPPED};
use host::ptx::{SM_80, SM_80_DEV, SM_90A, SM_90A_DEV};
use host::KernelInfo;

fn entry_header<'a>(ptx: &'a str, name: &str) -> Option<&'a str> {
    let start = ptx.find(&format!(".entry {name}("))?;
    let body = ptx[start..].find("\n{")?;
    Some(&ptx[start..start + body])
}

/// Bytes of the entry's one by-value parameter (`.param .align A .b8 NAME[N]`).
fn param_bytes(header: &str) -> Option<usize> {
    let params: Vec<&str> = header.lines().filter(|l| l.trim_start().starts_with(".param")).collect();
    let [one] = params[..] else { return None };
    one.split('[').nth(1)?.split(']').next()?.parse().ok()
}

fn check_handles(modules: &[(&str, &str)], handles: &[KernelInfo]) {
    for k in handles {
        let found: Vec<(&str, &str)> =
            modules.iter().filter_map(|&(arch, ptx)| entry_header(ptx, k.name).map(|h| (arch, h))).collect();
        assert!(!found.is_empty(), "kernel {} is in no module", k.name);
        for (arch, header) in found {
            let bound = format!(".maxntid {}, 1, 1", k.max_threads);
            assert!(header.contains(&bound), "{arch}: {} lacks `{bound}`:\n{header}", k.name);
            assert_eq!(param_bytes(header), Some(k.params_bytes), "{arch}: {} parameter size:\n{header}", k.name);
        }
    }
}

fn entries(ptx: &str) -> Vec<&str> {
    ptx.lines().filter_map(|l| l.split(".entry ").nth(1)).filter_map(|r| r.split('(').next()).collect()
}

#[test]
fn modules_target_their_architectures() {
    assert!(SM_90A.contains(".target sm_90a"), "sm_90a module has the wrong .target");
    assert!(SM_80.contains(".target sm_80"), "sm_80 module has the wrong .target");
    assert!(SM_90A.contains(".version 8."), "sm_90a needs PTX ISA 8.x");
}

/// The SM version a CUDA ELF image was assembled for (`e_machine` EM_CUDA; the
/// version in the second byte of `e_flags`).
fn cubin_sm(image: &[u8]) -> Option<u32> {
    let machine = u16::from_le_bytes(image.get(18..20)?.try_into().ok()?);
    let flags = u32::from_le_bytes(image.get(48..52)?.try_into().ok()?);
    (image.starts_with(b"\x7fELF") && machine == 190).then_some((flags >> 8) & 0xff)
}

#[test]
fn cubins_are_their_modules_assembled() {
    let cubins = [
        ("sm_90a", 90, SM_90A, host::cubin::SM_90A),
        ("sm_80", 80, SM_80, host::cubin::SM_80),
        ("sm_90a-dev", 90, SM_90A_DEV, host::cubin::SM_90A_DEV),
        ("sm_80-dev", 80, SM_80_DEV, host::cubin::SM_80_DEV),
    ];
    for (stem, sm, ptx, image) in cubins {
        assert_eq!(cubin_sm(image), Some(sm), "{stem}.cubin is not a CUDA ELF image for sm_{sm}");
        let text = String::from_utf8_lossy(image);
        for name in entries(ptx) {
            assert!(text.contains(&format!(".text.{name}\0")), "{stem}.cubin lacks the entry {name}");
        }
    }
}

#[test]
fn every_handle_matches_its_entry() {
    check_handles(&[("sm_90a", SM_90A), ("sm_80", SM_80)], SHIPPED);
    check_handles(&[("sm_90a-dev", SM_90A_DEV), ("sm_80-dev", SM_80_DEV)], dev::ALL);
}

#[test]
fn shipped_modules_hold_no_dev_entry() {
    for (arch, ptx) in [("sm_90a", SM_90A), ("sm_80", SM_80)] {
        for name in entries(ptx) {
            assert!(SHIPPED.iter().any(|k| k.name == name), "{arch}: entry {name} has no shipped handle");
            assert!(!dev::ALL.iter().any(|k| k.name == name), "{arch}: dev entry {name} in a shipped module");
        }
    }
}

#[test]
fn embedded_ptx_is_current() {
    // build.rs refuses stale PTX; this checks the files it embedded are the ones on disk.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for (stem, embedded) in [("sm_90a", SM_90A), ("sm_90a-dev", SM_90A_DEV)] {
        if let Ok(text) = std::fs::read_to_string(root.join(format!("target/ptx/{stem}.ptx"))) {
            assert_eq!(text, embedded, "embedded {stem} PTX differs from target/ptx: rebuild");
        }
    }
}

#[test]
fn hopper_only_kernels_are_only_in_the_sm90a_modules() {
    for (ptx90, ptx80) in [(SM_90A, SM_80), (SM_90A_DEV, SM_80_DEV)] {
        for name in entries(ptx90) {
            let hopper = entry_header(ptx90, name).is_some_and(|h| h.contains("wgmma") || h.contains("hopper"));
            if hopper {
                assert!(entry_header(ptx80, name).is_none(), "{name} must not be in an sm_80 module");
            }
        }
        assert!(!ptx80.contains("wgmma") && !ptx80.contains("cp.async.bulk") && !ptx80.contains("barrier.cluster"));
    }
    assert!(SM_90A.contains("wgmma.mma_async"));
    assert!(SM_90A.contains("cp.async.bulk.tensor.2d"));
}
