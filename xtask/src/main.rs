//! Project tasks: `cargo xtask <command>`.
//!
//! The kernels are built with rustc's own `nvptx64-nvidia-cuda` target from
//! Debian's toolchain (see README: why not `cuda_builder`). xtask also acts as
//! that target's bitcode linker: rustc calls it back with `XTASK_PTX_LINK` set.

mod bundle;
mod fingerprint;
mod link;
mod ptx;
mod ptxas;
mod stub;
mod toolchain;

use std::path::PathBuf;
use std::process::ExitCode;

pub type Result<T> = std::result::Result<T, String>;

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  build-ptx      build kernels/ to PTX for sm_90a and sm_80, then check it with ptxas
  ptxas-check    assemble the built PTX offline and print the per-kernel resource table
  test           build-ptx, then `cargo test --release` for the whole workspace
  demo           build-ptx, then run the softmax/RMSNorm demo example
  layer [flags]  build-ptx, then the fused-layer example: prefill 2048 tokens, 128 decode
                 steps at batch 1 and 16, reference check, timings, launch counts, ledgers
  bench          build-ptx, then the criterion benches (BENCH_GROUPS=memory,attention,gemm,decode)
  run <args>     build-ptx, then `cargo run --release -p host <args>`
  bundle [DIR]   build a self-contained folder (executables, PTX, run script) for a
                 GPU machine without Rust; DIR defaults to ./bundle
  stub-libcuda   write the stand-in libcuda.so used only where no NVIDIA driver exists
";

fn main() -> ExitCode {
    if std::env::var_os(link::LINK_MODE_ENV).is_some() {
        return report(link::run(std::env::args().skip(1).collect()));
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first() else {
        eprint!("{USAGE}");
        return ExitCode::FAILURE;
    };
    let rest = &args[1..];
    let result = match cmd.as_str() {
        "build-ptx" => ptx::build_all().map(|_| ()),
        "ptxas-check" => ptxas::check_all(),
        "test" => cargo_with_gpu_env(&["test", "--release", "--workspace"], rest),
        "demo" => cargo_with_gpu_env(&["run", "--release", "-p", "host", "--example", "demo"], rest),
        "layer" => cargo_with_gpu_env(&["run", "--release", "-p", "host", "--example", "layer", "--"], rest),
        "bench" => cargo_with_gpu_env(&["bench", "-p", "host"], rest),
        "run" => cargo_with_gpu_env(&["run", "--release", "-p", "host"], rest),
        "bundle" => bundle::build(rest.first().map(PathBuf::from)),
        "stub-libcuda" => stub::ensure_link_env().map(|_| ()),
        "-h" | "--help" | "help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown command `{other}`\n{USAGE}")),
    };
    report(result)
}

fn report(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("xtask: error: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// Workspace root: the parent of xtask's manifest directory.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Builds the PTX, makes sure `-lcuda` resolves, then runs a host cargo command.
fn cargo_with_gpu_env(base: &[&str], extra: &[String]) -> Result<()> {
    ptx::build_all()?;
    let env = stub::ensure_link_env()?;
    let mut cmd = std::process::Command::new(std::env::var("CARGO").unwrap_or("cargo".into()));
    cmd.current_dir(root()).args(base).args(extra);
    env.apply(&mut cmd);
    run_status(&mut cmd)
}

pub fn run_status(cmd: &mut std::process::Command) -> Result<()> {
    let status = cmd.status().map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{:?} failed with {status}", cmd.get_program()))
    }
}
