//! The synchronisation primitives of the thread caches and their statistics: std's, or loom's
//! when the crate is built with `--cfg loom` for model checking (`mempool/tests/README` and
//! `caching::tcache`'s loom tests).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicI64, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicI64, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

/// This process's fork generation: 1 in the first process, more in each child once a thread
/// cache was made (a `pthread_atfork` child handler, registered by `caching::asym`, counts
/// it). Plain std atomics under loom too: a process-wide fact, not part of a model.
static FORK_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

#[inline(always)]
pub(crate) fn fork_generation() -> u64 {
    FORK_GENERATION.load(std::sync::atomic::Ordering::Relaxed)
}

/// A fork child's handler: one generation more (an atomic add, async-signal-safe).
#[allow(dead_code)] // (not on targets without `pthread_atfork`, nor under loom or Miri)
pub(crate) fn count_fork() {
    FORK_GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// The `spins`-th wait (from 1) for another thread that is inside a few instructions but may
/// be switched out there: a short spin, a few yields, then sleeps from 1 us doubling to 1 ms.
/// Not yields alone: a yield gives the processor only to threads of the caller's priority, so a
/// real-time waiter on the other thread's processor would spin until the kernel throttled it.
/// (Under loom, a yield: its models must let the other thread run.)
#[cold]
pub(crate) fn back_off(spins: u32) {
    #[cfg(loom)]
    {
        let _ = spins;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    if spins < 64 {
        std::hint::spin_loop();
    } else if spins < 80 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(std::time::Duration::from_micros(1 << (spins - 80).min(10)));
    }
}
