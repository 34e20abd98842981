//! Hostile review (helper-37) of acedae7, 0fca16b, 36af93f: statistics and the bare-thread flag.
//! Review of acedae7 (def_hits), 0fca16b (BARE), 36af93f (malloc_cached signature).
//! Every test asserts what a user relies on and must pass on correct code.
//!
//! `differential_fingerprint` also writes every figure of every checkpoint to
//! `$REVIEW11_DUMP` when set, so that the same scenario can be compared with the commit
//! before acedae7 (the totals must be the same, byte for byte).

mod common;

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::{check_invariants, check_pool};
use mempool::sim::SimDevice;
use mempool::{Allocator, Config, MemPool, MemoryStats, PoolOptions, Sim};
use mempool::{BackendError, RawAllocator, StreamId};

const MIB: usize = 1 << 20;

fn setup(capacity: usize) -> (Arc<SimDevice>, Allocator<Sim>) {
    let sim = SimDevice::new(capacity);
    (sim.clone(), Allocator::sim(sim))
}

/// Expected totals, by kind (0 small, 1 large): allocations, bytes, bytes asked for.
#[derive(Default, Clone, Copy, Debug)]
struct Model {
    n: [u64; 2],
    bytes: [u64; 2],
    req: [u64; 2],
}

impl Model {
    fn add(&mut self, ask: usize, rounded: usize, small: bool, times: u64) {
        let k = usize::from(!small);
        self.n[k] += times;
        self.bytes[k] += times * rounded as u64;
        self.req[k] += times * ask as u64;
    }
    fn check(&self, s: &MemoryStats, when: &str) {
        assert_eq!(s.allocation.small_pool.allocated, self.n[0], "{when}: small allocations");
        assert_eq!(s.allocation.large_pool.allocated, self.n[1], "{when}: large allocations");
        assert_eq!(s.allocation.all.allocated, self.n[0] + self.n[1], "{when}: allocations");
        assert_eq!(s.active.all.allocated, self.n[0] + self.n[1], "{when}: active");
        assert_eq!(s.allocated_bytes.small_pool.allocated, self.bytes[0], "{when}: small bytes");
        assert_eq!(s.allocated_bytes.large_pool.allocated, self.bytes[1], "{when}: large bytes");
        assert_eq!(s.allocated_bytes.all.allocated, self.bytes[0] + self.bytes[1], "{when}: bytes");
        assert_eq!(s.active_bytes.all.allocated, self.bytes[0] + self.bytes[1], "{when}: active bytes");
        assert_eq!(s.requested_bytes.small_pool.allocated, self.req[0], "{when}: small asked");
        assert_eq!(s.requested_bytes.large_pool.allocated, self.req[1], "{when}: large asked");
        assert_eq!(s.requested_bytes.all.allocated, self.req[0] + self.req[1], "{when}: asked");
        for (name, st) in [
            ("allocation", &s.allocation),
            ("allocated_bytes", &s.allocated_bytes),
            ("requested_bytes", &s.requested_bytes),
            ("active", &s.active),
            ("active_bytes", &s.active_bytes),
            ("inactive_split", &s.inactive_split),
            ("inactive_split_bytes", &s.inactive_split_bytes),
        ] {
            for (k, x) in [("all", &st.all), ("small", &st.small_pool), ("large", &st.large_pool)] {
                assert_eq!(x.allocated as i64 - x.freed as i64, x.current, "{when}: {name}.{k}");
                assert!(x.allocated >= x.freed, "{when}: {name}.{k}: {x:?}");
            }
            assert_eq!(st.all.allocated, st.small_pool.allocated + st.large_pool.allocated, "{when}: {name} all");
        }
    }
}

/// `pairs` allocations of `ask` bytes, each dropped at once.
fn pairs(a: &Allocator<Sim>, ask: usize, pairs: u64) {
    for _ in 0..pairs {
        drop(a.alloc::<u8>(ask).unwrap());
    }
}

/// Code a pool allocator runs inside its `alloc`.
type Inside = Arc<Mutex<Option<Box<dyn Fn() + Send>>>>;

/// A pool allocator handing out addresses only (the sim never touches memory).
#[derive(Default, Clone)]
struct Addrs {
    next: Arc<Mutex<u64>>,
    /// Run inside `alloc` (a pool allocator may call mempool).
    inside: Inside,
}

// SAFETY: distinct 2 MiB aligned ranges, never reused; the simulated allocator never reads them.
unsafe impl RawAllocator for Addrs {
    fn name(&self) -> &str {
        "addrs"
    }
    fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        if let Some(f) = &*self.inside.lock().unwrap() {
            f();
        }
        let mut n = self.next.lock().unwrap();
        if *n == 0 {
            *n = 0x7000_0000_0000;
        }
        let a = *n;
        *n += (size as u64).next_multiple_of(2 * MIB as u64);
        Ok(a)
    }
    unsafe fn free(&self, _: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        Ok(())
    }
}

fn dump(out: &mut Vec<String>, what: &str, s: &MemoryStats) {
    // Every figure but the peaks of the whole struct, and then the peaks too (both commits
    // should agree on everything).
    out.push(format!("{what}: {s:?}"));
}

