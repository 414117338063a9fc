//! GPU tests of the NCCL binding on one GPU: a communicator of one rank runs
//! the real NCCL path (load, unique id, init, all-reduce on the stream, also
//! captured in a CUDA graph). On a GPU machine without NCCL they fail.

use host::bf16;
use host::data::{cast, random_with_outliers};
use host::ops::SampleOutput;
use host::tp::nccl::{Communicator, Nccl};
use host::{Error, Gpu, Tensor};
use lab::testing::GpuTests;

fn e(err: Error) -> String {
    err.to_string()
}

/// A one-rank all-reduce leaves the tensor as it was, bit for bit, plainly and
/// replayed from a graph; so does a broadcast its ids; a rank outside the world is refused.
fn one_rank_all_reduce_is_identity(gpu: &Gpu) -> Result<(), String> {
    let nccl = std::sync::Arc::new(Nccl::load().map_err(e)?);
    let (major, minor, patch) = nccl.version().map_err(e)?;
    println!("  NCCL {major}.{minor}.{patch} from {}", nccl.path().display());
    let id = nccl.unique_id().map_err(e)?;
    let comm = Communicator::new(&nccl, gpu, 1, 0, &id).map_err(e)?;
    for n in [1usize, 4096, 4097, 64 * 4096 + 3] {
        let values: Vec<bf16> = cast(&random_with_outliers(n as u64, n, 1.0));
        let mut t = Tensor::from_host(gpu, &values, &[n]).map_err(e)?;
        comm.all_reduce_sum(gpu, &mut t).map_err(e)?;
        if t.to_host(gpu).map_err(e)? != values {
            return Err(format!("n {n}: a one-rank all-reduce changed the tensor"));
        }
        let graph = gpu.capture(|| comm.all_reduce_sum(gpu, &mut t)).map_err(e)?;
        for _ in 0..3 {
            // SAFETY: the graph points into `t`, alive and unmoved until after the replays.
            unsafe { gpu.launch_graph(&graph) }.map_err(e)?;
        }
        if t.to_host(gpu).map_err(e)? != values {
            return Err(format!("n {n}: a replayed one-rank all-reduce changed the tensor"));
        }
    }
    // A one-rank broadcast leaves the ids; an empty list stays empty.
    for want in [vec![7u32, 0, u32::MAX, 3], vec![]] {
        let mut ids = want.clone();
        comm.broadcast_ids(gpu, &mut ids).map_err(e)?;
        if ids != want {
            return Err(format!("a one-rank broadcast turned {want:?} into {ids:?}"));
        }
    }
    // So does a broadcast of drawn tokens.
    let mut drawn = SampleOutput::new(gpu, 3, false).map_err(e)?;
    drawn.set_tokens(gpu, &[5, 128_255, 0]).map_err(e)?;
    comm.broadcast_tokens(gpu, &mut drawn).map_err(e)?;
    if drawn.tokens(gpu).map_err(e)? != [5, 128_255, 0] {
        return Err("a one-rank broadcast changed the drawn tokens".into());
    }
    if Communicator::new(&nccl, gpu, 1, 1, &id).is_ok() {
        return Err("rank 1 of a world of 1 was accepted".into());
    }
    Ok(())
}

fn main() {
    let mut t = GpuTests::new("nccl");
    t.run("nccl_one_rank_all_reduce_is_identity", one_rank_all_reduce_is_identity);
    t.finish();
}
