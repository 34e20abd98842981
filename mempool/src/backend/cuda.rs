//! CUDA through cudarc's driver API: `cuMemAlloc`/`cuMemFree` for segments, CUDA events for
//! cross-stream frees, `cuMemAddressReserve`/`cuMemCreate`/`cuMemMap`/`cuMemSetAccess` for
//! expandable segments (physical allocations exportable as POSIX file descriptors where the
//! device allows, GPUDirect RDMA capable where it says so, readable and writable by every peer
//! device that can reach it; fabric handles are not asked for). This file and `host.rs` hold the crate's only CUDA `unsafe`.

use std::sync::{Arc, Mutex};

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::{self, CUevent, CUevent_flags, CUresult, CUstream};
use cudarc::driver::{result, CudaContext, DriverError};

use super::{Backend, BackendError, EventId, StreamId};
use crate::error::{Error, Result};

/// Whether libcuda can be loaded, probed once (cudarc panics when it is absent).
fn driver_present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    {
        static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        // SAFETY: `is_culib_present` only tries to open the library by name.
        *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
    }
    // Linked at build time: the program would not have started without it.
    #[cfg(not(feature = "dynamic-loading"))]
    true
}

/// The [`Error::Backend`] for a failed driver call: the result's name as its message, the
/// driver's error as its source.
pub(crate) fn driver_error(op: &'static str, e: DriverError) -> Error {
    Error::Backend { op, message: format!("{:?}", e.0), cause: Some(driver_cause(e)) }
}

/// A driver error as a [`Cause`](crate::Cause), shown with the driver's description
/// (`cuGetErrorString`, asked now, where a driver is loaded: a `DriverError` made up without one
/// shows its result's name).
pub fn driver_cause(e: DriverError) -> crate::Cause {
    let words = if driver_present() { e.error_string().ok().map(|s| s.to_string_lossy().into_owned()) } else { None };
    crate::Cause::with_words(e, words)
}

/// The number of CUDA devices, or [`Error::NoCudaDriver`] when no driver can be loaded.
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(Error::NoCudaDriver);
    }
    result::init().map_err(|e| driver_err("cuInit", e))?;
    let n = result::device::get_count().map_err(|e| driver_err("cuDeviceGetCount", e))?;
    Ok(n.max(0) as usize)
}

/// A `CUmemLocation` of `type_` and `id`, whatever CUDA API level cudarc was built for (12.x
/// has an `id` field; 13.2 moved it into a union beside a NUMA-locality pair). Both layouts put
/// the 32-bit id right after the 32-bit type, which this writes through a pointer, so the code
/// compiles against every level, `cuda-version-from-build-system` included.
pub fn mem_location(type_: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    const _: () = assert!(std::mem::size_of::<sys::CUmemLocation>() == 8);
    const _: () = assert!(std::mem::align_of::<sys::CUmemLocation>() == 4);
    // SAFETY: a plain C struct of integers; all zeros is valid.
    let mut loc: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    loc.type_ = type_;
    // SAFETY: the struct is 8 bytes, 4-aligned (checked above), its first 4 bytes the type; the
    // next 4 are the id at every API level (a plain `int`, or the union whose `int` member starts
    // at its offset 0), so the write stays inside `loc` and sets exactly the id.
    unsafe { std::ptr::addr_of_mut!(loc).cast::<i32>().add(1).write(id) };
    loc
}

pub(crate) fn driver_err(op: &'static str, e: DriverError) -> Error {
    driver_error(op, e)
}

fn failed(e: DriverError) -> BackendError {
    BackendError::from(e)
}

/// What the device offers for expandable segments (probed when the backend is made).
#[derive(Debug)]
struct Vm {
    /// The least page `cuMemCreate` takes.
    granularity: usize,
    /// Physical allocations are made exportable as POSIX file descriptors (what NCCL and IPC
    /// use) while the device takes it; falls to no handle type, once, if `cuMemCreate` refuses.
    posix_fd: AtomicBool,
    /// GPUDirect RDMA on virtual-memory allocations, where the device says it can.
    rdma: bool,
    /// Devices that can reach this one's memory (peer access): every mapping is made readable
    /// and writable by them too, as by this device.
    peers: Vec<i32>,
}

