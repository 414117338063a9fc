//! Embeds the PTX built by `cargo xtask build-ptx` and the cubins its ptxas gate
//! assembles from it, and refuses PTX that is older than the kernel sources: a
//! stale kernel can never be loaded silently. A refusal is one `cargo::error`
//! line naming the command to run, not a panic's report.

use std::path::{Path, PathBuf};

include!("../xtask/src/fingerprint.rs");

const ARCHES: [&str; 2] = ["sm_90a", "sm_80"];

fn main() {
    if let Err(message) = embed() {
        println!("cargo::error={message}");
    }
}

fn embed() -> Result<(), String> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().unwrap();
    let ptx_dir = root.join("target/ptx");
    for watched in ["kernels/src", "kernels/Cargo.toml", "abi/src", "target/ptx/fingerprint"] {
        println!("cargo:rerun-if-changed={}", root.join(watched).display());
    }
    let want = kernels_fingerprint(&root.join("kernels")).map_err(|e| format!("reading kernels/ sources: {e}"))?;
    let have = std::fs::read_to_string(ptx_dir.join("fingerprint")).unwrap_or_default();
    let dev = std::env::var_os("CARGO_FEATURE_DEV").is_some();
    let stems: Vec<String> =
        ARCHES.iter().flat_map(|a| [a.to_string()].into_iter().chain(dev.then(|| format!("{a}-dev")))).collect();
    let files: Vec<String> = stems.iter().flat_map(|s| [format!("{s}.ptx"), format!("{s}.cubin")]).collect();
    if let Some(first) = files.iter().find(|f| !ptx_dir.join(f).exists()) {
        return Err(format!("target/ptx/{first} is missing: run `cargo xtask build-ptx`"));
    }
    if have.trim() != format!("{want:016x}") {
        return Err("target/ptx is older than kernels/ or abi/: run `cargo xtask build-ptx`".into());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    for file in &files {
        copy(&ptx_dir.join(file), &out.join(file))?;
    }
    generate(&ptx_dir, &out, dev)
}

/// Writes `kernels.rs`: one typed handle per `launch_bounds!` declaration in the
/// PTX (shipped modules at the top level, dev-only entries in `dev`).
fn generate(ptx_dir: &Path, out: &Path, dev: bool) -> Result<(), String> {
    let read = |stem: &str| std::fs::read_to_string(ptx_dir.join(format!("{stem}.ptx"))).unwrap_or_default();
    let shipped = declarations(ARCHES.iter().map(|a| read(a)));
    let mut code = handles(&shipped, false);
    code += "\n/// Every shipped entry: name, launch bound, size of its parameter block.\n";
    code += &table("SHIPPED", &shipped);
    if dev {
        let dev_only: Vec<Decl> = declarations(ARCHES.iter().map(|a| read(&format!("{a}-dev"))))
            .into_iter()
            .filter(|d| !shipped.iter().any(|s| s.name == d.name))
            .collect();
        code += "\n/// The versions kept for comparison (the `<arch>-dev.ptx` modules).\npub mod dev {\n";
        code += "    #[allow(unused_imports)]\n    use super::{Kernel, KernelInfo};\n";
        code += &handles(&dev_only, true);
        code += "\n/// Every dev-only entry: name, launch bound, size of its parameter block.\n";
        code += &table("ALL", &dev_only);
        code += "}\n";
    }
    std::fs::write(out.join("kernels.rs"), code).map_err(|e| format!("writing kernels.rs: {e}"))
}

/// One `launch_bounds!` declaration: entry name, launch bound, `abi` parameter struct.
struct Decl {
    name: String,
    threads: String,
    params: String,
}

/// The declarations in the PTX modules, each entry once, in order of appearance.
fn declarations(modules: impl Iterator<Item = String>) -> Vec<Decl> {
    let mut all: Vec<Decl> = Vec::new();
    for ptx in modules {
        for line in ptx.lines() {
            let Some(spec) = line.trim().strip_prefix("// xtask:launch_bounds ") else { continue };
            let f: Vec<&str> = spec.split_whitespace().collect();
            let [name, threads, _min_blocks, params] = f[..] else { panic!("bad launch_bounds line: {line}") };
            if !all.iter().any(|d| d.name == name) {
                all.push(Decl { name: name.into(), threads: threads.into(), params: params.into() });
            }
        }
    }
    all
}

fn handles(decls: &[Decl], dev: bool) -> String {
    let new = if dev { "new_dev" } else { "new" };
    decls
        .iter()
        .map(|d| {
            format!(
                "/// `{}`: `abi::{}`, at most {} threads per block.\npub const {}: Kernel<abi::{}> = Kernel::{new}(\"{}\", {});\n",
                d.name,
                d.params,
                d.threads,
                d.name.to_uppercase(),
                d.params,
                d.name,
                d.threads
            )
        })
        .collect()
}

fn table(name: &str, decls: &[Decl]) -> String {
    let rows: String = decls.iter().map(|d| format!("    {}.info(),\n", d.name.to_uppercase())).collect();
    format!("pub const {name}: &[KernelInfo] = &[\n{rows}];\n")
}

fn copy(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::copy(from, to).map(|_| ()).map_err(|e| format!("copy {}: {e}", from.display()))
}
