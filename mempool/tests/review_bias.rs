//! Hostile review of the biased state lock (`caching/bias.rs`), `Board::add_g` (the solo
//! member's plain commits) and `memory_stats` under the lock. Sim backend only.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::procs::{fork_and_wait, pin_to_cpu0, Ended};
use mempool::sim::SimDevice;
use mempool::{Allocator, Config, Sim};

/// Some tests fork: the others' threads (exiting, taking slots) must not run meanwhile.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn no_cache() -> Allocator<Sim> {
    Allocator::sim_with(SimDevice::new(1 << 32), Config::builder().thread_cache(false).build().unwrap())
}

/// Found by review: the revoker spun (64 spins, then `yield_now` for ever) while the biased
/// thread was inside its section. A revoker of higher real-time priority on the same CPU as the
/// biased holder never let it run (`sched_yield` only yields to its own priority), so it spun
/// until the kernel's RT throttling let the holder finish: a stall of up to a second per
/// hand-over, a livelock without throttling. Now it sleeps after a short spin, and the holder
/// finishes at once, as with a `std::sync::Mutex`.
#[test]
fn a_realtime_revoker_lets_the_preempted_biased_holder_finish() {
    let _serial = serial();
    // SAFETY: probes whether this process may use SCHED_FIFO (root / CAP_SYS_NICE).
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs CAP_SYS_NICE");
        return;
    }
    let a = no_cache();
    let stop = Arc::new(AtomicBool::new(false));
    let holder = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            assert!(pin_to_cpu0());
            // Every alloc and free takes the lock: biased after 512 rounds.
            while !stop.load(Ordering::Relaxed) {
                drop(a.alloc::<u8>(512).unwrap());
            }
        })
    };
    let revoker = {
        let a = a.clone();
        std::thread::spawn(move || {
            assert!(pin_to_cpu0());
            let p = libc::sched_param { sched_priority: 1 };
            // SAFETY: sets this thread's policy.
            if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) } != 0 {
                // Root without CAP_SYS_NICE (a container): nothing to show here.
                return None;
            }
            let mut worst = Duration::ZERO;
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(3) && worst < Duration::from_millis(200) {
                std::thread::sleep(Duration::from_millis(5));
                let t = Instant::now();
                drop(a.alloc::<u8>(1024).unwrap());
                worst = worst.max(t.elapsed());
            }
            Some(worst)
        })
    };
    let worst = revoker.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    holder.join().unwrap();
    let Some(worst) = worst else {
        eprintln!("skipped: SCHED_FIFO refused (no CAP_SYS_NICE)");
        return;
    };
    assert!(
        worst < Duration::from_millis(200),
        "one lock took {worst:?}: the revoker spun while the holder could not run"
    );
}

/// Found by review: `reset_peak_stats` summed the threads' counters outside the state lock (the
/// race `memory_stats` had): a drain on another thread (here its `memory_stats`) filing a third
/// thread's deferred free counts the free in the drainer's counters, then clears the owner's
/// record, both under the lock; a reset summing between the two counted that free twice and set
/// the peaks one block below the value held all along, and nothing rising afterwards corrected
/// it. Now the sum is taken under the lock.
#[test]
fn reset_peak_stats_never_sets_a_peak_below_the_current_value() {
    let _serial = serial();
    const N: i64 = 8;
    let a = Allocator::sim(SimDevice::new(1 << 32));
    let round = Arc::new(AtomicU64::new(0));
    let ready = Arc::new(AtomicU64::new(0));
    let drained = Arc::new(AtomicU64::new(0));
    const ROUNDS: u64 = 1_000_000;
    // O: makes a deferred free in its cache at each round.
    let owner = {
        let (a, round, ready) = (a.clone(), round.clone(), ready.clone());
        std::thread::spawn(move || {
            for r in 1..=ROUNDS {
                while round.load(Ordering::Acquire) < r {
                    std::thread::yield_now();
                }
                if round.load(Ordering::Acquire) == u64::MAX {
                    return;
                }
                for _ in 0..100 {
                    drop(a.alloc::<u8>(1536).unwrap());
                }
                ready.store(r, Ordering::Release);
            }
        })
    };
    // X: memory_stats (a drain that files O's deferred block) at each round.
    let drainer = {
        let (a, ready, drained) = (a.clone(), ready.clone(), drained.clone());
        std::thread::spawn(move || {
            for r in 1..=ROUNDS {
                while ready.load(Ordering::Acquire) < r {
                    std::thread::yield_now();
                }
                if ready.load(Ordering::Acquire) == u64::MAX {
                    return;
                }
                let _ = a.memory_stats();
                drained.store(r, Ordering::Release);
            }
        })
    };
    let start = Instant::now();
    let mut bad = Vec::new();
    for r in 1..=ROUNDS {
        let held: Vec<_> = (0..N).map(|_| a.alloc::<u8>(512).unwrap()).collect();
        round.store(r, Ordering::Release);
        while ready.load(Ordering::Acquire) != r {
            std::thread::yield_now();
        }
        // Sweeps the reset's start across the drain's filing.
        for _ in 0..(r * 7) % 400 {
            std::hint::black_box(());
        }
        a.reset_peak_stats();
        while drained.load(Ordering::Acquire) != r {
            std::thread::yield_now();
        }
        drop(held);
        let s = a.memory_stats();
        // N blocks were held from before the reset until after it.
        if s.allocation.all.peak < N {
            bad.push((r, s.allocation.all.peak, s.allocated_bytes.all.peak));
        }
        if !bad.is_empty() || start.elapsed() > Duration::from_secs(5) {
            eprintln!("{r} rounds");
            break;
        }
    }
    round.store(u64::MAX, Ordering::Release);
    ready.store(u64::MAX, Ordering::Release);
    let _ = (owner.join(), drainer.join());
    assert!(
        bad.is_empty(),
        "peak of allocations below {N} (held throughout) after a reset: {:?} of {}",
        &bad[..bad.len().min(5)],
        bad.len()
    );
}