/// One CUDA device.
#[derive(Debug)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    /// Completed events, kept for reuse (creating one costs a driver call).
    idle_events: Mutex<Vec<u64>>,
    /// `None`: the device has no virtual memory management (or this backend makes pinned host
    /// memory).
    vm: Option<Vm>,
    /// Segments are page-locked host memory mapped for the device (`cuMemHostAlloc`), not
    /// device memory.
    pinned: bool,
    /// Pinned segments are page-aligned host memory registered with `cuMemHostRegister`, their
    /// pages faulted in first on this many threads (`pinned_use_cuda_host_register`).
    register_threads: Option<usize>,
    /// `backend:cudaMallocAsync`: the default pools' segment source.
    malloc_async: Option<Arc<super::stream_ordered::StreamOrderedAllocator>>,
    /// Peer devices given access to this device's memory ([`enable_peer_access`]
    /// (Self::enable_peer_access)), their primary contexts retained: peer access belongs to the
    /// context, and a primary context released by its last user is destroyed with it.
    peers: Mutex<Vec<Arc<CudaContext>>>,
}

/// Runs `f` with this thread's stream-capture mode relaxed: a thread capturing a graph in global
/// or thread-local mode may then make segments and map memory (calls CUDA otherwise refuses
/// during a capture, invalidating it), as PyTorch's allocator does.
fn relaxed<T>(f: impl FnOnce() -> T) -> T {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is an in/out parameter holding a valid mode; the previous mode is put back.
    let swapped = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) } == CUresult::CUDA_SUCCESS;
    // Put back even if `f` panics (a pool allocator's panic is caught further up).
    let _back = scopeguard::guard(mode, move |mut mode| {
        if swapped {
            // SAFETY: as above, with the mode this thread had.
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    });
    f()
}

fn check(r: CUresult) -> Result<(), BackendError> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(failed(DriverError(r)))
    }
}

impl CudaBackend {
    fn probe_vm(ctx: &CudaContext) -> Option<Vm> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let attr = |a| ctx.attribute(a).unwrap_or(0);
        if attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED) == 0 {
            return None;
        }
        let posix_fd = attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) != 0;
        let rdma = attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) != 0;
        let prop = alloc_prop(ctx.ordinal(), false, false);
        let mut g = 0usize;
        // SAFETY: `prop` is a valid property struct and `g` a place for the answer.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        let me = ctx.cu_device();
        let count = result::device::get_count().unwrap_or(0);
        let peers = (0..count)
            .filter(|&o| o as usize != ctx.ordinal())
            .filter(|&o| {
                let (mut d, mut can) = (0, 0);
                // SAFETY: out-parameters for a device handle and a flag; `o` is below the count.
                let ok = unsafe {
                    sys::cuDeviceGet(&mut d, o) == CUresult::CUDA_SUCCESS
                        && sys::cuDeviceCanAccessPeer(&mut can, d, me) == CUresult::CUDA_SUCCESS
                };
                ok && can != 0
            })
            .collect();
        (r == CUresult::CUDA_SUCCESS && g.is_power_of_two()).then(|| Vm {
            granularity: g,
            posix_fd: AtomicBool::new(posix_fd),
            rdma,
            peers,
        })
    }
}

/// The properties of a physical allocation on device `ordinal`.
fn alloc_prop(ordinal: usize, posix_fd: bool, rdma: bool) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct of integers and a pointer, for which all zeros is valid (no
    // handle type, no flags, a null pointer).
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, ordinal as i32);
    if posix_fd {
        p.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    p.allocFlags.gpuDirectRDMACapable = u8::from(rdma);
    p
}

/// Host pages (registration and prefaulting work in pages).
const PAGE: usize = 4096;

/// The layout of a registered host segment of `size` bytes: page-aligned, whole pages.
fn host_layout(size: usize) -> Result<std::alloc::Layout, BackendError> {
    let bytes = size.checked_next_multiple_of(PAGE).ok_or(BackendError::OutOfMemory)?;
    std::alloc::Layout::from_size_align(bytes.max(PAGE), PAGE).map_err(|_| BackendError::OutOfMemory)
}

