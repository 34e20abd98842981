//! `Allocator`: the handle to one device's caching allocator, typed by the kind of device.

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::ValidAsZeroBits;

use crate::backend::cuda::CudaBackend;
use crate::backend::host::HostBackend;
use crate::backend::sim::SimDevice;
use crate::backend::Backend;
use crate::buffer::Buffer;
use crate::caching::{DeviceAllocator, Request};
use crate::config::Config;
use crate::elem::AnyBitPattern;
use crate::error::{Error, Result};
use crate::id::{AllocatorId, PoolRef, StreamId, StreamRef};
pub use crate::kind::{Cuda, Host, Kind, Sim, SimGraph};
pub(crate) use crate::kind::{CudaExt, Handle, Shared};
use crate::snapshot::Snapshot;
use crate::stats::MemoryStats;
use crate::stream::{self, StreamGuard};

/// A device's caching allocator. Cloning gives another handle to the same allocator.
///
/// `Allocator<Cuda>` (the default) comes from [`Allocator::cuda`]: one per device for the whole
/// process, created on first use with [`Config::from_env`]. Host and simulated allocators are
/// made with [`Allocator::host`] and [`Allocator::sim`], each its own.
pub struct Allocator<K: Kind = Cuda> {
    pub(crate) shared: Handle<K>,
}

impl<K: Kind> Clone for Allocator<K> {
    fn clone(&self) -> Self {
        Allocator { shared: self.shared.clone() }
    }
}

impl<K: Kind> fmt::Debug for Allocator<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocator")
            .field("backend", &self.shared.core.backend().kind())
            .field("device", &self.shared.device)
            .finish()
    }
}

fn shared<K: Kind>(backend: Arc<dyn Backend>, config: Config, ext: K::Ext) -> Shared<K> {
    let device = backend.device();
    let id = AllocatorId::fresh();
    Shared::new(DeviceAllocator::new(backend, config, id), id.0, device, ext)
}

/// `MEMPOOL_RECORD_HISTORY`, `MEMPOOL_RECORD_STACKS` and `MEMPOOL_SNAPSHOT_ON_OOM`, read when the
/// first allocator is made.
struct EnvSettings {
    snapshot_on_oom: Option<std::path::PathBuf>,
}

fn env_settings() -> &'static EnvSettings {
    static SETTINGS: OnceLock<EnvSettings> = OnceLock::new();
    SETTINGS.get_or_init(|| {
        if let Some(n) = std::env::var("MEMPOOL_RECORD_HISTORY").ok().and_then(|v| v.trim().parse::<usize>().ok()) {
            crate::trace::record_history(n);
        }
        match std::env::var("MEMPOOL_RECORD_STACKS").as_deref().map(str::trim) {
            Ok("sites") => crate::record_stacks(crate::stacks::StackMode::Sites),
            Ok("full") => crate::record_stacks(crate::stacks::StackMode::Full),
            _ => {}
        }
        EnvSettings { snapshot_on_oom: std::env::var_os("MEMPOOL_SNAPSHOT_ON_OOM").map(Into::into) }
    })
}

/// A new allocator; what its settings ask for at creation failing (the reserve segment, the
/// background thread) is kept as its error, reported by the next call that can fail.
fn make<K: Kind>(backend: Arc<dyn Backend>, config: Config, ext: K::Ext) -> Allocator<K> {
    let (a, started) = make_started(backend, config, ext);
    if let Err(e) = started {
        a.shared.core.keep_error(e);
    }
    a
}

/// A new allocator, and whether what its settings ask for at creation could be done.
fn make_started<K: Kind>(backend: Arc<dyn Backend>, config: Config, ext: K::Ext) -> (Allocator<K>, Result<()>) {
    env_settings();
    let s = Arc::new(shared(backend, config, ext));
    // Both are tried: a reserve that cannot be had does not switch the thread off.
    let reserve = s.core.make_reserve();
    let background = s.core.start_background();
    (Allocator { shared: Handle::Owned(s) }, reserve.and(background))
}

/// Per device: the allocator once made (read without a lock on every `mempool::alloc`), and a
/// lock that only its creation takes.
type CudaSlots = Vec<(OnceLock<Allocator<Cuda>>, Mutex<()>)>;

fn cuda_slots() -> Result<&'static CudaSlots> {
    static SLOTS: OnceLock<CudaSlots> = OnceLock::new();
    device_slots(&SLOTS)
}