// ------------------------------------------------------------------------------------------
// What held: hand-overs of the bias between live threads, exiting threads, recycled slots,
// thread-local destructors, threads beyond the 64 slots, many allocators.
// ------------------------------------------------------------------------------------------

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::{Barrier, Mutex};

use common::check_invariants;
use mempool::Buffer;

type Live = Arc<Mutex<HashSet<u64>>>;

fn claim(live: &Live, b: &Buffer<u8, Sim>) {
    assert!(live.lock().unwrap().insert(b.device_ptr_raw()), "{:#x} handed out twice", b.device_ptr_raw());
}

fn unclaim(live: &Live, b: Buffer<u8, Sim>) {
    assert!(live.lock().unwrap().remove(&b.device_ptr_raw()));
    drop(b);
}

/// Takes the lock `n` times in a row (alloc and free, no thread cache), claiming each block.
fn streak(a: &Allocator<Sim>, live: &Live, n: usize, size: usize) {
    for _ in 0..n / 2 {
        let b = a.alloc::<u8>(size).unwrap();
        claim(live, &b);
        unclaim(live, b);
    }
}

struct OnExit(Allocator<Sim>, Live, Vec<Buffer<u8, Sim>>);
impl Drop for OnExit {
    fn drop(&mut self) {
        for b in self.2.drain(..) {
            unclaim(&self.1, b);
        }
        // Enough takes in a row to be biased, from a thread-local destructor (before or after
        // the slot went back, depending on which key was made first).
        streak(&self.0, &self.1, 2100, 4096);
    }
}

thread_local! {
    static EARLY: RefCell<Option<OnExit>> = const { RefCell::new(None) };
    static LATE: RefCell<Option<OnExit>> = const { RefCell::new(None) };
}

