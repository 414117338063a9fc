//! The GPU runtime: one context, one stream, the kernel module for this device's
//! architecture (its cubin, or its PTX where that does not load), and a cache
//! of kernel handles.

use crate::error::{check, cuda, Error, Result};
use cust::context::Context;
use cust::device::{Device, DeviceAttribute};
use cust::event::{Event, EventFlags};
use cust::module::Module;
use cust::stream::{Stream, StreamFlags};
use cust::sys;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

/// Which PTX module a device runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Hopper, compute capability 9.0 exactly (sm_90a code is not forward compatible).
    Sm90a,
    /// Any device of compute capability 8.0 or newer.
    Sm80,
}

impl Arch {
    /// The module for a compute capability, or an error below sm_80.
    pub fn for_compute_capability(major: i32, minor: i32) -> Result<Arch> {
        match (major, minor) {
            (9, 0) => Ok(Arch::Sm90a),
            (m, _) if m >= 8 => Ok(Arch::Sm80),
            _ => Err(Error::UnsupportedArch { major, minor }),
        }
    }

    pub fn ptx(self) -> &'static str {
        match self {
            Arch::Sm90a => crate::ptx::SM_90A,
            Arch::Sm80 => crate::ptx::SM_80,
        }
    }

    /// The module of versions kept for comparison.
    #[cfg(feature = "dev")]
    pub fn dev_ptx(self) -> &'static str {
        match self {
            Arch::Sm90a => crate::ptx::SM_90A_DEV,
            Arch::Sm80 => crate::ptx::SM_80_DEV,
        }
    }

    /// [`ptx`](Self::ptx) assembled for the arch, where a device of compute
    /// capability `major`.x runs it: sm_90a's on 9.0 (the only one it is
    /// picked for), sm_80's on 8.x and not on later majors.
    pub fn cubin(self, major: i32) -> Option<&'static [u8]> {
        match self {
            Arch::Sm90a => Some(crate::cubin::SM_90A),
            Arch::Sm80 => (major == 8).then_some(crate::cubin::SM_80),
        }
    }

    /// [`dev_ptx`](Self::dev_ptx) assembled, as [`cubin`](Self::cubin).
    #[cfg(feature = "dev")]
    pub fn dev_cubin(self, major: i32) -> Option<&'static [u8]> {
        match self {
            Arch::Sm90a => Some(crate::cubin::SM_90A_DEV),
            Arch::Sm80 => (major == 8).then_some(crate::cubin::SM_80_DEV),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm90a => "sm_90a",
            Arch::Sm80 => "sm_80",
        }
    }
}

/// What the launch logic needs to know about the device.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub arch: Arch,
    pub sm_count: u32,
    pub total_memory: usize,
    /// Largest dynamic shared memory one block may opt into.
    pub max_shared_per_block_optin: u32,
    /// `domain:bus:device.function`, as NVML and `nvidia-smi` name the device.
    pub pci_bus_id: String,
    /// What the shipped module was loaded from.
    pub image: Image,
}

/// A module's form as loaded: the embedded cubin, or its PTX compiled by the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Image {
    Cubin,
    Ptx,
}

impl Image {
    pub fn name(self) -> &'static str {
        match self {
            Image::Cubin => "cubin",
            Image::Ptx => "PTX",
        }
    }
}

/// (block size, dynamic shared memory, cluster dimensions).
type ClusterShape = (u32, u32, (u32, u32, u32));

/// A typed handle of one kernel entry point: its name, launch bound and
/// parameter block `A`. The handles are generated from the kernels'
/// `launch_bounds!` declarations ([`crate::kernels`]); none can be made elsewhere.
pub struct Kernel<A> {
    name: &'static str,
    max_threads: u32,
    /// In the dev module (a version kept for comparison), not the shipped one.
    dev: bool,
    params: std::marker::PhantomData<fn(A)>,
}

impl<A> Clone for Kernel<A> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<A> Copy for Kernel<A> {}

impl<A> PartialEq for Kernel<A> {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}
impl<A> Eq for Kernel<A> {}

impl<A> std::fmt::Debug for Kernel<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name)
    }
}

impl<A: abi::Params> Kernel<A> {
    pub(crate) const fn new(name: &'static str, max_threads: u32) -> Kernel<A> {
        Kernel { name, max_threads, dev: false, params: std::marker::PhantomData }
    }

    /// A handle into the dev module.
    #[allow(dead_code)] // only the generated `kernels::dev` calls it
    pub(crate) const fn new_dev(name: &'static str, max_threads: u32) -> Kernel<A> {
        Kernel { name, max_threads, dev: true, params: std::marker::PhantomData }
    }

    /// The entry point's name in the PTX.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// Whether the entry is a version kept for comparison (in the dev module).
    pub const fn is_dev(&self) -> bool {
        self.dev
    }

