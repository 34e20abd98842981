//! Hostile review (helper-41, session 13) of 9a832d2 (`Owner::put` takes whether its bin is the
//! key's from `bin_for`) and 1b31dc2 (`State::free_cached` files another thread's deferred
//! block under the members' lock, `Board::filing`). Sim backend only.
//!
//! Findings are the tests named `finding_…`; the others are probes that pass. `R13B_ITERS`
//! scales the loops.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{check_invariants, check_pool, Rng};
use mempool::sim::{SimDevice, SimStream};
use mempool::{Allocator, BlockState, Buffer, MemPool, PoolId, PoolOptions, Sim, StreamId};

fn setup() -> (Arc<SimDevice>, Allocator<Sim>) {
    let sim = SimDevice::new(1 << 36);
    (sim.clone(), Allocator::sim(sim))
}

fn iters(n: usize) -> usize {
    std::env::var("R13B_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(n)
}

/// Aborts the process if `done` is not set within `secs` (a hang is a finding, not a timeout).
fn watchdog(name: &'static str, secs: u64) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    std::thread::spawn(move || {
        let t = Instant::now();
        while !d.load(Ordering::Relaxed) {
            if t.elapsed() > Duration::from_secs(secs) {
                eprintln!("{name}: hung for {secs} s (deadlock?)");
                std::process::abort();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    done
}

/// A live buffer and the key it was asked for under.
struct Live {
    buf: Buffer<u8, Sim>,
    stream: StreamId,
    pool: PoolId,
    len: usize,
}

/// Every live buffer lies in an allocated block of a segment of its own stream and pool, of at
/// least its length, asked for with its length, and no two overlap.
fn check_live(a: &Allocator<Sim>, live: &[Live]) {
    let snap = a.snapshot();
    let mut by_addr: HashMap<u64, (StreamId, PoolId, usize, usize, BlockState)> = HashMap::new();
    for s in &snap.segments {
        for b in &s.blocks {
            by_addr.insert(b.address, (s.stream, s.pool, b.size, b.requested_size, b.state));
        }
    }
    let mut spans: Vec<(u64, usize)> = Vec::new();
    for l in live {
        let addr = l.buf.device_ptr_raw();
        let (stream, pool, size, req, state) =
            *by_addr.get(&addr).unwrap_or_else(|| panic!("live buffer {addr:#x} is no block's start"));
        assert_eq!(state, BlockState::Allocated, "live buffer {addr:#x}'s block is {state:?}");
        assert_eq!(stream, l.stream, "live buffer {addr:#x} asked on {:?} lies in a segment of {stream:?}", l.stream);
        assert_eq!(pool, l.pool, "live buffer {addr:#x} asked in {:?} lies in pool {pool:?}", l.pool);
        assert!(size >= l.len, "block {addr:#x} of {size} bytes for {} asked", l.len);
        assert_eq!(req, l.len, "block {addr:#x} records {req} bytes asked, not {}", l.len);
        assert_eq!(l.buf.stream_id(), l.stream);
        spans.push((addr, size));
    }
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].0 + w[0].1 as u64 <= w[1].0, "live blocks overlap: {w:?}");
    }
}

// ------------------------------------------------------------------------------------------
// A. 9a832d2: `put`'s `keyed` from `bin_for`. Random frees and allocations over streams (the
// default and three more), user pools (two live, one released and made again to reuse its
// slot) and a few sizes, small and large (the large bin keyed by (stream, pool, requested)):
// every block handed out must be of its own (stream, pool) and recorded with the bytes asked
// for; stats exact at each checkpoint. PROBE.
// ------------------------------------------------------------------------------------------