/// The host's memory `(available, total)` from `/proc/meminfo` (Linux), for pinned backends'
/// out-of-memory reports.
fn host_memory_info() -> Option<(usize, usize)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |key: &str| -> Option<usize> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse::<usize>().ok().map(|k| k * 1024)
    };
    Some((kib("MemAvailable:")?, kib("MemTotal:")?))
}

impl CudaBackend {
    /// Opens device `ordinal` (its primary context).
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::InvalidDevice { device: ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuDevicePrimaryCtxRetain", e))?;
        let vm = Self::probe_vm(&ctx);
        Ok(CudaBackend {
            ctx,
            idle_events: Mutex::new(Vec::new()),
            vm,
            pinned: false,
            register_threads: None,
            malloc_async: None,
            peers: Mutex::new(Vec::new()),
        })
    }

    /// Page-locked host memory for device `ordinal`'s streams: segments from `cuMemHostAlloc`
    /// (portable, mapped: under unified addressing the host address is the device address, so
    /// copies and kernels take it as they take device memory), events on the device's streams.
    pub fn pinned(ordinal: usize) -> Result<CudaBackend> {
        Self::pinned_with(ordinal, None)
    }

    /// [`pinned`](Self::pinned); `register_threads`: take page-aligned host memory and register
    /// it (`cuMemHostRegister`) after faulting its pages in on that many threads, as PyTorch's
    /// `pinned_use_cuda_host_register` does (pinning a large segment is mostly page faults).
    pub fn pinned_with(ordinal: usize, register_threads: Option<usize>) -> Result<CudaBackend> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::InvalidDevice { device: ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuDevicePrimaryCtxRetain", e))?;
        Ok(CudaBackend {
            ctx,
            idle_events: Mutex::new(Vec::new()),
            vm: None,
            pinned: true,
            register_threads,
            malloc_async: None,
            peers: Mutex::new(Vec::new()),
        })
    }