/// One deterministic scenario that runs every path of a take-back: runs and alternations of
/// sizes of both kinds, the same size with another split flag, another bytes-asked-for with
/// the same rounded size, a user pool's blocks, a side stream, a second allocator on the same
/// thread, the clipped path (reset_peak_stats), drains by another thread, threads that exit
/// with a pending count and a pending deferred free, empty_cache.
fn scenario(sim: &Arc<SimDevice>, a: &Allocator<Sim>, out: &mut Vec<String>) -> Model {
    let mut m = Model::default();
    let b_sim = SimDevice::with_index(0, 1 << 30);
    let b = Allocator::sim(b_sim.clone());
    let mut mb = Model::default();
    let chk = |m: &Model, out: &mut Vec<String>, what: &str| {
        let s = a.memory_stats();
        m.check(&s, what);
        check_invariants(a, Some(sim));
        dump(out, what, &s);
    };

    // 1. runs of one size, then alternations (the record changes at every deferred free).
    pairs(a, 4000, 17);
    m.add(4000, 4096, true, 17);
    chk(&m, out, "run 4000");
    for i in 0..20 {
        let ask = if i % 2 == 0 { 512 } else { 3 * MIB + 100 };
        pairs(a, ask, 1);
        if i % 2 == 0 {
            m.add(512, 512, true, 1);
        } else {
            m.add(ask, 3 * MIB + 512, false, 1);
        }
    }
    chk(&m, out, "alternating");
    // Same rounded size, other bytes asked for (another record).
    for i in 0..12 {
        let ask = if i % 3 == 0 { 4096 } else { 4000 };
        pairs(a, ask, 3);
        m.add(ask, 4096, true, 3);
    }
    chk(&m, out, "same size, other asks");

    // 2. the same large size unsplit, then split (12 MiB: its own segment; then carved from a
    // 20 MiB segment).
    pairs(a, 12 * MIB, 6);
    m.add(12 * MIB, 12 * MIB, false, 6);
    chk(&m, out, "12 MiB unsplit");
    a.empty_cache().unwrap();
    chk(&m, out, "12 MiB unsplit, emptied");
    let hold = a.alloc::<u8>(4 * MIB).unwrap();
    m.add(4 * MIB, 4 * MIB, false, 1);
    pairs(a, 12 * MIB, 6);
    m.add(12 * MIB, 12 * MIB, false, 6);
    chk(&m, out, "12 MiB split");
    drop(hold);
    a.empty_cache().unwrap();
    pairs(a, 12 * MIB, 4);
    m.add(12 * MIB, 12 * MIB, false, 4);
    chk(&m, out, "12 MiB unsplit again");
    // Interleaved live buffers, each freed and taken back in turn: every deferred free is
    // taken back, so deferral stays on and the record changes at every step (a fold), or
    // stays for runs of one key. 12 MiB carved from a 20 MiB segment (split) and 12 MiB in a
    // segment of its own (unsplit) differ in the split flag alone; 4000 and 4096 in the bytes
    // asked for alone; a user pool's 4000 not at all from the default pools' 4000.
    a.empty_cache().unwrap();
    let pool0 = MemPool::on(a, PoolOptions::new()).unwrap();
    let hold = a.alloc::<u8>(4 * MIB).unwrap();
    m.add(4 * MIB, 4 * MIB, false, 1);
    // (bytes asked for, rounded, small, in the pool)
    let keys = [
        (12 * MIB, 12 * MIB, false, false), // split (the 20 MiB segment's rest)
        (12 * MIB, 12 * MIB, false, false), // unsplit (a segment of its own)
        (4000, 4096, true, false),
        (4096, 4096, true, false),
        (4000, 4096, true, true),
        (512, 512, true, false),
        (2 * MIB, 2 * MIB, false, false),
    ];
    let get = |k: usize| {
        let (ask, _, _, in_pool) = keys[k];
        if in_pool {
            pool0.alloc::<u8>(ask).unwrap()
        } else {
            a.alloc::<u8>(ask).unwrap()
        }
    };
    let mut bufs: Vec<_> = (0..keys.len()).map(get).collect();
    for &(ask, r, small, _) in &keys {
        m.add(ask, r, small, 1);
    }
    interleave_checks(a, sim, &mut m, out, &keys, &mut bufs, &get, 0);
    drop(bufs);
    drop(hold);
    chk(&m, out, "interleaved, all dropped");
    let s = a.memory_stats();
    out.push(format!("interleave inactive: {:?} {:?}", s.inactive_split, s.inactive_split_bytes));
    out.push(format!("interleave pool: {:?}", pool0.memory_stats()));
    check_pool(&pool0);
    drop(pool0);

    // A small block whose segment is split or not (1 MiB of a 2 MiB segment, then a 1 MiB
    // block next to another).
    a.empty_cache().unwrap();
    pairs(a, MIB, 3);
    m.add(MIB, MIB, true, 3);
    let h1 = a.alloc::<u8>(MIB).unwrap();
    let h2 = a.alloc::<u8>(MIB).unwrap();
    m.add(MIB, MIB, true, 2);
    drop(h1);
    pairs(a, MIB, 5);
    m.add(MIB, MIB, true, 5);
    drop(h2);
    chk(&m, out, "1 MiB");

    // 3. a user pool's blocks, of the same size as the default pools' (the record does not
    // change between them), then of another.
    let pool = MemPool::on(a, PoolOptions::new()).unwrap();
    pairs(a, 4000, 5);
    m.add(4000, 4096, true, 5);
    {
        let _s = pool.scope();
        pairs(a, 4000, 9);
        m.add(4000, 4096, true, 9);
        pairs(a, 2 * MIB, 4);
        m.add(2 * MIB, 2 * MIB, false, 4);
    }
    pairs(a, 4000, 5);
    m.add(4000, 4096, true, 5);
    chk(&m, out, "pool");
    let ps = pool.memory_stats();
    assert_eq!(ps.allocation.allocated, 13, "pool allocations");
    assert_eq!(ps.requested_bytes.allocated, 9 * 4000 + 4 * 2 * MIB as u64, "pool bytes asked for");
    check_pool(&pool);
    out.push(format!("pool stats: {ps:?}"));

    // 4. a side stream, same size (another bin, same record).
    let side = sim.new_stream();
    {
        let _g = a.set_stream(&side).unwrap();
        pairs(a, 4000, 7);
        m.add(4000, 4096, true, 7);
    }
    pairs(a, 4000, 2);
    m.add(4000, 4096, true, 2);
    chk(&m, out, "side stream");

    // 5. a second allocator interleaved on this thread.
    for i in 0..10 {
        pairs(a, 8192, 1);
        m.add(8192, 8192, true, 1);
        pairs(&b, if i % 2 == 0 { 8192 } else { 1024 }, 2);
        mb.add(if i % 2 == 0 { 8192 } else { 1024 }, if i % 2 == 0 { 8192 } else { 1024 }, true, 2);
    }
    chk(&m, out, "two allocators");
    mb.check(&b.memory_stats(), "second allocator");

    // 6. the clipped path: a reset of the peaks while a free is deferred.
    pairs(a, 4000, 3);
    m.add(4000, 4096, true, 3);
    let x = a.alloc::<u8>(4000).unwrap();
    drop(x); // deferred
    m.add(4000, 4096, true, 1);
    a.reset_peak_stats();
    pairs(a, 4000, 4);
    m.add(4000, 4096, true, 4);
    chk(&m, out, "clipped");

    // 7. another thread drains this thread's deferred block (memory_stats / empty_cache from
    // there), then this thread goes on with the same size.
    pairs(a, 4000, 3);
    m.add(4000, 4096, true, 3);
    {
        let a2 = a.clone();
        std::thread::spawn(move || a2.empty_cache().unwrap()).join().unwrap();
    }
    chk(&m, out, "drained by another thread");
    pairs(a, 4000, 3);
    m.add(4000, 4096, true, 3);
    pairs(a, 512, 1);
    m.add(512, 512, true, 1);
    chk(&m, out, "after the drain");

    // 8. threads that exit with a pending count and a deferred free, of both kinds; read
    // before and after a drain retires them; a new thread's first call retires an empty one.
    for (ask, rounded, small) in [(4000, 4096, true), (3 * MIB + 100, 3 * MIB + 512, false), (512, 512, true)] {
        let a2 = a.clone();
        std::thread::spawn(move || pairs(&a2, ask, 11)).join().unwrap();
        m.add(ask, rounded, small, 11);
        chk(&m, out, "exited");
    }
    a.empty_cache().unwrap();
    chk(&m, out, "exited, drained");
    {
        let a2 = a.clone();
        std::thread::spawn(move || {
            pairs(&a2, 4000, 2);
            a2.empty_cache().unwrap();
        })
        .join()
        .unwrap();
        m.add(4000, 4096, true, 2);
        let a2 = a.clone();
        std::thread::spawn(move || pairs(&a2, 4000, 2)).join().unwrap();
        m.add(4000, 4096, true, 2);
    }
    chk(&m, out, "exited empty");
    drop(pool);
    chk(&m, out, "pool dropped");
    a.empty_cache().unwrap();
    chk(&m, out, "end");
    mb.check(&b.memory_stats(), "second allocator at the end");
    out.push(format!("second: {:?}", b.memory_stats()));
    m
}

