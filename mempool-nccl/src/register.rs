//! Keeping a pool's segments registered as the pool grows and shrinks.
//!
//! A [`Registration`] registers every segment that exists when it is made, then follows the
//! allocator's trace hooks: a `SegmentAlloc` is registered as the hook sees it (normally before
//! the allocating call returns; a block another thread takes at that moment may be used in a
//! collective before, which NCCL then runs without zero-copy, correctly), and a `SegmentFree` is
//! deregistered before the memory goes back to its allocator (always: the allocator frees it
//! only after the hook returned).
//! The registering itself goes through the [`Registrar`] trait: a communicator supplies one
//! (`ncclCommRegister`), and the tests a recording one on the simulated device. This module knows
//! nothing of communicators; a communicator keeps a `RegLink` to each of its registrations to
//! close them before it goes.
//!
//! A deregistration that fails keeps its handle: the segment is still registered. Its allocator
//! must then refuse to free it (the `ncclMemAlloc` allocator does, through the crate's ledger),
//! which makes the caching allocator keep the segment cached and announce it again; the
//! registration keeps the handle it has and tries to deregister again at the segment's next
//! free (a later `empty_cache`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use mempool::trace::{self, Action, TraceHandle};
use mempool::{Allocator, AllocatorId, Kind, PoolId};

use crate::error::{Error, Result};

/// Registers and deregisters segments (NCCL's `ncclCommRegister`/`ncclCommDeregister` through a
/// communicator, or a recording stand-in in tests).
///
/// A registrar's memory must not be freed while it is registered: when
/// [`deregister`](Registrar::deregister) fails, the [`Registration`] keeps the handle and tries
/// again at the segment's next free, so the segment's allocator has to refuse to free it
/// meanwhile (returning an error from `RawAllocator::free` keeps it cached).
pub trait Registrar: Send + Sync + 'static {
    /// Registers `size` bytes at `addr`; returns a handle for [`deregister`](Registrar::deregister).
    fn register(&self, addr: u64, size: usize) -> Result<u64, String>;
    /// Undoes a registration. On an error the registration stays in place and the handle is
    /// kept, to be deregistered again later.
    fn deregister(&self, handle: u64) -> Result<(), String>;
    /// Whether the segment at `addr` is for this registrar at all; those it declines are left
    /// alone without an error. A communicator registers only `ncclMemAlloc` segments, the ones
    /// whose free waits for their deregistration. Every segment by default.
    fn covers(&self, addr: u64, size: usize) -> bool {
        let _ = (addr, size);
        true
    }
}

/// One registered segment.
#[derive(Debug, Clone, Copy)]
struct Entry {
    size: usize,
    handle: u64,
}

/// Shared between a [`Registration`], its hook and (through a [`RegLink`]) its communicator.
struct RegState {
    registrar: Arc<dyn Registrar>,
    allocator: AllocatorId,
    pool: Option<PoolId>,
    /// Registered segments by address, including those whose deregistration failed.
    entries: HashMap<u64, Entry>,
    /// Segments the hook saw freed while the initial segments were being registered.
    freed_meanwhile: Option<HashSet<u64>>,
    errors: Vec<Error>,
    closed: bool,
    /// Registrations and deregistrations not yet told to `tracing` (told once the lock is let
    /// go: a subscriber is user code).
    #[cfg(feature = "tracing")]
    told: Vec<Told>,
}