    /// Lets device `peer`'s kernels and copies reach this device's `cuMemAlloc` segments
    /// (`cuCtxEnablePeerAccess` from the peer's primary context, which this backend then keeps
    /// retained: were it released by its last user, the driver would destroy it and the access
    /// with it). Enabling twice is not an error. Leaves the peer's context current.
    pub fn enable_peer_access(&self, peer: usize) -> Result<()> {
        let count = device_count()?;
        if peer >= count {
            return Err(Error::InvalidDevice { device: peer, count });
        }
        if peer == self.ctx.ordinal() || self.pinned {
            return Ok(());
        }
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if peers.iter().any(|c| c.ordinal() == peer) {
            return Ok(());
        }
        let other = CudaContext::new(peer).map_err(|e| driver_err("opening the peer device", e))?;
        let mut can = 0;
        // SAFETY: out-parameter and two valid device handles.
        let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, other.cu_device(), self.ctx.cu_device()) };
        if r != CUresult::CUDA_SUCCESS || can == 0 {
            return Err(Error::backend(
                "cuDeviceCanAccessPeer",
                format!("device {peer} cannot reach device {}'s memory ({r:?})", self.ctx.ordinal()),
            ));
        }
        other.bind_to_thread().map_err(|e| driver_err("binding the peer device", e))?;
        // SAFETY: `self.ctx` is a live context (this backend retains it); the call changes only
        // the current (peer's) context's view of it.
        let r = unsafe { sys::cuCtxEnablePeerAccess(self.ctx.cu_ctx(), 0) };
        match r {
            CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                peers.push(other);
                Ok(())
            }
            r => Err(driver_error("cuCtxEnablePeerAccess", DriverError(r))),
        }
    }

    /// Page-aligned host memory, its pages faulted in on `threads` threads, then registered.
    fn alloc_registered(&self, size: usize, threads: usize) -> Result<u64, BackendError> {
        let layout = host_layout(size)?;
        // SAFETY: `layout` has a non-zero size (segments are never empty).
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return Err(BackendError::OutOfMemory);
        }
        let base = p as usize;
        let per = layout.size().div_ceil(threads).next_multiple_of(PAGE);
        std::thread::scope(|s| {
            for t in 0..threads {
                let (from, to) = ((t * per).min(layout.size()), ((t + 1) * per).min(layout.size()));
                s.spawn(move || {
                    let mut at = from;
                    while at < to {
                        // SAFETY: `base + at` lies inside the allocation made above, which this
                        // thread alone writes in `from..to`; a byte written per page faults it in.
                        unsafe { std::ptr::write_volatile((base + at) as *mut u8, 0) };
                        at += PAGE;
                    }
                });
            }
        });
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: `p..p + size` is host memory this backend owns, not registered yet.
        let r = relaxed(|| unsafe { sys::cuMemHostRegister_v2(p.cast(), layout.size(), flags) });
        let dev_ok = r == CUresult::CUDA_SUCCESS && {
            let mut dev: sys::CUdeviceptr = 0;
            // SAFETY: `p` was just registered with DEVICEMAP.
            let g = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p.cast(), 0) };
            g == CUresult::CUDA_SUCCESS && dev == p as u64
        };
        if !dev_ok {
            if r == CUresult::CUDA_SUCCESS {
                // SAFETY: registered just above, unregistered once.
                let _ = unsafe { sys::cuMemHostUnregister(p.cast()) };
            }
            // SAFETY: allocated above with `layout`, freed once.
            unsafe { std::alloc::dealloc(p, layout) };
            return Err(match r {
                CUresult::CUDA_ERROR_OUT_OF_MEMORY => BackendError::OutOfMemory,
                CUresult::CUDA_SUCCESS => BackendError::Failed(
                    "registered host memory is not at the same device address (no unified addressing)".into(),
                ),
                r => BackendError::Failed(format!("cuMemHostRegister: {r:?}")),
            });
        }
        Ok(p as u64)
    }

    /// Device `ordinal` whose default pools take every buffer from a stream-ordered driver pool
    /// and give it back at its free (`backend:cudaMallocAsync`). Errors: as [`new`](Self::new),
    /// and a device without stream-ordered pools.
    pub fn malloc_async(ordinal: usize) -> Result<CudaBackend> {
        let mut b = Self::new(ordinal)?;
        let source = super::stream_ordered::StreamOrderedAllocator::new(
            ordinal,
            super::stream_ordered::StreamOrderedOptions::default(),
        )?;
        b.malloc_async = Some(Arc::new(source));
        Ok(b)
    }

    /// Whether segments are pinned host memory ([`pinned`](Self::pinned)).
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn bind(&self) -> Result<(), BackendError> {
        self.ctx.bind_to_thread().map_err(failed)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let events = std::mem::take(self.idle_events.get_mut().unwrap_or_else(|p| p.into_inner()));
        if self.ctx.bind_to_thread().is_ok() {
            for e in events {
                // SAFETY: every idle event was created by `record_event` and is destroyed once;
                // errors are ignored because `Drop` must not fail.
                let _ = unsafe { result::event::destroy(e as CUevent) };
            }
        }
    }
}