/// Re-arms deferral (64 counted frees after one not taken back), leaving nothing deferred;
/// then frees and takes back the buffers in turn (runs of 1 to 3 per key), checking totals
/// while a free is pending and after its take-back.
#[allow(clippy::too_many_arguments)]
fn interleave_checks(
    a: &Allocator<Sim>,
    sim: &Arc<SimDevice>,
    m: &mut Model,
    out: &mut Vec<String>,
    keys: &[(usize, usize, bool, bool)],
    bufs: &mut [mempool::Buffer<u8, Sim>],
    get: &dyn Fn(usize) -> mempool::Buffer<u8, Sim>,
    _seed: u64,
) {
    let mut keeps = Vec::new();
    let mut step = 0;
    for round in 0..4 {
        // Re-arm: 64 counted frees after the last read's drain, the last deferred free taken
        // back and kept (a free not taken back before the next one would disarm again).
        pairs(a, 4000, 70);
        m.add(4000, 4096, true, 70);
        keeps.push(a.alloc::<u8>(4000).unwrap());
        m.add(4000, 4096, true, 1);
        for k in 0..keys.len() {
            let run = 1 + (k + round) % 3;
            for _ in 0..run {
                let (ask, r, small, _) = keys[k];
                // Freed (deferred), then taken back by the same key's request.
                drop(std::mem::replace(&mut bufs[k], a.alloc::<u8>(0).unwrap()));
                bufs[k] = get(k);
                m.add(ask, r, small, 1);
                step += 1;
            }
        }
        // Read with a free pending (of the key `round` names), then taken back.
        let k = round % keys.len();
        let (ask, r, small, _) = keys[k];
        drop(std::mem::replace(&mut bufs[k], a.alloc::<u8>(0).unwrap()));
        let s = a.memory_stats();
        m.check(&s, &format!("interleave round {round} ({step} steps), a free pending"));
        check_invariants(a, Some(sim));
        out.push(format!("interleave round {round} pending: {s:?}"));
        bufs[k] = get(k);
        m.add(ask, r, small, 1);
    }
    drop(keeps);
    let s = a.memory_stats();
    m.check(&s, "interleave end");
    out.push(format!("interleave end: {s:?}"));
}

