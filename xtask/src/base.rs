//! `bundle --base REV`: `perf` and `serve_bench` as built at another revision,
//! carried in the bundle as `examples/perf_base` and `examples/serve_bench_base`,
//! so that one GPU job times a change against what came before it, alternating
//! (`STEPS=ab` in run.sh, `MODEL_STEPS=serve-ab` in model.sh): machines differ
//! by more than most changes, so figures from two jobs cannot settle them.

use crate::{cargo, root, run_status, stub, Result};
use std::path::Path;
use std::process::Command;

/// Builds the examples `perf` and `serve_bench` at `rev` (its own kernels and
/// PTX) and copies them into `examples` as `perf_base` and `serve_bench_base`.
pub fn build_examples(rev: &str, examples: &Path, env: &stub::LinkEnv) -> Result<()> {
    let src = root().join("target/base-src");
    let git = |args: &[&str], dir: &Path| run_status(Command::new("git").current_dir(dir).args(args));
    // One detached worktree, moved to `rev` on later calls.
    if src.join(".git").exists() {
        git(&["checkout", "--quiet", "--force", "--detach", rev], &src)?;
    } else {
        let path = src.to_string_lossy().into_owned();
        git(&["worktree", "add", "--force", "--detach", &path, rev], &root())?;
    }
    // Its own xtask builds its own PTX (into its target/ptx); dependencies
    // compile once into a target folder of their own, kept between calls.
    let target = root().join("target/base-build");
    let mut ptx = cargo();
    ptx.current_dir(&src).args(["run", "--quiet", "--release", "-p", "xtask", "--", "build-ptx"]);
    ptx.env("CARGO_TARGET_DIR", &target);
    run_status(&mut ptx)?;
    for (package, name) in [("lab", "perf"), ("host", "serve_bench")] {
        let mut build = cargo();
        build.current_dir(&src).args(["build", "--release", "-p", package, "--example", name]);
        build.env("CARGO_TARGET_DIR", &target);
        env.apply(&mut build);
        run_status(&mut build)?;
        let built = target.join("release/examples").join(name);
        let dest = examples.join(format!("{name}_base"));
        std::fs::copy(&built, &dest).map_err(|e| format!("{} → {}: {e}", built.display(), dest.display()))?;
    }
    let commit = Command::new("git").current_dir(&src).args(["rev-parse", "--short", "HEAD"]).output();
    let commit = commit.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    if let Some(f) = examples.parent().map(|b| b.join("BASE")) {
        std::fs::write(&f, format!("{commit}\n")).map_err(|e| format!("{}: {e}", f.display()))?;
    }
    Ok(())
}
