//! Typed handles of every kernel entry point, generated at build time from the
//! kernels' `launch_bounds!(entry: Params, threads)` declarations in the PTX:
//! `SOFTMAX_V1_F32X4_R1` is a `Kernel<abi::SoftmaxArgs>` named
//! `softmax_v1_f32x4_r1`. [`SHIPPED`] lists the shipped module's entries;
//! with the `dev` feature, `dev` holds the versions kept for comparison.

use crate::runtime::{Kernel, KernelInfo};

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The handle of the entry `name`, if it takes `A`: for dispatch tables that
/// still choose entries by name. A name that is not an entry, or whose entry
/// takes another struct, is an error before any launch.
pub(crate) fn lookup<A: abi::Params>(name: &'static str) -> crate::Result<Kernel<A>> {
    let want = std::any::type_name::<A>();
    match BY_NAME.iter().find(|(n, _, _, _)| *n == name) {
        Some(&(_, threads, params, false)) if params == want => Ok(Kernel::new(name, threads)),
        Some(&(_, threads, params, true)) if params == want => Ok(Kernel::new_dev(name, threads)),
        Some(&(_, _, params, _)) => {
            Err(crate::Error::InvalidArgument(format!("kernel {name} takes {params}, not {want}")))
        }
        None => Err(crate::Error::InvalidArgument(format!("no kernel entry named {name}"))),
    }
}
