//! The reliability campaign on the simulated device: long random sequences over several streams
//! and pools (device memory and user allocators), scopes, cross-stream uses, `empty_cache`, pool
//! release and injected faults (device and user allocations failing or returning null, user frees
//! failing, event queries failing). After every step: the block table tiles the segments, stats
//! equal their recomputation, every segment of a user pool is live in its own allocator, and
//! nothing was ever freed through another free function. A failing sequence is shrunk to a
//! minimal one and printed, to be kept below as a regression test.
//!
//! `MEMPOOL_RELIABILITY_OPS=1000000 cargo test --release -p cuda-mempool --test reliability` runs the
//! full campaign; CI runs a shorter one.

mod common;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use common::{check_invariants, check_pool, Rng};
use mempool::sim::{SimDevice, SimStream};
use mempool::{Allocator, BackendError, Buffer, Error, MemPool, PoolOptions, RawAllocator, Sim, StreamId};

const MIB: usize = 1 << 20;

#[derive(Default)]
struct Ledger {
    live: BTreeMap<u64, usize>,
    next: u64,
    fail_allocs: usize,
    hard: bool,
    fail_frees: usize,
    foreign_frees: Vec<u64>,
}

/// A user allocator over its own address range that records what it holds and any free of
/// something it never gave.
#[derive(Clone)]
struct Tracking {
    base: u64,
    ledger: Arc<Mutex<Ledger>>,
    granularity: usize,
}

impl Tracking {
    fn new(k: u64, granularity: usize) -> Tracking {
        Tracking { base: 0x7000_0000_0000 + (k << 40), ledger: Arc::default(), granularity }
    }
    fn owns(&self, addr: u64) -> bool {
        addr >= self.base && addr < self.base + (1 << 40)
    }
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }
}

// SAFETY: only ever used with simulated allocators, whose memory is never read or written;
// the addresses it makes up are distinct, granularity-aligned ranges, each handed out once.
unsafe impl RawAllocator for Tracking {
    fn name(&self) -> &str {
        "tracking"
    }
    fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        let mut l = self.ledger();
        if l.fail_allocs > 0 {
            l.fail_allocs -= 1;
            return if l.hard { Err(BackendError::Failed("injected".into())) } else { Ok(0) };
        }
        if l.live.values().sum::<usize>() + size > 96 * MIB {
            return Err(BackendError::OutOfMemory);
        }
        let addr = self.base + l.next;
        l.next += (size as u64).next_multiple_of(2 << 20);
        l.live.insert(addr, size);
        Ok(addr)
    }
    unsafe fn free(&self, ptr: u64, size: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        let mut l = self.ledger();
        if l.fail_frees > 0 {
            l.fail_frees -= 1;
            return Err(BackendError::Failed("injected free failure".into()));
        }
        if l.live.get(&ptr) != Some(&size) {
            l.foreign_frees.push(ptr);
            return Ok(());
        }
        l.live.remove(&ptr);
        Ok(())
    }
    fn granularity(&self) -> usize {
        self.granularity
    }
}

/// One step of a sequence.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    /// `route`: 0 the default pools, 1..=3 inside a scope of pool `route-1`, 4..=6 explicitly from pool `route-4`.
    Alloc {
        size: usize,
        stream: u8,
        route: u8,
    },
    Free {
        slot: u16,
    },
    Record {
        slot: u16,
        stream: u8,
    },
    Complete {
        stream: u8,
    },
    EmptyCache,
    EmptyPool(u8),
    ReleasePool(u8),
    FailDeviceAlloc,
    FailUserAlloc {
        pool: u8,
        hard: bool,
    },
    FailUserFree {
        pool: u8,
    },
    FailQuery,
    Raw {
        size: usize,
    },
    BadFree,
}

