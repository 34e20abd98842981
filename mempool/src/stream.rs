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

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;

use crate::backend::Keep;
use crate::id::{PoolRef, StreamKey, StreamRef};

/// A pool scope: allocations of this thread through allocator `key` on `stream` go to `pool`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Route {
    pub(crate) key: u64,
    pub(crate) stream: StreamKey,
    pub(crate) pool: PoolRef,
    pub(crate) id: u64,
}

/// A current-stream setting of one allocator; the entry holds the stream alive.
struct Current {
    key: u64,
    stream: StreamRef,
    keep: Option<Keep>,
    id: u64,
}

/// This thread's allocation context.
struct Tls {
    /// Current-stream settings, innermost last; the last one of an allocator is its current
    /// stream (none: the default stream).
    streams: Vec<Current>,
    /// Active pool scopes, innermost last.
    routes: Vec<Route>,
    next_id: u64,
}

thread_local! {
    static TLS: RefCell<Tls> =
        const { RefCell::new(Tls { streams: Vec::new(), routes: Vec::new(), next_id: 1 }) };
    /// This thread has no current-stream setting and no pool scope (`TLS` holds none): every
    /// allocator's current stream is the default one, with the default pools. One load on the
    /// allocation path instead of `TLS`'s state check, borrow and searches. (No destructor:
    /// readable to the end of the thread.)
    static BARE: Cell<bool> = const { Cell::new(true) };
}

/// Sets `BARE` from `t` (after a change to it).
#[inline]
fn note_bare(t: &Tls) {
    let bare = t.streams.is_empty() && t.routes.is_empty();
    let _ = BARE.try_with(|b| b.set(bare));
}

#[inline(always)]
fn current_of(t: &Tls, key: u64) -> Option<&Current> {
    t.streams.iter().rev().find(|c| c.key == key)
}

// Every access is `try_with`: a thread-local destructor may allocate after this thread's
// context is gone; it then gets the default stream and no routes.

/// This thread's current stream for allocator `key`.
#[inline]
pub(crate) fn current(key: u64) -> StreamRef {
    if BARE.try_with(Cell::get).unwrap_or(false) {
        return StreamRef::DEFAULT;
    }
    TLS.try_with(|t| current_of(&t.borrow(), key).map_or(StreamRef::DEFAULT, |c| c.stream))
        .unwrap_or(StreamRef::DEFAULT)
}

/// What keeps this thread's current stream for allocator `key` alive (`None` for the default
/// stream, and for kinds whose streams never die).
pub(crate) fn current_keep(key: u64) -> Option<Keep> {
    TLS.try_with(|t| current_of(&t.borrow(), key).and_then(|c| c.keep.clone())).ok().flatten()
}

/// This thread's current stream for allocator `key`, and the pool its allocations go to: the
/// innermost scope of this thread on that stream, or the default pools.
#[inline]
pub(crate) fn current_with_pool(key: u64) -> (StreamRef, PoolRef) {
    if BARE.try_with(Cell::get).unwrap_or(false) {
        return (StreamRef::DEFAULT, PoolRef::DEFAULT);
    }
    TLS.try_with(|t| {
        let t = t.borrow();
        let s = current_of(&t, key).map_or(StreamRef::DEFAULT, |c| c.stream);
        // Inside a pool allocator's `alloc`, routes are set aside: a pool allocator allocating in
        // its own scope would otherwise call itself without end.
        if t.routes.is_empty() || crate::backend::in_source() {
            return (s, PoolRef::DEFAULT);
        }
        let pool =
            t.routes.iter().rev().find(|r| r.key == key && r.stream == s.key).map_or(PoolRef::DEFAULT, |r| r.pool);
        (s, pool)
    })
    .unwrap_or((StreamRef::DEFAULT, PoolRef::DEFAULT))
}

/// Begins routing; returns the route's id for [`end_route`].
#[inline]
/// `None` on a thread whose locals are being destroyed: it has no context left to route in.
pub(crate) fn begin_route(key: u64, stream: StreamKey, pool: PoolRef) -> Option<u64> {
    TLS.try_with(|t| {
        let mut t = t.borrow_mut();
        let id = t.next_id;
        t.next_id += 1;
        t.routes.push(Route { key, stream, pool, id });
        note_bare(&t);
        id
    })
    .ok()
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
        note_bare(&t);
    });
}

/// Sets this thread's current stream of one allocator until dropped. Made by
/// [`Allocator::set_stream`](crate::Allocator::set_stream).
///
/// Guards end by identity: dropping one removes exactly its own setting, so guards dropped out
/// of order leave the thread on the stream of the innermost guard still alive (or the default
/// stream), never on a stream nobody holds. The setting holds its stream alive, so a forgotten
/// guard (`mem::forget`) keeps the stream current, and alive, for the rest of the thread.
#[must_use = "the stream is current only while the guard lives"]
pub struct StreamGuard {
    id: u64,
    key: u64,
    // The setting is per thread: the guard must be dropped on the thread that made it.
    _not_send: PhantomData<*const ()>,
}

impl StreamGuard {
    /// `None` on a thread whose locals are being destroyed (no context to set a stream in).
    pub(crate) fn new(key: u64, stream: StreamRef, keep: Option<Keep>) -> Option<StreamGuard> {
        let id = TLS
            .try_with(|t| {
                let mut t = t.borrow_mut();
                let id = t.next_id;
                t.next_id += 1;
                t.streams.push(Current { key, stream, keep, id });
                note_bare(&t);
                id
            })
            .ok()?;
        Some(StreamGuard { id, key, _not_send: PhantomData })
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let removed = TLS.try_with(|t| {
            let mut t = t.borrow_mut();
            let i = t.streams.iter().rposition(|c| c.id == self.id)?;
            let c = t.streams.remove(i);
            note_bare(&t);
            Some(c)
        });
        // The stream (if this was its last holder) is destroyed outside the borrow.
        drop(removed);
    }
}

impl std::fmt::Debug for StreamGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamGuard").field("allocator", &self.key).field("id", &self.id).finish()
    }
}
