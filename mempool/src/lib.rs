//! # mempool
//!
//! A caching device allocator for Rust GPU programs (cudarc underneath), with the behaviour
//! PyTorch users know from `torch.cuda`'s CUDACachingAllocator: sizes rounded to 512 B, small
//! requests from 2 MiB segments, best-fit reuse per stream, splitting and merging, cross-stream
//! frees deferred until the other streams are done, an out-of-memory path that empties the cache
//! and retries, `memory_stats`, `memory_summary`, `empty_cache`.
//!
//! ```no_run
//! // GPU 0's process-wide allocator; allocations are cached and reused.
//! let a = mempool::alloc::<f32>(1 << 20)?;     // on the current device and stream
//! let first = a.device_ptr_raw();
//! drop(a);
//! let b = mempool::alloc::<f32>(1 << 20)?;     // same block, no cuMemAlloc
//! assert_eq!(b.device_ptr_raw(), first);
//! println!("{}", mempool::memory_summary(0)?);
//! # Ok::<(), mempool::Error>(())
//! ```
//!
//! The same algorithm runs over any [`Backend`]: CUDA, host memory, or the deterministic
//! simulated device of [`sim`], which is how it is tested everywhere without a GPU.
//!
//! | module | what |
//! | --- | --- |
//! | [`backend`] | the device boundary: [`Backend`] and its `cuda`, `host`, `sim` implementations |
//! | `caching` | the algorithm (private): blocks, segments, free sets, splitting, merging |
//! | [`Allocator`] | one device's allocator handle; [`Buffer`] owns one block |
//! | [`stream`] | the current stream per device per thread, and [`StreamGuard`] |
//! | [`config`] | `MEMPOOL_ALLOC_CONF` and [`Config`] |
//! | [`stats`] | [`MemoryStats`] and the summary table |
//! | [`snapshot`] | segments and blocks as they are now |

// `unsafe` lives where a contract meets the device: the backend boundary, the buffer's kernel
// argument, the element-type trait, and the few places that call the backend with addresses
// they own. Everything else is safe code, and the lint keeps it so.
#![deny(unsafe_code)]

/// A `tracing` event, target `mempool` (feature `tracing`); without the feature, nothing: the
/// arguments are not even compiled. Only where no allocator lock is held (a subscriber is user
/// code, and may call mempool); its calls are contained as a hook's are (`trace::contained`).
macro_rules! tracing_event {
    ($($arg:tt)*) => {
        #[cfg(feature = "tracing")]
        crate::trace::contained(|| ::tracing::event!(target: "mempool", $($arg)*));
    };
}

/// A `tracing` span, target `mempool`, entered until the value (an `Option`) is dropped
/// (feature `tracing`); `None` without the feature. The same rule as [`tracing_event!`]: never
/// under a lock.
macro_rules! tracing_span {
    ($($arg:tt)*) => {{
        #[cfg(feature = "tracing")]
        let span = crate::trace::ContainedSpan::enter(|| ::tracing::span!(target: "mempool", $($arg)*));
        #[cfg(not(feature = "tracing"))]
        let span: Option<()> = None;
        span
    }};
}

#[doc(hidden)]
pub mod __private;
#[allow(unsafe_code)] // `alloc_uninit`, and zero-filling a buffer through the backend
pub mod allocator;
#[allow(unsafe_code)] // the `unsafe trait`s and their implementations: the only device calls
pub mod backend;
#[allow(unsafe_code)] // cudarc's `PushKernelArg` for buffers
pub mod buffer;
#[allow(unsafe_code)] // backend calls with the addresses, streams and events the cache holds
mod caching;
pub mod config;
#[allow(unsafe_code)] // `unsafe impl RawAllocator` by forwarding
mod counting;
#[allow(unsafe_code)] // `unsafe trait AnyBitPattern` and its implementations
mod elem;
pub mod error;
pub mod format;
#[allow(unsafe_code)] // `Graph::replay`: the captured launches' contract, for every replay
pub mod graph;
mod id;
#[allow(unsafe_code)] // CUDA IPC calls, and the shared-memory lease counter (`mmap`)
pub mod ipc;
mod kind;
pub mod pool;
pub mod rules;
pub mod scope;
pub mod snapshot;
#[allow(unsafe_code)] // the unsynchronised stack walk (Linux), see `stacks::capture`
pub mod stacks;
pub mod stats;
pub mod stream;
mod sync;
pub mod trace;

