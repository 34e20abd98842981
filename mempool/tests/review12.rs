//! Hostile review (helper-39, session 12) of c869613 (deferred-free records kept until their
//! blocks are filed) and 3c9acd3 (the large bin not rewritten for the same key and size). Found:
//! `d_…` (a pool peak counting an exited thread's block in flight: fixed, such a thread is
//! retired after the filing), `a2_…` (pool statistics counting a block in flight: fixed, they
//! take records off), `c_…`/`c2_…` (device peaks one high now and then: a known gap, ignored,
//! RELIABILITY.md). Sim backend only.

mod common;

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use common::{check_invariants, check_pool};
use mempool::sim::SimDevice;
use mempool::{Allocator, Buffer, Config, MemPool, MemoryStats, PoolOptions, Sim};

const MIB: usize = 1 << 20;

fn setup() -> (Arc<SimDevice>, Allocator<Sim>) {
    let sim = SimDevice::new(1 << 34);
    (sim.clone(), Allocator::sim(sim))
}

fn iters(n: usize) -> usize {
    std::env::var("R12_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(n)
}

/// A reader thread calling the draining calls in a loop until `stop`.
fn reader(a: &Allocator<Sim>, stop: &Arc<AtomicBool>, kinds: &'static [u8]) -> std::thread::JoinHandle<u64> {
    let (a, stop) = (a.clone(), stop.clone());
    std::thread::spawn(move || {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            match kinds[n as usize % kinds.len()] {
                0 => drop(a.memory_stats()),
                1 => a.empty_cache().unwrap(),
                2 => drop(a.snapshot()),
                _ => a.reset_peak_stats(),
            }
            n += 1;
        }
        n
    })
}

// ------------------------------------------------------------------------------------------
// A. A user pool's statistics at quiescent points (every worker parked) while another thread
// drains: a pool block a drain holds (its free deferred, filed later under the lock) is
// counted allocated by `MemPool::memory_stats`.
// ------------------------------------------------------------------------------------------

#[test]
fn a_pool_stats_exact_at_quiescent_points_under_concurrent_readers() {
    let (sim, a) = setup();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    const T: usize = 3;
    let rounds = iters(200);
    let stop = Arc::new(AtomicBool::new(false));
    let bar = Arc::new(Barrier::new(T + 1));
    let counts = Arc::new(Mutex::new([(0i64, 0i64); T]));
    let mut hs = Vec::new();
    for t in 0..T {
        let (pool, bar, counts) = (pool.clone(), bar.clone(), counts.clone());
        hs.push(std::thread::spawn(move || {
            let mut held: Vec<Buffer<u8, Sim>> = Vec::new();
            for _round in 0..rounds {
                for i in 0..50 {
                    let n = 512 * (1 + (i + t) % 3);
                    let x = pool.alloc::<u8>(n).unwrap();
                    if i % 17 == 0 {
                        held.push(x);
                    }
                    if held.len() > 3 {
                        held.remove(0);
                    }
                }
                // The last free (a pool block) is deferred in this thread's cache.
                drop(pool.alloc::<u8>(512).unwrap());
                let mine = (held.len() as i64, held.iter().map(|b| b.num_bytes() as i64).sum());
                counts.lock().unwrap()[t] = mine;
                bar.wait();
                bar.wait();
            }
            drop(held);
        }));
    }
    let r = reader(&a, &stop, &[0, 1]);
    let mut bad = Vec::new();
    for round in 0..rounds {
        bar.wait();
        let want = counts.lock().unwrap().iter().fold((0, 0), |x, y| (x.0 + y.0, x.1 + y.1));
        let p = pool.memory_stats();
        let s = a.memory_stats();
        let got_pool = (p.allocation.current, p.requested_bytes.current);
        let got_dev = (s.allocation.all.current, s.requested_bytes.all.current);
        if got_pool != want || got_dev != want {
            bad.push((round, want, got_pool, got_dev));
        }
        bar.wait();
    }
    for h in hs {
        h.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    r.join().unwrap();
    assert!(bad.is_empty(), "(round, held, pool stats, device stats): {bad:?}");
    check_pool(&pool);
    check_invariants(&a, Some(&sim));
}

// ------------------------------------------------------------------------------------------
// B. Threads that exit with a deferred block (small split, small whole, large) while a reader
// drains, resets peaks, snapshots; device statistics at quiescent points.
// ------------------------------------------------------------------------------------------

#[test]
fn b_exiting_threads_deferred_blocks_device_stats_exact() {
    let (sim, a) = setup();
    let rounds = iters(300);
    let stop = Arc::new(AtomicBool::new(false));
    let r = reader(&a, &stop, &[0, 3, 1, 3, 2]);
    let mut held: Vec<Buffer<u8, Sim>> = Vec::new();
    let mut bad = Vec::new();
    for round in 0..rounds {
        let hs: Vec<_> = (0..3)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    // A kept neighbour makes the segment split.
                    let keep = a.alloc::<u8>(512 * (1 + t)).unwrap();
                    for i in 0..10 {
                        drop(a.alloc::<u8>(512 * (1 + (i + t) % 4)).unwrap());
                    }
                    if t == 2 {
                        drop(a.alloc::<u8>(3 * MIB + 512 * round % 4).unwrap());
                    }
                    drop(a.alloc::<u8>(1536).unwrap()); // deferred
                    keep
                })
            })
            .collect();
        for h in hs {
            held.push(h.join().unwrap());
        }
        if held.len() > 9 {
            held.drain(..3);
        }
        let want = (held.len() as i64, held.iter().map(|b| b.num_bytes() as i64).sum::<i64>());
        let s = a.memory_stats();
        let got = (s.allocation.all.current, s.requested_bytes.all.current);
        let active = s.active.all.current;
        if got != want || active != want.0 {
            bad.push((round, want, got, active));
        }
    }
    stop.store(true, Ordering::Relaxed);
    r.join().unwrap();
    assert!(bad.is_empty(), "(round, held, stats, active): {bad:?}");
    check_invariants(&a, Some(&sim));
    drop(held);
    check_invariants(&a, Some(&sim));
    a.empty_cache().unwrap();
    assert!(sim.live_segments().is_empty());
}

