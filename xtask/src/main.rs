//! Project tasks: `cargo xtask <command>`.
//!
//! The kernels are built with rustc's own `nvptx64-nvidia-cuda` target from
//! Debian's toolchain (see README: why not `cuda_builder`). xtask also acts as
//! that target's bitcode linker: rustc calls it back with `XTASK_PTX_LINK` set.

mod base;
mod bundle;
mod fingerprint;
mod link;
mod modules;
mod ptx;
mod ptxas;
mod sass;
mod stub;
mod toolchain;

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

pub type Result<T> = std::result::Result<T, String>;

/// Project tasks. Every command that runs host code builds the PTX first, and the
/// ptxas gate prints one summary line (the whole table with `-v`).
#[derive(Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    /// Print the whole ptxas table and what the build skipped, not only the summary line
    #[arg(short, long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build kernels/ to PTX (shipped and dev modules, sm_90a and sm_80), then run the ptxas gate
    BuildPtx,
    /// Assemble the built PTX offline and run the gate: no spills or stack frames in shipped modules
    PtxasCheck,
    /// One kernel's SASS from the built PTX (ptxas, then nvdisasm from PyPI): target/sass/KERNEL.sass and its opcode counts
    Sass {
        /// The entry's name, e.g. flash_fwd_hopper_ws_turns_counter_hd64
        kernel: String,
        /// The module's arch
        #[arg(long, default_value = "sm_90a")]
        arch: String,
    },
    /// build-ptx, then `cargo test --release --workspace [ARGS]` (GPU tests report skipped without a GPU)
    Test(Forward),
    /// build-ptx, then the softmax/RMSNorm demo example
    Demo,
    /// build-ptx, then the fused-layer example with FLAGS; `cargo xtask layer --help` lists them
    #[command(disable_help_flag = true)]
    Layer {
        /// Flags for the example (--prompt=, --steps=, --batches=, --weights=, …)
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "FLAGS")]
        flags: Vec<String>,
    },
    /// build-ptx, then text generation with a whole model (a checkpoint folder, or seeded Llama-3-8B-sized weights); `cargo xtask generate --help` lists the flags
    #[command(disable_help_flag = true)]
    Generate {
        /// Flags for the example (--model DIR, --prompt TEXT, --max-tokens N, --temperature T, --top-p P, --seed S, …)
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "FLAGS")]
        flags: Vec<String>,
    },
    /// build-ptx, then serving throughput under continuous batching (p50/p99 TTFT and inter-token latency, an SVG) and the HBM soak; `cargo xtask serve-bench --help` lists the flags
    #[command(disable_help_flag = true)]
    ServeBench {
        /// Flags for the example (--model DIR, --layers N, --requests N, --max-batch B, --soak-steps N, --svg FILE, …)
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "FLAGS")]
        flags: Vec<String>,
    },
    /// build-ptx, then the criterion benches: `cargo bench -p lab [ARGS]` (BENCH_GROUPS=memory,attention,gemm,decode)
    Bench(Forward),
    /// build-ptx, then `cargo run --release [ARGS]`, e.g. `run --example perf -- --only decode`
    Run(Forward),
    /// build-ptx, then clippy with -D warnings: the workspace with every target, and host without `dev`
    Lint,
    /// build-ptx, then the API docs of host and abi, with rustdoc warnings as errors
    Doc,
    /// Build a self-contained folder (executables, PTX, run script) for a GPU machine without Rust
    Bundle {
        /// Output folder [default: ./bundle in the workspace root]
        dir: Option<PathBuf>,
        /// Also `perf` as built at this revision (`examples/perf_base`), for run.sh's `ab` step
        #[arg(long, value_name = "REV")]
        base: Option<String>,
    },
    /// Write the stand-in libcuda.so used only where no NVIDIA driver exists
    StubLibcuda,
}

/// Arguments handed on to cargo as they are; `--` and what follows reach cargo too.
#[derive(Args)]
struct Forward {
    /// Arguments for cargo
    #[arg(allow_hyphen_values = true)]
    args: Vec<String>,
    /// Arguments after `--`, for the program cargo runs
    #[arg(last = true)]
    after: Vec<String>,
}

impl Forward {
    fn all(&self) -> Vec<String> {
        let mut all = self.args.clone();
        if !self.after.is_empty() {
            all.push("--".into());
            all.extend(self.after.iter().cloned());
        }
        all
    }
}

