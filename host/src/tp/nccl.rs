//! A minimal typed binding of NCCL, loaded at run time with `libloading`: from
//! `$NCCL_LIBRARY`, the system's `libnccl.so.2`, or the `nvidia-nccl-cu*`
//! Python wheel's copy. Without it everything single-GPU works, and asking for
//! a communicator is an [`Error::Nccl`] naming the paths tried.
//!
//! One process per GPU, as NCCL recommends: rank 0 makes a [`UniqueId`] and
//! hands it to the others (a file, [`UniqueId::write`] / [`UniqueId::wait_for`]),
//! then every rank joins with [`Communicator::new`] on its own [`Gpu`].

use crate::error::{Error, Result};
use crate::ops::SampleOutput;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use cust::memory::{CopyDestination, DeviceBuffer};
use half::bf16;
use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `ncclUniqueId`: the 128 opaque bytes every rank of a communicator shares.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId {
    internal: [u8; UNIQUE_ID_BYTES],
}

const UNIQUE_ID_BYTES: usize = 128;
const NCCL_SUCCESS: c_int = 0;
const NCCL_UINT32: c_int = 3;
const NCCL_FLOAT32: c_int = 7;
const NCCL_BFLOAT16: c_int = 9;
const NCCL_SUM: c_int = 0;

type RawComm = *mut c_void;

/// The entry points used, resolved once at load.
struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> c_int,
    comm_destroy: unsafe extern "C" fn(RawComm) -> c_int,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> c_int,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
}

/// A loaded NCCL library.
pub struct Nccl {
    api: Api,
    path: PathBuf,
    // Last: the entry points above point into it.
    _lib: Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nccl({})", self.path.display())
    }
}

/// Where NCCL may be: `$NCCL_LIBRARY` alone when set; else the loader's search
/// path, then the Python wheel under each `python3.*` library folder (beside
/// each `python3` on PATH, `$VIRTUAL_ENV`, the system's and the user's).
pub fn candidates() -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os("NCCL_LIBRARY") {
        return vec![PathBuf::from(p)];
    }
    let mut out = vec![PathBuf::from("libnccl.so.2")];
    // The `lib` beside every `python3` on PATH (virtual environments too), then the usual places.
    let mut roots: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .filter(|d| d.join("python3").exists())
                .filter_map(|d| Some(d.parent()?.join("lib")))
                .collect()
        })
        .unwrap_or_default();
    roots.extend(std::env::var_os("VIRTUAL_ENV").map(|v| Path::new(&v).join("lib")));
    roots.extend(["/usr/local/lib", "/usr/lib", "/opt/conda/lib"].map(PathBuf::from));
    roots.extend(std::env::var_os("HOME").map(|h| Path::new(&h).join(".local/lib")));
    roots.dedup();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else { continue };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons {
            for pkgs in ["dist-packages", "site-packages"] {
                let lib = py.join(pkgs).join("nvidia/nccl/lib/libnccl.so.2");
                if lib.exists() {
                    out.push(lib);
                }
            }
        }
    }
    out
}

impl Nccl {
    /// The first of [`candidates`] that loads.
    pub fn load() -> Result<Nccl> {
        let mut tried = Vec::new();
        for path in candidates() {
            match Nccl::load_from(&path) {
                Ok(n) => return Ok(n),
                Err(e) => tried.push(e.to_string()),
            }
        }
        Err(Error::Nccl(format!(
            "no usable libnccl.so.2 (set NCCL_LIBRARY, or install the nvidia-nccl-cu13 wheel); tried: {}",
            tried.join("; ")
        )))
    }

    /// NCCL from `path`, with every entry point used resolved.
    pub fn load_from(path: &Path) -> Result<Nccl> {
        let fail = |what: String| Error::Nccl(format!("{}: {what}", path.display()));
        // SAFETY: loading runs the library's initializers; NCCL's only set up its own state.
        let lib = unsafe { Library::new(path) }.map_err(|e| fail(e.to_string()))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is NCCL's, with the C signature of `Api`'s field
                // (nccl.h); the pointer stays valid while `lib` is loaded, which `Nccl` keeps.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| fail(format!("{}: {e}", $name)))?
            };
        }
        let api = Api {
            get_version: sym!("ncclGetVersion"),
            get_unique_id: sym!("ncclGetUniqueId"),
            comm_init_rank: sym!("ncclCommInitRank"),
            comm_destroy: sym!("ncclCommDestroy"),
            all_reduce: sym!("ncclAllReduce"),
            broadcast: sym!("ncclBroadcast"),
            get_error_string: sym!("ncclGetErrorString"),
        };
        Ok(Nccl { api, path: path.to_path_buf(), _lib: lib })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// (major, minor, patch).
    pub fn version(&self) -> Result<(u32, u32, u32)> {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        self.check("ncclGetVersion", unsafe { (self.api.get_version)(&mut v) })?;
        let v = v as u32;
        Ok((v / 10000, v / 100 % 100, v % 100))
    }

    /// A new communicator's id, made by one rank and shared with the others.
    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId { internal: [0; UNIQUE_ID_BYTES] };
        // SAFETY: writes one ncclUniqueId.
        self.check("ncclGetUniqueId", unsafe { (self.api.get_unique_id)(&mut id) })?;
        Ok(id)
    }

    fn check(&self, call: &str, status: c_int) -> Result<()> {
        if status == NCCL_SUCCESS {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any status.
        let text = unsafe { CStr::from_ptr((self.api.get_error_string)(status)) }.to_string_lossy();
        Err(Error::Nccl(format!("{call}: {text} (status {status})")))
    }
}

