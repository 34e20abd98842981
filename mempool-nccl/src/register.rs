//! Keeping a pool's segments registered with a communicator as the pool grows and shrinks.
//!
//! A [`Registration`] registers every segment that exists when it is made, then follows the
//! allocator's trace hooks: a `SegmentAlloc` is registered before any block of the segment is
//! handed out, and a `SegmentFree` deregistered before the memory goes back to `ncclMemFree`.
//! The bookkeeping goes through the [`Registrar`] trait, so it is tested on the CPU with a
//! recording implementation.

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::nccl::sys;
use mempool::trace::{self, Action, TraceHandle};
use mempool::{Allocator, AllocatorId, Kind, PoolId};

use crate::comm::CommInner;
use crate::error::{Error, Result};

/// Registers and deregisters segments (NCCL's `ncclCommRegister`/`ncclCommDeregister`, or a
/// recording stand-in in tests).
pub trait Registrar: Send + Sync + 'static {
    /// Registers `size` bytes at `addr`; returns a handle for [`deregister`](Registrar::deregister).
    fn register(&self, addr: u64, size: usize) -> Result<u64, String>;
    /// Undoes a registration.
    fn deregister(&self, handle: u64) -> Result<(), String>;
}

pub(crate) struct NcclRegistrar {
    pub(crate) comm: Arc<CommInner>,
}

impl Registrar for NcclRegistrar {
    fn register(&self, addr: u64, size: usize) -> Result<u64, String> {
        let guard = self.comm.lock();
        let raw = guard.as_ref().ok_or("the communicator was destroyed")?;
        self.comm.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: `raw` is a live communicator (held under its mutex); `addr..addr+size` is a
        // live segment of this device that stays allocated until it is deregistered (the
        // SegmentFree hook runs before its free); `handle` is a valid out pointer.
        let r = unsafe { sys::ncclCommRegister(raw.0, addr as *mut c_void, size, &mut handle) };
        r.result().map(|_| handle as u64).map_err(|e| format!("{:?}", e.0))
    }

    fn deregister(&self, handle: u64) -> Result<(), String> {
        let guard = self.comm.lock();
        let Some(raw) = guard.as_ref() else { return Ok(()) };
        self.comm.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: `handle` came from `ncclCommRegister` on this communicator and is deregistered once.
        let r = unsafe { sys::ncclCommDeregister(raw.0, handle as *mut c_void) };
        r.result().map(drop).map_err(|e| format!("{:?}", e.0))
    }
}

/// Shared between a [`Registration`], its hook and its communicator.
pub(crate) struct RegState {
    registrar: Arc<dyn Registrar>,
    allocator: AllocatorId,
    pool: Option<PoolId>,
    /// Registered segments: address -> (size, handle).
    handles: HashMap<u64, (usize, u64)>,
    /// Segments the hook saw freed while the initial segments were being registered.
    freed_meanwhile: Option<HashSet<u64>>,
    errors: Vec<Error>,
    closed: bool,
}

impl RegState {
    fn lock(s: &Mutex<RegState>) -> MutexGuard<'_, RegState> {
        s.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register(&mut self, addr: u64, size: usize) {
        if self.closed || self.handles.contains_key(&addr) {
            return;
        }
        match self.registrar.register(addr, size) {
            Ok(h) => {
                self.handles.insert(addr, (size, h));
            }
            Err(message) => self.errors.push(Error::Registration { segment: addr, size, message }),
        }
    }

    fn deregister(&mut self, addr: u64) {
        if let Some((size, h)) = self.handles.remove(&addr) {
            if let Err(message) = self.registrar.deregister(h) {
                self.errors.push(Error::Registration {
                    segment: addr,
                    size,
                    message: format!("deregister: {message}"),
                });
            }
        }
    }

    /// Deregisters everything; later events are ignored.
    pub(crate) fn close(s: &Mutex<RegState>) {
        let mut st = RegState::lock(s);
        let addrs: Vec<u64> = st.handles.keys().copied().collect();
        for a in addrs {
            st.deregister(a);
        }
        st.closed = true;
    }

    fn on_event(&mut self, e: &trace::TraceEntry) {
        // The allocator, not the device index: a host or simulated allocator also calls itself
        // device 0, and its memory must never reach NCCL.
        if e.allocator != self.allocator || self.pool.is_some_and(|p| p != e.pool) {
            return;
        }
        match e.action {
            Action::SegmentAlloc => self.register(e.addr, e.size),
            Action::SegmentFree => {
                if let Some(f) = &mut self.freed_meanwhile {
                    f.insert(e.addr);
                }
                self.deregister(e.addr)
            }
            _ => {}
        }
    }
}

/// Keeps a pool's (or a device's) segments registered; deregisters everything when dropped.
pub struct Registration {
    pub(crate) state: Arc<Mutex<RegState>>,
    hook: Option<TraceHandle>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = RegState::lock(&self.state);
        f.debug_struct("Registration").field("segments", &st.handles.len()).field("pool", &st.pool).finish()
    }
}

impl Registration {
    /// Registers the segments of `pool` (every pool when `None`) of `alloc`'s device through
    /// `registrar`, now and as they come and go.
    pub fn attach<K: Kind>(
        alloc: &Allocator<K>,
        pool: Option<PoolId>,
        registrar: Arc<dyn Registrar>,
    ) -> Result<Registration> {
        let state = Arc::new(Mutex::new(RegState {
            registrar,
            allocator: alloc.id(),
            pool,
            handles: HashMap::new(),
            freed_meanwhile: Some(HashSet::new()),
            errors: Vec::new(),
            closed: false,
        }));
        let s = state.clone();
        // The hook first, so no segment allocated from now on is missed...
        let hook = trace::attach(move |e| RegState::lock(&s).on_event(e))?;
        // ...then what exists already (the snapshot is taken before this state is locked: the
        // hook locks the allocator first, then this state).
        let snap = alloc.snapshot();
        {
            let mut st = RegState::lock(&state);
            let freed = st.freed_meanwhile.take().unwrap_or_default();
            for seg in snap.segments.iter().filter(|s| pool.is_none_or(|p| p == s.pool)) {
                if !freed.contains(&seg.address) {
                    st.register(seg.address, seg.total_size);
                }
            }
        }
        Ok(Registration { state, hook: Some(hook) })
    }

    /// The segments registered now, `(address, size)` in address order.
    pub fn segments(&self) -> Vec<(u64, usize)> {
        let st = RegState::lock(&self.state);
        let mut v: Vec<(u64, usize)> = st.handles.iter().map(|(a, (s, _))| (*a, *s)).collect();
        v.sort_unstable();
        v
    }

    /// Registrations NCCL refused (or deregistrations that failed) since the last call.
    pub fn take_errors(&self) -> Vec<Error> {
        std::mem::take(&mut RegState::lock(&self.state).errors)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        drop(self.hook.take());
        RegState::close(&self.state);
    }
}
