//! The caching rules on the simulated device, with exact addresses.

mod common;

use common::check_invariants;
use mempool::sim::SimDevice;
use mempool::{Allocator, BlockState, Config, Error, Sim, StreamId};

const BASE: u64 = SimDevice::BASE;
const MIB: usize = 1 << 20;

/// PyTorch's placement rules, block by block: without the thread caches, which reuse a block
/// freed by the same thread for the same request before best fit looks (`thread_cache.rs`).
fn setup(capacity: usize) -> (std::sync::Arc<SimDevice>, Allocator<Sim>) {
    let sim = SimDevice::new(capacity);
    let config = mempool::Config::builder().thread_cache(false).build().expect("a valid config");
    (sim.clone(), Allocator::sim_with(sim, config))
}

fn states(a: &Allocator<Sim>, seg: usize) -> Vec<(u64, usize, BlockState)> {
    a.snapshot().segments[seg].blocks.iter().map(|b| (b.address - BASE, b.size, b.state)).collect()
}

#[test]
fn small_requests_round_to_512_in_2mib_segments() {
    let (sim, a) = setup(1 << 30);
    let x = a.alloc::<u8>(1).unwrap();
    assert_eq!(x.device_ptr_raw(), BASE);
    assert_eq!(sim.live_segments(), vec![(BASE, 2 * MIB)]);
    let s = a.memory_stats();
    assert_eq!(s.allocated_bytes.all.current, 512);
    assert_eq!(s.requested_bytes.all.current, 1);
    assert_eq!(s.reserved_bytes.small_pool.current, 2 * MIB as i64);
    assert_eq!(s.reserved_bytes.large_pool.current, 0);
    let y = a.alloc::<u8>(1000).unwrap();
    assert_eq!(y.device_ptr_raw(), BASE + 512);
    let z = a.alloc::<u8>(MIB).unwrap(); // exactly 1 MiB is still small
    assert_eq!(z.device_ptr_raw(), BASE + 1536);
    use BlockState::*;
    assert_eq!(
        states(&a, 0),
        vec![
            (0, 512, Allocated),
            (512, 1024, Allocated),
            (1536, MIB, Allocated),
            (1536 + MIB as u64, MIB - 1536, Free)
        ]
    );
    check_invariants(&a, Some(&sim));
}

#[test]
fn frees_merge_with_free_neighbours() {
    let (sim, a) = setup(1 << 30);
    let x = a.alloc::<u8>(512).unwrap();
    let y = a.alloc::<u8>(1000).unwrap();
    let z = a.alloc::<u8>(4096).unwrap();
    drop(y);
    use BlockState::*;
    assert_eq!(states(&a, 0)[1], (512, 1024, Free));
    let s = a.memory_stats();
    assert_eq!(s.inactive_split.all.current, 2);
    assert_eq!(s.inactive_split_bytes.all.current, (1024 + 2 * MIB - 512 - 1024 - 4096) as i64);
    check_invariants(&a, Some(&sim));
    drop(x); // merges with y's block
    assert_eq!(states(&a, 0)[0], (0, 1536, Free));
    drop(z); // merges with both sides: one free block, the whole segment
    assert_eq!(states(&a, 0), vec![(0, 2 * MIB, Free)]);
    let s = a.memory_stats();
    assert_eq!(s.inactive_split.all.current, 0);
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.reserved_bytes.all.current, 2 * MIB as i64);
    check_invariants(&a, Some(&sim));
    a.empty_cache().unwrap();
    assert!(sim.live_segments().is_empty());
    assert_eq!(a.memory_stats().num_device_free, 1);
    check_invariants(&a, Some(&sim));
}

#[test]
fn best_fit_takes_smallest_then_lowest_address() {
    let (_sim, a) = setup(1 << 30);
    let b4k = a.alloc::<u8>(4096).unwrap();
    let _sep1 = a.alloc::<u8>(512).unwrap();
    let b2k_a = a.alloc::<u8>(2048).unwrap();
    let _sep2 = a.alloc::<u8>(512).unwrap();
    let b2k_b = a.alloc::<u8>(2048).unwrap();
    let _sep3 = a.alloc::<u8>(512).unwrap();
    let (first2k, second2k) = (b2k_a.device_ptr_raw(), b2k_b.device_ptr_raw());
    drop((b4k, b2k_a, b2k_b));
    let x = a.alloc::<u8>(1500).unwrap(); // 1536: the lower 2 KiB block, split
    assert_eq!(x.device_ptr_raw(), first2k);
    let y = a.alloc::<u8>(512).unwrap(); // the 512 B rest of that split
    assert_eq!(y.device_ptr_raw(), first2k + 1536);
    let z = a.alloc::<u8>(2048).unwrap(); // the other 2 KiB block, exact
    assert_eq!(z.device_ptr_raw(), second2k);
    let w = a.alloc::<u8>(3000).unwrap(); // 3072: the 4 KiB block, split
    assert_eq!(w.device_ptr_raw(), BASE);
}