    /// The most threads a block may have (the entry's `launch_bounds!`).
    pub const fn max_threads(&self) -> u32 {
        self.max_threads
    }

    /// Name, launch bound and parameter-block size, for tables and checks.
    pub const fn info(&self) -> KernelInfo {
        KernelInfo { name: self.name, max_threads: self.max_threads, params_bytes: std::mem::size_of::<A>() }
    }
}

/// What a [`Kernel`] handle says about its entry, without the parameter type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    pub name: &'static str,
    pub max_threads: u32,
    /// `size_of` the `abi` parameter struct: the entry's `.param` size in the PTX.
    pub params_bytes: usize,
}

struct Loaded {
    raw: sys::CUfunction,
    /// Shared memory the kernel declares statically (counts against the same limit).
    static_smem: u32,
    /// Dynamic shared memory a launch may ask for without raising the limit.
    dynamic_smem_limit: u32,
    /// Blocks per SM by (block size, dynamic shared memory), asked once: per-call
    /// queries cost host time that small launches (decode) feel.
    occupancy: HashMap<(u32, u32), u32>,
    /// Clusters resident at once by (block size, dynamic shared memory, cluster size).
    clusters: HashMap<ClusterShape, u32>,
}

/// Owner of the CUDA context, stream and module. Not `Sync`: one host thread
/// drives one `Gpu`.
pub struct Gpu {
    info: DeviceInfo,
    /// Zeroed f32 scratch for split-K GEMMs (kernels leave it zeroed again).
    workspace: RefCell<Workspace>,
    /// The split-tail GEMM's scratch: zero counters, then slots left as written.
    split_tail_scratch: RefCell<GrowOnlyBuffer<f32>>,
    /// One u32, 0 between launches: the next tile of a kernel that hands its
    /// tiles out as blocks finish (the kernel resets it when it is done).
    tile_counter: cust::memory::DeviceBuffer<u32>,
    kernels: RefCell<HashMap<&'static str, Loaded>>,
    tensor_maps: RefCell<crate::tensor_map::MapCache>,
    /// Whether [`Gpu::capture`] is recording: maps handed out then are pinned.
    capturing: std::cell::Cell<bool>,
    launches: std::cell::Cell<u64>,
    /// Whether [`Gpu::launch_after`] may overlap kernels (Hopper only).
    programmatic: std::cell::Cell<bool>,
    /// Pinned staging for small host-to-device copies (page tables, lengths,
    /// sampling parameters): from it a copy queues behind the stream's work
    /// instead of waiting for it, as a copy from pageable memory does.
    uploads: RefCell<UploadRing>,
    module: Module,
    /// The versions kept for comparison, looked up after `module`; loaded
    /// at the first launch of a dev entry or the first graph capture, so
    /// programs that do neither never pay for it (where its PTX is compiled by
    /// the driver, about 20 s on Hopper without a warm JIT cache).
    #[cfg(feature = "dev")]
    dev_module: std::cell::OnceCell<Module>,
    stream: Stream,
    // Dropped last: the module and stream belong to this context.
    _context: Context,
}

/// [`Gpu::upload_u32`]'s pinned ring: eight chunks of 512 KiB. A b64 decode
/// step at an 8k-token context stages about 32k words (its page tables), so a
/// chunk is reused only after several steps, and reusing one waits for the
/// copies staged from it alone, never for the whole stream.
const UPLOAD_CHUNK_WORDS: usize = 1 << 17;
const UPLOAD_CHUNKS: usize = 8;

struct UploadRing {
    buf: cust::memory::LockedBuffer<u32>,
    /// Per chunk, recorded on the stream after the last copy staged from it.
    drained: Vec<Event>,
    /// The chunk being filled, and the words of it used so far.
    chunk: usize,
    used: usize,
}

impl UploadRing {
    fn new() -> Result<UploadRing> {
        let buf = cust::memory::LockedBuffer::new(&0u32, UPLOAD_CHUNK_WORDS * UPLOAD_CHUNKS)
            .map_err(cuda("cuMemHostAlloc"))?;
        let event = || Event::new(EventFlags::DISABLE_TIMING).map_err(cuda("cuEventCreate"));
        let drained = (0..UPLOAD_CHUNKS).map(|_| event()).collect::<Result<_>>()?;
        Ok(UploadRing { buf, drained, chunk: 0, used: 0 })
    }

