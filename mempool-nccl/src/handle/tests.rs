//! The life of a communicator's handle on the CPU: a stand-in for NCCL's calls behind
//! [`CommOps`], the real registrar and ledger, and a simulated device whose pool allocator frees
//! through the ledger as `NcclMemAllocator` does.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::nccl::sys;
use mempool::sim::SimDevice;
use mempool::trace::{self, Action};
use mempool::{Allocator, BackendError, MemPool, PoolOptions, RawAllocator, Sim, StreamId};

use super::{Close, CommHandle, CommOps};
use crate::error::{Error, Result};
use crate::ledger;
use crate::register::Registration;

/// What the stand-in was asked, in order.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    fn push(&self, s: String) {
        self.0.lock().unwrap().push(s);
    }
    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// NCCL's calls, recorded; `ncclCommDeregister` fails while `fail_deregister` is set, and
/// `ncclCommFinalize` panics (it would wait for every peer: a `Drop` must never call it).
struct FakeNccl {
    log: Log,
    next: AtomicU64,
    fail_deregister: Arc<AtomicBool>,
}

impl CommOps for FakeNccl {
    fn raw(&self) -> sys::ncclComm_t {
        std::ptr::null_mut()
    }
    fn bind(&self) -> Result<()> {
        Ok(())
    }
    unsafe fn register(&self, addr: u64, _size: usize) -> Result<u64, String> {
        self.log.push(format!("register {addr:#x}"));
        Ok(self.next.fetch_add(1, Ordering::Relaxed))
    }
    unsafe fn deregister(&self, handle: u64) -> Result<(), String> {
        if self.fail_deregister.load(Ordering::Relaxed) {
            self.log.push(format!("deregister {handle} failed"));
            return Err("ncclInternalError".into());
        }
        self.log.push(format!("deregister {handle}"));
        Ok(())
    }
    unsafe fn window_register(&self, _: u64, _: usize) -> Result<usize> {
        unreachable!("no windows here")
    }
    unsafe fn window_deregister(&self, _: usize) -> Result<()> {
        unreachable!("no windows here")
    }
    fn async_error(&self) -> Result<()> {
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        self.log.push("synchronize".into());
        Ok(())
    }
    fn finalize(&self) -> Result<()> {
        self.log.push("finalize".into());
        panic!("ncclCommFinalize waits for every peer")
    }
    fn destroy(self: Box<Self>) -> Result<()> {
        self.log.push("destroy".into());
        Ok(())
    }
    fn abort(self: Box<Self>) -> Result<()> {
        self.log.push("abort".into());
        Ok(())
    }
}

fn fake() -> (Arc<CommHandle>, Log, Arc<AtomicBool>) {
    let log = Log::default();
    let fail = Arc::new(AtomicBool::new(false));
    let ops = FakeNccl { log: log.clone(), next: AtomicU64::new(1), fail_deregister: fail.clone() };
    (CommHandle::new(Box::new(ops)), log, fail)
}

/// Segments for a simulated pool, in the ledger like `ncclMemAlloc`'s, freed through
/// `ledger::free_segment` like `NcclMemAllocator::free` (a held one is refused).
struct LedgerAlloc {
    next: Mutex<u64>,
    frees: Arc<Mutex<Vec<u64>>>,
}

// SAFETY: only used by simulated allocators, which never read or write the memory; the
// addresses are distinct granularity-aligned ranges (each test its own), each handed out once.
unsafe impl RawAllocator for LedgerAlloc {
    fn name(&self) -> &str {
        "ledger"
    }
    fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        let mut n = self.next.lock().unwrap();
        let a = *n;
        *n += (size as u64).next_multiple_of(2 << 20);
        ledger::add_segment(a, size);
        Ok(a)
    }
    unsafe fn free(&self, ptr: u64, size: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        ledger::free_segment(ptr, size, || -> Result<(), String> {
            self.frees.lock().unwrap().push(ptr);
            Ok(())
        })
        .map_err(|e| BackendError::Failed(format!("{e:?}")))
    }
    fn granularity(&self) -> usize {
        2 << 20
    }
}

