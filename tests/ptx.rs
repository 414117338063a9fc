//! CPU-side checks of the embedded PTX: the right targets, every kernel the host
//! can launch is present, and each carries the launch bound the host assumes.

use host::ops::all_kernels;
use host::ptx::{SM_80, SM_90A};

fn entry_header<'a>(ptx: &'a str, name: &str) -> Option<&'a str> {
    let start = ptx.find(&format!(".entry {name}("))?;
    let body = ptx[start..].find("\n{")?;
    Some(&ptx[start..start + body])
}

#[test]
fn modules_target_their_architectures() {
    assert!(SM_90A.contains(".target sm_90a"), "sm_90a module has the wrong .target");
    assert!(SM_80.contains(".target sm_80"), "sm_80 module has the wrong .target");
    assert!(SM_90A.contains(".version 8."), "sm_90a needs PTX ISA 8.x");
}

#[test]
fn every_dispatched_kernel_exists_with_its_launch_bound() {
    for (arch, ptx) in [("sm_90a", SM_90A), ("sm_80", SM_80)] {
        for k in all_kernels() {
            let header = entry_header(ptx, k.name).unwrap_or_else(|| panic!("{arch}: kernel {} missing", k.name));
            let bound = format!(".maxntid {}, 1, 1", k.max_threads);
            assert!(header.contains(&bound), "{arch}: {} lacks `{bound}`:\n{header}", k.name);
        }
    }
}

#[test]
fn embedded_ptx_is_current() {
    // build.rs refuses stale PTX; this checks the files it embedded are the ones on disk.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let on_disk = std::fs::read_to_string(root.join("target/ptx/sm_90a.ptx"));
    if let Ok(text) = on_disk {
        assert_eq!(text, SM_90A, "embedded sm_90a PTX differs from target/ptx: rebuild");
    }
}

use host::ops::gemm::{TMA, TMA_PERSISTENT, WGMMA_EXP};

#[test]
fn hopper_only_kernels_are_only_in_the_sm90a_module() {
    let hopper = [
        (WGMMA_EXP.kernel, 128),
        (TMA.kernel, 384),
        (TMA_PERSISTENT.kernel, 384),
        ("flash_fwd_hopper_hd64", 256),
        ("flash_fwd_hopper_hd128", 256),
        (host::ops::decode::CLUSTER_KERNEL, 128),
    ];
    for (name, threads) in hopper {
        let bounds = format!(".maxntid {threads}, 1, 1");
        assert!(entry_header(SM_90A, name).is_some_and(|h| h.contains(&bounds)), "{name} missing from sm_90a");
        assert!(entry_header(SM_80, name).is_none(), "{name} must not be in the sm_80 module");
    }
    assert!(SM_90A.contains("wgmma.mma_async") && !SM_80.contains("wgmma"));
    assert!(SM_90A.contains("cp.async.bulk.tensor.2d") && !SM_80.contains("cp.async.bulk"));
    assert!(SM_90A.contains("barrier.cluster.arrive") && !SM_80.contains("barrier.cluster"));
}