#[test]
fn probe_a_cached_blocks_stay_with_their_key() {
    let (sim, a) = setup();
    let streams: Vec<SimStream> = (0..3).map(|_| sim.new_stream()).collect();
    let mut pools: Vec<MemPool<Sim>> = (0..2).map(|_| MemPool::on(&a, PoolOptions::new()).unwrap()).collect();
    // Few requested sizes so bins are hit and keys collide in sets: small (< 1 MiB) and large.
    let sizes = [512usize, 1000, 1024, 4096, 65536, 1 << 20, (1 << 20) + 512, 3 << 20, 5 << 20];
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut live: Vec<Live> = Vec::new();
    let steps = iters(20_000);
    for step in 0..steps {
        let op = rng.below(10);
        if op < 5 || live.is_empty() {
            let si = rng.below(4) as usize;
            let _g = if si < 3 { Some(a.set_stream(&streams[si]).unwrap()) } else { None };
            let stream = a.current_stream_id();
            let len = sizes[rng.below(sizes.len() as u64) as usize];
            let pi = rng.below(3) as usize;
            let (buf, pool) = if pi < 2 {
                (pools[pi].alloc::<u8>(len).unwrap(), pools[pi].id())
            } else {
                (a.alloc::<u8>(len).unwrap(), PoolId::DEFAULT)
            };
            assert_eq!(buf.stream_id(), stream);
            live.push(Live { buf, stream, pool, len });
        } else if op < 9 {
            // Free the newest mostly (what a cache reuses next), sometimes another.
            let i = if rng.below(3) == 0 { rng.below(live.len() as u64) as usize } else { live.len() - 1 };
            let l = live.swap_remove(i);
            // Sometimes freed under another current stream (the key is the block's stream).
            let si = rng.below(4) as usize;
            let _g = if si < 3 { Some(a.set_stream(&streams[si]).unwrap()) } else { None };
            drop(l.buf);
        } else if rng.below(20) == 0 {
            // A pool released (its blocks freed first) and made again: the slot is reused with
            // a new id.
            let pi = rng.below(2) as usize;
            let id = pools[pi].id();
            live.retain(|l| l.pool != id);
            pools[pi] = MemPool::on(&a, PoolOptions::new()).unwrap();
        }
        if step % 500 == 499 {
            check_live(&a, &live);
            check_invariants(&a, Some(&sim));
            for p in &pools {
                check_pool(p);
            }
        }
    }
    check_live(&a, &live);
    drop(live);
    check_invariants(&a, Some(&sim));
}

/// A block freed on stream A, taken for the same size on stream B and on another pool at once
/// (the bin just used, `last`, is the same set and way): never the block of A. PROBE.
#[test]
fn probe_a2_last_bin_is_not_taken_for_another_stream_or_pool() {
    let (sim, a) = setup();
    let s1 = sim.new_stream();
    let s2 = sim.new_stream();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    for len in [512usize, 4096, 1 << 20, 3 << 20, 5 << 20] {
        for _ in 0..iters(200) {
            let x = {
                let _g = a.set_stream(&s1).unwrap();
                a.alloc::<u8>(len).unwrap()
            };
            let ax = x.device_ptr_raw();
            drop(x);
            // Same size, other stream: must not be A's block (it is in s1's segment).
            let y = {
                let _g = a.set_stream(&s2).unwrap();
                a.alloc::<u8>(len).unwrap()
            };
            assert_ne!(y.device_ptr_raw(), ax, "s1's freed block served to s2 ({len} bytes)");
            // Same stream, a user pool: not A's either.
            let z = {
                let _g = a.set_stream(&s1).unwrap();
                pool.alloc::<u8>(len).unwrap()
            };
            assert_ne!(z.device_ptr_raw(), ax, "default pool's block served to a user pool ({len} bytes)");
            // Same stream and pool, one byte less asked (same rounded size): the cache keys by
            // bytes asked for, the state records them.
            let w = {
                let _g = a.set_stream(&s1).unwrap();
                a.alloc::<u8>(len - 1).unwrap()
            };
            let live = vec![
                Live { stream: s2.into(), pool: PoolId::DEFAULT, len, buf: y },
                Live { stream: s1.into(), pool: pool.id(), len, buf: z },
                Live { stream: s1.into(), pool: PoolId::DEFAULT, len: len - 1, buf: w },
            ];
            if rng_hit(len) {
                check_live(&a, &live);
            }
            drop(live);
        }
    }
    check_invariants(&a, Some(&sim));
}

fn rng_hit(len: usize) -> bool {
    static N: AtomicU64 = AtomicU64::new(0);
    (N.fetch_add(1, Ordering::Relaxed) + len as u64) % 37 == 0
}