    /// Room for `words` in the current chunk, moving to the next one (after its
    /// earlier copies have run) when this one is full; the staging's index.
    fn reserve(&mut self, words: usize, stream: &Stream) -> Result<usize> {
        if self.used + words > UPLOAD_CHUNK_WORDS {
            let next = (self.chunk + 1) % UPLOAD_CHUNKS;
            self.drained[self.chunk].record(stream).map_err(cuda("cuEventRecord"))?;
            // An event never recorded reads as complete. Moved on only once the
            // next chunk's copies have run: on an error the ring stays where it was.
            self.drained[next].synchronize().map_err(cuda("cuEventSynchronize"))?;
            (self.chunk, self.used) = (next, 0);
        }
        let at = self.chunk * UPLOAD_CHUNK_WORDS + self.used;
        // 16-byte steps keep every staged copy aligned for the copy engine.
        self.used = (self.used + words).next_multiple_of(4);
        Ok(at)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Queued copies may still read the pinned ring freed below.
        let _ = self.stream.synchronize();
    }
}

/// The one device this process uses, whose primary context stays retained until
/// the process exits (as the CUDA runtime keeps it). Tensors, caches and buffers
/// own device memory but not the `Gpu`: with the context pinned, dropping every
/// `Gpu` cannot free memory they still point at, and a later `Gpu` (same device,
/// same primary context) reaches it. One device per process until tensors carry
/// their device: a tensor of one device must never reach another's kernels.
static PROCESS_DEVICE: std::sync::Mutex<Option<u32>> = std::sync::Mutex::new(None);

fn pin_primary_context(ordinal: u32, device: &Device) -> Result<()> {
    let mut pinned = PROCESS_DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    match *pinned {
        Some(d) if d == ordinal => Ok(()),
        Some(d) => Err(Error::InvalidArgument(format!(
            "this process already uses GPU {d}; one device per process (asked for {ordinal})"
        ))),
        None => {
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: a valid device handle and an out-parameter; never released, on purpose.
            check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device.as_raw()) })?;
            *pinned = Some(ordinal);
            Ok(())
        }
    }
}

/// cust 0.3's attribute enum predates this one (CUDA 11.4 bindings), so ask the driver.
fn pci_bus_id(device: &Device) -> Result<String> {
    let mut id = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer holds `len` bytes, which the driver NUL-terminates.
    let status = unsafe { sys::cuDeviceGetPCIBusId(id.as_mut_ptr(), id.len() as i32, device.as_raw()) };
    crate::error::check("cuDeviceGetPCIBusId", status)?;
    // SAFETY: NUL-terminated above, within the buffer.
    Ok(unsafe { std::ffi::CStr::from_ptr(id.as_ptr()) }.to_string_lossy().into_owned())
}

