//! The device boundary: where segments, streams and events come from.
//!
//! One caching algorithm serves every kind of device. Two traits bring the device in, and both
//! are `unsafe` to implement, because the algorithm writes through, zero and hands out the
//! addresses they return without being able to check them:
//!
//! * [`Backend`]: a device's own segments, zero fill and events. Three ship with the crate:
//!
//!   | backend | memory | events |
//!   | --- | --- | --- |
//!   | [`cuda`] | `cuMemAlloc` / `cuMemFree` | CUDA events |
//!   | [`host`] | page-locked host memory through CUDA when a driver is present, plain otherwise | host work is synchronous: always complete |
//!   | [`sim`] | none: addresses only, with a capacity limit and injectable failures | complete only when the test says so |
//!
//! * [`RawAllocator`]: a user pool's segment source (ncclMemAlloc, cuMemCreate on a NUMA node,
//!   a stream-ordered CUDA pool...). A pool without one takes its segments from the backend.
//!
//! Methods that take an address, a stream or an event that the caller could make up are
//! `unsafe fn`: the caching allocator calls them only with what the same implementation gave it.

pub mod cuda;
pub mod host;
pub mod host_numa;
pub mod sim;
pub mod stream_ordered;

use std::any::Any;
use std::fmt;
use std::sync::Arc;

pub use crate::id::{EventId, StreamId};

/// Keeps a stream object alive (for CUDA, a clone of its `Arc<CudaStream>`): held by every
/// segment, recorded use and current-stream entry that names the stream, so that its handle
/// cannot be reused by a new stream while the allocator may still record events on it.
pub(crate) type Keep = Arc<dyn Any + Send + Sync>;

/// What a backend reports when it cannot do what was asked.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendError {
    /// The device has no memory left for this request.
    OutOfMemory,
    /// Anything else, with the backend's words.
    Failed(String),
    /// A CUDA driver call failed (other than for lack of memory): the error becomes the
    /// [`source`](std::error::Error::source) of the [`Error`](crate::Error) it turns into.
    Driver(cudarc::driver::DriverError),
}

// By hand: cudarc's `Debug` and `Display` of a driver error ask the driver for its words (and
// panic without one); these show the result's name.
impl fmt::Debug for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendError::OutOfMemory => f.write_str("OutOfMemory"),
            BackendError::Failed(m) => f.debug_tuple("Failed").field(m).finish(),
            BackendError::Driver(e) => f.debug_tuple("Driver").field(&e.0).finish(),
        }
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendError::OutOfMemory => f.write_str("out of memory"),
            BackendError::Failed(m) => f.write_str(m),
            BackendError::Driver(e) => write!(f, "{:?}", e.0),
        }
    }
}

impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BackendError::Driver(e) => Some(e),
            _ => None,
        }
    }
}

/// A driver error: `OutOfMemory` for `CUDA_ERROR_OUT_OF_MEMORY`, else `Driver`.
impl From<cudarc::driver::DriverError> for BackendError {
    fn from(e: cudarc::driver::DriverError) -> BackendError {
        match e.0 {
            cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => BackendError::OutOfMemory,
            _ => BackendError::Driver(e),
        }
    }
}

impl BackendError {
    /// The [`Error`](crate::Error) for this failure of `op`, keeping a driver error as its
    /// source.
    pub(crate) fn into_error(self, op: &'static str) -> crate::Error {
        match self {
            BackendError::Driver(e) => cuda::driver_error(op, e),
            e => crate::Error::backend(op, e.to_string()),
        }
    }
}