/// Several threads, each on its own streams and a shared pool, with drains from another thread
/// (empty_cache) in between: live buffers checked at the end of each round. PROBE.
#[test]
fn probe_a3_threads_keys_and_drains() {
    let (sim, a) = setup();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let rounds = iters(30);
    for round in 0..rounds {
        let stop = Arc::new(AtomicBool::new(false));
        let drainer = {
            let (a, stop) = (a.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    a.empty_cache().unwrap();
                    let _ = a.memory_stats();
                }
            })
        };
        let kept: Vec<Vec<Live>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|t| {
                    let (a, pool, sim) = (&a, &pool, &sim);
                    s.spawn(move || {
                        let st = [sim.new_stream(), sim.new_stream()];
                        let mut rng = Rng(0x9e37_79b9 ^ (round as u64 * 31 + t as u64 + 1));
                        let mut live: Vec<Live> = Vec::new();
                        for _ in 0..2000 {
                            if rng.below(2) == 0 || live.is_empty() {
                                let si = rng.below(3) as usize;
                                let _g = if si < 2 { Some(a.set_stream(&st[si]).unwrap()) } else { None };
                                let stream = a.current_stream_id();
                                let len = [512usize, 1024, 1 << 20, 3 << 20][rng.below(4) as usize];
                                let (buf, p) = if rng.below(2) == 0 {
                                    (pool.alloc::<u8>(len).unwrap(), pool.id())
                                } else {
                                    (a.alloc::<u8>(len).unwrap(), PoolId::DEFAULT)
                                };
                                live.push(Live { buf, stream, pool: p, len });
                            } else {
                                live.pop();
                            }
                        }
                        live
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        stop.store(true, Ordering::Relaxed);
        drainer.join().unwrap();
        let all: Vec<Live> = kept.into_iter().flatten().collect();
        check_live(&a, &all);
        drop(all);
        check_invariants(&a, Some(&sim));
        check_pool(&pool);
    }
}

// ------------------------------------------------------------------------------------------
// B. 1b31dc2: `Board::filing` (the members' lock) taken under the allocator's lock, and under
// `retired_lock` where the filer's locals are gone. Every path that files other threads'
// deferred blocks (empty_cache's drain_all, a thread's first locked call taking parked blocks,
// a segment made: drain_orphans_and_large, a thread exiting with locals gone) against every
// reader of the members' lock (memory_stats, reset_peak_stats, a pool's stats, census of a
// rising allocation), threads coming and going. Watchdog: a hang aborts. PROBE.
// ------------------------------------------------------------------------------------------

#[test]
fn probe_b_filing_against_every_members_lock_user_never_deadlocks() {
    let done = watchdog("probe_b", 120);
    let (sim, a) = setup();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut hs = Vec::new();
    // Readers / drainers.
    for r in 0..2u64 {
        let (a, pool, stop) = (a.clone(), pool.clone(), stop.clone());
        hs.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                match (n + r) % 6 {
                    0 => drop(a.memory_stats()),
                    1 => a.reset_peak_stats(),
                    2 => drop(pool.memory_stats()),
                    3 => a.empty_cache().unwrap(),
                    4 => drop(a.snapshot()),
                    _ => {
                        // A rise (census under the members' lock) from a locked path.
                        let v: Vec<_> = (0..4).map(|i| a.alloc::<u8>((1 << 21) + i * 4096).unwrap()).collect();
                        drop(v);
                    }
                }
                n += 1;
            }
        }));
    }
    // Workers that keep deferred blocks (sizes in turn), default and pool, across streams.
    for t in 0..2u64 {
        let (a, pool, stop, sim) = (a.clone(), pool.clone(), stop.clone(), sim.clone());
        hs.push(std::thread::spawn(move || {
            let s = sim.new_stream();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let len = 512 * (1 + ((i + t) % 3) as usize);
                if i % 7 == 0 {
                    let _g = a.set_stream(&s).unwrap();
                    drop(a.alloc::<u8>(len).unwrap());
                } else if i % 5 == 0 {
                    drop(pool.alloc::<u8>(len).unwrap());
                } else {
                    drop(a.alloc::<u8>(len).unwrap());
                }
                i += 1;
            }
        }));
    }
    // Threads that come and go: exit with a deferred block, or allocate and free with their
    // locals gone (the sink is `retired`, the filing runs under `retired_lock`).
    let churn = {
        let (a, pool, stop) = (a.clone(), pool.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let (a2, p2) = (a.clone(), pool.clone());
                let h = std::thread::spawn(move || {
                    common::at_exit_first();
                    let (a3, p3) = (a2.clone(), p2.clone());
                    common::at_exit(move || {
                        // Locals gone: every call files parked blocks and counts in `retired`.
                        drop(a3.alloc::<u8>(512).unwrap());
                        drop(p3.alloc::<u8>(1024).unwrap());
                        let _ = a3.memory_stats();
                        a3.empty_cache().unwrap();
                        drop(a3.alloc::<u8>(3 << 20).unwrap());
                    });
                    // Leave a deferred block behind (one free not taken back).
                    drop(a2.alloc::<u8>(512).unwrap());
                    drop(a2.alloc::<u8>(512).unwrap());
                    drop(p2.alloc::<u8>(1536).unwrap());
                    drop(a2.alloc::<u8>(1536).unwrap());
                });
                h.join().unwrap();
                k += 1;
            }
            k
        })
    };
    std::thread::sleep(Duration::from_millis(iters(8000) as u64));
    stop.store(true, Ordering::Relaxed);
    for h in hs {
        h.join().unwrap();
    }
    let k = churn.join().unwrap();
    done.store(true, Ordering::Relaxed);
    eprintln!("probe_b: {k} short-lived threads");
    a.empty_cache().unwrap();
    check_invariants(&a, Some(&sim));
    check_pool(&pool);
}

