//! The communicator's raw handle and its life: the NCCL calls behind the [`CommOps`] seam, and
//! [`CommHandle`], the one owner of the handle, which owns the links to its registrations and
//! decides how the handle ends.
//!
//! How it ends:
//! - [`Close::Orderly`] (`Communicator::destroy`): waits for the device's queued work, closes the
//!   registrations (every segment deregistered while nothing uses it), then `ncclCommFinalize`
//!   (collective: it waits for every rank's outstanding operations) and `ncclCommDestroy`.
//! - [`Close::Abort`] (`Communicator::abort`, and `Drop` of the last handle): `ncclCommAbort`
//!   first, which is local: it stops this rank's outstanding operations and frees its
//!   resources, registrations included, without waiting for any peer; the registrations'
//!   handles are then forgotten. A `Drop` can therefore never hang on a rank that is gone, even
//!   when it runs inside a trace hook (a hook that owned the last clone of a communicator, or a
//!   registration's hook still being delivered when the last registration goes). Nothing is
//!   deregistered under kernels that may still be running.
//!
//! After a successful destroy or abort the communicator's holds in the ledger are released:
//! NCCL never reads or writes that memory again on behalf of a communicator that is gone.
//! (Communicators made together in one process share resources that NCCL frees when the last of
//! them goes; what it still does then to a gone one's registrations is bookkeeping on its own
//! handles and mappings, not accesses to the memory.)
//!
//! Lock order: a registration's state, then this handle's mutex (a registration's hook registers
//! through the handle). Closing takes the handle's mutex only for single steps, never while it
//! takes a registration's state.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::CudaContext;
use cudarc::nccl::{result, sys};

use crate::error::{nccl, Error, Result};
use crate::ledger::{self, Hold, Owner};
use crate::register::{RegLink, Registrar};

/// What a communicator asks of NCCL, behind a seam so that the life of the handle (closing
/// registrations, then destroying or aborting) is tested on the CPU with a stand-in.
pub(crate) trait CommOps: Send + 'static {
    /// The raw handle, for collectives and windows, used under [`CommHandle::lock`].
    fn raw(&self) -> sys::ncclComm_t;
    /// Makes the communicator's device current on this thread.
    fn bind(&self) -> Result<()>;
    /// `ncclCommRegister`.
    ///
    /// # Safety
    /// `addr..addr+size` is memory of this communicator's device that stays allocated until it
    /// is deregistered successfully or the communicator is gone (the caller holds it in the
    /// ledger, which `ncclMemFree` consults).
    unsafe fn register(&self, addr: u64, size: usize) -> Result<u64, String>;
    /// `ncclCommDeregister`.
    ///
    /// # Safety
    /// `handle` came from [`register`](CommOps::register) on this value and has not been
    /// deregistered successfully yet.
    unsafe fn deregister(&self, handle: u64) -> Result<(), String>;
    /// `ncclCommWindowRegister` with `NCCL_WIN_COLL_SYMMETRIC` (collective).
    ///
    /// # Safety
    /// As for [`register`](CommOps::register), until the window is deregistered or the
    /// communicator is gone.
    unsafe fn window_register(&self, addr: u64, size: usize) -> Result<usize>;
    /// `ncclCommWindowDeregister` (local).
    ///
    /// # Safety
    /// `win` came from [`window_register`](CommOps::window_register) on this value and has not
    /// been deregistered successfully yet; no operation queued so far still uses it.
    unsafe fn window_deregister(&self, win: usize) -> Result<()>;
    /// `ncclCommGetAsyncError`: an error NCCL found in the background (a peer gone, say).
    fn async_error(&self) -> Result<()>;
    /// Waits for everything queued on the communicator's device.
    fn synchronize(&self) -> Result<()>;
    /// `ncclCommFinalize` (collective).
    fn finalize(&self) -> Result<()>;
    /// `ncclCommDestroy`.
    fn destroy(self: Box<Self>) -> Result<()>;
    /// `ncclCommAbort` (local).
    fn abort(self: Box<Self>) -> Result<()>;
}

/// An NCCL communicator handle of one device.
pub(crate) struct NcclComm {
    raw: sys::ncclComm_t,
    ctx: Arc<CudaContext>,
}

// SAFETY: an ncclComm_t is a heap object that NCCL allows to be used from any thread, one call
// at a time; an `NcclComm` is only reached through the mutex of its `CommHandle` (or owned, when
// it is destroyed), so calls never overlap.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// # Safety
    /// `raw` is a live communicator of `ctx`'s device, owned by nothing else: the `NcclComm`
    /// destroys or aborts it.
    pub(crate) unsafe fn new(raw: sys::ncclComm_t, ctx: Arc<CudaContext>) -> NcclComm {
        NcclComm { raw, ctx }
    }
}

impl CommOps for NcclComm {
    fn raw(&self) -> sys::ncclComm_t {
        self.raw
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(Error::cuda)
    }

