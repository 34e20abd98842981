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
//! Callbacks never run under an allocator's lock. Each allocator queues its events in the order
//! they happen and delivers them one thread at a time in that order, right after the call that
//! made them: a `SegmentFree` is delivered before the segment's memory is given back (NCCL
//! registrations are undone first), and a call that obtained a segment returns after its
//! `SegmentAlloc` was delivered, unless another thread of the same allocator was delivering at
//! that moment (then that thread delivers it, just after).
//!
//! A callback may call mempool: read statistics, take a snapshot, drop buffers, record streams,
//! attach or detach hooks. Only allocating is refused there ([`Error::Reentrant`](crate::Error::Reentrant)), since an
//! allocation would feed the hook its own events. Events caused from inside a callback are
//! delivered after it returns. Without hooks the cost is one relaxed load per event.

use std::cell::Cell;
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::Result;
use crate::id::{AllocatorId, PoolId, StreamId};

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
    /// Memory was mapped into an expandable segment (one physical allocation; its blocks are
    /// handed out only after the hooks have seen this).
    SegmentMap,
    /// Memory of an expandable segment is about to be unmapped (fired before the unmap).
    SegmentUnmap,
}

impl Action {
    /// PyTorch's name for it (`alloc`, `free_requested`, `free_completed`, `segment_alloc`,
    /// `segment_free`, `oom`, `segment_map`, `segment_unmap`).
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::Oom => "oom",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
        }
    }
}

/// One event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
    /// The allocator it happened in (two allocators may serve the same device index: CUDA
    /// device 0, a host allocator, a simulated one).
    pub allocator: AllocatorId,
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
    /// Where the block was allocated (`alloc`, `free_requested`, `free_completed`), when stacks
    /// are recorded ([`record_stacks`](crate::record_stacks)); 0 otherwise.
    pub stack: crate::stacks::StackId,
}

impl TraceEntry {
    pub(crate) fn new(
        action: Action,
        allocator: AllocatorId,
        device: usize,
        pool: PoolId,
        addr: u64,
        size: usize,
        stream: StreamId,
    ) -> TraceEntry {
        let time_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        TraceEntry { action, allocator, device, pool, addr, size, stream, time_us, stack: 0 }
    }
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
        // Delivery copies the callback list before calling any, so this never waits on a
        // delivery in progress (a callback may detach itself or another).
        let removed: Vec<(u64, Callback)> = {
            let mut hooks = HOOKS.write().unwrap_or_else(|p| p.into_inner());
            let (gone, kept) = std::mem::take(&mut *hooks).into_iter().partition(|(id, _)| *id == self.id);
            *hooks = kept;
            gone
        };
        if !removed.is_empty() {
            ACTIVE.fetch_sub(1, Ordering::Relaxed);
        }
        // Dropped outside the lock: the callback may own the last handle of an allocator, whose
        // drop delivers its last events.
        drop(removed);
    }
}