/// Raw segments, streams and events of one device.
///
/// The caching allocator calls these a few times per segment (never per cached allocation), so
/// an implementation may be simple rather than fast.
///
/// # Safety
///
/// An implementer promises that [`alloc_segment`](Backend::alloc_segment) returns the address
/// of `size` bytes of this device's memory, aligned to 512 bytes, that nothing else uses until
/// the same range is given to [`free_segment`](Backend::free_segment), and that [`zero`](Backend::zero)
/// (Backend::zero) writes only inside the range it is given. The allocator hands these bytes
/// out to safe code (zero-filled buffers, cudarc copies), so a made-up or shared range would be
/// undefined behaviour that the safe API could reach. The same holds for virtual memory: a
/// successful [`map`](Backend::map) puts `size` bytes of this device's memory, used by nothing
/// else, at exactly the range asked for, until [`unmap`](Backend::unmap) of that range.
pub unsafe trait Backend: Send + Sync + 'static {
    /// `"cuda"`, `"host"`, `"sim"`, or a user backend's name; used in reports.
    fn kind(&self) -> &'static str;
    /// The device index.
    fn device(&self) -> usize;
    /// `(free, total)` bytes of the device, where the backend knows them.
    fn memory_info(&self) -> Option<(usize, usize)>;
    /// A new segment of exactly `size` bytes (`size > 0`), aligned to at least 512 bytes.
    /// `stream` is the stream the first allocation in it is made for.
    fn alloc_segment(&self, size: usize, stream: StreamId) -> Result<u64, BackendError>;
    /// Gives back a segment. An `Err` means it was **not** given back: the memory is still the
    /// caller's, untouched, and the allocator keeps using it (an implementation that cannot tell
    /// must not return `Err`).
    ///
    /// # Safety
    /// `addr` and `size` are those of a segment from [`alloc_segment`](Backend::alloc_segment)
    /// of this backend, not freed yet, that nothing uses any more (every event guarding it has
    /// completed).
    unsafe fn free_segment(&self, addr: u64, size: usize) -> Result<(), BackendError>;
    /// Fills `size` bytes at `addr` with zeros, ordered on `stream`.
    ///
    /// # Safety
    /// `addr..addr + size` lies inside one live segment of this backend and belongs to a block
    /// the caller owns; `stream` is a live stream of this device.
    unsafe fn zero(&self, addr: u64, size: usize, stream: StreamId) -> Result<(), BackendError>;
    /// Records an event on `stream` capturing the work submitted to it so far.
    ///
    /// # Safety
    /// `stream` is a live stream of this device (for CUDA, recording on a destroyed stream's
    /// handle is undefined behaviour).
    unsafe fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError>;
    /// Whether the work the event captured has completed.
    ///
    /// # Safety
    /// `event` came from [`record_event`](Backend::record_event) of this backend and has not
    /// been released.
    unsafe fn query_event(&self, event: EventId) -> Result<bool, BackendError>;
    /// Blocks until the work the event captured has completed.
    ///
    /// # Safety
    /// As for [`query_event`](Backend::query_event).
    unsafe fn synchronize_event(&self, event: EventId) -> Result<(), BackendError>;
    /// The event is no longer needed (it may be reused).
    ///
    /// # Safety
    /// As for [`query_event`](Backend::query_event); the event is not used again.
    unsafe fn release_event(&self, event: EventId);

    /// The id of the graph capture `stream` takes part in (streams forked into a capture share
    /// its id), or `None` when it is not being captured. The default: never captured.
    ///
    /// # Safety
    /// `stream` is a live stream of this device.
    unsafe fn capture_id(&self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        let _ = stream;
        Ok(None)
    }

    /// Runs `f` with this thread's graph-capture mode relaxed (CUDA: calls a capture otherwise
    /// refuses, such as a pool allocator's, are then allowed). The default just runs it.
    fn with_relaxed_capture(&self, f: &mut dyn FnMut()) {
        f()
    }

    /// Whether the host reads and writes this memory directly (pinned host memory): a freed
    /// block is then reused only once the work queued on its own stream is done too (the host
    /// is not stream-ordered), not only other streams' work. The default: no.
    fn host_visible(&self) -> bool {
        false
    }

    /// The segment source of the default pools under `backend:cudaMallocAsync` (a stream-ordered
    /// driver pool), if this backend has one. The default: none (the setting then does nothing,
    /// as `expandable_segments` on a backend without virtual memory).
    fn malloc_async_source(&self) -> Option<Arc<dyn RawAllocator>> {
        None
    }

    /// Virtual memory management, for expandable segments: the page size that
    /// [`map`](Backend::map) works in (addresses and sizes are multiples of it), or `None` when
    /// the device has none (the default; expandable segments are then refused at configuration).
    fn vm_granularity(&self) -> Option<usize> {
        None
    }
    /// Reserves `size` bytes of address space (a multiple of the granularity) with no memory
    /// behind it, aligned to the granularity.
    fn reserve(&self, size: usize) -> Result<u64, BackendError> {
        let _ = size;
        Err(BackendError::Failed(format!("{}: no virtual memory management", self.kind())))
    }
    /// Gives back a reservation.
    ///
    /// # Safety
    /// `addr` and `size` are exactly those of a reservation from [`reserve`](Backend::reserve),
    /// not given back yet, with nothing mapped in it.
    unsafe fn unreserve(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        let _ = (addr, size);
        Ok(())
    }
    /// Creates `size` bytes of memory as one physical allocation, maps it at `addr` and makes it
    /// readable and writable by this device; returns its handle.
    ///
    /// # Safety
    /// `addr..addr + size` lies inside one reservation of this backend, aligned to the
    /// granularity, with nothing mapped there.
    unsafe fn map(&self, addr: u64, size: usize) -> Result<u64, BackendError> {
        let _ = (addr, size);
        Err(BackendError::Failed(format!("{}: no virtual memory management", self.kind())))
    }
    /// Waits for the work submitted to `stream`, then unmaps a physical allocation and gives it
    /// back. An `Err` means it is still mapped, untouched.
    ///
    /// # Safety
    /// `addr`, `size` and `handle` are exactly those of one [`map`](Backend::map) of this
    /// backend, not unmapped yet, that no block handed out lies in any more; `stream` is a live
    /// stream of this device.
    unsafe fn unmap(&self, addr: u64, size: usize, handle: u64, stream: StreamId) -> Result<(), BackendError> {
        let _ = (addr, size, handle, stream);
        Err(BackendError::Failed(format!("{}: no virtual memory management", self.kind())))
    }
}

