//! Second hostile review of parked frees after de1d89e. Findings, fixed: a thread whose locals
//! are gone (a thread-local destructor running after the allocator's) has no cache, so it was
//! not counted live and never ran the joiner's drain, and its best fit missed blocks parked by
//! another thread (`exiting_thread_misses_parked_block`) or by itself before its cache was
//! dropped (`one_thread_exit_destructor_misses_own_parked_block`): a locked call without a
//! cache now files every parked block first. `parking_against_churning_threads` held up.
mod common;

use common::check_invariants;
use mempool::sim::SimDevice;
use mempool::{Allocator, Config};
use std::sync::mpsc::{channel, Receiver, Sender};

const MIB: usize = 1 << 20;
const KIB: usize = 1 << 10;

/// The P2 sequence of review_park.rs, the other thread allocating from a thread-local
/// destructor that runs after the allocator's own thread-locals are gone (the thread had a
/// cache: `live` went 2 -> 1 when it was dropped, so the first thread parks again, while the
/// exiting thread still allocates under the lock, with no cache and no drain).
fn exiting_thread_turns(cache: bool, expandable: bool) -> (i64, i64) {
    let sim = SimDevice::new(1 << 30);
    let cfg = Config::builder().thread_cache(cache).expandable_segments(expandable).build().unwrap();
    let a = Allocator::sim_with(sim.clone(), cfg);
    let (to_t1, from_t2): (Sender<()>, Receiver<()>) = channel();
    let (to_t2, from_t1): (Sender<()>, Receiver<()>) = channel();
    let (stats_tx, stats_rx) = channel::<(i64, i64)>();
    let a1 = a.clone();
    let t1 = std::thread::spawn(move || {
        let x = a1.alloc::<u8>(6 * MIB).unwrap();
        let c = a1.alloc::<u8>(13 * MIB + 512 * KIB).unwrap();
        let y = a1.alloc::<u8>(2 * MIB).unwrap();
        to_t2.send(()).unwrap(); // t2 may start
        from_t2.recv().unwrap(); // t2 is exiting, its cache gone
        drop(c); // parked: this thread is the one live cache again
        to_t2.send(()).unwrap();
        from_t2.recv().unwrap(); // t2 done
        drop((x, y));
    });
    let a2 = a.clone();
    let t2 = std::thread::spawn(move || {
        from_t1.recv().unwrap();
        let a3 = a2.clone();
        // Registered before the allocator's thread-locals: destroyed after them.
        common::at_exit(move || {
            to_t1.send(()).unwrap();
            from_t1.recv().unwrap();
            let d = a3.alloc::<u8>(12 * MIB).unwrap();
            let e = a3.alloc::<u8>(17 * MIB).unwrap();
            let s = a3.memory_stats();
            stats_tx.send((s.segment.all.peak, s.reserved_bytes.all.peak)).unwrap();
            drop((d, e));
            to_t1.send(()).unwrap();
        });
        // This thread's cache of the allocator (made now, so dropped before AT_EXIT).
        drop(a2.alloc::<u8>(512).unwrap());
    });
    t2.join().unwrap();
    t1.join().unwrap();
    let r = stats_rx.recv().unwrap();
    check_invariants(&a, Some(&sim));
    r
}

/// F1: a thread allocating after its thread-locals are gone (a thread-local destructor) has
/// no cache, so it is not counted in `live` and never drains: another thread keeps parking,
/// and this thread's best fit misses the parked block.
#[test]
fn exiting_thread_misses_parked_block() {
    let without = exiting_thread_turns(false, false);
    assert_eq!(
        exiting_thread_turns(true, false),
        without,
        "(segments, reserved bytes) peaks, caches on (left) / off (right)"
    );
}

#[test]
fn exiting_thread_misses_parked_block_expandable() {
    let without = exiting_thread_turns(false, true);
    assert_eq!(
        exiting_thread_turns(true, true),
        without,
        "(segments, reserved bytes) peaks, caches on (left) / off (right)"
    );
}

