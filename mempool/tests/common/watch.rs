//! Hang and panic helpers for the attack and soundness tests.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mempool::sim::SimDevice;
use mempool::{Allocator, Sim};

/// Runs `f` on its own thread; fails the test if it has not finished within `secs` (a hang;
/// the stuck thread is left behind, it holds only this test's allocator).
pub(crate) fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("HANG: {what}: still running after {secs} s"),
    }
}

/// Waits until `flag` is set, at most `secs`; whether it was.
pub(crate) fn wait_for(flag: &AtomicBool, secs: u64) -> bool {
    let end = Instant::now() + Duration::from_secs(secs);
    while !flag.load(Ordering::SeqCst) {
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// A panic payload's message, if it is a string.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default()
}

/// A simulated device of `capacity` bytes and its allocator.
pub(crate) fn sim(capacity: usize) -> (Arc<SimDevice>, Allocator<Sim>) {
    let dev = SimDevice::new(capacity);
    (dev.clone(), Allocator::sim(dev))
}
