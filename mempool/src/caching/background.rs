//! The background event thread (`pinned_use_background_threads`): files the blocks whose
//! cross-stream events have completed, so that allocations query no event.
//!
//! One thread per allocator. It sleeps outside every lock of the allocator, on a condition
//! variable of its own: a locked section that queues an event wakes it (`State::kick`, acted on
//! as the lock is let go); while events are pending it looks again after a short sleep that
//! grows (50 µs to 1 ms) while nothing completes; with nothing pending it waits to be woken
//! (and looks every 100 ms all the same). Each look takes the allocator's state lock for the
//! event queries, as an allocation did (`State::process_events`: an event is only queried under
//! the lock, where no other thread can release it).
//!
//! The thread holds no reference to the allocator: only the parts a look needs, each shared
//! through its own `Arc` ([`Parts`]: the state and its lock, the backend, two flags, the lock
//! of the retired statistics, where a look's changes are counted, as an exited thread's are).
//! So the allocator goes (and its `Drop` runs) on the thread that drops its last handle, as
//! without the thread, and nothing the thread holds is inside the allocator while `Drop` has
//! it mutably; `Drop` stops and joins the thread first. A look runs no user code and nothing
//! that needs the allocator itself: it lets the state lock go without running the outbox (hook
//! events, and segment frees it made due, wait for the next call on the allocator; `Drop` runs
//! what is left).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::state::State;
use super::DeviceAllocator;
use crate::backend::Backend;
use crate::error::{Error, Result};

/// The first sleep while events are pending; doubled while none completes.
const BUSY_MIN: Duration = Duration::from_micros(50);
/// The longest sleep while events are pending.
const BUSY_MAX: Duration = Duration::from_millis(1);
/// How long the thread waits to be woken when nothing is pending before it looks anyway.
const IDLE: Duration = Duration::from_millis(100);

/// The allocator's parts a look uses, shared with the allocator (see the module's
/// documentation).
struct Parts {
    state: Arc<super::bias::BiasedMutex<State>>,
    backend: Arc<dyn Backend>,
    has_work: Arc<AtomicBool>,
    has_error: Arc<AtomicBool>,
    retired_lock: crate::sync::Arc<crate::sync::Mutex<()>>,
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

    /// Stops the thread and waits for it to end (a look under way first). Never panics.
    pub(super) fn stop(&self) {
        self.wake.lock().unwrap_or_else(PoisonError::into_inner).stop = true;
        self.cv.notify_all();
        let handle = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(h) = handle {
            // The thread holds no handle of the allocator, so this is never that thread.
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
    pub(crate) fn start_background(&self) -> Result<()> {
        if !self.wants_background() || self.poller.get().is_some() {
            return Ok(());
        }
        let poller = Arc::new(Poller::default());
        let p = poller.clone();
        let parts = Parts {
            state: self.state.clone(),
            backend: self.backend.clone(),
            has_work: self.has_work.clone(),
            has_error: self.has_error.clone(),
            retired_lock: self.caches.retired_lock_handle(),
        };
        // The name says which allocator it serves (Linux shows its first 15 bytes).
        let name = format!("mp-ev-{}", self.id.0);
        let spawned = std::thread::Builder::new().name(name).spawn(move || {
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&p, &parts)));
            if let Err(payload) = ran {
                // Not expected; if it happens, the allocations process events again rather than
                // leave freed blocks waiting for a thread that is gone.
                crate::backend::drop_payload(payload);
                parts.state.lock().background = false;
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
}

/// One look: files the blocks whose events have completed, their statistics counted in the
/// retired counters (the lock order of a locked section: the state, then `retired_lock`).
/// Returns (whether any event completed, whether some are still pending and can complete now:
/// none while a capture is under way, when no event may be queried).
fn poll_events(p: &Parts) -> (bool, bool) {
    let mut st = p.state.lock();
    let before = st.pending.len() + st.foreign.len();
    if before == 0 {
        return (false, false);
    }
    let retired = p.retired_lock.lock().unwrap_or_else(PoisonError::into_inner);
    let to = st.sink.retired();
    // SAFETY: the retired counters live as long as the board (the sink holds it); we hold their
    // lock until the sink is cleared below, before either lock is let go.
    unsafe { st.sink.point(to, crate::stats::MIN_BYTE_SLACK) };
    st.process_events(&*p.backend);
    let after = st.pending.len() + st.foreign.len();
    let waiting = after != 0 && st.captures.is_empty();
    p.has_error.store(st.error.is_some(), Ordering::Relaxed);
    if !st.outbox.is_empty() {
        // Delivered by the next call on the allocator (or its `Drop`).
        p.has_work.store(true, Ordering::Release);
    }
    // This thread is awake already.
    st.kick = false;
    // Nothing left uncommitted for the retired counters' next writer (`Board::commit_retired`).
    st.sink.board().commit_retired();
    st.sink.clear();
    drop(st);
    drop(retired);
    (after < before, waiting)
}

/// The thread's loop (see the module's documentation).
fn run(poller: &Poller, parts: &Parts) {
    let mut delay = BUSY_MIN;
    let mut waiting = true;
    while poller.sleep(if waiting { delay } else { IDLE }) {
        let (done, left) = poll_events(parts);
        waiting = left;
        delay = if done || !left { BUSY_MIN } else { (delay * 2).min(BUSY_MAX) };
    }
}
