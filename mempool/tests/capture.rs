//! Graph captures on the simulated device: routing by capture id, deferred cross-stream frees,
//! refusals, release, and no call that CUDA forbids during a capture.

mod common;

use std::sync::Arc;

use common::check_invariants;
use mempool::sim::SimDevice;
use mempool::{Allocator, CaptureMode, Error, MemPool, PoolOptions, Sim};

const MIB: usize = 1 << 20;

fn setup() -> (Arc<SimDevice>, Allocator<Sim>) {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    (sim, a)
}

fn pool(a: &Allocator<Sim>) -> MemPool<Sim> {
    MemPool::on(a, PoolOptions::new()).unwrap()
}

/// Bytes allocated from `p` now.
fn in_pool(p: &MemPool<Sim>) -> i64 {
    p.memory_stats().allocated_bytes.current
}

#[test]
fn allocations_on_the_captured_stream_go_to_the_capture_pool_whatever_the_scope() {
    let (sim, a) = setup();
    let s = sim.new_stream();
    let _cur = a.set_stream(&s).unwrap();
    let (graph_pool, scoped) = (pool(&a), pool(&a));
    let _scope = scoped.scope();
    let cap = a.begin_capture(&s, &graph_pool, CaptureMode::Global).unwrap();
    let b = a.alloc::<u8>(MIB).unwrap();
    assert_eq!(in_pool(&graph_pool), MIB as i64, "captured allocation not in the capture's pool");
    assert_eq!(in_pool(&scoped), 0);
    let graph = cap.end().unwrap();
    // After the capture the scope routes again.
    let c = a.alloc::<u8>(MIB).unwrap();
    assert_eq!(in_pool(&scoped), MIB as i64);
    assert_eq!(in_pool(&graph_pool), MIB as i64);
    drop((b, c, graph));
    assert!(sim.capture_violations().is_empty(), "{:?}", sim.capture_violations());
    check_invariants(&a, Some(&sim));
}

#[test]
fn a_stream_forked_into_the_capture_allocates_from_its_pool_and_others_do_not() {
    let (sim, a) = setup();
    let (s, fork, other) = (sim.new_stream(), sim.new_stream(), sim.new_stream());
    let p = pool(&a);
    let cap = a.begin_capture(&s, &p, CaptureMode::Global).unwrap();
    sim.join_capture(fork, cap.id());
    let on_fork = {
        let _cur = a.set_stream(&fork).unwrap();
        a.alloc::<u8>(4096).unwrap()
    };
    assert_eq!(in_pool(&p), 4096);
    let on_other = {
        let _cur = a.set_stream(&other).unwrap();
        a.alloc::<u8>(4096).unwrap()
    };
    assert_eq!(in_pool(&p), 4096, "a stream outside the capture allocated from its pool");
    let g = cap.end().unwrap();
    drop((on_fork, on_other, g));
    assert!(sim.capture_violations().is_empty(), "{:?}", sim.capture_violations());
}

#[test]
fn a_buffer_freed_during_capture_after_use_on_another_stream_is_not_reused_before_it_ends() {
    let (sim, a) = setup();
    let (s, side) = (sim.new_stream(), sim.new_stream());
    let _cur = a.set_stream(&s).unwrap();
    let p = pool(&a);
    let cap = a.begin_capture(&s, &p, CaptureMode::Global).unwrap();
    sim.join_capture(side, cap.id());
    let b = a.alloc::<u8>(MIB).unwrap();
    let addr = b.device_ptr_raw();
    b.record_stream(&side).unwrap();
    drop(b);
    let again = a.alloc::<u8>(MIB).unwrap();
    assert_ne!(again.device_ptr_raw(), addr, "reused during the capture after a use on another stream");
    assert!(sim.capture_violations().is_empty(), "{:?}", sim.capture_violations());
    let g = cap.end().unwrap();
    // Now its event is recorded on `side`; once that completes the pool hands it out again.
    assert_eq!(sim.pending_events(side), 1, "the deferred free recorded no event after the capture");
    sim.complete_stream(side);
    let back = p.alloc::<u8>(MIB).unwrap();
    assert_eq!(back.device_ptr_raw(), addr);
    drop((again, back, g));
    check_invariants(&a, Some(&sim));
}

