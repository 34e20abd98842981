//! `Buffer<T>`: owns one block of device memory; dropping it returns the block to its pool.

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg, SyncOnDrop};

use crate::caching::Allocation;
use crate::error::Result;
use crate::id::{StreamId, StreamRef};
use crate::kind::{Cuda, Handle, Kind};

/// `len` elements of `T` in device memory, owned. Dropping it gives the block back to its pool
/// (never panicking); the memory is reused by allocations on the same stream, and by others only
/// after every stream that used it is done (see [`record_stream`](Buffer::record_stream)).
///
/// CUDA buffers (`Buffer<T>`, i.e. `Buffer<T, Cuda>`) implement cudarc's [`DeviceSlice`],
/// [`DevicePtr`] and [`DevicePtrMut`], so they go wherever a `CudaSlice` goes: `memcpy_htod`,
/// `memcpy_dtoh`, `launch_builder(..).arg(&buf)`, NCCL. A cudarc copy on another stream than the
/// buffer's own waits for the work queued on the buffer's stream so far (a fresh `alloc_zeros`
/// fill included), and returns once that stream has done the copy. For a kernel launched on
/// another stream, call [`record_stream`](Buffer::record_stream) (cudarc does not tell a kernel
/// argument its stream; the launch is `unsafe` for that reason).
///
/// ```no_run
/// let alloc = mempool::Allocator::cuda(0)?;
/// let stream = alloc.current_stream();
/// let mut buf = alloc.alloc::<f32>(1024)?;
/// stream.memcpy_htod(&vec![1.0f32; 1024], &mut buf)?;
/// let back = stream.clone_dtoh(&buf)?;
/// assert_eq!(back[0], 1.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Buffer<T, K: Kind = Cuda> {
    shared: Handle<K>,
    block: Option<Allocation>,
    /// Another stream was recorded: its free must wait for that stream's work (so it does not
    /// go to a thread cache).
    used_elsewhere: AtomicBool,
    ptr: u64,
    len: usize,
    stream: StreamRef,
    /// cudarc's `Arc<CudaStream>` for [`DeviceSlice::stream`] and the event of the last use on
    /// another stream (CUDA only).
    stream_cache: K::StreamCache,
    _elem: PhantomData<T>,
}

impl<T, K: Kind> Buffer<T, K> {
    pub(crate) fn new(shared: Handle<K>, a: Allocation, len: usize, stream: StreamRef) -> Self {
        Buffer {
            shared,
            block: Some(a),
            used_elsewhere: AtomicBool::new(false),
            ptr: a.addr,
            len,
            stream,
            stream_cache: Default::default(),
            _elem: PhantomData,
        }
    }

