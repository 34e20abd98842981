//! Identities: plain newtypes at the bottom of the crate, imported by every layer above.
//!
//! Two kinds of stream identity are kept apart on purpose. A [`StreamId`] is what the device
//! knows: for CUDA the `CUstream` handle, which the driver hands out again once a stream is
//! destroyed. A [`StreamKey`] is what the allocator keys its free sets and routes by: it is
//! never reused within a process, so a new stream that happens to get a dead stream's handle is
//! never taken for it (it gets no cached block and no pool route of the old one).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// Identifies a stream of one device as the device knows it. For CUDA it is the `CUstream`
/// handle's value (0: the default stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StreamId(pub u64);

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A stream's identity inside the allocator: unique for the life of the process (0: the
/// device's default stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub(crate) struct StreamKey(pub(crate) u64);

impl StreamKey {
    /// The default stream of a device.
    pub(crate) const DEFAULT: StreamKey = StreamKey(0);

    /// A key no stream has had before.
    pub(crate) fn fresh() -> StreamKey {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        StreamKey(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A stream as the allocator holds it: its unique key and its device handle.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamRef {
    pub(crate) key: StreamKey,
    pub(crate) raw: StreamId,
}

impl StreamRef {
    /// The device's default stream.
    pub(crate) const DEFAULT: StreamRef = StreamRef { key: StreamKey::DEFAULT, raw: StreamId(0) };
}

/// An event recorded on a stream, named by the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventId(pub u64);

/// Identifies a memory pool of a device. [`PoolId::DEFAULT`] is the default caching pools.
/// Ids are never reused within a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PoolId(pub u64);

impl PoolId {
    /// The device's default pools (small and large).
    pub const DEFAULT: PoolId = PoolId(0);

    /// An id no pool has had before.
    pub(crate) fn fresh() -> PoolId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        PoolId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// Identifies one allocator (one device's caching allocator, host or simulated ones each their
/// own) for the life of the process; trace entries carry it, so that a hook can tell two
/// allocators of the same device index apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllocatorId(pub(crate) u64);

impl AllocatorId {
    pub(crate) fn fresh() -> AllocatorId {
        // 64 bits: never wraps, so a thread's stream and route entries can never be taken for
        // another allocator's.
        static NEXT: AtomicU64 = AtomicU64::new(1);
        AllocatorId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for AllocatorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "allocator {}", self.0)
    }
}

/// Where a pool sits in its allocator's pool table, with the pool's id as a generation: a slot
/// is reused once its pool is gone, so a reference is good only while the ids agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolRef {
    pub(crate) id: PoolId,
    pub(crate) slot: u32,
}

impl PoolRef {
    /// The default pools.
    pub(crate) const DEFAULT: PoolRef = PoolRef { id: PoolId::DEFAULT, slot: 0 };
}
