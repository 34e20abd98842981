//! Trace hooks: a callback sees every allocation, free and segment of every allocator.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use mempool::{trace::{self, Action}, Allocator, sim::SimDevice};
//! let seen = Arc::new(Mutex::new(Vec::new()));
//! let log = seen.clone();
//! let _hook = trace::attach(move |e| log.lock().unwrap().push(e.action))?;
//! let alloc = Allocator::sim(SimDevice::new(64 << 20));
//! drop(alloc.alloc::<u8>(100)?);
//! let seen = seen.lock().unwrap();
//! assert_eq!(seen[..4], [Action::SegmentAlloc, Action::Alloc, Action::FreeRequested, Action::FreeCompleted]);
//! # Ok::<(), mempool::Error>(())
//! ```
//!
//! Callbacks run on the thread that allocates, while that device's allocator is locked, so that
//! a `SegmentAlloc` is seen before any block of the segment is handed out and a `SegmentFree`
//! before the segment's memory is given back (NCCL registrations are undone first). A callback
//! that calls back into mempool gets [`Error::Reentrant`] (a `Buffer` dropped there is freed at
//! the allocator's next call), never a deadlock. Without hooks the cost is one relaxed load per
//! event.

use std::cell::Cell;
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::backend::StreamId;
use crate::caching::PoolId;
use crate::error::{Error, Result};

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// A block was handed out.
    Alloc,
    /// Its owner freed a block (it may still wait for other streams).
    FreeRequested,
    /// The block is back in its pool's free set.
    FreeCompleted,
    /// A segment was obtained from the device or a pool's allocator.
    SegmentAlloc,
    /// A segment is about to be given back (fired before the raw free).
    SegmentFree,
    /// An allocation failed for lack of memory.
    Oom,
}

impl Action {
    /// PyTorch's name for it (`alloc`, `free_requested`, `free_completed`, `segment_alloc`,
    /// `segment_free`, `oom`).
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::Oom => "oom",
        }
    }
}

/// One event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
    /// Device index.
    pub device: usize,
    /// The pool of the block or segment.
    pub pool: PoolId,
    /// Address of the block or segment (0 for `Oom`).
    pub addr: u64,
    /// Size in bytes (for `Oom`: the request).
    pub size: usize,
    /// The stream.
    pub stream: StreamId,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
}

impl fmt::Display for TraceEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} device={} pool={} addr={:#x} size={} stream={}",
            self.action.name(),
            self.device,
            self.pool.0,
            self.addr,
            self.size,
            self.stream
        )
    }
}

type Callback = Arc<dyn Fn(&TraceEntry) + Send + Sync>;

static HOOKS: RwLock<Vec<(u64, Callback)>> = RwLock::new(Vec::new());
/// Hooks attached plus 1 while history is recorded: the hot path's only check.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static HISTORY: Mutex<History> = Mutex::new(History { max: 0, entries: VecDeque::new() });

struct History {
    max: usize,
    entries: VecDeque<TraceEntry>,
}

thread_local! {
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Detaches its callback when dropped.
#[must_use = "the callback is detached when the handle is dropped"]
pub struct TraceHandle {
    id: u64,
}

impl fmt::Debug for TraceHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TraceHandle").field("id", &self.id).finish()
    }
}

impl Drop for TraceHandle {
    fn drop(&mut self) {
        if IN_HOOK.with(Cell::get) {
            // Detaching from inside a callback would wait on the lock the dispatch holds; the
            // callback stays attached rather than deadlock.
            return;
        }
        let mut hooks = HOOKS.write().unwrap_or_else(|p| p.into_inner());
        let before = hooks.len();
        hooks.retain(|(id, _)| *id != self.id);
        if hooks.len() < before {
            ACTIVE.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Calls `callback` for every event of every allocator until the handle is dropped.
/// From inside a callback: [`Error::Reentrant`].
pub fn attach(callback: impl Fn(&TraceEntry) + Send + Sync + 'static) -> Result<TraceHandle> {
    if in_hook() {
        return Err(Error::Reentrant);
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    HOOKS.write().unwrap_or_else(|p| p.into_inner()).push((id, Arc::new(callback)));
    ACTIVE.fetch_add(1, Ordering::Relaxed);
    Ok(TraceHandle { id })
}

/// Keeps the last `max_entries` events of every allocator for [`history`] and snapshots
/// (0 stops recording and forgets them).
pub fn record_history(max_entries: usize) {
    let mut h = HISTORY.lock().unwrap_or_else(|p| p.into_inner());
    match (h.max > 0, max_entries > 0) {
        (false, true) => {
            ACTIVE.fetch_add(1, Ordering::Relaxed);
        }
        (true, false) => {
            ACTIVE.fetch_sub(1, Ordering::Relaxed);
        }
        _ => {}
    }
    h.max = max_entries;
    while h.entries.len() > max_entries {
        h.entries.pop_front();
    }
}

/// The recorded events (oldest first) of `device`, or of every device.
pub fn history(device: Option<usize>) -> Vec<TraceEntry> {
    let h = HISTORY.lock().unwrap_or_else(|p| p.into_inner());
    h.entries.iter().filter(|e| device.is_none_or(|d| e.device == d)).copied().collect()
}

/// Whether anything listens (one relaxed load).
#[inline]
pub(crate) fn enabled() -> bool {
    ACTIVE.load(Ordering::Relaxed) != 0
}

/// Whether this thread is inside a callback (only ever true while something listens).
#[inline]
pub(crate) fn in_hook() -> bool {
    enabled() && IN_HOOK.with(Cell::get)
}

/// Delivers an event to every callback and the history. The caller checked [`enabled`].
pub(crate) fn dispatch(action: Action, device: usize, pool: PoolId, addr: u64, size: usize, stream: StreamId) {
    let time_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
    let e = TraceEntry { action, device, pool, addr, size, stream, time_us };
    {
        let mut h = HISTORY.lock().unwrap_or_else(|p| p.into_inner());
        if h.max > 0 {
            if h.entries.len() == h.max {
                h.entries.pop_front();
            }
            h.entries.push_back(e);
        }
    }
    let hooks: Vec<Callback> = HOOKS.read().unwrap_or_else(|p| p.into_inner()).iter().map(|(_, c)| c.clone()).collect();
    if hooks.is_empty() {
        return;
    }
    let was = IN_HOOK.with(|f| f.replace(true));
    for h in hooks {
        // A panicking callback must not unwind through the allocator (it holds a lock and may be
        // inside `Drop`); the panic is contained here.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(&e)));
    }
    IN_HOOK.with(|f| f.set(was));
}