#[test]
fn large_requests_and_segment_sizes() {
    let (sim, a) = setup(1 << 30);
    let big = a.alloc::<u8>(10 * MIB).unwrap(); // 10 MiB: its own segment of exactly that size
    let odd = a.alloc::<u8>(11 * MIB).unwrap(); // 12 MiB segment; 1 MiB rest is not > 1 MiB: no split
    let m = a.alloc::<u8>(MIB + 1).unwrap(); // large pool, 20 MiB segment, split (rest > 1 MiB)
    let m2 = a.alloc::<u8>(5 * MIB).unwrap(); // same segment
    assert_eq!(big.device_ptr_raw(), BASE);
    assert_eq!(odd.device_ptr_raw(), BASE + 10 * MIB as u64);
    assert_eq!(m.device_ptr_raw(), BASE + 22 * MIB as u64);
    assert_eq!(m2.device_ptr_raw(), m.device_ptr_raw() + (MIB + 512) as u64);
    assert_eq!(
        sim.live_segments(),
        vec![(BASE, 10 * MIB), (BASE + 10 * MIB as u64, 12 * MIB), (BASE + 22 * MIB as u64, 20 * MIB)]
    );
    let s = a.memory_stats();
    assert_eq!(s.allocated_bytes.large_pool.current, (MIB + 512 + 5 * MIB + 10 * MIB + 12 * MIB) as i64);
    assert_eq!(s.requested_bytes.large_pool.current, (MIB + 1 + 5 * MIB + 10 * MIB + 11 * MIB) as i64);
    assert_eq!(s.allocated_bytes.small_pool.current, 0);
    check_invariants(&a, Some(&sim));
    // A 1 MiB rest is not split off in the large pool: 19 MiB takes the whole 20 MiB block.
    let seg = m.device_ptr_raw();
    drop((m, m2));
    let n = a.alloc::<u8>(19 * MIB).unwrap();
    assert_eq!(n.device_ptr_raw(), seg);
    assert_eq!(a.snapshot().segments[2].blocks.len(), 1);
    check_invariants(&a, Some(&sim));
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole() {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim_with(sim.clone(), Config::parse("max_split_size_mb:40").unwrap());
    let big = a.alloc::<u8>(64 * MIB).unwrap();
    let addr = big.device_ptr_raw();
    assert_eq!(a.memory_stats().oversize_allocations.current, 1);
    assert_eq!(a.memory_stats().oversize_segments.current, 1);
    drop(big);
    // Below max_split_size: the oversize block is not used.
    let small = a.alloc::<u8>(30 * MIB).unwrap();
    assert_ne!(small.device_ptr_raw(), addr);
    // At or above it and within 20 MiB of its size: used whole, not split.
    let b = a.alloc::<u8>(45 * MIB).unwrap();
    assert_eq!(b.device_ptr_raw(), addr);
    assert_eq!(a.snapshot().segments.iter().find(|s| s.address == addr).unwrap().blocks.len(), 1);
    drop(b);
    // 20 MiB or more larger than the request: not used.
    let c = a.alloc::<u8>(44 * MIB).unwrap();
    assert_ne!(c.device_ptr_raw(), addr);
    assert_eq!(a.memory_stats().oversize_segments.current, 2);
    check_invariants(&a, Some(&sim));
}

#[test]
fn blocks_are_reused_only_on_their_stream() {
    let (sim, a) = setup(1 << 30);
    let s1 = sim.new_stream();
    let x = a.alloc::<u8>(4096).unwrap();
    let xa = x.device_ptr_raw();
    drop(x);
    let y = {
        let _g = a.set_stream(&s1).unwrap();
        a.alloc::<u8>(4096).unwrap()
    };
    assert_eq!(y.stream_id(), s1.id);
    assert_ne!(y.device_ptr_raw(), xa, "a block cached for stream 0 was handed to stream 1");
    assert_eq!(sim.live_segments().len(), 2);
    let z = a.alloc::<u8>(4096).unwrap();
    assert_eq!(z.device_ptr_raw(), xa);
    check_invariants(&a, Some(&sim));
}

#[test]
fn cross_stream_free_waits_for_the_other_stream() {
    let (sim, a) = setup(1 << 30);
    let s1 = sim.new_stream();
    let x = a.alloc::<u8>(4096).unwrap();
    let xa = x.device_ptr_raw();
    x.record_stream(&s1).unwrap();
    x.record_stream(&sim.default_stream()).unwrap(); // its own stream: nothing to wait for
    drop(x);
    assert_eq!(sim.pending_events(s1), 1);
    assert_eq!(sim.pending_events(StreamId(0)), 0);
    assert_eq!(a.snapshot().segments[0].blocks[0].state, BlockState::AwaitingStreams);
    let s = a.memory_stats();
    assert_eq!((s.allocation.all.current, s.active.all.current), (0, 1));
    check_invariants(&a, Some(&sim));
    let y = a.alloc::<u8>(4096).unwrap();
    assert_ne!(y.device_ptr_raw(), xa, "reused before stream 1 finished");
    drop(y);
    sim.complete_stream(s1);
    let z = a.alloc::<u8>(4096).unwrap();
    assert_eq!(z.device_ptr_raw(), xa, "not reused after stream 1 finished");
    check_invariants(&a, Some(&sim));
}

#[test]
fn out_of_memory_empties_the_cache_and_retries() {
    let (sim, a) = setup(21 * MIB);
    drop(a.alloc::<u8>(512).unwrap()); // a cached 2 MiB small segment
    let big = a.alloc::<u8>(2 * MIB).unwrap(); // needs 20 MiB: 2 + 20 > 21
    assert_eq!(sim.live_segments(), vec![(big.device_ptr_raw(), 20 * MIB)]);
    let s = a.memory_stats();
    assert_eq!((s.num_alloc_retries, s.num_ooms, s.num_device_free), (1, 0, 1));
    check_invariants(&a, Some(&sim));
}

#[test]
fn out_of_memory_waits_for_pending_frees_first() {
    let (sim, a) = setup(2 * MIB);
    let s1 = sim.new_stream();
    let x = a.alloc::<u8>(MIB).unwrap();
    let y = a.alloc::<u8>(MIB).unwrap(); // the rest of the segment, exactly
    let ya = y.device_ptr_raw();
    y.record_stream(&s1).unwrap();
    drop(y);
    // No free block and no room for a segment: the pending free is waited for and reused.
    let z = a.alloc::<u8>(MIB).unwrap();
    assert_eq!(z.device_ptr_raw(), ya);
    assert_eq!(sim.counters().2, 1, "one event synchronization");
    assert_eq!(a.memory_stats().num_ooms, 0);
    drop((x, z));
    check_invariants(&a, Some(&sim));
}

#[test]
fn out_of_memory_error_reads_like_pytorch() {
    let (sim, a) = setup(10 * MIB);
    drop(a.alloc::<u8>(512).unwrap()); // a cached small segment, given back on the way
    let err = a.alloc::<u8>(30 * MIB).unwrap_err();
    let Error::OutOfMemory(r) = &err else { panic!("expected OutOfMemory, got {err:?}") };
    assert_eq!(r.requested, 30 * MIB);
    let msg = err.to_string();
    for want in [
        "sim out of memory",
        "Tried to allocate 30.00 MiB",
        "total capacity of 10.00 MiB",
        "allocated by mempool",
        "reserved by mempool but unallocated",
    ] {
        assert!(msg.contains(want), "{want:?} missing from: {msg}");
    }
    assert_eq!(a.memory_stats().num_ooms, 1);
    // Nothing is lost: the allocator still works.
    let x = a.alloc::<u8>(MIB).unwrap();
    assert_eq!(sim.live_segments().len(), 1);
    drop(x);
    check_invariants(&a, Some(&sim));
}

#[test]
fn backend_refusal_is_out_of_memory_and_recoverable() {
    let (sim, a) = setup(1 << 30);
    sim.fail_next_allocs(2); // first try and the retry
    assert!(matches!(a.alloc::<u8>(100), Err(Error::OutOfMemory(_))));
    let x = a.alloc::<u8>(100).unwrap();
    assert_eq!(x.device_ptr_raw(), BASE);
    check_invariants(&a, Some(&sim));
}

#[test]
fn memory_fraction_limits_reservation() {
    let (sim, a) = setup(100 * MIB);
    a.set_memory_fraction(0.1).unwrap();
    let err = a.alloc::<u8>(12 * MIB).unwrap_err();
    assert!(err.to_string().contains("limited to 10.00 MiB"), "{err}");
    assert!(sim.live_segments().is_empty());
    assert!(a.set_memory_fraction(1.5).is_err());
}

#[test]
fn garbage_collection_gives_back_old_segments() {
    let sim = SimDevice::new(100 * MIB);
    let cfg = Config::builder().garbage_collection_threshold(0.5).memory_fraction(0.5).build().unwrap();
    let a = Allocator::sim_with(sim.clone(), cfg);
    let bufs: Vec<_> = (0..3).map(|_| a.alloc::<u8>(12 * MIB).unwrap()).collect();
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 36 * MIB as i64);
    drop(bufs);
    // 14 MiB fits no cached block; reserved 36 MiB is over 0.5 x 50 MiB: old segments go first.
    let _x = a.alloc::<u8>(14 * MIB).unwrap();
    let s = a.memory_stats();
    assert_eq!(s.num_device_free, 1, "one segment brings reserved under 25 MiB");
    assert_eq!(s.reserved_bytes.all.current, (24 + 14) as i64 * MIB as i64);
    assert!(!sim.live_segments().iter().any(|&(addr, _)| addr == BASE), "the oldest segment goes first");
    check_invariants(&a, Some(&sim));
}