fn smem_optin(device: &Device) -> Result<u32> {
    let mut value = 0i32;
    let attr = sys::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
    check("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut value, attr, device.as_raw()) })?;
    Ok(value as u32)
}

/// A module from its cubin where the device runs that (`cubin` given: the
/// arch it was assembled for) and the driver reads the assembler's output,
/// else from its PTX, which the driver compiles: a later arch, an older driver.
fn load_module(cubin: Option<&[u8]>, ptx: &str) -> Result<(Module, Image)> {
    match cubin.map(|c| Module::from_cubin(c, &[])) {
        Some(Ok(module)) => Ok((module, Image::Cubin)),
        _ => Ok((Module::from_ptx(ptx, &[]).map_err(cuda("cuModuleLoadData (PTX JIT)"))?, Image::Ptx)),
    }
}

const DEFAULT_SMEM_LIMIT: u32 = 48 * 1024;

impl Gpu {
    /// The first GPU. `Err(Error::NoDevice)` on machines without one.
    pub fn new() -> Result<Gpu> {
        Gpu::with_device(0)
    }

    pub fn with_device(ordinal: u32) -> Result<Gpu> {
        cust::init(cust::CudaFlags::empty()).map_err(cuda("cuInit"))?;
        let device = Device::get_device(ordinal).map_err(cuda("cuDeviceGet"))?;
        let attr = |a| device.get_attribute(a).map_err(cuda("cuDeviceGetAttribute"));
        let (major, minor) =
            (attr(DeviceAttribute::ComputeCapabilityMajor)?, attr(DeviceAttribute::ComputeCapabilityMinor)?);
        let arch = Arch::for_compute_capability(major, minor)?;
        pin_primary_context(ordinal, &device)?;
        let context = Context::new(device).map_err(cuda("cuDevicePrimaryCtxRetain"))?;
        let (module, image) = load_module(arch.cubin(major), arch.ptx())?;
        let stream = Stream::new(StreamFlags::NON_BLOCKING, None).map_err(cuda("cuStreamCreate"))?;
        let info = DeviceInfo {
            name: device.name().map_err(cuda("cuDeviceGetName"))?,
            compute_capability: (major, minor),
            arch,
            sm_count: attr(DeviceAttribute::MultiprocessorCount)? as u32,
            total_memory: device.total_memory().map_err(cuda("cuDeviceTotalMem"))?,
            max_shared_per_block_optin: smem_optin(&device)?,
            pci_bus_id: pci_bus_id(&device)?,
            image,
        };
        Ok(Gpu {
            info,
            workspace: RefCell::new(Workspace::default()),
            split_tail_scratch: RefCell::new(GrowOnlyBuffer::default()),
            tile_counter: {
                let counter = cust::memory::DeviceBuffer::from_slice(&[0u32]).map_err(cuda("cuMemcpyHtoD"))?;
                crate::tensor::uploaded()?;
                counter
            },
            kernels: RefCell::new(HashMap::new()),
            tensor_maps: RefCell::new(Default::default()),
            capturing: std::cell::Cell::new(false),
            launches: std::cell::Cell::new(0),
            programmatic: std::cell::Cell::new(arch == Arch::Sm90a && crate::launch_ex::available()),
            uploads: RefCell::new(UploadRing::new()?),
            module,
            #[cfg(feature = "dev")]
            dev_module: std::cell::OnceCell::new(),
            stream,
            _context: context,
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Waits for all work queued on the stream; reports asynchronous kernel faults.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda("cuStreamSynchronize"))
    }

    /// Queues a copy of `data` to `dst` on the stream, after the work queued
    /// before it; `data` may be dropped on return. Staged through the pinned
    /// ring, a copy a chunk of it, the call does not wait for the stream, unless
    /// it needs a chunk whose copies of a lap before have not run: those queue
    /// behind every launch before them, so an upload past the ring's 4 MiB in
    /// all (a graph's page tables for hundreds of sequences of tens of
    /// thousands of tokens in small pages) waits for the step before. Refused while
    /// a graph is captured: the graph would keep reading a staging that later
    /// uploads reuse.
    ///
    /// # Safety
    /// `dst` must address at least `data.len()` u32 of device memory that stays
    /// allocated until the copy has run.
    pub(crate) unsafe fn upload_u32(&self, dst: u64, data: &[u32]) -> Result<()> {
        if self.capturing.get() {
            return Err(Error::InvalidArgument("upload while a graph is captured: stage before the capture".into()));
        }
        let mut ring = self.uploads.borrow_mut();
        for (i, piece) in data.chunks(UPLOAD_CHUNK_WORDS).enumerate() {
            let at = ring.reserve(piece.len(), &self.stream)?;
            ring.buf[at..at + piece.len()].copy_from_slice(piece);
            let src = ring.buf.as_ptr().wrapping_add(at);
            let to = dst + (4 * i * UPLOAD_CHUNK_WORDS) as u64;
            // SAFETY: the caller vouches for `dst`; a staged source is not written
            // again before the event after this copy completes, and the ring lives
            // as long as the stream (the `Gpu` synchronizes before freeing it).
            let bytes = std::mem::size_of_val(piece);
            let status = sys::cuMemcpyHtoDAsync_v2(to, src as *const std::ffi::c_void, bytes, self.stream.as_inner());
            check("cuMemcpyHtoDAsync", status)?;
        }
        Ok(())
    }

    #[cfg(feature = "dev")]
    fn dev_module(&self) -> Result<&Module> {
        if self.dev_module.get().is_none() {
            let (arch, major) = (self.info.arch, self.info.compute_capability.0);
            let (module, _) = load_module(arch.dev_cubin(major), arch.dev_ptx())?;
            let _ = self.dev_module.set(module);
        }
        Ok(self.dev_module.get().expect("set above"))
    }

    fn kernel_raw<A>(&self, kernel: Kernel<A>) -> Result<sys::CUfunction> {
        let name = kernel.name;
        if let Some(k) = self.kernels.borrow().get(name) {
            return Ok(k.raw);
        }
        // A shipped handle of one arch may name an entry that only the other arch
        // ships (the dev module of each arch holds both): look before asking the
        // driver, so no lookup fails on the way (compute-sanitizer reports those).
        #[cfg(feature = "dev")]
        let module = if !kernel.dev && self.info.arch.ptx().contains(&format!(".entry {name}(")) {
            &self.module
        } else {
            self.dev_module()?
        };
        #[cfg(not(feature = "dev"))]
        let module = &self.module;
        let raw = module
            .get_function(name)
            .map_err(|_| Error::Cuda {
                call: "cuModuleGetFunction",
                detail: format!("kernel `{name}` is not in the {} PTX", self.info.arch.name()),
            })?
            .to_raw();
        let mut static_smem = 0i32;
        let attr = sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES;
        check("cuFuncGetAttribute", unsafe { sys::cuFuncGetAttribute(&mut static_smem, attr, raw) })?;
        let static_smem = static_smem.max(0) as u32;
        // Static and dynamic shared memory share the default 48 KB per block.
        let dynamic_smem_limit = DEFAULT_SMEM_LIMIT.saturating_sub(static_smem);
        self.kernels.borrow_mut().insert(
            name,
            Loaded { raw, static_smem, dynamic_smem_limit, occupancy: HashMap::new(), clusters: HashMap::new() },
        );
        Ok(raw)
    }

    /// Grows the split-K workspace to at least `len` f32 now, ahead of use.
    pub(crate) fn reserve_workspace(&self, len: usize) -> Result<()> {
        self.zeroed_workspace_f32(len).map(|_| ())
    }

    /// Device address of at least `len` zeroed f32, reused across calls: users must
    /// leave it zeroed (split-K's finalize kernel does). What a failed user left
    /// behind (`Gpu::workspace_dirty`) is zeroed first, on the stream, so after
    /// the launches that may still be writing it and before the caller's.
    pub fn zeroed_workspace_f32(&self, len: usize) -> Result<u64> {
        let mut ws = self.workspace.borrow_mut();
        let before = ws.buf.len();
        let ptr = ws.buf.zeroed_at_least(len.max(1 << 16))?;
        // A new buffer (it only grows) is all zeros.
        let fresh = ws.buf.len() != before;
        let dirty = ws.take_dirty(fresh);
        if dirty > 0 {
            // SAFETY: the live buffer holds at least `dirty` f32 (marks never
            // exceed what a caller was given); the memset is ordered on our stream.
            let status = unsafe { sys::cuMemsetD32Async(ptr, 0, dirty, self.stream.as_inner()) };
            if let Err(e) = check("cuMemsetD32Async", status) {
                ws.mark_dirty(dirty);
                return Err(e);
            }
        }
        Ok(ptr)
    }

    /// Device address of the tile counter: a u32 that is 0 whenever no kernel
    /// using it runs. Its kernels run on this stream, one after another (never
    /// as programmatic dependents), and each sets it back to 0 before it ends.
    pub(crate) fn tile_counter(&self) -> u64 {
        self.tile_counter.as_device_ptr().as_raw()
    }

    /// Device address of at least `len` f32 for the split-tail GEMM, reused
    /// across calls; allocated zeroed. Its kernels leave the counters at its
    /// start zero and do not clear the rest; nothing else uses it.
    pub(crate) fn split_tail_scratch(&self, len: usize) -> Result<u64> {
        self.split_tail_scratch.borrow_mut().zeroed_at_least(len)
    }

    /// Marks the first `len` f32 of the workspace as possibly non-zero: a split-K
    /// kernel added partial sums into them and what reads and zeroes them (the
    /// finalize, or a fused consumer) has not been launched. The next
    /// [`Gpu::zeroed_workspace_f32`] zeroes them.
    pub(crate) fn workspace_dirty(&self, len: usize) {
        self.workspace.borrow_mut().mark_dirty(len);
    }

    /// Withdraws [`Gpu::workspace_dirty`]: the launch that reads and zeroes the
    /// marked sums has been queued since.
    pub(crate) fn workspace_clean(&self) {
        self.workspace.borrow_mut().dirty = 0;
    }

    /// Kernel launches made through this `Gpu` so far (for per-phase counts).
    pub fn launch_count(&self) -> u64 {
        self.launches.get()
    }

    /// Bytes of the split-K workspace currently allocated.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.borrow().buf.len() * 4
    }

    /// Global address of the TMA tensor map for `b` (cached; see [`crate::tensor_map`]).
    pub fn tensor_map(&self, b: crate::tensor_map::Bf16Box) -> Result<u64> {
        self.map_of(crate::tensor_map::MapKey::Rows(b))
    }

    /// Global address of the 3-D TMA tensor map for an attention tensor (cached).
    pub fn heads_tensor_map(&self, b: crate::tensor_map::HeadsBox) -> Result<u64> {
        self.map_of(crate::tensor_map::MapKey::Heads(b))
    }

    /// A new map goes up through the upload ring, ordered on the stream: no
    /// wait for the GPU to go idle, as a synchronous copy would need, each time
    /// a step meets a new shape or address.
    fn map_of(&self, key: crate::tensor_map::MapKey) -> Result<u64> {
        // SAFETY: `dst` is a slot of the cache's chunks, 16 u64 = 32 u32 long,
        // which stay allocated while the `Gpu` lives.
        let upload = |dst, words: &[u32]| unsafe { self.upload_u32(dst, words) };
        self.tensor_maps.borrow_mut().get(key, self.capturing.get(), upload)
    }

    /// Tensor maps cached now, and the device bytes their slots take.
    pub fn tensor_map_usage(&self) -> (usize, usize) {
        self.tensor_maps.borrow().usage()
    }

    /// Blocks of `block` threads with `smem` bytes of dynamic shared memory that fit
    /// on one SM at once.
    pub fn occupancy<A: abi::Params>(&self, kernel: Kernel<A>, block: u32, smem: u32) -> Result<u32> {
        let name = kernel.name;
        let raw = self.kernel_raw(kernel)?;
        if let Some(&n) = self.kernels.borrow().get(name).and_then(|k| k.occupancy.get(&(block, smem))) {
            return Ok(n);
        }
        self.allow_dynamic_smem(name, smem)?;
        let mut blocks = 0i32;
        let status =
            unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, raw, block as i32, smem as usize) };
        check("cuOccupancyMaxActiveBlocksPerMultiprocessor", status)?;
        let n = blocks.max(0) as u32;
        if let Some(k) = self.kernels.borrow_mut().get_mut(name) {
            k.occupancy.insert((block, smem), n);
        }
        Ok(n)
    }

    fn allow_dynamic_smem(&self, name: &'static str, smem: u32) -> Result<()> {
        let mut kernels = self.kernels.borrow_mut();
        let k = kernels.get_mut(name).expect("kernel_raw() ran first");
        if smem > k.dynamic_smem_limit {
            if smem + k.static_smem > self.info.max_shared_per_block_optin {
                return Err(Error::TooLarge(format!(
                    "{name} needs {smem} + {} (static) bytes of shared memory; the device allows {}",
                    k.static_smem, self.info.max_shared_per_block_optin
                )));
            }
            let attr = sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            check("cuFuncSetAttribute", unsafe { sys::cuFuncSetAttribute(k.raw, attr, smem as i32) })?;
            k.dynamic_smem_limit = smem;
        }
        Ok(())
    }

    /// Launches `kernel` with its by-value parameter block `args`.
    ///
    /// # Safety
    /// Every device pointer in `args` must be valid for the accesses the kernel
    /// makes with the grid and sizes given.
    pub unsafe fn launch<A: abi::Params>(
        &self,
        kernel: Kernel<A>,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &A,
    ) -> Result<()> {
        self.launch_inner(kernel, grid, block, smem, args, false, None)
    }

    /// [`Gpu::launch`] with programmatic dependent launch on Hopper: the kernel's
    /// blocks may start while the previous kernel in the stream finishes (once that
    /// one lets them, `griddepcontrol.launch_dependents`), so the launch latency
    /// and the kernel's prologue (weight loads) overlap the previous kernel's tail.
    /// Elsewhere, or when turned off, a plain launch.
    ///
    /// # Safety
    /// As [`Gpu::launch`]; and the kernel must wait (`griddepcontrol.wait`, the
    /// kernels' `wait_for_prior_grids`) before it reads anything earlier kernels
    /// write or writes anything they read. What it reads before the wait (the
    /// RoPE and split-KV decode kernels: token slots, page tables, lengths; the
    /// TMA kernels' tensor maps) must come from copies queued before the
    /// previous kernel, or right before this launch (a copy ends the previous
    /// kernel's overlap: the launch waits for it), never from a kernel.
    pub unsafe fn launch_after<A: abi::Params>(
        &self,
        kernel: Kernel<A>,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &A,
    ) -> Result<()> {
        self.launch_inner(kernel, grid, block, smem, args, self.programmatic.get(), None)
    }

    /// [`Gpu::launch_after`] in thread-block clusters of `cluster` blocks (sm_90;
    /// up to 16, past the portable 8): each grid dimension must be a multiple of
    /// `cluster`'s.
    ///
    /// # Safety
    /// As [`Gpu::launch_after`]; and every block of a cluster must reach the
    /// kernel's cluster barriers.
    pub unsafe fn launch_cluster_after<A: abi::Params>(
        &self,
        kernel: Kernel<A>,
        grid: (u32, u32, u32),
        cluster: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &A,
    ) -> Result<()> {
        let name = kernel.name;
        let divides = |g: u32, c: u32| c > 0 && g.is_multiple_of(c);
        if !(divides(grid.0, cluster.0) && divides(grid.1, cluster.1) && divides(grid.2, cluster.2)) {
            return Err(Error::InvalidArgument(format!("{name}: grid {grid:?} is not a multiple of {cluster:?}")));
        }
        check("cuFuncSetAttribute", crate::launch_ex::allow_non_portable_clusters(self.kernel_raw(kernel)?))?;
        self.launch_inner(kernel, grid, block, smem, args, self.programmatic.get(), Some(cluster))
    }

    /// Clusters of `cluster` blocks of `name` that fit on the GPU at once (0 where
    /// they cannot launch, or the driver cannot say); asked once per shape.
    pub fn max_active_clusters<A: abi::Params>(
        &self,
        kernel: Kernel<A>,
        grid: (u32, u32, u32),
        cluster: (u32, u32, u32),
        block: u32,
        smem: u32,
    ) -> Result<u32> {
        let name = kernel.name;
        let raw = self.kernel_raw(kernel)?;
        let key = (block, smem, cluster);
        if let Some(&n) = self.kernels.borrow().get(name).and_then(|k| k.clusters.get(&key)) {
            return Ok(n);
        }
        self.allow_dynamic_smem(name, smem)?;
        let n = if crate::launch_ex::allow_non_portable_clusters(raw) == sys::CUresult::CUDA_SUCCESS {
            crate::launch_ex::max_active_clusters(raw, grid, block, smem, cluster).unwrap_or(0).max(0) as u32
        } else {
            0
        };
        if let Some(k) = self.kernels.borrow_mut().get_mut(name) {
            k.clusters.insert(key, n);
        }
        Ok(n)
    }

    pub fn programmatic_launch(&self) -> bool {
        self.programmatic.get()
    }

    /// Runs `f` with the overlap left as it is (`on`) or turned off, then restores it.
    pub fn with_programmatic_launch<T>(&self, on: bool, f: impl FnOnce() -> T) -> T {
        let was = self.programmatic.get();
        self.programmatic.set(was && on);
        let r = f();
        self.programmatic.set(was);
        r
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_inner<A: abi::Params>(
        &self,
        kernel: Kernel<A>,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &A,
        programmatic: bool,
        cluster: Option<(u32, u32, u32)>,
    ) -> Result<()> {
        let name = kernel.name;
        if block == 0 || block > kernel.max_threads {
            return Err(Error::InvalidArgument(format!(
                "{name}: {block} threads per block; its launch bound is {}",
                kernel.max_threads
            )));
        }
        let raw = self.kernel_raw(kernel)?;
        self.allow_dynamic_smem(name, smem)?;
        self.launches.set(self.launches.get() + 1);
        let mut params = [args as *const A as *mut c_void];
        let stream = self.stream.as_inner();
        let (call, status) = if programmatic || cluster.is_some() {
            let status = crate::launch_ex::launch_with(
                raw,
                grid,
                block,
                smem,
                stream,
                params.as_mut_ptr(),
                programmatic,
                cluster,
            );
            ("cuLaunchKernelEx", status)
        } else {
            let status = sys::cuLaunchKernel(
                raw,
                grid.0,
                grid.1,
                grid.2,
                block,
                1,
                1,
                smem,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            );
            ("cuLaunchKernel", status)
        };
        check(call, status).map_err(|e| match e {
            Error::Cuda { call, detail } => Error::Cuda { call, detail: format!("{detail} (kernel {name})") },
            e => e,
        })
    }

    /// Records the launches `f` makes on the stream into a CUDA graph instead of
    /// running them. Calls that would synchronize or allocate while capturing
    /// fail (thread-local capture mode), so warm `f`'s buffers up first.
    pub fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<GraphExec> {
        let stream = self.stream.as_inner();
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // Recorded launches do not run: keep them out of the launch count, and
        // keep the workspace's pending re-zero (a recorded memset did not run either).
        let launches = self.launches.get();
        let dirty = self.workspace.borrow().dirty;
        // Loading a module while capturing may not be allowed: load it first.
        #[cfg(feature = "dev")]
        self.dev_module()?;
        check("cuStreamBeginCapture", unsafe { sys::cuStreamBeginCapture_v2(stream, mode) })?;
        self.capturing.set(true);
        let recorded = f();
        self.capturing.set(false);
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // End the capture even when `f` failed, so the stream is usable again.
        let ended = check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(stream, &mut graph) });
        self.launches.set(launches);
        self.workspace.borrow_mut().dirty = dirty;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        let instantiated = match (recorded, ended) {
            (Err(e), _) | (_, Err(e)) => Err(e),
            _ => check("cuGraphInstantiateWithFlags", unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }),
        };
        // The executable graph does not need its template.
        if !graph.is_null() {
            unsafe { sys::cuGraphDestroy(graph) };
        }
        instantiated.map(|_| GraphExec { exec })
    }

    /// Queues a captured graph on the stream.
    ///
    /// # Safety
    /// A graph keeps the raw device addresses of every launch it recorded: all
    /// the tensors and buffers those launches touched must still be alive, with
    /// the shapes they had at capture.
    pub unsafe fn launch_graph(&self, g: &GraphExec) -> Result<()> {
        self.launches.set(self.launches.get() + 1);
        check("cuGraphLaunch", sys::cuGraphLaunch(g.exec, self.stream.as_inner()))
    }

    /// Milliseconds the queued work in `f` takes on the GPU, by CUDA events.
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f32> {
        let start = Event::new(EventFlags::DEFAULT).map_err(cuda("cuEventCreate"))?;
        let stop = Event::new(EventFlags::DEFAULT).map_err(cuda("cuEventCreate"))?;
        start.record(&self.stream).map_err(cuda("cuEventRecord"))?;
        f()?;
        stop.record(&self.stream).map_err(cuda("cuEventRecord"))?;
        stop.synchronize().map_err(cuda("cuEventSynchronize"))?;
        stop.elapsed_time_f32(&start).map_err(cuda("cuEventElapsedTime"))
    }
}