    pub(crate) fn empty(shared: Handle<K>, len: usize, stream: StreamRef) -> Self {
        Buffer {
            shared,
            block: None,
            used_elsewhere: AtomicBool::new(false),
            ptr: 0,
            len,
            stream,
            stream_cache: Default::default(),
            _elem: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes (`len * size_of::<T>()`).
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device address (0 for an empty buffer). For pinned host memory, the buffer then
    /// counts as used by the device: its memory is reused only after its stream's work.
    pub fn device_ptr_raw(&self) -> u64 {
        self.mark_device_use();
        self.ptr
    }

    /// Pinned host memory used by the device: its free must wait for its own stream's work too
    /// (the next owner's host writes are not stream-ordered). Nothing for device memory.
    #[inline]
    pub(crate) fn mark_device_use(&self) {
        if self.shared.core.host_visible() {
            self.used_elsewhere.store(true, Ordering::Relaxed);
        }
    }

    /// The id (device handle) of the stream it was allocated on.
    pub fn stream_id(&self) -> StreamId {
        self.stream.raw
    }

    /// The device index.
    pub fn device(&self) -> usize {
        self.shared.device
    }

    /// Notes that `stream` uses this buffer: when it is dropped, its memory is reused only after
    /// the work queued on `stream` until then has completed (`Tensor.record_stream`). The
    /// buffer's own stream needs no recording. A stream of another device is an error. The
    /// buffer holds `stream` alive until then.
    pub fn record_stream(&self, stream: &K::Stream) -> Result<()> {
        crate::kind::check_stream::<K>(stream, self.shared.device, "record_stream")?;
        self.mark_device_use();
        if let Some(a) = &self.block {
            // Set before the use is recorded: a free racing this call cannot happen (it takes
            // the buffer by value), so the flag is seen by `drop`.
            if K::stream_ref(stream).key != self.stream.key {
                self.used_elsewhere.store(true, Ordering::Relaxed);
            }
            self.shared.core.record_stream(a.block, K::stream_ref(stream), K::keep(stream));
        }
        Ok(())
    }
}

impl<T, K: Kind> Drop for Buffer<T, K> {
    fn drop(&mut self) {
        if let Some(a) = &self.block {
            let bytes = self.num_bytes();
            self.shared.core.free_allocation(a, self.stream.key, bytes, *self.used_elsewhere.get_mut());
        }
    }
}

impl<T, K: Kind> fmt::Debug for Buffer<T, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .field("device", &self.shared.device)
            .finish()
    }
}

impl<T: crate::AnyBitPattern> Buffer<T, Cuda> {
    /// The host's view of a pinned buffer ([`Allocator::pinned`](crate::Allocator::pinned)),
    /// once the work queued on its stream (a copy or kernel writing it) is done: it synchronises
    /// that stream first. Uses on other streams were waited for when their calls returned, and
    /// while the view is borrowed no `&mut` use can queue a write. Error: the buffer is device
    /// memory (no host view), or the stream's work failed.
    pub fn host_slice(&self) -> Result<&[T]> {
        let ptr = self.host_ptr("Buffer::host_slice")?;
        // SAFETY: `ptr` is `len` elements of host memory this buffer owns, mapped for the CPU in
        // this process (checked by `host_ptr`: a pinned allocator's own segment, or a segment of a
        // source whose `unsafe impl RawAllocator` promises host visibility), aligned for
        // `T` (blocks are 512-byte aligned), or a dangling pointer for a buffer of no bytes; the
        // device's writes to it are done (its stream and every stream recorded as using it were
        // waited for; cudarc's uses on other streams were synchronised when their borrows ended)
        // and no new write can be queued while `&self` is borrowed (writes need `&mut`); every
        // bit pattern is a valid `T` (`AnyBitPattern`).
        Ok(unsafe { std::slice::from_raw_parts(ptr, self.len) })
    }

    /// The host's mutable view of a pinned buffer, once every use queued on its stream and on
    /// the streams recorded as using it (copies still reading it included) is done. Errors as
    /// [`host_slice`](Self::host_slice).
    pub fn host_slice_mut(&mut self) -> Result<&mut [T]> {
        let ptr = self.host_ptr("Buffer::host_slice_mut")?;
        // SAFETY: as in `host_slice`, and `&mut self` makes this the only view: no device use
        // can be queued while it lives, and the queued ones are done.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, self.len) })
    }