#[test]
fn empty_and_overflowing_requests() {
    let (sim, a) = setup(1 << 30);
    let e = a.alloc::<f32>(0).unwrap();
    assert!(e.is_empty());
    assert_eq!(e.device_ptr_raw(), 0);
    assert!(sim.live_segments().is_empty());
    drop(e);
    let z = a.alloc::<()>(1000).unwrap(); // zero-sized elements: no memory either
    assert_eq!((z.len(), z.num_bytes()), (1000, 0));
    let err = a.alloc::<u64>(usize::MAX / 4).unwrap_err();
    assert_eq!(err, Error::SizeOverflow { len: usize::MAX / 4, elem_size: 8 });
    assert!(err.to_string().contains("overflows"));
    assert_eq!(a.memory_stats().allocation.all.allocated, 0);
}

#[test]
fn raw_bytes_api_rejects_foreign_and_double_frees() {
    let (sim, a) = setup(1 << 30);
    let p = a.alloc_bytes(3000).unwrap();
    assert_eq!(p, BASE);
    let before = a.memory_stats();
    let err = a.free_bytes(p + 512).unwrap_err();
    assert_eq!(err, Error::InvalidFree { ptr: p + 512, device: 0 });
    assert!(err.to_string().contains("nothing was changed"));
    assert_eq!(a.memory_stats(), before, "a rejected free changed the stats");
    a.free_bytes(p).unwrap();
    assert!(matches!(a.free_bytes(p), Err(Error::InvalidFree { .. })));
    // A Buffer's pointer is not the raw API's to free.
    let b = a.alloc::<u8>(100).unwrap();
    assert!(matches!(a.free_bytes(b.device_ptr_raw()), Err(Error::InvalidFree { .. })));
    assert_eq!(a.alloc_bytes(0).unwrap(), 0);
    a.free_bytes(0).unwrap();
    let s1 = sim.new_stream();
    let q = a.alloc_bytes(512).unwrap();
    a.record_stream_bytes(q, &s1).unwrap();
    a.free_bytes(q).unwrap();
    assert_eq!(sim.pending_events(s1), 1);
    check_invariants(&a, Some(&sim));
}