/// An instantiated CUDA graph (see [`Gpu::capture`]). Drop it before its `Gpu`.
pub struct GraphExec {
    exec: sys::CUgraphExec,
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // SAFETY: the handle came from the driver and is owned here.
        unsafe { sys::cuGraphExecDestroy(self.exec) };
    }
}

/// A device buffer that only grows, by doubling, and keeps the buffers it
/// outgrows while it lives: a captured CUDA graph may hold their addresses, and
/// queued launches may still use them.
pub(crate) struct GrowOnlyBuffer<T: cust::memory::DeviceCopy> {
    live: Option<cust::memory::DeviceBuffer<T>>,
    retired: Vec<cust::memory::DeviceBuffer<T>>,
}

impl<T: cust::memory::DeviceCopy + cust::memory::bytemuck::Zeroable> GrowOnlyBuffer<T> {
    /// [`at_least`](Self::at_least) with new buffers zeroed, and the zeroing
    /// finished before this returns: it runs on the legacy stream, unordered with ours.
    pub(crate) fn zeroed_at_least(&mut self, len: usize) -> Result<u64> {
        let (ptr, fresh) = self.at_least(len, |n| cust::memory::DeviceBuffer::zeroed(n).map_err(cuda("cuMemAlloc")))?;
        if fresh {
            cust::context::CurrentContext::synchronize().map_err(cuda("cuCtxSynchronize"))?;
        }
        Ok(ptr)
    }
}

