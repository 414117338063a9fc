//! Starts a program's tensor-parallel ranks, one process per GPU
//! (`host::tp::launch`): `tp_launch --ranks 2 -- PROGRAM ARGS…`. Each rank sees
//! only its GPU, learns its rank from `host::tp::launch::RankEnv::from_env`,
//! and runs with NVLink multicast off. If one fails, the others are stopped and
//! the exit status says so.

use clap::Parser;
use host::tp::launch::Launch;
use std::ffi::OsString;
use std::process::ExitCode;

/// One process per GPU for a tensor-parallel program.
#[derive(Parser)]
#[command(name = "tp_launch")]
struct Args {
    /// How many ranks (processes, GPUs)
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// The GPUs of ranks 0, 1, … (default: 0 to ranks − 1)
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// The program each rank runs, then its arguments
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "PROGRAM")]
    command: Vec<OsString>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut launch = Launch::new(&args.command[0], &args.command[1..], args.ranks);
    if let Some(devices) = args.devices {
        if devices.len() != args.ranks {
            eprintln!("tp_launch: --devices names {} GPUs for {} ranks", devices.len(), args.ranks);
            return ExitCode::FAILURE;
        }
        launch.devices = devices;
    }
    match launch.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tp_launch: {e}");
            ExitCode::FAILURE
        }
    }
}
