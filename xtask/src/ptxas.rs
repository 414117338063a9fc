//! Offline assembly of every PTX module with ptxas, the per-kernel resource table,
//! and the spill gate. No kernel of a shipped module (`<arch>.ptx`) may spill or
//! have a stack frame, with no allowance. In a dev module (`<arch>-dev.ptx`) a
//! kernel may, if `ALLOWED` lists it with a reason. No kernel of any module may
//! have its `wgmma`s serialized by ptxas (C7518: it found a register of one in
//! flight touched where it could not wait for it, and gave up the overlap), or
//! its `setmaxnreg` ignored (C7508: the consumers would keep the launch's share).

use crate::modules::{self, Module};
use crate::{toolchain, Result};
use std::collections::BTreeSet;
use std::process::Command;

/// (kernel name, reason); dev modules only. Versions kept for comparison may spill:
/// `FlashVersion::Auto` takes Hopper on sm_90a and the spill-free V2Bn32/V2Bn16
/// elsewhere. Their figures in docs/PERF.md include the spills.
const ALLOWED: &[(&str, &str)] = &[
    ("flash_fwd_v2_hd128", "FlashVersion::V2 at hd128: O + S in registers exceed 255"),
    ("flash_fwd_v2_hd128_bn32", "FlashVersion::V2Bn32 at hd128: spills"),
    ("flash_fwd_hd128", "FlashVersion::V1 at hd128: Q fragments + O + S exceed 255"),
    ("persistent_decode_b1", "dev persistent decode step: spills at 255 registers (one kernel holds every stage)"),
    (
        "flash_fwd_hopper_n128_counter_hd256",
        "FlashVersion::HopperN128Counter: the counter walk's producer at 24 registers (once a query tile, outside the key loop)",
    ),
    (
        "flash_fwd_hopper_turns_hd256",
        "FlashVersion::HopperTurns at hd256, one tile per block: its producer at 24 registers (beside its loads, not the consumers')",
    ),
    (
        "flash_fwd_hopper_late_pv_turns_walk_hd256",
        "FlashVersion::HopperLatePvTurns at hd256, strided walk: once a query tile, none in the key loop",
    ),
];

#[derive(Debug, Default, Clone)]
pub struct KernelReport {
    pub name: String,
    pub registers: u32,
    pub smem: u32,
    pub stack: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    /// ptxas serialized this kernel's `wgmma.mma_async` instructions (C7518) or
    /// ignored its `setmaxnreg` (C7508).
    pub wgmma_serialized: bool,
}

impl KernelReport {
    /// Spill traffic or a stack frame (a call into a `.func` shows as the latter).
    pub fn spills(&self) -> bool {
        self.stack > 0 || self.spill_stores > 0 || self.spill_loads > 0
    }
}

/// Parses `ptxas -v` output into one report per entry function. Properties of
/// non-entry functions (`.func`s the entries call) are attributed to nobody here;
/// a call into one shows up as the entry's own stack frame.
pub fn parse(verbose: &str) -> Vec<KernelReport> {
    let mut out: Vec<KernelReport> = Vec::new();
    let mut props_for = String::new();
    for line in verbose.lines() {
        if line.contains("wgmma.mma_async instructions are serialized") || line.contains("'setmaxnreg' ignored") {
            // C7518 names its function; C7508 comes while its entry compiles.
            let named = line.split("function '").nth(1).and_then(|r| r.split('\'').next());
            let k = match named {
                Some(name) => out.iter_mut().rev().find(|k| k.name == name),
                None => out.last_mut(),
            };
            if let Some(k) = k {
                k.wgmma_serialized = true;
            }
        } else if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(KernelReport { name, ..Default::default() });
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            props_for = rest.trim().to_string();
        } else if let Some(k) = out.last_mut() {
            if line.contains("bytes stack frame") && props_for == k.name {
                k.stack = number_before(line, "bytes stack frame");
                k.spill_stores = number_before(line, "bytes spill stores");
                k.spill_loads = number_before(line, "bytes spill loads");
            } else if line.contains("Used") && line.contains("registers") {
                k.registers = number_before(line, "registers");
                k.smem = number_before(line, "bytes smem");
            }
        }
    }
    out
}