// SAFETY: segments come from `cuMemAlloc` (or, pinned, `cuMemHostAlloc`, page-aligned, at the
// same address for host and device) with exactly the size asked for (256-byte aligned or
// better), owned by the caller until `free_segment`; `zero` writes only the range it is given.
unsafe impl Backend for CudaBackend {
    fn kind(&self) -> &'static str {
        if self.pinned {
            "cuda_pinned"
        } else {
            "cuda"
        }
    }

    fn host_visible(&self) -> bool {
        self.pinned
    }

    fn malloc_async_source(&self) -> Option<Arc<dyn super::RawAllocator>> {
        self.malloc_async.clone().map(|s| s as Arc<dyn super::RawAllocator>)
    }

    fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        if self.pinned {
            return host_memory_info();
        }
        self.ctx.mem_get_info().ok()
    }

    fn alloc_segment(&self, size: usize, _stream: StreamId) -> Result<u64, BackendError> {
        self.bind()?;
        if let (true, Some(threads)) = (self.pinned, self.register_threads) {
            return self.alloc_registered(size, threads.max(1));
        }
        if self.pinned {
            let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
            // SAFETY: the context is current; the memory is owned by the caching allocator until
            // `free_segment` gives it to `cuMemFreeHost`.
            let host = relaxed(|| unsafe { result::malloc_host(size, flags) }).map_err(failed)?;
            let mut dev: sys::CUdeviceptr = 0;
            // SAFETY: `host` was just mapped for the device by `cuMemHostAlloc(DEVICEMAP)`.
            let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }.result();
            if r.is_err() || dev != host as u64 {
                // SAFETY: `host` came from `malloc_host` above and is given back once.
                let _ = unsafe { result::free_host(host) };
                return Err(BackendError::Failed(format!(
                    "pinned memory at {host:p} is not at the same device address ({dev:#x}: no unified addressing)"
                )));
            }
            return Ok(host as u64);
        }
        // SAFETY: the context is current; the segment is owned by the caching allocator until
        // `free_segment`. Relaxed: `cuMemAlloc` is allowed while this thread captures a graph.
        relaxed(|| unsafe { result::malloc_sync(size) }).map_err(failed)
    }

    fn with_relaxed_capture(&self, f: &mut dyn FnMut()) {
        relaxed(f)
    }

    unsafe fn capture_id(&self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        self.bind()?;
        let (mut status, mut id) = (sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE, 0u64);
        // SAFETY: `stream` is a live stream of this context (the caller's promise); the status
        // and id are out-parameters, the optional graph, dependency and edge outputs are null.
        check(unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                stream.0 as CUstream,
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        })?;
        Ok(match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => None,
            // Active, or invalidated (its capture id stays until it ends).
            _ => Some(id),
        })
    }

    unsafe fn free_segment(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        self.bind()?;
        if self.pinned && self.register_threads.is_some() {
            // SAFETY: `addr` came from `alloc_registered` (this backend makes no other segment
            // in this mode), registered there; unused now.
            let r = unsafe { sys::cuMemHostUnregister(addr as *mut std::ffi::c_void) };
            if r != CUresult::CUDA_SUCCESS {
                return Err(BackendError::Failed(format!("cuMemHostUnregister: {r:?}")));
            }
            let layout = host_layout(size)?;
            // SAFETY: allocated by `alloc_registered` with this same layout (same size), freed
            // once, no longer registered.
            unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
            return Ok(());
        }
        if self.pinned {
            // SAFETY: `addr` came from `malloc_host` (pinned backends make no other segment) and
            // is freed once, after every event guarding its blocks completed.
            return unsafe { result::free_host(addr as *mut std::ffi::c_void) }.map_err(failed);
        }
        // SAFETY: `addr` came from `malloc_sync` and the caching allocator frees it once, after
        // every event guarding its blocks completed.
        unsafe { result::free_sync(addr) }.map_err(failed)
    }

    unsafe fn zero(&self, addr: u64, size: usize, stream: StreamId) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: the range lies inside a live segment, in a block just handed to the caller;
        // `stream` is a stream of this context that the caller is allocating on.
        unsafe { result::memset_d8_async(addr, 0, size, stream.0 as CUstream) }.map_err(failed)
    }

    unsafe fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError> {
        self.bind()?;
        let reuse = self.idle_events.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let ev = match reuse {
            Some(e) => e as CUevent,
            None => result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(failed)?,
        };
        // SAFETY: `ev` is a live event of this context; `stream` is the handle of a stream of this
        // context that used the block; its owner must keep it alive until the block is freed
        // (documented on `Buffer::record_stream`), and a dead handle gives an error, not UB.
        match unsafe { result::event::record(ev, stream.0 as CUstream) } {
            Ok(()) => Ok(EventId(ev as u64)),
            Err(e) => {
                self.idle_events.lock().unwrap_or_else(|p| p.into_inner()).push(ev as u64);
                Err(failed(e))
            }
        }
    }

    unsafe fn query_event(&self, event: EventId) -> Result<bool, BackendError> {
        // SAFETY: the event was created by `record_event` and not yet released.
        match unsafe { result::event::query(event.0 as CUevent) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(failed(e)),
        }
    }

    unsafe fn synchronize_event(&self, event: EventId) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: as in `query_event`.
        unsafe { result::event::synchronize(event.0 as CUevent) }.map_err(failed)
    }

    unsafe fn release_event(&self, event: EventId) {
        self.idle_events.lock().unwrap_or_else(|p| p.into_inner()).push(event.0);
    }

    fn vm_granularity(&self) -> Option<usize> {
        self.vm.as_ref().map(|v| v.granularity)
    }

    fn reserve(&self, size: usize) -> Result<u64, BackendError> {
        let vm = self.vm.as_ref().ok_or_else(|| BackendError::Failed("no virtual memory management".into()))?;
        self.bind()?;
        let mut addr = 0;
        // SAFETY: reserves address space only; `addr` receives its start.
        check(relaxed(|| unsafe { sys::cuMemAddressReserve(&mut addr, size, vm.granularity, 0, 0) }))?;
        Ok(addr)
    }

    unsafe fn unreserve(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: the caller gives exactly a reservation of ours with nothing mapped in it.
        check(unsafe { sys::cuMemAddressFree(addr, size) })
    }

    unsafe fn map(&self, addr: u64, size: usize) -> Result<u64, BackendError> {
        // SAFETY: the caller's promise, passed on; relaxed, as `alloc_segment`.
        relaxed(|| unsafe { self.map_now(addr, size) })
    }

    unsafe fn unmap(&self, addr: u64, size: usize, handle: u64, stream: StreamId) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: the caller keeps `stream` alive; waiting for it ends every use of the range
        // that work submitted before the free could still make.
        check(unsafe { sys::cuStreamSynchronize(stream.0 as CUstream) })?;
        // SAFETY: exactly one mapping of ours (the caller's contract), no longer used.
        check(unsafe { sys::cuMemUnmap(addr, size) })?;
        // SAFETY: the handle of that mapping, now unmapped, released once. Unmapped already, so
        // a failure here is not reported as "still mapped" (the memory leaks, which is safe).
        let _ = unsafe { sys::cuMemRelease(handle) };
        Ok(())
    }
}