#[test]
fn nothing_cuda_forbids_happens_during_a_capture_even_out_of_memory() {
    let sim = SimDevice::new(64 * MIB);
    let a = Allocator::sim(sim.clone());
    let (s, side) = (sim.new_stream(), sim.new_stream());
    let _cur = a.set_stream(&s).unwrap();
    // A cross-stream free pending from before the capture, and a free cached segment.
    let pending = a.alloc::<u8>(MIB).unwrap();
    pending.record_stream(&side).unwrap();
    drop(pending);
    drop(a.alloc::<u8>(30 * MIB).unwrap());
    let p = pool(&a);
    let cap = a.begin_capture(&s, &p, CaptureMode::Global).unwrap();
    // New segments, frees, and an allocation that cannot be served.
    let x = a.alloc::<u8>(8 * MIB).unwrap();
    drop(a.alloc::<u8>(2 * MIB).unwrap());
    let err = a.alloc::<u8>(48 * MIB).unwrap_err();
    assert!(matches!(&err, Error::OutOfMemory(r) if r.during_capture), "{err}");
    assert!(err.to_string().contains("graph capture is under way"), "{err}");
    assert!(matches!(a.empty_cache(), Err(Error::Capture { what: "empty_cache", .. })));
    assert!(matches!(p.empty_cache(), Err(Error::Capture { .. })));
    let _ = a.memory_stats();
    let _ = a.snapshot();
    assert!(sim.capture_violations().is_empty(), "{:?}", sim.capture_violations());
    let g = cap.end().unwrap();
    // After it: the out-of-memory request can be served once the caches are given back (the
    // graph pool's too, once graph and pool handle are gone).
    drop((x, g, p));
    sim.complete_stream(side);
    a.empty_cache().unwrap();
    let big = a.alloc::<u8>(48 * MIB).unwrap();
    drop(big);
    check_invariants(&a, Some(&sim));
}

#[test]
fn a_pool_released_during_a_capture_gives_its_memory_back_when_it_ends() {
    let (sim, a) = setup();
    let s = sim.new_stream();
    let _cur = a.set_stream(&s).unwrap();
    let other = pool(&a);
    let b = other.alloc::<u8>(MIB).unwrap();
    let before = sim.live_segments().len();
    let p = pool(&a);
    let cap = a.begin_capture(&s, &p, CaptureMode::Global).unwrap();
    drop(other);
    drop(b);
    assert_eq!(sim.live_segments().len(), before, "a segment went back during the capture");
    let g = cap.end().unwrap();
    assert_eq!(sim.live_segments().len(), before - 1, "the released pool's segment did not go back after");
    assert!(sim.capture_violations().is_empty(), "{:?}", sim.capture_violations());
    drop(g);
}

#[test]
fn replays_allocate_nothing_and_the_pool_goes_when_graph_and_buffers_are_gone() {
    let (sim, a) = setup();
    let s = sim.new_stream();
    let _cur = a.set_stream(&s).unwrap();
    let p = pool(&a);
    let cap = a.begin_capture(&s, &p, CaptureMode::Global).unwrap();
    drop(p);
    let out = a.alloc::<f32>(1 << 18).unwrap();
    drop(a.alloc::<u8>(3 * MIB).unwrap());
    let g = cap.end().unwrap();
    let (segments, allocs) = (sim.live_segments().len(), sim.counters().0);
    for _ in 0..1000 {
        // SAFETY: simulated memory is never touched; the graph's buffer `out` is alive.
        unsafe { g.replay() }.unwrap();
    }
    assert_eq!(sim.graph_launches(), 1000);
    assert_eq!((sim.live_segments().len(), sim.counters().0), (segments, allocs), "a replay allocated");
    assert_eq!(g.pool().memory_stats().allocated_bytes.current, 1 << 20);
    drop(g);
    // The wholly free segment goes back with the pool; the one `out` lies in stays.
    let at = out.device_ptr_raw();
    assert!(
        sim.live_segments().iter().any(|&(s, n)| s <= at && at < s + n as u64),
        "the pool's memory went while a buffer of it lives"
    );
    drop(out);
    assert_eq!(sim.live_segments().len(), 0, "the graph pool was not released");
    check_invariants(&a, Some(&sim));
}

