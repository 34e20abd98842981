//! User pools: `MemPool`, whose memory comes from a [`RawAllocator`] of yours (ncclMemAlloc,
//! cuMemCreate on a NUMA node, a stream-ordered CUDA pool...) or from the device, carved by the
//! same caching algorithm and kept apart from every other pool.
//!
//! ```
//! use mempool::{Allocator, MemPool, PoolOptions, sim::SimDevice};
//! let alloc = Allocator::sim(SimDevice::new(256 << 20));
//! let pool = MemPool::on(&alloc, PoolOptions::new())?;
//! let inside = {
//!     let _scope = pool.scope();             // this thread, current stream: into `pool`
//!     alloc.alloc::<f32>(1024)?
//! };
//! let outside = alloc.alloc::<f32>(1024)?;   // the default pools again
//! assert_eq!(pool.memory_stats().allocation.current, 1);
//! assert_ne!(inside.device_ptr_raw(), outside.device_ptr_raw());
//! # Ok::<(), mempool::Error>(())
//! ```

use std::fmt;
use std::sync::Arc;

use crate::allocator::Allocator;
use crate::backend::contain;
pub use crate::backend::{MapGuard, RawAllocator};
use crate::buffer::Buffer;
use crate::caching::PoolSpec;
use crate::elem::AnyBitPattern;
use crate::error::{Error, Result};
use crate::id::{PoolId, PoolRef};
use crate::kind::{Cuda, Kind};
use crate::snapshot::Snapshot;
use crate::stats::PoolStats;

/// How a pool carves its memory. `PoolOptions::new()`: device memory, PyTorch's rules.
#[derive(Clone, Default)]
#[must_use]
pub struct PoolOptions {
    allocator: Option<Arc<dyn RawAllocator>>,
    use_on_oom: bool,
    no_split: bool,
    granularity: Option<usize>,
    expandable: bool,
    no_span: bool,
    map_guard: Option<Arc<dyn MapGuard>>,
    no_cache: bool,
}

impl fmt::Debug for PoolOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolOptions")
            .field("allocator", &self.allocator.as_ref().map(|a| a.name().to_string()))
            .field("use_on_oom", &self.use_on_oom)
            .field("no_split", &self.no_split)
            .field("granularity", &self.granularity)
            .field("expandable", &self.expandable)
            .field("no_span", &self.no_span)
            .field("map_guard", &self.map_guard.is_some())
            .field("no_cache", &self.no_cache)
            .finish()
    }
}

impl PoolOptions {
    /// Device memory, split and merged as in the default pools.
    pub fn new() -> PoolOptions {
        PoolOptions::default()
    }

    /// Segments come from `a` (and go back to it, and only to it).
    pub fn allocator(mut self, a: impl RawAllocator) -> PoolOptions {
        self.allocator = Some(Arc::new(a));
        self
    }

    /// Segments come from an allocator already shared elsewhere (a [`Counting`](crate::Counting)
    /// adaptor whose counts you read, say).
    pub fn shared_allocator(mut self, a: Arc<dyn RawAllocator>) -> PoolOptions {
        self.allocator = Some(a);
        self
    }

    /// The default pools may borrow this pool's free blocks when they would otherwise run out
    /// (the blocks still belong to, and return to, this pool).
    pub fn use_on_oom(mut self, yes: bool) -> PoolOptions {
        self.use_on_oom = yes;
        self
    }

    /// Every block takes its whole segment: a buffer never shares a segment (for registration
    /// and for buffers that must be symmetric across ranks).
    pub fn no_split(mut self, yes: bool) -> PoolOptions {
        self.no_split = yes;
        self
    }

    /// No caching layer: every buffer is a segment of its own (`no_split`), obtained from the
    /// pool's segment source when allocated and given back to it when freed (once the streams
    /// that used it are done). With a [`StreamOrderedAllocator`](crate::backend::stream_ordered::StreamOrderedAllocator)
    /// as the source this is PyTorch's `backend:cudaMallocAsync`: every buffer straight from and
    /// back to the driver's pool.
    pub fn no_cache(mut self, yes: bool) -> PoolOptions {
        self.no_cache = yes;
        self
    }