impl CudaBackend {
    /// `Backend::map`, in the thread's capture mode.
    ///
    /// # Safety
    /// As for `Backend::map`.
    unsafe fn map_now(&self, addr: u64, size: usize) -> Result<u64, BackendError> {
        let vm = self.vm.as_ref().ok_or_else(|| BackendError::Failed("no virtual memory management".into()))?;
        self.bind()?;
        let ordinal = self.ctx.ordinal();
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        let fd = vm.posix_fd.load(Ordering::Relaxed);
        // SAFETY: `prop` describes pinned memory of this device; `h` receives the handle.
        let mut r = unsafe { sys::cuMemCreate(&mut h, size, &alloc_prop(ordinal, fd, vm.rdma), 0) };
        if fd && matches!(r, CUresult::CUDA_ERROR_NOT_PERMITTED | CUresult::CUDA_ERROR_NOT_SUPPORTED) {
            // Exportable handles refused here (a container without the permission): plain
            // allocations from now on, said once.
            if vm.posix_fd.swap(false, Ordering::Relaxed) {
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "mempool: device {ordinal} refused exportable (POSIX file descriptor) handles for cuMemCreate \
                     ({r:?}); expandable memory falls back to plain handles: other processes cannot map it, and \
                     NCCL cannot register it for zero-copy peer-to-peer transfers between processes"
                );
            }
            // SAFETY: as above.
            r = unsafe { sys::cuMemCreate(&mut h, size, &alloc_prop(ordinal, false, vm.rdma), 0) };
        }
        check(r)?;
        let release = |e: BackendError| {
            // SAFETY: `h` was created above and is given back once, on this failure path.
            let _ = unsafe { sys::cuMemRelease(h) };
            e
        };
        // SAFETY: the caller promises `addr..addr + size` is an unmapped, aligned range of one of
        // our reservations; `h` is `size` bytes.
        check(unsafe { sys::cuMemMap(addr, size, 0, h, 0) }).map_err(release)?;
        let descs: Vec<sys::CUmemAccessDesc> = std::iter::once(ordinal as i32)
            .chain(vm.peers.iter().copied())
            .map(|id| {
                // SAFETY: a plain C struct of integers, all zeros valid.
                let mut d: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
                d.location = mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id);
                d.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                d
            })
            .collect();
        // SAFETY: the range was just mapped; `descs` are valid descriptors, counted exactly.
        if let Err(e) = check(unsafe { sys::cuMemSetAccess(addr, size, descs.as_ptr(), descs.len()) }) {
            // SAFETY: the mapping made above, undone before its handle is released.
            let _ = unsafe { sys::cuMemUnmap(addr, size) };
            return Err(release(e));
        }
        Ok(h)
    }
}