#[test]
fn failed_segment_free_is_reported_and_nothing_lost() {
    let (sim, a) = setup(1 << 30);
    drop(a.alloc::<u8>(512).unwrap());
    sim.fail_next_frees(1);
    let err = a.empty_cache().unwrap_err();
    assert!(err.to_string().contains("segment free"), "{err}");
    assert_eq!(sim.live_segments().len(), 1);
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 2 * MIB as i64);
    check_invariants(&a, Some(&sim));
    a.empty_cache().unwrap();
    assert!(sim.live_segments().is_empty());
    check_invariants(&a, Some(&sim));
}

#[test]
fn failed_event_query_is_reported_by_the_next_call() {
    let (sim, a) = setup(1 << 30);
    let s1 = sim.new_stream();
    let x = a.alloc::<u8>(512).unwrap();
    x.record_stream(&s1).unwrap();
    drop(x);
    sim.complete_stream(s1);
    sim.fail_next_event_queries(1);
    let _y = a.alloc::<u8>(512).unwrap(); // the query fails: the block stays pending
    assert_eq!(a.snapshot().segments[0].blocks[0].state, BlockState::AwaitingStreams);
    let err = a.alloc::<u8>(512).unwrap_err();
    assert!(err.to_string().contains("querying a cross-stream event"), "{err}");
    let _z = a.alloc::<u8>(512).unwrap();
    assert_eq!(
        a.snapshot().segments[0].blocks[0].state,
        BlockState::Allocated,
        "freed and reused once the query worked"
    );
    check_invariants(&a, Some(&sim));
}