#[test]
fn differential_fingerprint() {
    let (sim, a) = setup(1 << 32);
    let mut out = Vec::new();
    scenario(&sim, &a, &mut out);
    if let Ok(p) = std::env::var("REVIEW11_DUMP") {
        std::fs::write(p, out.join("\n") + "\n").unwrap();
    }
}

/// The scenario on a thread of its own, read from the main thread while it idles and after it
/// exits (the pending count is another thread's then).
#[test]
fn scenario_on_a_worker_read_from_outside() {
    let (sim, a) = setup(1 << 32);
    let (tx, rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let w = {
        let (a, sim) = (a.clone(), sim.clone());
        std::thread::spawn(move || {
            let mut out = Vec::new();
            let m = scenario(&sim, &a, &mut out);
            // A last run left pending.
            pairs(&a, 4000, 9);
            let mut m2 = m;
            m2.add(4000, 4096, true, 9);
            tx.send(m2).unwrap();
            go_rx.recv().unwrap();
        })
    };
    let m = rx.recv().unwrap();
    m.check(&a.memory_stats(), "worker idle");
    go_tx.send(()).unwrap();
    w.join().unwrap();
    m.check(&a.memory_stats(), "worker exited");
    a.empty_cache().unwrap();
    m.check(&a.memory_stats(), "worker exited, drained");
    check_invariants(&a, Some(&sim));
}

/// Many threads at once, each alternating runs of sizes of both kinds; several readers meanwhile.
/// At the end (all joined) every total is exact.
#[test]
fn concurrent_threads_totals_exact_at_the_end() {
    let (sim, a) = setup(1 << 33);
    let total = Arc::new(Mutex::new(Model::default()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let s = a.memory_stats();
                n += s.allocation.all.allocated;
                if n % 3 == 0 {
                    a.empty_cache().unwrap();
                }
                std::thread::yield_now();
            }
        })
    };
    let ws: Vec<_> = (0..6)
        .map(|t| {
            let (a, total) = (a.clone(), total.clone());
            std::thread::spawn(move || {
                let mut m = Model::default();
                let mut r = common::Rng(0x9e37 + t);
                for _ in 0..300 {
                    let (ask, rounded, small) = match r.below(5) {
                        0 => (4000, 4096, true),
                        1 => (512, 512, true),
                        2 => (3 * MIB + 100, 3 * MIB + 512, false),
                        3 => (4096, 4096, true),
                        _ => (12 * MIB, 12 * MIB, false),
                    };
                    let k = 1 + r.below(6);
                    pairs(&a, ask, k);
                    m.add(ask, rounded, small, k);
                }
                let mut t = total.lock().unwrap();
                for k in 0..2 {
                    t.n[k] += m.n[k];
                    t.bytes[k] += m.bytes[k];
                    t.req[k] += m.req[k];
                }
            })
        })
        .collect();
    for w in ws {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    let m = *total.lock().unwrap();
    // Block sizes may be larger than rounded when best fit leaves a rest too small to split
    // (12 MiB into a bigger free block): only counts and bytes asked for are modelled here.
    let s = a.memory_stats();
    assert_eq!(s.allocation.all.allocated, m.n[0] + m.n[1]);
    assert_eq!(s.allocation.small_pool.allocated, m.n[0]);
    assert_eq!(s.requested_bytes.small_pool.allocated, m.req[0]);
    assert_eq!(s.requested_bytes.large_pool.allocated, m.req[1]);
    assert_eq!(s.allocated_bytes.small_pool.allocated, m.bytes[0]);
    assert_eq!(s.allocation.all.current, 0);
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.requested_bytes.all.current, 0);
    a.empty_cache().unwrap();
    let s2 = a.memory_stats();
    assert_eq!(s2.allocation.all.allocated, s.allocation.all.allocated);
    assert_eq!(s2.inactive_split.all.allocated, s.inactive_split.all.allocated, "a drain changes no total");
    assert_eq!(s2.inactive_split_bytes.all.allocated, s.inactive_split_bytes.all.allocated);
    check_invariants(&a, Some(&sim));
}

