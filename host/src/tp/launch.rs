//! The process model of tensor parallelism: one process per GPU, as NCCL
//! recommends. [`Launch`] starts a program's ranks, each seeing only its own
//! GPU (`CUDA_VISIBLE_DEVICES`) and told its rank, the world's size and the
//! file through which rank 0 hands NCCL's unique id to the others; a rank reads
//! that back with [`RankEnv::from_env`]. Every rank runs with NVLink multicast
//! off ([`MULTICAST_OFF`]): on the shared multi-GPU machines it can take the
//! GPUs out of service, so a rank whose environment lacks it is refused.
//! If a rank fails, the others are stopped: a peer waiting in NCCL for it
//! would otherwise wait forever.

use super::nccl::{Nccl, UniqueId};
use crate::error::{Error, Result};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The variables that keep NVLink multicast off in NCCL, PyTorch and NVSHMEM.
pub const MULTICAST_OFF: [(&str, &str); 3] =
    [("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")];

const RANK: &str = "TP_RANK";
const WORLD: &str = "TP_WORLD";
const ID_FILE: &str = "TP_ID_FILE";

/// What a launched rank is told: its rank, the world's size, and where rank 0
/// writes NCCL's unique id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    pub id_file: PathBuf,
}

impl RankEnv {
    /// This process's rank, if [`Launch`] started it (`None` when none of its
    /// variables is set); an error if they are partial or invalid, or if NVLink
    /// multicast is not off.
    pub fn from_env() -> Result<Option<RankEnv>> {
        RankEnv::from_vars(|k| std::env::var(k).ok())
    }

    /// [`RankEnv::from_env`] over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<RankEnv>> {
        let (rank, world, id_file) = (var(RANK), var(WORLD), var(ID_FILE));
        if rank.is_none() && world.is_none() && id_file.is_none() {
            return Ok(None);
        }
        let number = |name: &str, v: Option<String>| -> Result<usize> {
            let v = v.ok_or_else(|| Error::InvalidArgument(format!("tensor parallelism: {name} is not set")))?;
            v.parse().map_err(|_| Error::InvalidArgument(format!("tensor parallelism: {name}={v} is not a count")))
        };
        let (rank, world) = (number(RANK, rank)?, number(WORLD, world)?);
        if world == 0 || rank >= world {
            return Err(Error::InvalidArgument(format!("tensor parallelism: rank {rank} of a world of {world}")));
        }
        let id_file =
            id_file.ok_or_else(|| Error::InvalidArgument(format!("tensor parallelism: {ID_FILE} is not set")))?;
        for (k, v) in MULTICAST_OFF {
            if var(k).as_deref() != Some(v) {
                return Err(Error::InvalidArgument(format!(
                    "tensor parallelism: {k} must be {v} in every rank (NVLink multicast stays off)"
                )));
            }
        }
        Ok(Some(RankEnv { rank, world, id_file: PathBuf::from(id_file) }))
    }

    /// NCCL's unique id of this launch: rank 0 makes and writes it, the others
    /// wait up to `timeout` for it.
    pub fn unique_id(&self, nccl: &Nccl, timeout: Duration) -> Result<UniqueId> {
        if self.rank == 0 {
            let id = nccl.unique_id()?;
            id.write(&self.id_file)?;
            Ok(id)
        } else {
            UniqueId::wait_for(&self.id_file, timeout)
        }
    }
}

/// One process per GPU: `world` ranks of `program` with `args`, rank r on GPU
/// `devices[r]`.
#[derive(Clone, Debug)]
pub struct Launch {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub devices: Vec<usize>,
}

impl Launch {
    /// `world` ranks on GPUs 0, 1, … `world` − 1.
    pub fn new(
        program: impl Into<PathBuf>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
        world: usize,
    ) -> Launch {
        Launch {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            devices: (0..world).collect(),
        }
    }

    /// Starts every rank and waits for all: `Ok` once each has exited with
    /// success. The first rank to fail stops the others, and the error names
    /// it. Nothing is started if the devices are none or repeat one.
    pub fn run(&self) -> Result<()> {
        let world = self.devices.len();
        if world == 0 {
            return Err(Error::InvalidArgument("tensor parallelism: no ranks to launch".into()));
        }
        if let Some(d) = self.devices.iter().enumerate().find_map(|(i, d)| self.devices[..i].contains(d).then_some(d)) {
            return Err(Error::InvalidArgument(format!("tensor parallelism: GPU {d} is given to two ranks")));
        }
        let dir = std::env::temp_dir().join(format!("tp-launch-{}-{}", std::process::id(), unique_suffix()));
        std::fs::create_dir_all(&dir).map_err(|e| Error::InvalidArgument(format!("{}: {e}", dir.display())))?;
        let outcome = self.spawn_and_wait(&dir.join("nccl-id"));
        let _ = std::fs::remove_dir_all(&dir);
        outcome
    }

