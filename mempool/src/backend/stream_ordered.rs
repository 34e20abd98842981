//! CUDA's stream-ordered allocator as a segment source: an explicit `cuMemPoolCreate` pool whose
//! segments come from `cuMemAllocFromPoolAsync` on the request's own stream when the caching
//! allocator asks (`alloc_on_stream`, whose caller vouches for a live stream that is not being
//! captured: no synchronisation, as PyTorch's `cudaMallocAsync` backend), or on a stream of the
//! allocator's own, synchronised, through the safe `alloc` (which must not trust a stream number
//! it is given) and whenever the stream is being captured (a graph capture must not turn a
//! segment into a graph allocation); they go back with
//! `cuMemFreeAsync` on the segment's stream (alive during the call: the caching allocator keeps
//! it; never the default stream in its place), after the work queued on it. Any `MemPool` can take it
//! (`PoolOptions::shared_allocator(Arc::new(StreamOrderedAllocator::new(device, options)?))`); the
//! caching layer in front serves repeated sizes without a driver call.
//!
//! The driver pool's own settings are reachable: release threshold, reuse policies, maximum size,
//! [`trim_to`](StreamOrderedAllocator::trim_to), its reserved/used bytes next to our statistics,
//! and [`access_from`](StreamOrderedAllocator::access_from) for peers (`cuCtxEnablePeerAccess`
//! does not reach pool memory: the pool's access must be set).

use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::CudaContext;

use super::{BackendError, RawAllocator};
use crate::error::{Error, Result};
use crate::id::StreamId;

/// How the driver pool is made and behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamOrderedOptions {
    /// Bytes the pool keeps after a synchronisation instead of giving them back (the driver's
    /// default is 0; `u64::MAX` keeps everything, as PyTorch's `cudaMallocAsync` backend does).
    pub release_threshold: u64,
    /// The pool's maximum size in bytes (0: no limit).
    pub max_size: usize,
    /// Reuse memory freed on another stream when the free's event is known complete.
    pub reuse_follow_event_dependencies: bool,
    /// Reuse memory freed on another stream opportunistically.
    pub reuse_allow_opportunistic: bool,
    /// Reuse memory freed on another stream by inserting dependencies.
    pub reuse_allow_internal_dependencies: bool,
    /// The pool's memory may be shared with other processes ([`crate::ipc`]): the pool is made
    /// with POSIX file-descriptor handles (`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
    pub exportable: bool,
}

impl Default for StreamOrderedOptions {
    fn default() -> Self {
        StreamOrderedOptions {
            release_threshold: u64::MAX,
            max_size: 0,
            reuse_follow_event_dependencies: true,
            reuse_allow_opportunistic: true,
            reuse_allow_internal_dependencies: true,
            exportable: false,
        }
    }
}

/// An explicit CUDA memory pool as a segment source (see the module's documentation).
pub struct StreamOrderedAllocator {
    ctx: Arc<CudaContext>,
    pool: sys::CUmemoryPool,
    /// A stream of our own that new segments are allocated on (then synchronised): `alloc` is a
    /// safe function whose stream argument anyone can make up, so it never reaches the driver.
    own: Arc<cudarc::driver::CudaStream>,
    name: String,
    /// Made with POSIX file-descriptor handles: its memory exports ([`crate::ipc`]).
    exportable: bool,
}

// SAFETY: a `CUmemoryPool` is a driver handle usable from any thread; the struct owns it.
unsafe impl Send for StreamOrderedAllocator {}
// SAFETY: as above; every call on the handle is thread-safe in the driver.
unsafe impl Sync for StreamOrderedAllocator {}

impl std::fmt::Debug for StreamOrderedAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamOrderedAllocator").field("device", &self.ctx.ordinal()).finish()
    }
}

fn check(op: &'static str, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(super::cuda::driver_error(op, cudarc::driver::DriverError(r)))
    }
}