/// A drain between take-backs of one record (memory_stats reads from another thread while
/// this one cycles one size) moves no total: the sum equals the model after every step.
#[test]
fn reads_between_take_backs_by_the_owner_are_exact() {
    let (sim, a) = setup(1 << 30);
    let mut m = Model::default();
    for i in 0..200u64 {
        let ask = [4000, 4000, 4000, 512, 3 * MIB + 100][(i % 5) as usize];
        let (rounded, small) = match ask {
            4000 => (4096, true),
            512 => (512, true),
            _ => (3 * MIB + 512, false),
        };
        pairs(&a, ask, 1 + i % 3);
        m.add(ask, rounded, small, 1 + i % 3);
        m.check(&a.memory_stats(), &format!("step {i}"));
        if i % 17 == 0 {
            a.reset_peak_stats();
        }
        if i % 23 == 0 {
            a.empty_cache().unwrap();
            m.check(&a.memory_stats(), &format!("step {i}, emptied"));
        }
    }
    check_invariants(&a, Some(&sim));
}

// ---------------------------------------------------------------------------------------------
// BARE (0fca16b): the flag must never say "no context" while one is set.
// ---------------------------------------------------------------------------------------------

/// Forgotten stream guard: the stream stays current for the rest of the thread (documented),
/// also after other guards come and go.
#[test]
fn forgotten_stream_guard_stays_current() {
    let (sim, a) = setup(1 << 30);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let s1 = sim.new_stream();
            let s2 = sim.new_stream();
            std::mem::forget(a.set_stream(&s1).unwrap());
            assert_eq!(a.alloc::<u8>(100).unwrap().stream_id(), s1.id);
            {
                let _g = a.set_stream(&s2).unwrap();
                assert_eq!(a.alloc::<u8>(100).unwrap().stream_id(), s2.id);
            }
            // The inner guard's drop saw one setting left: BARE must stay false.
            assert_eq!(a.current_stream(), s1);
            assert_eq!(a.alloc::<u8>(100).unwrap().stream_id(), s1.id);
            let p = MemPool::on(&a, PoolOptions::new()).unwrap();
            {
                let _s = p.scope();
                drop(a.alloc::<u8>(100).unwrap());
            }
            assert_eq!(p.memory_stats().allocation.allocated, 1);
            assert_eq!(a.alloc::<u8>(100).unwrap().stream_id(), s1.id);
        });
    });
}

/// Stream guards and pool scopes, of two allocators, ended out of order: after each step the
/// stream and pool of an allocation are those of the settings still alive.
#[test]
fn guards_and_scopes_out_of_order_across_allocators() {
    let (sim, a) = setup(1 << 30);
    let sim_b = SimDevice::with_index(0, 1 << 30);
    let b = Allocator::sim(sim_b.clone());
    let (pa, pb) = (MemPool::on(&a, PoolOptions::new()).unwrap(), MemPool::on(&b, PoolOptions::new()).unwrap());
    let s1 = sim.new_stream();
    let t1 = sim_b.new_stream();
    let count = |p: &MemPool<Sim>| p.memory_stats().allocation.allocated;
    let base = sim.default_stream().id;

    let ga = a.set_stream(&s1).unwrap();
    let sa = pa.scope(); // on s1
    let sb = pb.scope(); // on b's default stream
    let gb = b.set_stream(&t1).unwrap();
    // b's scope was on its default stream; b is now on t1: not routed.
    drop(b.alloc::<u8>(64).unwrap());
    assert_eq!(count(&pb), 0);
    let x = a.alloc::<u8>(64).unwrap();
    assert_eq!((x.stream_id(), count(&pa)), (s1.id, 1));
    drop(x);
    drop(ga); // a back on its default stream: pa's scope (on s1) no longer applies
    let x = a.alloc::<u8>(64).unwrap();
    assert_eq!((x.stream_id(), count(&pa)), (base, 1));
    drop(x);
    drop(gb); // b back on its default stream: pb's scope applies
    drop(b.alloc::<u8>(64).unwrap());
    assert_eq!(count(&pb), 1);
    drop(sb);
    drop(b.alloc::<u8>(64).unwrap());
    assert_eq!(count(&pb), 1);
    // Only pa's scope (s1) is left: a's allocations on s1 go there.
    {
        let _g = a.set_stream(&s1).unwrap();
        drop(a.alloc::<u8>(64).unwrap());
        assert_eq!(count(&pa), 2);
    }
    drop(sa);
    // Bare again: everything default; then a forgotten scope keeps routing.
    drop(a.alloc::<u8>(64).unwrap());
    assert_eq!(count(&pa), 2);
    std::mem::forget(pa.scope());
    drop(a.alloc::<u8>(64).unwrap());
    assert_eq!(count(&pa), 3);
    {
        let _g = a.set_stream(&s1).unwrap();
        drop(a.alloc::<u8>(64).unwrap());
        assert_eq!(count(&pa), 3);
    }
    drop(a.alloc::<u8>(64).unwrap());
    assert_eq!(count(&pa), 4, "a forgotten scope routes after a stream guard came and went");
    check_pool(&pa);
    check_pool(&pb);
}