pub use allocator::{Allocator, Cuda, Host, Kind, Sim, SimGraph};
pub use backend::{sim, Backend, BackendError, MapGuard, RawAllocator};
pub use buffer::Buffer;
pub use config::Config;
pub use counting::{AllocatorCounts, Counting};
pub use elem::AnyBitPattern;
pub use error::{Cause, Error, OomReport, Result};
pub use graph::{Capture, CaptureMode, Graph};
pub use id::{AllocatorId, EventId, PoolId, StreamId};
pub use pool::{MemPool, PoolOptions};
pub use scope::{PoolScope, ScopeHandle, Scoped};
pub use snapshot::{BlockSnapshot, BlockState, SegmentSnapshot, Snapshot};
pub use stacks::StackMode;
pub use stats::{MemoryStats, PoolStats, Stat, StatArray};
pub use stream::StreamGuard;

#[doc(inline)]
pub use mempool_macros::{begin_pool, end_pool, pool_scope, pool_scopes, with_pool};

use std::cell::Cell;

thread_local! {
    static DEVICE: Cell<usize> = const { Cell::new(0) };
}

/// Keeps the last `max_entries` allocator events of every device for snapshots (0 stops);
/// PyTorch's `torch.cuda.memory._record_memory_history(max_entries=...)`. The variable
/// `MEMPOOL_RECORD_HISTORY=<max_entries>` does the same when the first allocator is made.
pub fn record_history(max_entries: usize) {
    trace::record_history(max_entries)
}

/// Records `mode` stacks with every allocation from now on (with history or hooks on; see
/// [`stacks`]), PyTorch's `_record_memory_history(stacks=...)`. `MEMPOOL_RECORD_STACKS=sites|full`
/// does the same when the first allocator is made. Turning it on again starts afresh: a block
/// allocated while it was off shows no stack.
pub fn record_stacks(mode: StackMode) {
    if let Some(on) = stacks::set_mode(mode) {
        // Recording counts as a listener: every allocation then passes the shared state, where
        // its stack is recorded (no thread cache).
        trace::stacks_changed(on);
    }
}

/// This thread's current CUDA device (0 unless [`set_device`] said otherwise).
pub fn current_device() -> usize {
    DEVICE.with(Cell::get)
}

/// Sets this thread's current CUDA device. Errors if it does not exist.
pub fn set_device(device: usize) -> Result<()> {
    let count = backend::cuda::device_count()?;
    if device >= count {
        return Err(Error::InvalidDevice { device, count });
    }
    DEVICE.with(|d| d.set(device));
    Ok(())
}

/// The number of CUDA devices ([`Error::NoCudaDriver`] without a driver).
pub fn device_count() -> Result<usize> {
    backend::cuda::device_count()
}

/// `len` elements of `T` on the current device and stream (see [`Allocator::alloc`]).
pub fn alloc<T: AnyBitPattern>(len: usize) -> Result<Buffer<T>> {
    Allocator::cuda(current_device())?.alloc(len)
}

/// `len` zeroed elements of `T` on the current device and stream.
pub fn alloc_zeros<T: cudarc::driver::ValidAsZeroBits>(len: usize) -> Result<Buffer<T>> {
    Allocator::cuda(current_device())?.alloc_zeros(len)
}

/// Gives every wholly free cached segment of every CUDA device back to the driver.
pub fn empty_cache() -> Result<()> {
    let mut first = Ok(());
    for a in Allocator::created() {
        if let Err(e) = a.empty_cache() {
            first = first.and(Err(e));
        }
    }
    first
}

/// The statistics of a CUDA device's allocator.
pub fn memory_stats(device: usize) -> Result<MemoryStats> {
    Ok(Allocator::cuda(device)?.memory_stats())
}

/// The summary table of a CUDA device's allocator.
pub fn memory_summary(device: usize) -> Result<String> {
    Ok(Allocator::cuda(device)?.memory_summary())
}

/// Resets the peaks of a CUDA device's statistics.
pub fn reset_peak_stats(device: usize) -> Result<()> {
    Allocator::cuda(device)?.reset_peak_stats();
    Ok(())
}
