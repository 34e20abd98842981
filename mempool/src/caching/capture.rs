//! CUDA-graph captures: while a stream is captured, allocations on it (and on streams forked
//! into the same capture, which share its capture id) come from the capture's pool, whatever
//! scope the thread is in; nothing the driver refuses during a capture is done: no event is
//! recorded on, queried or waited for (cross-stream frees wait until no capture is under way), and
//! no memory goes back (`empty_cache` is refused; released pools, garbage collection and the
//! out-of-memory ladder give back nothing until the last capture ends).
//!
//! `capturing` (the number of captures under way) is read without the lock on every
//! allocation: when it is 0, the thread caches and the usual path run unchanged.
//!
//! Giving memory back runs outside the lock (the outbox's run), so the check that no capture is
//! under way is made where it runs, not where it was queued: a free, unmap or reservation free
//! reaching the run during a capture is held back until the last capture ends, and a capture
//! begins only once the ones running (`State::freeing`) are done.

use std::sync::atomic::Ordering;

use super::{Allocation, DeviceAllocator, Request};
use crate::error::{Error, Result};
use crate::id::{PoolRef, StreamRef};

/// A capture under way: its capture id (the driver's) and the pool its allocations go to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Underway {
    pub(super) id: u64,
    pub(super) pool: PoolRef,
}

/// How long `begin_capture` waits for frees under way (a user's `free` that blocks on the
/// capturing thread would otherwise hang both).
const FREE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

fn refused(what: &'static str, message: impl Into<String>) -> Error {
    Error::Capture { what, message: message.into() }
}

impl DeviceAllocator {
    /// Begins a capture: `start` begins it on `stream` (under the lock, so that no allocation on
    /// the stream slips between the start and the registration); its allocations then go to
    /// `pool`. Returns the capture id.
    pub(crate) fn begin_capture(
        &self,
        stream: StreamRef,
        pool: PoolRef,
        start: impl FnOnce() -> Result<()>,
    ) -> Result<u64> {
        let be = &*self.backend;
        if super::releasing_here(self.id) {
            return Err(refused(
                "begin_capture",
                "called while this thread gives memory of this allocator back (from a pool allocator's `free` or a map guard): a capture cannot begin inside a free",
            ));
        }
        // No free, unmap or reservation free may run during the capture: wait for those under
        // way outside the lock (later ones see the capture and wait for its end).
        let mut st = self.lock();
        let since = std::time::Instant::now();
        while st.freeing > 0 {
            drop(st);
            if since.elapsed() > FREE_PATIENCE {
                return Err(refused(
                    "begin_capture",
                    format!(
                        "a segment free of this allocator has been under way for {} s (a pool allocator's `free` or a map guard that does not return?): the capture cannot begin before it ends",
                        FREE_PATIENCE.as_secs()
                    ),
                ));
            }
            std::thread::sleep(std::time::Duration::from_micros(20));
            st = self.lock();
        }
        if st.resolve(pool).is_none() {
            return Err(refused("begin_capture", format!("pool {} is released", pool.id.0)));
        }
        if let Some(c) = st.captures.iter().find(|c| c.pool.id == pool.id) {
            return Err(refused(
                "begin_capture",
                format!(
                    "pool {} is the pool of capture {} under way: two captures cannot allocate from one pool at once (end the first, then pass `graph.pool()` to the next)",
                    pool.id.0, c.id
                ),
            ));
        }
        // SAFETY: `stream` is the caller's live stream of this device (checked by `Allocator`).
        match unsafe { be.capture_id(stream.raw) } {
            Ok(None) => {}
            Ok(Some(id)) => {
                return Err(refused("begin_capture", format!("the stream is already being captured (capture {id})")))
            }
            Err(e) => return Err(e.into_error("asking a stream's capture status")),
        }
        start()?;
        // SAFETY: as above.
        let id = match unsafe { be.capture_id(stream.raw) } {
            Ok(Some(id)) => id,
            Ok(None) => return Err(refused("begin_capture", "the stream did not start capturing")),
            Err(e) => return Err(e.into_error("asking a stream's capture status")),
        };
        st.captures.push(Underway { id, pool });
        if let Some(slot) = st.resolve(pool) {
            st.pools[slot.get()].pinned += 1;
            // A pool a capture or graph holds is not cached by the thread caches (a block
            // freed now goes to its free set, where the capture may reuse it).
            self.set_pool_live(pool, false);
        }
        self.capturing.fetch_add(1, Ordering::Relaxed);
        Ok(id)
    }