// ------------------------------------------------------------------------------------------
// C. Peaks never above the true maximum: N workers each holding at most one block at a time
// (so at most N blocks, N * 1536 bytes asked for), one reader draining in a loop.
// ------------------------------------------------------------------------------------------

#[test]
fn c_peak_never_above_true_maximum_with_draining_reader() {
    let (_sim, a) = setup();
    const N: usize = 3;
    let steps = iters(200_000);
    let stop = Arc::new(AtomicBool::new(false));
    let r = reader(&a, &stop, &[0, 0, 1, 2]);
    one_block_workers(&a, N, steps);
    stop.store(true, Ordering::Relaxed);
    r.join().unwrap();
    let s = a.memory_stats();
    assert!(s.allocation.all.peak <= N as i64, "allocation peak {} > {N}", s.allocation.all.peak);
    assert!(
        s.requested_bytes.all.peak <= (N * 1536) as i64,
        "requested peak {} > {}",
        s.requested_bytes.all.peak,
        N * 1536
    );
    assert!(s.active.all.peak <= N as i64, "active peak {} > {N}", s.active.all.peak);
    assert_eq!(s.allocation.all.current, 0);
}

/// `n` threads, each allocating and freeing `steps` blocks of 512, 1024 or 1536 bytes in turn
/// (so each holds at most one block at a time), joined.
fn one_block_workers(a: &Allocator<Sim>, n: usize, steps: usize) {
    std::thread::scope(|s| {
        for t in 0..n {
            s.spawn(move || {
                for i in 0..steps {
                    drop(a.alloc::<u8>(512 * (1 + (i + t) % 3)).unwrap());
                }
            });
        }
    });
}

// ------------------------------------------------------------------------------------------
// D. A pool's peak: an exited thread's deferred pool block, drained and retired by a reader,
// must not be counted allocated by an allocation while the reader waits to file it.
// ------------------------------------------------------------------------------------------

#[test]
fn d_pool_peak_with_exited_threads_deferred_block() {
    d_pool_peak(true);
}

/// The same without the reader: passes (the window is the reader's, between its retirement of
/// the exited thread and its filing).
#[test]
fn d2_pool_peak_exited_threads_no_reader() {
    d_pool_peak(false);
}

