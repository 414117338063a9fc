//! One kernel's SASS without a GPU: ptxas assembles the built module that holds
//! it, and nvdisasm (PyPI's `nvidia-cuda-nvdisasm`) disassembles the cubin.

use crate::modules::{self, Module};
use crate::{toolchain, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const NVDISASM_WHEEL: &str = "nvidia-cuda-nvdisasm==13.5.37";

/// Writes `kernel`'s SASS to target/sass/<kernel>.sass and prints its path and
/// the function's instruction count by opcode (predicates dropped).
pub fn show(kernel: &str, arch: &str) -> Result<()> {
    let module = modules::all()
        .filter(|m| m.arch == arch)
        .find(|m| holds(*m, kernel))
        .ok_or_else(|| format!("no {arch} module holds the entry {kernel}: run `cargo xtask build-ptx`"))?;
    let dir = crate::root().join("target").join("sass");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // The gate's assembly: its cubin, assembled again only where older than the PTX.
    crate::ptxas::assemble(&toolchain::ptxas()?, module)?;
    let cubin = module.cubin();
    let out = Command::new(nvdisasm()?)
        .args(["-c", "-sf"])
        .arg(&cubin)
        .output()
        .map_err(|e| format!("cannot run nvdisasm: {e}"))?;
    if !out.status.success() {
        return Err(format!("nvdisasm failed on {}: {}", cubin.display(), String::from_utf8_lossy(&out.stderr)));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let function = function_text(&text, kernel).ok_or_else(|| format!("{kernel} not in {}", cubin.display()))?;
    let path = dir.join(format!("{kernel}.sass"));
    std::fs::write(&path, &function).map_err(|e| format!("{}: {e}", path.display()))?;
    let counts = opcodes(&function);
    let total: usize = counts.values().sum();
    let mut by_count: Vec<_> = counts.into_iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    println!("{} ({total} instructions)", path.display());
    for (op, n) in by_count {
        println!("{n:6}  {op}");
    }
    Ok(())
}

fn holds(m: Module, kernel: &str) -> bool {
    std::fs::read_to_string(m.ptx()).map(|t| t.contains(&format!(".entry {kernel}("))).unwrap_or(false)
}

/// The lines of `kernel`'s text section in nvdisasm's output.
fn function_text(sass: &str, kernel: &str) -> Option<String> {
    let start = format!(".text.{kernel}:");
    let mut lines = sass.lines().skip_while(|l| *l != start);
    let first = lines.next()?;
    let rest = lines.take_while(|l| !l.starts_with("//--") && !l.starts_with(".text."));
    Some(std::iter::once(first).chain(rest).map(|l| format!("{l}\n")).collect())
}

/// Instructions by opcode (with its modifiers), guard predicates dropped.
fn opcodes(function: &str) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for line in function.lines() {
        let Some(body) = line.trim_start().strip_prefix("/*").and_then(|l| l.split_once("*/")).map(|(_, b)| b) else {
            continue;
        };
        let mut words = body.split_whitespace().skip_while(|w| w.starts_with('@'));
        if let Some(op) = words.next() {
            *counts.entry(op.trim_end_matches(';').to_string()).or_insert(0) += 1;
        }
    }
    counts
}

/// $NVDISASM, the PyPI wheel's, PATH's; else installs the wheel.
fn nvdisasm() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("NVDISASM") {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = toolchain::from_wheel("nvdisasm").or_else(|| on_path("nvdisasm")) {
        return Ok(p);
    }
    eprintln!("xtask: installing nvdisasm from PyPI: python3 -m pip install {NVDISASM_WHEEL}");
    let ok = Command::new("python3").args(["-m", "pip", "install", "-q", NVDISASM_WHEEL]).status();
    match (ok.map(|s| s.success()).unwrap_or(false), toolchain::from_wheel("nvdisasm")) {
        (true, Some(p)) => Ok(p),
        _ => Err(format!("nvdisasm not found; run: python3 -m pip install {NVDISASM_WHEEL}")),
    }
}

fn on_path(tool: &str) -> Option<PathBuf> {
    let out = Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().ok()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!p.is_empty() && Path::new(&p).exists()).then(|| PathBuf::from(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SASS: &str = "\
.text.other:
        /*0000*/                   EXIT ;
//--------------------- .text.k --------------------------
.text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_1) ;
.L_x_1:
        /*0020*/              @!P1 MUFU.EX2 R2, R2 ;
        /*0030*/                   MUFU.EX2 R3, R3 ;
        /*0040*/                   EXIT ;
//--------------------- .text.z --------------------------
";

    #[test]
    fn a_function_is_its_section_and_counts_by_opcode() {
        let f = function_text(SASS, "k").unwrap();
        assert!(f.starts_with(".text.k:") && !f.contains("text.z") && !f.contains("EXIT ;\n//"));
        let c = opcodes(&f);
        assert_eq!(c["MUFU.EX2"], 2);
        assert_eq!((c["MOV"], c["BRA"], c["EXIT"], c.len()), (1, 1, 1, 4));
        assert!(function_text(SASS, "missing").is_none());
    }
}