    /// The capture `id` has ended on its stream (or was abandoned): its allocations go back to the
    /// usual routing; `graph`: a graph now holds the pool's memory (else it is unpinned). With
    /// the last capture gone, the cross-stream frees made during captures record their events,
    /// and released pools give back what they held.
    pub(crate) fn end_capture(&self, id: u64, graph: bool) {
        let be = &*self.backend;
        let mut st = self.lock();
        let Some(i) = st.captures.iter().position(|c| c.id == id) else { return };
        let ended = st.captures.swap_remove(i);
        if !graph && unpin(&mut st, ended.pool) {
            self.set_pool_live(ended.pool, true);
        }
        self.capturing.fetch_sub(1, Ordering::Relaxed);
        if st.captures.is_empty() {
            for (block, uses) in std::mem::take(&mut st.deferred) {
                st.record_uses(be, block, uses);
            }
            st.process_events(be);
            // What reached the outbox's run during the captures goes back now.
            let held = std::mem::take(&mut st.held_back);
            st.outbox.extend(held);
            st.release_cached(|p| p.released);
            st.give_back_runs_after_capture();
        }
        self.unlock(st, true);
    }

    /// A graph holding `pool`'s memory is gone.
    pub(crate) fn unpin_pool(&self, pool: PoolRef) {
        let mut st = self.lock();
        if unpin(&mut st, pool) {
            self.set_pool_live(pool, true);
        }
        self.unlock(st, false);
    }

    /// The id of the capture `stream` is in, if any.
    pub(crate) fn stream_capture_id(&self, stream: StreamRef) -> Result<Option<u64>> {
        // SAFETY: `stream` is a live stream of this device: the caller holds it.
        unsafe { self.backend.capture_id(stream.raw) }.map_err(|e| e.into_error("asking a stream's capture status"))
    }

    /// Whether a capture is under way on this device.
    pub(crate) fn capturing(&self) -> bool {
        self.capturing.load(Ordering::Relaxed) != 0
    }

    /// `malloc` while a capture is under way: a request on a captured stream goes to its
    /// capture's pool; no thread cache is used.
    #[cold]
    #[inline(never)]
    pub(super) fn malloc_capturing(&self, req: &Request<'_>) -> Result<Allocation> {
        // SAFETY: the request's stream is alive: the caller's current stream, which its entry
        // keeps alive, or a stream that never dies (the same promise `alloc_segment` relies on).
        let id = unsafe { self.backend.capture_id(req.stream.raw) }
            .map_err(|e| e.into_error("asking a stream's capture status"))?;
        let pool = id.and_then(|id| self.lock().captures.iter().find(|c| c.id == id).map(|c| c.pool));
        let routed;
        let req = match pool {
            Some(pool) => {
                routed = Request { size: req.size, stream: req.stream, pool, keep: req.keep };
                &routed
            }
            None => req,
        };
        self.malloc_locked(req).map_err(|e| self.completed_report(e))
    }

    /// Refuses `what` (which gives memory back) during a capture.
    pub(super) fn refuse_if_capturing(&self, what: &'static str) -> Result<()> {
        if self.capturing() {
            return Err(refused(
                what,
                "a CUDA graph capture is under way on this device: no memory is given back until it ends",
            ));
        }
        Ok(())
    }
}

/// One capture or graph less holds `pool`; true if none does any more (and the pool is live).
fn unpin(st: &mut super::State, pool: PoolRef) -> bool {
    if let Some(slot) = st.resolve(pool) {
        let p = &mut st.pools[slot.get()];
        p.pinned = p.pinned.saturating_sub(1);
        return p.pinned == 0 && !p.released;
    }
    false
}