impl StreamOrderedAllocator {
    /// A new driver pool on device `device`. Errors: no such device, a device without
    /// stream-ordered pools, the driver's refusal.
    pub fn new(device: usize, options: StreamOrderedOptions) -> Result<StreamOrderedAllocator> {
        let count = super::cuda::device_count()?;
        if device >= count {
            return Err(Error::InvalidDevice { device, count });
        }
        let ctx = CudaContext::new(device).map_err(|e| super::cuda::driver_error("opening the device", e))?;
        ctx.bind_to_thread().map_err(|e| super::cuda::driver_error("binding the device", e))?;
        if ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED).unwrap_or(0) == 0 {
            return Err(Error::Config(format!("device {device} has no stream-ordered memory pools")));
        }
        // SAFETY: a plain C struct; all-zero is its "nothing requested" value.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location = super::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, device as i32);
        props.maxSize = options.max_size;
        if options.exportable {
            props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        }
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: out-parameter and a valid property struct.
        check("cuMemPoolCreate", unsafe { sys::cuMemPoolCreate(&mut pool, &props) })?;
        let own = match ctx.new_stream() {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: the pool was created just above and is destroyed once, unused.
                let _ = unsafe { sys::cuMemPoolDestroy(pool) };
                return Err(super::cuda::driver_error("creating the pool's stream", e));
            }
        };
        let me = StreamOrderedAllocator {
            ctx,
            pool,
            own,
            name: format!("cudaMallocAsync pool of device {device}"),
            exportable: options.exportable,
        };
        me.set_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, options.release_threshold)?;
        for (attr, on) in [
            (
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
                options.reuse_follow_event_dependencies,
            ),
            (sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, options.reuse_allow_opportunistic),
            (
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                options.reuse_allow_internal_dependencies,
            ),
        ] {
            let mut v: i32 = on.into();
            // SAFETY: a boolean attribute of a live pool, given an `int`.
            check("cuMemPoolSetAttribute", unsafe {
                sys::cuMemPoolSetAttribute(me.pool, attr, (&mut v as *mut i32).cast())
            })?;
        }
        Ok(me)
    }

    fn set_u64(&self, attr: sys::CUmemPool_attribute, v: u64) -> Result<()> {
        let mut v = v;
        // SAFETY: a 64-bit attribute of a live pool, given a `cuuint64_t`.
        check("cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(self.pool, attr, (&mut v as *mut u64).cast())
        })
    }

    fn get_u64(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut v: u64 = 0;
        // SAFETY: a 64-bit attribute of a live pool, read into a `cuuint64_t`.
        check("cuMemPoolGetAttribute", unsafe {
            sys::cuMemPoolGetAttribute(self.pool, attr, (&mut v as *mut u64).cast())
        })?;
        Ok(v)
    }

    /// Bytes the driver pool holds from the device now (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub fn reserved(&self) -> Result<u64> {
        self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    }

    /// Bytes of the driver pool in use now (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`): the segments
    /// the caching layer holds.
    pub fn used(&self) -> Result<u64> {
        self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// Sets the release threshold (see [`StreamOrderedOptions::release_threshold`]).
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.set_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, bytes)
    }

    /// Gives the driver pool's unused memory back to the device until it holds at most `bytes`
    /// (`cuMemPoolTrimTo`). The caching layer's segments are in use for the driver: empty the
    /// `MemPool`'s cache first.
    pub fn trim_to(&self, bytes: usize) -> Result<()> {
        // SAFETY: a live pool.
        check("cuMemPoolTrimTo", unsafe { sys::cuMemPoolTrimTo(self.pool, bytes) })
    }

    /// Lets device `peer` read and write the pool's memory (`cuMemPoolSetAccess`), for its
    /// kernels and copies; pool memory is not reached by `cuCtxEnablePeerAccess`. Errors: no
    /// such device, or a device that cannot reach this one.
    pub fn access_from(&self, peer: usize) -> Result<()> {
        let count = super::cuda::device_count()?;
        if peer >= count {
            return Err(Error::InvalidDevice { device: peer, count });
        }
        if peer == self.ctx.ordinal() {
            return Ok(());
        }
        // SAFETY: a plain C struct; all-zero is a valid start.
        let mut d: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        d.location = super::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, peer as i32);
        d.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: a live pool and one valid descriptor.
        check("cuMemPoolSetAccess", unsafe { sys::cuMemPoolSetAccess(self.pool, &d, 1) }).map_err(|e| match e {
            Error::Backend { message, .. } => Error::backend(
                "cuMemPoolSetAccess",
                format!("device {peer} cannot be given access to device {}'s pool: {message}", self.ctx.ordinal()),
            ),
            e => e,
        })
    }
}

impl Drop for StreamOrderedAllocator {
    fn drop(&mut self) {
        // The pool outlives every segment: a `MemPool` holds this allocator until its last
        // segment went back. Errors are ignored (`Drop`).
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the pool is destroyed once; its allocations were all freed.
            let _ = unsafe { sys::cuMemPoolDestroy(self.pool) };
        }
    }
}