    /// Segment sizes rounded up to a multiple of `bytes` (a power of two, at most 1 GiB; a
    /// bad value is refused by [`MemPool::on`]), on top of what the allocator asks for.
    pub fn granularity(mut self, bytes: usize) -> PoolOptions {
        self.granularity = Some(bytes);
        self
    }
}

impl PoolOptions {
    /// Expandable segments: memory is mapped on demand into one reserved address range per
    /// (stream, pool kind), so a block can grow into the pages after it and the pool fragments
    /// far less (`expandable_segments:True` for the default pools). The backend's device memory
    /// only: a pool with its own [`allocator`](Self::allocator) cannot be expandable, nor a
    /// device without virtual memory management ([`MemPool::on`] refuses both).
    pub fn expandable(mut self, yes: bool) -> PoolOptions {
        self.expandable = yes;
        self
    }

    /// With [`expandable`](Self::expandable): no block spans two physical allocations, and each
    /// growth is one physical allocation, so that each can be registered on its own (NCCL before
    /// 2.29.2 registers one physical allocation per buffer). Costs some fragmentation.
    pub fn no_span(mut self, yes: bool) -> PoolOptions {
        self.no_span = yes;
        self
    }

    /// With [`expandable`](Self::expandable): `guard` is told of every physical allocation as it
    /// is mapped, and asked before each unmap (it may keep the memory mapped). `mempool-nccl`
    /// keeps its ledger of what NCCL holds this way. [`MemPool::on`] refuses a guard on a pool
    /// that is not expandable.
    pub fn map_guard(mut self, guard: impl MapGuard) -> PoolOptions {
        self.map_guard = Some(Arc::new(guard));
        self
    }

    /// Whether a [`map_guard`](Self::map_guard) is set.
    pub fn has_map_guard(&self) -> bool {
        self.map_guard.is_some()
    }

    /// Whether [`expandable`](Self::expandable) was asked for.
    pub fn is_expandable(&self) -> bool {
        self.expandable
    }
}

/// The largest segment granularity a pool takes (segments are at most 1 TiB − 512 B).
const MAX_GRANULARITY: usize = 1 << 30;

pub(crate) struct PoolInner<K: Kind> {
    pub(crate) alloc: Allocator<K>,
    pub(crate) pool: PoolRef,
}

impl<K: Kind> Drop for PoolInner<K> {
    fn drop(&mut self) {
        self.alloc.shared.core.release_pool(self.pool);
    }
}

/// A memory pool of one device (PyTorch's `torch.cuda.MemPool`). Cloning gives another handle;
/// when the last handle is dropped the pool's free segments go back through its own free
/// function at once, and the rest as their last buffers are dropped.
pub struct MemPool<K: Kind = Cuda> {
    pub(crate) inner: Arc<PoolInner<K>>,
}

impl<K: Kind> Clone for MemPool<K> {
    fn clone(&self) -> Self {
        MemPool { inner: self.inner.clone() }
    }
}

impl<K: Kind> fmt::Debug for MemPool<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemPool").field("id", &self.inner.pool.id.0).field("device", &self.device()).finish()
    }
}

impl MemPool<Cuda> {
    /// A private pool on device memory of the current CUDA device.
    pub fn new() -> Result<MemPool<Cuda>> {
        MemPool::on(&Allocator::cuda(crate::current_device())?, PoolOptions::new())
    }

    /// A pool on the current CUDA device whose segments come from `a`.
    pub fn with_allocator(a: impl RawAllocator) -> Result<MemPool<Cuda>> {
        MemPool::on(&Allocator::cuda(crate::current_device())?, PoolOptions::new().allocator(a))
    }
}

