//! `Allocator`: the handle to one device's caching allocator, typed by the kind of device.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudarc::driver::CudaStream;

use crate::backend::cuda::CudaBackend;
use crate::backend::host::HostBackend;
use crate::backend::sim::{SimDevice, SimStream};
use crate::backend::{Backend, StreamId};
use crate::buffer::Buffer;
use crate::caching::{DeviceAllocator, PoolRef};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::snapshot::Snapshot;
use crate::stats::MemoryStats;
use crate::stream::{self, StreamGuard};

mod sealed {
    pub trait Sealed {}
}

/// The kind of device an [`Allocator`] serves: [`Cuda`], [`Host`] or [`Sim`]. It fixes the type
/// of the streams, and which traits a [`Buffer`] implements (only CUDA buffers implement cudarc's
/// `DevicePtr`, so a simulated buffer can never reach a kernel).
pub trait Kind: sealed::Sealed + Sized + Send + Sync + 'static {
    /// A stream of this kind of device.
    type Stream: Clone + Send + Sync + 'static;
    #[doc(hidden)]
    type Ext: Send + Sync + 'static;
    #[doc(hidden)]
    type StreamCache: Default + Send + Sync + 'static;
    #[doc(hidden)]
    fn stream_id(s: &Self::Stream) -> StreamId;
    #[doc(hidden)]
    fn stream_device(s: &Self::Stream, allocator_device: usize) -> usize;
    /// Called when a stream becomes current, so that `resolve` can find it later.
    #[doc(hidden)]
    fn register(_shared: &Shared<Self>, _s: &Self::Stream) {}
    #[doc(hidden)]
    fn resolve(shared: &Shared<Self>, id: StreamId) -> Self::Stream;
}

/// NVIDIA GPUs through cudarc. Streams are cudarc's `Arc<CudaStream>`.
#[derive(Debug)]
pub struct Cuda;
/// Host memory (pinned when CUDA is present). Streams are notional ids.
#[derive(Debug)]
pub struct Host;
/// The simulated device of [`sim`](crate::sim). Streams are [`SimStream`]s from [`SimDevice::new_stream`].
#[derive(Debug)]
pub struct Sim;

impl sealed::Sealed for Cuda {}
impl sealed::Sealed for Host {}
impl sealed::Sealed for Sim {}

#[doc(hidden)]
pub struct CudaExt {
    backend: Arc<CudaBackend>,
    /// Streams made current through this allocator, by handle, so that a buffer can give cudarc
    /// its stream without holding a reference count on the hot path.
    streams: Mutex<HashMap<u64, Weak<CudaStream>>>,
}

impl Kind for Cuda {
    type Stream = Arc<CudaStream>;
    type Ext = CudaExt;
    type StreamCache = OnceLock<Arc<CudaStream>>;
    fn stream_id(s: &Arc<CudaStream>) -> StreamId {
        StreamId(s.cu_stream() as u64)
    }
    fn stream_device(s: &Arc<CudaStream>, _: usize) -> usize {
        s.context().ordinal()
    }
    fn register(shared: &Shared<Cuda>, s: &Arc<CudaStream>) {
        if !s.cu_stream().is_null() {
            let mut m = shared.ext.streams.lock().unwrap_or_else(|p| p.into_inner());
            m.retain(|_, w| w.strong_count() > 0);
            m.insert(s.cu_stream() as u64, Arc::downgrade(s));
        }
    }
    /// The stream with this handle; the device's default stream for 0, or if the stream was
    /// dropped since it was made current.
    fn resolve(shared: &Shared<Cuda>, id: StreamId) -> Arc<CudaStream> {
        let m = shared.ext.streams.lock().unwrap_or_else(|p| p.into_inner());
        match m.get(&id.0).and_then(Weak::upgrade) {
            Some(s) => s,
            None => shared.ext.backend.context().default_stream(),
        }
    }
}

impl Kind for Host {
    type Stream = StreamId;
    type Ext = ();
    type StreamCache = ();
    fn stream_id(s: &StreamId) -> StreamId {
        *s
    }
    fn stream_device(_: &StreamId, d: usize) -> usize {
        d
    }
    fn resolve(_: &Shared<Host>, id: StreamId) -> StreamId {
        id
    }
}

impl Kind for Sim {
    type Stream = SimStream;
    type Ext = ();
    type StreamCache = ();
    fn stream_id(s: &SimStream) -> StreamId {
        s.id
    }
    fn stream_device(s: &SimStream, _: usize) -> usize {
        s.device
    }
    fn resolve(shared: &Shared<Sim>, id: StreamId) -> SimStream {
        SimStream { device: shared.device, id }
    }
}

#[doc(hidden)]
pub struct Shared<K: Kind> {
    pub(crate) core: DeviceAllocator,
    pub(crate) key: u32,
    pub(crate) device: usize,
    ext: K::Ext,
}