fn main() -> ExitCode {
    if std::env::var_os(link::LINK_MODE_ENV).is_some() {
        return report(link::run(std::env::args().skip(1).collect()));
    }
    let cli = Cli::parse();
    let v = cli.verbose;
    let host_run = |base: &[&str], extra: &[String]| cargo_with_gpu_env(v, base, extra);
    let result = match cli.command {
        Task::BuildPtx => ptx::build_all(v),
        Task::PtxasCheck => ptxas::check_all(v),
        Task::Sass { kernel, arch } => sass::show(&kernel, &arch),
        Task::Test(f) => host_run(&["test", "--release", "--workspace"], &f.all()),
        Task::Demo => host_run(&["run", "--release", "-p", "host", "--example", "demo"], &[]),
        Task::Layer { flags } => host_run(&["run", "--release", "-p", "host", "--example", "layer", "--"], &flags),
        Task::Generate { flags } => {
            host_run(&["run", "--release", "-p", "host", "--example", "generate", "--"], &flags)
        }
        Task::ServeBench { flags } => {
            host_run(&["run", "--release", "-p", "host", "--example", "serve_bench", "--"], &flags)
        }
        Task::Bench(f) => host_run(&["bench", "-p", "lab"], &f.all()),
        Task::Run(f) => host_run(&["run", "--release"], &f.all()),
        Task::Lint => lint(v),
        Task::Doc => doc(v),
        Task::Bundle { dir, base } => bundle::build(dir, base.as_deref(), v),
        Task::StubLibcuda => stub::ensure_link_env().map(|_| ()),
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

fn cargo() -> std::process::Command {
    std::process::Command::new(std::env::var("CARGO").unwrap_or("cargo".into()))
}

/// Builds the PTX, makes sure `-lcuda` resolves, then runs a host cargo command.
fn cargo_with_gpu_env(verbose: bool, base: &[&str], extra: &[String]) -> Result<()> {
    ptx::build_all(verbose)?;
    let env = stub::ensure_link_env()?;
    let mut cmd = cargo();
    cmd.current_dir(root()).args(base).args(extra);
    env.apply(&mut cmd);
    run_status(&mut cmd)
}

/// Clippy over everything, then host alone: without `dev` (which lab turns on for
/// the whole workspace) the shipped library has its own dead code to find.
fn lint(verbose: bool) -> Result<()> {
    ptx::build_all(verbose)?;
    for packages in [&["--workspace", "--all-targets"][..], &["-p", "host"][..]] {
        run_status(cargo().current_dir(root()).arg("clippy").args(packages).args(["--", "-D", "warnings"]))?;
    }
    Ok(())
}

fn doc(verbose: bool) -> Result<()> {
    ptx::build_all(verbose)?;
    run_status(
        cargo()
            .current_dir(root())
            .args(["doc", "--no-deps", "-p", "host", "-p", "abi"])
            .env("RUSTDOCFLAGS", "-Dwarnings"),
    )
}

pub fn run_status(cmd: &mut std::process::Command) -> Result<()> {
    let program = std::path::Path::new(cmd.get_program());
    let shown = std::iter::once(program.file_name().unwrap_or(program.as_os_str()))
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let status = cmd.status().map_err(|e| format!("cannot start `{shown}`: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{shown}` failed ({status})"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> std::result::Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("cargo xtask").chain(args.iter().copied()))
    }

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn unknown_commands_and_flags_are_errors_naming_them() {
        let err = parse(&["frob"]).err().unwrap().to_string();
        assert!(err.contains("frob"), "{err}");
        let err = parse(&["build-ptx", "--frob"]).err().unwrap().to_string();
        assert!(err.contains("--frob"), "{err}");
    }

    #[test]
    fn layer_flags_and_help_reach_the_example() {
        let Task::Layer { flags } = parse(&["layer", "--steps=10", "--batches", "1"]).unwrap().command else {
            panic!("not layer")
        };
        assert_eq!(flags, ["--steps=10", "--batches", "1"]);
        let Task::Layer { flags } = parse(&["layer", "--help"]).unwrap().command else { panic!("not layer") };
        assert_eq!(flags, ["--help"]);
        assert!(parse(&["layer", "-v"]).unwrap().verbose);
    }

    #[test]
    fn forwarded_args_keep_their_double_dash() {
        for (args, want) in [
            (&["test", "--", "--nocapture"][..], &["--", "--nocapture"][..]),
            (&["test", "softmax", "--", "--nocapture"], &["softmax", "--", "--nocapture"]),
            (&["run", "--example", "perf", "--", "--only", "decode"], &["--example", "perf", "--", "--only", "decode"]),
            (&["bench", "--bench", "kernels"], &["--bench", "kernels"]),
        ] {
            let f = match parse(args).unwrap().command {
                Task::Test(f) | Task::Run(f) | Task::Bench(f) => f,
                _ => panic!("{args:?}"),
            };
            assert_eq!(f.all(), want, "{args:?}");
        }
        let cli = parse(&["test", "-v", "softmax"]).unwrap();
        assert!(cli.verbose);
    }
}