/// One registration step for `tracing`: what, the segment, whether NCCL accepted it.
#[cfg(feature = "tracing")]
type Told = (&'static str, u64, usize, bool);

/// Runs `f` on the state, then tells `tracing` what it registered and deregistered.
fn with_state<T>(s: &Mutex<RegState>, f: impl FnOnce(&mut RegState) -> T) -> T {
    let mut st = lock(s);
    let r = f(&mut st);
    #[cfg(feature = "tracing")]
    {
        let told = std::mem::take(&mut st.told);
        drop(st);
        for (what, segment, size, ok) in told {
            // A subscriber's panic stays here (this may run in a `Drop`, during an unwind); its
            // payload is forgotten, as a hook's is.
            let told = std::panic::catch_unwind(|| {
                if ok {
                    tracing::debug!(target: "mempool_nccl", segment, size, "{what}");
                } else {
                    tracing::warn!(target: "mempool_nccl", segment, size, "{what} refused by NCCL");
                }
            });
            if let Err(p) = told {
                std::mem::forget(p);
            }
        }
    }
    r
}

fn lock(s: &Mutex<RegState>) -> MutexGuard<'_, RegState> {
    // Nothing here panics while holding it (registrar panics are caught by the hook delivery,
    // which leaves the state as consistent as before the call).
    s.lock().unwrap_or_else(|p| p.into_inner())
}

impl RegState {
    fn register(&mut self, addr: u64, size: usize) {
        if self.closed {
            return;
        }
        if let Some(e) = self.entries.get(&addr).copied() {
            if e.size == size {
                // Still registered: its deregistration failed, so its free was refused and the
                // allocator announces it again. The handle it has stays.
                return;
            }
            // Another segment at the same address: the old one was freed after all (its
            // allocator did not wait for the deregistration). Try once more, then forget it.
            self.deregister(addr);
            if self.entries.remove(&addr).is_some() {
                self.errors.push(Error::Registration {
                    segment: addr,
                    size: e.size,
                    message: "freed while its deregistration had failed; its handle is dropped".into(),
                });
            }
        }
        if !self.registrar.covers(addr, size) {
            return;
        }
        let r = self.registrar.register(addr, size);
        #[cfg(feature = "tracing")]
        self.told.push(("segment registered", addr, size, r.is_ok()));
        match r {
            Ok(handle) => {
                self.entries.insert(addr, Entry { size, handle });
            }
            Err(message) => self.errors.push(Error::Registration { segment: addr, size, message }),
        }
    }

    /// Deregisters the segment at `addr` if it is registered; on failure the entry stays.
    fn deregister(&mut self, addr: u64) {
        let Some(e) = self.entries.get(&addr).copied() else { return };
        let r = self.registrar.deregister(e.handle);
        #[cfg(feature = "tracing")]
        self.told.push(("segment deregistered", addr, e.size, r.is_ok()));
        match r {
            Ok(()) => {
                self.entries.remove(&addr);
            }
            Err(message) => self.errors.push(Error::Registration {
                segment: addr,
                size: e.size,
                message: format!("deregister: {message} (still registered; tried again at its next free)"),
            }),
        }
    }

    /// Deregisters everything; later events are ignored. Entries whose deregistration fails
    /// stay (their memory is still registered).
    fn close(&mut self) {
        let addrs: Vec<u64> = self.entries.keys().copied().collect();
        for a in addrs {
            self.deregister(a);
        }
        self.closed = true;
    }

    fn on_event(&mut self, e: &trace::TraceEntry) {
        // The allocator, not the device index: a host or simulated allocator also calls itself
        // device 0, and its memory must never reach this registrar.
        if self.closed || e.allocator != self.allocator || self.pool.is_some_and(|p| p != e.pool) {
            return;
        }
        match e.action {
            // A physical allocation mapped into an expandable segment is registered as a
            // segment is (each on its own: a `no_span` pool keeps buffers inside one).
            Action::SegmentAlloc | Action::SegmentMap => self.register(e.addr, e.size),
            Action::SegmentFree | Action::SegmentUnmap => {
                if let Some(f) = &mut self.freed_meanwhile {
                    f.insert(e.addr);
                }
                self.deregister(e.addr)
            }
            _ => {}
        }
    }
}

/// A communicator's link to one of its registrations: closes it before the communicator goes,
/// and forgets its handles once the communicator is gone (NCCL dropped them with it). It does
/// not keep the registration alive.
#[derive(Clone)]
pub(crate) struct RegLink(Weak<Mutex<RegState>>);