impl UniqueId {
    pub fn to_bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        self.internal
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let internal = bytes
            .try_into()
            .map_err(|_| Error::Nccl(format!("a unique id is {UNIQUE_ID_BYTES} bytes, not {}", bytes.len())))?;
        Ok(UniqueId { internal })
    }

    /// Writes the id to `path` whole (through a temporary file and a rename), so
    /// a rank polling for it never reads half of it.
    pub fn write(&self, path: &Path) -> Result<()> {
        let io = |e: std::io::Error| Error::Nccl(format!("{}: {e}", path.display()));
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, self.internal).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Reads the id rank 0 writes to `path`, waiting up to `timeout` for it.
    pub fn wait_for(path: &Path, timeout: Duration) -> Result<UniqueId> {
        let start = Instant::now();
        loop {
            match std::fs::read(path) {
                Ok(bytes) => return UniqueId::from_bytes(&bytes),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && start.elapsed() < timeout => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(Error::Nccl(format!("{}: {e}", path.display()))),
            }
        }
    }
}

/// An element type NCCL sums.
pub trait Summable: crate::tensor::DType {
    const NCCL: c_int;
}

impl Summable for bf16 {
    const NCCL: c_int = NCCL_BFLOAT16;
}

impl Summable for f32 {
    const NCCL: c_int = NCCL_FLOAT32;
}

/// One rank's NCCL communicator, on this process's GPU. Not `Sync`: NCCL
/// communicators must not be used from two threads at once.
pub struct Communicator {
    nccl: Arc<Nccl>,
    comm: RawComm,
    world: usize,
    rank: usize,
    _not_sync: PhantomData<*mut ()>,
}