// SAFETY: `alloc` returns `size` bytes of this device's memory from the driver pool, allocated on
// the allocator's own stream and synchronised, so valid for every stream (the stream argument,
// which safe code can make up, is not used); `alloc_on_stream` allocates them in the order of the
// stream its caller vouches for, in which its caller uses them (its contract). Either way they are
// used by nothing else until `free` gives them
// back with `cuMemFreeAsync` on the segment's stream (alive by `free`'s contract), after whose
// queued work the driver reuses them. A failed free leaves the memory allocated (the driver
// changes nothing on error). `serves` keeps it to CUDA allocators, whose streams are real.
unsafe impl RawAllocator for StreamOrderedAllocator {
    fn name(&self) -> &str {
        &self.name
    }

    fn alloc(&self, size: usize, device: usize, _stream: StreamId) -> Result<u64, BackendError> {
        if device != self.ctx.ordinal() {
            return Err(BackendError::Failed(format!("{} does not serve device {device}", self.name)));
        }
        self.ctx.bind_to_thread().map_err(BackendError::from)?;
        let own = self.own.cu_stream();
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: out-parameter; a live pool; `own` is this allocator's live stream, never
        // captured (so the memory is real, not a graph's).
        let r = unsafe { sys::cuMemAllocFromPoolAsync(&mut p, size, self.pool, own) };
        match r {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => return Err(BackendError::OutOfMemory),
            r => return Err(BackendError::Failed(format!("cuMemAllocFromPoolAsync: {r:?}"))),
        }
        // Valid for every stream once our stream reached the allocation.
        if let Err(e) = self.own.synchronize() {
            // SAFETY: `p` was just allocated on `own` and is given back once, unused.
            let _ = unsafe { sys::cuMemFreeAsync(p, own) };
            return Err(BackendError::Failed(format!("synchronizing the pool's stream: {e}")));
        }
        Ok(p)
    }

    fn serves(&self, backend_kind: &str) -> bool {
        backend_kind == "cuda"
    }

    /// In the stream's order, with no synchronisation (PyTorch's `cudaMallocAsync` backend
    /// does the same): `cuMemAllocFromPoolAsync` on `stream` itself. A stream being captured
    /// after all (a capture begun on another thread meanwhile) gets the synchronised path.
    unsafe fn alloc_on_stream(&self, size: usize, device: usize, stream: StreamId) -> Result<u64, BackendError> {
        if device != self.ctx.ordinal() {
            return Err(BackendError::Failed(format!("{} does not serve device {device}", self.name)));
        }
        self.ctx.bind_to_thread().map_err(BackendError::from)?;
        let s = stream.0 as sys::CUstream;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the caller promises a live stream of this device; `status` is an out-parameter.
        let r = unsafe { sys::cuStreamIsCapturing(s, &mut status) };
        if r != CUresult::CUDA_SUCCESS || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return self.alloc(size, device, stream);
        }
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: out-parameter; a live pool; a live stream of its device, not capturing (just
        // checked), in whose order the caller uses the memory.
        match unsafe { sys::cuMemAllocFromPoolAsync(&mut p, size, self.pool, s) } {
            CUresult::CUDA_SUCCESS => Ok(p),
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(BackendError::OutOfMemory),
            r => Err(BackendError::Driver(cudarc::driver::DriverError(r))),
        }
    }

    fn ipc_export(&self, addr: u64) -> Option<Result<super::PoolExport, BackendError>> {
        if !self.exportable {
            return None;
        }
        Some((|| {
            self.ctx.bind_to_thread().map_err(BackendError::from)?;
            let mut fd: std::ffi::c_int = -1;
            let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            // SAFETY: a live pool made with POSIX file-descriptor handles; the out-parameter is
            // an `int`, as that handle type writes.
            let r = unsafe {
                sys::cuMemPoolExportToShareableHandle((&mut fd as *mut std::ffi::c_int).cast(), self.pool, posix, 0)
            };
            r.result().map_err(BackendError::from)?;
            // SAFETY: the driver just opened `fd` for us; nothing else owns it.
            let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
            // SAFETY: `addr` is a live allocation of this pool (a segment the caching layer
            // holds); the out-parameter is the driver's struct.
            unsafe { sys::cuMemPoolExportPointer(&mut data, addr) }.result().map_err(BackendError::from)?;
            Ok((fd, data.reserved, self.pool as usize as u64))
        })())
    }

    unsafe fn free(&self, ptr: u64, _size: usize, _device: usize, stream: StreamId) -> Result<(), BackendError> {
        self.ctx.bind_to_thread().map_err(BackendError::from)?;
        // SAFETY: `ptr` came from `alloc` on `stream`, which is alive during the call and after
        // whose queued work the memory is reused (stream order); freed once.
        let r = unsafe { sys::cuMemFreeAsync(ptr, stream.0 as sys::CUstream) };
        if r == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(BackendError::Failed(format!("cuMemFreeAsync: {r:?}")))
        }
    }
}
