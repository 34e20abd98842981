//! Second hostile review: the background event thread after commit 462fb46 ("holds no
//! reference to the allocator ... a look lets the lock go without running the outbox"), on
//! `SimDevice::pinned` (no GPU). Tests named for a finding pass once it was fixed (or made the
//! documented behaviour); `held_*` tests checked what held.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{check_invariants, eventually, pinned_sim};
use mempool::{trace, MemPool, PoolOptions};

const MIB: usize = 1 << 20;
const BG: &str = "pinned_use_background_threads:True,thread_cache:False";

/// Was a finding (low), now the documented behaviour: with `pinned_use_background_threads`, a
/// look of the event thread runs no user code, so what it queues (the segment free of a
/// `no_cache` pool's block it filed, a released pool's last segment, the `FreeCompleted`
/// events for trace hooks) goes out with the next call on the allocator (any call: an
/// allocation, statistics, `empty_cache`), or at its drop; without the thread the block itself
/// waited for the next allocation. Here: the stream completes, the thread files the blocks, and
/// one call later every segment is back and the hook has seen every `FreeCompleted`.
#[test]
fn work_a_look_queues_goes_out_with_the_next_call() {
    let (sim, a) = pinned_sim(1 << 30, BG);
    let mine = a.id();
    let completed = Arc::new(AtomicUsize::new(0));
    let seen = completed.clone();
    let _hook = trace::attach(move |e| {
        if e.allocator == mine && e.action == trace::Action::FreeCompleted {
            seen.fetch_add(1, Ordering::SeqCst);
        }
    })
    .unwrap();
    let no_cache = MemPool::on(&a, PoolOptions::new().no_cache(true)).unwrap();
    let released = MemPool::on(&a, PoolOptions::new()).unwrap();
    let s = sim.new_stream();
    let on = a.set_stream(&s).unwrap();
    let x = no_cache.alloc::<u8>(4 * MIB).unwrap();
    let y = released.alloc::<u8>(4 * MIB).unwrap();
    let z = a.alloc::<u8>(4 * MIB).unwrap();
    for b in [&x, &y, &z] {
        let _ = b.device_ptr_raw(); // the device used them: their frees wait for stream `s`
    }
    drop(on);
    drop(released);
    drop((x, y, z));
    assert_eq!(sim.live_segments().len(), 3, "held until the stream is done");
    sim.complete_stream(s);
    // The thread files the three blocks (the state says so without a call that delivers).
    assert!(eventually(|| a
        .snapshot()
        .segments
        .iter()
        .all(|g| g.blocks.iter().all(|b| b.state != mempool::BlockState::AwaitingStreams))));
    let _ = a.memory_stats(); // the next call
    assert_eq!(sim.live_segments().len(), 1, "the no_cache and released pools' segments went back");
    assert_eq!(completed.load(Ordering::SeqCst), 3, "every FreeCompleted reached the hook");
    drop(no_cache);
    check_invariants(&a, Some(&sim));
}

/// Held: a look under way while another thread runs `empty_cache`, the out-of-memory ladder
/// and allocations on many streams, then the last handle dropped: no deadlock, exact
/// statistics, nothing left.
#[test]
fn held_looks_against_empty_cache_and_the_oom_ladder() {
    let (sim, a) = pinned_sim(64 * MIB, BG);
    let streams: Vec<_> = (0..4).map(|_| sim.new_stream()).collect();
    std::thread::scope(|sc| {
        for (t, s) in streams.iter().enumerate() {
            let (a, sim) = (&a, &sim);
            sc.spawn(move || {
                for i in 0..200usize {
                    let on = a.set_stream(s).unwrap();
                    // Some fail (the ladder runs, empty_cache included).
                    if let Ok(x) = a.alloc::<u8>(MIB * (1 + (i + t) % 24)) {
                        let _ = x.device_ptr_raw();
                        drop(x);
                    }
                    drop(on);
                    if i % 7 == t {
                        sim.complete_stream(*s);
                    }
                    if i % 11 == 0 {
                        a.empty_cache().unwrap();
                    }
                }
            });
        }
    });
    sim.complete_all();
    assert!(eventually(|| a.memory_stats().active_bytes.all.current == 0));
    check_invariants(&a, Some(&sim));
    drop(a);
    assert!(sim.live_segments().is_empty());
}

/// Held: the process for the event thread's panic path is not reachable from safe code here
/// (nothing a look runs panics); a failing event query (the backend's error) is kept for the
/// next call and the thread keeps going: the block is filed once the query works again.
#[test]
fn held_a_failing_event_query_on_the_thread_is_reported_and_retried() {
    let (sim, a) = pinned_sim(1 << 30, BG);
    let s = sim.new_stream();
    sim.fail_next_event_queries(3);
    let on = a.set_stream(&s).unwrap();
    let x = a.alloc::<u8>(4 * MIB).unwrap();
    let _ = x.device_ptr_raw();
    drop(x);
    drop(on);
    sim.complete_stream(s);
    std::thread::sleep(Duration::from_millis(50));
    assert!(eventually(|| a.memory_stats().active_bytes.all.current == 0));
    check_invariants(&a, Some(&sim));
}

/// Held (suspected, not shown): with thread caches on (the default), an allocation served by
/// this thread's cache takes no lock, and `has_work` is looked at only by `unlock` and
/// `drain_caches`; the suspicion was that a program whose allocations are all cache hits
/// (pinned buffers the device never used) never runs the work a look queued. It does: the
/// `no_cache` segment the event thread freed goes back while the program keeps allocating.
#[test]
fn held_work_a_look_queued_is_run_while_the_program_keeps_allocating() {
    let (sim, a) = pinned_sim(1 << 30, "pinned_use_background_threads:True");
    // Warm this thread's cache with a host-only buffer.
    drop(a.alloc::<u8>(1000).unwrap());
    let pool = MemPool::on(&a, PoolOptions::new().no_cache(true)).unwrap();
    let s = sim.new_stream();
    let on = a.set_stream(&s).unwrap();
    let x = pool.alloc::<u8>(4 * MIB).unwrap();
    let seg = x.device_ptr_raw();
    drop(x);
    drop(on);
    sim.complete_stream(s);
    let held = |sim: &mempool::sim::SimDevice| sim.live_segments().iter().any(|&(addr, _)| addr == seg);
    let since = std::time::Instant::now();
    let mut calls = 0u64;
    while held(&sim) && since.elapsed() < Duration::from_secs(3) {
        // The program goes on: host-only pinned buffers, served by the thread cache.
        let b = a.alloc::<u8>(1000).unwrap();
        drop(b);
        calls += 1;
    }
    assert!(
        !held(&sim),
        "after {calls} allocations over 3 s the no_cache segment the event thread freed is still taken"
    );
}