impl Communicator {
    /// Joins communicator `id` as `rank` of `world`; blocks until every rank has
    /// joined. `gpu` is this process's device (its context is current).
    pub fn new(nccl: &Arc<Nccl>, _gpu: &Gpu, world: usize, rank: usize, id: &UniqueId) -> Result<Communicator> {
        if world == 0 || rank >= world || world > c_int::MAX as usize {
            return Err(Error::InvalidArgument(format!("NCCL rank {rank} of a world of {world}")));
        }
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: writes one communicator handle; the id is passed by value.
        let status = unsafe { (nccl.api.comm_init_rank)(&mut comm, world as c_int, *id, rank as c_int) };
        nccl.check("ncclCommInitRank", status)?;
        Ok(Communicator { nccl: nccl.clone(), comm, world, rank, _not_sync: PhantomData })
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Sums `t` over the ranks, in place, queued on `gpu`'s stream (so it is
    /// captured into a CUDA graph when queued inside [`Gpu::capture`]).
    pub fn all_reduce_sum<T: Summable>(&self, gpu: &Gpu, t: &mut Tensor<T>) -> Result<()> {
        if t.numel() == 0 {
            return Err(Error::Empty("all_reduce_sum: the tensor has no elements".into()));
        }
        let ptr = t.device_ptr() as *mut c_void;
        let stream = gpu.stream().as_inner() as *mut c_void;
        // SAFETY: `t` is a live device buffer of numel T on this process's
        // device, borrowed mutably for the call; the reduction is stream-ordered
        // after the work that wrote it, and freeing `t` waits for the device.
        let status = unsafe { (self.nccl.api.all_reduce)(ptr, ptr, t.numel(), T::NCCL, NCCL_SUM, self.comm, stream) };
        self.nccl.check("ncclAllReduce", status)
    }

    /// Rank 0's `ids` on every rank (the others' are replaced, whatever their
    /// length): how rank 0, which drives the requests, hands a step's token ids
    /// to the others. Synchronous: it returns once this rank holds them.
    pub fn broadcast_ids(&self, gpu: &Gpu, ids: &mut Vec<u32>) -> Result<()> {
        let len = [ids.len() as u32];
        let mut n = DeviceBuffer::from_slice(&len).map_err(crate::error::cuda("cuMemAlloc"))?;
        self.broadcast_u32(gpu, &mut n)?;
        let mut len = [0u32];
        gpu.synchronize()?;
        n.copy_to(&mut len[..]).map_err(crate::error::cuda("cuMemcpyDtoH"))?;
        ids.resize(len[0] as usize, 0);
        if ids.is_empty() {
            return Ok(());
        }
        let mut buf = DeviceBuffer::from_slice(ids).map_err(crate::error::cuda("cuMemAlloc"))?;
        self.broadcast_u32(gpu, &mut buf)?;
        gpu.synchronize()?;
        buf.copy_to(&mut ids[..]).map_err(crate::error::cuda("cuMemcpyDtoH"))
    }

    /// Rank 0's `buf` into every rank's, in place, on `gpu`'s stream.
    /// Every rank's drawn tokens ← rank 0's, queued on the GPU's stream (a
    /// graph may hold it).
    pub fn broadcast_tokens(&self, gpu: &Gpu, tokens: &mut SampleOutput) -> Result<()> {
        self.broadcast_u32(gpu, tokens.tokens_mut())
    }

    fn broadcast_u32(&self, gpu: &Gpu, buf: &mut DeviceBuffer<u32>) -> Result<()> {
        let ptr = buf.as_device_ptr().as_raw() as *mut c_void;
        let stream = gpu.stream().as_inner() as *mut c_void;
        // SAFETY: `buf` is a live device buffer of len u32 on this process's
        // device, borrowed mutably until the caller synchronizes.
        let status = unsafe { (self.nccl.api.broadcast)(ptr, ptr, buf.len(), NCCL_UINT32, 0, self.comm, stream) };
        self.nccl.check("ncclBroadcast", status)
    }

    /// [`all_reduce_sum`](Self::all_reduce_sum) over f32 sums in device memory.
    pub fn all_reduce_sums(&self, gpu: &Gpu, sums: &mut super::DeviceSums) -> Result<()> {
        if sums.is_empty() {
            return Err(Error::Empty("all_reduce_sums: no sums".into()));
        }
        let ptr = sums.device_ptr() as *mut c_void;
        let stream = gpu.stream().as_inner() as *mut c_void;
        // SAFETY: the view holds `len` f32 on this process's device, lent
        // mutably for the call; the reduction is stream-ordered after the
        // kernel that wrote them and before the one that finishes them.
        let status =
            unsafe { (self.nccl.api.all_reduce)(ptr, ptr, sums.len(), NCCL_FLOAT32, NCCL_SUM, self.comm, stream) };
        self.nccl.check("ncclAllReduce", status)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // SAFETY: the handle came from ncclCommInitRank and is destroyed once.
        let _ = unsafe { (self.nccl.api.comm_destroy)(self.comm) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_its_path() {
        let e = Nccl::load_from(Path::new("/nonexistent/libnccl.so.2")).unwrap_err().to_string();
        assert!(e.starts_with("NCCL: /nonexistent/libnccl.so.2"), "{e}");
    }

    #[test]
    fn load_finds_nccl_or_says_what_it_tried() {
        match Nccl::load() {
            Ok(n) => {
                let v = n.version().unwrap();
                assert!(v.0 >= 2, "{v:?}");
                // A unique id needs no GPU; NCCL may still refuse without a network.
                match n.unique_id() {
                    Ok(id) => assert_ne!(id.to_bytes(), [0; UNIQUE_ID_BYTES]),
                    Err(e) => assert!(matches!(e, Error::Nccl(_)), "{e}"),
                }
                println!("NCCL {v:?} from {}", n.path().display());
            }
            Err(e) => assert!(e.to_string().contains("libnccl.so.2") && e.to_string().contains("NCCL_LIBRARY")),
        }
    }

    #[test]
    fn unique_ids_round_trip_through_bytes_and_files() {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        bytes.iter_mut().enumerate().for_each(|(i, b)| *b = (i * 37 % 251) as u8);
        let id = UniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.to_bytes(), bytes);
        assert!(UniqueId::from_bytes(&bytes[..127]).is_err());
        let path = std::env::temp_dir().join(format!("nccl-id-{}", std::process::id()));
        id.write(&path).unwrap();
        assert!(UniqueId::wait_for(&path, Duration::from_secs(1)).unwrap() == id);
        std::fs::remove_file(&path).unwrap();
        let e = UniqueId::wait_for(&path, Duration::from_millis(50)).err().unwrap().to_string();
        assert!(e.contains("nccl-id"), "{e}");
    }
}