/// How buffers and handles reach their allocator: the process-wide CUDA allocators live for the
/// whole process and are shared by reference (no reference count to bump per allocation); the
/// others are reference counted.
pub(crate) enum Handle<K: Kind> {
    Static(&'static Shared<K>),
    Owned(Arc<Shared<K>>),
}

impl<K: Kind> Clone for Handle<K> {
    fn clone(&self) -> Self {
        match self {
            Handle::Static(s) => Handle::Static(s),
            Handle::Owned(a) => Handle::Owned(a.clone()),
        }
    }
}

impl<K: Kind> std::ops::Deref for Handle<K> {
    type Target = Shared<K>;
    #[inline]
    fn deref(&self) -> &Shared<K> {
        match self {
            Handle::Static(s) => s,
            Handle::Owned(a) => a,
        }
    }
}

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

static NEXT_KEY: AtomicU32 = AtomicU32::new(1);

fn shared<K: Kind>(backend: Arc<dyn Backend>, config: Config, ext: K::Ext) -> Shared<K> {
    let device = backend.device();
    Shared { core: DeviceAllocator::new(backend, config), key: NEXT_KEY.fetch_add(1, Ordering::Relaxed), device, ext }
}

/// `MEMPOOL_RECORD_HISTORY` and `MEMPOOL_SNAPSHOT_ON_OOM`, read when the first allocator is made.
struct EnvSettings {
    snapshot_on_oom: Option<std::path::PathBuf>,
}

fn env_settings() -> &'static EnvSettings {
    static SETTINGS: OnceLock<EnvSettings> = OnceLock::new();
    SETTINGS.get_or_init(|| {
        if let Some(n) = std::env::var("MEMPOOL_RECORD_HISTORY").ok().and_then(|v| v.trim().parse::<usize>().ok()) {
            crate::trace::record_history(n);
        }
        EnvSettings { snapshot_on_oom: std::env::var_os("MEMPOOL_SNAPSHOT_ON_OOM").map(Into::into) }
    })
}

fn make<K: Kind>(backend: Arc<dyn Backend>, config: Config, ext: K::Ext) -> Allocator<K> {
    env_settings();
    Allocator { shared: Handle::Owned(Arc::new(shared(backend, config, ext))) }
}

/// Per device: the allocator once made (read without a lock on every `mempool::alloc`), and a
/// lock that only its creation takes.
type CudaSlots = Vec<(OnceLock<Allocator<Cuda>>, Mutex<()>)>;

fn cuda_slots() -> Result<&'static CudaSlots> {
    static SLOTS: OnceLock<CudaSlots> = OnceLock::new();
    if let Some(s) = SLOTS.get() {
        return Ok(s);
    }
    let n = crate::backend::cuda::device_count()?;
    Ok(SLOTS.get_or_init(|| (0..n).map(|_| (OnceLock::new(), Mutex::new(()))).collect()))
}

impl Allocator<Cuda> {
    /// The process-wide allocator of CUDA device `ordinal`, created on first use with the
    /// settings of `MEMPOOL_ALLOC_CONF`.
    ///
    /// Errors: [`Error::NoCudaDriver`] without a driver, [`Error::InvalidDevice`] (naming the
    /// device count) for an index that does not exist, [`Error::Config`] for a bad
    /// `MEMPOOL_ALLOC_CONF`.
    pub fn cuda(ordinal: usize) -> Result<Allocator<Cuda>> {
        let slots = cuda_slots()?;
        let (slot, creating) =
            slots.get(ordinal).ok_or(Error::InvalidDevice { device: ordinal, count: slots.len() })?;
        if let Some(a) = slot.get() {
            return Ok(a.clone());
        }
        let _creating = creating.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = slot.get() {
            return Ok(a.clone());
        }
        let config = Config::from_env()?;
        let backend = Arc::new(CudaBackend::new(ordinal)?);
        let ext = CudaExt { backend: backend.clone(), streams: Mutex::new(HashMap::new()) };
        // Lives for the rest of the process, like the device itself.
        env_settings();
        let a = Allocator { shared: Handle::Static(Box::leak(Box::new(shared::<Cuda>(backend, config, ext)))) };
        Ok(slot.get_or_init(|| a).clone())
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
        self.shared.ext.backend.context()
    }
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
        make::<Sim>(device, config, ())
    }
}

impl<K: Kind> Allocator<K> {
    /// The device index.
    pub fn device(&self) -> usize {
        self.shared.device
    }

