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
//!     assert_eq!(b.stream_id(), side);
//! }
//! assert_eq!(alloc.current_stream(), mempool::StreamId(0));
//! # Ok::<(), mempool::Error>(())
//! ```

use std::cell::RefCell;
use std::marker::PhantomData;

use crate::backend::StreamId;

thread_local! {
    /// `(allocator key, current stream)`: a handful of entries, one per allocator this thread set
    /// a stream for. No entry: the default stream, `StreamId(0)`.
    static CURRENT: RefCell<Vec<(u32, StreamId)>> = const { RefCell::new(Vec::new()) };
}

/// This thread's current stream for allocator `key`.
#[inline]
pub(crate) fn current(key: u32) -> StreamId {
    CURRENT.with(|c| c.borrow().iter().rev().find(|(k, _)| *k == key).map_or(StreamId(0), |(_, s)| *s))
}

/// Sets the current stream for `key` (None: back to the default), returning the previous one.
fn replace(key: u32, s: Option<StreamId>) -> Option<StreamId> {
    CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        let pos = c.iter().position(|(k, _)| *k == key);
        let prev = pos.map(|p| c.swap_remove(p).1);
        if let Some(s) = s {
            c.push((key, s));
        }
        prev
    })
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
