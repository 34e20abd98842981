//! Device kinds: what an [`Allocator`](crate::Allocator) serves, which fixes its stream type and
//! what its buffers implement; and the shared state a kind's allocator, buffers and pools point to.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudarc::driver::CudaStream;

use crate::backend::cuda::CudaBackend;
use crate::backend::sim::{SimDevice, SimStream};
use crate::backend::{CaptureMode, Keep};
use crate::caching::DeviceAllocator;
use crate::error::Result;
use crate::id::{StreamId, StreamKey, StreamRef};

mod sealed {
    pub trait Sealed {}
}

/// The kind of device an [`Allocator`](crate::Allocator) serves: [`Cuda`], [`Host`] or [`Sim`].
/// It fixes the type of the streams, and which traits a [`Buffer`](crate::Buffer) implements (only CUDA buffers implement cudarc's
/// `DevicePtr`, so a simulated buffer can never reach a kernel).
pub trait Kind: sealed::Sealed + Sized + Send + Sync + 'static {
    /// A stream of this kind of device.
    type Stream: Clone + Send + Sync + 'static;
    #[doc(hidden)]
    type Ext: Send + Sync + 'static;
    #[doc(hidden)]
    type StreamCache: Default + Send + Sync + 'static;
    /// The stream's identity for the allocator (unique for the life of the process) and its
    /// device handle.
    #[doc(hidden)]
    fn stream_ref(s: &Self::Stream) -> StreamRef;
    /// What keeps the stream alive while the allocator may still use its handle.
    #[doc(hidden)]
    fn keep(s: &Self::Stream) -> Option<Keep>;
    #[doc(hidden)]
    fn stream_device(s: &Self::Stream, allocator_device: usize) -> usize;
    /// The stream object back from what the allocator holds.
    #[doc(hidden)]
    fn resolve(shared: &Shared<Self>, stream: StreamRef, keep: Option<Keep>) -> Self::Stream;
    /// Whether the allocator can key this stream (CUDA's per-thread stream it cannot).
    #[doc(hidden)]
    fn usable(_s: &Self::Stream) -> bool {
        true
    }
    /// An instantiated graph of this kind of device (CUDA: cudarc's `CudaGraph`).
    type Graph: 'static;
    /// Begins a graph capture on the stream.
    #[doc(hidden)]
    fn begin_capture(shared: &Shared<Self>, s: &Self::Stream, mode: CaptureMode) -> Result<()>;
    /// Ends the stream's capture and instantiates the graph (`None`: nothing was captured).
    #[doc(hidden)]
    fn end_capture(shared: &Shared<Self>, s: &Self::Stream) -> Result<Option<Self::Graph>>;
    /// Launches the graph on the stream it was captured on.
    #[doc(hidden)]
    fn launch(g: &Self::Graph) -> Result<()>;
}

fn no_graphs(what: &'static str) -> crate::error::Error {
    crate::error::Error::Capture { what, message: "host memory has no graphs to capture".into() }
}

/// The checks every entry point that takes a stream makes: the allocator's device, and a stream
/// the allocator can tell apart from others.
pub(crate) fn check_stream<K: Kind>(s: &K::Stream, device: usize, what: &'static str) -> crate::error::Result<()> {
    let found = K::stream_device(s, device);
    if found != device {
        return Err(crate::error::Error::WrongDevice { what, expected: device, found });
    }
    if !K::usable(s) {
        return Err(crate::error::Error::UnsupportedStream { what });
    }
    Ok(())
}