/// How a graph capture treats the calls CUDA forbids while it is under way (CUDA's
/// `CUstreamCaptureMode`): [`Global`](CaptureMode::Global) (the default: any thread's forbidden
/// call breaks the capture), [`ThreadLocal`](CaptureMode::ThreadLocal) (only this thread's), or
/// [`Relaxed`](CaptureMode::Relaxed) (none is checked). The allocator's own device calls during a
/// capture run relaxed in every mode, as PyTorch's do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL`.
    #[default]
    Global,
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`.
    ThreadLocal,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`.
    Relaxed,
}

/// Watches the physical allocations of an expandable pool, and may keep one mapped: what a
/// registry of memory that others hold (NCCL's registrations) needs to know.
///
/// Both methods are called without any of the allocator's locks held. A panic in `mapped` is
/// caught and ignored (the memory is mapped all the same); a panic in `unmapping` is caught and
/// keeps the memory mapped, as an error does.
pub trait MapGuard: Send + Sync + 'static {
    /// `size` bytes at `addr` were just mapped as one physical allocation of the pool: called
    /// before any block of them is handed out and before the trace hooks see their
    /// `SegmentMap`. Also called when an unmap that was let through failed after all (the
    /// memory is still mapped, and the hooks see `SegmentMap` again).
    fn mapped(&self, addr: u64, size: usize);
    /// The physical allocation `addr..addr + size` is about to be unmapped; the trace hooks have
    /// seen its `SegmentUnmap`. An `Err` keeps it mapped: it comes back as a free segment of the
    /// pool (the hooks see `SegmentMap` again), and a later `empty_cache` tries again.
    fn unmapping(&self, addr: u64, size: usize) -> Result<(), String>;
}

