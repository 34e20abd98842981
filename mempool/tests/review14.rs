//! Hostile review 14 probes (sim backend): user pools released while other threads hold their
//! buffers and scopes, forgotten scopes, expandable pools with OOM / empty_cache / release,
//! captures with frees on other threads, and many threads mixing pools against readers.
//!
//! It found two ways for expandable memory to stay mapped with nothing using it, both fixed in
//! `DeviceAllocator::map_more`: a request whose map failed partway kept what it had mapped
//! (`a_failed_…`, `an_oom_in_a_capture_…`), and a pool released while a request of it was
//! mapping kept the new memory (`a_pool_released_…`). The tests named `p…` are its probes that
//! held up. `R14_ITERS` scales the loops.
mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::watch::within;
use common::{all_given_back, check_invariants, check_pool, sim_with, Rng};
use mempool::{Allocator, Buffer, CaptureMode, MemPool, PoolOptions, Sim};

const MIB: usize = 1 << 20;

fn iters(n: usize) -> usize {
    std::env::var("R14_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(n)
}

// ------------------------------------------------------------------------------------------
// 1. A pool released while workers on other threads hold its buffers and handles.
// ------------------------------------------------------------------------------------------
#[test]
fn p1_pool_released_while_other_threads_hold_buffers_and_handles() {
    for round in 0..iters(30) {
        let (sim, a) = sim_with(1 << 34, "");
        within(60, "p1", move || {
            let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
            let n = 4;
            let bar = Arc::new(Barrier::new(n + 1));
            let mut hs = Vec::new();
            for t in 0..n {
                let h = pool.scope_handle();
                let a = a.clone();
                let bar = bar.clone();
                hs.push(std::thread::spawn(move || {
                    let mut r = Rng(0x9e37 + t as u64 * 7 + round as u64);
                    let mut kept: Vec<Buffer<u8, Sim>> = Vec::new();
                    {
                        let _s = h.enter();
                        for _ in 0..200 {
                            let b = a.alloc::<u8>(r.size(22)).unwrap();
                            if r.below(3) == 0 {
                                kept.push(b);
                            }
                        }
                    }
                    bar.wait();
                    drop(h);
                    // Free after the pool was released (maybe), interleaved with default allocs.
                    for b in kept.drain(..) {
                        let _d = a.alloc::<u8>(r.size(20)).unwrap();
                        drop(b);
                    }
                }));
            }
            bar.wait();
            drop(pool);
            for h in hs {
                h.join().unwrap();
            }
            all_given_back(&sim, &a);
        });
    }
}

// ------------------------------------------------------------------------------------------
// 2. A scope handle sent to another thread, its guard forgotten, the pool released; a new
//    pool takes the slot. The forgotten route must route nothing to the new pool.
// ------------------------------------------------------------------------------------------
#[test]
fn p2_forgotten_scope_of_a_released_pool_routes_nowhere() {
    let (sim, a) = sim_with(1 << 32, "");
    within(30, "p2", move || {
        let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
        let h = pool.scope_handle();
        let a2 = a.clone();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (tx2, rx2) = std::sync::mpsc::channel::<()>();
        let (txp, rxp) = std::sync::mpsc::channel::<MemPool<Sim>>();
        let t = std::thread::spawn(move || {
            let g = h.enter();
            std::mem::forget(g);
            let b = a2.alloc::<u8>(4096).unwrap();
            drop(h);
            tx.send(()).unwrap();
            rx2.recv().unwrap();
            let newp = rxp.recv().unwrap();
            // After release: a fresh allocation must not go to the new pool.
            let c = a2.alloc::<u8>(4096).unwrap();
            let d = a2.alloc::<u8>(3 * MIB).unwrap();
            let inp = newp.memory_stats().allocation.current;
            drop((b, c, d));
            inp
        });
        rx.recv().unwrap();
        drop(pool);
        let newp = MemPool::on(&a, PoolOptions::new()).unwrap();
        tx2.send(()).unwrap();
        txp.send(newp.clone()).unwrap();
        let inp = t.join().unwrap();
        assert_eq!(inp, 0, "a forgotten route of a released pool allocated from the pool in its slot");
        check_pool(&newp);
        drop(newp);
        all_given_back(&sim, &a);
    });
}

// ------------------------------------------------------------------------------------------
// 3. Forgotten scope on the same thread with a pool released by another thread while this
//    one allocates through the stale route in a loop (the release races the allocations).
// ------------------------------------------------------------------------------------------
#[test]
fn p3_stale_route_allocating_while_another_thread_releases() {
    for _ in 0..iters(50) {
        let (sim, a) = sim_with(1 << 34, "");
        within(30, "p3", move || {
            let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
            let h = pool.scope_handle();
            let a2 = a.clone();
            let go = Arc::new(Barrier::new(2));
            let go2 = go.clone();
            let t = std::thread::spawn(move || {
                std::mem::forget(h.enter());
                drop(h);
                go2.wait();
                let mut r = Rng(77);
                let mut kept = Vec::new();
                for i in 0..2000 {
                    let b = a2.alloc::<u8>(r.size(21)).unwrap();
                    if i % 5 == 0 {
                        kept.push(b);
                    }
                    if kept.len() > 20 {
                        kept.remove(0);
                    }
                }
                kept
            });
            go.wait();
            std::thread::sleep(Duration::from_micros(200));
            drop(pool);
            // New pools come and go in the freed slot.
            for _ in 0..20 {
                let p = MemPool::on(&a, PoolOptions::new()).unwrap();
                let _x = p.alloc::<u8>(1000).unwrap();
            }
            let kept = t.join().unwrap();
            drop(kept);
            all_given_back(&sim, &a);
        });
    }
}

// ------------------------------------------------------------------------------------------
// 4. Expandable pools (user pool and default via config) on a small device: threads allocate
//    until out of memory, free, while another thread calls empty_cache and MemPool::empty_cache
//    and the pool is released midway.
// ------------------------------------------------------------------------------------------
fn expandable_storm(conf: &str, seed: u64) {
    let (sim, a) = sim_with(96 * MIB, conf);
    within(120, "expandable storm", move || {
        let pool = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        for t in 0..4u64 {
            let a = a.clone();
            let h = pool.scope_handle();
            let stream = if t % 2 == 0 { Some(sim.new_stream()) } else { None };
            hs.push(std::thread::spawn(move || {
                let _cur = stream.as_ref().map(|s| a.set_stream(s).unwrap());
                let mut r = Rng(seed ^ ((t + 1) * 0x1234567));
                let mut kept: Vec<Buffer<u8, Sim>> = Vec::new();
                for i in 0..3000 {
                    let scoped = t % 2 == 1 && i < 2000;
                    let g = if scoped { Some(h.enter()) } else { None };
                    match a.alloc::<u8>(r.size(24)) {
                        Ok(b) => kept.push(b),
                        Err(mempool::Error::OutOfMemory(_)) => kept.clear(),
                        Err(e) => panic!("unexpected error {e}"),
                    }
                    drop(g);
                    if kept.len() > 6 {
                        let k = r.below(kept.len() as u64) as usize;
                        kept.swap_remove(k);
                    }
                }
                drop(h);
                kept
            }));
        }
        let a2 = a.clone();
        let p2 = pool.clone();
        let stop2 = stop.clone();
        let cleaner = std::thread::spawn(move || {
            let mut n = 0;
            while !stop2.load(Ordering::Relaxed) {
                let _ = a2.empty_cache();
                let _ = p2.empty_cache();
                let s = a2.memory_stats();
                assert!(s.reserved_bytes.all.current >= s.allocated_bytes.all.current);
                let _ = a2.snapshot();
                n += 1;
                if n % 7 == 0 {
                    a2.reset_peak_stats();
                }
            }
            drop(p2);
        });
        std::thread::sleep(Duration::from_millis(5));
        drop(pool);
        let mut kept = Vec::new();
        for h in hs {
            kept.extend(h.join().unwrap());
        }
        stop.store(true, Ordering::Relaxed);
        cleaner.join().unwrap();
        check_invariants(&a, Some(&sim));
        drop(kept);
        // (`all_back` checked that no mapping and no reservation is left.)
        all_given_back(&sim, &a);
    });
}

#[test]
fn p4_expandable_user_pool_storm() {
    for s in 0..iters(6) as u64 {
        expandable_storm("", s);
    }
}

#[test]
fn p4b_expandable_default_and_user_pool_storm() {
    for s in 0..iters(6) as u64 {
        expandable_storm("expandable_segments:True", s);
    }
}

#[test]
fn p4c_expandable_default_no_thread_cache_storm() {
    for s in 0..iters(6) as u64 {
        expandable_storm("expandable_segments:True,thread_cache:False", s);
    }
}

/// After everything is freed and the caches emptied, no reservation should remain either.
#[test]
fn p5_expandable_reservations_go_back() {
    let (sim, a) = sim_with(64 * MIB, "expandable_segments:True");
    {
        let pool = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
        let x = pool.alloc::<u8>(30 * MIB).unwrap();
        let y = a.alloc::<u8>(30 * MIB).unwrap();
        // OOM in both
        assert!(pool.alloc::<u8>(30 * MIB).is_err());
        assert!(a.alloc::<u8>(30 * MIB).is_err());
        check_invariants(&a, Some(&sim));
        drop(pool);
        drop(x);
        drop(y);
    }
    all_given_back(&sim, &a);
    assert!(sim.reservations().is_empty(), "reservations left: {:?}", sim.reservations());
}

// ------------------------------------------------------------------------------------------
// 6. One thread, random operations over the default pools, an (expandable) user pool and a
//    pool released while its buffers live; device and pool peaks checked exactly against the
//    true maxima since the last reset (one thread: no known gap applies).
// ------------------------------------------------------------------------------------------
#[derive(Default, Clone, Copy, Debug)]
struct Truth {
    n: i64,
    req: i64,
    max_n: i64,
    max_req: i64,
}
impl Truth {
    fn add(&mut self, bytes: usize) {
        self.n += 1;
        self.req += bytes as i64;
        self.max_n = self.max_n.max(self.n);
        self.max_req = self.max_req.max(self.req);
    }
    fn sub(&mut self, bytes: usize) {
        self.n -= 1;
        self.req -= bytes as i64;
    }
    fn reset(&mut self) {
        self.max_n = self.n;
        self.max_req = self.req;
    }
}

fn model_run(conf: &str, expandable: bool, seed: u64, steps: usize) {
    let (sim, a) = sim_with(160 * MIB, conf);
    let mut r = Rng(seed.wrapping_mul(0x9e3779b97f4a7c15) | 1);
    let p = MemPool::on(&a, PoolOptions::new().expandable(expandable)).unwrap();
    let mut q = Some(MemPool::on(&a, PoolOptions::new()).unwrap());
    // (buffer, which: 0 default, 1 p, 2 q)
    let mut live: Vec<(Buffer<u8, Sim>, u8)> = Vec::new();
    let (mut dev, mut tp) = (Truth::default(), Truth::default());
    let s2 = sim.new_stream();
    for step in 0..steps {
        let op = r.below(100);
        if op < 45 {
            let size = if r.below(4) == 0 { r.size(26) } else { r.size(16) };
            let which = r.below(3) as u8;
            let on_s2 = r.below(4) == 0;
            let _cur = if on_s2 { Some(a.set_stream(&s2).unwrap()) } else { None };
            let res = match which {
                0 => a.alloc::<u8>(size),
                1 => {
                    if r.below(2) == 0 {
                        p.alloc::<u8>(size)
                    } else {
                        let _g = p.scope();
                        a.alloc::<u8>(size)
                    }
                }
                _ => match &q {
                    Some(q) => {
                        let _g = q.scope();
                        a.alloc::<u8>(size)
                    }
                    None => a.alloc::<u8>(size),
                },
            };
            let which = if which == 2 && q.is_none() { 0 } else { which };
            match res {
                Ok(b) => {
                    dev.add(size);
                    if which == 1 {
                        tp.add(size);
                    }
                    live.push((b, which));
                }
                Err(mempool::Error::OutOfMemory(_)) => {}
                Err(e) => panic!("step {step}: {e}"),
            }
        } else if op < 85 {
            if !live.is_empty() {
                let i = r.below(live.len() as u64) as usize;
                let (b, which) = live.swap_remove(i);
                let n = b.len();
                if r.below(5) == 0 {
                    b.record_stream(&s2).unwrap();
                }
                drop(b);
                dev.sub(n);
                if which == 1 {
                    tp.sub(n);
                }
            }
        } else if op < 88 {
            a.empty_cache().unwrap();
        } else if op < 90 {
            p.empty_cache().unwrap();
        } else if op < 93 {
            a.reset_peak_stats();
            dev.reset();
            tp.reset();
        } else if op < 95 {
            if r.below(3) == 0 {
                q = None;
            } else if q.is_none() {
                q = Some(MemPool::on(&a, PoolOptions::new()).unwrap());
            }
        } else if op < 97 {
            sim.complete_all();
        } else {
            let s = a.memory_stats();
            let ps = p.memory_stats();
            let ctx = format!("seed {seed} step {step} conf {conf:?} exp {expandable}");
            assert_eq!(s.allocation.all.current, dev.n, "{ctx}: dev current");
            assert_eq!(s.requested_bytes.all.current, dev.req, "{ctx}: dev requested current");
            assert_eq!(s.allocation.all.peak, dev.max_n, "{ctx}: dev allocation peak");
            assert_eq!(s.requested_bytes.all.peak, dev.max_req, "{ctx}: dev requested peak");
            assert_eq!(ps.allocation.current, tp.n, "{ctx}: pool current");
            assert_eq!(ps.requested_bytes.current, tp.req, "{ctx}: pool requested current");
            assert_eq!(ps.allocation.peak, tp.max_n, "{ctx}: pool allocation peak");
            assert_eq!(ps.requested_bytes.peak, tp.max_req, "{ctx}: pool requested peak");
            check_invariants(&a, Some(&sim));
            check_pool(&p);
        }
    }
    drop(live);
    drop(q);
    drop(p);
    sim.complete_all();
    all_given_back(&sim, &a);
}

#[test]
fn p6_single_thread_peaks_exact() {
    for seed in 0..iters(40) as u64 {
        model_run("", false, seed, 3000);
    }
}

#[test]
fn p6b_single_thread_peaks_exact_expandable() {
    for seed in 0..iters(40) as u64 {
        model_run("expandable_segments:True", true, seed, 3000);
    }
}

#[test]
fn p6c_single_thread_peaks_exact_no_tcache() {
    for seed in 0..iters(40) as u64 {
        model_run("thread_cache:False,expandable_segments:True", true, seed, 3000);
    }
}

#[test]
fn p6d_single_thread_peaks_exact_gc() {
    for seed in 0..iters(40) as u64 {
        model_run("garbage_collection_threshold:0.5,max_split_size_mb:40", false, seed, 3000);
    }
}

// ------------------------------------------------------------------------------------------
// 7. Graph capture on the sim backend while other threads free capture-pool buffers (some
//    used on other streams), free buffers of a released pool, allocate on the captured stream
//    and on their own, and call empty_cache / memory_stats / snapshot / reset_peak_stats.
// ------------------------------------------------------------------------------------------
fn capture_storm(conf: &str, seed: u64) {
    let (sim, a) = sim_with(1 << 32, conf);
    within(60, "capture storm", move || {
        let s = sim.new_stream();
        let gp = MemPool::on(&a, PoolOptions::new()).unwrap();
        // A pool released before the capture, its buffers alive on a worker.
        let rel = MemPool::on(&a, PoolOptions::new()).unwrap();
        let rel_bufs: Vec<Buffer<u8, Sim>> = (0..8).map(|i| rel.alloc::<u8>(1000 + i * 300_000).unwrap()).collect();
        drop(rel);
        let (tx, rx) = std::sync::mpsc::channel::<Buffer<u8, Sim>>();
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        let cap = {
            let _cur = a.set_stream(&s).unwrap();
            a.begin_capture(&s, &gp, CaptureMode::Global).unwrap()
        };
        let rx = Arc::new(std::sync::Mutex::new(rx));
        for t in 0..3u64 {
            let a = a.clone();
            let sim = sim.clone();
            let stop = stop.clone();
            let rx = rx.clone();
            let mine = sim.new_stream();
            hs.push(std::thread::spawn(move || {
                let mut r = Rng(seed + t * 991 + 5);
                let mut keep = Vec::new();
                let mut got = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(b) = rx.lock().unwrap().try_recv() {
                        if r.below(2) == 0 {
                            b.record_stream(&mine).unwrap();
                        }
                        drop(b);
                    }
                    match r.below(6) {
                        0 => {
                            let _c = a.set_stream(&s).unwrap();
                            got.push(a.alloc::<u8>(r.size(22)).unwrap());
                        }
                        1 => {
                            let _c = a.set_stream(&mine).unwrap();
                            keep.push(a.alloc::<u8>(r.size(22)).unwrap());
                        }
                        2 => {
                            assert!(a.empty_cache().is_err(), "empty_cache during a capture must be refused");
                        }
                        3 => {
                            let _ = a.memory_stats();
                            let _ = a.snapshot();
                        }
                        4 => a.reset_peak_stats(),
                        _ => {
                            keep.pop();
                            got.pop();
                        }
                    }
                    if keep.len() > 10 {
                        keep.remove(0);
                    }
                }
                (keep, got)
            }));
        }
        let mut r = Rng(seed + 3);
        {
            let _cur = a.set_stream(&s).unwrap();
            for i in 0..300 {
                let b = a.alloc::<u8>(r.size(22)).unwrap();
                tx.send(b).unwrap();
                if i == 100 {
                    drop(rel_bufs);
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::Relaxed);
        let mut held = Vec::new();
        for h in hs {
            held.push(h.join().unwrap());
        }
        // Whatever remains in the channel is dropped on this thread.
        while let Ok(b) = rx.lock().unwrap().try_recv() {
            drop(b);
        }
        let v = sim.capture_violations();
        assert!(v.is_empty(), "violations during capture: {v:?}");
        let graph = cap.end();
        check_invariants(&a, Some(&sim));
        drop(graph);
        drop(gp);
        drop(held);
        sim.complete_all();
        all_given_back(&sim, &a);
        let v = sim.capture_violations();
        assert!(v.is_empty(), "violations: {v:?}");
    });
}

#[test]
fn p7_capture_with_frees_on_other_threads() {
    for s in 0..iters(20) as u64 {
        capture_storm("", s);
    }
}

#[test]
fn p7b_capture_with_frees_on_other_threads_expandable() {
    for s in 0..iters(20) as u64 {
        capture_storm("expandable_segments:True", s);
    }
}

// ------------------------------------------------------------------------------------------
// 8. Many threads mixing default pools and user pools (made and released by the threads) while
//    readers call empty_cache, memory_stats, snapshot, reset_peak_stats, pool stats.
// ------------------------------------------------------------------------------------------
fn mixing_storm(conf: &str, seed: u64, threads: usize, steps: usize) {
    let (sim, a) = sim_with(1 << 30, conf);
    within(120, "mixing storm", move || {
        const HOLD: usize = 6;
        let shared = MemPool::on(&a, PoolOptions::new().use_on_oom(true)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        for t in 0..threads as u64 {
            let a = a.clone();
            let h = shared.scope_handle();
            let sim = sim.clone();
            hs.push(std::thread::spawn(move || {
                let mut r = Rng(seed.wrapping_mul(31) + t * 7919 + 1);
                let st = sim.new_stream();
                let mut own: Option<MemPool<Sim>> = None;
                let mut held: Vec<Buffer<u8, Sim>> = Vec::new();
                for _ in 0..steps {
                    match r.below(10) {
                        0 => own = Some(MemPool::on(&a, PoolOptions::new().expandable(r.below(2) == 0)).unwrap()),
                        1 => own = None,
                        _ => {}
                    }
                    let _c = if r.below(3) == 0 { Some(a.set_stream(&st).unwrap()) } else { None };
                    let size = r.size(23);
                    let b = match r.below(4) {
                        0 => {
                            let _g = h.enter();
                            a.alloc::<u8>(size)
                        }
                        1 => match &own {
                            Some(p) => p.alloc::<u8>(size),
                            None => a.alloc::<u8>(size),
                        },
                        2 => match &own {
                            Some(p) => {
                                let g = p.scope();
                                let x = a.alloc::<u8>(size);
                                if r.below(50) == 0 {
                                    std::mem::forget(g);
                                } else {
                                    drop(g);
                                }
                                x
                            }
                            None => a.alloc::<u8>(size),
                        },
                        _ => a.alloc::<u8>(size),
                    };
                    match b {
                        Ok(b) => held.push(b),
                        Err(e) => panic!("alloc failed: {e}"),
                    }
                    if held.len() > HOLD {
                        let i = r.below(held.len() as u64) as usize;
                        let b = held.swap_remove(i);
                        if r.below(8) == 0 {
                            b.record_stream(&sim.new_stream()).unwrap();
                        }
                    }
                }
                held
            }));
        }
        let mut readers = Vec::new();
        for k in 0..2u64 {
            let a = a.clone();
            let stop = stop.clone();
            let sim = sim.clone();
            let shared = shared.clone();
            readers.push(std::thread::spawn(move || {
                let mut r = Rng(seed + k + 100);
                let mut last_alloc = 0u64;
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    match r.below(7) {
                        0 => a.empty_cache().unwrap(),
                        1 => a.reset_peak_stats(),
                        2 => {
                            let s = a.snapshot();
                            common::check_snapshot(&s);
                        }
                        3 => shared.empty_cache().unwrap(),
                        4 => {
                            let p = shared.memory_stats();
                            assert!(p.allocation.current >= 0 && p.allocation.peak >= p.allocation.current, "{p:?}");
                            assert!(p.allocation.current as usize <= threads * (HOLD + 1), "{p:?}");
                        }
                        5 => sim.complete_all(),
                        _ => {
                            let s = a.memory_stats();
                            let max = (threads * (HOLD + 1)) as i64;
                            assert!(s.allocation.all.current <= max, "allocation current {}", s.allocation.all.current);
                            assert!(s.allocation.all.current >= 0);
                            assert!(s.allocation.all.peak >= s.allocation.all.current);
                            assert!(s.allocation.all.peak <= max, "allocation peak {} > {max}", s.allocation.all.peak);
                            assert!(s.allocation.all.allocated >= last_alloc, "total went down");
                            last_alloc = s.allocation.all.allocated;
                            assert!(s.reserved_bytes.all.current >= s.allocated_bytes.all.current);
                        }
                    }
                }
                n
            }));
        }
        let mut held = Vec::new();
        for h in hs {
            held.extend(h.join().unwrap());
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
        sim.complete_all();
        check_invariants(&a, Some(&sim));
        check_pool(&shared);
        drop(held);
        drop(shared);
        sim.complete_all();
        all_given_back(&sim, &a);
    });
}

#[test]
fn p8_mixing_storm() {
    for s in 0..iters(10) as u64 {
        mixing_storm("", s, 6, 4000);
    }
}

#[test]
fn p8b_mixing_storm_expandable() {
    for s in 0..iters(10) as u64 {
        mixing_storm("expandable_segments:True", s, 6, 4000);
    }
}

// ------------------------------------------------------------------------------------------
// 9. Out of memory during a capture on a small device: the ladder must give nothing back (no
//    free or unmap during the capture) and the capture's allocation fails cleanly; after the
//    capture ends, the memory can be had again.
// ------------------------------------------------------------------------------------------
fn oom_in_capture(conf: &str, expandable_pool: bool, other_thread: bool) {
    let (sim, a) = sim_with(64 * MIB, conf);
    within(30, "oom in capture", move || {
        let s = sim.new_stream();
        // Fill the cache of the default pools (freed, cached) and of a released pool.
        {
            let x = a.alloc::<u8>(20 * MIB).unwrap();
            let y = a.alloc::<u8>(500_000).unwrap();
            let rel = MemPool::on(&a, PoolOptions::new().expandable(expandable_pool)).unwrap();
            let z = rel.alloc::<u8>(12 * MIB).unwrap();
            drop(rel);
            drop((x, y, z));
        }
        let gp = MemPool::on(&a, PoolOptions::new().expandable(expandable_pool)).unwrap();
        let _cur = a.set_stream(&s).unwrap();
        let cap = a.begin_capture(&s, &gp, CaptureMode::ThreadLocal).unwrap();
        let r = if other_thread {
            let a2 = a.clone();
            let s2 = s;
            std::thread::spawn(move || {
                let _c = a2.set_stream(&s2).unwrap();
                let b = a2.alloc::<u8>(60 * MIB).map(|_| ());
                // And a default allocation on another stream.
                let c = a2.alloc::<u8>(40 * MIB).map(|_| ());
                (b, c)
            })
            .join()
            .unwrap()
            .0
        } else {
            a.alloc::<u8>(60 * MIB).map(|_| ())
        };
        let v = sim.capture_violations();
        assert!(v.is_empty(), "violations during capture: {v:?}");
        assert!(matches!(r, Err(mempool::Error::OutOfMemory(_))), "{r:?}");
        drop(cap);
        let v = sim.capture_violations();
        assert!(v.is_empty(), "violations: {v:?}");
        check_invariants(&a, Some(&sim));
        // Now the memory can be had.
        let mut gp = Some(gp);
        if other_thread {
            gp = None;
        }
        let b = a.alloc::<u8>(50 * MIB).unwrap();
        drop(b);
        drop(gp);
        drop(_cur);
        all_given_back(&sim, &a);
    });
}

#[test]
fn p9_oom_in_capture() {
    oom_in_capture("", false, false);
}
#[test]
fn an_oom_in_a_capture_of_an_expandable_pool_gives_back_what_it_mapped() {
    oom_in_capture("expandable_segments:True", true, false);
}
#[test]
fn p9c_oom_in_capture_other_thread() {
    oom_in_capture("expandable_segments:True", true, true);
}
#[test]
fn p9d_oom_in_capture_other_thread_plain() {
    oom_in_capture("", false, true);
}

// ------------------------------------------------------------------------------------------
// 10. A request of an expandable user pool that fails for lack of memory leaves the physical
//     allocations it managed to map in the pool's cache (never handed out); the default pools'
//     out-of-memory ladder does not take a live user pool's cache, so the device's free
//     memory is gone for default requests that would fit.
// ------------------------------------------------------------------------------------------
#[test]
fn a_failed_expandable_pool_request_gives_back_what_it_mapped() {
    let (sim, a) = sim_with(64 * MIB, "");
    let pool = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
    let x = a.alloc::<u8>(20 * MIB).unwrap();
    let r = pool.alloc::<u8>(60 * MIB);
    assert!(matches!(r, Err(mempool::Error::OutOfMemory(_))), "{r:?}");
    let ps = pool.memory_stats();
    check_invariants(&a, Some(&sim));
    let left = ps.reserved_bytes.current;
    // A default request for memory the device has free (64 - 20 = 44 MiB, 40 asked for).
    let d = a.alloc::<u8>(40 * MIB);
    assert_eq!(
        left,
        0,
        "a failed request left {left} bytes mapped in the pool (allocation current {}), \
        and a 40 MiB default request then got {:?}",
        ps.allocation.current,
        d.as_ref().map(|_| ())
    );
    drop((x, d, pool));
    all_given_back(&sim, &a);
}

/// The same with expandable default pools: the failed default request leaves its partial map
/// mapped; a user pool's request does get it back through its ladder (default caches are
/// given back), so only the stats show it: reserved with nothing allocated.
#[test]
fn a_failed_expandable_default_request_gives_back_what_it_mapped() {
    let (sim, a) = sim_with(64 * MIB, "expandable_segments:True");
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let x = pool.alloc::<u8>(20 * MIB).unwrap();
    let r = a.alloc::<u8>(60 * MIB);
    assert!(matches!(r, Err(mempool::Error::OutOfMemory(_))), "{r:?}");
    let s = a.memory_stats();
    check_invariants(&a, Some(&sim));
    let left = s.reserved_bytes.all.current - pool.memory_stats().reserved_bytes.current;
    assert_eq!(left, 0, "a failed default request left {left} bytes mapped");
    drop((x, pool));
    all_given_back(&sim, &a);
}

// ------------------------------------------------------------------------------------------
// 11. Pool peaks when two threads take turns with cached blocks of the pool (strict turns,
//     no concurrency at all: each step is finished before the next begins).
// ------------------------------------------------------------------------------------------
fn turns(pool_peak: bool, reset_first: bool) -> (i64, i64) {
    let (_sim, a) = sim_with(1 << 32, "");
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let (tx_a, rx_a) = std::sync::mpsc::channel::<u32>();
    let (tx_b, rx_b) = std::sync::mpsc::channel::<u32>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let mk =
        |rx: std::sync::mpsc::Receiver<u32>, p: MemPool<Sim>, a: Allocator<Sim>, done: std::sync::mpsc::Sender<()>| {
            std::thread::spawn(move || {
                let mut held: Vec<Buffer<u8, Sim>> = Vec::new();
                while let Ok(cmd) = rx.recv() {
                    match cmd {
                        0 => {
                            for _ in 0..3 {
                                held.push(if pool_peak {
                                    p.alloc::<u8>(4096).unwrap()
                                } else {
                                    a.alloc::<u8>(4096).unwrap()
                                });
                            }
                        }
                        1 => held.clear(),
                        _ => break,
                    }
                    done.send(()).unwrap();
                }
            })
        };
    let ta = mk(rx_a, pool.clone(), a.clone(), done_tx.clone());
    let tb = mk(rx_b, pool.clone(), a.clone(), done_tx);
    let step = |tx: &std::sync::mpsc::Sender<u32>, c: u32| {
        tx.send(c).unwrap();
        done_rx.recv().unwrap();
    };
    step(&tx_a, 0);
    step(&tx_a, 1);
    if reset_first {
        a.reset_peak_stats();
    }
    step(&tx_b, 0);
    if std::env::var("R14_MIDREAD").is_ok() {
        let _ = a.memory_stats();
    }
    step(&tx_a, 0); // 6 allocated now
    let truth = 6;
    let got = if pool_peak { pool.memory_stats().allocation.peak } else { a.memory_stats().allocation.all.peak };
    tx_a.send(9).unwrap();
    tx_b.send(9).unwrap();
    ta.join().unwrap();
    tb.join().unwrap();
    (got, truth)
}

#[test]
fn p11_pool_peak_threads_taking_turns() {
    let (got, truth) = turns(true, false);
    assert_eq!(got, truth, "pool allocation peak");
}
#[test]
fn p11b_pool_peak_threads_taking_turns_after_reset() {
    let (got, truth) = turns(true, true);
    assert_eq!(got, truth, "pool allocation peak");
}
#[test]
fn p11c_device_peak_threads_taking_turns() {
    let (got, truth) = turns(false, true);
    assert_eq!(got, truth, "device allocation peak");
}

// ------------------------------------------------------------------------------------------
// 12. use_on_oom lending: a borrowed block outlives its lender's release, freed on another
//     thread; stats of the lender while lent; everything given back after.
// ------------------------------------------------------------------------------------------
#[test]
fn p12_borrowed_block_outlives_lender() {
    for expandable in [false, true] {
        let conf = if expandable { "expandable_segments:True" } else { "" };
        let (sim, a) = sim_with(64 * MIB, conf);
        let lender = MemPool::on(&a, PoolOptions::new().use_on_oom(true).expandable(expandable)).unwrap();
        let l = lender.alloc::<u8>(40 * MIB).unwrap();
        drop(l);
        // The default pools have no room for 30 MiB; the lender has a free 40 MiB block.
        let x = a.alloc::<u8>(20 * MIB).unwrap();
        let b = a.alloc::<u8>(30 * MIB).expect("borrowed");
        check_invariants(&a, Some(&sim));
        check_pool(&lender);
        drop(lender);
        check_invariants(&a, Some(&sim));
        let t = std::thread::spawn(move || drop(b));
        t.join().unwrap();
        drop(x);
        all_given_back(&sim, &a);
    }
}

// ------------------------------------------------------------------------------------------
// 13. An expandable pool released while one of its maps is under way (its map guard's
//     `mapped` drops the pool's last handle; the request came through a forgotten scope, so
//     the requester holds no handle). The memory just mapped must not be lost, nor handed to
//     the pool that takes the slot next.
// ------------------------------------------------------------------------------------------
struct DropOnMap(Arc<std::sync::Mutex<Option<MemPool<Sim>>>>);
impl mempool::MapGuard for DropOnMap {
    fn mapped(&self, _addr: u64, _size: usize) {
        let p = self.0.lock().unwrap().take();
        drop(p);
    }
    fn unmapping(&self, _addr: u64, _size: usize) -> Result<(), String> {
        Ok(())
    }
}

#[test]
fn a_pool_released_by_its_guard_during_a_map_keeps_nothing() {
    let (sim, a) = sim_with(1 << 30, "");
    within(30, "p13", move || {
        let holder = Arc::new(std::sync::Mutex::new(None));
        let pool = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(DropOnMap(holder.clone()))).unwrap();
        let old = pool.id();
        let h = pool.scope_handle();
        std::mem::forget(h.enter());
        drop(h);
        *holder.lock().unwrap() = Some(pool);
        let b = a.alloc::<u8>(4 * MIB).unwrap();
        let held: usize = a.snapshot().segments.iter().filter(|s| s.pool == old).map(|s| s.total_size).sum();
        let mapped_before_empty = sim.mapped().iter().map(|m| m.1).sum::<usize>();
        // The released pool's slot goes to a new pool.
        let newp = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
        let nb = newp.alloc::<u8>(MIB).unwrap();
        check_invariants(&a, Some(&sim));
        let ns = newp.memory_stats();
        check_pool(&newp);
        assert_eq!(ns.allocation.current, 1);
        drop((b, nb, newp));
        assert_eq!(held, 0, "the released pool kept {held} bytes mapped (device mapped {mapped_before_empty}) with no block and no handle, until empty_cache");
        all_given_back(&sim, &a);
    });
}

/// The same without a guard: the pool's last handle dropped on main while a thread with a
/// forgotten scope of it maps memory in a loop. Counts the rounds where the released pool
/// still holds mapped memory once everything is freed (no empty_cache yet).
#[test]
fn a_pool_released_during_another_threads_maps_keeps_nothing() {
    let rounds = iters(5000);
    let mut bad = 0;
    for _ in 0..rounds {
        let (sim, a) = sim_with(1 << 34, "");
        let pool = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
        let old = pool.id();
        let h = pool.scope_handle();
        let a2 = a.clone();
        let go = Arc::new(Barrier::new(2));
        let go2 = go.clone();
        let t = std::thread::spawn(move || {
            std::mem::forget(h.enter());
            drop(h);
            go2.wait();
            for i in 0..200 {
                // Each one maps: sizes grow so the cache never fits.
                let b = a2.alloc::<u8>((i + 1) * 2 * MIB + 4096).unwrap();
                std::hint::black_box(&b);
            }
        });
        go.wait();
        std::thread::sleep(Duration::from_micros(50 + (bad as u64 % 7) * 30));
        drop(pool);
        t.join().unwrap();
        let held: usize = a.snapshot().segments.iter().filter(|s| s.pool == old).map(|s| s.total_size).sum();
        if held != 0 {
            bad += 1;
        }
        all_given_back(&sim, &a);
    }
    assert_eq!(bad, 0, "{bad} of {rounds} rounds: a released pool kept mapped memory after its last block was freed");
}
