//! Hostile review (helper-40, session 13) of aa26300 (a settle is one step for readers: a
//! per-thread sequence number, `ThreadStats::seq`) and 1fb22be (a reader in a fork child reads
//! through a step a parent's thread left open: `seq_gen`). Sim backend only.
//!
//! Findings are the tests named `finding_…`; the others are probes that pass (kept because they
//! probe something the commits rely on). Iterations: `R13_ITERS` scales the loops.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::procs::{fork_and_wait, Ended};
use common::{check_invariants, Rng};
use mempool::sim::SimDevice;
use mempool::{Allocator, Buffer, MemPool, MemoryStats, PoolOptions, Sim};

fn setup() -> (Arc<SimDevice>, Allocator<Sim>) {
    let sim = SimDevice::new(1 << 34);
    (sim.clone(), Allocator::sim(sim))
}

fn iters(n: usize) -> usize {
    std::env::var("R13_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(n)
}

fn spin_for(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// The totals (allocated) of the entries a thread cache moves, in one read.
fn totals(s: &MemoryStats) -> [u64; 6] {
    [
        s.allocation.all.allocated,
        s.allocation.small_pool.allocated,
        s.allocated_bytes.all.allocated,
        s.requested_bytes.all.allocated,
        s.active.all.allocated,
        s.active_bytes.all.allocated,
    ]
}

// ------------------------------------------------------------------------------------------
// A. Totals read by a sum while the owner folds its deferred record's take-backs into
// `elided` (`ThreadStats::defer` -> `fold_def_hits`): not a step (no `seq` bump), and the sum
// reads `def_hits` before `elided` (`add_into_now`), the fold writes `elided` before zeroing
// `def_hits`. A sum that reads the old `def_hits` and the new `elided` counts the record's
// take-backs twice: `allocation.allocated` one too high, and the next read lower (a total that
// goes down).
// ------------------------------------------------------------------------------------------

#[test]
fn finding_a_totals_go_down_when_a_sum_races_a_fold_of_take_backs() {
    let (_sim, a) = setup();
    let stop = Arc::new(AtomicBool::new(false));
    // Allocations the writer has seen returned (after each returns).
    let made = Arc::new(AtomicU64::new(0));
    let w = {
        let (a, stop, made) = (a.clone(), stop.clone(), made.clone());
        std::thread::spawn(move || {
            // Two sizes freed and taken back in turn: every free is deferred (the previous one
            // was taken back, so nothing is settled) and changes the record's figures, so it
            // folds the previous record's one take-back into `elided`.
            let mut x = a.alloc::<u8>(512).unwrap();
            made.fetch_add(1, Ordering::Release);
            let mut y = a.alloc::<u8>(1024).unwrap();
            made.fetch_add(1, Ordering::Release);
            while !stop.load(Ordering::Relaxed) {
                drop(x);
                x = a.alloc::<u8>(512).unwrap();
                made.fetch_add(1, Ordering::Release);
                drop(y);
                y = a.alloc::<u8>(1024).unwrap();
                made.fetch_add(1, Ordering::Release);
            }
            drop((x, y));
        })
    };
    while made.load(Ordering::Acquire) < 100 {
        std::thread::yield_now();
    }
    let deadline = Instant::now() + Duration::from_secs(iters(6) as u64);
    let mut last = totals(&a.memory_stats());
    let (mut reads, mut down, mut over) = (0u64, Vec::new(), Vec::new());
    while Instant::now() < deadline && down.len() < 5 {
        let s = a.memory_stats();
        let after = made.load(Ordering::Acquire);
        let t = totals(&s);
        reads += 1;
        for k in 0..t.len() {
            if t[k] < last[k] {
                down.push((reads, k, last[k], t[k]));
            }
        }
        // At most one allocation in flight besides those seen returned.
        if s.allocation.all.allocated > after + 1 {
            over.push((reads, after, s.allocation.all.allocated));
        }
        last = t;
    }
    stop.store(true, Ordering::Relaxed);
    w.join().unwrap();
    eprintln!("reads {reads}; totals that went down: {down:?}; counted over made+1: {over:?}");
    assert!(
        down.is_empty() && over.is_empty(),
        "(read, field, before, after): {down:?}; (read, made, counted): {over:?}"
    );
}

// ------------------------------------------------------------------------------------------
// B. Peaks below the true maximum: `Board::reset_peaks` sums (leaving each deferred block out),
// then, in a second pass, marks the threads that hold a deferred record *now*
// (`def_clipped`). A thread that takes its deferred block back between the sum and the marking
// (the elided path of `Owner::take`, no lock, no step) is not marked: its reuse checks no peak,
// and the new peak never counts the block. Same pattern in `Board::census` (reads, then marks
// `t.deferred(i) != 0`).
//
// Main holds z (counted at the reset); each worker frees its block (deferred) and takes it
// back at random times around the reset. After the last barrier every worker holds its block
// and main still holds z: N + 1 blocks allocated, after the reset returned. Main then frees z
// and reads: the allocation peak must be at least N + 1.
// (With every take-back forced through the checked path, a few rounds in thousands still fail:
// a census a take-back sets off between the reset's sum and its `peak.store(now)` is
// overwritten by that store: the same window, another door.)
// ------------------------------------------------------------------------------------------

// Fixed in part (session 13): the reset marks before and after its sum, sums twice, holds the
// members' lock throughout (a census stores its peak under it), and marks every member to
// recheck before its next rise: 72 to 111 short peaks in 2,000 rounds before, 11 to 19 after.
// What remains is the known gap of threads taking turns within their slack (RELIABILITY.md).
#[test]
#[ignore = "known gap (RELIABILITY.md, peaks when threads take turns with cached blocks): 11 to 19 short peaks in 2,000 rounds"]
fn finding_b_reset_marks_deferred_threads_after_its_sum_peak_misses_a_take_back() {
    let (_sim, a) = setup();
    const N: usize = 2;
    let rounds = iters(2000);
    let bar = Arc::new(Barrier::new(N + 1));
    let resetting = Arc::new(AtomicBool::new(false));
    let hs: Vec<_> = (0..N)
        .map(|t| {
            let (a, bar, resetting) = (a.clone(), bar.clone(), resetting.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t as u64 + 1) * 0x1234_5678));
                let mut x = a.alloc::<u8>(512).unwrap();
                for _ in 0..rounds {
                    bar.wait(); // A
                                // Free (deferred) and take back, over and over while the reset runs.
                    while resetting.load(Ordering::Acquire) {
                        let r = rng.next();
                        drop(x);
                        spin_for(Duration::from_nanos(r % 1_500));
                        x = a.alloc::<u8>(512).unwrap();
                        spin_for(Duration::from_nanos((r >> 20) % 1_500));
                    }
                    bar.wait(); // B: every worker holds x
                    bar.wait(); // C: main has read
                }
                drop(x);
            })
        })
        .collect();
    let mut bad = Vec::new();
    let mut took = Duration::ZERO;
    for round in 0..rounds {
        let z = a.alloc::<u8>(4096).unwrap();
        resetting.store(true, Ordering::Release);
        bar.wait(); // A
        spin_for(Duration::from_micros(3));
        let t0 = Instant::now();
        a.reset_peak_stats();
        took += t0.elapsed();
        resetting.store(false, Ordering::Release);
        bar.wait(); // B: N + 1 allocated now, after the reset
        drop(z);
        let s = a.memory_stats();
        if s.allocation.all.peak < (N + 1) as i64 || s.requested_bytes.all.peak < (N * 512 + 4096) as i64 {
            bad.push((round, s.allocation.all.peak, s.requested_bytes.all.peak, s.allocation.all.current));
        }
        bar.wait(); // C
    }
    for h in hs {
        h.join().unwrap();
    }
    eprintln!(
        "rounds {rounds} (reset {:?} on average), short peaks {}: {:?}",
        took / rounds as u32,
        bad.len(),
        &bad[..bad.len().min(10)]
    );
    assert!(
        bad.is_empty(),
        "(round, allocation peak, requested peak, current) want >= {} / {}: {bad:?}",
        N + 1,
        N * 512 + 4096
    );
}

