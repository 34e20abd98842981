//! Regression tests for the ways safe code used to reach undefined behaviour, a hang or a leak
//! (RELIABILITY.md, "Soundness"). Each test names its finding. The compile-time ones (unsafe
//! traits and methods, `AnyBitPattern`) are trybuild tests in `ui-tests/tests/ui/fail/safety/`.

mod common;

use common::watch::within;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use mempool::sim::SimDevice;
use mempool::trace::{self, Action};
use mempool::{Allocator, BackendError, Error, MemPool, PoolOptions, RawAllocator, Sim, StreamId};

const MIB: usize = 1 << 20;

/// A pool allocator over made-up addresses (the simulated device never touches memory), with a
/// log of what it gave and got back, and switches to fail or panic.
#[derive(Clone, Default)]
struct Ledger {
    inner: Arc<Mutex<LedgerState>>,
}

#[derive(Default)]
struct LedgerState {
    next: u64,
    live: Vec<(u64, usize)>,
    foreign_frees: Vec<u64>,
    panic_on_free: bool,
    on_alloc: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl Ledger {
    fn state(&self) -> std::sync::MutexGuard<'_, LedgerState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

// SAFETY: only used with simulated allocators, whose memory is never read or written; the
// made-up ranges are distinct and 2 MiB aligned, each handed out once.
unsafe impl RawAllocator for Ledger {
    fn name(&self) -> &str {
        "ledger"
    }
    fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        let hook = self.state().on_alloc.clone();
        if let Some(h) = hook {
            h(); // user code that calls back into mempool, with no lock of ours held
        }
        let mut s = self.state();
        let addr = 0x7000_0000_0000 + s.next;
        s.next += (size as u64).next_multiple_of(2 * MIB as u64);
        s.live.push((addr, size));
        Ok(addr)
    }
    unsafe fn free(&self, ptr: u64, size: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        let mut s = self.state();
        if s.panic_on_free {
            drop(s);
            panic!("user free panicked");
        }
        match s.live.iter().position(|l| *l == (ptr, size)) {
            Some(i) => {
                s.live.remove(i);
            }
            None => s.foreign_frees.push(ptr),
        }
        Ok(())
    }
}

fn sim() -> (Arc<SimDevice>, Allocator<Sim>) {
    let dev = SimDevice::new(1 << 30);
    (dev.clone(), Allocator::sim(dev))
}

/// Finding 4: a forgotten scope outlived its pool; the next pool took the slot and received
/// allocations (and frees of pointers it never made), and a counter underflowed.
#[test]
fn a_forgotten_scope_of_a_dead_pool_never_reaches_the_next_pool() {
    let (dev, a) = sim();
    let first = Ledger::default();
    let pool_a = MemPool::on(&a, PoolOptions::new().allocator(first.clone())).unwrap();
    std::mem::forget(pool_a.scope());
    drop(pool_a);
    let second = Ledger::default();
    let pool_b = MemPool::on(&a, PoolOptions::new().allocator(second.clone())).unwrap();
    let x = a.alloc::<u8>(1000).unwrap(); // the dead route: the default pools
    assert_eq!(pool_b.memory_stats().allocation.current, 0, "routed into the pool that took the slot");
    assert!(second.state().live.is_empty(), "the new pool's allocator was asked for memory");
    assert_eq!(a.memory_stats().allocation.all.current, 1);
    drop(x);
    drop(pool_b);
    assert!(second.state().foreign_frees.is_empty() && first.state().foreign_frees.is_empty());
    common::check_invariants(&a, Some(&dev));
}

/// Finding 5: guards dropped out of order left the thread on a stale stream.
#[test]
fn stream_guards_end_by_identity_in_any_order() {
    let (dev, a) = sim();
    let (s1, s2) = (dev.new_stream(), dev.new_stream());
    let g1 = a.set_stream(&s1).unwrap();
    let g2 = a.set_stream(&s2).unwrap();
    drop(g1); // the outer one first
    assert_eq!(a.current_stream(), s2, "the inner guard still lives: its stream is current");
    drop(g2);
    assert_eq!(a.current_stream(), dev.default_stream(), "no guard left: the default stream");
    // A forgotten guard keeps its stream current (a leak, never a stale stream).
    std::mem::forget(a.set_stream(&s1).unwrap());
    let g = a.set_stream(&s2).unwrap();
    drop(g);
    assert_eq!(a.current_stream(), s1);
}

/// Finding 6: a hook reading the allocator (the usual "snapshot on OOM" hook) hung.
#[test]
fn a_hook_may_read_and_use_the_allocator_without_hanging() {
    within(20, "hook calling back", || {
        let (dev, a) = sim();
        let raw = a.alloc_bytes(4096).unwrap();
        let side = dev.new_stream();
        let results: Arc<Mutex<Vec<String>>> = Arc::default();
        let (a2, r2, me) = (a.clone(), results.clone(), a.id());
        let once = Arc::new(AtomicBool::new(false));
        let hook = trace::attach(move |e| {
            if e.allocator != me || e.action != Action::Oom || once.swap(true, Ordering::SeqCst) {
                return;
            }
            let mut r = r2.lock().unwrap();
            r.push(format!("stats {}", a2.memory_stats().num_ooms));
            r.push(format!("snapshot {}", a2.snapshot().segments.len()));
            r.push(format!("summary {}", a2.memory_summary().len() > 100));
            r.push(format!("pool {}", MemPool::on(&a2, PoolOptions::new()).is_ok()));
            a2.reset_peak_stats();
            r.push(format!("config {}", a2.config().memory_fraction));
            r.push(format!("take_error {}", a2.take_error().is_none()));
            r.push(format!("record {}", a2.record_stream_bytes(raw, &side).is_ok()));
            r.push(format!("alloc {}", matches!(a2.alloc::<u8>(1), Err(Error::Reentrant))));
        })
        .unwrap();
        assert!(matches!(a.alloc::<u8>(2 << 30), Err(Error::OutOfMemory(_))));
        drop(hook);
        let r = results.lock().unwrap().join(", ");
        assert_eq!(
            r,
            "stats 1, snapshot 1, summary true, pool true, config 1, take_error true, record true, alloc true"
        );
        a.free_bytes(raw).unwrap();
    });
}

/// Finding 6: hooks are global; two allocators on two threads whose hooks read each other
/// deadlocked (ABBA).
#[test]
fn hooks_of_two_allocators_reading_each_other_do_not_deadlock() {
    within(20, "ABBA", || {
        let (_, a) = sim();
        let (_, b) = sim();
        let (ida, idb) = (a.id(), b.id());
        let (a2, b2) = (a.clone(), b.clone());
        let reads = Arc::new(AtomicUsize::new(0));
        let r2 = reads.clone();
        let hook = trace::attach(move |e| {
            if e.allocator == ida {
                b2.memory_stats();
                r2.fetch_add(1, Ordering::Relaxed);
            } else if e.allocator == idb {
                a2.memory_stats();
                r2.fetch_add(1, Ordering::Relaxed);
            }
        })
        .unwrap();
        let threads: Vec<_> = [a, b]
            .into_iter()
            .map(|x| {
                std::thread::spawn(move || {
                    for i in 0..2000 {
                        drop(x.alloc::<u8>(1 + i % 5000).unwrap());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        drop(hook);
        assert!(reads.load(Ordering::Relaxed) >= 2 * 2000 * 3);
    });
}

/// Finding 7: another thread dropping the last `TraceHandle` while a callback ran made the
/// callback look like ordinary code; a buffer dropped there then locked the held mutex.
#[test]
fn a_callback_stays_a_callback_when_another_thread_detaches_every_hook() {
    within(20, "detach race", || {
        let (_, a) = sim();
        let me = a.id();
        let kept = Arc::new(Mutex::new(Some(a.alloc::<u8>(64).unwrap())));
        let (entered_tx, entered_rx) = mpsc::channel::<()>();
        let (detached_tx, detached_rx) = mpsc::channel::<()>();
        let detached_rx = Mutex::new(detached_rx);
        let (a2, k2) = (a.clone(), kept.clone());
        let verdict: Arc<Mutex<Option<bool>>> = Arc::default();
        let v2 = verdict.clone();
        let hook = trace::attach(move |e| {
            if e.allocator != me || e.action != Action::Alloc || v2.lock().unwrap().is_some() {
                return;
            }
            entered_tx.send(()).unwrap();
            detached_rx.lock().unwrap().recv().unwrap(); // every hook is detached now
            k2.lock().unwrap().take(); // a buffer dropped inside the callback
            *v2.lock().unwrap() = Some(matches!(a2.alloc::<u8>(8), Err(Error::Reentrant)));
        })
        .unwrap();
        let a3 = a.clone();
        let t = std::thread::spawn(move || drop(a3.alloc::<u8>(128).unwrap()));
        entered_rx.recv().unwrap();
        drop(hook); // from this thread, while the callback runs on the other
        detached_tx.send(()).unwrap();
        t.join().unwrap();
        assert_eq!(*verdict.lock().unwrap(), Some(true), "the callback was no longer treated as one");
        assert_eq!(a.memory_stats().allocation.all.current, 0, "the buffer dropped in the callback was lost");
    });
}

/// Finding 8: `record_stream` inside a callback returned Ok but recorded nothing, so the block
/// was reused while the other stream still used it.
#[test]
fn record_stream_inside_a_callback_is_kept() {
    let (dev, a) = sim();
    let side = dev.new_stream();
    let buf = a.alloc::<u8>(4096).unwrap();
    let addr = buf.device_ptr_raw();
    let buf = Arc::new(buf);
    let (b2, me, side2) = (buf.clone(), a.id(), side);
    let hook = trace::attach(move |e| {
        if e.allocator == me && e.action == Action::Alloc {
            b2.record_stream(&side2).unwrap();
        }
    })
    .unwrap();
    drop(a.alloc::<u8>(100).unwrap()); // an event whose callback records `side` on `buf`
    drop(hook);
    // Hooks are global: a test running beside this one may still be inside the callback (for
    // its own allocator's event) and hold the closure a moment longer.
    let mut buf = buf;
    let t = std::time::Instant::now();
    let buf = loop {
        match Arc::try_unwrap(buf) {
            Ok(b) => break b,
            Err(again) if t.elapsed() < std::time::Duration::from_secs(10) => {
                buf = again;
                std::thread::yield_now();
            }
            Err(_) => panic!("the hook's clone is never let go"),
        }
    };
    drop(buf);
    let again = a.alloc::<u8>(4096).unwrap();
    assert_ne!(again.device_ptr_raw(), addr, "reused while the recorded stream may still use it");
    dev.complete_stream(side);
    // `again` stays live: were it freed, this thread's cache (on whenever no hook is attached,
    // so when this test runs alone) would hand its block out first.
    let third = a.alloc::<u8>(4096).unwrap();
    assert_eq!(third.device_ptr_raw(), addr, "free once the recorded stream is done");
    drop(again);
}

/// Finding 9: a pool allocator's `free` panicking inside the pending-event loop lost the rest of
/// the pending list (blocks awaiting streams forever).
#[test]
fn a_panicking_pool_free_leaves_every_entry_and_counter_exact() {
    let (dev, a) = sim();
    let ledger = Ledger::default();
    let pool = MemPool::on(&a, PoolOptions::new().allocator(ledger.clone())).unwrap();
    let side = dev.new_stream();
    let x = pool.alloc::<u8>(100).unwrap();
    let y = a.alloc::<u8>(100).unwrap();
    let z = a.alloc::<u8>(100).unwrap();
    for b in [&x, &y, &z] {
        b.record_stream(&side).unwrap();
    }
    drop((x, y, z));
    ledger.state().panic_on_free = true;
    drop(pool); // released: its segment goes back once its event completes
    dev.complete_stream(side);
    drop(a.alloc::<u8>(10).unwrap()); // events processed; then the pool's free panics
    let err = a.take_error().expect("the panic is kept as the pool allocator's error");
    assert!(err.to_string().contains("panicked") && err.to_string().contains("ledger"), "{err}");
    assert_eq!(a.memory_stats().active.all.current, 0, "a block is still awaiting its stream");
    common::check_invariants(&a, Some(&dev));
    ledger.state().panic_on_free = false;
    a.empty_cache().unwrap();
    assert!(ledger.state().live.is_empty(), "the pool's segment never went back");
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
}

/// A pool allocator may call mempool: it runs with no lock of ours held.
#[test]
fn a_pool_allocator_calling_mempool_does_not_deadlock() {
    within(20, "pool allocator calling back", || {
        let (_, a) = sim();
        let ledger = Ledger::default();
        let (a2, seen) = (a.clone(), Arc::new(AtomicUsize::new(0)));
        let s2 = seen.clone();
        ledger.state().on_alloc = Some(Arc::new(move || {
            s2.fetch_add(a2.memory_stats().num_alloc_retries as usize + 1, Ordering::Relaxed);
        }));
        let pool = MemPool::on(&a, PoolOptions::new().allocator(ledger)).unwrap();
        let _x = pool.alloc::<u8>(100).unwrap();
        assert_eq!(seen.load(Ordering::Relaxed), 1);
    });
}

/// Finding 10: dropping a host or simulated allocator never returned its cached segments.
#[test]
fn dropping_an_allocator_gives_every_segment_back() {
    let dev = SimDevice::new(1 << 30);
    let a = Allocator::sim(dev.clone());
    let ledger = Ledger::default();
    {
        let pool = MemPool::on(&a, PoolOptions::new().allocator(ledger.clone())).unwrap();
        drop(pool.alloc::<u8>(100).unwrap());
        let side = dev.new_stream();
        let b = a.alloc::<u8>(30 * MIB).unwrap();
        b.record_stream(&side).unwrap();
        drop(b); // awaiting `side`: the drop waits for it
        let _leaked = a.alloc_bytes(4096).unwrap(); // never freed by its user
        drop(a.alloc::<u8>(100).unwrap());
    }
    assert!(!dev.live_segments().is_empty());
    drop(a);
    assert_eq!(dev.live_segments(), vec![], "segments outlived their allocator");
    assert!(ledger.state().live.is_empty(), "the pool's segments outlived the allocator");
}

/// Finding 11: sizes that round past the largest block tripped an assertion; a granularity that
/// is not a power of two (or overflows) panicked.
#[test]
fn bad_sizes_and_granularities_are_errors() {
    let (dev, a) = sim();
    for n in [(1usize << 40) - 1, 1 << 40, usize::MAX / 2, usize::MAX] {
        match a.alloc::<u8>(n) {
            Err(Error::OutOfMemory(r)) => assert_eq!(r.requested, n),
            other => panic!("{n} bytes: {other:?}"),
        }
        assert!(matches!(a.alloc_bytes(n), Err(Error::OutOfMemory(_))));
    }
    assert!(matches!(a.alloc::<u64>(usize::MAX / 4), Err(Error::SizeOverflow { .. })));
    for g in [0, 3, 1000, (1 << 41), usize::MAX] {
        let e = MemPool::on(&a, PoolOptions::new().granularity(g)).unwrap_err();
        assert!(e.to_string().contains("power of two"), "{g}: {e}");
    }
    common::check_invariants(&a, Some(&dev));
}

/// Finding 12: a snapshot of one allocator showed other allocators' trace entries.
#[test]
fn a_snapshot_shows_only_its_own_allocators_history() {
    mempool::record_history(10_000);
    let (_, a) = sim();
    let (_, b) = sim(); // the same device index
    drop(a.alloc::<u8>(100).unwrap());
    drop(b.alloc::<u8>(200).unwrap());
    let (sa, sb) = (a.snapshot(), b.snapshot());
    assert!(!sa.trace.is_empty() && !sb.trace.is_empty());
    assert!(sa.trace.iter().all(|e| e.allocator == a.id()), "another allocator's entries");
    assert!(sb.trace.iter().all(|e| e.allocator == b.id()), "another allocator's entries");
}