#[test]
fn peaks_reset_and_summary_prints() {
    let (_sim, a) = setup(1 << 30);
    let x = a.alloc::<u8>(8 * MIB).unwrap();
    drop(x);
    let s = a.memory_stats();
    assert_eq!(s.allocated_bytes.all.peak, 8 * MIB as i64);
    a.reset_peak_stats();
    assert_eq!(a.memory_stats().allocated_bytes.all.peak, 0);
    let m = a.memory_stats().as_map();
    assert_eq!(m["allocated_bytes.all.allocated"], 8 * MIB as i64);
    assert_eq!(m["reserved_bytes.large_pool.current"], 20 * MIB as i64);
    let summary = a.memory_summary();
    for want in [
        "memory summary, device 0",
        "Allocated memory",
        "from large pool",
        "Reserved memory",
        "20.00 MiB",
        "Oversize segments",
    ] {
        assert!(summary.contains(want), "{want:?} missing:\n{summary}");
    }
    for line in summary.lines() {
        assert_eq!(line.chars().count(), 77, "ragged summary line: {line:?}");
    }
}

#[test]
fn roundup_power2_divisions_apply() {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim_with(sim, Config::parse("roundup_power2_divisions:4").unwrap());
    let x = a.alloc::<u8>(1200 << 10).unwrap();
    assert_eq!(a.snapshot().segments[0].blocks[0].size, 1280 << 10);
    drop(x);
}

/// `pinned_round_power2` is the pinned allocators' option: an allocator of device memory with the
/// same settings keeps 512-byte steps (and says it is off).
#[test]
fn pinned_round_power2_leaves_device_allocators_alone() {
    let cfg = Config::parse("pinned_round_power2:True").unwrap();
    let a = Allocator::sim_with(SimDevice::new(64 << 20), cfg);
    assert!(!a.config().pinned_round_power2);
    let b = a.alloc::<u8>(3000).unwrap();
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 3072);
    drop(b);
}

/// `leak`: the allocator keeps working through clones and buffers, outlives every handle (its
/// cached segments stay on the device after the last handle goes, where an owned allocator's
/// drop gives them back), and `empty_cache` still releases them.
#[test]
fn a_leaked_allocator_outlives_its_handles_and_still_empties_its_cache() {
    let owned_sim = SimDevice::new(1 << 30);
    let owned = Allocator::sim(owned_sim.clone());
    drop(owned.alloc::<u8>(4096).unwrap());
    drop(owned);
    assert_eq!(owned_sim.used(), 0, "an owned allocator gives its segments back when dropped");

    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone()).leak();
    let b = a.clone();
    let x = b.alloc::<u32>(1000).unwrap();
    drop(b);
    drop(a);
    assert_eq!(x.len(), 1000, "a buffer outlives every handle");
    drop(x);
    assert_eq!(sim.used(), 2 * MIB, "no handle left, and the cached segment is still there");

    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone()).leak().leak();
    drop(a.alloc::<u8>(512).unwrap());
    check_invariants(&a, Some(&sim));
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
    a.empty_cache().unwrap();
    assert_eq!(sim.used(), 0, "empty_cache releases the leaked allocator's segments");
}
