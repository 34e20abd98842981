//! The pinned allocators' reserve segment (`pinned_reserve_segment_size_mb`) and background
//! event thread (`pinned_use_background_threads`), on a simulated device whose memory counts as
//! pinned host memory (`SimDevice::pinned`): no GPU needed. Their GPU counterparts are in
//! `cuda_pinned.rs`.

mod common;

use std::time::{Duration, Instant};

use common::{check_invariants, eventually, pinned_sim};
use mempool::sim::SimDevice;
use mempool::{Allocator, BlockState, Config, Error, Sim};

const BASE: u64 = SimDevice::BASE;
const MIB: usize = 1 << 20;

fn reserved(a: &Allocator<Sim>) -> i64 {
    a.memory_stats().reserved_bytes.all.current
}

/// The states of the blocks of the segment at `addr`.
fn blocks_at(a: &Allocator<Sim>, addr: u64) -> Vec<(u64, usize, BlockState)> {
    let snap = a.snapshot();
    let seg = snap.segments.iter().find(|s| s.address == addr).expect("a segment at that address");
    seg.blocks.iter().map(|b| (b.address - addr, b.size, b.state)).collect()
}

/// The background thread of allocator `a` as Linux names it (`/proc/self/task/*/comm`, the
/// thread name's first 15 bytes): whether a thread of that name is alive in this process.
#[cfg(target_os = "linux")]
fn event_thread_alive<K: mempool::Kind>(a: &Allocator<K>) -> bool {
    event_thread_named(&thread_name(a))
}

fn thread_name<K: mempool::Kind>(a: &Allocator<K>) -> String {
    let id = a.id().to_string();
    let n = id.strip_prefix("allocator ").expect("`allocator N`");
    format!("mp-ev-{n}").chars().take(15).collect()
}

#[cfg(target_os = "linux")]
fn event_thread_named(name: &str) -> bool {
    std::fs::read_dir("/proc/self/task").expect("/proc/self/task").any(|t| {
        let comm = t.ok().and_then(|t| std::fs::read_to_string(t.path().join("comm")).ok());
        comm.is_some_and(|c| c.trim_end() == name)
    })
}

// ---------------------------------------------------------------------------------------------
// The reserve segment
// ---------------------------------------------------------------------------------------------

/// The reserve is allocated when the allocator is made, counted in reserved bytes and in the
/// snapshot from then on (one free small-pool block on the default stream), and carved by the
/// small requests of the default stream before any other segment is made.
#[test]
fn the_reserve_is_allocated_at_creation_and_carved() {
    let (sim, a) = pinned_sim(1 << 30, "pinned_reserve_segment_size_mb:8,thread_cache:False");
    assert_eq!(sim.live_segments(), vec![(BASE, 8 * MIB)], "allocated before any request");
    let s = a.memory_stats();
    assert_eq!(s.reserved_bytes.all.current, 8 * MIB as i64);
    assert_eq!(s.reserved_bytes.small_pool.current, 8 * MIB as i64);
    assert_eq!((s.segment.all.current, s.num_device_alloc, s.allocated_bytes.all.current), (1, 1, 0));
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1);
    assert!(snap.segments[0].is_small);
    assert_eq!(snap.segments[0].stream.0, 0, "the default stream's");
    assert_eq!(blocks_at(&a, BASE), vec![(0, 8 * MIB, BlockState::Free)]);
    assert_eq!(a.config().pinned_reserve_segment_size, 8 * MIB);
    check_invariants(&a, Some(&sim));

    // Small requests are carved from it, best fit as usual; no new segment.
    let x = a.alloc::<u8>(1000).unwrap();
    let y = a.alloc::<u8>(MIB).unwrap(); // exactly 1 MiB is still small
    let z = a.alloc::<u8>(1).unwrap();
    assert_eq!(
        (x.device_ptr_raw(), y.device_ptr_raw(), z.device_ptr_raw()),
        (BASE, BASE + 1024, BASE + 1024 + MIB as u64)
    );
    assert_eq!(sim.counters().0, 1, "no segment beyond the reserve");
    assert_eq!(reserved(&a), 8 * MIB as i64);
    use BlockState::*;
    assert_eq!(
        blocks_at(&a, BASE),
        vec![
            (0, 1024, Allocated),
            (1024, MIB, Allocated),
            (1024 + MIB as u64, 512, Allocated),
            (1536 + MIB as u64, 7 * MIB - 1536, Free)
        ]
    );
    check_invariants(&a, Some(&sim));

    // A large request gets a segment of its own.
    let big = a.alloc::<u8>(2 * MIB).unwrap();
    assert!(big.device_ptr_raw() >= BASE + 8 * MIB as u64, "not from the reserve");
    assert_eq!(sim.live_segments().len(), 2);
    // So does a small request on another stream (a segment serves one stream).
    let other = sim.new_stream();
    let on = a.set_stream(&other).unwrap();
    let w = a.alloc::<u8>(1000).unwrap();
    drop(on);
    assert!(w.device_ptr_raw() >= BASE + 8 * MIB as u64, "not from the reserve");
    assert_eq!(sim.live_segments().len(), 3);
    assert_eq!(reserved(&a), (8 + 20 + 2) as i64 * MIB as i64);
    check_invariants(&a, Some(&sim));
    drop((x, y, z, big, w));
    check_invariants(&a, Some(&sim));
}

