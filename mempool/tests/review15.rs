//! Hostile review 15 probes: memory an expandable request mapped and did not take goes back
//! (`State::give_back_runs`), at once or when the last capture ends. It found that the runs
//! kept for the end of a capture were unmapped then although a graph held their pool and a
//! capture had used them for a temporary (the `a_…` tests: failed every run; fixed in
//! `give_back_runs_after_capture`, which leaves a held pool's runs alone); the other probes
//! held up.
mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::watch::within;
use common::{all_given_back, check_invariants, sim_with};
use mempool::sim::SimDevice;
use mempool::trace::{self, Action};
use mempool::{Allocator, CaptureMode, MapGuard, MemPool, PoolOptions, Sim};

const MIB: usize = 1 << 20;

/// A guard keeping its own ledger; can fail the device's map at position `fail_at` of its
/// count (by arming `fail_next_maps` from inside `mapped`), veto, or panic.
#[derive(Clone, Default)]
struct Ledger {
    sim: Arc<Mutex<Option<Arc<SimDevice>>>>,
    mapped: Arc<Mutex<BTreeSet<(u64, usize)>>>,
    dup_maps: Arc<AtomicUsize>,
    unknown_unmaps: Arc<AtomicUsize>,
    seen_maps: Arc<AtomicUsize>,
    fail_at: Arc<AtomicUsize>, // usize::MAX: never
    veto: Arc<AtomicBool>,
    panic_unmap: Arc<AtomicBool>,
}

impl Ledger {
    fn new(sim: &Arc<SimDevice>) -> Ledger {
        let l = Ledger::default();
        *l.sim.lock().unwrap() = Some(sim.clone());
        l.fail_at.store(usize::MAX, Ordering::Relaxed);
        l
    }
    fn check(&self, sim: &SimDevice) {
        assert_eq!(self.dup_maps.load(Ordering::Relaxed), 0, "guard told twice of a map");
        assert_eq!(self.unknown_unmaps.load(Ordering::Relaxed), 0, "guard asked of an unmap it never saw mapped");
        let mine: Vec<_> = self.mapped.lock().unwrap().iter().copied().collect();
        for (a, n) in &mine {
            assert!(sim.is_mapped(*a, *n), "guard believes {a:#x} ({n}) mapped; device disagrees");
        }
    }
}

