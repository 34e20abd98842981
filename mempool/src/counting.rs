//! `Counting<A>`: a pool allocator adaptor that counts what its inner allocator hands out and
//! gets back (RMM's statistics adaptor, for `RawAllocator`s). Wrap any segment source to see what
//! a pool asks of it:
//!
//! ```
//! use mempool::{Allocator, BackendError, Counting, MemPool, PoolOptions, RawAllocator, StreamId, sim::SimDevice};
//! # struct MadeUp(std::sync::atomic::AtomicU64);
//! # // SAFETY: used with a simulated device only, whose memory is never touched; ranges are distinct.
//! # unsafe impl RawAllocator for MadeUp {
//! #     fn name(&self) -> &str { "made-up" }
//! #     fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
//! #         Ok(0x7000_0000_0000 + self.0.fetch_add(size as u64, std::sync::atomic::Ordering::Relaxed))
//! #     }
//! #     unsafe fn free(&self, _: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> { Ok(()) }
//! # }
//! let alloc = Allocator::sim(SimDevice::new(1 << 30));
//! let counted = Counting::new(MadeUp(0.into()));
//! let pool = MemPool::on(&alloc, PoolOptions::new().shared_allocator(counted.clone()))?;
//! drop(pool.alloc::<u8>(100)?);
//! assert_eq!(counted.counts().allocs, 1);
//! drop(pool); // its segment goes back through the adaptor
//! assert_eq!(counted.counts().live_bytes, 0);
//! # Ok::<(), mempool::Error>(())
//! ```

use std::sync::{Arc, Mutex};

use crate::backend::{BackendError, RawAllocator};
use crate::id::StreamId;

/// What a [`Counting`] adaptor has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorCounts {
    /// Successful `alloc` calls.
    pub allocs: u64,
    /// Successful `free` calls.
    pub frees: u64,
    /// `alloc` calls that failed (out of memory or an error).
    pub failed_allocs: u64,
    /// `free` calls that failed (the segment was not given back).
    pub failed_frees: u64,
    /// Bytes handed out, in all.
    pub allocated_bytes: usize,
    /// Bytes given back, in all.
    pub freed_bytes: usize,
    /// Bytes handed out and not given back.
    pub live_bytes: usize,
    /// The most `live_bytes` ever were.
    pub peak_bytes: usize,
}

/// Counts the calls of the pool allocator it wraps; every call is forwarded unchanged.
/// `Arc`-shared, so the counts stay readable after the pool took its handle
/// ([`PoolOptions::shared_allocator`](crate::PoolOptions::shared_allocator)).
pub struct Counting<A> {
    inner: A,
    counts: Mutex<AllocatorCounts>,
}

impl<A: RawAllocator> Counting<A> {
    /// Wraps `inner`.
    pub fn new(inner: A) -> Arc<Counting<A>> {
        Arc::new(Counting { inner, counts: Mutex::new(AllocatorCounts::default()) })
    }

    /// The counts so far.
    pub fn counts(&self) -> AllocatorCounts {
        *self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The wrapped allocator.
    pub fn inner(&self) -> &A {
        &self.inner
    }

    fn count(&self, f: impl FnOnce(&mut AllocatorCounts)) {
        f(&mut self.counts.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

impl<A> std::fmt::Debug for Counting<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = *self.counts.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("Counting").field("counts", &c).finish_non_exhaustive()
    }
}

// SAFETY: every call goes unchanged to `A`, whose own `unsafe impl` keeps the contract; the
// adaptor only counts (a failed `free` is counted as one, as the contract says it did not free).
unsafe impl<A: RawAllocator> RawAllocator for Counting<A> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn alloc(&self, size: usize, device: usize, stream: StreamId) -> Result<u64, BackendError> {
        let r = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.inner.alloc(size, device, stream)))
        {
            Ok(r) => r,
            Err(p) => {
                self.count(|c| c.failed_allocs += 1);
                std::panic::resume_unwind(p)
            }
        };
        self.count(|c| match r {
            Ok(p) if p != 0 => {
                c.allocs += 1;
                c.allocated_bytes += size;
                c.live_bytes += size;
                c.peak_bytes = c.peak_bytes.max(c.live_bytes);
            }
            _ => c.failed_allocs += 1,
        });
        r
    }

    unsafe fn free(&self, ptr: u64, size: usize, device: usize, stream: StreamId) -> Result<(), BackendError> {
        // SAFETY: the caller's promise for this free is the inner allocator's.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
            self.inner.free(ptr, size, device, stream)
        }));
        // A panicking free did not free (the contract): a failed free, then the panic goes on.
        let r = match r {
            Ok(r) => r,
            Err(p) => {
                self.count(|c| c.failed_frees += 1);
                std::panic::resume_unwind(p)
            }
        };
        self.count(|c| match r {
            Ok(()) => {
                c.frees += 1;
                c.freed_bytes += size;
                c.live_bytes = c.live_bytes.saturating_sub(size);
            }
            Err(_) => c.failed_frees += 1,
        });
        r
    }

    fn granularity(&self) -> usize {
        self.inner.granularity()
    }

    fn host_visible(&self) -> bool {
        self.inner.host_visible()
    }

    fn serves(&self, backend_kind: &str) -> bool {
        self.inner.serves(backend_kind)
    }
}