    unsafe fn register(&self, addr: u64, size: usize) -> Result<u64, String> {
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: `self.raw` is live (owned by this value, used one call at a time); the caller
        // promises `addr..addr+size` is memory of this device that stays allocated while NCCL
        // has it registered; `handle` is a valid out pointer.
        let r = unsafe { sys::ncclCommRegister(self.raw, addr as *mut c_void, size, &mut handle) };
        r.result().map(|_| handle as u64).map_err(|e| format!("{:?}", e.0))
    }

    unsafe fn deregister(&self, handle: u64) -> Result<(), String> {
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: `self.raw` is live; the caller promises `handle` came from `ncclCommRegister`
        // on it and has not been deregistered successfully yet.
        let r = unsafe { sys::ncclCommDeregister(self.raw, handle as *mut c_void) };
        r.result().map(drop).map_err(|e| format!("{:?}", e.0))
    }

    unsafe fn window_register(&self, addr: u64, size: usize) -> Result<usize> {
        self.bind()?;
        let mut win: sys::ncclWindow_t = std::ptr::null_mut();
        const NCCL_WIN_COLL_SYMMETRIC: i32 = 1;
        // SAFETY: `self.raw` is live; the caller promises `addr..addr+size` is memory of this
        // device that stays allocated while the window is registered; `win` is a valid out
        // pointer.
        unsafe { sys::ncclCommWindowRegister(self.raw, addr as *mut c_void, size, &mut win, NCCL_WIN_COLL_SYMMETRIC) }
            .result()
            .map_err(|e| nccl("ncclCommWindowRegister", e))?;
        Ok(win as usize)
    }

    unsafe fn window_deregister(&self, win: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: `self.raw` is live; the caller promises `win` came from
        // `ncclCommWindowRegister` on it, is not deregistered yet, and is used by no queued
        // operation.
        unsafe { sys::ncclCommWindowDeregister(self.raw, win as sys::ncclWindow_t) }
            .result()
            .map(drop)
            .map_err(|e| nccl("ncclCommWindowDeregister", e))
    }

    fn async_error(&self) -> Result<()> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `self.raw` is live; `state` is a valid out pointer.
        unsafe { sys::ncclCommGetAsyncError(self.raw, &mut state) }
            .result()
            .map_err(|e| nccl("ncclCommGetAsyncError", e))?;
        state.result().map(drop).map_err(|e| nccl("NCCL (asynchronous error)", e))
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.synchronize().map_err(Error::cuda)
    }

    fn finalize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: `self.raw` is live and finalized at most once (the value is destroyed or
        // aborted right after).
        unsafe { result::comm_finalize(self.raw) }.map(drop).map_err(|e| nccl("ncclCommFinalize", e))
    }

    fn destroy(self: Box<Self>) -> Result<()> {
        self.bind()?;
        // SAFETY: the value is consumed: `self.raw` is destroyed once and never used again.
        unsafe { result::comm_destroy(self.raw) }.map(drop).map_err(|e| nccl("ncclCommDestroy", e))
    }

    fn abort(self: Box<Self>) -> Result<()> {
        // Aborting does not need the device current, but a failure to bind must not leave the
        // handle alive either.
        let _ = self.bind();
        // SAFETY: the value is consumed: `self.raw` is aborted once and never used again.
        unsafe { result::comm_abort(self.raw) }.map(drop).map_err(|e| nccl("ncclCommAbort", e))
    }
}

/// How a communicator ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Close {
    /// Finalize (collective), then destroy.
    Orderly,
    /// Abort: local, never waits for a peer.
    Abort,
}

/// The one owner of a communicator's handle, shared by its `Communicator` clones, its
/// registrars and its windows.
pub(crate) struct CommHandle {
    ops: Mutex<Option<Box<dyn CommOps>>>,
    registrations: Mutex<Vec<RegLink>>,
    owner: Owner,
}

impl std::fmt::Debug for CommHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommHandle").field("open", &self.lock().is_some()).finish()
    }
}

impl CommHandle {
    pub(crate) fn new(ops: Box<dyn CommOps>) -> Arc<CommHandle> {
        Arc::new(CommHandle {
            ops: Mutex::new(Some(ops)),
            registrations: Mutex::new(Vec::new()),
            owner: Owner::fresh(),
        })
    }

    /// The handle while it is open (`None` once destroyed or aborted). NCCL calls on it are
    /// made while this guard is held, one at a time.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Option<Box<dyn CommOps>>> {
        // NCCL calls do not panic; a poisoned lock still guards a consistent handle.
        self.ops.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whose holds this communicator's registrations and windows take in the ledger.
    pub(crate) fn owner(&self) -> Owner {
        self.owner
    }

    /// A registrar registering through this communicator (one per registration).
    pub(crate) fn registrar(self: &Arc<Self>) -> Arc<dyn Registrar> {
        Arc::new(CommRegistrar { comm: self.clone(), next: AtomicU64::new(1), handles: Mutex::new(HashMap::new()) })
    }

    /// Keeps a link to a registration, to close it before the handle goes.
    pub(crate) fn keep(&self, link: RegLink) {
        let mut regs = self.registrations.lock().unwrap_or_else(|p| p.into_inner());
        regs.retain(RegLink::alive);
        regs.push(link);
    }