/// The split-K workspace: zero between GEMMs, except for a prefix a failed
/// split-K left behind, zeroed before the next use.
#[derive(Default)]
pub(crate) struct Workspace {
    buf: GrowOnlyBuffer<f32>,
    /// Leading f32 that may be non-zero.
    dirty: usize,
}

impl Workspace {
    fn mark_dirty(&mut self, len: usize) {
        self.dirty = self.dirty.max(len);
    }

    /// The f32 to zero before the buffer is handed out again (none in a new,
    /// zeroed buffer), and the mark cleared.
    fn take_dirty(&mut self, fresh: bool) -> usize {
        let dirty = std::mem::take(&mut self.dirty);
        if fresh {
            0
        } else {
            dirty
        }
    }
}

impl<T: cust::memory::DeviceCopy> Default for GrowOnlyBuffer<T> {
    fn default() -> Self {
        GrowOnlyBuffer { live: None, retired: Vec::new() }
    }
}

impl<T: cust::memory::DeviceCopy> GrowOnlyBuffer<T> {
    /// Device address of at least `len` elements, allocating (with `alloc`, of a
    /// power-of-two length) when the live buffer is shorter; also whether it did.
    pub(crate) fn at_least(
        &mut self,
        len: usize,
        alloc: impl FnOnce(usize) -> Result<cust::memory::DeviceBuffer<T>>,
    ) -> Result<(u64, bool)> {
        let fresh = self.live.as_ref().is_none_or(|b| b.len() < len);
        if fresh {
            if let Some(old) = self.live.replace(alloc(len.next_power_of_two())?) {
                self.retired.push(old);
            }
        }
        Ok((self.live.as_ref().unwrap().as_device_ptr().as_raw(), fresh))
    }