    fn spawn_and_wait(&self, id_file: &Path) -> Result<()> {
        let mut ranks: Vec<Child> = Vec::with_capacity(self.devices.len());
        for (rank, device) in self.devices.iter().enumerate() {
            let mut cmd = Command::new(&self.program);
            cmd.args(&self.args)
                .env(RANK, rank.to_string())
                .env(WORLD, self.devices.len().to_string())
                .env(ID_FILE, id_file)
                .env("CUDA_VISIBLE_DEVICES", device.to_string())
                .envs(MULTICAST_OFF);
            match cmd.spawn() {
                Ok(child) => ranks.push(child),
                Err(e) => {
                    stop(&mut ranks);
                    return Err(Error::InvalidArgument(format!(
                        "tensor parallelism: rank {rank}: {}: {e}",
                        self.program.display()
                    )));
                }
            }
        }
        let mut done = vec![false; ranks.len()];
        while done.contains(&false) {
            for rank in 0..ranks.len() {
                if done[rank] {
                    continue;
                }
                let why = match ranks[rank].try_wait() {
                    Ok(Some(status)) if status.success() => {
                        done[rank] = true;
                        continue;
                    }
                    Ok(None) => continue,
                    Ok(Some(status)) => status.to_string(),
                    Err(e) => e.to_string(),
                };
                stop(&mut ranks);
                return Err(Error::InvalidArgument(format!("tensor parallelism: rank {rank} failed ({why})")));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }
}

/// Kills and reaps every rank still running.
fn stop(ranks: &mut [Child]) {
    for child in ranks.iter_mut() {
        if matches!(child.try_wait(), Ok(None)) {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

/// Distinguishes launches of one process from each other.
fn unique_suffix() -> u128 {
    static STARTED: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let since = STARTED.get_or_init(Instant::now).elapsed().as_nanos();
    since ^ std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    fn with_multicast_off<'a>(pairs: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        pairs.iter().copied().chain(MULTICAST_OFF).collect()
    }

    #[test]
    fn a_rank_reads_its_place_and_refuses_multicast() {
        assert_eq!(RankEnv::from_vars(vars(&[])).unwrap(), None);
        let full = with_multicast_off(&[(RANK, "1"), (WORLD, "4"), (ID_FILE, "/tmp/id")]);
        let env = RankEnv::from_vars(vars(&full)).unwrap().unwrap();
        assert_eq!(env, RankEnv { rank: 1, world: 4, id_file: PathBuf::from("/tmp/id") });
        // Without multicast off, or with it on, a rank is refused, naming the variable.
        let no_off = vars(&[(RANK, "1"), (WORLD, "4"), (ID_FILE, "/tmp/id")]);
        assert!(matches!(RankEnv::from_vars(no_off), Err(Error::InvalidArgument(m)) if m.contains("NCCL_NVLS_ENABLE")));
        // A later pair overrides an earlier one.
        let mut on = full.clone();
        on.push(("NVSHMEM_DISABLE_NVLS", "0"));
        assert!(matches!(RankEnv::from_vars(vars(&on)), Err(Error::InvalidArgument(m)) if m.contains("NVSHMEM")));
        for bad in [
            with_multicast_off(&[(RANK, "4"), (WORLD, "4"), (ID_FILE, "/tmp/id")]),
            with_multicast_off(&[(RANK, "0"), (WORLD, "0"), (ID_FILE, "/tmp/id")]),
            with_multicast_off(&[(RANK, "x"), (WORLD, "2"), (ID_FILE, "/tmp/id")]),
            with_multicast_off(&[(RANK, "0"), (ID_FILE, "/tmp/id")]),
            with_multicast_off(&[(RANK, "0"), (WORLD, "2")]),
        ] {
            assert!(matches!(RankEnv::from_vars(vars(&bad)), Err(Error::InvalidArgument(_))), "{bad:?}");
        }
    }

    #[test]
    fn every_rank_gets_its_gpu_its_rank_and_multicast_off() {
        // Each rank checks what it was given, and rank 0 leaves a file in the
        // launch's folder (removed afterwards) that the others wait for.
        let script = r#"
            test "$TP_WORLD" = 3 && test "$CUDA_VISIBLE_DEVICES" = $((TP_RANK + 4)) || exit 7
            test "$NCCL_NVLS_ENABLE" = 0 && test "$TORCH_SYMM_MEM_DISABLE_MULTICAST" = 1 || exit 8
            test "$NVSHMEM_DISABLE_NVLS" = 1 || exit 9
            if [ "$TP_RANK" = 0 ]; then echo id > "$TP_ID_FILE"; fi
            for _ in $(seq 200); do [ -f "$TP_ID_FILE" ] && exit 0; sleep 0.01; done; exit 10
        "#;
        let launch = Launch { devices: vec![4, 5, 6], ..Launch::new("/bin/sh", ["-c", script], 3) };
        launch.run().unwrap();
    }

    #[test]
    fn a_failing_rank_stops_the_others_and_is_named() {
        let start = Instant::now();
        let script = r#"if [ "$TP_RANK" = 1 ]; then exit 3; fi; sleep 30"#;
        let err = Launch::new("/bin/sh", ["-c", script], 3).run().unwrap_err();
        assert!(err.to_string().contains("rank 1 failed"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(20), "the sleeping ranks were not stopped");
        let missing = Launch::new("/nonexistent/program", Vec::<String>::new(), 2).run().unwrap_err();
        assert!(missing.to_string().contains("rank 0"), "{missing}");
    }

    #[test]
    fn no_ranks_or_a_gpu_twice_is_refused_before_anything_starts() {
        let none = Launch::new("/bin/sh", ["-c", "exit 0"], 0);
        assert!(matches!(none.run(), Err(Error::InvalidArgument(_))));
        let twice = Launch { devices: vec![0, 1, 0], ..Launch::new("/bin/sh", ["-c", "exit 0"], 3) };
        assert!(matches!(twice.run(), Err(Error::InvalidArgument(m)) if m.contains("GPU 0")));
    }
}