impl MapGuard for Ledger {
    fn mapped(&self, addr: u64, size: usize) {
        if !self.mapped.lock().unwrap().insert((addr, size)) {
            self.dup_maps.fetch_add(1, Ordering::Relaxed);
        }
        let n = self.seen_maps.fetch_add(1, Ordering::Relaxed) + 1;
        if n == self.fail_at.load(Ordering::Relaxed) {
            if let Some(s) = self.sim.lock().unwrap().as_ref() {
                s.fail_next_maps(1);
            }
        }
    }
    fn unmapping(&self, addr: u64, size: usize) -> Result<(), String> {
        if self.panic_unmap.load(Ordering::Relaxed) {
            panic!("guard panics on unmap");
        }
        if self.veto.load(Ordering::Relaxed) {
            return Err("held".into());
        }
        if !self.mapped.lock().unwrap().remove(&(addr, size)) {
            self.unknown_unmaps.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Map/unmap balance seen by the hooks, for one allocator.
struct HookLedger {
    _h: trace::TraceHandle,
    live: Arc<Mutex<BTreeSet<(u64, usize)>>>,
    errs: Arc<Mutex<Vec<String>>>,
}

fn hook_ledger(a: &Allocator<Sim>) -> HookLedger {
    let me = a.id();
    let live: Arc<Mutex<BTreeSet<(u64, usize)>>> = Default::default();
    let errs: Arc<Mutex<Vec<String>>> = Default::default();
    let (l, e) = (live.clone(), errs.clone());
    let h = trace::attach(move |t| {
        if t.allocator != me {
            return;
        }
        let wrong = match t.action {
            Action::SegmentMap => (!l.lock().unwrap().insert((t.addr, t.size))).then_some("map twice"),
            Action::SegmentUnmap => (!l.lock().unwrap().remove(&(t.addr, t.size))).then_some("unmap of unknown"),
            _ => None,
        };
        if let Some(w) = wrong {
            e.lock().unwrap().push(format!("{w} {:#x} {}", t.addr, t.size));
        }
    })
    .unwrap();
    HookLedger { _h: h, live, errs }
}

impl HookLedger {
    fn check(&self, sim: &SimDevice) {
        let e = self.errs.lock().unwrap().clone();
        assert!(e.is_empty(), "hooks unbalanced: {e:?}");
        let live: Vec<_> = self.live.lock().unwrap().iter().copied().collect();
        assert_eq!(live, sim.mapped(), "hooks' view of the mappings differs from the device's");
    }
}

// ------------------------------------------------------------------------------------------
// A. A run given back during a capture, used by the capture as a temporary (allocated and
//    freed inside it), is unmapped when the capture ends although a graph now holds the pool.
// ------------------------------------------------------------------------------------------
#[test]
fn a_graph_temporary_in_a_run_given_back_during_the_capture_stays_mapped() {
    let (sim, a) = sim_with(64 * MIB, "");
    within(30, "A", move || {
        let s = sim.new_stream();
        let x = a.alloc::<u8>(20 * MIB).unwrap();
        let gp = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
        let cur = a.set_stream(&s).unwrap();
        let cap = a.begin_capture(&s, &gp, CaptureMode::ThreadLocal).unwrap();
        let r = a.alloc::<u8>(60 * MIB);
        assert!(matches!(r, Err(mempool::Error::OutOfMemory(_))), "{r:?}");
        // The graph's temporary: allocated and freed during the capture.
        let t = a.alloc::<u8>(10 * MIB).unwrap();
        let addr = t.device_ptr_raw();
        assert!(sim.is_mapped(addr, 10 * MIB));
        drop(t);
        let g = cap.end().unwrap();
        let mapped_now = sim.is_mapped(addr, 10 * MIB);
        let reserved = gp.memory_stats().reserved_bytes.current;
        assert!(
            mapped_now,
            "the graph's temporary at {addr:#x} was unmapped when the capture ended, while the graph \
             holds the pool (pool reserved now {reserved}; device mapped {:?}; reservations {:?})",
            sim.mapped(),
            sim.reservations()
        );
        // SAFETY: nothing the graph uses is gone (sim).
        unsafe { g.replay() }.unwrap();
        drop(g);
        drop(cur);
        drop((x, gp));
        all_given_back(&sim, &a);
    });
}

/// The same through a pool another graph already holds: a second capture shares the graph's
/// pool (`graph.pool()`), while an earlier capture on another pool is still under way (so the
/// pool's partial map is deferred to the end of the last capture).
#[test]
fn a_second_graph_temporary_in_a_deferred_run_stays_mapped() {
    let (sim, a) = sim_with(64 * MIB, "");
    within(30, "A2", move || {
        let (s1, s2) = (sim.new_stream(), sim.new_stream());
        let x = a.alloc::<u8>(20 * MIB).unwrap();
        let gp = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
        let other = MemPool::on(&a, PoolOptions::new()).unwrap();
        // Capture 1 on another pool stays under way throughout.
        let cap1 = a.begin_capture(&s1, &other, CaptureMode::Relaxed).unwrap();
        let cur = a.set_stream(&s2).unwrap();
        // Out of memory partway in gp, on a stream not captured yet: deferred.
        let r = gp.alloc::<u8>(60 * MIB);
        assert!(matches!(r, Err(mempool::Error::OutOfMemory(_))), "{r:?}");
        let cap2 = a.begin_capture(&s2, &gp, CaptureMode::Relaxed).unwrap();
        let t = a.alloc::<u8>(10 * MIB).unwrap();
        let addr = t.device_ptr_raw();
        drop(t);
        let g2 = cap2.end().unwrap();
        drop(cur);
        let g1 = cap1.end();
        let ok = sim.is_mapped(addr, 10 * MIB);
        assert!(ok, "graph 2's temporary at {addr:#x} unmapped at the end of the last capture: {:?}", sim.mapped());
        drop((g1, g2, x, gp, other));
        all_given_back(&sim, &a);
    });
}

// ------------------------------------------------------------------------------------------
// B. The ladder after a partial give-back: the request fits the device once the default cache
//    and the partial map go back.
// ------------------------------------------------------------------------------------------
#[test]
fn b_partial_map_then_ladder_serves_a_request_that_fits() {
    let (sim, a) = sim_with(64 * MIB, "");
    let hooks = hook_ledger(&a);
    drop(a.alloc::<u8>(20 * MIB).unwrap()); // default cache: 20 MiB free
    let g = Ledger::new(&sim);
    let pool = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(g.clone())).unwrap();
    let before = sim.map_counters();
    let r = pool.alloc::<u8>(60 * MIB);
    let after = sim.map_counters();
    check_invariants(&a, Some(&sim));
    g.check(&sim);
    hooks.check(&sim);
    assert!(r.is_ok(), "{r:?} (maps {:?} -> {:?})", before, after);
    drop(r);
    drop(pool);
    all_given_back(&sim, &a);
    g.check(&sim);
    hooks.check(&sim);
}

#[test]
fn b2_partial_map_default_expandable_ladder() {
    let (sim, a) = sim_with(64 * MIB, "expandable_segments:True");
    let hooks = hook_ledger(&a);
    {
        let s = sim.new_stream();
        let _c = a.set_stream(&s).unwrap();
        drop(a.alloc::<u8>(20 * MIB).unwrap()); // cached on stream s
    }
    let r = a.alloc::<u8>(60 * MIB);
    check_invariants(&a, Some(&sim));
    hooks.check(&sim);
    assert!(r.is_ok(), "{r:?}");
    drop(r);
    all_given_back(&sim, &a);
    hooks.check(&sim);
}

// ------------------------------------------------------------------------------------------
// C. A map failing at every position of a multi-chunk plan (through the guard arming
//    `fail_next_maps`), default and user pools, merge and no-merge, with and without a capture.
// ------------------------------------------------------------------------------------------
fn fail_at_position(k: usize, conf: &str, in_capture: bool, graph: bool, veto_end: bool) {
    let (sim, a) = sim_with(1 << 32, conf);
    let hooks = hook_ledger(&a);
    let g = Ledger::new(&sim);
    let pool = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(g.clone())).unwrap();
    // Something mapped first, so the plan grows a free last block.
    let pre = pool.alloc::<u8>(3 * MIB).unwrap();
    drop(pool.alloc::<u8>(5 * MIB).unwrap());
    let s = sim.new_stream();
    let gp = MemPool::on(&a, PoolOptions::new()).unwrap();
    let cap = in_capture.then(|| a.begin_capture(&s, &gp, CaptureMode::Relaxed).unwrap());
    let seen = g.seen_maps.load(Ordering::Relaxed);
    g.fail_at.store(seen + k, Ordering::Relaxed);
    if k == 0 {
        sim.fail_next_maps(1);
    }
    // 5 chunks of 20 MiB; the ladder's retry maps the whole again.
    let r = pool.alloc::<u8>(100 * MIB);
    let rs = format!("{:?}", r.as_ref().map(|_| ()));
    check_invariants(&a, Some(&sim));
    g.check(&sim);
    hooks.check(&sim);
    if let Some(c) = cap {
        if veto_end {
            g.veto.store(true, Ordering::Relaxed);
        }
        if graph {
            drop(c.end().unwrap());
        } else {
            drop(c);
        }
        g.veto.store(false, Ordering::Relaxed);
    }
    check_invariants(&a, Some(&sim));
    g.check(&sim);
    hooks.check(&sim);
    let ps = pool.memory_stats();
    let snap_reserved: usize = a.snapshot().segments.iter().filter(|s| s.pool == pool.id()).map(|s| s.total_size).sum();
    assert_eq!(ps.reserved_bytes.current as usize, snap_reserved, "k={k}: pool reserved vs snapshot; r={rs}");
    drop(r);
    drop(pre);
    let _ = a.empty_cache();
    let _ = a.empty_cache();
    drop(pool);
    drop(gp);
    all_given_back(&sim, &a);
    g.check(&sim);
    hooks.check(&sim);
    assert!(g.mapped.lock().unwrap().is_empty(), "guard still holds {:?}", g.mapped.lock().unwrap());
}

#[test]
fn c_fail_at_every_position() {
    for conf in ["", "expandable_segments:True"] {
        for k in 0..6 {
            fail_at_position(k, conf, false, false, false);
        }
    }
}

#[test]
fn c_fail_at_every_position_in_capture() {
    for graph in [false, true] {
        for veto in [false, true] {
            for k in 0..6 {
                fail_at_position(k, "", true, graph, veto);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// D. Threads mapping into one reservation (same pool, same stream) with maps failing at random,
//    captures on another pool beginning and ending meanwhile, empty_cache racing.
// ------------------------------------------------------------------------------------------
fn storm(seed: u64, conf: &str) {
    let (sim, a) = sim_with(160 * MIB, conf);
    let hooks = hook_ledger(&a);
    within(120, "D storm", move || {
        let g = Ledger::new(&sim);
        let pool = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(g.clone())).unwrap();
        let shared = sim.new_stream();
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        for t in 0..3u64 {
            let (a, pool, sim, stop) = (a.clone(), pool.clone(), sim.clone(), stop.clone());
            hs.push(std::thread::spawn(move || {
                let _c = a.set_stream(&shared).unwrap();
                let mut r = common::Rng(seed * 31 + t + 1);
                let mut kept = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) && i < 1500 {
                    i += 1;
                    if r.below(10) == 0 {
                        sim.fail_next_maps(r.below(3) as usize);
                    }
                    let size = (r.below(45) as usize + 1) * MIB + r.below(1000) as usize;
                    let got = if t == 2 { a.alloc::<u8>(size) } else { pool.alloc::<u8>(size) };
                    match got {
                        Ok(b) => kept.push(b),
                        Err(mempool::Error::OutOfMemory(_)) => kept.clear(),
                        Err(e) => panic!("unexpected {e}"),
                    }
                    if kept.len() > 2 {
                        kept.remove(0);
                    }
                    if r.below(20) == 0 {
                        let _ = a.empty_cache();
                    }
                }
            }));
        }
        // Main: captures on another pool, ended with a graph or abandoned.
        let q = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
        let cs = sim.new_stream();
        let mut r = common::Rng(seed ^ 0xabc);
        for _ in 0..200 {
            let _c = a.set_stream(&cs).unwrap();
            let cap = a.begin_capture(&cs, &q, CaptureMode::Relaxed).unwrap();
            let t = a.alloc::<u8>(MIB);
            std::thread::yield_now();
            drop(t);
            if r.below(2) == 0 {
                drop(cap.end().unwrap());
            } else {
                drop(cap);
            }
        }
        stop.store(true, Ordering::Relaxed);
        for h in hs {
            h.join().unwrap();
        }
        let v = sim.capture_violations();
        assert!(v.is_empty(), "violations: {v:?}");
        check_invariants(&a, Some(&sim));
        g.check(&sim);
        drop((pool, q));
        all_given_back(&sim, &a);
        g.check(&sim);
        assert!(g.mapped.lock().unwrap().is_empty());
    });
    hooks.check(&SimDevice::new(1)); // nothing mapped anywhere now: compare with an empty device
}

#[test]
fn d_storm_user_pool() {
    for s in 0..4 {
        storm(s, "");
    }
}

#[test]
fn d_storm_default_expandable() {
    for s in 0..4 {
        storm(s, "expandable_segments:True");
    }
}

// ------------------------------------------------------------------------------------------
// E. Deferred entries of a pool released before the capture ends: given back at the end, the
//    reservation and the slot go.
// ------------------------------------------------------------------------------------------
#[test]
fn e_pool_released_during_capture_with_entries_pending() {
    let (sim, a) = sim_with(64 * MIB, "");
    let hooks = hook_ledger(&a);
    within(30, "E", move || {
        let g = Ledger::new(&sim);
        let x = a.alloc::<u8>(20 * MIB).unwrap();
        let p = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(g.clone())).unwrap();
        let (s, s2) = (sim.new_stream(), sim.new_stream());
        let gp = MemPool::on(&a, PoolOptions::new()).unwrap();
        let cap = a.begin_capture(&s, &gp, CaptureMode::Relaxed).unwrap();
        let cap2 = {
            let s3 = sim.new_stream();
            let gp2 = MemPool::on(&a, PoolOptions::new()).unwrap();
            (a.begin_capture(&s3, &gp2, CaptureMode::Relaxed).unwrap(), gp2)
        };
        {
            let _c = a.set_stream(&s2).unwrap();
            assert!(p.alloc::<u8>(60 * MIB).is_err());
        }
        assert!(!sim.mapped().is_empty(), "nothing mapped: the test tests less");
        drop(p);
        drop(cap.end().unwrap());
        assert!(!sim.mapped().is_empty(), "unmapped while a capture is still under way");
        drop(cap2);
        let v = sim.capture_violations();
        assert!(v.is_empty(), "violations: {v:?}");
        check_invariants(&a, Some(&sim));
        g.check(&sim);
        assert!(g.mapped.lock().unwrap().is_empty(), "released pool still mapped: {:?}", sim.mapped());
        assert!(sim.reservations().is_empty(), "reservation left: {:?}", sim.reservations());
        drop((x, gp));
        all_given_back(&sim, &a);
    });
    hooks.check(&SimDevice::new(1));
}

// ------------------------------------------------------------------------------------------
// F. The give-back's unmap fails (device) or the guard panics: what the request and the next
//    call return.
// ------------------------------------------------------------------------------------------
/// The give-back's unmap fails on the device: the request gets out-of-memory, the next call
/// reports the unmap's failure (as for every release outside a caller's own call: the ladder's
/// unmaps did so before), and the call after it works; nothing is lost.
#[test]
fn f_give_back_unmap_fails_is_reported_by_the_next_call() {
    let (sim, a) = sim_with(64 * MIB, "");
    let x = a.alloc::<u8>(20 * MIB).unwrap();
    let p = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
    sim.fail_next_unmaps(1);
    let r = p.alloc::<u8>(60 * MIB);
    assert!(matches!(r, Err(mempool::Error::OutOfMemory(_))), "{:?}", r.as_ref().map(|_| ()));
    check_invariants(&a, Some(&sim));
    let next = a.alloc::<u8>(512);
    assert!(
        matches!(&next, Err(mempool::Error::Backend { op, .. }) if op.contains("unmap")),
        "{:?}",
        next.as_ref().map(|_| ())
    );
    let after = a.alloc::<u8>(512).unwrap();
    drop((after, x, p));
    all_given_back(&sim, &a);
}

#[test]
fn f2_give_back_guard_panics() {
    let (sim, a) = sim_with(64 * MIB, "");
    let g = Ledger::new(&sim);
    g.panic_unmap.store(true, Ordering::Relaxed);
    let x = a.alloc::<u8>(20 * MIB).unwrap();
    let p = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(g.clone())).unwrap();
    let r = p.alloc::<u8>(60 * MIB);
    let r_s = format!("{:?}", r.as_ref().map(|_| ()));
    check_invariants(&a, Some(&sim));
    let nxt = a.alloc::<u8>(512);
    let n_s = format!("{:?}", nxt.as_ref().map(|_| ()));
    let e = a.empty_cache();
    g.panic_unmap.store(false, Ordering::Relaxed);
    drop((r, nxt, x));
    let e2 = p.empty_cache();
    drop(p);
    all_given_back(&sim, &a);
    g.check(&sim);
    assert!(n_s.starts_with("Ok"), "request: {r_s}; next: {n_s}; empty_cache {e:?} {e2:?}");
}

// ------------------------------------------------------------------------------------------
// G. Storm on one pool that captures also use (threads allocate from it on the captured
//    stream's sibling streams and on the captured stream itself), maps failing at random, the
//    guard vetoing at random; graphs kept for a while.
// ------------------------------------------------------------------------------------------
fn storm2(seed: u64) {
    let (sim, a) = sim_with(128 * MIB, "");
    let hooks = hook_ledger(&a);
    within(120, "G storm", move || {
        let g = Ledger::new(&sim);
        let pool = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(g.clone())).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        for t in 0..2u64 {
            let (a, pool, sim, stop, g) = (a.clone(), pool.clone(), sim.clone(), stop.clone(), g.clone());
            hs.push(std::thread::spawn(move || {
                let st = sim.new_stream();
                let _c = a.set_stream(&st).unwrap();
                let mut r = common::Rng(seed * 131 + t + 7);
                let mut kept = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) && i < 3000 {
                    i += 1;
                    if r.below(8) == 0 {
                        sim.fail_next_maps(1 + r.below(2) as usize);
                    }
                    g.veto.store(r.below(6) == 0, Ordering::Relaxed);
                    let size = (r.below(40) as usize + 1) * MIB;
                    match pool.alloc::<u8>(size) {
                        Ok(b) => kept.push(b),
                        Err(mempool::Error::OutOfMemory(_)) => kept.clear(),
                        Err(e) => panic!("unexpected {e}"),
                    }
                    if kept.len() > 2 {
                        kept.remove(0);
                    }
                    if r.below(30) == 0 {
                        let _ = pool.empty_cache();
                    }
                }
            }));
        }
        let cs = sim.new_stream();
        let mut r = common::Rng(seed ^ 0x5eed);
        let mut graphs = Vec::new();
        let side = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
        for _ in 0..150 {
            let _c = a.set_stream(&cs).unwrap();
            // Alternate: captures on a pool of their own, or sharing `side` via graphs.
            let cap = a.begin_capture(&cs, &side, CaptureMode::Relaxed).unwrap();
            let mut temps = Vec::new();
            for _ in 0..3 {
                if let Ok(b) = a.alloc::<u8>((r.below(20) as usize + 1) * MIB) {
                    temps.push(b);
                }
            }
            temps.clear();
            if r.below(2) == 0 {
                let gr = cap.end().unwrap();
                graphs.push(gr);
                if graphs.len() > 2 {
                    graphs.remove(0);
                }
            } else {
                drop(cap);
            }
        }
        for h in hs {
            h.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        g.veto.store(false, Ordering::Relaxed);
        let v = sim.capture_violations();
        assert!(v.is_empty(), "violations: {v:?}");
        check_invariants(&a, Some(&sim));
        g.check(&sim);
        drop(graphs);
        drop((pool, side));
        let _ = a.empty_cache(); // a veto kept for it
        all_given_back(&sim, &a);
        g.check(&sim);
        assert!(g.mapped.lock().unwrap().is_empty());
    });
    hooks.check(&SimDevice::new(1));
}

#[test]
fn g_storm_shared_pool_veto() {
    for s in 0..4 {
        storm2(s);
    }
}