fn generate(seed: u64, n: usize) -> Vec<Op> {
    let mut r = Rng(seed);
    (0..n)
        .map(|_| match r.below(1000) {
            0..=419 => {
                let size = if r.below(6) == 0 { r.size(26) } else { r.size(20) };
                Op::Alloc { size, stream: r.below(3) as u8, route: r.below(7) as u8 }
            }
            420..=799 => Op::Free { slot: r.below(400) as u16 },
            800..=869 => Op::Record { slot: r.below(400) as u16, stream: r.below(3) as u8 },
            870..=939 => Op::Complete { stream: r.below(3) as u8 },
            940..=949 => Op::EmptyCache,
            950..=959 => Op::EmptyPool(r.below(3) as u8),
            960..=964 => Op::ReleasePool(r.below(3) as u8),
            965..=969 => Op::FailDeviceAlloc,
            970..=974 => Op::FailUserAlloc { pool: 1 + r.below(2) as u8, hard: r.below(2) == 0 },
            975..=979 => Op::FailUserFree { pool: 1 + r.below(2) as u8 },
            980..=984 => Op::FailQuery,
            985..=994 => Op::Raw { size: r.size(16) },
            _ => Op::BadFree,
        })
        .collect()
}

struct World {
    sim: Arc<SimDevice>,
    a: Allocator<Sim>,
    streams: Vec<SimStream>,
    pools: Vec<MemPool<Sim>>,
    trackers: Vec<Option<Tracking>>,
    retired: Vec<Tracking>,
    live: Vec<Buffer<u8, Sim>>,
    made: u64,
    /// What the sequence did: allocations, each error kind, pool releases, cross-stream frees.
    tally: BTreeMap<&'static str, u64>,
}

impl World {
    fn new() -> World {
        let sim = SimDevice::new(192 * MIB);
        let a = Allocator::sim(sim.clone());
        let streams = vec![sim.default_stream(), sim.new_stream(), sim.new_stream()];
        let mut w = World {
            sim,
            a,
            streams,
            pools: Vec::new(),
            trackers: Vec::new(),
            retired: Vec::new(),
            live: Vec::new(),
            made: 0,
            tally: BTreeMap::new(),
        };
        for p in 0..3 {
            let (pool, t) = w.make_pool(p);
            w.pools.push(pool);
            w.trackers.push(t);
        }
        w
    }

    /// Pool 0: device memory, lends on OOM. Pool 1: a user allocator. Pool 2: a user allocator,
    /// whole-segment blocks, 2 MiB granularity.
    fn make_pool(&mut self, p: usize) -> (MemPool<Sim>, Option<Tracking>) {
        self.made += 1;
        match p {
            0 => (MemPool::on(&self.a, PoolOptions::new().use_on_oom(true)).unwrap(), None),
            1 => {
                let t = Tracking::new(self.made, 512);
                (MemPool::on(&self.a, PoolOptions::new().allocator(t.clone())).unwrap(), Some(t))
            }
            _ => {
                let t = Tracking::new(self.made, 2 * MIB);
                (MemPool::on(&self.a, PoolOptions::new().allocator(t.clone()).no_split(true)).unwrap(), Some(t))
            }
        }
    }

    fn step(&mut self, op: Op) -> Result<(), String> {
        let tally = std::cell::RefCell::new(std::mem::take(&mut self.tally));
        let ok_err = |e: Error| {
            let kind = match e {
                Error::OutOfMemory(_) => "error: out of memory",
                Error::PoolAllocator { .. } => "error: user allocator failed",
                Error::Backend { .. } => "error: backend (kept from a Drop, or injected)",
                other => return Err(format!("unexpected error: {other}")),
            };
            *tally.borrow_mut().entry(kind).or_default() += 1;
            Ok(())
        };
        let r = self.step_inner(op, &ok_err);
        let mut t = tally.into_inner();
        *t.entry(match op {
            Op::Alloc { .. } => "op: alloc",
            Op::Free { .. } => "op: free",
            Op::Record { .. } => "op: record_stream",
            Op::Complete { .. } => "op: complete a stream",
            Op::EmptyCache => "op: empty_cache",
            Op::EmptyPool(_) => "op: pool empty_cache",
            Op::ReleasePool(_) => "op: release a pool",
            Op::FailDeviceAlloc => "fault: device alloc",
            Op::FailUserAlloc { .. } => "fault: user alloc",
            Op::FailUserFree { .. } => "fault: user free",
            Op::FailQuery => "fault: event query",
            Op::Raw { .. } => "op: raw alloc/free",
            Op::BadFree => "misuse: foreign free",
        })
        .or_default() += 1;
        self.tally = t;
        r
    }