/// The reserve fills up: the small requests after that get ordinary 2 MiB segments, which go
/// back at `empty_cache`; the reserve does not.
#[test]
fn a_full_reserve_falls_back_to_ordinary_segments() {
    let (sim, a) = pinned_sim(1 << 30, "pinned_reserve_segment_size_mb:1,thread_cache:False");
    let x = a.alloc::<u8>(MIB).unwrap();
    assert_eq!(x.device_ptr_raw(), BASE);
    let y = a.alloc::<u8>(512).unwrap();
    assert_eq!(sim.live_segments(), vec![(BASE, MIB), (BASE + 2 * MIB as u64, 2 * MIB)]);
    assert_eq!(y.device_ptr_raw(), BASE + 2 * MIB as u64);
    drop((x, y));
    assert_eq!(reserved(&a), 3 * MIB as i64);
    a.empty_cache().unwrap();
    assert_eq!(sim.live_segments(), vec![(BASE, MIB)], "the ordinary segment went back, the reserve stayed");
    assert_eq!(reserved(&a), MIB as i64);
    check_invariants(&a, Some(&sim));
}

/// Nothing gives the reserve back while the allocator lives: `empty_cache`, garbage
/// collection, the out-of-memory ladder. Dropping the allocator does.
#[test]
fn the_reserve_survives_empty_cache_gc_and_the_oom_ladder_and_goes_at_drop() {
    // 64 MiB device, half of it for this allocator, collection above 10% of that.
    let (sim, a) =
        pinned_sim(64 * MIB, "pinned_reserve_segment_size_mb:8,garbage_collection_threshold:0.1,thread_cache:False");
    a.set_memory_fraction(0.5).unwrap();
    let x = a.alloc::<u8>(4096).unwrap();
    drop(x);
    a.empty_cache().unwrap();
    assert_eq!(sim.live_segments(), vec![(BASE, 8 * MIB)]);
    assert_eq!(reserved(&a), 8 * MIB as i64);
    assert_eq!(blocks_at(&a, BASE), vec![(0, 8 * MIB, BlockState::Free)], "merged back whole");

    // Garbage collection: reserved (8 MiB) is over the threshold (3.2 MiB) at every growth.
    let big = a.alloc::<u8>(12 * MIB).unwrap();
    drop(big);
    let big2 = a.alloc::<u8>(14 * MIB).unwrap(); // collects the free 12 MiB segment, not the reserve
    assert!(sim.live_segments().contains(&(BASE, 8 * MIB)));
    assert_eq!(sim.live_segments().len(), 2, "{:?}", sim.live_segments());
    drop(big2);

    // The out-of-memory ladder: gives back every cached segment it may, then fails.
    let e = a.alloc::<u8>(30 * MIB).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert_eq!(sim.live_segments(), vec![(BASE, 8 * MIB)], "the ladder gave back all but the reserve");
    assert_eq!(reserved(&a), 8 * MIB as i64);
    // Two climbs: the 14 MiB request's (the collected segment was still on its way back, so
    // over the limit) and this one's.
    let s = a.memory_stats();
    assert_eq!((s.num_alloc_retries, s.num_ooms), (2, 1));
    // And it still serves.
    let y = a.alloc::<u8>(512).unwrap();
    assert_eq!(y.device_ptr_raw(), BASE);
    check_invariants(&a, Some(&sim));
    drop(y);

    drop(a);
    assert!(sim.live_segments().is_empty(), "dropping the allocator gives the reserve back");
    assert_eq!(sim.used(), 0);
}

