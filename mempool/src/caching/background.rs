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
//! The thread does not keep the allocator alive: it holds a `Weak` of the handle's shared part
//! and takes a strong reference only for one look. The allocator's `Drop` stops it and joins
//! it; a drop that happens on the thread itself (its look held the last reference) only stops
//! it, and the thread ends as soon as the drop returns. The process-wide allocators live for
//! the process, and so do their threads.

use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
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

/// What the thread reaches its allocator through.
pub(crate) enum PollTarget<S: 'static> {
    /// An allocator that goes when its last handle does.
    Weak(Weak<S>),
    /// A process-wide allocator, never dropped.
    Static(&'static S),
}

/// The thread's controls, shared by the allocator and the thread.
#[derive(Debug, Default)]
pub(super) struct Poller {
    wake: Mutex<Wake>,
    cv: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
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

    /// Stops the thread and waits for it to end, unless this is that thread (it then ends once
    /// the caller returns). Never panics.
    pub(super) fn stop(&self) {
        self.wake.lock().unwrap_or_else(PoisonError::into_inner).stop = true;
        self.cv.notify_all();
        let handle = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                // The thread's own panic (there is none to expect) is not the dropper's.
                let _ = h.join();
            }
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

    /// Starts the background thread (if the settings ask for it), reaching this allocator
    /// through `target` (`core` finds it there). From then on allocations query no event.
    /// Errors: the thread could not be started (the allocator then goes on without it).
    pub(crate) fn start_background<S: Send + Sync + 'static>(
        &self,
        target: PollTarget<S>,
        core: fn(&S) -> &DeviceAllocator,
    ) -> Result<()> {
        if !self.wants_background() || self.poller.get().is_some() {
            return Ok(());
        }
        let poller = Arc::new(Poller::default());
        let p = poller.clone();
        // The name says which allocator it serves (Linux shows its first 15 bytes).
        let name = format!("mp-ev-{}", self.id.0);
        let spawned = std::thread::Builder::new().name(name).spawn(move || {
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&p, &target, core)));
            if let Err(payload) = ran {
                // Not expected (hooks' and pool allocators' panics are contained already); if
                // it happens, the allocations process events again rather than leave freed
                // blocks waiting for a thread that is gone.
                std::mem::forget(payload);
                match &target {
                    PollTarget::Static(s) => core(s).lock().background = false,
                    PollTarget::Weak(w) => {
                        if let Some(s) = w.upgrade() {
                            core(&s).lock().background = false;
                        }
                    }
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
        self.unlock(st, false);
        (after < before, waiting)
    }
}

/// The thread's loop (see the module's documentation).
fn run<S>(poller: &Poller, target: &PollTarget<S>, core: fn(&S) -> &DeviceAllocator) {
    let mut delay = BUSY_MIN;
    let mut waiting = true;
    while poller.sleep(if waiting { delay } else { IDLE }) {
        let (done, left) = match target {
            PollTarget::Static(s) => core(s).poll_events(),
            PollTarget::Weak(w) => {
                let Some(s) = w.upgrade() else { return };
                let r = core(&s).poll_events();
                // May be the last reference: the allocator's `Drop` then runs here, stops this
                // loop and returns.
                drop(s);
                r
            }
        };
        waiting = left;
        delay = if done || !left { BUSY_MIN } else { (delay * 2).min(BUSY_MAX) };
    }
}