    fn step_inner(&mut self, op: Op, ok_err: &dyn Fn(Error) -> Result<(), String>) -> Result<(), String> {
        // Bounded live set: the invariant checks walk every block after every step.
        let op = match op {
            Op::Alloc { size, .. } if self.live.len() >= 300 => Op::Free { slot: size as u16 },
            other => other,
        };
        match op {
            Op::Alloc { size, stream, route } => {
                let s = self.streams[stream as usize];
                let _g = self.a.set_stream(&s).map_err(|e| e.to_string())?;
                let r = match route {
                    0 => self.a.alloc::<u8>(size),
                    1..=3 => {
                        let _scope = self.pools[route as usize - 1].scope();
                        self.a.alloc::<u8>(size)
                    }
                    _ => self.pools[route as usize - 4].alloc::<u8>(size),
                };
                match r {
                    Ok(b) => {
                        if b.stream_id() != s.id {
                            return Err("allocated on the wrong stream".into());
                        }
                        self.live.push(b);
                    }
                    Err(e) => ok_err(e)?,
                }
            }
            Op::Free { slot } if !self.live.is_empty() => {
                let i = slot as usize % self.live.len();
                drop(self.live.swap_remove(i));
            }
            Op::Record { slot, stream } if !self.live.is_empty() => {
                let i = slot as usize % self.live.len();
                self.live[i].record_stream(&self.streams[stream as usize]).map_err(|e| e.to_string())?;
            }
            Op::Complete { stream } => self.sim.complete_stream(self.streams[stream as usize]),
            Op::EmptyCache => {
                if let Err(e) = self.a.empty_cache() {
                    ok_err(e)?
                }
            }
            Op::EmptyPool(p) => {
                if let Err(e) = self.pools[p as usize].empty_cache() {
                    ok_err(e)?
                }
            }
            Op::ReleasePool(p) => {
                let (pool, t) = self.make_pool(p as usize);
                drop(std::mem::replace(&mut self.pools[p as usize], pool));
                if let Some(old) = std::mem::replace(&mut self.trackers[p as usize], t) {
                    self.retired.push(old);
                }
            }
            Op::FailDeviceAlloc => self.sim.fail_next_allocs(1),
            Op::FailUserAlloc { pool, hard } => {
                if let Some(t) = &self.trackers[pool as usize] {
                    let mut l = t.ledger();
                    l.fail_allocs = 1;
                    l.hard = hard;
                }
            }
            Op::FailUserFree { pool } => {
                if let Some(t) = &self.trackers[pool as usize] {
                    t.ledger().fail_frees = 1;
                }
            }
            Op::FailQuery => self.sim.fail_next_event_queries(1),
            Op::Raw { size } => match self.a.alloc_bytes(size) {
                Ok(p) => {
                    self.a.free_bytes(p).map_err(|e| e.to_string())?;
                }
                Err(e) => ok_err(e)?,
            },
            Op::BadFree => {
                let before = self.a.memory_stats();
                if self.a.free_bytes(0x5555_5555_0000).is_ok() {
                    return Err("a foreign free was accepted".into());
                }
                if self.a.memory_stats() != before {
                    return Err("a rejected free changed the stats".into());
                }
            }
            Op::Free { .. } | Op::Record { .. } => {}
        }
        // A released pool never allocates again: once its allocator holds nothing, it is done.
        self.retired.retain(|t| !t.ledger().live.is_empty());
        self.check()
    }

