//! Thread caches and trace hooks: while a hook or the history is active, every allocation and
//! free reaches it (the caches stand aside); blocks cached before a hook was attached report
//! their free when they leave the cache. Its own binary: the hooks are process-wide.

mod common;

use mempool::sim::SimDevice;
use mempool::trace::Action;
use mempool::Allocator;

#[test]
fn hooks_see_every_allocation_and_free() {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    // Cached before any hook.
    let early = a.alloc::<u8>(8192).unwrap();
    let early_addr = early.device_ptr_raw();
    drop(early);
    let (hook, seen) = common::record_events(&a);
    for _ in 0..3 {
        drop(a.alloc::<u8>(4096).unwrap());
    }
    let count = |act: Action| seen.lock().unwrap().iter().filter(|(x, _)| *x == act).count();
    assert_eq!((count(Action::Alloc), count(Action::FreeRequested), count(Action::FreeCompleted)), (3, 3, 3));
    // The early block leaves its cache (a snapshot takes every cached block): its free arrives.
    let _ = a.snapshot();
    let frees_of_early =
        seen.lock().unwrap().iter().filter(|(x, addr)| *x == Action::FreeCompleted && *addr == early_addr).count();
    assert_eq!(frees_of_early, 1);
    drop(hook);
    // Hooks gone: caching again, and the allocator's state still exact.
    drop(a.alloc::<u8>(4096).unwrap());
    let s = a.memory_stats();
    assert_eq!((s.allocation.all.current, s.allocated_bytes.all.current), (0, 0));
    a.empty_cache().unwrap();
    assert!(sim.live_segments().is_empty());
}
