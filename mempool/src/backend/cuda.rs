//! CUDA through cudarc's driver API: `cuMemAlloc`/`cuMemFree` for segments, CUDA events for
//! cross-stream frees. This file and `host.rs` hold the crate's only CUDA `unsafe`.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{CUevent, CUevent_flags, CUresult, CUstream};
use cudarc::driver::{result, CudaContext, DriverError};

use super::{Backend, BackendError, EventId, StreamId};
use crate::error::{Error, Result};

/// Whether libcuda can be loaded, probed once (cudarc panics when it is absent).
fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to open the library by name.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
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

pub(crate) fn driver_err(op: &'static str, e: DriverError) -> Error {
    Error::Backend { op, message: e.to_string() }
}

fn failed(e: DriverError) -> BackendError {
    match e.0 {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => BackendError::OutOfMemory,
        _ => BackendError::Failed(e.to_string()),
    }
}

/// One CUDA device.
#[derive(Debug)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    /// Completed events, kept for reuse (creating one costs a driver call).
    idle_events: Mutex<Vec<u64>>,
}

impl CudaBackend {
    /// Opens device `ordinal` (its primary context).
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::InvalidDevice { device: ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("cuDevicePrimaryCtxRetain", e))?;
        Ok(CudaBackend { ctx, idle_events: Mutex::new(Vec::new()) })
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

// SAFETY: segments come from `cuMemAlloc` with exactly the size asked for (256-byte aligned or
// better), owned by the caller until `free_segment`; `zero` writes only the range it is given.
unsafe impl Backend for CudaBackend {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        self.ctx.mem_get_info().ok()
    }

    fn alloc_segment(&self, size: usize, _stream: StreamId) -> Result<u64, BackendError> {
        self.bind()?;
        // SAFETY: the context is current; the segment is owned by the caching allocator until
        // `free_segment`.
        unsafe { result::malloc_sync(size) }.map_err(failed)
    }

    unsafe fn free_segment(&self, addr: u64, _size: usize) -> Result<(), BackendError> {
        self.bind()?;
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
}
