//! `bundle --base REV`: `perf` as built at another revision, carried in the bundle
//! as `examples/perf_base`, so that one GPU job times a change against what came
//! before it, alternating (`STEPS=ab` in run.sh): machines differ by more than
//! most changes, so figures from two jobs cannot settle them.

use crate::{cargo, root, run_status, stub, Result};
use std::path::Path;
use std::process::Command;

/// Builds `perf` at `rev` (its own kernels and PTX) and copies it to `dest`.
pub fn build_perf(rev: &str, dest: &Path, env: &stub::LinkEnv) -> Result<()> {
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
    let mut perf = cargo();
    perf.current_dir(&src).args(["build", "--release", "-p", "lab", "--example", "perf"]);
    perf.env("CARGO_TARGET_DIR", &target);
    env.apply(&mut perf);
    run_status(&mut perf)?;
    let built = target.join("release/examples/perf");
    std::fs::copy(&built, dest).map_err(|e| format!("{} → {}: {e}", built.display(), dest.display()))?;
    let commit = Command::new("git").current_dir(&src).args(["rev-parse", "--short", "HEAD"]).output();
    let commit = commit.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    let base_file = dest.parent().and_then(Path::parent).map(|b| b.join("BASE"));
    if let Some(f) = base_file {
        std::fs::write(&f, format!("{commit}\n")).map_err(|e| format!("{}: {e}", f.display()))?;
    }
    Ok(())
}
