//! The background event thread (`pinned_use_background_threads`): files the blocks whose
//! cross-stream events have completed, so that allocations query no event.
//!
//! One thread per allocator. It sleeps outside every lock of the allocator, on a condition
//! variable of its own: a locked section that queues an event wakes it (`State::kick`, acted on
//! as the lock is let go); while events are pending it looks again after a short sleep that
//! grows (50 µs to 1 ms) while nothing completes; with nothing pending it waits to be woken
//! (and looks every 100 ms all the same). Each look takes the allocator's lock for the event
//! queries, as an allocation did (`State::process_events`: an event is only queried under the
//! lock, where no other thread can release it).
//!
//! The thread holds no reference to the allocator, so the allocator goes (and its `Drop` runs)
//! on the thread that drops its last handle, as without the thread: it reaches the allocator
//! through its address, and only inside the poller's gate, which the allocator's `Drop` closes
//! before anything else (waiting for a look under way), then joins the thread. A look runs no
//! user code (it lets the lock go without running the outbox: hook events it queued wait for
//! the next call on the allocator), so nothing it does can drop the allocator or wait for the
//! gate.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::DeviceAllocator;
use crate::error::{Error, Result};

/// The first sleep while events are pending; doubled while none completes.
const BUSY_MIN: Duration = Duration::from_micros(50);
/// The longest sleep while events are pending.
const BUSY_MAX: Duration = Duration::from_millis(1);
/// How long the thread waits to be woken when nothing is pending before it looks anyway.
const IDLE: Duration = Duration::from_millis(100);

/// The allocator's address, for its thread (see the module's documentation).
struct Target(*const DeviceAllocator);

// SAFETY: the address is only followed inside the poller's gate, while the allocator (which is
// `Sync`, checked below) is alive: its `Drop` closes the gate first.
unsafe impl Send for Target {}

const _: fn() = || {
    fn sync<T: Sync>() {}
    sync::<DeviceAllocator>();
};

/// The thread's controls, shared by the allocator and the thread.
#[derive(Debug, Default)]
pub(super) struct Poller {
    wake: Mutex<Wake>,
    cv: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Closed (true) by the allocator's `Drop`; the thread follows the allocator's address only
    /// while holding it open.
    gate: Mutex<bool>,
}

#[derive(Debug, Default)]
struct Wake {
    /// The allocator is being dropped: the thread ends.
    stop: bool,
    /// An event was queued since the thread last looked.
    kicked: bool,
}

impl Poller {
    /// Wakes the thread: an event was queued.
    pub(super) fn kick(&self) {
        let mut w = self.wake.lock().unwrap_or_else(PoisonError::into_inner);
        if !w.kicked {
            w.kicked = true;
            self.cv.notify_one();
        }
    }

    /// Stops the thread and waits for it to end (a look under way first). Never panics.
    pub(super) fn stop(&self) {
        *self.gate.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.wake.lock().unwrap_or_else(PoisonError::into_inner).stop = true;
        self.cv.notify_all();
        let handle = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(h) = handle {
            // The thread runs no user code and holds no handle, so this is never that thread.
            debug_assert_ne!(h.thread().id(), std::thread::current().id());
            // The thread's own panic (there is none to expect) is not the dropper's.
            let _ = h.join();
        }
    }

    /// Sleeps until woken, stopped, or `timeout` passes; false when stopped.
    fn sleep(&self, timeout: Duration) -> bool {
        let mut w = self.wake.lock().unwrap_or_else(PoisonError::into_inner);
        if !w.stop && !w.kicked {
            w = self.cv.wait_timeout(w, timeout).unwrap_or_else(PoisonError::into_inner).0;
        }
        w.kicked = false;
        !w.stop
    }
}

impl DeviceAllocator {
    /// Whether the settings in effect ask for the background thread.
    pub(crate) fn wants_background(&self) -> bool {
        self.rounding.pinned_use_background_threads
    }

    /// Starts the background thread (if the settings ask for it). From then on allocations
    /// query no event. Errors: the thread could not be started (the allocator then goes on
    /// without it).
    ///
    /// # Safety
    /// `self` stays at this address until it is dropped (it is inside an `Arc`, or leaked): the
    /// thread follows the address until `Drop` stops it.
    pub(crate) unsafe fn start_background(&self) -> Result<()> {
        if !self.wants_background() || self.poller.get().is_some() {
            return Ok(());
        }
        let poller = Arc::new(Poller::default());
        let p = poller.clone();
        let target = Target(self);
        // The name says which allocator it serves (Linux shows its first 15 bytes).
        let name = format!("mp-ev-{}", self.id.0);
        let spawned = std::thread::Builder::new().name(name).spawn(move || {
            let target = target;
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&p, &target)));
            if let Err(payload) = ran {
                // Not expected (hooks' and pool allocators' panics are contained already); if
                // it happens, the allocations process events again rather than leave freed
                // blocks waiting for a thread that is gone.
                std::mem::forget(payload);
                let gate = p.gate.lock().unwrap_or_else(PoisonError::into_inner);
                if !*gate {
                    // SAFETY: the gate is open: the allocator is alive (see `Target`).
                    unsafe { &*target.0 }.lock().background = false;
                }
            }
        });
        match spawned {
            Ok(h) => {
                *poller.thread.lock().unwrap_or_else(PoisonError::into_inner) = Some(h);
                // Set before allocations stop querying, so every event queued from now on
                // wakes the thread.
                let _ = self.poller.set(poller);
                self.lock().background = true;
                Ok(())
            }
            Err(e) => Err(Error::backend(
                "starting the background event thread (pinned_use_background_threads)",
                format!("{e}; events are processed at allocations instead"),
            )),
        }
    }

    /// One look: files the blocks whose events have completed. Returns (whether any event
    /// completed, whether some are still pending and can complete now: none while a capture is
    /// under way, when no event may be queried).
    fn poll_events(&self) -> (bool, bool) {
        let mut st = self.lock();
        let before = st.pending.len() + st.foreign.len();
        if before != 0 {
            st.process_events(&*self.backend);
        }
        let after = st.pending.len() + st.foreign.len();
        let waiting = after != 0 && st.captures.is_empty();
        // Let go without running the outbox (no user code on this thread: see the module's
        // documentation); what the look queued is delivered by the next call.
        drop(st);
        (after < before, waiting)
    }
}

/// The thread's loop (see the module's documentation).
fn run(poller: &Poller, target: &Target) {
    let mut delay = BUSY_MIN;
    let mut waiting = true;
    while poller.sleep(if waiting { delay } else { IDLE }) {
        let gate = poller.gate.lock().unwrap_or_else(PoisonError::into_inner);
        if *gate {
            return;
        }
        // SAFETY: the gate is open and held: the allocator is alive until it is let go (its
        // `Drop` closes the gate first, waiting for this look).
        let (done, left) = unsafe { &*target.0 }.poll_events();
        drop(gate);
        waiting = left;
        delay = if done || !left { BUSY_MIN } else { (delay * 2).min(BUSY_MAX) };
    }
}