/// A pool allocator that sets a stream and a scope (of another allocator) inside its `alloc`
/// and ends them there: after the call, this thread is bare again and its context as before.
#[test]
fn settings_made_and_ended_inside_a_pool_allocator() {
    let (sim, a) = setup(1 << 30);
    let sim_b = SimDevice::with_index(0, 1 << 30);
    let b = Allocator::sim(sim_b.clone());
    let pb = MemPool::on(&b, PoolOptions::new()).unwrap();
    let src = Addrs::default();
    let inner_counts = Arc::new(AtomicU64::new(0));
    {
        let (b, pb, t1, c) = (b.clone(), pb.clone(), sim_b.new_stream(), inner_counts.clone());
        *src.inside.lock().unwrap() = Some(Box::new(move || {
            let g = b.set_stream(&t1).unwrap();
            let s = pb.scope_on(&t1).unwrap();
            let x = b.alloc::<u8>(128).unwrap();
            assert_eq!(x.stream_id(), t1.id);
            c.fetch_add(1, Ordering::SeqCst);
            drop(x);
            drop(g);
            drop(s);
        }));
    }
    let pa = MemPool::on(&a, PoolOptions::new().allocator(src)).unwrap();
    {
        let _s = pa.scope();
        let x = a.alloc::<u8>(4096).unwrap();
        drop(x);
    }
    assert_eq!(inner_counts.load(Ordering::SeqCst), 1);
    assert_eq!(pa.memory_stats().allocation.allocated, 1);
    // Inside the source, routes are set aside (in_source): b's allocation was in b's own
    // scope? It was inside a's pool allocator: routes are set aside there, so not pb.
    let inside_pb = pb.memory_stats().allocation.allocated;
    // Back outside: bare.
    let x = b.alloc::<u8>(64).unwrap();
    assert_eq!(x.stream_id(), sim_b.default_stream().id);
    drop(x);
    assert_eq!(pb.memory_stats().allocation.allocated, inside_pb, "b's allocation outside went to its pool");
    let y = a.alloc::<u8>(64).unwrap();
    assert_eq!(y.stream_id(), sim.default_stream().id);
    drop(y);
    assert_eq!(pa.memory_stats().allocation.allocated, 1, "a's allocation outside went to its pool");
}

/// The documented behaviour of scopes inside a pool allocator's alloc: routes are set aside.
/// A scope made *inside* the source on the source's own allocator routes nothing there, and
/// nothing leaks out of it.
#[test]
fn scope_inside_own_pool_allocator_is_set_aside_and_ends() {
    let (_sim, a) = setup(1 << 30);
    let src = Addrs::default();
    let slot: Arc<Mutex<Option<MemPool<Sim>>>> = Arc::new(Mutex::new(None));
    let seen = Arc::new(Mutex::new(Vec::new()));
    {
        let (a, slot, seen) = (a.clone(), slot.clone(), seen.clone());
        *src.inside.lock().unwrap() = Some(Box::new(move || {
            let p = slot.lock().unwrap().clone();
            if let Some(p) = p {
                let _s = p.scope();
                let before = p.memory_stats().allocation.allocated;
                drop(a.alloc::<u8>(64).unwrap());
                seen.lock().unwrap().push(p.memory_stats().allocation.allocated - before);
            }
        }));
    }
    let pa = MemPool::on(&a, PoolOptions::new().allocator(src)).unwrap();
    *slot.lock().unwrap() = Some(pa.clone());
    {
        let _s = pa.scope();
        drop(a.alloc::<u8>(4096).unwrap());
    }
    assert_eq!(*seen.lock().unwrap(), vec![0], "inside the source, its scope is set aside");
    let n = pa.memory_stats().allocation.allocated;
    drop(a.alloc::<u8>(64).unwrap());
    assert_eq!(pa.memory_stats().allocation.allocated, n, "no route left after the source returned");
    *slot.lock().unwrap() = None;
}

