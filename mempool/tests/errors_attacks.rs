//! Hostile-review probes (issue 19): the error types' causes, formatting without a CUDA driver, equality.
//! Run on a machine without libcuda: `cargo test -p cuda-mempool --test errors_attacks`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::{sys::CUresult, DriverError};
use mempool::sim::SimDevice;
use mempool::{Allocator, BackendError, Cause, Error, MemPool, PoolOptions, RawAllocator, StreamId};

const MIB: usize = 1 << 20;

fn no_driver() -> bool {
    matches!(mempool::device_count(), Err(Error::NoCudaDriver))
}

fn d() -> DriverError {
    DriverError(CUresult::CUDA_ERROR_INVALID_VALUE)
}

fn panics(f: impl FnOnce() -> String) -> Result<String, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

/// `Error::with_cause(.., DriverError)` is public; its Display is fine (the words are given),
/// but Debug (what `unwrap`, `assert_eq!`, `{:?}` print) formats the cause through cudarc,
/// whose Debug calls cuGetErrorString: without libcuda that panics.
#[test]
fn probe_debug_of_error_with_driver_cause_without_driver() {
    if !no_driver() {
        return;
    }
    let e = Error::with_cause("segment allocation", "invalid argument", d());
    let shown = panics(|| e.to_string());
    assert!(shown.is_ok(), "Display panicked: {shown:?}");
    let dbg = panics(|| format!("{e:?}"));
    assert!(dbg.is_ok(), "Debug of a public Error panicked: {dbg:?}");
}

/// `Error::caused_by(op, DriverError)` formats the cause at construction.
#[test]
fn probe_caused_by_driver_error_without_driver() {
    if !no_driver() {
        return;
    }
    let r = panics(|| Error::caused_by("op", d()).to_string());
    assert!(r.is_ok(), "Error::caused_by panicked: {r:?}");
}

/// `BackendError::Driver` is public; its Display forwards to cudarc.
#[test]
fn probe_backend_error_driver_display_without_driver() {
    if !no_driver() {
        return;
    }
    let r = panics(|| BackendError::Driver(d()).to_string());
    assert!(r.is_ok(), "BackendError::Driver Display panicked: {r:?}");
    let r = panics(|| format!("{:?}", BackendError::Driver(d())));
    assert!(r.is_ok(), "BackendError::Driver Debug panicked: {r:?}");
}

/// The source chain of an error from the walk an error reporter makes (anyhow's `{:#}`):
/// the Display of each error, then of its source, joined by ": ".
fn report(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s += ": ";
        s += &c.to_string();
        cur = c.source();
    }
    s
}

/// `caused_by` puts the cause's words in the message *and* returns the cause as the source:
/// every reporter prints them twice (the API guidelines: one or the other, never both).
#[test]
fn probe_caused_by_prints_the_cause_twice_in_a_report() {
    let e = Error::caused_by("snapshot write", std::io::Error::other("disk full"));
    let r = report(&e);
    assert_eq!(r.matches("disk full").count(), 1, "report: {r}");
}

/// `Cause`'s equality for two non-driver errors formats both (Display and Debug): a cause that
/// wraps a driver error (here `BackendError::Driver`) panics on `==` without libcuda.
#[test]
fn probe_cause_eq_of_wrapped_driver_error_without_driver() {
    if !no_driver() {
        return;
    }
    let a = Cause::new(BackendError::Driver(d()));
    let b = Cause::new(BackendError::Driver(d()));
    let r = panics(|| (a == b).to_string());
    assert!(r.is_ok(), "Cause == panicked: {r:?}");
}

/// Lawfulness of `Cause: Eq` where it holds: reflexive through the Arc, symmetric, transitive
/// within a kind; a driver cause never equals a non-driver one that prints the same.
#[test]
#[allow(clippy::eq_op, clippy::nonminimal_bool)] // the laws, spelled out: symmetry is the point
fn probe_cause_eq_laws() {
    let io = |m: &str| Cause::new(std::io::Error::other(m.to_string()));
    let (a, b, c) = (io("x"), io("x"), io("x"));
    let lawful = a == a && a == b && b == a && b == c && a == c;
    assert!(lawful);
    assert!(io("x") != io("y"));
    let (p, q) = (Cause::new(d()), Cause::new(d()));
    assert!(p == q && q == p);
    assert!(p != Cause::new(DriverError(CUresult::CUDA_ERROR_INVALID_HANDLE)));
    assert!(p != a && a != p);
}

/// A pool allocator (public `RawAllocator`) that refuses with a driver error, as one built on
/// cudarc's `result::` calls would (`BackendError::from(e)`). Without libcuda, `alloc_failed`
/// formats it (`e.to_string()`) under the allocator's lock.
struct DriverRefuser {
    frees: AtomicUsize,
    alloc_fails: bool,
}