    /// The buffer's host address once the device's work on it is done, a dangling (aligned,
    /// non-null) pointer for a buffer of no bytes, or an error: device memory, a stream being
    /// captured into a graph (waiting would break the capture), a failed wait.
    fn host_ptr(&self, op: &'static str) -> Result<*mut T> {
        let visible = self.shared.ext.is_pinned()
            || self.block.as_ref().is_some_and(|a| self.shared.core.block_host_visible(a.block));
        if !visible {
            return Err(crate::Error::backend(
                op,
                "device memory has no host view: allocate from Allocator::pinned, or from a pool whose segment source is host-visible (HostNumaAllocator), for host-visible buffers",
            ));
        }
        let Some(a) = &self.block else {
            // No bytes (an empty buffer, or zero-sized elements): nothing to wait for.
            return Ok(std::ptr::NonNull::dangling().as_ptr());
        };
        if self.num_bytes() == 0 {
            return Ok(std::ptr::NonNull::dangling().as_ptr());
        }
        if self.shared.core.stream_capture_id(self.stream)?.is_some() {
            return Err(crate::Error::Capture {
                what: op,
                message: "the buffer's stream is being captured into a graph: its work has not run, and waiting for it would break the capture".into(),
            });
        }
        DeviceSlice::stream(self).synchronize().map_err(|e| crate::backend::cuda::driver_error(op, e))?;
        self.shared.core.wait_for_uses(a.block)?;
        Ok(self.ptr as *mut T)
    }
}

impl<T> Buffer<T, Cuda> {
    /// Orders a use on `stream`. On the buffer's own stream nothing is needed. Another stream
    /// first waits for the work queued on the buffer's stream so far (its zero fill, the writes
    /// before this use), through an event; and the cudarc call returns only once that stream has
    /// done the use (cudarc synchronises it when the borrow ends), so the buffer's stream, and the
    /// block's reuse after a drop, can never run ahead of it. One event per use would let the call
    /// return at once, but a buffer is `Sync`: two threads could use it on two streams at a time,
    /// and one event per buffer could then forget one of them.
    fn use_on<'a>(&'a self, stream: &'a CudaStream) -> SyncOnDrop<'a> {
        self.mark_device_use();
        if self.block.is_none() {
            return SyncOnDrop::Sync(None);
        }
        let own = DeviceSlice::stream(self);
        if stream.cu_stream() == own.cu_stream() && stream.context() == own.context() {
            return SyncOnDrop::Sync(None);
        }
        if stream.join(own).is_err() {
            // Could not order it on the device: finish the buffer's stream on the host instead.
            let _ = own.synchronize();
        }
        SyncOnDrop::Sync(Some(stream))
    }
}

impl<T> Buffer<T, Cuda> {
    /// For CUDA IPC: the allocator's backend, and where the buffer's memory comes from (`None`:
    /// an empty buffer).
    pub(crate) fn ipc_source(&self) -> (&crate::backend::cuda::CudaBackend, Option<crate::caching::ExportSource>) {
        let src = self.block.map(|a| self.shared.core.export_source(a.block));
        (self.shared.ext.backend(), src)
    }
}

impl<T> DeviceSlice<T> for Buffer<T, Cuda> {
    fn len(&self) -> usize {
        self.len
    }

    /// The stream the buffer was allocated on.
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream_cache.stream(|| {
            let keep = self.block.and_then(|a| self.shared.core.stream_keep(a.block));
            Cuda::resolve(&self.shared, self.stream, keep)
        })
    }
}

impl<T> DevicePtr<T> for Buffer<T, Cuda> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.use_on(stream))
    }
}

impl<T> DevicePtrMut<T> for Buffer<T, Cuda> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.use_on(stream))
    }
}
// SAFETY: the kernel receives the buffer's device address, read from `self.ptr`, which lives as
// long as the borrow `'b` that `LaunchArgs` is tied to; the buffer owns that memory until it is
// dropped, which the borrow prevents while the arguments exist. cudarc does not tell an argument
// which stream the launch uses, so a launch on another stream than the buffer's own needs
// `record_stream` (as a `Tensor` passed to a custom kernel does in PyTorch).
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b Buffer<T, Cuda>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b Buffer<T, Cuda>) -> &mut Self {
        arg.mark_device_use();
        self.arg(&arg.ptr)
    }
}

// SAFETY: as above; `&mut` also rules out any other use of the buffer while the arguments exist.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut Buffer<T, Cuda>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut Buffer<T, Cuda>) -> &mut Self {
        arg.mark_device_use();
        self.arg(&arg.ptr)
    }
}