/// A reserve block the device used waits for its stream's work at its free, as every pinned
/// block does, and is carved again only once that work is done.
#[test]
fn a_reserve_block_the_device_used_waits_for_its_stream() {
    let (sim, a) = pinned_sim(1 << 30, "pinned_reserve_segment_size_mb:4,thread_cache:False");
    let x = a.alloc::<u8>(4096).unwrap();
    let addr = x.device_ptr_raw(); // a raw address: a device use
    assert_eq!(addr, BASE);
    drop(x);
    assert_eq!(blocks_at(&a, BASE)[0], (0, 4096, BlockState::AwaitingStreams));
    let y = a.alloc::<u8>(4096).unwrap();
    assert_eq!(y.device_ptr_raw(), BASE + 4096, "not handed out while the stream may use it");
    sim.complete_stream(sim.default_stream());
    let z = a.alloc::<u8>(4096).unwrap();
    assert_eq!(z.device_ptr_raw(), BASE, "handed out again once its event completed");
    drop((y, z));
    check_invariants(&a, Some(&sim));
}

/// Dropping the allocator while a reserve block awaits an event: the drop waits for it and
/// gives the reserve back.
#[test]
fn dropping_with_a_reserve_block_awaiting_its_event_gives_everything_back() {
    let (sim, a) = pinned_sim(1 << 30, "pinned_reserve_segment_size_mb:4");
    let x = a.alloc::<u8>(4096).unwrap();
    let _ = x.device_ptr_raw();
    drop(x);
    drop(a);
    assert!(sim.live_segments().is_empty());
}

/// The `pinned_*` keys are the pinned allocators': an allocator of device memory takes the
/// settings, makes no reserve and no thread, and reports them off.
#[test]
fn device_allocators_ignore_the_pinned_options() {
    let sim = SimDevice::new(1 << 30);
    let cfg = Config::parse("pinned_reserve_segment_size_mb:8,pinned_use_background_threads:True").unwrap();
    let a = Allocator::sim_with(sim.clone(), cfg);
    assert!(sim.live_segments().is_empty(), "no reserve");
    assert_eq!(reserved(&a), 0);
    let c = a.config();
    assert_eq!((c.pinned_reserve_segment_size, c.pinned_use_background_threads), (0, false));
    #[cfg(target_os = "linux")]
    assert!(!event_thread_alive(&a), "no background thread");
    // Pinned ones report what is in effect.
    let (_, p) = pinned_sim(1 << 30, "pinned_reserve_segment_size_mb:8,pinned_use_background_threads:True");
    let c = p.config();
    assert_eq!((c.pinned_reserve_segment_size, c.pinned_use_background_threads), (8 * MIB, true));
}