// SAFETY: `alloc` returns fresh host memory of `size` bytes aligned to 512 (or fails), `free`
// gives exactly that back, or fails without freeing.
unsafe impl RawAllocator for DriverRefuser {
    fn name(&self) -> &str {
        "driver-refuser"
    }
    fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        if self.alloc_fails {
            if FAILED_NOT_DRIVER.with(|c| c.get()) {
                return Err(BackendError::Failed("refused".into()));
            }
            return Err(BackendError::Driver(d()));
        }
        let l = std::alloc::Layout::from_size_align(size, 512).unwrap();
        // SAFETY: size > 0.
        Ok(unsafe { std::alloc::alloc(l) } as u64)
    }
    unsafe fn free(&self, _: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        self.frees.fetch_add(1, Ordering::Relaxed);
        // Not freed (leaked): the contract lets a free fail.
        if FAILED_NOT_DRIVER.with(|c| c.get()) {
            return Err(BackendError::Failed("refused".into()));
        }
        Err(BackendError::Driver(d()))
    }
}

thread_local! {
    /// Control runs: the same refusals as `BackendError::Failed`.
    static FAILED_NOT_DRIVER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Controls: the same two probes with `BackendError::Failed` pass.
#[test]
fn control_pool_allocator_failed_refusals() {
    FAILED_NOT_DRIVER.with(|c| c.set(true));
    probe_pool_allocator_driver_error_on_alloc_without_driver_inner();
    probe_pool_allocator_driver_error_on_free_without_driver_inner();
}

#[test]
fn probe_pool_allocator_driver_error_on_alloc_without_driver() {
    if !no_driver() {
        return;
    }
    probe_pool_allocator_driver_error_on_alloc_without_driver_inner();
}

#[test]
fn probe_pool_allocator_driver_error_on_free_without_driver() {
    if !no_driver() {
        return;
    }
    probe_pool_allocator_driver_error_on_free_without_driver_inner();
}

fn probe_pool_allocator_driver_error_on_alloc_without_driver_inner() {
    let a = Allocator::sim(SimDevice::new(64 * MIB));
    let pool =
        MemPool::on(&a, PoolOptions::new().allocator(DriverRefuser { frees: AtomicUsize::new(0), alloc_fails: true }))
            .unwrap();
    let r = catch_unwind(AssertUnwindSafe(|| pool.alloc::<u8>(MIB).map(drop)));
    let after = catch_unwind(AssertUnwindSafe(|| a.alloc::<u8>(MIB).map(drop)));
    let stats = a.memory_stats();
    assert!(
        matches!(r, Ok(Err(Error::PoolAllocator { .. }))),
        "pool.alloc with a driver refusal: {} (Err(Any) = it panicked); allocator afterwards: {:?}; stats: reserved {}",
        match &r {
            Ok(x) => format!("{:?}", x.as_ref().map_err(|e| e.to_string())),
            Err(_) => "panicked".into(),
        },
        after.is_ok(),
        stats.reserved_bytes.all.current
    );
}

fn probe_pool_allocator_driver_error_on_free_without_driver_inner() {
    let a = Allocator::sim(SimDevice::new(64 * MIB));
    let src = Arc::new(DriverRefuser { frees: AtomicUsize::new(0), alloc_fails: false });
    struct Shared(Arc<DriverRefuser>);
    // SAFETY: forwards to the inner allocator.
    unsafe impl RawAllocator for Shared {
        fn name(&self) -> &str {
            self.0.name()
        }
        fn alloc(&self, s: usize, d: usize, st: StreamId) -> Result<u64, BackendError> {
            self.0.alloc(s, d, st)
        }
        unsafe fn free(&self, p: u64, s: usize, d: usize, st: StreamId) -> Result<(), BackendError> {
            // SAFETY: forwarded.
            unsafe { self.0.free(p, s, d, st) }
        }
    }
    let pool = MemPool::on(&a, PoolOptions::new().allocator(Shared(src.clone()))).unwrap();
    drop(pool.alloc::<u8>(MIB).unwrap());
    let before = pool.snapshot().segments.len();
    let r = catch_unwind(AssertUnwindSafe(|| pool.empty_cache()));
    let segs = pool.snapshot().segments.len();
    let reserved = pool.memory_stats().reserved_bytes.current;
    // A failed free keeps the segment (the contract: it was not given back).
    assert!(
        matches!(r, Ok(Err(_))) && segs == before,
        "empty_cache with a refused free: panicked={} result={:?}; segments before {before}, after {segs}, \
         reserved {reserved}, frees tried {}",
        r.is_err(),
        r.as_ref().ok().map(|x| x.as_ref().map_err(|e| e.to_string())),
        src.frees.load(Ordering::Relaxed)
    );
}