    /// The backend's kind: `"cuda"`, `"host"` or `"sim"`.
    pub fn backend_kind(&self) -> &'static str {
        self.shared.core.backend().kind()
    }

    /// This thread's current stream for this device (the default stream unless a
    /// [`StreamGuard`] says otherwise).
    pub fn current_stream(&self) -> K::Stream {
        K::resolve(&self.shared, self.current_stream_id())
    }

    /// The id of this thread's current stream for this device.
    pub fn current_stream_id(&self) -> StreamId {
        stream::current(self.shared.key)
    }

    /// Makes `stream` this thread's current stream for this device until the guard drops.
    pub fn set_stream(&self, stream: &K::Stream) -> Result<StreamGuard> {
        self.check_device(stream, "set_stream")?;
        K::register(&self.shared, stream);
        Ok(StreamGuard::new(self.shared.key, K::stream_id(stream)))
    }

    /// With `MEMPOOL_SNAPSHOT_ON_OOM=<path>`: writes a snapshot there before an out-of-memory
    /// error returns (a failure to write it is reported on stderr; the error stays the OOM).
    #[cold]
    fn on_error(&self, e: Error) -> Error {
        if let (Error::OutOfMemory(_), Some(path)) = (&e, &env_settings().snapshot_on_oom) {
            if let Err(w) = self.snapshot().write_pickle(path) {
                eprintln!("mempool: MEMPOOL_SNAPSHOT_ON_OOM: {w}");
            }
        }
        e
    }

    pub(crate) fn check_device(&self, stream: &K::Stream, what: &'static str) -> Result<()> {
        let found = K::stream_device(stream, self.shared.device);
        if found != self.shared.device {
            return Err(Error::WrongDevice { what, expected: self.shared.device, found });
        }
        Ok(())
    }

    /// A buffer of `len` elements of `T` on the current stream; its contents are undefined.
    /// `len == 0` gives an empty buffer that holds no memory.
    ///
    /// Inside a [`MemPool::scope`](crate::MemPool::scope) of this thread on the current stream,
    /// the buffer comes from that pool (the innermost scope wins).
    #[inline]
    pub fn alloc<T>(&self, len: usize) -> Result<Buffer<T, K>> {
        let (stream, pool) = stream::current_with_pool(self.shared.key);
        self.alloc_at(len, stream, pool)
    }

    /// Like [`alloc`](Self::alloc), filled with zero bytes (ordered on the current stream).
    pub fn alloc_zeros<T>(&self, len: usize) -> Result<Buffer<T, K>> {
        let b = self.alloc::<T>(len)?;
        if b.num_bytes() > 0 {
            let stream = b.stream_id();
            self.shared
                .core
                .backend()
                .zero(b.device_ptr_raw(), b.num_bytes(), stream)
                .map_err(|e| Error::Backend { op: "zero fill", message: e.to_string() })?;
        }
        Ok(b)
    }

    /// A buffer from `pool` on the current stream, whatever the scopes say.
    pub(crate) fn alloc_in<T>(&self, len: usize, pool: PoolRef) -> Result<Buffer<T, K>> {
        self.alloc_at(len, self.current_stream_id(), pool)
    }

    #[inline]
    fn alloc_at<T>(&self, len: usize, stream: StreamId, pool: PoolRef) -> Result<Buffer<T, K>> {
        let elem = std::mem::size_of::<T>();
        let bytes = len.checked_mul(elem).ok_or(Error::SizeOverflow { len, elem_size: elem })?;
        if bytes == 0 {
            return Ok(Buffer::empty(self.shared.clone(), len, stream));
        }
        match self.shared.core.malloc(bytes, stream, pool) {
            Ok(a) => Ok(Buffer::new(self.shared.clone(), a, len, stream)),
            Err(e) => Err(self.on_error(e)),
        }
    }

    /// `size` bytes on the current stream (from the pool of the innermost scope, if any), as a raw
    /// device address for FFI; give it back with
    /// [`free_bytes`](Self::free_bytes). `size == 0` returns 0.
    pub fn alloc_bytes(&self, size: usize) -> Result<u64> {
        let (stream, pool) = stream::current_with_pool(self.shared.key);
        self.shared.core.malloc_raw(size, stream, pool).map_err(|e| self.on_error(e))
    }

    /// Gives back an address from [`alloc_bytes`](Self::alloc_bytes). A foreign or already freed
    /// address is [`Error::InvalidFree`] and changes nothing; 0 is ignored.
    pub fn free_bytes(&self, ptr: u64) -> Result<()> {
        self.shared.core.free_raw(ptr)
    }

    /// Notes that the raw allocation at `ptr` is used on `stream`: on free, its memory is reused
    /// only after the work queued on `stream` until then has completed.
    pub fn record_stream_bytes(&self, ptr: u64, stream: &K::Stream) -> Result<()> {
        self.check_device(stream, "record_stream_bytes")?;
        let block = self.shared.core.raw_block(ptr).ok_or(Error::InvalidFree { ptr, device: self.shared.device })?;
        self.shared.core.record_stream(block, K::stream_id(stream));
        Ok(())
    }

    /// Waits for pending cross-stream frees, then gives every wholly free cached segment back to
    /// the device. Reports an error kept from an earlier `Drop`.
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