/// A reserve the device cannot give: the allocator is made (its constructor cannot fail), and
/// its first allocation reports why; it then works without a reserve.
#[test]
fn a_reserve_that_cannot_be_allocated_is_reported_by_the_next_call() {
    let (sim, a) = pinned_sim(4 * MIB, "pinned_reserve_segment_size_mb:8");
    assert!(sim.live_segments().is_empty());
    let e = a.alloc::<u8>(512).unwrap_err();
    let m = e.to_string();
    assert!(m.contains("pinned_reserve_segment_size_mb") && m.contains("out of memory"), "{m}");
    let x = a.alloc::<u8>(512).unwrap();
    assert_eq!(sim.live_segments(), vec![(BASE, 2 * MIB)]);
    drop(x);
    // Over the memory-fraction limit: refused before the device is asked.
    let sim = SimDevice::pinned(64 * MIB);
    let cfg = Config::builder().pinned_reserve_segment_size_mb(40).memory_fraction(0.5).build().unwrap();
    let a = Allocator::sim_with(sim.clone(), cfg);
    assert!(sim.live_segments().is_empty());
    let m = a.take_error().expect("the reserve's error is kept").to_string();
    assert!(m.contains("memory fraction"), "{m}");
    // A size set on the struct, past the builder's checks: refused at creation too.
    let cfg = Config { pinned_reserve_segment_size: 64 * MIB, max_split_size: 32 * MIB, ..Config::default() };
    let a = Allocator::sim_with(SimDevice::pinned(1 << 30), cfg);
    let m = a.take_error().expect("kept").to_string();
    assert!(m.contains("max_split_size"), "{m}");
}

/// A reserve size that is not a multiple of 512 bytes (set on the struct) is rounded up, so
/// blocks keep tiling it.
#[test]
fn a_reserve_size_set_on_the_struct_is_rounded_to_512_bytes() {
    let sim = SimDevice::pinned(1 << 30);
    let cfg = Config { pinned_reserve_segment_size: 1000, thread_cache: false, ..Config::default() };
    let a = Allocator::sim_with(sim.clone(), cfg);
    assert_eq!(sim.live_segments(), vec![(BASE, 1024)]);
    let x = a.alloc::<u8>(1000).unwrap();
    assert_eq!(x.device_ptr_raw(), BASE);
    check_invariants(&a, Some(&sim));
    drop(x);
}

// ---------------------------------------------------------------------------------------------
// The background event thread
// ---------------------------------------------------------------------------------------------

/// A block freed after device use on a stream waits for that stream's event; once the event
/// completes, the background thread files it, with no allocation or other call to the
/// allocator between (statistics and snapshots are read-only: they process no event). The
/// thread queries; it never synchronises.
#[test]
fn the_background_thread_files_completed_frees_without_an_allocation() {
    let (sim, a) = pinned_sim(1 << 30, "pinned_use_background_threads:True,thread_cache:False");
    let s = sim.new_stream();
    let _on = a.set_stream(&s).unwrap();
    let x = a.alloc::<u8>(4096).unwrap();
    let _ = x.device_ptr_raw();
    drop(x);
    // The event has not completed: the thread must leave the block alone.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(blocks_at(&a, BASE)[0], (0, 4096, BlockState::AwaitingStreams));
    assert_eq!(a.memory_stats().active_bytes.all.current, 4096);
    sim.complete_stream(s);
    assert!(
        eventually(|| blocks_at(&a, BASE)[0].2 == BlockState::Free),
        "the background thread did not file the block: {:?}",
        blocks_at(&a, BASE)
    );
    let st = a.memory_stats();
    assert_eq!((st.active_bytes.all.current, st.allocated_bytes.all.current, st.num_sync_all_streams), (0, 0, 0));
    assert_eq!(sim.counters().2, 0, "no event was waited for: the thread queries");
    check_invariants(&a, Some(&sim));
}

/// The control: without the background thread, a completed free waits for the next
/// allocation (so the test above would fail without the thread).
#[test]
fn without_the_background_thread_a_completed_free_waits_for_an_allocation() {
    let (sim, a) = pinned_sim(1 << 30, "thread_cache:False");
    let s = sim.new_stream();
    let _on = a.set_stream(&s).unwrap();
    let x = a.alloc::<u8>(4096).unwrap();
    let _ = x.device_ptr_raw();
    drop(x);
    sim.complete_stream(s);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(blocks_at(&a, BASE)[0].2, BlockState::AwaitingStreams);
    let y = a.alloc::<u8>(4096).unwrap();
    assert_eq!(y.device_ptr_raw(), BASE, "the allocation filed it, then took it");
}