/// One slot per CUDA device in `slots`, made on first use.
fn device_slots(slots: &'static OnceLock<CudaSlots>) -> Result<&'static CudaSlots> {
    if let Some(s) = slots.get() {
        return Ok(s);
    }
    let n = crate::backend::cuda::device_count()?;
    Ok(slots.get_or_init(|| (0..n).map(|_| (OnceLock::new(), Mutex::new(()))).collect()))
}

/// The process-wide allocator in `slots` for device `ordinal`: the one made already, or the one
/// `make` makes (once: callers racing for it wait on the slot's lock), leaked for the process.
fn process_wide(
    slots: &'static CudaSlots,
    ordinal: usize,
    make: impl FnOnce() -> Result<(Arc<CudaBackend>, Config)>,
) -> Result<Allocator<Cuda>> {
    let (slot, creating) = slots.get(ordinal).ok_or(Error::InvalidDevice { device: ordinal, count: slots.len() })?;
    if let Some(a) = slot.get() {
        return Ok(a.clone());
    }
    let _creating = creating.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(a) = slot.get() {
        return Ok(a.clone());
    }
    let (backend, config) = make()?;
    let ext = CudaExt::new(backend.clone());
    env_settings();
    let s = Box::new(shared::<Cuda>(backend, config, ext));
    // Before it is leaked: an allocator whose reserve segment cannot be had is dropped here.
    s.core.make_reserve()?;
    // Lives for the rest of the process, like the device itself (its background thread too).
    let s: &'static Shared<Cuda> = Box::leak(s);
    // Not started: the allocator still works (allocations process events); the error is
    // reported by its next fallible call, as the slot keeps the allocator.
    if let Err(e) = s.core.start_background() {
        s.core.keep_error(e);
    }
    let a = Allocator { shared: Handle::Static(s) };
    Ok(slot.get_or_init(|| a).clone())
}

impl Allocator<Cuda> {
    /// The process-wide allocator of CUDA device `ordinal`, created on first use with the
    /// settings of `MEMPOOL_ALLOC_CONF`.
    ///
    /// Errors: [`Error::NoCudaDriver`] without a driver, [`Error::InvalidDevice`] (naming the
    /// device count) for an index that does not exist, [`Error::Config`] for a bad
    /// `MEMPOOL_ALLOC_CONF`.
    pub fn cuda(ordinal: usize) -> Result<Allocator<Cuda>> {
        process_wide(cuda_slots()?, ordinal, || {
            let config = Config::from_env()?;
            let backend = Arc::new(if config.malloc_async {
                CudaBackend::malloc_async(ordinal)?
            } else {
                CudaBackend::new(ordinal)?
            });
            if config.expandable_segments && backend.vm_granularity().is_none() {
                return Err(Error::Config(format!(
                    "{}: expandable_segments:True, but CUDA device {ordinal} has no virtual memory management",
                    crate::config::ENV_VAR
                )));
            }
            Ok((backend, config))
        })
    }

    /// The process-wide pinned host memory allocator of CUDA device `ordinal` (PyTorch's
    /// `CachingHostAllocator`, `pin_memory=True`), created on first use with the settings of
    /// `MEMPOOL_ALLOC_CONF`: page-locked host memory, mapped for the device, carved and cached
    /// by the same algorithm as device memory. Its buffers are `Buffer<T, Cuda>`: cudarc's
    /// asynchronous copies and kernels take them as they take device memory (the host address is
    /// the device address), and [`Buffer::host_slice`] / [`Buffer::host_slice_mut`] give the
    /// host view. A freed buffer's memory is handed out again only once the work queued on the
    /// streams that used it, its own included, is done, so no copy still reading it can see the
    /// next owner's writes (the host is not stream-ordered); a buffer the device never used
    /// goes back at once (through the thread caches). No expandable segments.
    ///
    /// `pinned_reserve_segment_size_mb` gives it a reserve segment, allocated here and kept until
    /// the process ends, that the small requests of the default stream are carved from;
    /// `pinned_use_background_threads` gives it a thread that files the blocks whose events
    /// completed, instead of the next allocation (see the table in [`config`](crate::config)).
    ///
    /// Errors: as [`cuda`](Self::cuda), and a reserve segment that cannot be allocated.
    pub fn pinned(ordinal: usize) -> Result<Allocator<Cuda>> {
        static SLOTS: OnceLock<CudaSlots> = OnceLock::new();
        process_wide(device_slots(&SLOTS)?, ordinal, || pinned_parts(ordinal, Config::from_env()?))
    }

    /// A new pinned host memory allocator of device `ordinal` with these settings (not the
    /// process-wide one): for `pinned_use_cuda_host_register` in one part of a program, say.
    ///
    /// With `pinned_reserve_segment_size_mb`, the reserve segment is allocated here (an error if
    /// it cannot be); with `pinned_use_background_threads`, the allocator's background event
    /// thread starts here and ends when the allocator is dropped (its last handle and buffer).
    pub fn pinned_with(ordinal: usize, config: Config) -> Result<Allocator<Cuda>> {
        let (backend, config) = pinned_parts(ordinal, config)?;
        let ext = CudaExt::new(backend.clone());
        let (a, started) = make_started::<Cuda>(backend, config, ext);
        started.map(|()| a)
    }

    /// Whether this allocator makes pinned host memory ([`pinned`](Self::pinned)).
    pub fn is_pinned(&self) -> bool {
        self.shared.ext.is_pinned()
    }

    /// The allocator of CUDA device `ordinal` if it exists already (never creates one, nor a
    /// context: what FFI callers that only look, or free, want).
    pub fn cuda_if_created(ordinal: usize) -> Option<Allocator<Cuda>> {
        cuda_slots().ok()?.get(ordinal)?.0.get().cloned()
    }

    /// The allocators created so far, in device order.
    pub(crate) fn created() -> Vec<Allocator<Cuda>> {
        match cuda_slots() {
            Ok(slots) => slots.iter().filter_map(|(s, _)| s.get().cloned()).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// The cudarc context of this device.
    pub fn context(&self) -> &Arc<cudarc::driver::CudaContext> {
        self.shared.ext.context()
    }

    /// Lets device `peer`'s kernels and copies read and write this allocator's memory: peer
    /// access from `peer`'s context to this device's (`cuCtxEnablePeerAccess`; enabling it
    /// twice is not an error). Expandable segments grant every peer that can reach the device
    /// access when they map, so they need nothing more; a stream-ordered pool source has its own
    /// [`access_from`](crate::backend::stream_ordered::StreamOrderedAllocator::access_from).
    /// The peer's primary context stays retained as long as this allocator lives, so the access
    /// lasts. Pinned host memory needs nothing (every device reaches it already). Errors: no
    /// such device, a device that cannot reach this one.
    pub fn access_from(&self, peer: usize) -> Result<()> {
        self.shared.ext.backend().enable_peer_access(peer)
    }
}

/// A pinned backend for `config` (registered memory if it says so) and the settings in effect
/// (no expandable segments: pinned memory is not mapped on demand).
fn pinned_parts(ordinal: usize, mut config: Config) -> Result<(Arc<CudaBackend>, Config)> {
    config.expandable_segments = false;
    let register = config.pinned_use_cuda_host_register.then_some(config.pinned_num_register_threads);
    Ok((Arc::new(CudaBackend::pinned_with(ordinal, register)?), config))
}

impl Allocator<Host> {
    /// A new allocator over host memory (page-locked through CUDA when a GPU is present).
    pub fn host() -> Allocator<Host> {
        Self::host_with(HostBackend::new(), Config::default())
    }

    /// A new host allocator over the given backend, with these settings.
    pub fn host_with(backend: HostBackend, config: Config) -> Allocator<Host> {
        make::<Host>(Arc::new(backend), config, ())
    }
}

impl Allocator<Sim> {
    /// A new allocator over a simulated device.
    pub fn sim(device: Arc<SimDevice>) -> Allocator<Sim> {
        Self::sim_with(device, Config::default())
    }

    /// A new allocator over a simulated device, with these settings.
    pub fn sim_with(device: Arc<SimDevice>, config: Config) -> Allocator<Sim> {
        make::<Sim>(device.clone(), config, device)
    }
}

impl<K: Kind> Allocator<K> {
    /// This allocator, kept for the rest of the process as the process-wide CUDA allocators
    /// ([`Allocator::cuda`], [`Allocator::pinned`]) are: its clones and buffers reach it by
    /// reference and no longer count references (an atomic add and subtract fewer per
    /// allocation, a third of a cache hit's time on the simulated device). Its memory is
    /// released only by [`empty_cache`](Self::empty_cache), and its background thread (if any)
    /// runs until the process ends. For an allocator that lives as long as the program anyway.
    pub fn leak(self) -> Allocator<K> {
        match self.shared {
            Handle::Static(s) => Allocator { shared: Handle::Static(s) },
            Handle::Owned(a) => {
                let kept: &'static Arc<Shared<K>> = Box::leak(Box::new(a));
                Allocator { shared: Handle::Static(kept) }
            }
        }
    }

    /// The device index.
    pub fn device(&self) -> usize {
        self.shared.device
    }

    /// The backend's kind: `"cuda"`, `"host"` or `"sim"`.
    pub fn backend_kind(&self) -> &'static str {
        self.shared.core.backend().kind()
    }

    /// The allocator's id, as trace entries carry it.
    pub fn id(&self) -> AllocatorId {
        self.shared.core.id()
    }

    /// This thread's current stream for this device (the default stream unless a
    /// [`StreamGuard`] says otherwise).
    pub fn current_stream(&self) -> K::Stream {
        let key = self.shared.key;
        K::resolve(&self.shared, stream::current(key), stream::current_keep(key))
    }

    /// The id (device handle) of this thread's current stream for this device.
    pub fn current_stream_id(&self) -> StreamId {
        stream::current(self.shared.key).raw
    }

    /// Makes `stream` this thread's current stream for this device until the guard drops (the
    /// guard holds the stream alive).
    pub fn set_stream(&self, stream: &K::Stream) -> Result<StreamGuard> {
        self.check_device(stream, "set_stream")?;
        StreamGuard::new(self.shared.key, K::stream_ref(stream), K::keep(stream))
            .ok_or(Error::ThreadExiting { what: "set_stream" })
    }

    /// With `MEMPOOL_SNAPSHOT_ON_OOM=<path>`: writes a snapshot there before an out-of-memory
    /// error returns (a failure to write it is reported on stderr; the error stays the OOM).
    #[cold]
    fn on_error(&self, e: Error) -> Error {
        if let (Error::OutOfMemory(_), Some(path)) = (&e, &env_settings().snapshot_on_oom) {
            if let Err(w) = self.snapshot().write_pickle(path) {
                // Not `eprintln!`: it panics when stderr is gone, and this runs inside FFI callers.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "mempool: MEMPOOL_SNAPSHOT_ON_OOM: {w}");
            }
        }
        e
    }

    pub(crate) fn check_device(&self, stream: &K::Stream, what: &'static str) -> Result<()> {
        crate::kind::check_stream::<K>(stream, self.shared.device, what)
    }

    /// A buffer of `len` elements of `T` on the current stream. Its contents are whatever the
    /// memory held before (cached memory is reused as it is), which is why `T` must be valid at
    /// every bit pattern ([`AnyBitPattern`]: integers, floats, arrays of them). For other types:
    /// [`alloc_zeros`](Self::alloc_zeros), or the `unsafe` [`alloc_uninit`](Self::alloc_uninit).
    /// `len == 0` gives an empty buffer that holds no memory.
    ///
    /// Inside a [`MemPool::scope`](crate::MemPool::scope) of this thread on the current stream,
    /// the buffer comes from that pool (the innermost scope wins).
    #[inline(always)]
    pub fn alloc<T: AnyBitPattern>(&self, len: usize) -> Result<Buffer<T, K>> {
        let (stream, pool) = stream::current_with_pool(self.shared.key);
        self.alloc_at(len, stream, pool)
    }

    /// A buffer of `len` elements of any type `T`, holding whatever the memory held before.
    ///
    /// # Safety
    /// The contents are not valid values of `T` in general: nothing may read them as `T` (a copy
    /// to the host, a kernel that reads them) before they are written with valid values.
    pub unsafe fn alloc_uninit<T>(&self, len: usize) -> Result<Buffer<T, K>> {
        let (stream, pool) = stream::current_with_pool(self.shared.key);
        self.alloc_at(len, stream, pool)
    }

    /// Like [`alloc`](Self::alloc), filled with zero bytes (ordered on the current stream), for
    /// any type that is valid as all zeros (cudarc's `ValidAsZeroBits`: numbers, `bool`, arrays
    /// and tuples of them).
    pub fn alloc_zeros<T: ValidAsZeroBits>(&self, len: usize) -> Result<Buffer<T, K>> {
        let (stream, pool) = stream::current_with_pool(self.shared.key);
        let b = self.alloc_at::<T>(len, stream, pool)?;
        self.zero(&b)?;
        Ok(b)
    }

    /// Zero-fills a buffer just allocated, on its stream.
    pub(crate) fn zero<T>(&self, b: &Buffer<T, K>) -> Result<()> {
        if b.num_bytes() > 0 {
            // SAFETY: the range is exactly the buffer's, inside one live segment of this
            // allocator's backend (a pool allocator's segments are promised to be memory of this
            // device by its `unsafe impl`), owned by the buffer, which nothing else references
            // yet; its stream is alive: the buffer's segment holds it.
            unsafe { self.shared.core.backend().zero(b.device_ptr_raw(), b.num_bytes(), b.stream_id()) }
                .map_err(|e| e.into_error("zero fill"))?;
        }
        Ok(())
    }

    /// A buffer from `pool` on the current stream, whatever the scopes say.
    pub(crate) fn alloc_in<T>(&self, len: usize, pool: PoolRef) -> Result<Buffer<T, K>> {
        self.alloc_at(len, stream::current(self.shared.key), pool)
    }

    #[inline(always)]
    fn alloc_at<T>(&self, len: usize, stream: StreamRef, pool: PoolRef) -> Result<Buffer<T, K>> {
        let elem = std::mem::size_of::<T>();
        let bytes = len.checked_mul(elem).ok_or_else(|| Error::SizeOverflow { len, elem_size: elem })?;
        if bytes == 0 {
            return Ok(Buffer::empty(self.shared.clone(), len, stream));
        }
        // The cache's hit builds its buffer apart from the other paths (see `malloc_cached`),
        // and makes no `Request`.
        if let Some(a) = self.shared.core.malloc_cached(bytes, stream.key, pool) {
            return Ok(Buffer::new(self.shared.clone(), a, len, stream));
        }
        let key = self.shared.key;
        let req = Request { size: bytes, stream, pool, keep: &|| stream::current_keep(key) };
        match self.shared.core.malloc_slow(&req) {
            Ok(a) => Ok(Buffer::new(self.shared.clone(), a, len, stream)),
            Err(e) => Err(self.on_error(e)),
        }
    }

    /// `size` bytes on the current stream (from the pool of the innermost scope, if any), as a raw
    /// device address for FFI; give it back with
    /// [`free_bytes`](Self::free_bytes). `size == 0` returns 0.
    pub fn alloc_bytes(&self, size: usize) -> Result<u64> {
        if size == 0 {
            return Ok(0);
        }
        let key = self.shared.key;
        let (stream, pool) = stream::current_with_pool(key);
        let req = Request { size, stream, pool, keep: &|| stream::current_keep(key) };
        self.shared.core.malloc_raw(&req).map_err(|e| self.on_error(e))
    }

    /// Gives back an address from [`alloc_bytes`](Self::alloc_bytes). A foreign or already freed
    /// address is [`Error::InvalidFree`] and changes nothing; 0 is ignored.
    pub fn free_bytes(&self, ptr: u64) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        self.shared.core.free_raw(ptr)
    }

    /// Notes that the raw allocation at `ptr` is used on `stream`: on free, its memory is reused
    /// only after the work queued on `stream` until then has completed.
    pub fn record_stream_bytes(&self, ptr: u64, stream: &K::Stream) -> Result<()> {
        self.check_device(stream, "record_stream_bytes")?;
        if self.shared.core.record_stream_raw(ptr, K::stream_ref(stream), K::keep(stream)) {
            Ok(())
        } else {
            Err(Error::InvalidFree { ptr, device: self.shared.device })
        }
    }

    /// Waits for pending cross-stream frees, then gives every wholly free cached segment back to
    /// the device (a pinned allocator's reserve segment excepted: it goes only when the
    /// allocator is dropped). Reports an error kept from an earlier `Drop`.
    pub fn empty_cache(&self) -> Result<()> {
        self.shared.core.empty_cache()
    }

    /// The statistics (`torch.cuda.memory_stats()`).
    pub fn memory_stats(&self) -> MemoryStats {
        self.shared.core.stats()
    }

    /// Resets every peak to its current value.
    pub fn reset_peak_stats(&self) {
        self.shared.core.reset_peak_stats()
    }

    /// A table of the statistics (`torch.cuda.memory_summary()`).
    pub fn memory_summary(&self) -> String {
        let title = format!("mempool {} memory summary, device {}", self.backend_kind(), self.device());
        self.memory_stats().summary(&title)
    }

    /// The segments and blocks of this device now.
    pub fn snapshot(&self) -> Snapshot {
        self.shared.core.snapshot()
    }

    /// Limits this allocator to `fraction` of the device's total memory (1.0: no limit).
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        self.shared.core.set_memory_fraction(fraction)
    }

    /// The settings in force.
    pub fn config(&self) -> Config {
        self.shared.core.config()
    }

    /// An error kept from a `Drop` (a failed segment free or event record), taken; the next
    /// allocation would otherwise report it.
    pub fn take_error(&self) -> Option<Error> {
        self.shared.core.take_error()
    }

    /// `(free, total)` device memory, where the backend knows it.
    pub fn device_memory(&self) -> Option<(usize, usize)> {
        self.shared.core.backend().memory_info()
    }
}
