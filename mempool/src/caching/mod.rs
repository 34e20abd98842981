//! The caching algorithm: blocks, segments, free sets, splitting, merging, deferred frees, pools.
//!
//! Safe code only; every device action goes through a [`Backend`] or a pool's
//! [`RawAllocator`](crate::RawAllocator), with addresses this module obtained from them.
//!
//! | file | job |
//! | --- | --- |
//! | `mod.rs` | the entry points, the lock, and the outbox: work done outside the lock, in order |
//! | `state.rs` | the data behind the lock; carving: best fit, split, merge, counting |
//! | `segments.rs` | new segments, release, garbage collection, the out-of-memory report, pool retirement |
//! | `events.rs` | cross-stream frees through events |
//! | `background.rs` | the background thread that files completed cross-stream frees (`pinned_use_background_threads`) |
//! | `reserve.rs` | a pinned allocator's reserve segment (`pinned_reserve_segment_size_mb`) |
//! | `freeset.rs` | the binned best-fit sets |
//!
//! **What runs under the lock**: only this module's own code and event queries. User code (trace
//! hooks, pool allocators) and segment allocation and release run outside it, so a hook or a
//! pool allocator may call back into mempool without deadlocking, and a slow `cuMemAlloc` does
//! not stall other threads' cache hits. Hook events and segment frees are queued in the
//! *outbox* under the lock, in the order they happen, and run by one thread at a time in that
//! order: a `SegmentFree` reaches the hooks (NCCL deregisters) before the segment's memory goes
//! back, and a call that obtained a segment returns only after its `SegmentAlloc` was delivered
//! (unless another thread was delivering at that moment; it then delivers it).

mod asym;
mod background;
mod bias;
mod capture;
mod events;
mod expand;
mod freeset;
mod reserve;
mod segments;
mod state;
mod tcache;

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, TryLockError};

use crate::backend::{contain, Backend, BackendError, Keep};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::id::{AllocatorId, PoolId, PoolRef, StreamKey, StreamRef};
use crate::rules::is_small;
use crate::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot, Snapshot};
use crate::stats::{MemoryStats, PoolStats};
use crate::trace;
pub(crate) use state::{BlockIdx, PoolSpec};
use state::{SegIdx, Slot, Source, State, Work};

thread_local! {
    /// The allocators whose outbox this thread is running (a hook or a segment free is under
    /// way): a flush of one of them asked for meanwhile is left to that loop, so nothing a hook
    /// or a pool allocator does waits on itself. Other allocators' outboxes it runs as usual.
    static RUNNING: RefCell<Vec<AllocatorId>> = const { RefCell::new(Vec::new()) };
}

thread_local! {
    /// Allocators whose segment call or map this thread is inside, with the allocator's lock
    /// let go (user code of a pool allocator or map guard included). A request made from inside
    /// one (a pool's allocator that allocates from the same allocator) never waits for growth to
    /// end: it could be waiting for its own caller.
    static GROWING: RefCell<Vec<AllocatorId>> = const { RefCell::new(Vec::new()) };
}

thread_local! {
    /// Allocators whose memory this thread is giving back now (a segment free, an unmap or a
    /// reservation free under way, user code of a pool allocator or map guard included).
    static RELEASING: RefCell<Vec<AllocatorId>> = const { RefCell::new(Vec::new()) };
}

type IdSet = std::thread::LocalKey<RefCell<Vec<AllocatorId>>>;

/// Whether this thread's `set` holds `id` (false on a thread whose locals are gone).
fn marked(set: &'static IdSet, id: AllocatorId) -> bool {
    set.try_with(|r| r.borrow().contains(&id)).unwrap_or(false)
}

/// Adds `id` to this thread's `set`, or takes one occurrence of it out.
fn mark(set: &'static IdSet, id: AllocatorId, on: bool) {
    let _ = set.try_with(|r| {
        let mut r = r.borrow_mut();
        if on {
            r.push(id);
        } else if let Some(i) = r.iter().rposition(|x| *x == id) {
            r.remove(i);
        }
    });
}

/// Whether this thread is giving back `id`'s memory now (see [`RELEASING`]).
pub(super) fn releasing_here(id: AllocatorId) -> bool {
    marked(&RELEASING, id)
}

/// Runs `f` as this thread giving back `id`'s memory.
fn as_releasing<R>(id: AllocatorId, f: impl FnOnce() -> R) -> R {
    mark(&RELEASING, id, true);
    let _off = scopeguard::guard((), |()| mark(&RELEASING, id, false));
    f()
}

/// Whether this thread is inside a segment call or map of `id` (see [`GROWING`]); a thread
/// whose locals are gone says yes (it never waits).
fn growing_here(id: AllocatorId) -> bool {
    GROWING.try_with(|r| r.borrow().contains(&id)).unwrap_or(true)
}

/// Marks this thread as inside a segment call or map of `id` until the guard is dropped.
fn as_growing(id: AllocatorId) -> impl Drop {
    mark(&GROWING, id, true);
    scopeguard::guard((), move |()| mark(&GROWING, id, false))
}

/// Whether this thread is running `id`'s outbox.
fn running_here(id: AllocatorId) -> bool {
    marked(&RUNNING, id)
}

fn set_running(id: AllocatorId, on: bool) {
    mark(&RUNNING, id, on);
}

/// Items a runner takes from the outbox at a time.
const OUTBOX_BATCH: usize = 64;
/// How long a runner goes on delivering other threads' work once its own is done.
const OUTBOX_EXTRA: std::time::Duration = std::time::Duration::from_millis(1);

/// How long a call that promises its work is done (a new segment announced, `empty_cache`'s
/// memory back) waits for another thread that is running the outbox before it goes on without:
/// a hook may be waiting for a lock the caller holds, and then waiting longer would be a hang.
const OUTBOX_PATIENCE: std::time::Duration = std::time::Duration::from_millis(200);

/// An allocation request.
pub(crate) struct Request<'a> {
    /// Bytes asked for (> 0).
    pub(crate) size: usize,
    pub(crate) stream: StreamRef,
    pub(crate) pool: PoolRef,
    /// Gives what keeps `stream` alive, for a new segment (called only when one is made).
    pub(crate) keep: &'a dyn Fn() -> Option<Keep>,
}

/// Where a block's memory comes from, for CUDA IPC.
pub(crate) enum ExportSource {
    /// A whole backend segment (`cuMemAlloc`) at this address.
    Segment(u64),
    /// A segment of a pool's own allocator, at this address.
    Pool(Arc<dyn crate::backend::RawAllocator>, u64),
    /// Physical allocations of an expandable segment covering the block: (address, size,
    /// handle), in address order.
    Mapped(Vec<(u64, usize, u64)>),
}

/// A block handed out by [`DeviceAllocator::malloc`], and what its free needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Allocation {
    pub(crate) block: BlockIdx,
    pub(crate) addr: u64,
    /// The block's size.
    pub(crate) size: usize,
    /// It is in a small segment.
    pub(crate) small: bool,
    /// Its segment is split and counts in the inactive-split statistics (not an expandable
    /// segment's, which PyTorch leaves out), as a thread cache counts it; this cannot change
    /// while the block is allocated.
    pub(crate) split: bool,
    /// Its pool.
    pub(crate) pool: PoolRef,
    /// A thread cache may take it when it is freed (see `State::allocation`).
    pub(crate) cacheable: bool,
    /// Its free set (a `u32` index, kept in a word of its own: see below), and that set's
    /// generation right after it was handed out.
    pub(crate) set: u64,
    pub(crate) gen: u64,
}

// The hit path builds an `Allocation` field by field and the caller copies it into its
// `Buffer` at once: two `u32` fields side by side are read back as one 8-byte word, which the
// processor cannot forward from the two 4-byte stores still in flight (a stall of about a
// dozen cycles: with `set` a `u32`, a pair on the simulated device takes 26.2 ns instead of
// 23.7). So `set` is a `u64` and `block` the only `u32`.
const _: () = assert!(std::mem::size_of::<Allocation>() <= 64);

/// User pool slots whose blocks thread caches may hold (see `DeviceAllocator::pool_live`).
const CACHED_POOLS: usize = 64;

/// How long a request that found no memory waits, in all, for other threads' segments in the
/// making before it gives back cached memory (see `DeviceAllocator::grow`).
const GROWTH_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// What mapping more memory for a request came to.
enum Grown<'a> {
    /// The request is served from newly mapped memory.
    Done(Allocation),
    /// Memory was mapped or a reservation made: look for a block again.
    Retry,
    Failed(Error),
    /// No memory (the device's, or under the limit): the lock is held for the ladder.
    OutOfMemory(Locked<'a>),
}

