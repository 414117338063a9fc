//! `cargo xtask bundle`: a folder that runs on a GPU machine with no Rust toolchain:
//! test, bench and example executables, the PTX with its ptxas report, and run.sh.

use crate::{base, modules, ptx, root, stub, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn build(out: Option<PathBuf>, base_rev: Option<&str>, verbose: bool) -> Result<()> {
    let out = out.unwrap_or_else(|| root().join("bundle"));
    ptx::build_all(verbose)?;
    let env = stub::ensure_link_env()?;
    let _ = std::fs::remove_dir_all(&out);
    for dir in ["tests", "benches", "examples", "ptx"] {
        std::fs::create_dir_all(out.join(dir)).map_err(|e| e.to_string())?;
    }
    let mut copied = 0;
    // Tests and benches are built in test mode; examples as the programs they are.
    for args in [&["test", "--no-run", "--tests", "--benches"][..], &["build", "--examples"][..]] {
        copied += build_and_copy(&env, args, &out)?;
    }
    if let Some(rev) = base_rev {
        base::build_examples(rev, &out.join("examples"), &env)?;
    }
    for module in modules::all() {
        for f in [module.ptx(), module.ptxas_report()] {
            copy(&f, &out.join("ptx").join(f.file_name().unwrap()))?;
        }
    }
    // Figures are recorded against a commit: say which one (and whether the tree
    // had uncommitted changes) next to the executables.
    let git = |args: &[&str]| {
        Command::new("git")
            .current_dir(root())
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_default();
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"]).unwrap_or_default().is_empty();
    std::fs::write(out.join("COMMIT"), format!("{commit}{}\n", if dirty { "-dirty" } else { "" }))
        .map_err(|e| e.to_string())?;
    copy(&root().join("scripts/gpu-run.sh"), &out.join("run.sh"))?;
    copy(&root().join("scripts/model-run.sh"), &out.join("model.sh"))?;
    copy(&root().join("scripts/pack_out.sh"), &out.join("pack_out.sh"))?;
    copy(&root().join("scripts/compare.py"), &out.join("compare.py"))?;
    copy(&root().join("scripts/torch_gqa_backends.py"), &out.join("torch_gqa_backends.py"))?;
    copy(&root().join("scripts/profile_summary.py"), &out.join("profile_summary.py"))?;
    copy(&root().join("scripts/graph_nodes.py"), &out.join("graph_nodes.py"))?;
    copy(&root().join("scripts/repeats.py"), &out.join("repeats.py"))?;
    copy(&root().join("scripts/ab_summary.py"), &out.join("ab_summary.py"))?;
    copy(&root().join("scripts/torch_copy_sizes.py"), &out.join("torch_copy_sizes.py"))?;
    copy(&root().join("scripts/model_reference.py"), &out.join("model_reference.py"))?;
    let decode_ref = root().join("../shared/bench/torch_model_decode.py");
    if decode_ref.exists() {
        copy(&decode_ref, &out.join("torch_model_decode.py"))?;
    }
    let torch_ref = root().join("../shared/bench/torch_reference.py");
    if torch_ref.exists() {
        copy(&torch_ref, &out.join("torch_reference.py"))?;
    } else {
        eprintln!("xtask: warning: {} not found; run.sh will skip the PyTorch side", torch_ref.display());
    }
    // Every executable embeds the PTX of both arches, so the folder is large; the
    // archive is what travels to the GPU machine. A 128 MiB window spans several
    // executables, so each copy of the PTX after the first costs next to nothing
    // (712 MB of executables: 11.9 MB, against 58.1 MB with xz -6's 8 MiB window
    // in blocks of 24 MiB); blocks of 384 MiB still give two threads work.
    let name = out.file_name().and_then(|n| n.to_str()).unwrap_or("bundle").to_string();
    let archive = out.with_file_name(format!("{name}.tar.xz"));
    let parent = out.parent().unwrap_or(Path::new("."));
    let file = std::fs::File::create(&archive).map_err(|e| format!("{}: {e}", archive.display()))?;
    let mut xz = Command::new("xz")
        .args(["-T0", "--block-size=384MiB", "--lzma2=preset=6,dict=128MiB", "-c"])
        .stdin(std::process::Stdio::piped())
        .stdout(file)
        .spawn()
        .map_err(|e| format!("xz: {e} (apt-get install xz-utils)"))?;
    let tar = Command::new("tar")
        .current_dir(parent)
        .arg("cf")
        .arg("-")
        .arg(&name)
        .stdout(xz.stdin.take().expect("piped"))
        .status()
        .map_err(|e| format!("tar: {e}"))?;
    let xz_ok = xz.wait().map_err(|e| format!("xz: {e}"))?.success();
    if !tar.success() || !xz_ok {
        return Err("tar | xz failed".into());
    }
    eprintln!("xtask: bundle with {copied} executables in {}", out.display());
    eprintln!("xtask: on the GPU machine: tar xJf {name}.tar.xz && bash {name}/run.sh");
    Ok(())
}

/// Runs `cargo <args> --release -p host -p lab` and copies every executable it reports.
fn build_and_copy(env: &stub::LinkEnv, args: &[&str], out: &Path) -> Result<usize> {
    let cargo = std::env::var("CARGO").unwrap_or("cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(root()).args(args).args([
        "--release",
        "-p",
        "host",
        "-p",
        "lab",
        "--message-format=json-render-diagnostics",
    ]);
    env.apply(&mut cmd);
    let output = cmd.output().map_err(|e| format!("cargo: {e}"))?;
    if !output.status.success() {
        return Err(format!("cargo {} failed:\n{}", args.join(" "), String::from_utf8_lossy(&output.stderr)));
    }
    let mut copied = 0;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Some(exe) = json_str(line, "\"executable\":\"") else {
            continue;
        };
        let kind = json_str(line, "\"kind\":[\"").unwrap_or_default();
        let name = json_str(line, "\"name\":\"").unwrap_or_default();
        let dir = match kind.as_str() {
            "bench" => "benches",
            "example" => "examples",
            _ => "tests",
        };
        copy(Path::new(&exe), &out.join(dir).join(&name))?;
        copied += 1;
    }
    Ok(copied)
}

/// The string value after `key` in one line of cargo's JSON (no escapes in our paths).
fn json_str(line: &str, key: &str) -> Option<String> {
    let rest = line.split(key).nth(1)?;
    Some(rest.split('"').next()?.to_string())
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to).map(|_| ()).map_err(|e| format!("copy {} → {}: {e}", from.display(), to.display()))
}