/// Calls `callback` for every event of every allocator until the handle is dropped (a callback
/// attached from inside a callback sees the events after the current one). Callbacks run on
/// the threads that call the allocator, never on a pinned allocator's background event thread
/// (`pinned_use_background_threads`): the events of the blocks it files reach them with the
/// next call on that allocator.
pub fn attach(callback: impl Fn(&TraceEntry) + Send + Sync + 'static) -> Result<TraceHandle> {
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

/// The recorded events (oldest first) of one allocator, or of every allocator.
pub fn history(allocator: Option<AllocatorId>) -> Vec<TraceEntry> {
    let h = HISTORY.lock().unwrap_or_else(|p| p.into_inner());
    h.entries.iter().filter(|e| allocator.is_none_or(|a| e.allocator == a)).copied().collect()
}

/// Stack recording turned on or off: it counts as a listener (every allocation then passes the
/// shared state, where its stack is recorded).
pub(crate) fn stacks_changed(on: bool) {
    if on {
        ACTIVE.fetch_add(1, Ordering::Relaxed);
    } else {
        ACTIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether anything listens (one relaxed load).
#[inline]
pub(crate) fn enabled() -> bool {
    ACTIVE.load(Ordering::Relaxed) != 0
}

/// Whether segment-level events (segment allocation and free, map and unmap, out of memory) are
/// wanted: by a hook or the history, or, with the `tracing` feature, possibly by a subscriber
/// (the global level hint, one atomic load: no subscriber code runs here, which may be under an
/// allocator's lock; the subscriber's own filter decides at delivery, outside every lock).
#[inline]
pub(crate) fn segments_wanted() -> bool {
    #[cfg(feature = "tracing")]
    if tracing::level_filters::LevelFilter::current() >= tracing::level_filters::LevelFilter::DEBUG {
        return true;
    }
    enabled()
}

/// As [`segments_wanted`], for the out-of-memory event (a warning: wanted at WARN already).
#[inline]
pub(crate) fn oom_wanted() -> bool {
    #[cfg(feature = "tracing")]
    if tracing::level_filters::LevelFilter::current() >= tracing::level_filters::LevelFilter::WARN {
        return true;
    }
    enabled()
}

/// Runs `f`, user code of a `tracing` subscriber, as a hook runs: allocating from it is refused
/// (`Reentrant`), and a panic stays here (its payload dropped by `drop_payload`, which keeps
/// a panic of the payload's own `Drop` in too), so it never unwinds into the allocator, nor out of a `Drop` during an unwind.
#[cfg(feature = "tracing")]
pub(crate) fn contained<R>(f: impl FnOnce() -> R) -> Option<R> {
    let was = IN_HOOK.with(|h| h.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    IN_HOOK.with(|h| h.set(was));
    r.map_err(crate::backend::drop_payload).ok()
}

/// A `tracing` span entered until dropped, its subscriber's calls [`contained`].
#[cfg(feature = "tracing")]
pub(crate) struct ContainedSpan(Option<tracing::span::EnteredSpan>);

#[cfg(feature = "tracing")]
impl ContainedSpan {
    pub(crate) fn enter(make: impl FnOnce() -> tracing::Span) -> Option<ContainedSpan> {
        contained(|| ContainedSpan(Some(make().entered())))
    }
}

#[cfg(feature = "tracing")]
impl Drop for ContainedSpan {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            contained(|| drop(s));
        }
    }
}

/// With the `tracing` feature: the segment-level events as `tracing` events (target `mempool`),
/// called from delivery, outside every lock, in each allocator's event order.
#[cfg(feature = "tracing")]
fn to_tracing(e: &TraceEntry) {
    let (allocator, device, pool, addr, size, stream) = (e.allocator.0, e.device, e.pool.0, e.addr, e.size, e.stream.0);
    match e.action {
        Action::SegmentAlloc => {
            tracing::debug!(target: "mempool", allocator, device, pool, addr, size, stream, "segment allocated")
        }
        Action::SegmentFree => {
            tracing::debug!(target: "mempool", allocator, device, pool, addr, size, stream, "segment freed")
        }
        Action::SegmentMap => tracing::debug!(target: "mempool", allocator, device, pool, addr, size, stream, "mapped"),
        Action::SegmentUnmap => {
            tracing::debug!(target: "mempool", allocator, device, pool, addr, size, stream, "unmapped")
        }
        Action::Oom => tracing::warn!(target: "mempool", allocator, device, pool, requested = size, "out of memory"),
        Action::Alloc | Action::FreeRequested | Action::FreeCompleted => {}
    }
}

/// Whether this thread is inside a callback. Read from the thread's own flag alone: another
/// thread detaching the last hook meanwhile does not make it false.
#[inline]
pub(crate) fn in_hook() -> bool {
    IN_HOOK.with(Cell::get)
}

/// With the `tracing` feature, the subscriber of the thread an event happened on, which sees it
/// whatever thread delivers it (a thread-scoped subscriber included); nothing otherwise.
#[cfg(feature = "tracing")]
pub(crate) type Dispatch = Option<tracing::Dispatch>;
/// See above.
#[cfg(not(feature = "tracing"))]
pub(crate) type Dispatch = Option<std::convert::Infallible>;

/// The current thread's [`Dispatch`] (a thread-local read and a reference count: no subscriber
/// code runs, so it may be called under a lock). Only for segment-level events, which are rare.
#[inline]
pub(crate) fn dispatch() -> Dispatch {
    #[cfg(feature = "tracing")]
    {
        tracing::dispatcher::get_default(|d| {
            (!d.is::<tracing::subscriber::NoSubscriber>() && segments_wanted_by_tracing()).then(|| d.clone())
        })
    }
    #[cfg(not(feature = "tracing"))]
    None
}

#[cfg(feature = "tracing")]
fn segments_wanted_by_tracing() -> bool {
    tracing::level_filters::LevelFilter::current() >= tracing::level_filters::LevelFilter::WARN
}

/// Delivers an event to the history and every callback (called outside every allocator lock).
pub(crate) fn deliver(e: &TraceEntry, d: Dispatch) {
    let e = *e;
    {
        let mut h = HISTORY.lock().unwrap_or_else(|p| p.into_inner());
        if h.max > 0 {
            if h.entries.len() == h.max {
                h.entries.pop_front();
            }
            h.entries.push_back(e);
        }
    }
    // A subscriber is user code, as a hook is: contained the same way. Told to the subscriber
    // of the thread the event happened on.
    #[cfg(feature = "tracing")]
    if let Some(d) = d {
        contained(|| tracing::dispatcher::with_default(&d, || to_tracing(&e)));
    }
    #[cfg(not(feature = "tracing"))]
    let _ = d;
    let hooks: Vec<Callback> = HOOKS.read().unwrap_or_else(|p| p.into_inner()).iter().map(|(_, c)| c.clone()).collect();
    if hooks.is_empty() {
        return;
    }
    let was = IN_HOOK.with(|f| f.replace(true));
    for h in hooks {
        // A panicking callback must not unwind into the allocator (it may be inside `Drop`);
        // the panic is contained here.
        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(&e))) {
            crate::backend::drop_payload(p);
        }
    }
    IN_HOOK.with(|f| f.set(was));
}