fn d_pool_peak(with_reader: bool) {
    let (sim, a) = setup();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let stop = Arc::new(AtomicBool::new(!with_reader));
    let r = reader(&a, &stop, &[0]);
    let rounds = iters(3000);
    let mut bad = Vec::new();
    for round in 0..rounds {
        let p2 = pool.clone();
        std::thread::spawn(move || drop(p2.alloc::<u8>(512).unwrap())).join().unwrap();
        // A locked allocation (a size this thread never cached), then freed: at most one pool
        // block allocated at any time.
        let n = 1024 + 512 * (round % 64);
        let y = pool.alloc::<u8>(n).unwrap();
        drop(y);
        if round % 100 == 99 {
            let p = pool.memory_stats();
            if p.allocation.peak > 1 {
                bad.push((round, p.allocation.peak));
            }
            pool.allocator().reset_peak_stats();
        }
    }
    stop.store(true, Ordering::Relaxed);
    r.join().unwrap();
    let p = pool.memory_stats();
    assert!(
        bad.is_empty() && p.allocation.peak <= 1,
        "(round, pool allocation peak): {bad:?}, end {}",
        p.allocation.peak
    );
    check_pool(&pool);
    check_invariants(&a, Some(&sim));
}

// ------------------------------------------------------------------------------------------
// E. Large blocks through the large bin: keys alternating (sizes 3 MiB / 3 MiB + 1, streams,
// pools), parked blocks, empty_cache in between; an allocator without thread caches fed the
// same sequence gives the same placement-independent statistics; invariants every step.
// ------------------------------------------------------------------------------------------

fn same(a: &MemoryStats, b: &MemoryStats, when: &str) {
    for (name, x, y) in [
        ("allocation", a.allocation, b.allocation),
        ("requested_bytes", a.requested_bytes, b.requested_bytes),
        ("active", a.active, b.active),
    ] {
        for (k, s, t) in
            [("all", x.all, y.all), ("small", x.small_pool, y.small_pool), ("large", x.large_pool, y.large_pool)]
        {
            assert_eq!(
                (s.current, s.allocated, s.freed, s.peak),
                (t.current, t.allocated, t.freed, t.peak),
                "{when}: {name}.{k} (current, allocated, freed, peak)"
            );
        }
    }
}

#[test]
fn e_large_bin_alternating_keys_against_uncached() {
    let s_on = SimDevice::new(1 << 36);
    let s_off = SimDevice::new(1 << 36);
    let on = Allocator::sim_with(s_on.clone(), Config::builder().thread_cache(true).build().unwrap());
    let off = Allocator::sim_with(s_off.clone(), Config::builder().thread_cache(false).build().unwrap());
    let p_on = MemPool::on(&on, PoolOptions::new()).unwrap();
    let p_off = MemPool::on(&off, PoolOptions::new()).unwrap();
    let st_on = [s_on.new_stream(), s_on.new_stream()];
    let st_off = [s_off.new_stream(), s_off.new_stream()];
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut held_on: Vec<Buffer<u8, Sim>> = Vec::new();
    let mut held_off: Vec<Buffer<u8, Sim>> = Vec::new();
    let sizes = [3 * MIB, 3 * MIB + 1, 3 * MIB, 3 * MIB + 511, 3 * MIB + 513, 2 * MIB + 1, 5 * MIB];
    for step in 0..iters(6000) {
        let r = next();
        let size = sizes[(r % sizes.len() as u64) as usize];
        let s = ((r >> 8) % 3) as usize; // 0,1: streams; 2: default stream
        let in_pool = (r >> 12) % 4 == 0;
        let keep = (r >> 16) % 8 == 0;
        let op = (r >> 20) % 64;
        let g_on = (s < 2).then(|| on.set_stream(&st_on[s]).unwrap());
        let g_off = (s < 2).then(|| off.set_stream(&st_off[s]).unwrap());
        // alloc then free at once (the large bin), or keep it a while.
        let (x, y) = if in_pool {
            (p_on.alloc::<u8>(size).unwrap(), p_off.alloc::<u8>(size).unwrap())
        } else {
            (on.alloc::<u8>(size).unwrap(), off.alloc::<u8>(size).unwrap())
        };
        drop((g_on, g_off));
        if keep {
            held_on.push(x);
            held_off.push(y);
        } else {
            drop(x);
            drop(y);
        }
        if held_on.len() > 4 {
            let i = (r >> 24) as usize % held_on.len();
            held_on.remove(i);
            held_off.remove(i);
        }
        match op {
            0 => {
                on.empty_cache().unwrap();
                off.empty_cache().unwrap();
            }
            1 => {
                on.reset_peak_stats();
                off.reset_peak_stats();
            }
            2 => {
                // Another thread uses the allocator (parked blocks are filed at its first call).
                let (a1, a2) = (on.clone(), off.clone());
                std::thread::spawn(move || {
                    drop(a1.alloc::<u8>(3 * MIB).unwrap());
                    drop(a2.alloc::<u8>(3 * MIB).unwrap());
                })
                .join()
                .unwrap();
            }
            _ => {}
        }
        if step % 97 == 0 || op < 3 {
            same(&on.memory_stats(), &off.memory_stats(), &format!("step {step}"));
            check_invariants(&on, Some(&s_on));
        }
    }
    drop(held_on);
    drop(held_off);
    same(&on.memory_stats(), &off.memory_stats(), "end");
    check_invariants(&on, Some(&s_on));
    check_pool(&p_on);
}