/// Settings made in a thread-local destructor: before the context is gone they apply; a
/// destructor running after it gets the default stream (documented), never a stale one, and
/// nothing panics.
#[test]
fn settings_in_thread_local_destructors() {
    let (sim, a) = setup(1 << 30);
    struct OnExit(Box<dyn FnMut()>);
    impl Drop for OnExit {
        fn drop(&mut self) {
            (self.0)();
        }
    }
    thread_local! {
        static EARLY: std::cell::RefCell<Option<OnExit>> = const { std::cell::RefCell::new(None) };
        static LATE: std::cell::RefCell<Option<OnExit>> = const { std::cell::RefCell::new(None) };
    }
    let results = Arc::new(Mutex::new(Vec::new()));
    let (a2, sim2, r2) = (a.clone(), sim.clone(), results.clone());
    std::thread::spawn(move || {
        // Registered before the allocator's thread-locals: destroyed after them.
        common::at_exit_first();
        let s1 = sim2.new_stream();
        let (a3, r3, s1c) = (a2.clone(), r2.clone(), s1);
        common::at_exit(move || {
            // The context is gone: set_stream fails or routes nothing; allocations use the default stream.
            let g = a3.set_stream(&s1c);
            let x = a3.alloc::<u8>(100).unwrap();
            r3.lock().unwrap().push(("after", x.stream_id() == s1c.id, g.is_ok()));
            drop(x);
            drop(g);
            let x = a3.alloc::<u8>(100).unwrap();
            r3.lock().unwrap().push(("after, again", x.stream_id() == s1c.id, true));
        });
        // A forgotten guard, so BARE is false when the context goes.
        std::mem::forget(a2.set_stream(&s1).unwrap());
        let x = a2.alloc::<u8>(100).unwrap();
        assert_eq!(x.stream_id(), s1.id);
        drop(x);
        // Registered after the context (first use of the allocator is above): destroyed before it.
        let (a4, r4) = (a2.clone(), r2.clone());
        let s2 = sim2.new_stream();
        EARLY.with(|e| {
            *e.borrow_mut() = Some(OnExit(Box::new(move || {
                let g = a4.set_stream(&s2).unwrap();
                let x = a4.alloc::<u8>(100).unwrap();
                r4.lock().unwrap().push(("before", x.stream_id() == s2.id, true));
                drop(x);
                drop(g);
                let x = a4.alloc::<u8>(100).unwrap();
                r4.lock().unwrap().push(("before, guard gone", x.stream_id() == s1.id, true));
            })))
        });
        let _ = &LATE;
    })
    .join()
    .unwrap();
    let r = results.lock().unwrap().clone();
    // "before": the context is alive: the guard's stream; then the forgotten guard's.
    assert!(r.contains(&("before", true, true)), "{r:?}");
    assert!(r.contains(&("before, guard gone", true, true)), "{r:?}");
    // "after": the default stream.
    for e in r.iter().filter(|e| e.0.starts_with("after")) {
        assert!(!e.1, "an allocation after the context was gone used a stale stream: {r:?}");
    }
    let s = a.memory_stats();
    assert_eq!(s.allocation.all.current, 0);
    a.empty_cache().unwrap();
    check_invariants(&a, Some(&sim));
}

/// A `Scoped` future: between polls the thread is bare; during a poll routed. A panic inside
/// a poll (the scope unwinds) leaves the thread bare.
#[test]
fn scoped_future_polls_and_panics() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let (_sim, a) = setup(1 << 30);
    let p = MemPool::on(&a, PoolOptions::new()).unwrap();
    struct Step<'a>(&'a Allocator<Sim>, u32, bool);
    impl Future for Step<'_> {
        type Output = ();
        fn poll(mut self: std::pin::Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            drop(self.0.alloc::<u8>(64).unwrap());
            self.1 += 1;
            if self.2 && self.1 == 2 {
                panic!("boom");
            }
            if self.1 == 3 {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }
    }
    let mut f = p.scoped(Step(&a, 0, false));
    let mut cx = Context::from_waker(Waker::noop());
    let mut polls = 0;
    loop {
        polls += 1;
        let r = std::pin::Pin::new(&mut f).poll(&mut cx);
        drop(a.alloc::<u8>(64).unwrap()); // outside: default pool
        if r.is_ready() {
            break;
        }
    }
    assert_eq!(polls, 3);
    assert_eq!(p.memory_stats().allocation.allocated, 3);
    let mut f = p.scoped(Step(&a, 0, true));
    let _ = std::pin::Pin::new(&mut f).poll(&mut cx);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| std::pin::Pin::new(&mut f).poll(&mut cx)));
    assert!(r.is_err());
    drop(a.alloc::<u8>(64).unwrap());
    assert_eq!(p.memory_stats().allocation.allocated, 5, "after the panic the scope is gone");
    let _ = Cell::new(0);
}

/// A panic while a stream guard and a scope are alive (unwinding drops them): bare again after.
#[test]
fn unwinding_through_guards_leaves_the_thread_bare() {
    let (sim, a) = setup(1 << 30);
    let p = MemPool::on(&a, PoolOptions::new()).unwrap();
    let s1 = sim.new_stream();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _g = a.set_stream(&s1).unwrap();
        let _s = p.scope_on(&s1).unwrap();
        drop(a.alloc::<u8>(64).unwrap());
        panic!("boom");
    }));
    assert!(r.is_err());
    let x = a.alloc::<u8>(64).unwrap();
    assert_eq!(x.stream_id(), sim.default_stream().id);
    assert_eq!(p.memory_stats().allocation.allocated, 1);
    drop(x);
    // The hot path after the panic takes back cached blocks of the right stream only.
    let y = a.alloc::<u8>(64).unwrap();
    assert_eq!(y.stream_id(), sim.default_stream().id);
}

/// A stream guard of allocator A made while a pool scope of allocator B is alive on B's
/// default stream; dropping B's scope first leaves A's stream; dropping A's guard then leaves
/// the thread bare: caches keyed by stream hand out blocks of the right stream each time.
#[test]
fn cached_blocks_follow_the_current_stream_through_bare_transitions() {
    let (sim, a) = setup(1 << 30);
    let s1 = sim.new_stream();
    for _ in 0..3 {
        // Cache a block on the default stream and one on s1.
        drop(a.alloc::<u8>(4096).unwrap());
        {
            let _g = a.set_stream(&s1).unwrap();
            drop(a.alloc::<u8>(4096).unwrap());
        }
        let x = a.alloc::<u8>(4096).unwrap();
        assert_eq!(x.stream_id(), sim.default_stream().id);
        let g = a.set_stream(&s1).unwrap();
        let y = a.alloc::<u8>(4096).unwrap();
        assert_eq!(y.stream_id(), s1.id);
        drop(g);
        let z = a.alloc::<u8>(4096).unwrap();
        assert_eq!(z.stream_id(), sim.default_stream().id);
        drop((x, y, z));
    }
    a.empty_cache().unwrap();
    check_invariants(&a, Some(&sim));
}