/// One thread: its parked block stays in its (now orphaned) cache when its thread-locals are
/// destroyed; its own later allocation from a thread-local destructor (no cache, under the
/// lock) misses it. Single-threaded placement differs from `thread_cache:False`.
fn one_thread_exiting(cache: bool, expandable: bool) -> (i64, i64) {
    let sim = SimDevice::new(1 << 30);
    let cfg = Config::builder().thread_cache(cache).expandable_segments(expandable).build().unwrap();
    let a = Allocator::sim_with(sim.clone(), cfg);
    let (stats_tx, stats_rx) = channel::<(i64, i64)>();
    let a1 = a.clone();
    std::thread::spawn(move || {
        common::at_exit_first(); // registered first: destroyed after the allocator's locals
        let x = a1.alloc::<u8>(6 * MIB).unwrap();
        let c = a1.alloc::<u8>(13 * MIB + 512 * KIB).unwrap();
        let y = a1.alloc::<u8>(2 * MIB).unwrap();
        drop(c); // parked
        let a3 = a1.clone();
        common::at_exit(move || {
            let d = a3.alloc::<u8>(12 * MIB).unwrap();
            let e = a3.alloc::<u8>(17 * MIB).unwrap();
            let s = a3.memory_stats();
            stats_tx.send((s.segment.all.peak, s.reserved_bytes.all.peak)).unwrap();
            drop((d, e, x, y));
        });
    })
    .join()
    .unwrap();
    let r = stats_rx.recv().unwrap();
    check_invariants(&a, Some(&sim));
    r
}

/// F2: as F1 on one thread (its own parked block, its cache orphaned by its exit).
#[test]
fn one_thread_exit_destructor_misses_own_parked_block() {
    let got: Vec<_> = [false, true].map(|e| (e, one_thread_exiting(true, e), one_thread_exiting(false, e))).into();
    assert!(
        got.iter().all(|(_, w, wo)| w == wo),
        "(expandable, caches on, caches off): (segments, reserved bytes) peaks {got:?}"
    );
}

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Probe: one long-lived parking thread against threads that come and go (each joins, drains
/// at its first locked call, exits), and drains: no block handed out twice, nothing lost.
#[test]
fn parking_against_churning_threads() {
    for expandable in [false, true] {
        let sim = SimDevice::new(4 << 30);
        let cfg = Config::builder().expandable_segments(expandable).build().unwrap();
        let a = Allocator::sim_with(sim.clone(), cfg);
        let live = Arc::new(Mutex::new(BTreeMap::<u64, usize>::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let check = |live: &Mutex<BTreeMap<u64, usize>>, p: u64, size: usize| {
            let mut l = live.lock().unwrap();
            if let Some((&q, &qn)) = l.range(..p + size as u64).next_back() {
                assert!(q + qn as u64 <= p, "block {p:#x}+{size} overlaps live {q:#x}+{qn}");
            }
            l.insert(p, size);
        };
        let mut rng = common::Rng(7);
        let parker = {
            let (a, live, stop) = (a.clone(), live.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = common::Rng(11);
                let mut held = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) || i < 20_000 {
                    let size = [19 * MIB + 512 * KIB, 13 * MIB + 512 * KIB, 3 * MIB + 7][rng.below(3) as usize];
                    let b = a.alloc::<u8>(size).unwrap();
                    check(&live, b.device_ptr_raw(), size);
                    held.push((b, size));
                    if held.len() > 2 {
                        let (b, _) = held.swap_remove(rng.below(3) as usize);
                        live.lock().unwrap().remove(&b.device_ptr_raw());
                        drop(b);
                    }
                    i += 1;
                }
                for (b, _) in held {
                    live.lock().unwrap().remove(&b.device_ptr_raw());
                }
            })
        };
        for k in 0..400 {
            let (a2, live2) = (a.clone(), live.clone());
            let n = 1 + rng.below(4) as usize;
            let t = std::thread::spawn(move || {
                for j in 0..n {
                    let size = 12 * MIB + j * 4097;
                    let b = a2.alloc::<u8>(size).unwrap();
                    check(&live2, b.device_ptr_raw(), size);
                    live2.lock().unwrap().remove(&b.device_ptr_raw());
                    drop(b);
                }
            });
            if k % 50 == 0 {
                a.empty_cache().unwrap();
            }
            t.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        parker.join().unwrap();
        check_invariants(&a, Some(&sim));
        a.empty_cache().unwrap();
        let s = a.memory_stats();
        assert_eq!(
            (s.reserved_bytes.all.current, s.allocated_bytes.all.current, s.inactive_split.all.current),
            (0, 0, 0),
            "expandable {expandable}"
        );
        assert!(sim.mapped().is_empty() && sim.live_segments().is_empty());
    }
}