/// With the thread, a block whose stream is still busy is not handed out again (the
/// allocation neither files nor takes it), and is once the thread has filed it.
#[test]
fn with_the_background_thread_a_pending_block_is_not_reused_early() {
    let (sim, a) = pinned_sim(1 << 30, "pinned_use_background_threads:True,thread_cache:False");
    let s = sim.new_stream();
    let _on = a.set_stream(&s).unwrap();
    let x = a.alloc::<u8>(4096).unwrap();
    let _ = x.device_ptr_raw();
    drop(x);
    let y = a.alloc::<u8>(4096).unwrap();
    assert_eq!(y.device_ptr_raw(), BASE + 4096, "the gate is closed: the first block is still in use");
    sim.complete_stream(s);
    assert!(eventually(|| blocks_at(&a, BASE)[0].2 == BlockState::Free));
    let z = a.alloc::<u8>(4096).unwrap();
    assert_eq!(z.device_ptr_raw(), BASE);
    drop((y, z));
    check_invariants(&a, Some(&sim));
}

/// Other streams' uses (`record_stream`) wait in the same way and are filed by the thread too;
/// several threads freeing on several streams leave exact statistics once the thread is done.
#[test]
fn background_frees_from_many_threads_leave_exact_statistics() {
    let (sim, a) = pinned_sim(1 << 30, "pinned_use_background_threads:True,pinned_reserve_segment_size_mb:4");
    let streams: Vec<_> = (0..4).map(|_| sim.new_stream()).collect();
    std::thread::scope(|sc| {
        for (i, s) in streams.iter().enumerate() {
            let (a, s, other) = (&a, *s, streams[(i + 1) % streams.len()]);
            sc.spawn(move || {
                let _on = a.set_stream(&s).unwrap();
                for n in 0..200usize {
                    let b = a.alloc::<u32>(64 + (n % 7) * 1000).unwrap();
                    match n % 3 {
                        0 => {
                            let _ = b.device_ptr_raw();
                        }
                        1 => b.record_stream(&other).unwrap(),
                        _ => {} // never used by the device: straight back
                    }
                    drop(b);
                }
            });
        }
    });
    sim.complete_all();
    assert!(
        eventually(|| a.memory_stats().active_bytes.all.current == 0),
        "frees still awaiting events: {}",
        a.memory_stats().active_bytes.all.current
    );
    let st = a.memory_stats();
    assert_eq!((st.allocated_bytes.all.current, st.active.all.current, st.requested_bytes.all.current), (0, 0, 0));
    check_invariants(&a, Some(&sim));
    a.empty_cache().unwrap();
    assert_eq!(sim.live_segments(), vec![(BASE, 4 * MIB)], "only the reserve is left");
    check_invariants(&a, Some(&sim));
}

/// The thread ends when the allocator is dropped (its last handle and buffer), even with a
/// free still awaiting an event that will never complete on its own, and the drop does not
/// hang; the thread keeps nothing alive (the allocator's `Drop` ran: its segments went back).
/// `eventually`: Linux lists a thread in `/proc` for a moment after `join` returned, and should
/// the thread's look hold the last reference at the drop, the `Drop` runs on the thread, which
/// then ends.
#[cfg(target_os = "linux")]
#[test]
fn the_background_thread_stops_when_the_allocator_is_dropped() {
    let (sim, a) = pinned_sim(1 << 30, "pinned_use_background_threads:True");
    // (The new thread names itself as it starts.)
    assert!(eventually(|| event_thread_alive(&a)), "started with the allocator");
    let name = thread_name(&a);
    let s = sim.new_stream();
    let on = a.set_stream(&s).unwrap();
    let x = a.alloc::<u8>(4096).unwrap();
    let _ = x.device_ptr_raw();
    let keep = a.alloc::<u8>(512).unwrap(); // a buffer holds the allocator too
    drop(x);
    drop(on);
    drop(a);
    std::thread::sleep(Duration::from_millis(20));
    assert!(event_thread_named(&name), "a buffer still holds the allocator: the thread goes on");
    let since = Instant::now();
    drop(keep); // the last reference: the allocator's `Drop` runs here and joins the thread
    assert!(since.elapsed() < Duration::from_secs(2), "the drop waited {:?}", since.elapsed());
    assert!(eventually(|| !event_thread_named(&name)), "the thread outlived its allocator");
    assert!(eventually(|| sim.live_segments().is_empty()), "the allocator was dropped, and gave everything back");
}

