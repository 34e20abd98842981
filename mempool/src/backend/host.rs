//! Host memory as a device: page-locked through CUDA when a driver and a GPU are present (so GPU
//! kernels can read it), plain heap memory otherwise. Host work is synchronous, so its events are
//! always complete.

use std::alloc::Layout;
use std::sync::Arc;

use cudarc::driver::{result, CudaContext};

use super::{Backend, BackendError, EventId, StreamId};

const ALIGN: usize = 4096;

/// Host memory, pinned when possible.
#[derive(Debug)]
pub struct HostBackend {
    pinned: Option<Arc<CudaContext>>,
}

impl HostBackend {
    /// Pinned memory through device 0's context when CUDA is usable, plain memory otherwise.
    pub fn new() -> HostBackend {
        let pinned = match super::cuda::device_count() {
            Ok(n) if n > 0 => CudaContext::new(0).ok(),
            _ => None,
        };
        HostBackend { pinned }
    }

    /// Plain heap memory, never pinned.
    pub fn plain() -> HostBackend {
        HostBackend { pinned: None }
    }

    /// Whether segments are page-locked through CUDA.
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }
}

impl Default for HostBackend {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: segments come from `std::alloc::alloc` (or `cuMemHostAlloc`) with exactly the size asked
// for and a 4 KiB alignment, and are owned by the caller until `free_segment`; `zero` writes only
// the range it is given, which its caller promises lies in a live segment.
unsafe impl Backend for HostBackend {
    fn kind(&self) -> &'static str {
        "host"
    }

    fn device(&self) -> usize {
        0
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        None
    }

    fn alloc_segment(&self, size: usize, _stream: StreamId) -> Result<u64, BackendError> {
        match &self.pinned {
            Some(ctx) => {
                ctx.bind_to_thread().map_err(BackendError::from)?;
                // SAFETY: the context is current on this thread; the returned pointer is owned
                // by the caching allocator until `free_segment` gives it back.
                let p = unsafe { result::malloc_host(size, 0) }.map_err(|e| match e.0 {
                    cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => BackendError::OutOfMemory,
                    _ => BackendError::Failed(e.to_string()),
                })?;
                Ok(p as u64)
            }
            None => {
                let layout = Layout::from_size_align(size, ALIGN).map_err(|_| BackendError::OutOfMemory)?;
                // SAFETY: `size` is non-zero (the allocator never asks for empty segments).
                let p = unsafe { std::alloc::alloc(layout) };
                if p.is_null() {
                    Err(BackendError::OutOfMemory)
                } else {
                    Ok(p as u64)
                }
            }
        }
    }

    unsafe fn free_segment(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        match &self.pinned {
            Some(ctx) => {
                ctx.bind_to_thread().map_err(BackendError::from)?;
                // SAFETY: `addr` came from `malloc_host` in `alloc_segment` and is freed once.
                unsafe { result::free_host(addr as *mut std::ffi::c_void) }.map_err(BackendError::from)
            }
            None => {
                let layout = Layout::from_size_align(size, ALIGN).map_err(|e| BackendError::Failed(e.to_string()))?;
                // SAFETY: `addr` came from `std::alloc::alloc` with this same layout in
                // `alloc_segment`, and the caching allocator frees each segment once.
                unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
                Ok(())
            }
        }
    }

    unsafe fn zero(&self, addr: u64, size: usize, _stream: StreamId) -> Result<(), BackendError> {
        // SAFETY: the caching allocator passes a range inside one live segment of this backend,
        // owned by a block it has just handed out and that nothing else references yet.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0, size) };
        Ok(())
    }

    unsafe fn record_event(&self, _stream: StreamId) -> Result<EventId, BackendError> {
        Ok(EventId(0))
    }

    unsafe fn query_event(&self, _event: EventId) -> Result<bool, BackendError> {
        Ok(true)
    }

    unsafe fn synchronize_event(&self, _event: EventId) -> Result<(), BackendError> {
        Ok(())
    }

    unsafe fn release_event(&self, _event: EventId) {}
}
