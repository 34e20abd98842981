//! Hostile review of MapGuard (review-mapguard): guards that veto, panic, or call back into
//! the allocator; statistics, snapshots and the guard's own view of what is mapped.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use common::{check_invariants, check_pool};
use mempool::sim::SimDevice;
use mempool::{Allocator, Config, MapGuard, MemPool, PoolOptions, Sim};

const MIB: usize = 1 << 20;

/// A guard that refuses unmaps while `veto` is set, and keeps its own view of what is mapped.
#[derive(Clone, Default)]
struct View {
    veto: Arc<AtomicBool>,
    mapped: Arc<Mutex<BTreeSet<(u64, usize)>>>,
    dup_maps: Arc<AtomicUsize>,
    unknown_unmaps: Arc<AtomicUsize>,
}

impl MapGuard for View {
    fn mapped(&self, addr: u64, size: usize) {
        if !self.mapped.lock().unwrap().insert((addr, size)) {
            self.dup_maps.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn unmapping(&self, addr: u64, size: usize) -> Result<(), String> {
        if self.veto.load(Ordering::Relaxed) {
            return Err(format!("{addr:#x} held"));
        }
        if !self.mapped.lock().unwrap().remove(&(addr, size)) {
            self.unknown_unmaps.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Snapshot `mappings` cover each expandable segment exactly and equal the device's mappings.
fn check_mappings(a: &Allocator<Sim>, sim: &SimDevice) {
    let snap = a.snapshot();
    let mut all = Vec::new();
    for s in snap.segments.iter().filter(|s| s.address >= SimDevice::VM_BASE) {
        let mut at = s.address;
        for &(m, n) in &s.mappings {
            assert_eq!(m, at, "mappings of segment {:#x} do not tile it: {:?}", s.address, s.mappings);
            at += n as u64;
            all.push((m, n));
        }
        assert_eq!(at, s.address + s.total_size as u64, "mappings of {:#x} short: {:?}", s.address, s.mappings);
    }
    all.sort_unstable();
    assert_eq!(all, sim.mapped(), "snapshot mappings differ from the device's");
}

/// A veto is a guard's ordinary answer (NCCL still holds the memory), reported by the call that
/// asked (`empty_cache`). Releasing a pool cannot report it: it must not make the next, unrelated
/// allocation of the default pool fail.
#[test]
fn a_veto_at_pool_release_fails_the_next_unrelated_alloc() {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    let g = View::default();
    let p = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(g.clone())).unwrap();
    drop(p.alloc::<u8>(3 * MIB).unwrap());
    g.veto.store(true, Ordering::Relaxed);
    drop(p); // release: the guard vetoes the unmap; nothing can return that
    let r = a.alloc::<u8>(MIB);
    assert!(r.is_ok(), "an alloc on the default pool failed with the pool's veto: {}", r.unwrap_err());
}

/// The same through another thread's out-of-memory ladder: a default-pool request on a full
/// device releases the released pools' caches; the guard's veto then fails a later request of
/// someone else.
#[test]
fn a_veto_in_the_oom_ladder_fails_a_later_unrelated_alloc() {
    let sim = SimDevice::new(64 * MIB);
    let a = Allocator::sim(sim.clone());
    let g = View::default();
    let p = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(g.clone())).unwrap();
    drop(p.alloc::<u8>(40 * MIB).unwrap());
    g.veto.store(true, Ordering::Relaxed);
    drop(p);
    let _ = a.take_error(); // whatever the release kept
                            // 40 MiB of the 64 stay mapped (vetoed): this one cannot fit and runs the ladder.
    assert!(a.alloc::<u8>(30 * MIB).is_err());
    let _ = a.take_error();
    let big = a.alloc::<u8>(30 * MIB);
    assert!(big.is_err());
    // Memory is there for this one: it must succeed.
    let r = a.alloc::<u8>(MIB);
    assert!(r.is_ok(), "a 1 MiB alloc failed with the veto of a 30 MiB request's ladder: {}", r.unwrap_err());
}

/// After vetoes, partial cuts and restores, the statistics, the snapshot's mappings and the
/// guard's view stay exact; spanning and no_span pools.
#[test]
fn vetoed_cuts_keep_stats_mappings_and_the_guards_view_exact() {
    for no_span in [false, true] {
        let sim = SimDevice::new(1 << 30);
        let a = Allocator::sim(sim.clone());
        let g = View::default();
        let p = MemPool::on(&a, PoolOptions::new().expandable(true).no_span(no_span).map_guard(g.clone())).unwrap();
        let x = p.alloc::<u8>(50 * MIB).unwrap(); // three runs when spanning
        let y = p.alloc::<u8>(6 * MIB).unwrap();
        let z = p.alloc::<u8>(30 * MIB).unwrap();
        drop(x);
        drop(z);
        g.veto.store(true, Ordering::Relaxed);
        assert!(p.empty_cache().is_err());
        check_invariants(&a, Some(&sim));
        check_pool(&p);
        check_mappings(&a, &sim);
        g.veto.store(false, Ordering::Relaxed);
        let w = p.alloc::<u8>(45 * MIB).unwrap();
        assert!(sim.is_mapped(w.device_ptr_raw(), 45 * MIB));
        drop(y);
        p.empty_cache().unwrap();
        check_invariants(&a, Some(&sim));
        check_pool(&p);
        check_mappings(&a, &sim);
        drop(w);
        p.empty_cache().unwrap();
        assert!(sim.mapped().is_empty(), "no_span {no_span}: left mapped {:?}", sim.mapped());
        assert_eq!(g.dup_maps.load(Ordering::Relaxed), 0);
        assert_eq!(g.unknown_unmaps.load(Ordering::Relaxed), 0);
        assert!(g.mapped.lock().unwrap().is_empty());
    }
}

/// Guards that panic, in `mapped` and in `unmapping`: contained, the state exact.
#[test]
fn panicking_guards_are_contained() {
    struct Boom;
    impl MapGuard for Boom {
        fn mapped(&self, _: u64, _: usize) {
            panic!("mapped boom")
        }
        fn unmapping(&self, _: u64, _: usize) -> Result<(), String> {
            panic!("unmapping boom")
        }
    }
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    let p = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(Boom)).unwrap();
    let x = p.alloc::<u8>(25 * MIB).unwrap();
    assert!(sim.is_mapped(x.device_ptr_raw(), 25 * MIB));
    drop(x);
    let e = p.empty_cache().unwrap_err();
    assert!(e.to_string().contains("unmapping boom"), "{e}");
    check_invariants(&a, Some(&sim));
    check_pool(&p);
    check_mappings(&a, &sim);
    drop(p);
    let _ = a.take_error();
    drop(a);
}

/// Runs `f` on a thread; fails if it does not finish in 10 s (a deadlock).
fn within_10s(what: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    assert!(rx.recv_timeout(Duration::from_secs(10)).is_ok(), "{what}: hung (deadlock?)");
}

/// Guards that call back into the allocator from `mapped` and `unmapping`.
#[test]
fn reentrant_guards_neither_deadlock_nor_corrupt() {
    struct Reenter {
        a: Mutex<Option<Allocator<Sim>>>,
        depth: AtomicUsize,
    }
    impl Reenter {
        fn poke(&self) {
            if self.depth.fetch_add(1, Ordering::SeqCst) > 0 {
                self.depth.fetch_sub(1, Ordering::SeqCst);
                return;
            }
            let a = self.a.lock().unwrap().clone();
            if let Some(a) = a {
                let _ = a.snapshot();
                let _ = a.memory_stats();
                let b = a.alloc::<u8>(3 * MIB);
                drop(b);
                let _ = a.empty_cache();
            }
            self.depth.fetch_sub(1, Ordering::SeqCst);
        }
    }
    #[derive(Clone)]
    struct G(Arc<Reenter>);
    impl MapGuard for G {
        fn mapped(&self, _: u64, _: usize) {
            self.0.poke()
        }
        fn unmapping(&self, _: u64, _: usize) -> Result<(), String> {
            self.0.poke();
            Ok(())
        }
    }
    within_10s("reentrant guard", || {
        let sim = SimDevice::new(1 << 30);
        let cfg = Config::builder().expandable_segments(true).build().unwrap();
        let a = Allocator::sim_with(sim.clone(), cfg);
        let r = Arc::new(Reenter { a: Mutex::new(Some(a.clone())), depth: AtomicUsize::new(0) });
        let p = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(G(r.clone()))).unwrap();
        for i in 0..20 {
            let x = p.alloc::<u8>((i % 7 + 1) * 5 * MIB).unwrap();
            assert!(sim.is_mapped(x.device_ptr_raw(), (i % 7 + 1) * 5 * MIB));
            drop(x);
            p.empty_cache().unwrap();
        }
        check_invariants(&a, Some(&sim));
        check_mappings(&a, &sim);
        *r.a.lock().unwrap() = None;
        drop(p);
        drop(a);
    });
}

/// Threads allocating, freeing, emptying caches, with vetoes, map and unmap failures switched
/// at random: every block handed out lies in mapped memory, and at rest the guard's view, the
/// snapshot's mappings and the device agree, and everything is unmapped at the end.
#[test]
fn fuzz_vetoes_and_failures_across_threads() {
    for seed in 1..=6u64 {
        for no_span in [false, true] {
            let sim = SimDevice::new(256 * MIB);
            let cfg = Config::builder().expandable_segments(true).build().unwrap();
            let a = Allocator::sim_with(sim.clone(), cfg);
            let g = View::default();
            let p = MemPool::on(&a, PoolOptions::new().expandable(true).no_span(no_span).map_guard(g.clone())).unwrap();
            let hs: Vec<_> = (0..3u64)
                .map(|t| {
                    let (a, p, g, sim) = (a.clone(), p.clone(), g.clone(), sim.clone());
                    std::thread::spawn(move || {
                        let mut rng = common::Rng(seed * 7919 + t * 104729 + 1);
                        let mut held = Vec::new();
                        for _ in 0..400 {
                            match rng.below(10) {
                                0..=4 => {
                                    let n = rng.size(26).max(1);
                                    let r = if rng.below(4) == 0 { a.alloc::<u8>(n) } else { p.alloc::<u8>(n) };
                                    if let Ok(b) = r {
                                        assert!(sim.is_mapped(b.device_ptr_raw(), n), "block in unmapped memory");
                                        held.push(b);
                                    }
                                }
                                5 | 6 if !held.is_empty() => {
                                    let i = rng.below(held.len() as u64) as usize;
                                    held.swap_remove(i);
                                }
                                7 => {
                                    let _ = p.empty_cache();
                                }
                                8 => {
                                    let _ = a.empty_cache();
                                }
                                _ => match rng.below(4) {
                                    0 => g.veto.store(!g.veto.load(Ordering::Relaxed), Ordering::Relaxed),
                                    1 => sim.fail_next_unmaps(1),
                                    2 => sim.fail_next_maps(1),
                                    _ => {}
                                },
                            }
                        }
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
            g.veto.store(false, Ordering::Relaxed);
            sim.fail_next_unmaps(0);
            sim.fail_next_maps(0);
            let _ = a.empty_cache();
            let _ = p.empty_cache();
            let _ = a.take_error();
            check_invariants(&a, Some(&sim));
            check_pool(&p);
            check_mappings(&a, &sim);
            let pool_runs: BTreeSet<(u64, usize)> =
                p.snapshot().segments.iter().filter(|s| s.pool == p.id()).flat_map(|s| s.mappings.clone()).collect();
            assert_eq!(*g.mapped.lock().unwrap(), pool_runs, "seed {seed} no_span {no_span}: guard's view");
            assert_eq!(g.dup_maps.load(Ordering::Relaxed), 0, "told twice of one map");
            assert_eq!(g.unknown_unmaps.load(Ordering::Relaxed), 0, "asked of an unmap it never saw mapped");
            drop(p);
            a.empty_cache().unwrap();
            assert!(sim.mapped().is_empty(), "left mapped: {:?}", sim.mapped());
            assert!(g.mapped.lock().unwrap().is_empty());
        }
    }
}

/// As above, with pools made and released by each thread, streams, use_on_oom, a memory limit
/// with garbage collection and a small device (the out-of-memory ladder runs often).
#[test]
fn fuzz_released_pools_oom_and_gc() {
    for seed in 1..=8u64 {
        let sim = SimDevice::new(160 * MIB);
        let cfg = Config::builder()
            .expandable_segments(true)
            .memory_fraction(0.9)
            .garbage_collection_threshold(0.5)
            .build()
            .unwrap();
        let a = Allocator::sim_with(sim.clone(), cfg);
        let g = View::default();
        let hs: Vec<_> = (0..3u64)
            .map(|t| {
                let (a, g, sim) = (a.clone(), g.clone(), sim.clone());
                std::thread::spawn(move || {
                    let mut rng = common::Rng(seed * 7919 + t * 104729 + 1);
                    let stream = sim.new_stream();
                    let _sg = if t == 1 { Some(a.set_stream(&stream).unwrap()) } else { None };
                    let mut pool: Option<MemPool<Sim>> = None;
                    let mut held = Vec::new();
                    for _ in 0..400 {
                        match rng.below(12) {
                            0..=4 => {
                                let n = rng.size(25).max(1);
                                let r = match (&pool, rng.below(3)) {
                                    (Some(p), 0 | 1) => p.alloc::<u8>(n),
                                    _ => a.alloc::<u8>(n),
                                };
                                if let Ok(b) = r {
                                    assert!(sim.is_mapped(b.device_ptr_raw(), n), "block in unmapped memory");
                                    held.push(b);
                                }
                            }
                            5 | 6 if !held.is_empty() => {
                                let i = rng.below(held.len() as u64) as usize;
                                held.swap_remove(i);
                            }
                            7 => {
                                if let Some(p) = &pool {
                                    let _ = p.empty_cache();
                                }
                            }
                            8 => {
                                let _ = a.empty_cache();
                            }
                            9 => {
                                pool = match pool.take() {
                                    Some(_) => None,
                                    None => Some(
                                        MemPool::on(
                                            &a,
                                            PoolOptions::new()
                                                .expandable(true)
                                                .no_span(rng.below(2) == 0)
                                                .use_on_oom(rng.below(2) == 0)
                                                .map_guard(g.clone()),
                                        )
                                        .unwrap(),
                                    ),
                                };
                            }
                            _ => match rng.below(4) {
                                0 => g.veto.store(!g.veto.load(Ordering::Relaxed), Ordering::Relaxed),
                                1 => sim.fail_next_unmaps(1),
                                2 => sim.fail_next_maps(1),
                                _ => {}
                            },
                        }
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        g.veto.store(false, Ordering::Relaxed);
        sim.fail_next_unmaps(0);
        sim.fail_next_maps(0);
        let _ = a.empty_cache();
        let _ = a.take_error();
        check_invariants(&a, Some(&sim));
        check_mappings(&a, &sim);
        assert!(
            a.snapshot().segments.iter().all(|s| s.pool == mempool::PoolId::DEFAULT),
            "seed {seed}: released pools' memory left: {:?}",
            a.snapshot().segments.iter().map(|s| (s.pool, s.address, s.total_size)).collect::<Vec<_>>()
        );
        assert!(sim.mapped().is_empty(), "seed {seed}: left mapped: {:?}", sim.mapped());
        assert!(g.mapped.lock().unwrap().is_empty(), "seed {seed}: guard's view {:?}", g.mapped.lock().unwrap());
        assert_eq!(g.dup_maps.load(Ordering::Relaxed), 0, "told twice of one map");
        assert_eq!(g.unknown_unmaps.load(Ordering::Relaxed), 0, "asked of an unmap it never saw mapped");
        drop(a);
        assert!(sim.reservations().is_empty(), "seed {seed}: reservations left: {:?}", sim.reservations());
    }
}

/// A guard is user code, and so is its `Drop`: a released pool's raw allocator is let go outside
/// the lock (`retire_pool_if_empty` queues a `Work::Drop`), its guard is not. Here the guard
/// owns a buffer; the guard goes when a new pool takes the retired pool's slot, under the
/// allocator's lock, and the buffer's free takes that lock again.
#[test]
fn a_guards_drop_runs_under_the_allocator_lock() {
    struct Owns(#[allow(dead_code)] mempool::Buffer<u8, Sim>);
    impl MapGuard for Owns {
        fn mapped(&self, _: u64, _: usize) {}
        fn unmapping(&self, _: u64, _: usize) -> Result<(), String> {
            Ok(())
        }
    }
    within_10s("a new pool after a guarded pool's release", || {
        let sim = SimDevice::new(1 << 30);
        let a = Allocator::sim(sim.clone());
        let scratch = a.alloc::<u8>(8 * MIB).unwrap();
        let p = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(Owns(scratch))).unwrap();
        drop(p.alloc::<u8>(MIB).unwrap());
        drop(p); // released; its memory unmapped; its slot retired
        let q = MemPool::on(&a, PoolOptions::new()).unwrap(); // takes the slot: drops the guard
        drop(q);
    });
}

/// The same with a guard's `Drop` that panics: the panic escapes from `MemPool::on` of an
/// unrelated pool (a raw allocator's `Drop` is contained: it runs as a `Work::Drop`).
#[test]
fn a_guards_drop_panic_escapes_from_an_unrelated_call() {
    struct PanicsOnDrop;
    impl MapGuard for PanicsOnDrop {
        fn mapped(&self, _: u64, _: usize) {}
        fn unmapping(&self, _: u64, _: usize) -> Result<(), String> {
            Ok(())
        }
    }
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("guard drop boom");
        }
    }
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    let p = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(PanicsOnDrop)).unwrap();
    drop(p.alloc::<u8>(MIB).unwrap());
    drop(p);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| MemPool::on(&a, PoolOptions::new()).map(drop)));
    assert!(r.is_ok(), "MemPool::on panicked with the old pool's guard's Drop");
}

/// A guard that, from `mapped` (a growth of its own pool under way), allocates from the same
/// pool and empties the same pool's cache; from `unmapping`, allocates from it again.
#[test]
fn a_guard_reentering_its_own_pool() {
    #[derive(Clone, Default)]
    struct Own {
        p: Arc<Mutex<Option<MemPool<Sim>>>>,
        depth: Arc<AtomicUsize>,
    }
    impl Own {
        fn poke(&self, grow: bool) {
            if self.depth.fetch_add(1, Ordering::SeqCst) > 0 {
                self.depth.fetch_sub(1, Ordering::SeqCst);
                return;
            }
            let p = self.p.lock().unwrap().clone();
            if let Some(p) = p {
                if grow {
                    let b = p.alloc::<u8>(7 * MIB);
                    let _ = p.empty_cache();
                    drop(b);
                } else {
                    drop(p.alloc::<u8>(3 * MIB));
                }
                let _ = p.snapshot();
                let _ = p.memory_stats();
            }
            self.depth.fetch_sub(1, Ordering::SeqCst);
        }
    }
    impl MapGuard for Own {
        fn mapped(&self, _: u64, _: usize) {
            self.poke(true)
        }
        fn unmapping(&self, _: u64, _: usize) -> Result<(), String> {
            self.poke(false);
            Ok(())
        }
    }
    within_10s("a guard reentering its own pool", || {
        for no_span in [false, true] {
            let sim = SimDevice::new(1 << 30);
            let a = Allocator::sim(sim.clone());
            let g = Own::default();
            let p = MemPool::on(&a, PoolOptions::new().expandable(true).no_span(no_span).map_guard(g.clone())).unwrap();
            *g.p.lock().unwrap() = Some(p.clone());
            let mut keep = Vec::new();
            for i in 0..30usize {
                let n = (i * 37 % 23 + 1) * MIB;
                let x = p.alloc::<u8>(n).unwrap();
                assert!(sim.is_mapped(x.device_ptr_raw(), n));
                if i % 3 == 0 {
                    keep.push(x);
                }
                if i % 4 == 0 {
                    p.empty_cache().unwrap();
                }
                check_invariants(&a, Some(&sim));
                check_mappings(&a, &sim);
            }
            drop(keep);
            *g.p.lock().unwrap() = None;
            p.empty_cache().unwrap();
            assert!(sim.mapped().is_empty(), "left mapped {:?}", sim.mapped());
        }
    });
}