/// The caching allocator of one device, over any [`Backend`].
pub(crate) struct DeviceAllocator {
    backend: Arc<dyn Backend>,
    id: AllocatorId,
    /// Shared with the background event thread (`background.rs`), as are `has_work` and
    /// `has_error`.
    state: Arc<bias::BiasedMutex<State>>,
    /// Held by the thread running the outbox.
    outbox: Mutex<()>,
    /// Whether the outbox may hold work (checked without the lock on the way out of a call).
    has_work: Arc<AtomicBool>,
    /// The thread caches, and the device-wide side of the block statistics.
    caches: tcache::Registry,
    /// What rounds a request (fixed at creation; `State::config` holds the same).
    rounding: Config,
    /// Whether an error is kept for the next call (so that a thread-cache hit does not skip it).
    has_error: Arc<AtomicBool>,
    /// Set by `Drop`: statistics are no longer kept.
    closing: AtomicBool,
    /// Graph captures under way (`capture.rs`); changed under the lock.
    capturing: AtomicUsize,
    /// Requests on the out-of-memory ladder now: while any is, frees bypass the thread caches.
    under_pressure: AtomicUsize,
    /// The live user pool of each of the first `CACHED_POOLS` slots (its id; 0: none, or
    /// released): a freed block of a user pool goes to a thread cache only while its pool is
    /// live (a released pool gives its memory back as its last block is freed).
    pool_live: [AtomicU64; CACHED_POOLS],
    /// The memory is host-visible (pinned host memory): `Backend::host_visible`.
    host_visible: bool,
    /// The outbox items that calls made from inside the outbox's own run (a hook or a pool
    /// allocator calling back on the running thread) queued: the run delivers them too before
    /// it stops, as those calls cannot wait for themselves.
    nested_target: AtomicU64,
    /// The background event thread's controls, once it is started (`background.rs`).
    poller: OnceLock<Arc<background::Poller>>,
}

/// The state, locked, with its statistics sink pointed at the calling thread's counters (or at
/// the retired ones, whose lock it then holds too).
struct Locked<'a> {
    /// Taken out only by `Drop` (no `Option`: every access through `Deref` would test it).
    guard: std::mem::ManuallyDrop<bias::BiasedGuard<'a, State>>,
    retired: Option<crate::sync::MutexGuard<'a, ()>>,
    owner: &'a DeviceAllocator,
}

impl Deref for Locked<'_> {
    type Target = State;
    #[inline(always)]
    fn deref(&self) -> &State {
        &self.guard
    }
}

impl DerefMut for Locked<'_> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: `guard` is taken once, here, and `self` is not used after its drop.
        let mut g = unsafe { std::mem::ManuallyDrop::take(&mut self.guard) };
        self.owner.has_error.store(g.error.is_some(), Ordering::Relaxed);
        // An event queued for the background thread: it is woken once the lock is let go.
        let kick = g.kick;
        if kick {
            g.kick = false;
        }
        if !g.outbox.is_empty() {
            // Queued by a call that lets go without running the outbox (a deferred block
            // filed as this lock was taken): the next run delivers it.
            self.owner.has_work.store(true, Ordering::Release);
        }
        if self.retired.is_some() {
            // The retired counters leave nothing uncommitted for their next writer (see
            // `Board::commit_retired`).
            g.sink.board().commit_retired();
        }
        g.sink.clear();
        drop(g);
        drop(self.retired.take());
        if kick {
            if let Some(p) = self.owner.poller.get() {
                p.kick();
            }
        }
    }
}

impl std::fmt::Debug for DeviceAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceAllocator").field("id", &self.id).field("backend", &self.backend.kind()).finish()
    }
}

/// Drops `x`, whose `Drop` is user code (a pool's allocator or map guard), outside every lock;
/// a panic in it is contained.
fn drop_user_code<T>(x: T) {
    let _ = contain("a pool's allocator or map guard being dropped", || {
        drop(x);
        Ok(())
    });
}

impl DeviceAllocator {
    pub(crate) fn new(backend: Arc<dyn Backend>, config: Config, id: AllocatorId) -> DeviceAllocator {
        let limit = limit_for(&*backend, config.memory_fraction);
        let mut default_pool = PoolSpec {
            id: PoolId::DEFAULT,
            raw: None,
            use_on_oom: false,
            no_split: false,
            no_cache: false,
            granularity: 512,
            align: 512,
            name: backend.kind().to_string(),
            // Without virtual memory (host memory) the setting has nothing to act on; CUDA
            // devices without it are refused when their allocator is made.
            expandable: config.expandable_segments && backend.vm_granularity().is_some(),
            merge_runs: true,
            map_guard: None,
            host_visible: false,
        };
        let device = backend.device();
        let caches = tcache::Registry::default();
        // What is in effect: `config()` reports it.
        let mut config = config;
        config.expandable_segments = default_pool.expandable;
        // Host-visible memory: a freed block the device used waits for its own stream too; only
        // blocks the device never used (`Buffer::mark_device_use`) reach the thread caches, which
        // hand blocks out again at once.
        let host_visible = backend.host_visible();
        // Power-of-two rounding, the reserve segment and the background event thread are the
        // pinned allocators' options alone.
        config.pinned_round_power2 &= host_visible;
        config.pinned_use_background_threads &= host_visible;
        if !host_visible {
            config.pinned_reserve_segment_size = 0;
        }
        // `backend:cudaMallocAsync`: the default pools pass every buffer to the driver's
        // stream-ordered pool, with no caching (no thread caches either).
        let malloc_async = if config.malloc_async { backend.malloc_async_source() } else { None };
        config.malloc_async = malloc_async.is_some();
        if let Some(source) = malloc_async {
            default_pool.raw = Some(source);
            default_pool.no_split = true;
            default_pool.no_cache = true;
            config.thread_cache = false;
        }
        let mut state = State::new(config.clone(), limit, default_pool, id, device, caches.board.clone());
        state.host_visible = host_visible;
        state.vm_page = backend.vm_granularity().filter(|p| p.is_power_of_two());
        if let Some(page) = state.vm_page {
            // One reservation per (pool, stream, kind) covers the whole device, as PyTorch's.
            // At most the largest block the free sets hold (a segment lies in one reservation).
            let most = crate::rules::MAX_BLOCK / page * page;
            let total = backend.memory_info().map_or(64 << 30, |(_, t)| t);
            state.reserve_size = total.max(page).checked_next_multiple_of(page).map_or(most, |t| t.min(most));
        }
        DeviceAllocator {
            rounding: config,
            state: Arc::new(bias::BiasedMutex::new(state)),
            backend,
            id,
            outbox: Mutex::new(()),
            has_work: Arc::new(AtomicBool::new(false)),
            caches,
            has_error: Arc::new(AtomicBool::new(false)),
            closing: AtomicBool::new(false),
            capturing: AtomicUsize::new(0),
            under_pressure: AtomicUsize::new(0),
            pool_live: std::array::from_fn(|_| AtomicU64::new(0)),
            host_visible,
            nested_target: AtomicU64::new(0),
            poller: OnceLock::new(),
        }
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    pub(crate) fn id(&self) -> AllocatorId {
        self.id
    }

    #[inline(always)]
    fn lock(&self) -> Locked<'_> {
        self.lock_taking_large(false)
    }