/// The same, with 3 MiB and 3 MiB + 1 strictly alternating (the brief's case), many pairs
/// (past the bypass window: a low hit rate parks blocks).
#[test]
fn e2_large_alternating_sizes_pairs() {
    let (sim, a) = setup();
    let off = Allocator::sim_with(SimDevice::new(1 << 34), Config::builder().thread_cache(false).build().unwrap());
    for i in 0..iters(20_000) {
        let n = if i % 2 == 0 { 3 << 20 } else { (3 << 20) + 1 };
        drop(a.alloc::<u8>(n).unwrap());
        drop(off.alloc::<u8>(n).unwrap());
        if i % 1000 == 999 {
            same(&a.memory_stats(), &off.memory_stats(), &format!("pair {i}"));
            check_invariants(&a, Some(&sim));
        }
        if i % 3333 == 0 {
            a.empty_cache().unwrap();
            off.empty_cache().unwrap();
        }
    }
    // Then the same size again and again: reused from the large bin (no new segment).
    let before = sim.live_segments().len();
    for _ in 0..1000 {
        drop(a.alloc::<u8>(3 << 20).unwrap());
        drop(off.alloc::<u8>(3 << 20).unwrap());
    }
    assert!(sim.live_segments().len() <= before.max(1) + 1);
    same(&a.memory_stats(), &off.memory_stats(), "end");
    check_invariants(&a, Some(&sim));
}

// ------------------------------------------------------------------------------------------
// F. A drained deferred block's record goes with its filing: the owner caches a user pool's
// block again afterwards (a pool block is cached only as a deferred free, so a stuck record
// would send every later pool free to the free set, where another thread would get it).
// ------------------------------------------------------------------------------------------

#[test]
fn f_owner_defers_again_after_a_drain_filed_its_block() {
    let (_sim, a) = setup();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let (to_w, w_rx) = std::sync::mpsc::channel::<u8>();
    let (to_m, m_rx) = std::sync::mpsc::channel::<u64>();
    let p2 = pool.clone();
    let w = std::thread::spawn(move || {
        let keep = p2.alloc::<u8>(512).unwrap();
        while let Ok(cmd) = w_rx.recv() {
            match cmd {
                // Free a pool block (deferred), report its address.
                // Pairs of one pool size (after a deferred free that was not taken back, the
                // next 64 frees are counted: a pool block is then not cached), the last free
                // left deferred; its address reported.
                0 => {
                    let mut addr = 0;
                    for _ in 0..100 {
                        let x = p2.alloc::<u8>(512).unwrap();
                        addr = x.device_ptr_raw();
                        drop(x);
                    }
                    to_m.send(addr).unwrap();
                }
                _ => break,
            }
        }
        drop(keep);
    });
    let mut cached_after = 0;
    for round in 0..50 {
        to_w.send(0).unwrap();
        let addr = m_rx.recv().unwrap();
        // Is it cached? Another thread allocating the same size would get it from the free set.
        let p3 = pool.clone();
        let other = std::thread::spawn(move || {
            let y = p3.alloc::<u8>(512).unwrap();
            y.device_ptr_raw()
        })
        .join()
        .unwrap();
        if round > 0 && other != addr {
            cached_after += 1;
        }
        // A drain takes it (and files it).
        let _ = a.memory_stats();
    }
    to_w.send(1).unwrap();
    w.join().unwrap();
    assert!(cached_after >= 45, "the worker cached its pool block in only {cached_after} of 49 rounds");
    check_pool(&pool);
}

// ------------------------------------------------------------------------------------------
// G. reset_peak_stats racing with exiting threads and drains: peaks stay within the true
// maximum (each worker holds at most one block at a time; threads come and go).
// ------------------------------------------------------------------------------------------