/// Many allocators with threads, made and dropped from several threads, some with frees
/// pending: every thread ends, nothing hangs.
#[cfg(target_os = "linux")]
#[test]
fn background_threads_of_many_allocators_all_end() {
    let names = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|sc| {
        for t in 0..4 {
            let names = &names;
            sc.spawn(move || {
                for i in 0..10 {
                    let (sim, a) =
                        pinned_sim(1 << 30, "pinned_use_background_threads:True,pinned_reserve_segment_size_mb:2");
                    names.lock().unwrap().push(thread_name(&a));
                    let s = sim.new_stream();
                    let _on = a.set_stream(&s).unwrap();
                    let b = a.alloc::<u8>(1000 * (t + i + 1)).unwrap();
                    let _ = b.device_ptr_raw();
                    drop(b);
                    if i % 2 == 0 {
                        sim.complete_stream(s);
                    }
                    drop(_on);
                    drop(a);
                    assert!(eventually(|| sim.live_segments().is_empty()));
                }
            });
        }
    });
    let names = names.into_inner().unwrap();
    assert_eq!(names.len(), 40);
    for n in &names {
        assert!(eventually(|| !event_thread_named(n)), "{n} is still running");
    }
}

// ---------------------------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------------------------

#[test]
fn the_keys_parse_and_match_the_builder() {
    let c = Config::parse("pinned_reserve_segment_size_mb:16, pinned_use_background_threads:True").unwrap();
    assert_eq!((c.pinned_reserve_segment_size, c.pinned_use_background_threads), (16 * MIB, true));
    let b = Config::builder().pinned_reserve_segment_size_mb(16).pinned_use_background_threads(true).build().unwrap();
    assert_eq!(c, b);
    let off = Config::parse("pinned_reserve_segment_size_mb:0,pinned_use_background_threads:False").unwrap();
    assert_eq!(off, Config::default(), "0 and False are the defaults");
    // Below max_split_size_mb, in either order.
    assert!(Config::parse("max_split_size_mb:64,pinned_reserve_segment_size_mb:63").is_ok());
    assert!(Config::parse("pinned_reserve_segment_size_mb:63,max_split_size_mb:64").is_ok());
}

#[test]
fn bad_values_are_clear_errors() {
    let e = Config::parse("pinned_reserve_segment_size_mb:lots").unwrap_err().to_string();
    assert!(e.contains("`lots`") && e.contains("pinned_reserve_segment_size_mb") && e.contains("MiB"), "{e}");
    let e = Config::parse("pinned_reserve_segment_size_mb:-1").unwrap_err().to_string();
    assert!(e.contains("pinned_reserve_segment_size_mb"), "{e}");
    let e = Config::parse("pinned_reserve_segment_size_mb:1048576").unwrap_err().to_string();
    assert!(e.contains("at most 1048575"), "{e}");
    let e = Config::parse(&format!("pinned_reserve_segment_size_mb:{}", usize::MAX)).unwrap_err().to_string();
    assert!(e.contains("at most"), "{e}");
    let e = Config::parse("max_split_size_mb:64,pinned_reserve_segment_size_mb:64").unwrap_err().to_string();
    assert!(e.contains("below max_split_size_mb"), "{e}");
    let e = Config::parse("pinned_use_background_threads:yes").unwrap_err().to_string();
    assert!(e.contains("pinned_use_background_threads") && e.contains("True or False"), "{e}");
    let e = Config::parse("pinned_use_background_thread:True").unwrap_err().to_string();
    assert!(e.contains("unknown key") && e.contains("pinned_use_background_threads"), "{e}");
    assert!(e.contains("pinned_reserve_segment_size_mb"), "the valid keys are listed: {e}");
    let e = Config::builder().pinned_reserve_segment_size_mb(usize::MAX).build().unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
}