#[test]
fn two_graphs_share_a_pool_one_capture_at_a_time() {
    let (sim, a) = setup();
    let (s, s2) = (sim.new_stream(), sim.new_stream());
    let p = pool(&a);
    let cap = a.begin_capture(&s, &p, CaptureMode::Global).unwrap();
    let err = a.begin_capture(&s2, &p, CaptureMode::Global).unwrap_err();
    assert!(
        matches!(&err, Error::Capture { what: "begin_capture", message } if message.contains("two captures")),
        "{err}"
    );
    let err = a.begin_capture(&s, &pool(&a), CaptureMode::Global).unwrap_err();
    assert!(err.to_string().contains("already being captured"), "{err}");
    let first = {
        let _cur = a.set_stream(&s).unwrap();
        let b = a.alloc::<u8>(MIB).unwrap();
        let g = cap.end().unwrap();
        drop(b);
        g
    };
    let cap2 = a.begin_capture(&s2, first.pool(), CaptureMode::Global).unwrap();
    let _cur = a.set_stream(&s2).unwrap();
    let c = a.alloc::<u8>(MIB).unwrap();
    assert_eq!(in_pool(first.pool()), MIB as i64);
    let second = cap2.end().unwrap();
    assert_eq!(second.pool().id(), first.pool().id());
    drop((c, first, second, p));
    assert!(sim.capture_violations().is_empty(), "{:?}", sim.capture_violations());
    check_invariants(&a, Some(&sim));
}

#[test]
fn a_capture_dropped_without_end_is_discarded_and_the_allocator_goes_on() {
    let (sim, a) = setup();
    let s = sim.new_stream();
    let _cur = a.set_stream(&s).unwrap();
    let p = pool(&a);
    let b;
    {
        let _cap = a.begin_capture(&s, &p, CaptureMode::Global).unwrap();
        b = a.alloc::<u8>(MIB).unwrap();
    }
    // The stream captures no more, allocations route as usual, memory can go back.
    let c = a.alloc::<u8>(MIB).unwrap();
    assert_eq!(in_pool(&p), MIB as i64);
    drop(c);
    a.empty_cache().unwrap();
    let again = a.begin_capture(&s, &p, CaptureMode::Global).unwrap();
    drop(again);
    drop(b);
    check_invariants(&a, Some(&sim));
}

#[test]
fn bad_input_gets_clear_errors() {
    let (sim, a) = setup();
    let s = sim.new_stream();
    // A stream of another device.
    let sim1 = SimDevice::with_index(1, 1 << 30);
    let err = a.begin_capture(&sim1.new_stream(), &pool(&a), CaptureMode::Global).unwrap_err();
    assert!(matches!(err, Error::WrongDevice { what: "begin_capture", .. }), "{err}");
    // A pool of another allocator.
    let b = Allocator::sim(SimDevice::new(1 << 30));
    let err = a.begin_capture(&s, &pool(&b), CaptureMode::Global).unwrap_err();
    assert!(err.to_string().contains("another allocator"), "{err}");
    // Host memory has no graphs.
    let h = Allocator::host();
    let hp = MemPool::on(&h, PoolOptions::new()).unwrap();
    let err = h.begin_capture(&mempool::StreamId(0), &hp, CaptureMode::Global).unwrap_err();
    assert!(matches!(err, Error::Capture { .. }), "{err}");
    // Nothing was left capturing.
    a.empty_cache().unwrap();
    assert!(sim.capture_violations().is_empty());
}