#[test]
fn g_reset_peaks_with_exiting_threads() {
    let (sim, a) = setup();
    let stop = Arc::new(AtomicBool::new(false));
    let r = reader(&a, &stop, &[3, 0, 3, 1]);
    const N: usize = 3;
    let max_seen = Arc::new(AtomicI64::new(0));
    for _ in 0..iters(300) {
        let hs: Vec<_> = (0..N)
            .map(|t| {
                let a = a.clone();
                std::thread::spawn(move || {
                    for i in 0..40 {
                        drop(a.alloc::<u8>(512 * (1 + (i + t) % 3)).unwrap());
                    }
                    if t == 0 {
                        drop(a.alloc::<u8>(3 * MIB).unwrap());
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let s = a.memory_stats();
        max_seen.fetch_max(s.allocation.all.peak, Ordering::Relaxed);
        assert!(s.allocation.all.peak <= N as i64, "allocation peak {}", s.allocation.all.peak);
        assert!(s.allocation.all.peak >= 0 && s.allocation.all.current == 0, "{:?}", s.allocation.all);
        assert!(
            s.requested_bytes.all.peak <= (2 * 1536 + 3 * MIB) as i64,
            "requested peak {}",
            s.requested_bytes.all.peak
        );
    }
    stop.store(true, Ordering::Relaxed);
    r.join().unwrap();
    check_invariants(&a, Some(&sim));
    a.empty_cache().unwrap();
    assert!(sim.live_segments().is_empty());
}

// ------------------------------------------------------------------------------------------
// A2. A. made tight: one live worker leaves a deferred pool block and parks; the main thread
// reads the pool's statistics at once while a reader drains.
// ------------------------------------------------------------------------------------------

#[test]
fn a2_pool_current_with_a_live_workers_deferred_block_in_flight() {
    let (sim, a) = setup();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let rounds = iters(5000);
    let stop = Arc::new(AtomicBool::new(false));
    let bar = Arc::new(Barrier::new(2));
    let p2 = pool.clone();
    let b2 = bar.clone();
    let w = std::thread::spawn(move || {
        let keep = p2.alloc::<u8>(1024).unwrap();
        for _ in 0..rounds {
            for _ in 0..70 {
                drop(p2.alloc::<u8>(512).unwrap());
            }
            b2.wait();
            b2.wait();
        }
        drop(keep);
    });
    let r = reader(&a, &stop, &[0]);
    let mut bad = Vec::new();
    for round in 0..rounds {
        bar.wait();
        let p = pool.memory_stats();
        if p.allocation.current != 1 || p.requested_bytes.current != 1024 {
            bad.push((round, p.allocation.current, p.requested_bytes.current));
        }
        bar.wait();
    }
    w.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    r.join().unwrap();
    assert!(
        bad.is_empty(),
        "{} of {rounds} rounds: (round, pool allocation, requested): {:?}",
        bad.len(),
        &bad[..bad.len().min(10)]
    );
    check_pool(&pool);
    check_invariants(&a, Some(&sim));
}

// ------------------------------------------------------------------------------------------
// C2. Peaks checked by the reader at every read (a reset between reads lets censuses run):
// N workers each holding at most one block.
// ------------------------------------------------------------------------------------------

#[test]
fn c2_peaks_read_by_the_resetting_reader_never_above_true_maximum() {
    let (_sim, a) = setup();
    const N: usize = 3;
    let steps = iters(200_000);
    let stop = Arc::new(AtomicBool::new(false));
    let ra = a.clone();
    let rstop = stop.clone();
    let r = std::thread::spawn(move || {
        let mut bad = Vec::new();
        let mut n = 0u64;
        while !rstop.load(Ordering::Relaxed) {
            let s = ra.memory_stats();
            if s.allocation.all.peak > N as i64
                || s.requested_bytes.all.peak > (N * 1536) as i64
                || s.active.all.peak > N as i64
                || s.active.all.current > N as i64
                || s.allocation.all.current > N as i64
            {
                bad.push((
                    n,
                    s.allocation.all.peak,
                    s.requested_bytes.all.peak,
                    s.active.all.peak,
                    s.active.all.current,
                    s.allocation.all.current,
                ));
            }
            if n % 2 == 0 {
                ra.reset_peak_stats();
            }
            n += 1;
        }
        (n, bad)
    });
    one_block_workers(&a, N, steps);
    stop.store(true, Ordering::Relaxed);
    let (n, bad) = r.join().unwrap();
    let s = a.memory_stats();
    assert_eq!(
        (s.allocation.all.current, s.active.all.current, s.requested_bytes.all.current),
        (0, 0, 0),
        "at the end"
    );
    assert!(
        bad.is_empty(),
        "{} of {n} reads: (read, peaks: allocation, requested, active; active.current, allocation.current): {:?} .. {:?}",
        bad.len(),
        &bad[..bad.len().min(4)],
        &bad[bad.len().saturating_sub(2)..]
    );
}
