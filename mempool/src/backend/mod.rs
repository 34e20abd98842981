//! The device boundary: everything the caching algorithm needs from a device.
//!
//! One caching algorithm serves every kind of device; a [`Backend`] supplies raw segments,
//! streams and events. Three ship with the crate:
//!
//! | backend | memory | events |
//! | --- | --- | --- |
//! | [`cuda`] | `cuMemAlloc` / `cuMemFree` | CUDA events |
//! | [`host`] | page-locked host memory through CUDA when a driver is present, plain otherwise | host work is synchronous: always complete |
//! | [`sim`] | none: addresses only, with a capacity limit and injectable failures | complete only when the test says so |

pub mod cuda;
pub mod host;
pub mod sim;

use std::fmt;

/// Identifies a stream of one device. For CUDA it is the `CUstream` handle's value (0: the
/// default stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StreamId(pub u64);

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// An event recorded on a stream, named by the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventId(pub u64);

/// What a backend reports when it cannot do what was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendError {
    /// The device has no memory left for this request.
    OutOfMemory,
    /// Anything else, with the driver's words.
    Failed(String),
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendError::OutOfMemory => f.write_str("out of memory"),
            BackendError::Failed(m) => f.write_str(m),
        }
    }
}

/// Raw segments, streams and events of one device.
///
/// The caching allocator calls these under its lock, a few times per segment (never per cached
/// allocation), so an implementation may be simple rather than fast.
pub trait Backend: Send + Sync + 'static {
    /// `"cuda"`, `"host"`, `"sim"`, or a user backend's name; used in reports.
    fn kind(&self) -> &'static str;
    /// The device index.
    fn device(&self) -> usize;
    /// `(free, total)` bytes of the device, where the backend knows them.
    fn memory_info(&self) -> Option<(usize, usize)>;
    /// A new segment of exactly `size` bytes, aligned to at least 512 bytes. `stream` is the
    /// stream the first allocation in it is made for.
    fn alloc_segment(&self, size: usize, stream: StreamId) -> Result<u64, BackendError>;
    /// Gives back a segment obtained from [`alloc_segment`](Backend::alloc_segment) with this size.
    fn free_segment(&self, addr: u64, size: usize) -> Result<(), BackendError>;
    /// Fills `size` bytes at `addr` with zeros, ordered on `stream`.
    fn zero(&self, addr: u64, size: usize, stream: StreamId) -> Result<(), BackendError>;
    /// Records an event on `stream` capturing the work submitted to it so far.
    fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError>;
    /// Whether the work the event captured has completed.
    fn query_event(&self, event: EventId) -> Result<bool, BackendError>;
    /// Blocks until the work the event captured has completed.
    fn synchronize_event(&self, event: EventId) -> Result<(), BackendError>;
    /// The event is no longer needed (it may be reused).
    fn release_event(&self, event: EventId);
}