fn number_before(line: &str, unit: &str) -> u32 {
    line.split(unit)
        .next()
        .filter(|head| head.len() < line.len())
        .and_then(|head| head.split_whitespace().last())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// What the gate says of one kernel in one module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Clean,
    /// Spills in a dev module, with a reason in `ALLOWED`.
    Allowed,
    Fails,
}

/// The allowance lists the gate applies.
pub struct Gate<'a> {
    /// (kernel, reason), dev modules only.
    pub allowed: &'a [(&'a str, &'a str)],
}

impl Gate<'static> {
    pub const PROJECT: Gate<'static> = Gate { allowed: ALLOWED };
}

impl Gate<'_> {
    pub fn judge(&self, module: Module, k: &KernelReport) -> Verdict {
        if k.wgmma_serialized {
            Verdict::Fails
        } else if !k.spills() {
            Verdict::Clean
        } else if module.dev && self.allowed.iter().any(|(name, _)| *name == k.name) {
            Verdict::Allowed
        } else {
            Verdict::Fails
        }
    }

    fn reason(&self, name: &str) -> &str {
        self.allowed.iter().find(|(n, _)| *n == name).map_or("", |(_, reason)| reason)
    }

    /// Judges every kernel; the rows to print are every row when `verbose`, and
    /// otherwise the failing ones only.
    pub fn evaluate(&self, reports: &[(Module, Vec<KernelReport>)], verbose: bool) -> Outcome {
        let mut out = Outcome::default();
        let mut names = BTreeSet::new();
        let (mut shipped_spills, mut allowed, mut max_regs) = (0, 0, 0);
        let spilling = |dev: bool| -> BTreeSet<&str> {
            let mut set = BTreeSet::new();
            for (m, kernels) in reports.iter().filter(|(m, _)| m.dev == dev) {
                set.extend(kernels.iter().filter(|k| self.judge(*m, k) != Verdict::Clean).map(|k| k.name.as_str()));
            }
            set
        };
        let spilling_dev = spilling(true);
        for (module, kernels) in reports {
            for k in kernels {
                names.insert(k.name.as_str());
                max_regs = max_regs.max(k.registers);
                let verdict = self.judge(*module, k);
                let note = match verdict {
                    Verdict::Clean => String::new(),
                    Verdict::Allowed => format!("allowed: {}", self.reason(&k.name)),
                    Verdict::Fails if k.wgmma_serialized => {
                        "FAIL: ptxas serialized its wgmma (C7518) or ignored its setmaxnreg (C7508)".to_string()
                    }
                    Verdict::Fails => "FAIL: spills or has a stack frame".to_string(),
                };
                match verdict {
                    Verdict::Clean => {}
                    Verdict::Allowed => allowed += 1,
                    Verdict::Fails => {
                        out.failures.push(format!("{} {}", module.stem(), k.name));
                        if !module.dev && k.spills() {
                            shipped_spills += 1;
                        }
                    }
                }
                if verbose || verdict == Verdict::Fails {
                    out.rows.push(row(*module, k, &note));
                }
            }
        }
        for (name, _) in self.allowed {
            if !spilling_dev.contains(name) {
                out.warnings.push(format!("`ALLOWED` lists {name}, which no dev module has spilling: remove it"));
            }
        }
        out.summary = format!(
            "ptxas: {} modules, {} kernels, {shipped_spills} spills in shipped modules, \
             {allowed} allowed in dev modules, max {max_regs} regs",
            reports.len(),
            names.len(),
        );
        out
    }
}

/// The gate's findings over all modules.
#[derive(Debug, Default)]
pub struct Outcome {
    /// One line for every build.
    pub summary: String,
    /// Table rows to print under `TABLE_HEADER`.
    pub rows: Vec<String>,
    pub warnings: Vec<String>,
    /// `<module> <kernel>` of each kernel that fails the gate.
    pub failures: Vec<String>,
}

