//! The link step of rustc's `llbc` linker flavor for nvptx64, as the project's own code:
//! llvm-link the bitcode → internalize all but the kernels, O3, globaldce → llc to PTX.

use crate::toolchain::llvm_tool;
use crate::Result;
use std::path::PathBuf;
use std::process::Command;

pub const LINK_MODE_ENV: &str = "XTASK_PTX_LINK";

#[derive(Default, Debug)]
struct LinkArgs {
    exports: Vec<String>,
    inputs: Vec<PathBuf>,
    cpu: Option<String>,
    features: Option<String>,
    output: Option<PathBuf>,
}

fn parse(args: Vec<String>) -> Result<LinkArgs> {
    let mut parsed = LinkArgs::default();
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("linker: {name} needs a value"));
        match arg.as_str() {
            "--export-symbol" => parsed.exports.push(value("--export-symbol")?),
            "-o" => parsed.output = Some(PathBuf::from(value("-o")?)),
            "--target-cpu" => parsed.cpu = Some(value("--target-cpu")?),
            "--target" | "-L" => {
                value(&arg)?;
            }
            s if s.starts_with("--target-feature=") => {
                parsed.features = Some(s["--target-feature=".len()..].to_string())
            }
            s if s.starts_with('-') => {} // -O3, --debug: the optimization level is ours.
            s => parsed.inputs.push(PathBuf::from(s)),
        }
    }
    Ok(parsed)
}

pub fn run(args: Vec<String>) -> Result<()> {
    let a = parse(args)?;
    let out = a.output.clone().ok_or("linker: no -o given")?;
    let linked = out.with_extension("linked.bc");
    let optimized = out.with_extension("opt.bc");
    let symbols = out.with_extension("symbols.txt");
    std::fs::write(&symbols, a.exports.join("\n") + "\n").map_err(|e| e.to_string())?;

    step(Command::new(llvm_tool("llvm-link")?).arg("--ignore-non-bitcode").args(&a.inputs).arg("-o").arg(&linked))?;
    step(
        Command::new(llvm_tool("opt")?)
            .arg(&linked)
            .arg("-o")
            .arg(&optimized)
            .arg(format!("--internalize-public-api-file={}", symbols.display()))
            .arg("--passes=internalize,default<O3>,globaldce")
            .arg("--strip-debug")
            .arg("-unroll-threshold=4000"),
    )?;
    let mut llc = Command::new(llvm_tool("llc")?);
    if let Some(cpu) = &a.cpu {
        llc.arg(format!("-mcpu={cpu}"));
    }
    if let Some(features) = &a.features {
        llc.arg(format!("-mattr={features}"));
    }
    step(llc.arg("-O3").arg(&optimized).arg("-o").arg(&out))?;
    let ptx = std::fs::read_to_string(&out).map_err(|e| e.to_string())?;
    std::fs::write(&out, apply_launch_bounds(&ptx)?).map_err(|e| e.to_string())
}

/// Rust has no `__launch_bounds__`; kernels leave `// xtask:launch_bounds NAME THREADS
/// MIN_BLOCKS PARAMS` lines (the `launch_bounds!` macro) and this adds `.maxntid` (and
/// `.minnctapersm`) to that entry, so ptxas caps registers accordingly. Every entry
/// must have one: the host's typed kernel handles are generated from them.
pub fn apply_launch_bounds(ptx: &str) -> Result<String> {
    let mut out = ptx.to_string();
    let mut declared = Vec::new();
    for line in ptx.lines() {
        let Some(spec) = line.trim().strip_prefix("// xtask:launch_bounds ") else {
            continue;
        };
        let f: Vec<&str> = spec.split_whitespace().collect();
        let [name, threads, min_blocks, _params] = f[..] else {
            return Err(format!("bad launch_bounds line: {line}"));
        };
        declared.push(name.to_string());
        let Some(entry) = out.find(&format!(".entry {name}(")) else {
            continue;
        };
        let body = entry + out[entry..].find("\n{").ok_or(format!("no body for {name}"))?;
        let mut directive = format!("\n.maxntid {threads}, 1, 1");
        if min_blocks != "0" {
            directive += &format!("\n.minnctapersm {min_blocks}");
        }
        out.insert_str(body, &directive);
    }
    let undeclared: Vec<&str> = ptx
        .lines()
        .filter_map(|l| l.split(".entry ").nth(1))
        .filter_map(|rest| rest.split('(').next())
        .filter(|name| !declared.iter().any(|d| d == name))
        .collect();
    if !undeclared.is_empty() {
        return Err(format!("entries without a launch_bounds! declaration: {}", undeclared.join(", ")));
    }
    Ok(out)
}

fn step(cmd: &mut Command) -> Result<()> {
    let output = cmd.output().map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if output.status.success() {
        return Ok(());
    }
    Err(format!(
        "{:?} failed ({})\n{}{}",
        cmd.get_program(),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_arguments_rustc_passes() {
        let args: Vec<String> =
            "--export-symbol k1 --export-symbol k2 a.rcgu.o libcore.rlib -L /x --target nvptx64-nvidia-cuda \
             --target-cpu sm_90a --target-feature=+ptx32,+ptx80 -L /y -o out.ptx -O3 --debug"
                .split_whitespace()
                .map(String::from)
                .collect();
        let a = parse(args).unwrap();
        assert_eq!(a.exports, vec!["k1", "k2"]);
        assert_eq!(a.inputs, vec![PathBuf::from("a.rcgu.o"), PathBuf::from("libcore.rlib")]);
        assert_eq!(a.cpu.as_deref(), Some("sm_90a"));
        assert_eq!(a.features.as_deref(), Some("+ptx32,+ptx80"));
        assert_eq!(a.output, Some(PathBuf::from("out.ptx")));
    }

    #[test]
    fn launch_bounds_become_maxntid_on_their_entry() {
        let ptx = "// xtask:launch_bounds k2 256 2 A\n// xtask:launch_bounds k1 128 0 A\n.visible .entry k1(\n.param .u64 a\n)\n{\nret;\n}\n\
                   .visible .entry k2(\n.param .u64 a\n)\n{\nret;\n}\n";
        let out = apply_launch_bounds(ptx).unwrap();
        assert!(out.contains(".entry k2(\n.param .u64 a\n)\n.maxntid 256, 1, 1\n.minnctapersm 2\n{"), "{out}");
        assert!(out.contains(".entry k1(\n.param .u64 a\n)\n.maxntid 128, 1, 1\n{"), "{out}");
        assert!(apply_launch_bounds("// xtask:launch_bounds k2 256 0\n").is_err());
        assert!(apply_launch_bounds(".visible .entry k3(\n)\n{\nret;\n}\n").is_err());
    }
}
