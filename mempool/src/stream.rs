//! The current stream: one per allocator (so per device) per thread, and a guard that sets it
//! for a region.
//!
//! ```
//! use mempool::{Allocator, sim::SimDevice};
//! let sim = SimDevice::new(64 << 20);
//! let alloc = Allocator::sim(sim.clone());
//! let side = sim.new_stream();
//! {
//!     let _guard = alloc.set_stream(&side)?;
//!     assert_eq!(alloc.current_stream(), side);
//!     let b = alloc.alloc::<u8>(100)?;
//!     assert_eq!(b.stream_id(), side.id);
//! }
//! assert_eq!(alloc.current_stream(), sim.default_stream());
//! # Ok::<(), mempool::Error>(())
//! ```

use std::cell::RefCell;
use std::marker::PhantomData;

use crate::backend::StreamId;
use crate::caching::PoolRef;

/// A pool scope: allocations of this thread through allocator `key` on `stream` go to `pool`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Route {
    pub(crate) key: u32,
    pub(crate) stream: StreamId,
    pub(crate) pool: PoolRef,
    pub(crate) id: u64,
}

/// This thread's allocation context.
struct Tls {
    /// `(allocator key, current stream)`; no entry: the default stream, `StreamId(0)`.
    streams: Vec<(u32, StreamId)>,
    /// Active pool scopes, innermost last.
    routes: Vec<Route>,
    next_route: u64,
}

thread_local! {
    static TLS: RefCell<Tls> = const { RefCell::new(Tls { streams: Vec::new(), routes: Vec::new(), next_route: 1 }) };
}

fn stream_of(t: &Tls, key: u32) -> StreamId {
    t.streams.iter().rev().find(|(k, _)| *k == key).map_or(StreamId(0), |(_, s)| *s)
}

/// This thread's current stream for allocator `key`.
#[inline]
pub(crate) fn current(key: u32) -> StreamId {
    TLS.with(|t| stream_of(&t.borrow(), key))
}

/// This thread's current stream for allocator `key`, and the pool its allocations go to: the
/// innermost scope of this thread on that stream, or the default pools.
#[inline]
pub(crate) fn current_with_pool(key: u32) -> (StreamId, PoolRef) {
    TLS.with(|t| {
        let t = t.borrow();
        let s = stream_of(&t, key);
        if t.routes.is_empty() {
            return (s, PoolRef::DEFAULT);
        }
        let pool = t.routes.iter().rev().find(|r| r.key == key && r.stream == s).map_or(PoolRef::DEFAULT, |r| r.pool);
        (s, pool)
    })
}

/// Begins routing; returns the route's id for [`end_route`].
#[inline]
pub(crate) fn begin_route(key: u32, stream: StreamId, pool: PoolRef) -> u64 {
    TLS.with(|t| {
        let mut t = t.borrow_mut();
        let id = t.next_route;
        t.next_route += 1;
        t.routes.push(Route { key, stream, pool, id });
        id
    })
}

/// Ends exactly the route `id`, wherever it is in the stack (guards may be dropped out of order).
#[inline]
pub(crate) fn end_route(id: u64) {
    // `try_with`: during thread teardown the storage may already be gone, and then so are the routes.
    let _ = TLS.try_with(|t| {
        let mut t = t.borrow_mut();
        if let Some(i) = t.routes.iter().rposition(|r| r.id == id) {
            t.routes.remove(i);
        }
    });
}

/// Sets the current stream for `key` (None: back to the default), returning the previous one.
fn replace(key: u32, s: Option<StreamId>) -> Option<StreamId> {
    TLS.try_with(|t| {
        let mut t = t.borrow_mut();
        let pos = t.streams.iter().position(|(k, _)| *k == key);
        let prev = pos.map(|p| t.streams.swap_remove(p).1);
        if let Some(s) = s {
            t.streams.push((key, s));
        }
        prev
    })
    .unwrap_or(None)
}

/// Sets this thread's current stream of one allocator until dropped, then restores the one
/// before. Made by [`Allocator::set_stream`](crate::Allocator::set_stream).
#[must_use = "the stream is current only while the guard lives"]
pub struct StreamGuard {
    key: u32,
    prev: Option<StreamId>,
    // The setting is per thread: the guard must be dropped on the thread that made it.
    _not_send: PhantomData<*const ()>,
}

impl StreamGuard {
    pub(crate) fn new(key: u32, s: StreamId) -> StreamGuard {
        let prev = replace(key, Some(s));
        StreamGuard { key, prev, _not_send: PhantomData }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        replace(self.key, self.prev.take());
    }
}

impl std::fmt::Debug for StreamGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamGuard").field("allocator", &self.key).field("restores", &self.prev).finish()
    }
}