fn sim_pool(base: u64) -> (Allocator<Sim>, MemPool<Sim>, Arc<Mutex<Vec<u64>>>) {
    let a = Allocator::sim(SimDevice::new(1 << 34));
    let frees = Arc::default();
    let raw = LedgerAlloc { next: Mutex::new(base), frees: Arc::clone(&frees) };
    let pool = MemPool::on(&a, PoolOptions::new().allocator(raw)).unwrap();
    (a, pool, frees)
}

fn attach(comm: &Arc<CommHandle>, a: &Allocator<Sim>, pool: &MemPool<Sim>) -> Registration {
    let r = Registration::attach(a, Some(pool.id()), comm.registrar()).unwrap();
    comm.keep(r.link());
    r
}

#[test]
fn drop_of_the_last_handle_aborts_after_deregistering_and_never_finalizes() {
    let (comm, log, _) = fake();
    let (a, pool, _frees) = sim_pool(0x6100_0000_0000);
    let reg = attach(&comm, &a, &pool);
    let x = pool.alloc::<u8>(100).unwrap();
    drop(reg);
    drop(comm);
    // Hooks are process-wide: another test's thread delivering its events may still hold a clone
    // of this registration's callback (and through it the communicator) for a moment; the last
    // handle then goes, and aborts, on that thread.
    let t0 = std::time::Instant::now();
    while log.all().len() < 3 && t0.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(log.all(), ["register 0x610000000000", "deregister 1", "abort"]);
    drop(x);
}

#[test]
fn the_orderly_end_waits_deregisters_then_finalizes() {
    let (comm, log, _) = fake();
    let (a, pool, _frees) = sim_pool(0x6200_0000_0000);
    let reg = attach(&comm, &a, &pool);
    let _x = pool.alloc::<u8>(100).unwrap();
    // The stand-in's finalize panics (a real one would wait for the peers): reaching it after the
    // deregistration is what this checks.
    let closed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| comm.close(Close::Orderly)));
    assert!(closed.is_err());
    assert_eq!(log.all(), ["register 0x620000000000", "synchronize", "deregister 1", "finalize"]);
    assert!(reg.segments().is_empty());
}

/// An abort with registrations alive deregisters nothing itself (kernels may still be running
/// on the segments; NCCL's abort stops them and frees the registrations): the registrations
/// are closed, their handles forgotten, and their segments free to go.
#[test]
fn abort_first_then_the_registrations_are_forgotten() {
    let (comm, log, _) = fake();
    let (a, pool, frees) = sim_pool(0x6700_0000_0000);
    let reg = attach(&comm, &a, &pool);
    drop(pool.alloc::<u8>(100).unwrap());
    assert!(ledger::is_held(0x6700_0000_0000, 2 << 20));
    comm.close(Close::Abort).unwrap();
    assert_eq!(log.all(), ["register 0x670000000000", "abort"]);
    assert!(reg.segments().is_empty());
    assert!(!ledger::is_held(0x6700_0000_0000, 2 << 20));
    let _later = pool.alloc::<u8>(30 << 20).unwrap(); // closed: not registered
    assert_eq!(log.all().len(), 2);
    pool.empty_cache().unwrap();
    assert_eq!(*frees.lock().unwrap(), [0x6700_0000_0000]);
    assert!(reg.take_errors().is_empty());
}

#[test]
fn last_handle_dropped_inside_a_hook_aborts_there_without_blocking() {
    let (comm, log, _) = fake();
    let (a, pool, frees) = sim_pool(0x6300_0000_0000);
    let reg = attach(&comm, &a, &pool);
    let first = pool.alloc::<u8>(100).unwrap();
    // A hook owns the communicator's last handle and the registration, and drops both at the
    // next segment of this allocator.
    let owned = Arc::new(Mutex::new(Some((comm, reg))));
    let dropped_in_hook = Arc::new(AtomicBool::new(false));
    let (o, flag, me) = (owned.clone(), dropped_in_hook.clone(), a.id());
    let _hook = trace::attach(move |e| {
        if e.allocator == me && e.action == Action::SegmentAlloc {
            if let Some(both) = o.lock().unwrap().take() {
                drop(both);
                flag.store(true, Ordering::SeqCst);
            }
        }
    })
    .unwrap();
    let second = pool.alloc::<u8>(30 << 20).unwrap(); // a new segment: its hook event drops them
    assert!(dropped_in_hook.load(Ordering::SeqCst));
    // Hooks are global: a delivery on another test's thread may hold a clone of the
    // registration's hook (and so the handle) for a moment; the abort then runs when that
    // delivery ends, on that thread. It must come, without a finalize.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while log.all().last().map(String::as_str) != Some("abort") && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let log = log.all();
    assert_eq!(log.first().map(String::as_str), Some("register 0x630000000000"));
    assert_eq!(log.last().map(String::as_str), Some("abort"), "{log:?}");
    assert!(!log.iter().any(|l| l == "finalize"), "{log:?}");
    // Every registration was undone before the abort, and nothing is held: both segments go.
    assert!(!ledger::is_held(0x6300_0000_0000, 64 << 20));
    drop((first, second));
    pool.empty_cache().unwrap();
    assert_eq!(frees.lock().unwrap().len(), 2);
}