/// Two allocators on one thread with thread caches; a config without caches for one: totals of
/// both stay exact (separate counters per allocator).
#[test]
fn allocator_without_cache_next_to_one_with() {
    let (sim, a) = setup(1 << 30);
    let sim_b = SimDevice::with_index(0, 1 << 30);
    let b = Allocator::sim_with(sim_b.clone(), Config::builder().thread_cache(false).build().unwrap());
    let (mut ma, mut mb) = (Model::default(), Model::default());
    for i in 0..40 {
        let ask = if i % 4 == 0 { 512 } else { 4000 };
        let r = if ask == 512 { 512 } else { 4096 };
        pairs(&a, ask, 2);
        ma.add(ask, r, true, 2);
        pairs(&b, ask, 1);
        mb.add(ask, r, true, 1);
    }
    ma.check(&a.memory_stats(), "a");
    mb.check(&b.memory_stats(), "b");
    check_invariants(&a, Some(&sim));
    check_invariants(&b, Some(&sim_b));
}

/// The same (size, bytes asked for) whose split flag alone differs between deferred frees
/// taken back: 12 MiB carved from a 20 MiB segment (split: its free counts inactive-split) and
/// 12 MiB in a segment of its own (unsplit: never inactive-split). Each free-and-take-back of
/// the split one adds one to the inactive-split total (12 MiB to its bytes), of the unsplit
/// one nothing.
#[test]
fn split_flag_alone_changes_between_take_backs() {
    let (sim, a) = setup(1 << 32);
    let hold = a.alloc::<u8>(4 * MIB).unwrap(); // a 20 MiB segment: 4 MiB + 16 MiB free
    let mut y = a.alloc::<u8>(12 * MIB).unwrap(); // from the 16 MiB: split
    let mut z = a.alloc::<u8>(12 * MIB).unwrap(); // a segment of its own: unsplit
    let mut m = Model::default();
    m.add(4 * MIB, 4 * MIB, false, 1);
    m.add(12 * MIB, 12 * MIB, false, 2);
    let (mut ny, mut nz) = (0u64, 0u64);
    let want = |s: &MemoryStats, ny: u64, what: &str| {
        assert_eq!(s.inactive_split.large_pool.allocated, 1 + ny, "{what}: inactive-split blocks");
        assert_eq!(
            s.inactive_split_bytes.large_pool.allocated,
            (16 * MIB) as u64 + ny * (12 * MIB) as u64,
            "{what}: inactive-split bytes"
        );
    };
    for round in 0..3 {
        // Re-arm deferral (a read drained the caches) without touching the large free set.
        pairs(&a, 4000, 70);
        m.add(4000, 4096, true, 70);
        let keep = a.alloc::<u8>(4000).unwrap();
        m.add(4000, 4096, true, 1);
        for i in 0..8 {
            // Unsplit first in odd rounds.
            if (i + round) % 2 == 0 {
                drop(y);
                y = a.alloc::<u8>(12 * MIB).unwrap();
                ny += 1;
            } else {
                drop(z);
                z = a.alloc::<u8>(12 * MIB).unwrap();
                nz += 1;
            }
            m.add(12 * MIB, 12 * MIB, false, 1);
        }
        // Runs of one, then the other.
        for _ in 0..3 {
            drop(z);
            z = a.alloc::<u8>(12 * MIB).unwrap();
            nz += 1;
            m.add(12 * MIB, 12 * MIB, false, 1);
        }
        for _ in 0..2 {
            drop(y);
            y = a.alloc::<u8>(12 * MIB).unwrap();
            ny += 1;
            m.add(12 * MIB, 12 * MIB, false, 1);
        }
        for _ in 0..3 {
            drop(z);
            z = a.alloc::<u8>(12 * MIB).unwrap();
            nz += 1;
            m.add(12 * MIB, 12 * MIB, false, 1);
        }
        let s = a.memory_stats();
        m.check(&s, &format!("round {round}"));
        want(&s, ny, &format!("round {round}"));
        check_invariants(&a, Some(&sim));
        drop(keep);
    }
    // A free of the unsplit one pending while read (and of the split one).
    pairs(&a, 4000, 70);
    m.add(4000, 4096, true, 70);
    let keep = a.alloc::<u8>(4000).unwrap();
    m.add(4000, 4096, true, 1);
    drop(y);
    y = a.alloc::<u8>(12 * MIB).unwrap();
    ny += 1;
    m.add(12 * MIB, 12 * MIB, false, 1);
    drop(z);
    let s = a.memory_stats();
    m.check(&s, "z pending");
    check_invariants(&a, Some(&sim));
    assert!(nz > 0 && ny > 0);
    drop((y, hold, keep));
    a.empty_cache().unwrap();
    m.check(&a.memory_stats(), "end");
    check_invariants(&a, Some(&sim));
}