impl RegLink {
    /// Whether the registration still exists.
    pub(crate) fn alive(&self) -> bool {
        self.0.strong_count() > 0
    }

    /// Deregisters everything; later events are ignored.
    pub(crate) fn close(&self) {
        if let Some(s) = self.0.upgrade() {
            with_state(&s, RegState::close);
        }
    }

    /// Drops the handles left (deregistrations that failed): the registrar's registrations are
    /// void now.
    pub(crate) fn forget(&self) {
        if let Some(s) = self.0.upgrade() {
            let mut st = lock(&s);
            st.entries.clear();
            st.closed = true;
        }
    }
}

/// Keeps a pool's (or a device's) segments registered; deregisters everything when dropped.
///
/// Dropping it is allowed anywhere, inside a trace hook included: its hook is detached, every
/// segment is deregistered, and events still being delivered are ignored.
pub struct Registration {
    state: Arc<Mutex<RegState>>,
    hook: Option<TraceHandle>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = lock(&self.state);
        f.debug_struct("Registration").field("segments", &st.entries.len()).field("pool", &st.pool).finish()
    }
}

impl Registration {
    /// Registers the segments of `pool` (every pool when `None`) of `alloc` through
    /// `registrar`, now and as they come and go. Events of other allocators (another device,
    /// a host or simulated allocator that also calls itself device 0) never reach it.
    pub fn attach<K: Kind>(
        alloc: &Allocator<K>,
        pool: Option<PoolId>,
        registrar: Arc<dyn Registrar>,
    ) -> Result<Registration> {
        let state = Arc::new(Mutex::new(RegState {
            registrar,
            allocator: alloc.id(),
            pool,
            entries: HashMap::new(),
            freed_meanwhile: Some(HashSet::new()),
            errors: Vec::new(),
            closed: false,
            #[cfg(feature = "tracing")]
            told: Vec::new(),
        }));
        let s = state.clone();
        // The hook first, so no segment allocated from now on is missed...
        let hook = trace::attach(move |e| with_state(&s, |st| st.on_event(e)))?;
        // ...then what exists already. Hooks run outside the allocator's lock, so the snapshot
        // may show a segment the hook is about to see freed: a segment the hook saw freed
        // meanwhile is skipped, and one freed later is deregistered by the hook (which sees its
        // `SegmentFree` before its memory goes back).
        let snap = alloc.snapshot();
        with_state(&state, |st| {
            let freed = st.freed_meanwhile.take().unwrap_or_default();
            for seg in snap.segments.iter().filter(|s| pool.is_none_or(|p| p == s.pool)) {
                // An expandable segment is registered as the physical allocations it was
                // mapped in, as the hook registers them.
                let whole = [(seg.address, seg.total_size)];
                let pieces = if seg.mappings.is_empty() { &whole[..] } else { &seg.mappings[..] };
                for &(addr, size) in pieces.iter().filter(|p| !freed.contains(&p.0)) {
                    st.register(addr, size);
                }
            }
        });
        Ok(Registration { state, hook: Some(hook) })
    }

    /// A link for the communicator that owns the registrar.
    pub(crate) fn link(&self) -> RegLink {
        RegLink(Arc::downgrade(&self.state))
    }

    /// The segments registered now, `(address, size)` in address order (those whose
    /// deregistration failed included: they are still registered).
    pub fn segments(&self) -> Vec<(u64, usize)> {
        let st = lock(&self.state);
        let mut v: Vec<(u64, usize)> = st.entries.iter().map(|(a, e)| (*a, e.size)).collect();
        v.sort_unstable();
        v
    }

    /// Registrations refused (or deregistrations that failed) since the last call.
    pub fn take_errors(&self) -> Vec<Error> {
        std::mem::take(&mut lock(&self.state).errors)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Detached first (allowed inside a hook too); a delivery already under way may still
        // call the hook, which then finds the state closed.
        drop(self.hook.take());
        with_state(&self.state, RegState::close);
    }
}