#[test]
fn a_failed_deregistration_holds_the_segment_until_a_retry_succeeds() {
    let (comm, log, fail) = fake();
    let (a, pool, frees) = sim_pool(0x6400_0000_0000);
    let reg = attach(&comm, &a, &pool);
    drop(pool.alloc::<u8>(100).unwrap());
    fail.store(true, Ordering::Relaxed);
    // The segment's free is refused (NCCL still has it), it stays cached and is announced again
    // without a second registration.
    let e = pool.empty_cache().unwrap_err();
    assert!(e.to_string().contains("Held"), "{e}");
    assert!(frees.lock().unwrap().is_empty());
    assert_eq!(reg.segments(), [(0x6400_0000_0000, 2 << 20)]);
    assert!(ledger::is_held(0x6400_0000_0000, 2 << 20));
    assert_eq!(reg.take_errors().len(), 1);
    // The pool keeps using it.
    drop(pool.alloc::<u8>(100).unwrap());
    fail.store(false, Ordering::Relaxed);
    pool.empty_cache().unwrap();
    assert_eq!(*frees.lock().unwrap(), [0x6400_0000_0000]);
    assert!(reg.segments().is_empty());
    assert!(!ledger::is_held(0x6400_0000_0000, 2 << 20));
    let log = log.all();
    assert_eq!(log.iter().filter(|l| l.starts_with("register")).count(), 1, "{log:?}");
    assert_eq!(log.last().unwrap(), "deregister 1");
}

#[test]
fn a_failed_deregistration_holds_until_the_communicator_is_aborted() {
    let (comm, _log, fail) = fake();
    let (a, pool, frees) = sim_pool(0x6500_0000_0000);
    let reg = attach(&comm, &a, &pool);
    drop(pool.alloc::<u8>(100).unwrap());
    fail.store(true, Ordering::Relaxed);
    drop(reg); // its deregistration fails: the registration is gone, the segment still held
    assert!(ledger::is_held(0x6500_0000_0000, 2 << 20));
    assert!(pool.empty_cache().is_err());
    assert!(frees.lock().unwrap().is_empty());
    comm.close(Close::Abort).unwrap(); // NCCL lets every registration go with the handle
    assert!(!ledger::is_held(0x6500_0000_0000, 2 << 20));
    pool.empty_cache().unwrap();
    assert_eq!(*frees.lock().unwrap(), [0x6500_0000_0000]);
}

#[test]
fn a_closed_communicator_registers_nothing() {
    let (comm, _log, _) = fake();
    let (a, pool, _frees) = sim_pool(0x6600_0000_0000);
    comm.close(Close::Abort).unwrap();
    let reg = attach(&comm, &a, &pool);
    let _x = pool.alloc::<u8>(100).unwrap();
    assert!(reg.segments().is_empty());
    let errors = reg.take_errors();
    assert!(matches!(&errors[..], [Error::Registration { .. }]), "{errors:?}");
    assert!(!ledger::is_held(0x6600_0000_0000, 2 << 20));
}

#[test]
fn only_ledger_segments_are_registered() {
    // Segments of the default pools (not from ncclMemAlloc) are left alone, without an error.
    let (comm, log, _) = fake();
    let a = Allocator::sim(SimDevice::new(1 << 30));
    let reg = Registration::attach(&a, None, comm.registrar()).unwrap();
    let _x = a.alloc::<u8>(100).unwrap();
    assert!(reg.segments().is_empty());
    assert!(reg.take_errors().is_empty());
    assert!(log.all().is_empty());
}