/// `CU_STREAM_LEGACY`: the legacy default stream, the same stream as the null handle.
const CU_STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`: a different stream on every thread.
const CU_STREAM_PER_THREAD: usize = 0x2;

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
#[derive(Debug)]
pub struct CudaExt {
    backend: Arc<CudaBackend>,
}

impl CudaExt {
    pub(crate) fn new(backend: Arc<CudaBackend>) -> CudaExt {
        CudaExt { backend }
    }

    pub(crate) fn context(&self) -> &Arc<cudarc::driver::CudaContext> {
        self.backend.context()
    }

    pub(crate) fn is_pinned(&self) -> bool {
        self.backend.is_pinned()
    }

    pub(crate) fn backend(&self) -> &CudaBackend {
        &self.backend
    }
}

/// The key of a CUDA stream object. Keyed by the `Arc`'s address, with a `Weak` that pins that
/// allocation: while an entry exists no other stream can live at its address, so a stream
/// found here is the very stream the key was made for. Entries of dead streams are pruned; a
/// stream at a pruned address later gets a fresh key. (The handle cannot be the key: the
/// driver gives a destroyed stream's handle to the next stream created.)
///
/// The last stream looked up on this thread is remembered with a `Weak` of its own (which pins
/// the address just as the registry's does), so a thread that keeps using one stream finds its
/// key without the registry's lock.
fn cuda_stream_key(s: &Arc<CudaStream>) -> StreamKey {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(usize, Weak<CudaStream>, StreamKey)>> =
            const { std::cell::RefCell::new(None) };
    }
    let addr = Arc::as_ptr(s) as usize;
    let hit = LAST.try_with(|l| l.borrow().as_ref().filter(|x| x.0 == addr).map(|x| x.2)).ok().flatten();
    if let Some(k) = hit {
        return k;
    }
    let k = cuda_stream_key_shared(s);
    let _ = LAST.try_with(|l| *l.borrow_mut() = Some((addr, Arc::downgrade(s), k)));
    k
}

fn cuda_stream_key_shared(s: &Arc<CudaStream>) -> StreamKey {
    type Registry = HashMap<usize, (Weak<CudaStream>, StreamKey)>;
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    let mut m = REGISTRY.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    let addr = Arc::as_ptr(s) as usize;
    if let Some((_, k)) = m.get(&addr) {
        return *k;
    }
    if m.len() >= 64 && m.len().is_power_of_two() {
        m.retain(|_, (w, _)| w.strong_count() > 0);
    }
    let k = StreamKey::fresh();
    m.insert(addr, (Arc::downgrade(s), k));
    k
}

impl Kind for Cuda {
    type Stream = Arc<CudaStream>;
    type Ext = CudaExt;
    type StreamCache = CudaCache;
    fn stream_ref(s: &Arc<CudaStream>) -> StreamRef {
        if s.cu_stream().is_null() || s.cu_stream() as usize == CU_STREAM_LEGACY {
            // The legacy default stream: one per context, never destroyed.
            return StreamRef::DEFAULT;
        }
        StreamRef { key: cuda_stream_key(s), raw: StreamId(s.cu_stream() as u64) }
    }
    fn keep(s: &Arc<CudaStream>) -> Option<Keep> {
        (Cuda::stream_ref(s).key != StreamKey::DEFAULT).then(|| s.clone() as Keep)
    }
    fn usable(s: &Arc<CudaStream>) -> bool {
        s.cu_stream() as usize != CU_STREAM_PER_THREAD
    }
    fn stream_device(s: &Arc<CudaStream>, _: usize) -> usize {
        s.context().ordinal()
    }
    /// The stream object the keep-alive holds; the device's default stream without one.
    type Graph = cudarc::driver::CudaGraph;
    fn begin_capture(_: &Shared<Cuda>, s: &Arc<CudaStream>, mode: CaptureMode) -> Result<()> {
        use cudarc::driver::sys::CUstreamCaptureMode as M;
        let mode = match mode {
            CaptureMode::Global => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => M::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        s.begin_capture(mode).map_err(|e| crate::backend::cuda::driver_err("cuStreamBeginCapture", e))
    }
    fn end_capture(_: &Shared<Cuda>, s: &Arc<CudaStream>) -> Result<Option<cudarc::driver::CudaGraph>> {
        s.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(|e| crate::backend::cuda::driver_err("cuStreamEndCapture / cuGraphInstantiate", e))
    }
    fn launch(g: &cudarc::driver::CudaGraph) -> Result<()> {
        g.launch().map_err(|e| crate::backend::cuda::driver_err("cuGraphLaunch", e))
    }
    fn resolve(shared: &Shared<Cuda>, _: StreamRef, keep: Option<Keep>) -> Arc<CudaStream> {
        match keep.and_then(|k| k.downcast::<CudaStream>().ok()) {
            Some(s) => s,
            None => shared.ext.backend.context().default_stream(),
        }
    }
}

impl Kind for Host {
    type Stream = StreamId;
    type Ext = ();
    type StreamCache = ();
    fn stream_ref(s: &StreamId) -> StreamRef {
        // Host "streams" are names the caller picks; there is no device object behind them.
        StreamRef { key: StreamKey(s.0), raw: *s }
    }
    fn keep(_: &StreamId) -> Option<Keep> {
        None
    }
    fn stream_device(_: &StreamId, d: usize) -> usize {
        d
    }
    type Graph = std::convert::Infallible;
    fn begin_capture(_: &Shared<Host>, _: &StreamId, _: CaptureMode) -> Result<()> {
        Err(no_graphs("begin_capture"))
    }
    fn end_capture(_: &Shared<Host>, _: &StreamId) -> Result<Option<std::convert::Infallible>> {
        Err(no_graphs("end_capture"))
    }
    fn launch(g: &std::convert::Infallible) -> Result<()> {
        match *g {}
    }
    fn resolve(_: &Shared<Host>, s: StreamRef, _: Option<Keep>) -> StreamId {
        s.raw
    }
}

impl Kind for Sim {
    type Stream = SimStream;
    type Ext = Arc<SimDevice>;
    type Graph = SimGraph;
    fn begin_capture(shared: &Shared<Sim>, s: &SimStream, _: CaptureMode) -> Result<()> {
        shared.ext.begin_capture(s.id);
        Ok(())
    }
    fn end_capture(shared: &Shared<Sim>, s: &SimStream) -> Result<Option<SimGraph>> {
        shared.ext.end_capture(s.id);
        Ok(Some(SimGraph { device: shared.ext.clone() }))
    }
    fn launch(g: &SimGraph) -> Result<()> {
        g.device.launch_graph();
        Ok(())
    }
    type StreamCache = ();
    fn stream_ref(s: &SimStream) -> StreamRef {
        // A simulated device never reuses a stream id.
        StreamRef { key: StreamKey(s.id.0), raw: s.id }
    }
    fn keep(_: &SimStream) -> Option<Keep> {
        None
    }
    fn stream_device(s: &SimStream, _: usize) -> usize {
        s.device
    }
    fn resolve(shared: &Shared<Sim>, s: StreamRef, _: Option<Keep>) -> SimStream {
        SimStream { device: shared.device, id: s.raw }
    }
}

/// A graph captured on a simulated device: its launches are counted
/// ([`SimDevice::graph_launches`]).
#[derive(Debug)]
pub struct SimGraph {
    device: Arc<SimDevice>,
}

#[doc(hidden)]
#[derive(Debug)]
pub struct Shared<K: Kind> {
    pub(crate) core: DeviceAllocator,
    /// The allocator's id, as the key of this thread's current-stream and route entries.
    pub(crate) key: u64,
    pub(crate) device: usize,
    pub(crate) ext: K::Ext,
}

impl<K: Kind> Shared<K> {
    pub(crate) fn new(core: DeviceAllocator, key: u64, device: usize, ext: K::Ext) -> Shared<K> {
        Shared { core, key, device, ext }
    }
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

/// A CUDA buffer's stream object, found on first use.
#[doc(hidden)]
#[derive(Default)]
pub struct CudaCache {
    stream: OnceLock<Arc<CudaStream>>,
}

impl fmt::Debug for CudaCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaCache").finish_non_exhaustive()
    }
}

impl CudaCache {
    /// The buffer's stream, found on first use.
    pub(crate) fn stream(&self, find: impl FnOnce() -> Arc<CudaStream>) -> &Arc<CudaStream> {
        self.stream.get_or_init(find)
    }
}