// ------------------------------------------------------------------------------------------
// C. fork() while a worker settles deferred frees (steps) all the time: each child reads the
// statistics under an alarm (a step the parent's worker left open must be read through, not
// waited on: 1fb22be), then compares them with its snapshot (a fork inside any of the
// worker's unlocked counter updates, a step or not, leaves the child's counters off for good:
// counted, not asserted). PROBE: passes (no child hung).
// ------------------------------------------------------------------------------------------

fn is_child(name: &str) -> bool {
    std::env::var("REVIEW13_CHILD").is_ok_and(|v| v == name)
}

#[test]
fn probe_c_fork_children_never_hang_on_a_step_left_open() {
    const NAME: &str = "probe_c_fork_children_never_hang_on_a_step_left_open";
    if !is_child(NAME) {
        let (code, _, out) =
            common::procs::run_test_child("REVIEW13_CHILD", NAME, &[], Duration::from_secs(120), |c| {
                c.env_remove("MEMPOOL_NO_MEMBARRIER");
            });
        let line = out.find("CHILD-RESULT").map_or("none", |i| out[i..].lines().next().unwrap()).to_string();
        eprintln!("{line}");
        assert!(code == Some(0) && line.contains("hung=0"), "exit {code:?}: {out}");
        return;
    }
    let (_sim, a) = setup();
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(AtomicBool::new(false));
    let w = {
        let (a, stop, ready) = (a.clone(), stop.clone(), ready.clone());
        std::thread::spawn(move || {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                // Three sizes in turn: a deferred free not taken back is settled at the next
                // free (a step), and every 65th free is deferred again.
                drop(a.alloc::<u8>(512 * (1 + i % 3)).unwrap());
                i += 1;
                if i == 1000 {
                    ready.store(true, Ordering::Release);
                }
            }
        })
    };
    while !ready.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (mut hung, mut off, mut forks) = (0u32, 0u32, 0u32);
    for _ in 0..iters(300) {
        // SAFETY: the child calls the allocator (no lock of it is held by the worker, whose
        // calls are cache hits or settles between its rare locked calls; a fork inside one
        // is possible and would show as a hang too).
        let ended = unsafe {
            fork_and_wait(3, || {
                std::panic::set_hook(Box::new(|_| {}));
                let s = a.memory_stats();
                let snap = a.snapshot();
                let ok =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| common::check_stats(&snap, &s))).is_ok();
                if ok {
                    0
                } else {
                    7
                }
            })
        };
        forks += 1;
        match ended {
            Ended::Hung => hung += 1,
            Ended::Exited(7) => off += 1,
            _ => {}
        }
    }
    stop.store(true, Ordering::Relaxed);
    w.join().unwrap();
    println!("CHILD-RESULT hung={hung} off={off} forks={forks}");
}