    /// Elements in the live buffer (0 before the first use).
    pub(crate) fn len(&self) -> usize {
        self.live.as_ref().map_or(0, |b| b.len())
    }
}

impl GrowOnlyBuffer<u32> {
    /// `data` copied in on the GPU's stream, after the launches queued before it
    /// (which read the old contents), the buffer grown to fit first; the device
    /// address. Its owner must synchronize before freeing it.
    pub(crate) fn upload(&mut self, gpu: &Gpu, data: &[u32]) -> Result<u64> {
        // SAFETY (alloc): u32 has no invalid bit patterns, and every word a user
        // reads is copied in first. No zeroing memset: it would run on the legacy
        // stream, unordered with the copies on ours.
        let alloc = |n| unsafe { cust::memory::DeviceBuffer::uninitialized(n) }.map_err(cuda("cuMemAlloc"));
        let (ptr, _) = self.at_least(data.len().max(1), alloc)?;
        // SAFETY: the live buffer holds at least `data.len()` words, and its owner
        // keeps it (and what it outgrew) until the stream has run the copy.
        if !data.is_empty() {
            unsafe { gpu.upload_u32(ptr, data)? };
        }
        Ok(ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::Workspace;

    #[test]
    fn workspace_zeroes_what_a_failed_split_left_once() {
        let mut ws = Workspace::default();
        assert_eq!(ws.take_dirty(false), 0);
        // Two failed users: the longer prefix is zeroed, once.
        ws.mark_dirty(4096);
        ws.mark_dirty(1024);
        assert_eq!(ws.take_dirty(false), 4096);
        assert_eq!(ws.take_dirty(false), 0);
        // A new buffer is zeroed already; the mark on the old one goes.
        ws.mark_dirty(4096);
        assert_eq!(ws.take_dirty(true), 0);
        assert_eq!(ws.take_dirty(false), 0);
    }
}