const TABLE_HEADER: &str = "module      regs   smem  stack  spill(st/ld)  kernel";

fn row(module: Module, k: &KernelReport, note: &str) -> String {
    let line = format!(
        "{:11} {:4} {:6} {:6} {:6}/{:<6}  {}",
        module.stem(),
        k.registers,
        k.smem,
        k.stack,
        k.spill_stores,
        k.spill_loads,
        k.name
    );
    if note.is_empty() {
        line
    } else {
        format!("{line}  [{note}]")
    }
}

/// Assembles every module (or reads the report saved for an unchanged one), prints
/// the summary line, the rows that matter (all of them when `verbose`), and fails
/// if any kernel fails the gate.
pub fn check_all(verbose: bool) -> Result<()> {
    let ptxas = toolchain::ptxas()?;
    let reports = modules::all().map(|m| Ok((m, parse(&assemble(&ptxas, m)?)))).collect::<Result<Vec<_>>>()?;
    let outcome = Gate::PROJECT.evaluate(&reports, verbose);
    if !outcome.rows.is_empty() {
        eprintln!("{TABLE_HEADER}");
        for r in &outcome.rows {
            eprintln!("{r}");
        }
    }
    for w in &outcome.warnings {
        eprintln!("ptxas: warning: {w}");
    }
    eprintln!("{}", outcome.summary);
    if outcome.failures.is_empty() {
        Ok(())
    } else {
        Err(format!("{} kernels spill or have a stack frame: {}", outcome.failures.len(), outcome.failures.join(", ")))
    }
}