// ------------------------------------------------------------------------------------------
// D. Readers that take the members' lock and wait on steps (memory_stats, reset_peak_stats,
// a pool's stats, empty_cache, the solo census of a thread alone) against settling threads
// that come and go (exit with a deferred block, panic between calls), under a watchdog; at the
// end, the statistics agree with the snapshot. PROBE: passes (no hang, exact at the end).
// ------------------------------------------------------------------------------------------

#[test]
fn probe_d_readers_and_settling_threads_never_deadlock() {
    let (sim, a) = setup();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    {
        let done = done.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            while !done.load(Ordering::Relaxed) {
                if t.elapsed() > Duration::from_secs(60) {
                    eprintln!("probe_d: hung for 60 s");
                    std::process::abort();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
    }
    let readers: Vec<_> = (0..2)
        .map(|r| {
            let (a, pool, stop) = (a.clone(), pool.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    match (n + r) % 5 {
                        0 => drop(a.memory_stats()),
                        1 => a.reset_peak_stats(),
                        2 => drop(pool.memory_stats()),
                        3 => a.empty_cache().unwrap(),
                        _ => drop(a.snapshot()),
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    let t0 = Instant::now();
    let mut gens = 0;
    while t0.elapsed() < Duration::from_secs(iters(4) as u64) {
        let hs: Vec<_> = (0..2)
            .map(|t| {
                let (a, pool) = (a.clone(), pool.clone());
                std::thread::spawn(move || {
                    let mut keep: Vec<Buffer<u8, Sim>> = Vec::new();
                    for i in 0..3000usize {
                        let n = 512 * (1 + (i + t) % 3);
                        if i % 7 == 0 {
                            drop(pool.alloc::<u8>(n).unwrap());
                        } else {
                            drop(a.alloc::<u8>(n).unwrap());
                        }
                        if i % 101 == 0 {
                            keep.push(a.alloc::<u8>(n).unwrap());
                        }
                    }
                    if t == 1 && gens % 3 == 0 {
                        // Exits by a panic, its last free deferred (unwinding drops `keep`).
                        drop(a.alloc::<u8>(1536).unwrap());
                        std::panic::resume_unwind(Box::new("worker panics on purpose"));
                    }
                    drop(a.alloc::<u8>(1024).unwrap()); // exits with a deferred free
                })
            })
            .collect();
        for h in hs {
            let _ = h.join();
        }
        gens += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
    done.store(true, Ordering::Relaxed);
    let s = a.memory_stats();
    eprintln!("worker generations {gens}, reads {reads}");
    assert_eq!(s.allocation.all.current, 0);
    assert_eq!(s.requested_bytes.all.current, 0);
    check_invariants(&a, Some(&sim));
    let p = pool.memory_stats();
    assert_eq!(p.allocation.current, 0);
}

// ------------------------------------------------------------------------------------------
// E. Reader latency while threads settle as often as they can: the seqlock reader retries
// while a step overlaps its read and sleeps (up to 1 ms) after 80 tries, holding the
// members' lock and, in `memory_stats`, the allocator's state lock. PROBE: passes (the worst
// memory_stats stays far below a second).
// ------------------------------------------------------------------------------------------

#[test]
fn probe_e_reader_not_starved_by_settling_threads() {
    let (_sim, a) = setup();
    let stop = Arc::new(AtomicBool::new(false));
    let ws: Vec<_> = (0..2)
        .map(|t| {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    drop(a.alloc::<u8>(512 * (1 + i % 3)).unwrap());
                    i += 1;
                }
            })
        })
        .collect();
    let t0 = Instant::now();
    let (mut worst, mut n) = (Duration::ZERO, 0u32);
    while t0.elapsed() < Duration::from_secs(iters(3) as u64) {
        let t = Instant::now();
        let _ = a.memory_stats();
        a.reset_peak_stats();
        worst = worst.max(t.elapsed());
        n += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for w in ws {
        w.join().unwrap();
    }
    eprintln!("{n} reads, worst {worst:?}");
    assert!(worst < Duration::from_millis(500), "worst read {worst:?}");
}