#[test]
fn statistics_stay_exact_across_captures() {
    let (sim, a) = setup();
    let (s, side) = (sim.new_stream(), sim.new_stream());
    let _cur = a.set_stream(&s).unwrap();
    let mut rng = common::Rng(7);
    let p = pool(&a);
    let mut live = Vec::new();
    for round in 0..6 {
        let cap = (round % 2 == 0).then(|| a.begin_capture(&s, &p, CaptureMode::Global).unwrap());
        if let Some(c) = &cap {
            sim.join_capture(side, c.id());
        }
        for _ in 0..200 {
            if rng.below(3) == 0 && !live.is_empty() {
                let i = rng.below(live.len() as u64) as usize;
                let b: mempool::Buffer<u8, Sim> = live.swap_remove(i);
                if rng.below(2) == 0 {
                    b.record_stream(&side).unwrap();
                }
                drop(b);
            } else {
                live.push(a.alloc::<u8>(rng.size(24)).unwrap());
            }
        }
        check_invariants(&a, Some(&sim));
        if let Some(c) = cap {
            drop(c.end().unwrap());
        }
        sim.complete_all();
        check_invariants(&a, Some(&sim));
    }
    drop(live);
    drop(p);
    sim.complete_all();
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
    assert!(sim.capture_violations().is_empty(), "{:?}", sim.capture_violations());
}

#[test]
fn a_graph_keeps_its_pools_memory_through_empty_cache_and_out_of_memory() {
    let sim = SimDevice::new(64 * MIB);
    let a = Allocator::sim(sim.clone());
    let s = sim.new_stream();
    let _cur = a.set_stream(&s).unwrap();
    let p = pool(&a);
    let cap = a.begin_capture(&s, &p, CaptureMode::Global).unwrap();
    // A temporary of the graph: freed during the capture, its memory is where replays write.
    drop(a.alloc::<u8>(30 * MIB).unwrap());
    let g = cap.end().unwrap();
    let held = sim.live_segments();
    assert_eq!(held.len(), 1);
    p.empty_cache().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.live_segments(), held, "MemPool::empty_cache gave a graph's memory back");
    // Out of memory in the graph's pool does not give it back either.
    assert!(matches!(p.alloc::<u8>(40 * MIB), Err(Error::OutOfMemory(_))));
    assert_eq!(sim.live_segments(), held, "the out-of-memory ladder gave a graph's memory back");
    drop(g);
    p.empty_cache().unwrap();
    assert!(sim.live_segments().is_empty(), "the pool kept its memory after the graph went");
    check_invariants(&a, Some(&sim));
}

#[test]
fn the_scoped_form_ends_its_capture_even_when_the_closure_panics() {
    let (sim, a) = setup();
    let s = sim.new_stream();
    let _cur = a.set_stream(&s).unwrap();
    let p = pool(&a);
    let (g, b) = a.capture(&s, &p, CaptureMode::Global, || a.alloc::<u8>(MIB).unwrap()).unwrap();
    assert_eq!(in_pool(g.pool()), MIB as i64);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = a.capture(&s, &p, CaptureMode::Global, || -> () { panic!("in the capture") });
    }));
    assert!(panicked.is_err());
    // The capture was discarded: the stream captures no more, memory can go back.
    assert!(a.empty_cache().is_ok());
    let c = a.alloc::<u8>(MIB).unwrap();
    assert_eq!(in_pool(&p), MIB as i64, "an allocation after the panicked capture went to its pool");
    drop((b, c, g));
    assert!(sim.capture_violations().is_empty());
    check_invariants(&a, Some(&sim));
}

#[test]
fn a_use_on_oom_pool_lends_nothing_while_a_graph_holds_it() {
    let sim = SimDevice::new(64 * MIB);
    let a = Allocator::sim(sim.clone());
    let s = sim.new_stream();
    let _cur = a.set_stream(&s).unwrap();
    let lender = MemPool::on(&a, PoolOptions::new().use_on_oom(true)).unwrap();
    let cap = a.begin_capture(&s, &lender, CaptureMode::Global).unwrap();
    // A graph temporary: 40 MiB of the pool's memory, free again when the capture ends.
    drop(a.alloc::<u8>(40 * MIB).unwrap());
    let g = cap.end().unwrap();
    // A default-pool request that only the lender's free block could serve.
    let err = a.alloc::<u8>(30 * MIB).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory(_)), "a graph's temporary memory was lent: {err}");
    drop(g);
    let b = a.alloc::<u8>(30 * MIB).unwrap();
    assert_eq!(in_pool(&lender), 30 * MIB as i64, "lent once the graph is gone");
    drop(b);
    check_invariants(&a, Some(&sim));
}