impl<K: Kind> MemPool<K> {
    /// A pool of `alloc`'s device with these options. Errors: a granularity (of the options or
    /// of the pool's allocator) that is not a power of two of at most 1 GiB ([`Error::Config`]);
    /// a pool allocator whose `granularity` or `name` panics ([`Error::PoolAllocator`]).
    pub fn on(alloc: &Allocator<K>, options: PoolOptions) -> Result<MemPool<K>> {
        let id = PoolId::fresh();
        let kind = alloc.backend_kind();
        let (raw_gran, name, host_visible, serves) = match &options.allocator {
            None => (512, kind.to_string(), false, true),
            Some(a) => contain("RawAllocator::granularity, name, host_visible and serves", || {
                Ok((a.granularity(), a.name().to_string(), a.host_visible(), a.serves(kind)))
            })
            .map_err(|e| Error::PoolAllocator {
                pool: id.0,
                allocator: "?".into(),
                message: e.to_string(),
            })?,
        };
        if !serves {
            return Err(Error::Config(format!(
                "PoolOptions: the pool allocator `{name}` does not serve a `{kind}` allocator (its memory and streams are another kind's)"
            )));
        }
        let asked = options.granularity.unwrap_or(512);
        for (what, g) in [("PoolOptions::granularity", asked), ("RawAllocator::granularity", raw_gran)] {
            if !g.is_power_of_two() || g > MAX_GRANULARITY {
                return Err(Error::Config(format!(
                    "{what} is {g}: a segment granularity must be a power of two of at most 1 GiB"
                )));
            }
        }
        if options.allocator.is_some() && alloc.shared.core.host_visible() {
            return Err(Error::Config(
                "PoolOptions: a pool of a pinned allocator takes its memory from that allocator (its buffers have host views); it cannot take its segments from a RawAllocator".into(),
            ));
        }
        if options.expandable && options.allocator.is_some() {
            return Err(Error::Config(
                "PoolOptions: an expandable pool maps the device's memory itself; it cannot take its segments from a RawAllocator".into(),
            ));
        }
        if options.map_guard.is_some() && !options.expandable {
            return Err(Error::Config(
                "PoolOptions::map_guard: only an expandable pool maps memory; this one is not expandable".into(),
            ));
        }
        if options.expandable && alloc.shared.core.backend().vm_granularity().is_none() {
            return Err(Error::Config(format!(
                "PoolOptions::expandable: the {} backend of device {} has no virtual memory management",
                alloc.backend_kind(),
                alloc.device()
            )));
        }
        let spec = PoolSpec {
            expandable: options.expandable,
            merge_runs: !options.no_span,
            map_guard: options.map_guard,
            id,
            raw: options.allocator,
            use_on_oom: options.use_on_oom,
            no_split: options.no_split || options.no_cache,
            no_cache: options.no_cache,
            granularity: asked.max(raw_gran).max(512),
            align: raw_gran.max(512),
            name,
            host_visible,
        };
        let pool = alloc.shared.core.register_pool(spec);
        Ok(MemPool { inner: Arc::new(PoolInner { alloc: alloc.clone(), pool }) })
    }

    /// The pool's id (as in snapshots and trace entries).
    pub fn id(&self) -> PoolId {
        self.inner.pool.id
    }

    /// The device index.
    pub fn device(&self) -> usize {
        self.inner.alloc.device()
    }

    /// The allocator of the pool's device.
    pub fn allocator(&self) -> &Allocator<K> {
        &self.inner.alloc
    }

    /// Live handles of this pool (clones, scope handles, wrapped futures).
    pub fn use_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// A buffer from this pool on the current stream, without a scope (contents as for
    /// [`Allocator::alloc`]).
    pub fn alloc<T: AnyBitPattern>(&self, len: usize) -> Result<Buffer<T, K>> {
        self.inner.alloc.alloc_in(len, self.pool_ref())
    }

    /// Like [`alloc`](Self::alloc), zero-filled on the current stream.
    pub fn alloc_zeros<T: cudarc::driver::ValidAsZeroBits>(&self, len: usize) -> Result<Buffer<T, K>> {
        let b = self.inner.alloc.alloc_in::<T>(len, self.pool_ref())?;
        self.inner.alloc.zero(&b)?;
        Ok(b)
    }

    pub(crate) fn pool_ref(&self) -> PoolRef {
        self.inner.pool
    }

    /// This pool's statistics (the device's [`memory_stats`](Allocator::memory_stats) include it).
    pub fn memory_stats(&self) -> PoolStats {
        self.inner.alloc.shared.core.pool_stats(self.inner.pool)
    }

    /// This pool's segments.
    pub fn snapshot(&self) -> Snapshot {
        let mut s = self.inner.alloc.snapshot();
        s.segments.retain(|seg| seg.pool == self.inner.pool.id);
        s.trace.retain(|e| e.pool == self.inner.pool.id);
        s
    }

    /// Gives this pool's wholly free segments back through its free function.
    pub fn empty_cache(&self) -> Result<()> {
        self.inner.alloc.shared.core.empty_pool_cache(self.inner.pool)
    }
}
