//! `Buffer<T>`: owns one block of device memory; dropping it returns the block to its pool.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg, SyncOnDrop};

use crate::allocator::{Cuda, Handle, Kind};
use crate::backend::StreamId;
use crate::caching::Allocation;
use crate::error::Result;

const NO_BLOCK: u32 = u32::MAX;

/// `len` elements of `T` in device memory, owned. Dropping it gives the block back to its pool
/// (never panicking); the memory is reused by allocations on the same stream, and by others only
/// after every stream that used it is done (see [`record_stream`](Buffer::record_stream)).
///
/// CUDA buffers (`Buffer<T>`, i.e. `Buffer<T, Cuda>`) implement cudarc's [`DeviceSlice`],
/// [`DevicePtr`] and [`DevicePtrMut`], so they go wherever a `CudaSlice` goes: `memcpy_htod`,
/// `memcpy_dtoh`, `launch_builder(..).arg(&buf)`, NCCL. Passing one to a cudarc copy on another
/// stream than its own records that stream automatically; for a kernel launched on another stream,
/// call [`record_stream`](Buffer::record_stream) (cudarc does not tell a kernel argument its stream).
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
    block: u32,
    ptr: u64,
    len: usize,
    stream: StreamId,
    /// cudarc's `Arc<CudaStream>` for [`DeviceSlice::stream`], found on first use.
    stream_cache: K::StreamCache,
    _elem: PhantomData<T>,
}

impl<T, K: Kind> Buffer<T, K> {
    pub(crate) fn new(shared: Handle<K>, a: Allocation, len: usize, stream: StreamId) -> Self {
        Buffer {
            shared,
            block: a.block,
            ptr: a.addr,
            len,
            stream,
            stream_cache: Default::default(),
            _elem: PhantomData,
        }
    }

    pub(crate) fn empty(shared: Handle<K>, len: usize, stream: StreamId) -> Self {
        Buffer { shared, block: NO_BLOCK, ptr: 0, len, stream, stream_cache: Default::default(), _elem: PhantomData }
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

    /// The device address (0 for an empty buffer).
    pub fn device_ptr_raw(&self) -> u64 {
        self.ptr
    }

    /// The id of the stream it was allocated on.
    pub fn stream_id(&self) -> StreamId {
        self.stream
    }

    /// The device index.
    pub fn device(&self) -> usize {
        self.shared.device
    }

    /// Notes that `stream` uses this buffer: when it is dropped, its memory is reused only after
    /// the work queued on `stream` until then has completed (`Tensor.record_stream`). The
    /// buffer's own stream needs no recording. A stream of another device is an error.
    ///
    /// As with PyTorch, a recorded stream must still exist when the buffer is dropped (that is
    /// when its event is recorded); if it does not, the block is held back and the error is
    /// reported by the allocator's next call.
    pub fn record_stream(&self, stream: &K::Stream) -> Result<()> {
        let found = K::stream_device(stream, self.shared.device);
        if found != self.shared.device {
            return Err(crate::Error::WrongDevice { what: "record_stream", expected: self.shared.device, found });
        }
        self.note_use(K::stream_id(stream));
        Ok(())
    }

    fn note_use(&self, stream: crate::StreamId) {
        if self.block != NO_BLOCK {
            self.shared.core.record_stream(self.block, stream);
        }
    }
}

impl<T, K: Kind> Drop for Buffer<T, K> {
    fn drop(&mut self) {
        if self.block != NO_BLOCK {
            self.shared.core.free(self.block);
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

impl<T> Buffer<T, Cuda> {
    fn use_on(&self, stream: &CudaStream) {
        let id = StreamId(stream.cu_stream() as u64);
        if id != self.stream && stream.context().ordinal() == self.shared.device {
            self.note_use(id);
        }
    }
}

impl<T> DeviceSlice<T> for Buffer<T, Cuda> {
    fn len(&self) -> usize {
        self.len
    }

    /// The stream the buffer was allocated on (the device's default stream if that stream has
    /// been dropped since).
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream_cache.get_or_init(|| Cuda::resolve(&self.shared, self.stream))
    }
}

impl<T> DevicePtr<T> for Buffer<T, Cuda> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.use_on(stream);
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Buffer<T, Cuda> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.use_on(stream);
        (self.ptr, SyncOnDrop::Sync(None))
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
        self.arg(&arg.ptr)
    }
}

// SAFETY: as above; `&mut` also rules out any other use of the buffer while the arguments exist.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut Buffer<T, Cuda>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut Buffer<T, Cuda>) -> &mut Self {
        self.arg(&arg.ptr)
    }
}