/// `ptxas -v` output for one module, which it assembles into the module's cubin;
/// the saved report when it and the cubin are newer than the PTX.
pub fn assemble(ptxas: &std::path::Path, m: Module) -> Result<String> {
    let (cache, ptx, cubin) = (m.ptxas_report(), m.ptx(), m.cubin());
    let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let fresh = match (modified(&cache), modified(&cubin), modified(&ptx)) {
        (Some(c), Some(b), Some(p)) => c >= p && b >= p,
        _ => false,
    };
    if fresh {
        return std::fs::read_to_string(&cache).map_err(|e| format!("{}: {e}", cache.display()));
    }
    let out = Command::new(ptxas)
        .arg(format!("-arch={}", m.arch))
        .args(["-v", "-O3", "-o"])
        .arg(&cubin)
        .arg(&ptx)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("ptxas rejected {}:\n{text}", ptx.display()));
    }
    std::fs::write(&cache, &text).map_err(|e| format!("{}: {e}", cache.display()))?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_verbose_output() {
        let text = "ptxas info    : Compiling entry function 'softmax_f32' for 'sm_90a'\n\
ptxas info    : Function properties for softmax_f32\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 40 registers, used 1 barriers, 128 bytes smem, 380 bytes cmem[0]\n";
        let r = &parse(text)[0];
        assert_eq!(r.name, "softmax_f32");
        assert_eq!((r.registers, r.smem, r.stack, r.spill_stores, r.spill_loads), (40, 128, 8, 4, 12));
    }

    #[test]
    fn properties_of_called_functions_do_not_mask_the_entry() {
        let text = "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n\
ptxas info    : Function properties for k\n\
    296 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 203 registers, used 1 barriers, 296 bytes cumulative stack size\n\
ptxas info    : Function properties for helper_closure\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n";
        assert_eq!(parse(text)[0].stack, 296);
    }

    fn kernel(name: &str, registers: u32, spill: u32, stack: u32) -> KernelReport {
        KernelReport {
            name: name.into(),
            registers,
            stack,
            spill_stores: spill,
            spill_loads: spill,
            ..Default::default()
        }
    }

    const SHIPPED: Module = Module { arch: "sm_90a", dev: false };
    const DEV: Module = Module { arch: "sm_90a", dev: true };
    const GATE: Gate = Gate { allowed: &[("slow", "kept for comparison")] };

    #[test]
    fn shipped_modules_allow_nothing_that_spills() {
        assert_eq!(GATE.judge(SHIPPED, &kernel("fast", 80, 0, 0)), Verdict::Clean);
        // The dev allowance does not reach the shipped module.
        assert_eq!(GATE.judge(SHIPPED, &kernel("slow", 255, 8, 8)), Verdict::Fails);
        // A stack frame alone fails too.
        assert_eq!(GATE.judge(SHIPPED, &kernel("fast", 80, 0, 16)), Verdict::Fails);
    }

    #[test]
    fn serialized_wgmma_fails_in_every_module() {
        let log = "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n\
                   ptxas info    : Function properties for k\n    \
                   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 168 registers, used 1 barriers\n\
                   ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are \
                   serialized due to program dependence on compiler-inserted WG.DP in divergent path in \
                   the function 'k'\n";
        let reports = parse(log);
        assert_eq!(reports.len(), 1);
        assert!(reports[0].wgmma_serialized && !reports[0].spills());
        assert_eq!(GATE.judge(DEV, &reports[0]), Verdict::Fails);
        assert_eq!(GATE.judge(SHIPPED, &reports[0]), Verdict::Fails);
        let outcome = GATE.evaluate(&[(SHIPPED, reports)], false);
        assert!(outcome.rows[0].contains("C7518") && outcome.summary.contains("0 spills"));
        let ignored = "ptxas info    : Compiling entry function 'a' for 'sm_90a'\n\
                       ptxas info    : Compiling entry function 'b' for 'sm_90a'\n\
                       ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to \
                       determine register count at entry.\n";
        let reports = parse(ignored);
        assert!(!reports[0].wgmma_serialized && reports[1].wgmma_serialized);
    }

    #[test]
    fn dev_modules_allow_the_listed_kernels_only() {
        assert_eq!(GATE.judge(DEV, &kernel("slow", 255, 8, 8)), Verdict::Allowed);
        assert_eq!(GATE.judge(DEV, &kernel("other", 255, 8, 8)), Verdict::Fails);
    }

    #[test]
    fn project_list_never_allows_a_shipped_spill() {
        for (name, reason) in ALLOWED {
            assert!(!reason.is_empty(), "{name} needs a reason");
            assert_eq!(Gate::PROJECT.judge(SHIPPED, &kernel(name, 255, 8, 8)), Verdict::Fails);
        }
    }

    #[test]
    fn quiet_run_prints_one_line_and_failures_print_their_rows() {
        let clean = vec![
            (SHIPPED, vec![kernel("fast", 80, 0, 0), kernel("moving", 200, 0, 0)]),
            (DEV, vec![kernel("fast", 80, 0, 0), kernel("slow", 255, 4, 0), kernel("moving", 200, 0, 0)]),
        ];
        let quiet = GATE.evaluate(&clean, false);
        assert!(quiet.rows.is_empty() && quiet.failures.is_empty() && quiet.warnings.is_empty());
        assert_eq!(
            quiet.summary,
            "ptxas: 2 modules, 3 kernels, 0 spills in shipped modules, \
             1 allowed in dev modules, max 255 regs"
        );
        assert_eq!(GATE.evaluate(&clean, true).rows.len(), 5);

        let bad = vec![(SHIPPED, vec![kernel("fast", 80, 0, 0), kernel("slow", 255, 4, 0)]), (DEV, vec![])];
        let outcome = GATE.evaluate(&bad, false);
        assert_eq!(outcome.failures, vec!["sm_90a slow".to_string()]);
        assert_eq!(outcome.rows.len(), 1);
        assert!(outcome.rows[0].contains("slow") && outcome.rows[0].contains("FAIL"));
        assert!(outcome.summary.contains("1 spills in shipped modules"));
    }

    #[test]
    fn stale_allowances_are_reported() {
        let reports = vec![(SHIPPED, vec![kernel("moving", 100, 0, 0)]), (DEV, vec![kernel("slow", 100, 0, 0)])];
        let warnings = GATE.evaluate(&reports, false).warnings;
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("slow"));
    }
}