/// A segment of a stream-ordered driver pool as another process opens it
/// ([`RawAllocator::ipc_export`]): the pool's POSIX file descriptor, the allocation's
/// `CUmemPoolPtrExportData`, and a number naming the pool among this process's pools.
pub type PoolExport = (std::os::fd::OwnedFd, [u8; 64], u64);

/// Where a user pool's segments come from: your own alloc/free functions (PyTorch's pluggable
/// allocator functions).
///
/// `alloc` returns a device address of `size` bytes (a multiple of [`granularity`]), aligned to
/// the granularity; 0 or `Err(BackendError::OutOfMemory)` means there is no memory. The
/// allocator calls both functions without holding any of its locks, so they may call mempool
/// (to read statistics, say); a panic in either is caught and reported as the pool allocator's
/// error, and the allocator's state stays exact.
///
/// [`granularity`]: RawAllocator::granularity
///
/// # Safety
///
/// An implementer promises that a successful [`alloc`](RawAllocator::alloc) returns the address
/// of `size` bytes of memory of `device` that the caller may read and write (device memory for
/// CUDA pools: the allocator zero-fills it with `cuMemsetD8Async` and cudarc copies into it),
/// that nothing else uses until the same range is given back to [`free`](RawAllocator::free),
/// and that a `free` which returns `Err` (or panics) did **not** give it back: the range is
/// still the caller's, untouched, and the allocator puts it back in its cache and keeps using
/// it. A `free` that cannot tell whether it freed the memory must return `Ok` (and leak). An
/// allocator whose [`host_visible`](RawAllocator::host_visible) is true promises besides that
/// the CPU may read and write every segment at its address while it lives.
/// The allocator hands these bytes to safe code; a made-up, shared or too small range would be
/// undefined behaviour that the safe API could reach.
pub unsafe trait RawAllocator: Send + Sync + 'static {
    /// A name for reports and errors.
    fn name(&self) -> &str;
    /// A new segment of `size` bytes for `stream` of `device` (the stream is alive during the
    /// call).
    fn alloc(&self, size: usize, device: usize, stream: StreamId) -> Result<u64, BackendError>;
    /// [`alloc`](Self::alloc) for a caller that vouches for the stream: the caching allocator
    /// calls this one. A source may then allocate in the stream's order (`cuMemAllocFromPoolAsync`
    /// on it, with no synchronisation): the memory is valid for work queued on `stream` after
    /// this call, and for other streams once they wait for it. The default calls `alloc`.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of `device` (CUDA: its handle), alive during the call and not
    /// being captured into a graph; the memory is used in that stream's order (other streams
    /// wait for it first), as the caching allocator uses a segment of a stream.
    unsafe fn alloc_on_stream(&self, size: usize, device: usize, stream: StreamId) -> Result<u64, BackendError> {
        self.alloc(size, device, stream)
    }
    /// Gives a segment back; `Err` means it was not (see the trait's safety contract).
    ///
    /// # Safety
    /// `ptr` and `size` are exactly those of a segment this allocator's
    /// [`alloc`](RawAllocator::alloc) returned for `device`, not freed yet, with no block of it
    /// handed out and every other stream's use of it complete. `stream` is the stream it was
    /// allocated for, alive during the call: work queued on it before the call may still use
    /// the memory, so an implementation frees in that stream's order (`cuMemFreeAsync`) or
    /// waits for it first (an unmap does not wait).
    unsafe fn free(&self, ptr: u64, size: usize, device: usize, stream: StreamId) -> Result<(), BackendError>;
    /// Segment sizes are multiples of this, and addresses must be aligned to it (a power of two,
    /// at least 512). NCCL/NVLS buffers want the multicast granularity, typically 2 MiB.
    fn granularity(&self) -> usize {
        512
    }
    /// Whether the segments are host memory the CPU may read and write at the address `alloc`
    /// returned, for as long as the segment lives (default: no). Saying yes is part of the
    /// trait's safety contract: the pool's buffers then get host views
    /// ([`Buffer::host_slice`](crate::Buffer::host_slice)), and a freed block waits for its own
    /// stream's work before the next owner gets it (the host is not stream-ordered).
    fn host_visible(&self) -> bool {
        false
    }
    /// Whether this source's memory suits an allocator of this backend kind (`cuda`, `host`,
    /// `sim`, ...): a pool is refused when not (CUDA device memory behind a host allocator would
    /// be zero-filled by the CPU, and its streams would be made-up numbers). The default: any.
    fn serves(&self, backend_kind: &str) -> bool {
        let _ = backend_kind;
        true
    }
    /// CUDA IPC ([`crate::ipc`]): the segment `addr` (one `alloc` of this source) in a form
    /// another process can open: a POSIX file descriptor of the driver pool it came from, the
    /// pool's export data for the allocation (`cuMemPoolExportToShareableHandle`,
    /// `cuMemPoolExportPointer`), and a number naming the pool among this process's pools.
    /// `None` (the default): this source's memory does not export.
    fn ipc_export(&self, addr: u64) -> Option<Result<PoolExport, BackendError>> {
        let _ = addr;
        None
    }
}

