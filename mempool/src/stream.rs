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
//!     assert_eq!(*b.stream(), side);
//! }
//! assert_eq!(alloc.current_stream(), mempool::StreamId(0));
//! # Ok::<(), mempool::Error>(())
//! ```

use std::any::Any;
use std::cell::RefCell;
use std::marker::PhantomData;

thread_local! {
    /// `(allocator key, current stream)`: a handful of entries, one per allocator this thread used.
    static CURRENT: RefCell<Vec<(u32, Box<dyn Any>)>> = const { RefCell::new(Vec::new()) };
}

/// This thread's current stream for allocator `key`; `default` makes the first one.
pub(crate) fn current<S: Clone + 'static>(key: u32, default: impl FnOnce() -> S) -> S {
    CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        if let Some((_, s)) = c.iter().find(|(k, _)| *k == key) {
            if let Some(s) = s.downcast_ref::<S>() {
                return s.clone();
            }
        }
        let s = default();
        c.retain(|(k, _)| *k != key);
        c.push((key, Box::new(s.clone())));
        s
    })
}

/// Replaces the current stream for `key`, returning the previous one (if any).
fn replace(key: u32, s: Option<Box<dyn Any>>) -> Option<Box<dyn Any>> {
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
    prev: Option<Box<dyn Any>>,
    // The setting is per thread: the guard must be dropped on the thread that made it.
    _not_send: PhantomData<*const ()>,
}

impl StreamGuard {
    pub(crate) fn new<S: 'static>(key: u32, s: S) -> StreamGuard {
        let prev = replace(key, Some(Box::new(s)));
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
        f.debug_struct("StreamGuard").field("allocator", &self.key).finish()
    }
}