    fn trackers(&self) -> impl Iterator<Item = &Tracking> {
        self.trackers.iter().flatten().chain(&self.retired)
    }

    fn check(&self) -> Result<(), String> {
        let (a, sim) = (&self.a, &self.sim);
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            check_invariants(a, Some(sim));
            for p in &self.pools {
                check_pool(p);
            }
        }))
        .map_err(panic_text)?;
        let snap = self.a.snapshot();
        for t in self.trackers() {
            let l = t.ledger();
            if !l.foreign_frees.is_empty() {
                return Err(format!("freed through the wrong free function: {:#x?}", l.foreign_frees));
            }
            let mine: BTreeMap<u64, usize> =
                snap.segments.iter().filter(|s| t.owns(s.address)).map(|s| (s.address, s.total_size)).collect();
            if mine != l.live {
                return Err(format!("a user allocator holds {:?}, its pool's segments are {mine:?}", l.live));
            }
        }
        Ok(())
    }

    /// Frees everything and checks that every byte went back where it came from.
    fn finish(mut self) -> Result<(), String> {
        let retired_at_end = self.retired.clone();
        self.live.clear();
        self.sim.complete_all();
        for t in self.trackers.iter().flatten() {
            t.ledger().fail_frees = 0;
        }
        for t in &self.retired {
            t.ledger().fail_frees = 0;
        }
        let pools = std::mem::take(&mut self.pools);
        drop(pools);
        // Errors kept from injected failures may surface once more; the second pass must be clean.
        let _ = self.a.empty_cache();
        self.a.empty_cache().map_err(|e| format!("final empty_cache: {e}"))?;
        self.check()?;
        if self.a.memory_stats().reserved_bytes.all.current != 0 {
            return Err(format!(
                "{} bytes still reserved at the end",
                self.a.memory_stats().reserved_bytes.all.current
            ));
        }
        for t in self.trackers().chain(&retired_at_end) {
            if !t.ledger().live.is_empty() {
                return Err(format!("a user allocator still holds {:?} at the end", t.ledger().live));
            }
        }
        Ok(())
    }
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// Runs a sequence; the first failure, with its step. On success, what it did.
fn run(ops: &[Op]) -> Result<BTreeMap<&'static str, u64>, String> {
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let mut w = World::new();
        for (i, op) in ops.iter().enumerate() {
            w.step(*op).map_err(|e| format!("step {i} ({op:?}): {e}"))?;
        }
        let tally = w.tally.clone();
        w.finish().map(|()| tally)
    }));
    outcome.map_err(panic_text)?
}

/// Removes ever smaller chunks of a failing sequence while it keeps failing.
fn shrink(mut ops: Vec<Op>) -> Vec<Op> {
    let mut chunk = ops.len() / 2;
    while chunk >= 1 {
        let mut i = 0;
        while i < ops.len() {
            let mut candidate = ops.clone();
            candidate.drain(i..(i + chunk).min(ops.len()));
            if run(&candidate).is_err() {
                ops = candidate;
            } else {
                i += chunk;
            }
        }
        chunk /= 2;
    }
    ops
}

fn campaign(seed: u64, n: usize) {
    let ops = generate(seed, n);
    let r = run(&ops);
    if let Ok(tally) = &r {
        eprintln!("seed {seed}, {n} steps: {tally:?}");
    }
    if let Err(e) = r {
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let minimal = shrink(ops);
        std::panic::set_hook(hook);
        let why = run(&minimal).err().unwrap_or_default();
        panic!("seed {seed} failed: {e}\nminimal sequence ({} steps), keep it as a regression test:\n{minimal:?}\nfails with: {why}", minimal.len());
    }
}