/// A long-lived thread keeps taking the lock (biased, revoked, biased again) while short-lived
/// threads take streaks long enough to be biased themselves, then exit: their slots are
/// recycled while the bias may still name them, and their thread-local destructors free and
/// take streaks before and after their slot goes back. No block is handed out twice, and the
/// state and statistics are exact at the end.
#[test]
fn held_bias_across_exiting_threads_recycled_slots_and_tls_destructors() {
    let _serial = serial();
    let sim = SimDevice::new(1 << 32);
    let a = Allocator::sim_with(sim.clone(), Config::builder().thread_cache(false).build().unwrap());
    let live: Live = Arc::new(Mutex::new(HashSet::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (a, live, stop) = (a.clone(), live.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                streak(&a, &live, 64, 512);
            }
        })
    };
    let start = Instant::now();
    let mut rounds = 0;
    while start.elapsed() < Duration::from_secs(3) {
        let threads: Vec<_> = (0..6)
            .map(|k| {
                let (a, live) = (a.clone(), live.clone());
                std::thread::spawn(move || {
                    let keep = |n| -> Vec<Buffer<u8, Sim>> {
                        (0..n)
                            .map(|_| {
                                let b = a.alloc::<u8>(1536).unwrap();
                                claim(&live, &b);
                                b
                            })
                            .collect()
                    };
                    // EARLY made before the first lock (its destructor runs after the slot
                    // went back), LATE after (before).
                    if k % 2 == 0 {
                        EARLY.with(|e| *e.borrow_mut() = Some(OnExit(a.clone(), live.clone(), Vec::new())));
                    }
                    streak(&a, &live, 2100, 2048);
                    let held = keep(3);
                    EARLY.with(|e| match &mut *e.borrow_mut() {
                        Some(e) => e.2.extend(held),
                        None => held.into_iter().for_each(|b| unclaim(&live, b)),
                    });
                    let held = keep(2);
                    LATE.with(|l| *l.borrow_mut() = Some(OnExit(a.clone(), live.clone(), held)));
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        rounds += 1;
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().unwrap();
    assert!(live.lock().unwrap().is_empty());
    check_invariants(&a, Some(&sim));
    let s = a.memory_stats();
    assert_eq!((s.allocation.all.current, s.active.all.current), (0, 0), "after {rounds} rounds");
}

/// 80 threads alive at once (more than the 64 slots), each taking streaks on a shared allocator
/// and on one of its own (biased there), while the shared one's bias moves between them.
#[test]
fn held_more_threads_than_slots_and_many_allocators() {
    let _serial = serial();
    let sim = SimDevice::new(1 << 34);
    let cfg = || Config::builder().thread_cache(false).build().unwrap();
    let shared = Allocator::sim_with(sim.clone(), cfg());
    let live: Live = Arc::new(Mutex::new(HashSet::new()));
    for _ in 0..2 {
        let all = Arc::new(Barrier::new(80));
        let threads: Vec<_> = (0..80)
            .map(|_| {
                let (shared, live, all, sim) = (shared.clone(), live.clone(), all.clone(), sim.clone());
                std::thread::spawn(move || {
                    let own = Allocator::sim_with(sim, cfg());
                    let own_live: Live = Arc::new(Mutex::new(HashSet::new()));
                    all.wait();
                    for _ in 0..4 {
                        streak(&own, &own_live, 1100, 512);
                        streak(&shared, &live, 1100, 1024);
                    }
                    all.wait();
                    let s = own.memory_stats();
                    assert_eq!(s.allocation.all.current, 0);
                    assert_eq!(s.allocation.all.allocated, 4 * 550);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
    check_invariants(&shared, Some(&sim));
    let s = shared.memory_stats();
    assert_eq!(s.allocation.all.allocated, 2 * 80 * 4 * 550);
}

/// A fork while another thread is biased (but not inside): the child's first lock revokes a
/// bias whose thread it does not have (its `busy` is clear), with a `membarrier` that the child
/// may still make (the registration is the address space's, copied by fork). The forking
/// thread biased itself keeps its bias in the child.
#[test]
fn held_fork_with_a_biased_thread_outside_its_section() {
    let _serial = serial();
    let a = no_cache();
    let (go, parked) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
    let w = {
        let (a, go, parked) = (a.clone(), go.clone(), parked.clone());
        std::thread::spawn(move || {
            for _ in 0..1100 {
                drop(a.alloc::<u8>(512).unwrap());
            }
            parked.wait();
            go.wait();
        })
    };
    parked.wait();
    for round in 0..2 {
        if round == 1 {
            // The forking thread biased too (then revoked by the child's nothing: it is the same).
            for _ in 0..1100 {
                drop(a.alloc::<u8>(512).unwrap());
            }
        }
        let child = || {
            for _ in 0..3000 {
                drop(a.alloc::<u8>(4096).unwrap());
            }
            // membarrier(PRIVATE_EXPEDITED): 0 while the registration holds (none is made with
            // `MEMPOOL_NO_MEMBARRIER`, when nobody is biased either).
            let mb = if std::env::var_os("MEMPOOL_NO_MEMBARRIER").is_some() {
                0
            } else {
                // SAFETY: a system call with a command, no flags and no CPU: it touches no memory.
                unsafe { libc::syscall(libc::SYS_membarrier, 1i32 << 3, 0u32, 0i32) }
            };
            let s = a.memory_stats();
            let ok = s.allocation.all.current == 0 && s.allocation.all.allocated >= 3000;
            if !ok {
                2
            } else if mb != 0 {
                3
            } else {
                0
            }
        };
        // SAFETY: the child calls the allocator (no lock of it is held: the worker is parked
        // outside, the main thread is here) and the membarrier system call.
        let ended = unsafe { fork_and_wait(3, child) };
        assert_eq!(ended, Ended::Exited(0), "round {round}");
    }
    go.wait();
    w.join().unwrap();
}

/// The background event thread's looks revoke the bias of a thread that keeps taking the lock
/// (its frees wait for a stream, so every look has work): blocks are never handed out twice,
/// and everything is filed and exact at the end.
#[test]
fn held_background_event_thread_against_a_biased_allocator_thread() {
    let _serial = serial();
    let (sim, a) = common::pinned_sim(1 << 32, "pinned_use_background_threads:True,thread_cache:False");
    let live: Live = Arc::new(Mutex::new(HashSet::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let s = sim.new_stream();
    let completer = {
        let (sim, stop) = (sim.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_micros(200));
                sim.complete_stream(s);
            }
        })
    };
    let workers: Vec<_> = (0..2)
        .map(|t| {
            let (a, live, s) = (a.clone(), live.clone(), s);
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let on = a.set_stream(&s).unwrap();
                while t0.elapsed() < Duration::from_secs(2) {
                    // Streaks of plain takes (biased), then one whose free waits for the stream.
                    streak(&a, &live, 1100 + 300 * t, 512 << t);
                    let b = a.alloc::<u8>(8192).unwrap();
                    claim(&live, &b);
                    let _ = b.device_ptr_raw();
                    unclaim(&live, b);
                }
                drop(on);
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    completer.join().unwrap();
    sim.complete_all();
    assert!(common::eventually(|| a.memory_stats().active_bytes.all.current == 0));
    check_invariants(&a, Some(&sim));
}

/// Found by review: the slot list was a process-wide `std::sync::Mutex`, taken by every exiting
/// thread that had locked an allocator and by every thread's first lock; a fork while other
/// threads exited could copy it locked, and the child's first lock of any allocator blocked for
/// ever. Now the free slots are bits of one atomic word. (The forking thread here never locked
/// an allocator; its child is alone, nothing else of the allocator is held.)
#[test]
fn fork_while_threads_exit_leaves_the_child_a_working_lock() {
    let _serial = serial();
    let a = no_cache();
    let start = Instant::now();
    let (mut hung, mut forks) = (0u32, 0u32);
    while start.elapsed() < Duration::from_secs(4) && hung == 0 {
        let go = Arc::new(Barrier::new(33));
        let threads: Vec<_> = (0..32)
            .map(|_| {
                let (a, go) = (a.clone(), go.clone());
                std::thread::spawn(move || {
                    drop(a.alloc::<u8>(512).unwrap()); // takes a slot
                    go.wait();
                    // ... and gives it back as it exits
                })
            })
            .collect();
        go.wait();
        for _ in 0..8 {
            // SAFETY: the child calls the allocator.
            let ended = unsafe {
                fork_and_wait(1, || {
                    drop(a.alloc::<u8>(512).unwrap());
                    0
                })
            };
            forks += 1;
            if ended == Ended::Hung {
                hung += 1;
            }
        }
        for t in threads {
            t.join().unwrap();
        }
    }
    assert_eq!(hung, 0, "{hung} of {forks} forked children hung in their first lock");
}

/// `Board::add_g`: the solo member's plain commits while threads join and exit around it
/// (solo named, unnamed, named again at each retirement; exited threads' counters absorbed
/// into `retired`, whose commits are atomic; a thread-local destructor allocating with its
/// cache gone). A lost update of `g` below the true sum would let a later climb pass the peak
/// unseen: after each round, a reset and a climb of `k` blocks above the quiescent value must
/// give a peak of exactly that value, and the counts are exact.
#[test]
fn held_solo_commits_across_joins_exits_and_retirements() {
    let _serial = serial();
    let a = Allocator::sim(SimDevice::new(1 << 34));
    let base: Vec<_> = (0..3).map(|_| a.alloc::<u8>(1 << 20).unwrap()).collect();
    let t0 = Instant::now();
    let mut round = 0usize;
    while t0.elapsed() < Duration::from_secs(3) {
        round += 1;
        let helpers: Vec<_> = (0..2)
            .map(|h| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let v: Vec<_> = (0..4 + h).map(|i| a.alloc::<u8>(512 * (i + 1)).unwrap()).collect();
                    if round % 3 == 0 {
                        // Freed after the caches went: counted in `retired`.
                        LATE.with(|l| {
                            let la = a.clone();
                            *l.borrow_mut() = Some(OnExit(la, Arc::new(Mutex::new(HashSet::new())), Vec::new()))
                        });
                    }
                    drop(v);
                })
            })
            .collect();
        // The main thread climbs and falls meanwhile (solo, then not, then solo again).
        let mut held = Vec::new();
        for i in 0..200 {
            held.push(a.alloc::<u8>(512 * (1 + i % 5)).unwrap());
            if i % 3 == 0 {
                held.swap_remove(0);
            }
        }
        drop(held);
        for h in helpers {
            h.join().unwrap();
        }
        let _ = a.memory_stats(); // retires the exited threads: solo again
        a.reset_peak_stats();
        let k = 5 + round % 7;
        let climb: Vec<_> = (0..k).map(|i| a.alloc::<u8>(4096 * (i + 1)).unwrap()).collect();
        drop(climb);
        let s = a.memory_stats();
        assert_eq!(s.allocation.all.current, 3, "round {round}");
        assert_eq!(s.allocation.all.peak, 3 + k as i64, "round {round}: peak of a climb of {k} over 3");
        let bytes: i64 = (1..=k as i64).map(|i| 4096 * i).sum::<i64>() + 3 * (1 << 20);
        assert_eq!(s.allocated_bytes.all.peak, bytes, "round {round}");
    }
    drop(base);
    check_invariants(&a, None);
}