// ------------------------------------------------------------------------------------------
// C. 1b31dc2's claim: a census or sum never counts a block filed by another thread allocated
// twice (nor freed twice, which the old order allowed). One-block workers (each holds at most
// one block) keep deferred blocks; a drainer files them all the time (empty_cache) from
// another thread; readers check `current` within [0, N] for allocation, active and requested,
// and that every peak read is at most N. Both directions. Also user-pool blocks (the pool's
// stats under the allocator's lock). Counted, asserted.
// ------------------------------------------------------------------------------------------

fn c_run(pool_too: bool) -> (u64, Vec<String>) {
    let (_sim, a) = setup();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    const N: usize = 3;
    let stop = Arc::new(AtomicBool::new(false));
    let bad = Arc::new(Mutex::new(Vec::<String>::new()));
    let reads = Arc::new(AtomicU64::new(0));
    let mut aux = Vec::new();
    {
        let (a, stop) = (a.clone(), stop.clone());
        aux.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                a.empty_cache().unwrap();
            }
        }));
    }
    for r in 0..2 {
        let (a, pool, stop, bad, reads) = (a.clone(), pool.clone(), stop.clone(), bad.clone(), reads.clone());
        aux.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let s = a.memory_stats();
                let maxb = (N * 1536) as i64;
                let checks = [
                    ("allocation.cur", s.allocation.all.current, N as i64),
                    ("active.cur", s.active.all.current, N as i64),
                    ("requested.cur", s.requested_bytes.all.current, maxb),
                    ("allocated_bytes.cur", s.allocated_bytes.all.current, maxb),
                    ("allocation.peak", s.allocation.all.peak, N as i64),
                    ("requested.peak", s.requested_bytes.all.peak, maxb),
                ];
                for (name, v, max) in checks {
                    if v < 0 || v > max {
                        bad.lock().unwrap().push(format!("reader {r} read {n}: {name} = {v} (0..={max})"));
                    }
                }
                if pool_too && n % 4 == 0 {
                    let p = pool.memory_stats();
                    if p.allocation.current < 0 || p.allocation.current > N as i64 || p.allocation.peak > N as i64 {
                        bad.lock().unwrap().push(format!(
                            "reader {r} read {n}: pool allocation cur {} peak {}",
                            p.allocation.current, p.allocation.peak
                        ));
                    }
                }
                if r == 0 && n % 2 == 0 {
                    a.reset_peak_stats();
                }
                n += 1;
            }
            reads.fetch_add(n, Ordering::Relaxed);
        }));
    }
    let steps = iters(100_000);
    std::thread::scope(|s| {
        for t in 0..N {
            let (a, pool) = (&a, &pool);
            s.spawn(move || {
                for i in 0..steps {
                    let len = 512 * (1 + (i + t) % 3);
                    if pool_too && i % 2 == 1 {
                        drop(pool.alloc::<u8>(len).unwrap());
                    } else {
                        drop(a.alloc::<u8>(len).unwrap());
                    }
                }
            });
        }
    });
    stop.store(true, Ordering::Relaxed);
    for h in aux {
        h.join().unwrap();
    }
    let s = a.memory_stats();
    let mut bad = std::mem::take(&mut *bad.lock().unwrap());
    if (s.allocation.all.current, s.active.all.current) != (0, 0) {
        bad.push(format!("at the end: {} / {}", s.allocation.all.current, s.active.all.current));
    }
    (reads.load(Ordering::Relaxed), bad)
}

#[test]
fn probe_c_filing_by_a_drainer_counts_each_block_once_default_pools() {
    let (n, bad) = c_run(false);
    assert!(bad.is_empty(), "{} of {n} reads: {:?}", bad.len(), &bad[..bad.len().min(8)]);
}

#[test]
fn probe_c2_filing_by_a_drainer_counts_each_block_once_with_a_pool() {
    let (n, bad) = c_run(true);
    assert!(bad.is_empty(), "{} of {n} reads: {:?}", bad.len(), &bad[..bad.len().min(8)]);
}