fn ops_from_env(default: usize) -> usize {
    std::env::var("MEMPOOL_RELIABILITY_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn random_campaign_with_pools_scopes_and_faults() {
    let n = ops_from_env(15_000);
    for seed in [11, 12, 13, 14] {
        campaign(seed, n / 4);
    }
}

#[test]
fn shrinking_finds_a_minimal_sequence() {
    // A property that fails as soon as two buffers are live at once: the shrinker must bring a
    // long random sequence down to the two allocations that break it.
    let ops = generate(99, 300);
    let broken = |ops: &[Op]| ops.iter().filter(|o| matches!(o, Op::Alloc { route: 0, .. })).count() >= 2;
    assert!(broken(&ops));
    let mut cur = ops;
    let mut chunk = cur.len() / 2;
    while chunk >= 1 {
        let mut i = 0;
        while i < cur.len() {
            let mut c = cur.clone();
            c.drain(i..(i + chunk).min(cur.len()));
            if broken(&c) {
                cur = c;
            } else {
                i += chunk;
            }
        }
        chunk /= 2;
    }
    assert_eq!(cur.len(), 2);
}

#[test]
fn eight_threads_share_pools_and_enter_scopes_concurrently() {
    const THREADS: usize = 8;
    let ops: usize = ops_from_env(800_000) / THREADS;
    let sim = SimDevice::new(8192 * MIB);
    let a = Allocator::sim(sim.clone());
    let tracker = Tracking::new(1, 512);
    let pools = Arc::new(vec![
        MemPool::on(&a, PoolOptions::new()).unwrap(),
        MemPool::on(&a, PoolOptions::new().allocator(tracker.clone())).unwrap(),
    ]);
    let streams: Arc<Vec<SimStream>> = Arc::new(vec![sim.default_stream(), sim.new_stream(), sim.new_stream()]);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, sim, pools, streams, done) =
                (a.clone(), sim.clone(), pools.clone(), streams.clone(), done_tx.clone());
            std::thread::spawn(move || {
                let mut r = Rng(500 + t as u64);
                let mut live: Vec<Buffer<u8, Sim>> = Vec::new();
                let handle = pools[t % 2].scope_handle();
                for _ in 0..ops {
                    match r.below(12) {
                        0..=2 => live.extend(a.alloc::<u8>(r.size(18)).ok()),
                        3..=4 => {
                            let _scope = pools[r.below(2) as usize].scope();
                            live.extend(a.alloc::<u8>(r.size(18)).ok());
                        }
                        5 => {
                            let _scope = handle.enter();
                            live.extend(a.alloc::<u8>(r.size(16)).ok());
                        }
                        6..=9 if !live.is_empty() => {
                            drop(live.swap_remove(r.below(live.len() as u64) as usize));
                        }
                        10 => {
                            if let Some(b) = live.last() {
                                b.record_stream(&streams[r.below(3) as usize]).unwrap();
                            }
                            sim.complete_stream(streams[r.below(3) as usize]);
                        }
                        _ => {
                            if r.below(50) == 0 {
                                let _ = pools[r.below(2) as usize].empty_cache();
                            }
                        }
                    }
                }
                done.send(()).unwrap();
                live
            })
        })
        .collect();
    drop(done_tx);
    for _ in 0..THREADS {
        done_rx.recv_timeout(std::time::Duration::from_secs(600)).expect("a thread did not finish: deadlock?");
    }
    let mut all: Vec<Buffer<u8, Sim>> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    let mut spans: Vec<(u64, u64)> =
        all.iter().map(|b| (b.device_ptr_raw(), b.device_ptr_raw() + b.num_bytes() as u64)).collect();
    spans.sort_unstable();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "live buffers overlap");
    check_invariants(&a, Some(&sim));
    for p in pools.iter() {
        check_pool(p);
    }
    all.clear();
    sim.complete_all();
    drop(pools);
    a.empty_cache().unwrap();
    check_invariants(&a, Some(&sim));
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
    assert!(tracker.ledger().live.is_empty(), "the user pool kept segments after release");
    assert!(tracker.ledger().foreign_frees.is_empty());
}