thread_local! {
    static IN_SOURCE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs `f` (a pool allocator's `alloc`) marked as inside a segment source on this thread.
pub(crate) fn as_source<T>(f: impl FnOnce() -> T) -> T {
    let _ = IN_SOURCE.try_with(|c| c.set(c.get() + 1));
    let _back = scopeguard::guard((), |()| {
        let _ = IN_SOURCE.try_with(|c| c.set(c.get() - 1));
    });
    f()
}

/// Whether this thread is inside a pool allocator's `alloc`.
pub(crate) fn in_source() -> bool {
    IN_SOURCE.try_with(|c| c.get() > 0).unwrap_or(false)
}

/// Runs user code (a pool allocator, a hook) so that a panic in it becomes an error instead of
/// unwinding through the allocator.
pub(crate) fn contain<T>(what: &str, f: impl FnOnce() -> Result<T, BackendError>) -> Result<T, BackendError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string payload".into());
            drop_payload(p);
            Err(BackendError::Failed(format!("{what} panicked: {msg}")))
        }
    }
}

/// Drops a caught panic's payload without unwinding: a payload whose own `Drop` panics leaves
/// that second payload leaked (only it), so nothing unwinds into the caller after all.
pub(crate) fn drop_payload(p: Box<dyn std::any::Any + Send>) {
    if let Err(again) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(p))) {
        std::mem::forget(again);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Cause, Error};
    use cudarc::driver::{sys::CUresult, DriverError};

    fn is_shareable<T: std::error::Error + Send + Sync + 'static>() {}

    #[test]
    fn errors_are_send_sync_static() {
        is_shareable::<Error>();
        is_shareable::<BackendError>();
        fn send_sync<T: Send + Sync + 'static>() {}
        send_sync::<Cause>();
    }

    #[test]
    fn a_driver_failure_keeps_the_driver_error_as_its_source() {
        let d = DriverError(CUresult::CUDA_ERROR_INVALID_VALUE);
        let e = BackendError::from(d).into_error("segment allocation");
        let src = std::error::Error::source(&e).expect("a source");
        assert!(src.downcast_ref::<DriverError>() == Some(&d));
        let Error::Backend { op, message, .. } = &e else { panic!("not a backend error") };
        assert_eq!(*op, "segment allocation");
        assert!(message.contains("CUDA_ERROR_INVALID_VALUE"), "{message}");
        // Out of memory is not a driver failure: the caching layer's out-of-memory path takes it.
        assert_eq!(BackendError::from(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)), BackendError::OutOfMemory);
        // A backend's own words have no source.
        let e = BackendError::Failed("refused".into()).into_error("map");
        assert!(std::error::Error::source(&e).is_none());
        assert_eq!(e, Error::backend("map", "refused"));
        // Clones compare equal and share the cause.
        let a = cuda::driver_error("x", d);
        assert!(a.clone() == a);
        assert!(a != cuda::driver_error("x", DriverError(CUresult::CUDA_ERROR_INVALID_HANDLE)));
    }
}