    /// Ends the handle as `how` says, with its registrations:
    /// - `Orderly`: waits for the device's queued work, closes the registrations (deregistering
    ///   their segments while nothing uses them), then finalizes (collective) and destroys.
    /// - `Abort`: aborts first (NCCL stops this rank's kernels, then frees its registrations
    ///   itself), without deregistering anything under kernels that may still run and without
    ///   any call that could wait; the registrations are then closed by forgetting their handles.
    ///
    /// Once NCCL has let the handle go, every hold of this communicator is released: NCCL
    /// touches none of that memory again on its behalf. If it failed, the holds stay: that
    /// memory is never given to `ncclMemFree`.
    pub(crate) fn close(&self, how: Close) -> Result<()> {
        let links = std::mem::take(&mut *self.registrations.lock().unwrap_or_else(|p| p.into_inner()));
        if how == Close::Orderly {
            // Deregistering is not stream-ordered: nothing queued may still use the segments.
            let synced = match self.lock().as_ref() {
                Some(ops) => ops.synchronize(),
                None => Ok(()),
            };
            if let Err(e) = synced {
                self.registrations.lock().unwrap_or_else(|p| p.into_inner()).extend(links);
                return Err(e);
            }
            for l in &links {
                l.close();
            }
        }
        let Some(ops) = self.lock().take() else { return Ok(()) };
        // `gone`: NCCL let the handle go (an orderly close whose finalize failed still aborts).
        let (r, gone) = match how {
            Close::Orderly => match ops.finalize() {
                Ok(()) => {
                    let r = ops.destroy();
                    let gone = r.is_ok();
                    (r, gone)
                }
                // The finalize error is the one to report; the handle must go all the same.
                Err(e) => (Err(e), ops.abort().is_ok()),
            },
            Close::Abort => {
                let r = ops.abort();
                let gone = r.is_ok();
                (r, gone)
            }
        };
        for l in &links {
            if gone {
                l.forget();
            } else {
                // Later events are ignored; the handles that are left stay held.
                l.close();
            }
        }
        if gone {
            ledger::release_owner(self.owner);
        }
        r
    }
}

impl Drop for CommHandle {
    fn drop(&mut self) {
        // Never `ncclCommFinalize` here: it waits for every peer, and a `Drop` (possibly inside a
        // trace hook, possibly after a peer died) must not hang. An error is dropped with it.
        let _ = self.close(Close::Abort);
    }
}

/// Registers segments with one communicator for one registration. Only `ncclMemAlloc` segments
/// (those in the ledger) are covered, and each registered range is held in the ledger until its
/// deregistration succeeds or the communicator is gone, so its memory never reaches
/// `ncclMemFree` while NCCL has it registered.
struct CommRegistrar {
    comm: Arc<CommHandle>,
    next: AtomicU64,
    /// Our handle -> (NCCL's handle, the ledger's hold). NCCL may give the same handle (or none)
    /// for two registrations, so ours are our own.
    handles: Mutex<HashMap<u64, (u64, Hold)>>,
}

impl CommRegistrar {
    fn handles(&self) -> MutexGuard<'_, HashMap<u64, (u64, Hold)>> {
        self.handles.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Registrar for CommRegistrar {
    fn covers(&self, addr: u64, size: usize) -> bool {
        ledger::within_segment(addr, size)
    }

    fn register(&self, addr: u64, size: usize) -> Result<u64, String> {
        let guard = self.comm.lock();
        let ops = guard.as_ref().ok_or("the communicator was destroyed or aborted")?;
        // Held before NCCL has it, in the same step as the check that it is a live segment.
        let hold = ledger::hold_within_segment(self.comm.owner, addr, size)
            .ok_or_else(|| format!("{addr:#x} is not a live ncclMemAlloc segment"))?;
        // SAFETY: the segment is live memory of this communicator's device (a registration
        // registers only segments of its own allocator, the communicator's device's, whose
        // `NcclMemAllocator` serves that device alone), and the hold just taken keeps it from
        // `ncclMemFree` until `deregister` below succeeds or the communicator is gone.
        match unsafe { ops.register(addr, size) } {
            Ok(raw) => {
                let ours = self.next.fetch_add(1, Ordering::Relaxed);
                self.handles().insert(ours, (raw, hold));
                Ok(ours)
            }
            Err(m) => {
                ledger::release(hold);
                Err(m)
            }
        }
    }

    fn deregister(&self, handle: u64) -> Result<(), String> {
        let guard = self.comm.lock();
        let Some(ops) = guard.as_ref() else {
            // Destroyed or aborted: NCCL let the registration go with the handle. Its hold went
            // with the communicator's holds if the close succeeded, and stays if it failed.
            self.handles().remove(&handle);
            return Ok(());
        };
        let raw = self.handles().get(&handle).map(|h| h.0).ok_or("unknown handle")?;
        // SAFETY: `raw` came from `ops.register` on this communicator (through `register` above)
        // and is forgotten once a deregistration succeeds.
        unsafe { ops.deregister(raw) }?;
        if let Some((_, hold)) = self.handles().remove(&handle) {
            ledger::release(hold);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