/// Host memory of yours, page-locked and mapped for a device while this lives
/// (`cuMemHostRegister`, PyTorch's `cudaHostRegister`): copies from it run at pinned speed, and
/// [`device_ptr`](Self::device_ptr) is its address for the device. Unregistered on drop. The
/// registration holds the memory's only borrow, so nothing else in safe code can touch it (nor
/// register it again) meanwhile.
pub struct HostRegistration<'a> {
    ctx: Arc<CudaContext>,
    mem: &'a mut [u8],
    dev: u64,
}

impl std::fmt::Debug for HostRegistration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration")
            .field("ptr", &self.mem.as_ptr())
            .field("len", &self.mem.len())
            .field("device", &self.ctx.ordinal())
            .finish()
    }
}

impl<'a> HostRegistration<'a> {
    /// Registers `mem` for device `device`. Errors: an empty range; memory already registered,
    /// wholly or in part (pinned memory from `cuMemHostAlloc` included): nothing is changed;
    /// the driver's other refusals.
    pub fn new(device: usize, mem: &'a mut [u8]) -> Result<HostRegistration<'a>> {
        if mem.is_empty() {
            return Err(Error::backend("cuMemHostRegister", "an empty range cannot be registered"));
        }
        let count = device_count()?;
        if device >= count {
            return Err(Error::InvalidDevice { device, count });
        }
        let ctx = CudaContext::new(device).map_err(|e| driver_err("cuDevicePrimaryCtxRetain", e))?;
        ctx.bind_to_thread().map_err(|e| driver_err("binding the device", e))?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: `mem` is a live range of this process's memory, borrowed exclusively for the
        // registration's life; registering changes none of its bytes.
        let r = unsafe { sys::cuMemHostRegister_v2(mem.as_mut_ptr().cast(), mem.len(), flags) };
        match r {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => {
                return Err(Error::backend("cuMemHostRegister", format!(
                        "{:p}..+{} is already registered (wholly or in part), or is pinned memory: nothing was changed",
                        mem.as_ptr(),
                        mem.len()
                    )))
            }
            r => {
                return Err(Error::backend("cuMemHostRegister", format!(
                        "{:p}..+{}: the driver refuses it ({r:?}; memory from cuMemHostAlloc gets CUDA_ERROR_INVALID_VALUE): nothing was changed",
                        mem.as_ptr(),
                        mem.len()
                    )))
            }
        }
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: registered just above with DEVICEMAP.
        let g = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, mem.as_mut_ptr().cast(), 0) };
        if g != CUresult::CUDA_SUCCESS {
            // SAFETY: registered above; undone once.
            let _ = unsafe { sys::cuMemHostUnregister(mem.as_mut_ptr().cast()) };
            return Err(driver_error("cuMemHostGetDevicePointer", DriverError(g)));
        }
        Ok(HostRegistration { ctx, mem, dev })
    }

    /// The memory's address for the device (its host address under unified addressing).
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// The memory.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mem
    }
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: registered by `new`, unregistered once; errors are ignored (`Drop`).
            let _ = unsafe { sys::cuMemHostUnregister(self.mem.as_mut_ptr().cast()) };
        }
    }
}