    /// Locks; `take_large`: also files this thread's cached large block (or parked block: see
    /// `Owner::park`) under this lock, taken out of its cache with the thread's counters.
    /// (Filed here, not returned: a block returned beside the guard went through memory and
    /// was read back at once with wider loads than its stores, a stall on every locked call.)
    #[inline(always)]
    fn lock_taking_large(&self, take_large: bool) -> Locked<'_> {
        // Nothing panics while the lock is held (user code runs outside it); if something did,
        // the state is still the best there is, and `Drop` paths must not panic on a poisoned lock.
        let closing = self.closing.load(Ordering::Relaxed);
        // This thread's counters, found before the lock is taken (a thread's first call makes
        // its cache, which takes the registry's locks).
        let (mine, held, joined) = if closing {
            (None, [0, 0], false)
        } else {
            match self.caches.mine_stats(self.id, take_large) {
                Some((to, slack, held, joined)) => (Some((to, slack)), held, joined),
                // No cache (this thread's locals are gone: a thread-local destructor, after
                // the caches'): parked blocks, its own orphaned cache's included, are filed
                // with every such call, or its best fit would miss them. Rare.
                None => (None, [0, 0], true),
            }
        };
        // This thread's first locked call: other threads' parked blocks are filed with it.
        let parked = if joined { self.take_parked() } else { Vec::new() };
        let mut g = self.state.lock();
        let mut retired = None;
        // SAFETY: this thread's counters, which its cache keeps alive while this allocator is
        // (we are in one of its calls).
        let own = mine.map(|(to, slack)| (unsafe { to.as_ref() }, slack));
        match own {
            Some((stats, slack)) => {
                // Read by this thread, their only writer.
                let elided = stats.take_pool_elided();
                // SAFETY: this thread's counters (above), written by this thread only; the
                // sink is cleared when the `Locked` is dropped, before the state lock is let go.
                unsafe { g.sink.point(std::ptr::NonNull::from(&**stats), slack) };
                stats.before_rise(&self.caches.board);
                // This thread's elided allocations of a user pool join the pool's totals here,
                // under the lock that readers of pool statistics take.
                if let Some(e) = elided {
                    g.fold_pool_elided(e);
                }
            }
            None if !closing => {
                retired = Some(self.caches.retired_lock());
                let to = g.sink.retired();
                // SAFETY: the retired counters live as long as the board; we hold their lock
                // until the sink is cleared (`Locked`'s drop clears it, then lets go).
                unsafe { g.sink.point(to, crate::stats::MIN_BYTE_SLACK) }
                // SAFETY: as above (their lock is held: this thread is their one writer now).
                unsafe { to.as_ref() }.before_rise(&self.caches.board);
            }
            // The allocator is being dropped: no statistics are kept.
            None => g.sink.clear(),
        }
        let mut st = Locked { guard: std::mem::ManuallyDrop::new(g), retired, owner: self };
        // A user pool's block this thread held as a deferred free, settled, and the large
        // bin's block: filed (and counted) under this lock.
        if let Some((stats, _)) = own {
            for w in held {
                if w != 0 {
                    st.free_cached(tcache::unpack(w, stats));
                }
            }
        }
        // (Only when there are some: iterating the empty vector cost a call per locked step.)
        if !parked.is_empty() {
            for c in parked {
                st.free_cached(c);
            }
        }
        st
    }

    /// Other threads' parked blocks (and exited threads' caches), for a thread's first locked
    /// call (`Registry::drain_parked`).
    #[cold]
    #[inline(never)]
    fn take_parked(&self) -> Vec<tcache::Cached> {
        let mut blocks = Vec::new();
        self.caches.drain_parked(&mut blocks, self.caches.mine(self.id));
        blocks
    }

    /// Takes every block out of every thread cache and files it in its free set.
    fn drain_caches(&self) {
        let mut blocks = Vec::new();
        self.caches.drain_all(&mut blocks, self.caches.mine(self.id));
        self.free_cached(blocks);
        // Work a call left queued (see `Locked`'s drop) is delivered before anyone reads.
        if self.has_work.load(Ordering::Acquire) {
            let st = self.lock();
            self.unlock(st, false);
        }
    }

    /// Files the blocks of this thread's cache, of exited threads' caches, and every thread's
    /// cached large block (before a segment is made).
    fn drain_own(&self) {
        let mut blocks = Vec::new();
        self.caches.with_mine(self.id, |o| o.drain_own(&mut blocks));
        self.caches.drain_orphans_and_large(&mut blocks, self.caches.mine(self.id));
        self.free_cached(blocks);
    }

    /// Files the blocks this thread's cache set aside (`Owner::spill`), if any.
    #[cold]
    fn file_spill(&self) {
        let spill = self.caches.with_mine(self.id, |tc| {
            if tc.spill.is_empty() {
                None
            } else {
                Some(std::mem::take(&mut tc.spill))
            }
        });
        if let Some(Some(spill)) = spill {
            self.free_cached(spill);
        }
    }

    /// Files blocks taken out of a thread cache, under one lock.
    fn free_cached(&self, blocks: impl IntoIterator<Item = tcache::Cached>) {
        let mut blocks = blocks.into_iter().peekable();
        if blocks.peek().is_none() {
            return;
        }
        let mut st = self.lock();
        for c in blocks {
            st.free_cached(c);
        }
        self.unlock(st, false);
    }

    /// Unlocks, then runs the outbox if the call queued anything (or work is left over from a
    /// runner that stopped); `wait`: even if another thread is running it now (for calls that
    /// promise the work is done when they return).
    #[inline(always)]
    fn unlock(&self, st: Locked<'_>, wait: bool) {
        let queued = !st.outbox.is_empty();
        let target = st.taken + st.outbox.len() as u64;
        if queued {
            self.has_work.store(true, Ordering::Release);
        }
        drop(st);
        if queued || self.has_work.load(Ordering::Acquire) {
            self.flush(wait, target);
        }
    }

    /// Runs the outbox: hook events and segment frees, one thread at a time, in queue order,
    /// until the items up to `target` (the caller's own) are done, then for at most
    /// `OUTBOX_EXTRA` more; what is left, the next call on this allocator delivers. `wait`: if
    /// another thread is running it, wait (at most `OUTBOX_PATIENCE`) rather than leave our work
    /// to that thread.
    #[cold]
    fn flush(&self, wait: bool, target: u64) {
        if running_here(self.id) {
            // This thread's run, further up the stack, delivers it before it stops.
            self.nested_target.fetch_max(target, Ordering::AcqRel);
            return;
        }
        let since = std::time::Instant::now();
        loop {
            let guard = match self.outbox.try_lock() {
                Ok(g) => g,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                // The thread that holds it runs our work too (it looks again after letting go).
                Err(TryLockError::WouldBlock) if !wait || since.elapsed() > OUTBOX_PATIENCE => return,
                Err(TryLockError::WouldBlock) => {
                    std::thread::sleep(std::time::Duration::from_micros(50));
                    continue;
                }
            };
            set_running(self.id, true);
            let id = self.id;
            let _running = scopeguard::guard((), move |()| set_running(id, false));
            let started = std::time::Instant::now();
            let mut done = 0;
            loop {
                let batch: Vec<Work> = {
                    let mut st = self.lock();
                    if st.outbox.is_empty() {
                        self.has_work.store(false, Ordering::Release);
                        break;
                    }
                    let n = st.outbox.len().min(OUTBOX_BATCH);
                    st.taken += n as u64;
                    done = st.taken;
                    st.outbox.drain(..n).collect()
                };
                for w in batch {
                    // One item's panic (a pool allocator's `Drop`, a panic payload that panics on
                    // drop) must not lose the items after it.
                    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run(w))) {
                        crate::backend::drop_payload(p);
                    }
                }
                let ours = target.max(self.nested_target.load(Ordering::Acquire));
                if done >= ours && started.elapsed() > OUTBOX_EXTRA {
                    break;
                }
            }
            drop(_running);
            drop(guard);
            // Our work is done; what others queued meanwhile their next call (or any call) runs.
            let ours = target.max(self.nested_target.load(Ordering::Acquire));
            if done >= ours || !self.has_work.load(Ordering::Acquire) {
                return;
            }
        }
    }

    fn run(&self, w: Work) {
        // Memory goes back only while no capture is under way (the driver refuses a free or an
        // unmap during a capture, and invalidates the capture): work queued before a capture
        // began, or left behind by a slow hook, waits for its end. `freeing` counts the releases
        // running outside the lock, for which `begin_capture` waits.
        if matches!(w, Work::Free(_) | Work::Unmap(_) | Work::Unreserve(_) | Work::GiveBack(_)) {
            let mut st = self.lock();
            if !st.captures.is_empty() {
                st.held_back.push(w);
                return;
            }
            st.freeing += 1;
            drop(st);
            let _done = scopeguard::guard((), |()| self.lock().freeing -= 1);
            as_releasing(self.id, || self.release(w));
            return;
        }
        match w {
            Work::Event(e, d) => trace::deliver(&e, d),
            Work::Drop(x) => drop_user_code(x),
            _ => {}
        }
    }

    /// Gives back what `w` says (a segment, a mapping, a reservation); see [`run`](Self::run).
    fn release(&self, w: Work) {
        match w {
            Work::Event(..) | Work::Drop(_) => {}
            Work::GiveBack(g) => self.give_back_now(g),
            Work::Free(r) => {
                let be = &*self.backend;
                let res = contain("the segment free", || match &r.source {
                    // SAFETY: `r` was taken out of the cache by `release_segment`: a segment this
                    // backend allocated with exactly this address and size, wholly free (no block
                    // handed out, every cross-stream event completed), given back once (a
                    // `Released` is moved, and kept only if its free failed, i.e. did not happen).
                    Source::Backend => unsafe { be.free_segment(r.addr, r.size) },
                    // SAFETY: as above, for the pool's own allocator, which made the segment for
                    // this device and `r.stream`; `r.keep` keeps that stream alive for the call.
                    Source::Pool(a) => unsafe { a.free(r.addr, r.size, be.device(), r.stream.raw) },
                });
                let mut st = self.lock();
                let leftover = match res {
                    Ok(()) => {
                        st.freed(&r);
                        Some(r)
                    }
                    Err(e) => {
                        st.free_failed(r, e.to_string());
                        None
                    }
                };
                drop(st);
                // The stream and the pool allocator it holds are let go outside the lock (their
                // `Drop` is user code, or destroys a stream).
                drop(leftover);
            }
            Work::Unmap(mut u) => {
                let be = &*self.backend;
                // The guard is let go of after the lock (its `Drop` is user code, and this may be
                // the last handle of a released pool's guard).
                let guard = u.guard.take();
                let vetoed = guard.as_ref().and_then(|g| {
                    contain("MapGuard::unmapping", || g.unmapping(u.addr, u.size).map_err(BackendError::Failed)).err()
                });
                let veto = vetoed.is_some();
                let res = match vetoed {
                    Some(e) => Err(e),
                    None => contain("the unmap", || {
                        // SAFETY: `u` was taken out of its segment by `unmap_free_runs`: exactly one
                        // `map` of this backend (address, size, handle), lying wholly in one free
                        // block (no block handed out, every cross-stream event completed), unmapped
                        // once (an `Unmapping` is moved); `u._keep` keeps its stream alive, and the
                        // backend waits for that stream's work before unmapping.
                        unsafe { be.unmap(u.addr, u.size, u.handle, u.stream.raw) }
                    })
                    .inspect_err(|_| {
                        // Still mapped: the guard, which let it go, is told it is back.
                        if let Some(g) = &guard {
                            let _ = contain("MapGuard::mapped", || {
                                g.mapped(u.addr, u.size);
                                Ok(())
                            });
                        }
                    }),
                };
                let mut st = self.lock();
                st.unmapped(u, res.map_err(|e| e.to_string()), veto);
                drop(st);
                drop_user_code(guard);
            }
            Work::Unreserve(u) => {
                let be = &*self.backend;
                // SAFETY: a reservation of this backend with nothing mapped in it and nothing
                // under way (`maybe_unreserve` checked under the lock, and took it out of the
                // table, so no map can be planned in it), given back once.
                let res = contain("the reservation free", || unsafe { be.unreserve(u.addr, u.size) });
                let mut st = self.lock();
                st.unreserved(&u, res.map_err(|e| e.to_string()));
                drop(st);
                drop(u);
            }
        }
    }

    /// Allocates `req.size` bytes (`> 0`). From inside a trace hook: [`Error::Reentrant`] (an
    /// allocation there would feed the hook its own events).
    #[inline]
    pub(crate) fn malloc(&self, req: &Request<'_>) -> Result<Allocation> {
        match self.malloc_cached(req.size, req.stream.key, req.pool) {
            Some(a) => Ok(a),
            None => self.malloc_slow(req),
        }
    }

    /// [`malloc`](Self::malloc)'s thread-cache hit, if it has one: inlined into the caller,
    /// which builds its `Buffer` from the block's figures in registers (a caller that merged
    /// this with [`malloc_slow`](Self::malloc_slow)'s result first would copy them through
    /// memory, just written, which costs the processor more than the rest of the hit).
    #[inline(always)]
    pub(crate) fn malloc_cached(&self, size: usize, stream: StreamKey, pool: PoolRef) -> Option<Allocation> {
        if self.rounding.thread_cache
            && self.capturing.load(Ordering::Relaxed) == 0
            && !self.has_error.load(Ordering::Relaxed)
            && !trace::enabled()
            && !trace::in_hook()
        {
            return self.take_cached(size, stream, pool);
        }
        None
    }

    /// [`malloc`](Self::malloc) past the thread cache: a capture's, from inside a hook, or
    /// under the lock.
    #[inline(never)]
    pub(crate) fn malloc_slow(&self, req: &Request<'_>) -> Result<Allocation> {
        if trace::in_hook() {
            return Err(Error::Reentrant);
        }
        if self.capturing.load(Ordering::Relaxed) != 0 {
            return self.malloc_capturing(req);
        }
        self.malloc_locked(req).map_err(|e| self.completed_report(e))
    }

    /// A block of this thread's cache for `req` (default pools), if there is one.
    #[inline(always)]
    fn take_cached(&self, size: usize, stream: StreamKey, pool: PoolRef) -> Option<Allocation> {
        let board = &self.caches.board;
        // Bins are found by the bytes asked for: every cached block is the rounded size of
        // its request (no rounding here).
        // A user pool's only while it is live (a scope that was forgotten may outlive it).
        if pool.slot != 0 && !self.pool_is_live(pool) {
            return None;
        }
        // (The cache is let go at the end of this block, before a miss files anything.)
        let (taken, spilled) = {
            let mut tc = self.caches.mine_cache(self.id)?;
            let taken = tc.take(board, stream, pool, size);
            let spilled = taken.is_none() && !tc.spill.is_empty();
            (taken, spilled)
        };
        let Some(h) = taken else {
            // A miss; a block `take` set aside to be filed (a pool's, see `Owner::take`) is
            // filed before the request takes the lock for itself. (Looked at here: a call to
            // find the cache again on every miss cost a mixed step about 20 instructions.)
            if spilled {
                self.file_spill();
            }
            return None;
        };
        Some(Allocation {
            block: h.block,
            addr: h.addr,
            size: h.size,
            pool,
            small: h.small,
            split: h.split,
            cacheable: true,
            set: u64::from(h.set),
            gen: h.gen,
        })
    }

    /// An out-of-memory report gets the allocated bytes summed over threads.
    #[cold]
    fn completed_report(&self, mut e: Error) -> Error {
        if let Error::OutOfMemory(r) = &mut e {
            r.allocated = self.caches.sum().current(crate::stats::ALLOCATED_BYTES * 3).max(0) as usize;
            let stacks = segments::PENDING_SITES.with(|p| std::mem::take(&mut *p.borrow_mut()));
            r.sites = segments::sites_of(stacks, 5);
        }
        e
    }

    fn malloc_locked(&self, req: &Request<'_>) -> Result<Allocation> {
        // This thread's cached large block goes back first: best fit sees it where it would be.
        let mut st = self.lock_taking_large(true);
        if let Some(e) = st.error.take() {
            return Err(e);
        }
        // With the background thread, it files completed frees; the allocation queries nothing.
        if !st.background && (!st.pending.is_empty() || !st.foreign.is_empty()) {
            st.process_events(&*self.backend);
        }
        st.tick += 1;
        let Some(rounded) = st.config.round(req.size) else {
            let slot = st.resolve(req.pool).unwrap_or(Slot::DEFAULT);
            let e = st.oom(&*self.backend, req.size, slot);
            self.unlock(st, false);
            return Err(e);
        };
        let slot = st.resolve(req.pool).unwrap_or(Slot::DEFAULT);
        let small = is_small(rounded);
        let set = st.set_for(slot, req.stream.key, small);
        let no_split = st.no_split(slot);
        match st.best_fit(set, rounded, no_split) {
            Some(b) => {
                // (Built in place as the result: an `Allocation` kept across the unlock, then
                // moved into it, cost a copy of its 64 bytes.)
                let r = Ok(st.take_block_inline(b, rounded, req.size));
                self.unlock(st, false);
                r
            }
            None => {
                drop(st);
                self.grow(req, rounded)
            }
        }
    }

    /// No cached block fits: a new segment, with the out-of-memory ladder (wait for pending
    /// cross-stream frees, give back the caches, try again; for the default pools, borrow a free
    /// block of a `use_on_oom` pool), then the report.
    #[cold]
    fn grow(&self, req: &Request<'_>, rounded: usize) -> Result<Allocation> {
        let be = &*self.backend;
        let small = is_small(rounded);
        let mut retried = false;
        // When this request first waited for another thread's segment (see below), and its
        // back-off count.
        let mut waited: Option<(std::time::Instant, u32)> = None;
        // The growths under way at this request's first refusal (ids below this mark) are the
        // only ones it waits for: threads that keep growing and being refused would otherwise
        // chain its waits up to `GROWTH_WAIT`.
        let mut mark: Option<u64> = None;
        // While this request climbs the out-of-memory ladder, no thread caches what it frees:
        // blocks freed meanwhile go to their free sets, where this request can find them.
        let mut _pressure = None;
        // The out-of-memory ladder's span (feature `tracing`), entered at its first rung.
        let mut _ladder: Option<_> = None;
        // Before any user code runs (hooks and frees run when the lock is let go, and may change
        // this thread's current stream): the request's stream is still the current one.
        let mut keep = Some((req.keep)());
        // Blocks waiting in this thread's cache are free memory: they are filed (and merged)
        // before a segment is made. Other threads' caches are left alone (draining them on every
        // growth would make threads that warm up together miss each other's blocks over and
        // over); the out-of-memory ladder below takes them too.
        self.drain_own();
        loop {
            let mut st = self.lock();
            let slot = st.resolve(req.pool).unwrap_or(Slot::DEFAULT);
            let key = (slot, req.stream.key, small);
            let set = st.set_for(slot, req.stream.key, small);
            let no_split = st.no_split(slot);
            let pool_id = st.pools[slot.get()].spec.id;
            // Another thread may have freed a fitting block while the lock was let go.
            if let Some(b) = st.best_fit(set, rounded, no_split) {
                let a = st.take_block(b, rounded, req.size);
                self.unlock(st, true);
                return Ok(a);
            }
            if st.config.garbage_collection_threshold > 0.0 {
                st.garbage_collect();
            }
            if st.pools[slot.get()].spec.expandable {
                match self.map_more(st, req, rounded, key, slot, &keep) {
                    Grown::Done(a) => return Ok(a),
                    Grown::Retry => continue,
                    Grown::Failed(e) => return Err(e),
                    Grown::OutOfMemory(locked) => st = locked,
                }
            } else {
                let id = st.pools[slot.get()].spec.id;
                let align = st.pools[slot.get()].spec.align;
                let source = match &st.pools[slot.get()].spec.raw {
                    Some(a) => Source::Pool(a.clone()),
                    None => Source::Backend,
                };
                let got = match st.segment_size_for(slot, rounded) {
                    Some(size) if st.within_limit(size) => {
                        let split = !st.no_split(slot)
                            && crate::rules::should_split(size, rounded, small, st.config.max_split_size);
                        let growth = st.begin_growth(key, size, if split { size - rounded } else { 0 });
                        // Before the unlock, whose outbox may run user code that allocates.
                        let here = as_growing(self.id);
                        self.unlock(st, true);
                        let seg_keep = keep.take().unwrap_or_else(|| (req.keep)());
                        let r = contain("the pool allocator", || match &source {
                            Source::Backend => be.alloc_segment(size, req.stream.raw),
                            // During a graph capture, relaxed: the pool's allocator may make
                            // calls the capture would otherwise refuse (`ncclMemAlloc`).
                            Source::Pool(a) if self.capturing() => {
                                let mut r = None;
                                be.with_relaxed_capture(&mut || {
                                    r = Some(crate::backend::as_source(|| a.alloc(size, be.device(), req.stream.raw)))
                                });
                                r.unwrap_or_else(|| Err(BackendError::Failed("the relaxed call did not run".into())))
                            }
                            // SAFETY: the request's stream is alive (`seg_keep` holds it), of this
                            // device (checked when the request was made), not capturing (that is
                            // the arm above); the segment serves only this stream, whose order its
                            // blocks are used in (other streams wait for it: `record_stream`, a
                            // buffer's `device_ptr` on another stream).
                            Source::Pool(a) => crate::backend::as_source(|| unsafe {
                                a.alloc_on_stream(size, be.device(), req.stream.raw)
                            }),
                        });
                        drop(here);
                        st = self.lock();
                        st.end_growth(growth);
                        Some((r, size, seg_keep))
                    }
                    _ => None,
                };
                // The pool may have been released, and its slot taken, while the lock was let go: the
                // request then falls back to the default pools (and blames no other pool).
                let now = st.resolve(req.pool).unwrap_or(Slot::DEFAULT);
                let gone = now != slot || st.pools[now.get()].spec.id != id;
                match got {
                    Some((Ok(addr), size, seg_keep)) if addr != 0 => {
                        let misaligned = addr % align as u64 != 0;
                        // The free sets pack addresses into 56 bits; no device hands out higher ones.
                        let too_high = addr.checked_add(size as u64).is_none_or(|end| end > 1 << 56);
                        if misaligned || too_high || gone {
                            let why = if misaligned {
                                Some(format!("returned {addr:#x}, not aligned to its granularity of {align} bytes"))
                            } else if too_high {
                                Some(format!("returned {addr:#x}, whose segment ends above 2^56"))
                            } else {
                                None
                            };
                            let err = why.filter(|_| !gone).map(|w| st.alloc_failed(slot, BackendError::Failed(w)));
                            keep = Some(seg_keep.clone());
                            drop(st);
                            self.give_back(&source, addr, size, req.stream, seg_keep);
                            match err {
                                Some(e) => return Err(e),
                                None => continue,
                            }
                        }
                        let block = st.insert_segment(addr, size, key, req.stream, seg_keep, true);
                        let a = st.take_block(block, rounded, req.size);
                        self.unlock(st, true);
                        return Ok(a);
                    }
                    Some((_, _, seg_keep)) if gone => {
                        keep = Some(seg_keep);
                        drop(st);
                        continue;
                    }
                    Some((Err(e @ (BackendError::Failed(_) | BackendError::Driver(_))), _, _)) => {
                        let e = st.alloc_failed(slot, e);
                        self.unlock(st, false);
                        return Err(e);
                    }
                    // Out of memory: `Ok(0)`, `Err(OutOfMemory)`, or over the limit.
                    Some((_, _, seg_keep)) => keep = Some(seg_keep),
                    None if gone => {
                        drop(st);
                        continue;
                    }
                    None => {}
                }
            }
            // The lock was let go while the segment or mapping was tried: another thread may
            // have made one, or freed blocks, meanwhile (PyTorch holds its lock throughout). A
            // block that fits now is taken before the ladder gives back any cached segment:
            // giving back what a neighbour is about to use set off ladders in turn, each taking
            // the next one's memory (4 threads on one stream, memory for exactly their blocks:
            // 1,521 failed requests in one run of 240,000; `oom_races.rs`).
            if st.resolve(req.pool).unwrap_or(Slot::DEFAULT) != slot || st.pools[slot.get()].spec.id != pool_id {
                // Its pool was released (its slot perhaps taken) meanwhile: from the start (the
                // default pools, if the pool is gone).
                drop(st);
                continue;
            }
            if let Some(a) = st.take_fit(slot, req.stream.key, rounded, req.size) {
                self.unlock(st, true);
                return Ok(a);
            }
            // Another thread is making a segment or mapping memory for this request's free set,
            // with the lock let go, and its request leaves room for this one; or the memory-
            // fraction limit refused this request only for the bytes of growths under way (any
            // set's). PyTorch's callers wait on its lock while it does; this one waits for the
            // growths under way (`GROWTH_WAIT` at most, in all), then starts over, before
            // giving anything back; only for those under way at its first refusal. Not from
            // inside a segment call or map of its own thread on this allocator (it could be
            // waiting for its caller).
            let need = if st.pools[slot.get()].spec.expandable {
                rounded
            } else {
                st.segment_size_for(slot, rounded).unwrap_or(rounded)
            };
            let (mark, any) = (*mark.get_or_insert(st.growth_mark()), st.limited_by_growth(need));
            if !growing_here(self.id) && st.growth_may_serve(key, rounded, mark, any) {
                match self.wait_for_growth(st, (key, rounded, mark, any), &mut waited) {
                    None => continue,
                    Some(held) => st = held,
                }
            }
            if !retried {
                retried = true;
                drop(st);
                self.under_pressure.fetch_add(1, Ordering::AcqRel);
                _pressure = Some(scopeguard::guard((), |()| {
                    self.under_pressure.fetch_sub(1, Ordering::AcqRel);
                }));
                _ladder = tracing_span!(
                    ::tracing::Level::INFO,
                    "out_of_memory_ladder",
                    device = be.device(),
                    requested = req.size
                );
                tracing_event!(
                    ::tracing::Level::INFO,
                    "no memory for a new segment: waiting for pending frees, giving back cached memory, retrying"
                );
                if let Some(a) = self.out_of_memory_retry(req, rounded, slot, pool_id) {
                    return Ok(a);
                }
                continue;
            }
            if slot == Slot::DEFAULT {
                if let Some(b) = st.borrow_from_pools(req.stream.key, small, rounded) {
                    let a = st.take_block(b, rounded, req.size);
                    #[cfg(feature = "tracing")]
                    let lender = st.pools[st.block(b).pool.get()].spec.id.0;
                    self.unlock(st, true);
                    tracing_event!(::tracing::Level::INFO, lender, "served by a free block of a use_on_oom pool");
                    return Ok(a);
                }
            }
            let e = st.oom(be, req.size, slot);
            // A set made for this request alone (and still this key's: it may have been retired
            // and reused while the lock was let go).
            if st.set_index.get(&key) == Some(&set) && st.set_segments[set.0 as usize] == 0 {
                st.retire_set(set);
            }
            self.unlock(st, true);
            return Err(e);
        }
    }

    /// `st` back, held throughout, if this request has waited `GROWTH_WAIT` in all already;
    /// else waits, with the lock let go, until none of the growths `what` names is under way
    /// (`State::growth_may_serve`: key, rounded size, mark, any) or the time is up, and returns
    /// `None`: the caller starts over.
    #[cold]
    fn wait_for_growth<'a>(
        &'a self,
        st: Locked<'a>,
        (key, rounded, mark, any): (state::SetKey, usize, u64, bool),
        waited: &mut Option<(std::time::Instant, u32)>,
    ) -> Option<Locked<'a>> {
        let (since, spins) = waited.get_or_insert_with(|| (std::time::Instant::now(), 0));
        if since.elapsed() >= GROWTH_WAIT {
            return Some(st);
        }
        self.unlock(st, false);
        loop {
            // (Sleeps of 1 ms at most: a growth takes a segment call's time, and many waiters
            // must not keep taking the lock.)
            *spins = (*spins + 1).min(90);
            crate::sync::back_off(*spins);
            let st = self.lock();
            let may = st.growth_may_serve(key, rounded, mark, any);
            drop(st);
            if !may || since.elapsed() >= GROWTH_WAIT {
                return None;
            }
        }
    }

    /// The out-of-memory ladder's first rung: every thread's cached blocks back in the free
    /// sets (so that the segments they kept are wholly free), pending cross-stream frees waited
    /// for, then the caches of the default pools, of released pools and of the requesting pool
    /// given back; live user pools keep theirs (they may be registered, and `use_on_oom`
    /// lenders are tried after).
    #[cold]
    fn out_of_memory_retry(
        &self,
        req: &Request<'_>,
        rounded: usize,
        slot: Slot,
        pool_id: PoolId,
    ) -> Option<Allocation> {
        self.drain_caches();
        let mut st = self.lock();
        st.synchronize_events(&*self.backend);
        st.stats.num_alloc_retries += 1;
        // The drained caches' blocks and the completed cross-stream frees are free memory now: a
        // block among them that fits is taken before any segment is given back (giving back a
        // segment such a block left wholly free, only to make one again, would also leave the
        // memory in between to whichever thread asks first).
        if st.resolve(req.pool).unwrap_or(Slot::DEFAULT) == slot && st.pools[slot.get()].spec.id == pool_id {
            if let Some(a) = st.take_fit(slot, req.stream.key, rounded, req.size) {
                self.unlock(st, true);
                return Some(a);
            }
        }
        st.release_cached(|p| p.spec.id == PoolId::DEFAULT || p.released || p.spec.id == pool_id);
        self.unlock(st, true);
        None
    }

    /// Maps memory into an expandable segment of the request's (pool, stream, kind), making a
    /// reservation first if none has room.
    #[cold]
    fn map_more<'a>(
        &'a self,
        mut st: Locked<'a>,
        req: &Request<'_>,
        rounded: usize,
        key: state::SetKey,
        slot: Slot,
        keep: &Option<Option<Keep>>,
    ) -> Grown<'a> {
        let be = &*self.backend;
        let Some(page) = st.vm_page else {
            let e = Error::Config("expandable segments on a backend without virtual memory management".into());
            return Grown::Failed(e);
        };
        match st.plan_map(key, rounded) {
            Some(plan) if st.within_limit(plan.size) => {
                let growth = st.begin_growth(key, plan.size, plan.spare);
                let guard = st.pools[slot.get()].spec.map_guard.clone();
                let here = as_growing(self.id);
                self.unlock(st, true);
                let mut mapped = Vec::new();
                let mut failed = None;
                for (addr, size) in plan.chunks() {
                    // SAFETY: the plan's range lies inside a reservation of this backend, at a
                    // page-aligned address with page-multiple chunks, and was taken out of the
                    // reservation's free ranges under the lock: nothing is mapped there, and no
                    // other thread maps or unmaps there until `finish_map`.
                    match contain("the map", || unsafe { be.map(addr, size) }) {
                        Ok(h) => {
                            if let Some(g) = &guard {
                                // Told before the lock is taken again, so before the hooks can
                                // see the map and before any block of it is handed out.
                                let _ = contain("MapGuard::mapped", || {
                                    g.mapped(addr, size);
                                    Ok(())
                                });
                            }
                            mapped.push((addr, size, h))
                        }
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                // Let go of before the lock: the pool may have been released meanwhile, and
                // this may be the guard's last handle.
                drop_user_code(guard);
                drop(here);
                let mut st = self.lock();
                st.end_growth(growth);
                let grown = st.finish_map(&plan, &mapped);
                // The new memory's block is taken at once (in this locked section, so no other
                // request takes it first), past best fit's rules: it was made for this request
                // (`plan_map` never grows a block best fit passed over), and a block grown to
                // page size may cross `max_split_size` although the request does not.
                let fits = grown.filter(|&b| failed.is_none() && st.block(b).size >= rounded);
                let slot_now = st.resolve(req.pool).unwrap_or(Slot::DEFAULT);
                if let Some(b) = fits.filter(|&b| st.block(b).pool == slot_now) {
                    st.remove_free(b);
                    let a = st.take_block(b, rounded, req.size);
                    self.unlock(st, true);
                    return Grown::Done(a);
                }
                // Not taken: what was mapped goes back at once if the map failed partway (as
                // PyTorch releases the handles of a failed map: kept, it would sit in the cache,
                // out of reach of other pools' ladders, and a retry would map part of it again)
                // or if the request's pool went meanwhile (a released pool keeps nothing).
                let pool_gone = grown.is_some_and(|b| st.block(b).pool != slot_now);
                if !mapped.is_empty() && (failed.is_some() || pool_gone) {
                    st.give_back_runs(plan.res, &mapped);
                }
                match failed {
                    Some(e @ (BackendError::Failed(_) | BackendError::Driver(_))) => {
                        let e = e.into_error("map");
                        self.unlock(st, true);
                        Grown::Failed(e)
                    }
                    Some(BackendError::OutOfMemory) => Grown::OutOfMemory(st),
                    None => {
                        self.unlock(st, true);
                        Grown::Retry
                    }
                }
            }
            Some(plan) => {
                st.cancel_map(&plan);
                Grown::OutOfMemory(st)
            }
            None => {
                let size = rounded.checked_next_multiple_of(page).map(|r| r.max(st.reserve_size));
                let Some(size) = size.filter(|&s| s <= crate::rules::MAX_BLOCK) else {
                    return Grown::OutOfMemory(st);
                };
                let merge = st.pools[slot.get()].spec.merge_runs;
                let id = st.pools[slot.get()].spec.id;
                self.unlock(st, true);
                let r = contain("the address reservation", || be.reserve(size));
                let mut st = self.lock();
                // The pool may have been released, and its slot taken, meanwhile.
                let gone = st.resolve(req.pool).unwrap_or(Slot::DEFAULT) != slot || st.pools[slot.get()].spec.id != id;
                match r {
                    Ok(addr) if gone => {
                        drop(st);
                        // SAFETY: the reservation `reserve` just made, with nothing mapped.
                        let _ = contain("the reservation free", || unsafe { be.unreserve(addr, size) });
                        Grown::Retry
                    }
                    Ok(addr) => {
                        let k = keep.clone().unwrap_or_else(|| (req.keep)());
                        st.add_reservation(addr, size, key, req.stream, k, merge);
                        drop(st);
                        Grown::Retry
                    }
                    Err(BackendError::OutOfMemory) => Grown::OutOfMemory(st),
                    Err(e) => {
                        drop(st);
                        Grown::Failed(e.into_error("address reservation"))
                    }
                }
            }
        }
    }

    /// Gives back a segment that was never taken into the cache.
    fn give_back(&self, source: &Source, addr: u64, size: usize, stream: StreamRef, keep: Option<Keep>) {
        // Through `run`: held back while a capture is under way, counted in `freeing` otherwise.
        self.run(Work::GiveBack(state::GiveBack { source: source.clone(), addr, size, stream, keep }));
    }

    fn give_back_now(&self, g: state::GiveBack) {
        let state::GiveBack { source, addr, size, stream, keep } = g;
        let source = &source;
        let be = &*self.backend;
        let r = contain("the segment free", || match source {
            // SAFETY: `addr`/`size` are exactly what this backend's `alloc_segment` just returned;
            // nothing has used the segment.
            Source::Backend => unsafe { be.free_segment(addr, size) },
            // SAFETY: as above, for the pool's allocator; `keep` keeps `stream` alive for the call.
            Source::Pool(a) => unsafe { a.free(addr, size, be.device(), stream.raw) },
        });
        drop(keep);
        if let Err(e) = r {
            let mut st = self.lock();
            st.error.get_or_insert(Error::backend(
                "giving back a refused segment",
                format!("{e} (segment {addr:#x}, {size} bytes)"),
            ));
        }
    }

    /// Returns a block from [`malloc`](Self::malloc). Never fails: an error on the way (an event
    /// that could not be recorded) is kept and reported by the next call.
    #[inline]
    /// `device_used`: for host-visible memory, whether the device may have used the block (its
    /// free then waits for the block's own stream too).
    fn free_with(&self, block: BlockIdx, device_used: bool) {
        // This thread's parked block is filed under the same lock.
        let mut st = self.lock_taking_large(true);
        st.free_with(&*self.backend, block, device_used);
        self.unlock(st, false);
    }

    /// Whether the memory is host-visible (pinned): see `Backend::host_visible`.
    #[inline]
    pub(crate) fn host_visible(&self) -> bool {
        self.host_visible
    }

    /// Its owner gives back a block it holds as `a` (allocated on `stream` for `requested`
    /// bytes): into this thread's cache when nothing has to happen at its free (`used_elsewhere`:
    /// another stream was recorded), else as [`free`](Self::free).
    #[inline]
    pub(crate) fn free_allocation(
        &self,
        a: &Allocation,
        stream: crate::id::StreamKey,
        requested: usize,
        used_elsewhere: bool,
    ) {
        // A user pool's block only while its pool is live, and not while a capture is under
        // way (the capture's pool may get it).
        if a.cacheable
            && !used_elsewhere
            && self.rounding.thread_cache
            && !trace::enabled()
            && self.under_pressure.load(Ordering::Relaxed) == 0
            && (a.pool.slot == 0 || (self.pool_is_live(a.pool) && self.capturing.load(Ordering::Relaxed) == 0))
        {
            let board = &self.caches.board;
            if let Some(mut tc) = self.caches.mine_cache(self.id) {
                let cached = tc.put(board, stream, requested, a);
                if !tc.spill.is_empty() {
                    let spill = std::mem::take(&mut tc.spill);
                    // Let go of the cache first: filing takes the lock, which looks at it.
                    drop(tc);
                    self.free_cached(spill);
                }
                if cached {
                    return;
                }
            }
        }
        if !a.cacheable && self.park(a, stream, requested, used_elsewhere) {
            return;
        }
        self.free_with(a.block, used_elsewhere);
    }

    /// Parks a block of the default pools that is not cacheable (bigger than its request's
    /// rounded size), unless it is oversize or needs work at its free (see `Owner::park`);
    /// returns whether it did.
    #[inline(never)]
    fn park(&self, a: &Allocation, stream: crate::id::StreamKey, requested: usize, used_elsewhere: bool) -> bool {
        if a.pool.slot != 0
            || a.size >= self.rounding.max_split_size
            || used_elsewhere
            || !self.rounding.thread_cache
            || trace::enabled()
            || self.under_pressure.load(Ordering::Relaxed) != 0
        {
            return false;
        }
        let board = &self.caches.board;
        let Some(mut tc) = self.caches.mine_cache(self.id) else { return false };
        let parked = tc.park(board, stream, requested, a, false);
        if !tc.spill.is_empty() {
            let spill = std::mem::take(&mut tc.spill);
            drop(tc);
            self.free_cached(spill);
        }
        parked
    }

    /// Marks user pool `pool` cacheable by the thread caches or not (under the allocator's
    /// lock, with the pool's state): not while a capture or graph holds it.
    pub(super) fn set_pool_live(&self, pool: PoolRef, live: bool) {
        if let Some(l) = self.pool_live.get(pool.slot as usize) {
            if live {
                l.store(pool.id.0, Ordering::Release);
            } else {
                let _ = l.compare_exchange(pool.id.0, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }

    /// Whether user pool `pool` is live (as far as the thread caches go: slots beyond
    /// `CACHED_POOLS` never are).
    #[inline(always)]
    fn pool_is_live(&self, pool: PoolRef) -> bool {
        self.pool_live.get(pool.slot as usize).is_some_and(|l| l.load(Ordering::Acquire) == pool.id.0)
    }

    /// Notes that `stream` uses the block; returns whether the stream is new to it. `keep` keeps
    /// the stream alive until the event is recorded at free time.
    pub(crate) fn record_stream(&self, block: BlockIdx, stream: StreamRef, keep: Option<Keep>) -> bool {
        self.lock().record_use(block, stream, keep)
    }

    /// The keep-alive of the stream a block's segment serves.
    /// Whether `block`'s memory is host-visible: a pinned allocator's, or a pool's whose
    /// segment source says so.
    pub(crate) fn block_host_visible(&self, block: BlockIdx) -> bool {
        if self.host_visible {
            return true;
        }
        let st = self.lock();
        let pool = st.block(block).pool;
        st.pools[pool.get()].spec.host_visible
    }

    /// Waits for the work queued so far on every stream recorded as using `block`
    /// (`record_stream`), its own excluded: an event recorded on each and waited for.
    pub(crate) fn wait_for_uses(&self, block: BlockIdx) -> Result<()> {
        let uses: Vec<(StreamRef, Option<Keep>)> = {
            let st = self.lock();
            st.uses.get(&block).map_or_else(Vec::new, |u| u.iter().map(|u| (u.stream, u.keep.clone())).collect())
        };
        let be = &*self.backend;
        for (stream, _keep) in uses {
            let failed = |e: BackendError| e.into_error("waiting for a stream that used the buffer");
            // SAFETY: `stream` is alive: `_keep` holds it (CUDA) for the calls.
            let ev = unsafe { be.record_event(stream.raw) }.map_err(failed)?;
            // SAFETY: `ev` was just recorded by this backend; released once, right after.
            let r = unsafe { be.synchronize_event(ev) };
            // SAFETY: as above.
            unsafe { be.release_event(ev) };
            r.map_err(failed)?;
        }
        Ok(())
    }

    /// Where `block`'s memory comes from, for CUDA IPC (`crate::ipc`).
    pub(crate) fn export_source(&self, block: BlockIdx) -> ExportSource {
        let st = self.lock();
        let b = st.block(block);
        let s = st.seg(b.seg);
        if let Some(res) = s.res {
            return ExportSource::Mapped(st.runs_covering(res, b.addr, b.addr + b.size as u64));
        }
        match &st.pools[b.pool.get()].spec.raw {
            Some(raw) => ExportSource::Pool(raw.clone(), s.addr),
            None => ExportSource::Segment(s.addr),
        }
    }

    pub(crate) fn stream_keep(&self, block: BlockIdx) -> Option<Keep> {
        let st = self.lock();
        st.seg(st.block(block).seg).keep.clone()
    }

    /// `alloc_bytes` for FFI users: the pointer is the handle.
    pub(crate) fn malloc_raw(&self, req: &Request<'_>) -> Result<u64> {
        let a = self.malloc(req)?;
        self.lock().raw.insert(a.addr, a.block);
        Ok(a.addr)
    }

    pub(crate) fn free_raw(&self, ptr: u64) -> Result<()> {
        let mut st = self.lock();
        match st.raw.remove(&ptr) {
            Some(b) => {
                st.free(&*self.backend, b);
                self.unlock(st, false);
                Ok(())
            }
            None => Err(Error::InvalidFree { ptr, device: self.backend.device() }),
        }
    }

    /// `record_stream` on a live raw allocation, looked up and recorded under one lock (a
    /// concurrent `free_bytes` cannot slip in between); false if `ptr` is not one.
    pub(crate) fn record_stream_raw(&self, ptr: u64, stream: StreamRef, keep: Option<Keep>) -> bool {
        let mut st = self.lock();
        let Some(&block) = st.raw.get(&ptr) else { return false };
        st.record_use(block, stream, keep);
        true
    }

    /// Waits for every pending cross-stream free, then gives back every wholly free segment of the
    /// default pools and of released pools (live user pools keep theirs: `MemPool::empty_cache`;
    /// a pinned allocator keeps its reserve segment), and tries again the segments whose free
    /// failed before.
    pub(crate) fn empty_cache(&self) -> Result<()> {
        self.refuse_if_capturing("empty_cache")?;
        let _span = tracing_span!(::tracing::Level::DEBUG, "empty_cache", device = self.backend.device());
        self.drain_caches();
        let mut st = self.lock();
        st.synchronize_events(&*self.backend);
        st.release_cached(|p| p.spec.id == PoolId::DEFAULT || p.released);
        self.unlock(st, true);
        let mut st = self.lock();
        st.error.take().or_else(|| st.vetoed.take()).map_or(Ok(()), Err)
    }

    /// Waits for every pending free (as [`empty_cache`](Self::empty_cache) does, PyTorch's
    /// `synchronize_and_free_events`), then gives back the wholly free segments of one pool.
    pub(crate) fn empty_pool_cache(&self, pool: PoolRef) -> Result<()> {
        self.refuse_if_capturing("MemPool::empty_cache")?;
        let _span = tracing_span!(
            ::tracing::Level::DEBUG,
            "empty_pool_cache",
            device = self.backend.device(),
            pool = pool.id.0
        );
        self.drain_caches();
        let mut st = self.lock();
        if !st.pending.is_empty() || !st.foreign.is_empty() {
            st.synchronize_events(&*self.backend);
        }
        if st.resolve(pool).is_some() {
            st.release_cached(|p| p.spec.id == pool.id);
        }
        self.unlock(st, true);
        let mut st = self.lock();
        st.error.take().or_else(|| st.vetoed.take()).map_or(Ok(()), Err)
    }

    /// The statistics; every thread's cached blocks are filed first, so that the figures are
    /// those of the blocks as the shared state holds them (a cached block of a split segment
    /// would otherwise count as an inactive-split block of its own, unmerged).
    pub(crate) fn stats(&self) -> MemoryStats {
        self.drain_caches();
        // Summed under the lock: a block another thread's drain files (under the lock) is
        // counted free in the drainer's counters first, then its deferred record is cleared in
        // its owner's; a sum between the two counted its free twice.
        let (counters, max_split, sum) = {
            let st = self.lock();
            (st.stats.clone(), st.config.max_split_size, self.caches.sum())
        };
        counters.report(&sum, &self.caches.board, max_split)
    }

    pub(crate) fn pool_stats(&self, pool: PoolRef) -> PoolStats {
        // Cached blocks are `Allocated` in the state: filed first, as for `stats`.
        self.drain_caches();
        let mut st = self.lock();
        let mut retired = Vec::new();
        let others = self.caches.board.pool_elided(pool.id.0, &mut retired);
        for e in retired {
            st.fold_pool_elided(e);
        }
        let slot = Slot(pool.slot);
        let (mut active, mut inactive) = (0, 0);
        for s in st.segments.iter().filter(|s| s.live && s.pool == slot) {
            for blk in st.blocks_of(s) {
                match blk.state {
                    BlockState::Free if blk.is_split() && st.counts_inactive(blk) => inactive += blk.size,
                    BlockState::Free => {}
                    _ => active += blk.size,
                }
            }
        }
        // Blocks of this pool still recorded as deferred frees: a drain (another thread's, under
        // way) holds them on their way to the free set, or their threads cached them again
        // since this call's drain; free, though the counters and the table count them allocated.
        let deferred = self.caches.board.pool_deferred_marking(pool.id.0, false);
        let active = active.saturating_sub(deferred[1] as usize);
        st.pools[slot.get()].stats.with_elided(others).less_deferred(deferred).report(active, inactive)
    }

    pub(crate) fn reset_peak_stats(&self) {
        // Nothing cached: the pools' counters (kept under the lock) are then the true ones.
        self.drain_caches();
        self.caches.commit_for_reset(self.id);
        let mut st = self.lock();
        // Summed under the lock, as `stats` sums (a filing is counted in two steps).
        self.caches.board.reset_peaks();
        st.stats.reset_peak();
        let board = self.caches.board.clone();
        for p in st.pools.iter_mut().filter(|p| p.live) {
            // Blocks cached again since the drain (a pool allocator's code run by it may free
            // some) count as allocated in the pool's counters: left out of the new peaks.
            let id = p.spec.id.0;
            p.stats.reset_peak_less(if id == 0 { [0; 3] } else { board.pool_deferred(id) });
        }
    }

    pub(crate) fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        let config = Config::builder().memory_fraction(fraction).build()?;
        let mut st = self.lock();
        st.config.memory_fraction = config.memory_fraction;
        st.limit = limit_for(&*self.backend, fraction);
        Ok(())
    }

    pub(crate) fn config(&self) -> Config {
        self.lock().config.clone()
    }

    /// An error kept from a call that could not return one (a `Drop`), taken.
    pub(crate) fn take_error(&self) -> Option<Error> {
        self.lock().error.take()
    }

    /// Keeps `e` for the next call that can fail (unless an earlier error is kept already).
    pub(crate) fn keep_error(&self, e: Error) {
        let mut st = self.lock();
        st.error.get_or_insert(e);
    }

    /// Adds a user pool; returns its place in the pool table.
    pub(crate) fn register_pool(&self, spec: PoolSpec) -> PoolRef {
        let mut st = self.lock();
        let id = spec.id;
        let p = state::PoolState {
            spec,
            stats: crate::stats::PoolCounters::default(),
            segments: 0,
            released: false,
            live: true,
            pinned: 0,
        };
        let slot = match st.pools.iter().position(|p| !p.live) {
            Some(i) => {
                st.pools[i] = p;
                i
            }
            None => {
                st.pools.push(p);
                st.pools.len() - 1
            }
        };
        if let Some(l) = self.pool_live.get(slot) {
            l.store(id.0, Ordering::Release);
        }
        PoolRef { id, slot: slot as u32 }
    }

    /// The pool's last handle is gone: its wholly free segments go back now, the others as soon
    /// as they become wholly free.
    pub(crate) fn release_pool(&self, pool: PoolRef) {
        // No thread caches its blocks from now (one that checked just before may still: its
        // block is filed at that thread's next put or locked call, or by the next drain).
        if let Some(l) = self.pool_live.get(pool.slot as usize) {
            let _ = l.compare_exchange(pool.id.0, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
        let mut st = self.lock();
        st.release_pool(&*self.backend, Slot(pool.slot), pool.id);
        // Its blocks in thread caches are filed (a wholly free segment of a released pool
        // goes back as it is filed): first taken out of every cache, outside the lock.
        self.unlock(st, false);
        self.drain_caches();
        self.caches.board.forget_pool(pool.id.0);
        let st = self.lock();
        #[cfg(feature = "tracing")]
        let held = {
            let p = &st.pools[pool.slot as usize];
            if p.spec.id == pool.id && p.live {
                p.segments
            } else {
                0
            }
        };
        self.unlock(st, false);
        tracing_event!(
            ::tracing::Level::DEBUG,
            device = self.backend.device(),
            pool = pool.id.0,
            segments_left = held,
            "pool released: its cached segments are given back, the rest as their last blocks are freed"
        );
    }

    pub(crate) fn snapshot(&self) -> Snapshot {
        self.drain_caches();
        let st = self.lock();
        let mut segments: Vec<SegmentSnapshot> = st
            .segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.live)
            .map(|(i, s)| SegmentSnapshot {
                mappings: st.mappings_of(SegIdx(i as u32)),
                address: s.addr,
                total_size: s.size,
                stream: s.stream.raw,
                pool: st.pools[s.pool.get()].spec.id,
                is_small: s.small,
                blocks: st
                    .blocks_of(s)
                    .map(|blk| BlockSnapshot {
                        address: blk.addr,
                        size: blk.size,
                        requested_size: if blk.state == BlockState::Free { 0 } else { blk.requested },
                        state: blk.state,
                        stack: if blk.state == BlockState::Free || !crate::stacks::current(blk.stack, blk.stack_epoch) {
                            0
                        } else {
                            blk.stack
                        },
                    })
                    .collect(),
            })
            .collect();
        drop(st);
        segments.sort_by_key(|s| s.address);
        let device = self.backend.device();
        let trace = trace::history(Some(self.id));
        Snapshot { device, backend: self.backend.kind(), segments, trace }
    }
}

/// Dropping an allocator (host, simulated: the process-wide CUDA ones live for the process)
/// gives every segment back. No buffer or pool of it exists any more (they hold it), so every
/// block is free, awaiting events, or an `alloc_bytes` allocation nobody freed: those are freed
/// too (their addresses were only ever numbers to safe code).
impl Drop for DeviceAllocator {
    fn drop(&mut self) {
        // The background thread first: stopped and joined (a look under way finishes first).
        if let Some(p) = self.poller.get() {
            p.stop();
        }
        let be = &*self.backend;
        let mut cached = Vec::new();
        self.caches.close(&mut cached);
        self.closing.store(true, Ordering::Relaxed);
        let mut st = self.lock();
        for c in cached {
            st.free_cached(c);
        }
        let raw: Vec<BlockIdx> = st.raw.drain().map(|(_, b)| b).collect();
        for b in raw {
            st.free(be, b);
        }
        // Nothing can be capturing any more (a capture holds its allocator): what was held back
        // for captures goes with the rest.
        st.captures.clear();
        let held = std::mem::take(&mut st.held_back);
        st.outbox.extend(held);
        st.synchronize_events(be);
        for p in &mut st.pools {
            p.released = true;
        }
        // The reserve segment goes with the rest.
        st.kept_segment = None;
        st.release_cached(|_| true);
        drop(st);
        // No other thread can reach this allocator any more: its last work runs here, even if
        // this drop happens inside another allocator's hook delivery. A segment whose free fails
        // comes back into the cache: one more try, then it is reported (there is no next call to
        // return the error from) and left to the process.
        for attempt in 0..2 {
            loop {
                let work = std::mem::take(&mut self.lock().outbox);
                if work.is_empty() {
                    break;
                }
                for w in work {
                    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run(w))) {
                        crate::backend::drop_payload(p);
                    }
                }
            }
            let mut st = self.lock();
            let left = st.segments.iter().filter(|s| s.live).count();
            if left == 0 {
                break;
            }
            if attempt == 1 {
                let why = st.error.take().map_or_else(String::new, |e| format!(": {e}"));
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "mempool: {left} segment(s) could not be given back when the allocator was dropped{why}"
                );
                break;
            }
            st.error = None;
            st.release_cached(|_| true);
        }
    }
}

fn limit_for(backend: &dyn Backend, fraction: f64) -> Option<usize> {
    if fraction >= 1.0 {
        return None;
    }
    backend.memory_info().map(|(_, total)| (total as f64 * fraction) as usize)
}
