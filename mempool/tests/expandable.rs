//! Expandable segments on the simulated device's virtual memory: growth into the pages after a
//! free block, unmapping by `empty_cache` and the out-of-memory ladder, hooks, statistics, and a
//! random campaign that checks after every step that no byte handed out is unmapped.

mod common;

use std::sync::{Arc, Mutex};

use common::{check_invariants, Rng};
use mempool::sim::SimDevice;
use mempool::trace::{self, Action};
use mempool::{Allocator, Buffer, Config, Error, MemPool, PoolOptions, Sim};

const MIB: usize = 1 << 20;

fn expandable(capacity: usize) -> (Arc<SimDevice>, Allocator<Sim>) {
    let sim = SimDevice::new(capacity);
    let cfg = Config::builder().expandable_segments(true).build().unwrap();
    (sim.clone(), Allocator::sim_with(sim, cfg))
}

fn mapped_bytes(sim: &SimDevice) -> usize {
    sim.mapped().iter().map(|m| m.1).sum()
}

#[test]
fn config_key_parses() {
    assert!(Config::parse("expandable_segments:True").unwrap().expandable_segments);
    assert!(!Config::parse("expandable_segments:False").unwrap().expandable_segments);
    let e = Config::parse("expandable_segments:maybe").unwrap_err().to_string();
    assert!(e.contains("expandable_segments") && e.contains("True or False"), "{e}");
}

#[test]
fn a_block_grows_into_the_pages_after_it() {
    let (sim, a) = expandable(1 << 30);
    let x = a.alloc::<u8>(5 * MIB / 2).unwrap();
    assert_eq!(x.device_ptr_raw(), SimDevice::VM_BASE);
    // 2.5 MiB maps two pages, not PyTorch's 20 MiB segment (1.5 MiB stay free after it).
    assert_eq!(a.memory_stats().reserved_bytes.all.current, (4 * MIB) as i64);
    // The free 1.5 MiB after it plus 4 new MiB serve 5 MiB: 8 MiB reserved in all.
    let y = a.alloc::<u8>(5 * MIB).unwrap();
    assert_eq!(y.device_ptr_raw(), SimDevice::VM_BASE + 5 * MIB as u64 / 2);
    assert_eq!(a.memory_stats().reserved_bytes.all.current, (8 * MIB) as i64);
    assert_eq!(mapped_bytes(&sim), 8 * MIB);
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1, "one contiguous mapped range");
    assert_eq!(snap.segments[0].total_size, 8 * MIB);
    check_invariants(&a, Some(&sim));
    drop((x, y));
    check_invariants(&a, Some(&sim));
    a.empty_cache().unwrap();
    assert_eq!(mapped_bytes(&sim), 0);
    assert!(sim.reservations().is_empty(), "an emptied reservation is given back");
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
    check_invariants(&a, Some(&sim));
}

#[test]
fn empty_cache_unmaps_only_wholly_free_pages_and_cuts_the_segment() {
    let (sim, a) = expandable(1 << 30);
    // 40 MiB in one growth: two 20 MiB physical allocations (the large pool's chunk).
    let big = a.alloc::<u8>(40 * MIB).unwrap();
    assert_eq!(sim.mapped(), vec![(SimDevice::VM_BASE, 20 * MIB), (SimDevice::VM_BASE + 20 * MIB as u64, 20 * MIB)]);
    drop(big);
    let x = a.alloc::<u8>(10 * MIB).unwrap();
    a.empty_cache().unwrap();
    // x lies in the first allocation: only the second is unmapped.
    assert_eq!(sim.mapped(), vec![(SimDevice::VM_BASE, 20 * MIB)]);
    let y = a.alloc::<u8>(8 * MIB).unwrap();
    drop(x);
    a.empty_cache().unwrap();
    assert_eq!(mapped_bytes(&sim), 20 * MIB, "y still uses the first allocation");
    drop(y);
    a.empty_cache().unwrap();
    assert_eq!(mapped_bytes(&sim), 0);
    check_invariants(&a, Some(&sim));

    // A live block in the middle: the free allocations around it go, the segment is cut.
    let bufs: Vec<Buffer<u8, Sim>> = (0..3).map(|_| a.alloc::<u8>(20 * MIB).unwrap()).collect();
    assert_eq!(mapped_bytes(&sim), 60 * MIB);
    let mid = bufs[1].device_ptr_raw();
    let mut bufs = bufs.into_iter();
    let (b0, b1, b2) = (bufs.next().unwrap(), bufs.next().unwrap(), bufs.next().unwrap());
    drop((b0, b2));
    a.empty_cache().unwrap();
    assert_eq!(sim.mapped(), vec![(mid, 20 * MIB)]);
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1);
    assert_eq!((snap.segments[0].address, snap.segments[0].total_size), (mid, 20 * MIB));
    check_invariants(&a, Some(&sim));
    // The holes are mapped again on demand.
    let again = a.alloc::<u8>(20 * MIB).unwrap();
    assert!(sim.is_mapped(again.device_ptr_raw(), 20 * MIB));
    check_invariants(&a, Some(&sim));
    drop((b1, again));
    a.empty_cache().unwrap();
    assert_eq!(mapped_bytes(&sim), 0);
    assert!(sim.reservations().is_empty());
}

#[test]
fn unmaps_wait_for_the_segments_stream() {
    let (sim, a) = expandable(1 << 30);
    let s = sim.new_stream();
    let g = a.set_stream(&s).unwrap();
    drop(a.alloc::<u8>(3 * MIB).unwrap());
    drop(g);
    a.empty_cache().unwrap();
    assert_eq!(sim.unmap_syncs(), vec![s.id]);
}

#[test]
fn out_of_memory_unmaps_another_streams_free_pages_and_retries() {
    let (sim, a) = expandable(64 * MIB);
    let s1 = sim.new_stream();
    let s2 = sim.new_stream();
    {
        let _g = a.set_stream(&s1).unwrap();
        drop(a.alloc::<u8>(60 * MIB).unwrap());
    }
    assert_eq!(mapped_bytes(&sim), 60 * MIB);
    let _g = a.set_stream(&s2).unwrap();
    let b = a.alloc::<u8>(40 * MIB).unwrap();
    assert!(sim.is_mapped(b.device_ptr_raw(), 40 * MIB));
    assert_eq!(a.memory_stats().num_alloc_retries, 1);
    check_invariants(&a, Some(&sim));
    // Nothing left to unmap: the report.
    let e = a.alloc::<u8>(40 * MIB).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    check_invariants(&a, Some(&sim));
}

#[test]
fn a_failed_map_is_retried_then_reported_and_loses_nothing() {
    let (sim, a) = expandable(1 << 30);
    sim.fail_next_maps(1);
    let x = a.alloc::<u8>(3 * MIB).unwrap();
    assert_eq!(a.memory_stats().num_alloc_retries, 1);
    drop(x);
    sim.fail_next_maps(100);
    let e = a.alloc::<u8>(100 * MIB).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    sim.fail_next_maps(0);
    check_invariants(&a, Some(&sim));
    let y = a.alloc::<u8>(100 * MIB).unwrap();
    assert!(sim.is_mapped(y.device_ptr_raw(), 100 * MIB));
    drop(y);
    a.empty_cache().unwrap();
    assert_eq!(mapped_bytes(&sim), 0);
    check_invariants(&a, Some(&sim));
}

#[test]
fn a_failed_unmap_keeps_the_memory_in_use_and_is_reported() {
    let (sim, a) = expandable(1 << 30);
    drop(a.alloc::<u8>(3 * MIB).unwrap());
    sim.fail_next_unmaps(1);
    let e = a.empty_cache().unwrap_err();
    assert!(e.to_string().contains("unmap"), "{e}");
    assert_eq!(mapped_bytes(&sim), 4 * MIB);
    check_invariants(&a, Some(&sim));
    // Still usable, and the next `empty_cache` gives it back.
    let x = a.alloc::<u8>(4 * MIB).unwrap();
    assert!(sim.is_mapped(x.device_ptr_raw(), 4 * MIB));
    drop(x);
    a.empty_cache().unwrap();
    assert_eq!(mapped_bytes(&sim), 0);
    check_invariants(&a, Some(&sim));
}

#[test]
fn hooks_see_each_map_before_its_blocks_and_each_unmap_before_it_happens() {
    let (sim, a) = expandable(1 << 30);
    let me = a.id();
    type Seen = Vec<(Action, u64, usize, bool)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let (s2, sim2) = (seen.clone(), sim.clone());
    let _h = trace::attach(move |e| {
        if e.allocator == me {
            let mapped = sim2.is_mapped(e.addr, e.size);
            s2.lock().unwrap().push((e.action, e.addr, e.size, mapped));
        }
    })
    .unwrap();
    let x = a.alloc::<u8>(3 * MIB).unwrap();
    drop(x);
    a.empty_cache().unwrap();
    let seen = seen.lock().unwrap().clone();
    let actions: Vec<Action> = seen.iter().map(|s| s.0).collect();
    assert_eq!(
        actions,
        vec![Action::SegmentMap, Action::Alloc, Action::FreeRequested, Action::FreeCompleted, Action::SegmentUnmap]
    );
    assert_eq!((seen[0].1, seen[0].2, seen[0].3), (SimDevice::VM_BASE, 4 * MIB, true), "mapped when announced");
    assert_eq!((seen[4].1, seen[4].2, seen[4].3), (SimDevice::VM_BASE, 4 * MIB, true), "still mapped when announced");
    assert_eq!(mapped_bytes(&sim), 0);
}

#[test]
fn no_span_pools_keep_every_block_inside_one_physical_allocation() {
    let (sim, a) = expandable(1 << 30);
    let p = MemPool::on(&a, PoolOptions::new().expandable(true).no_span(true)).unwrap();
    let x = p.alloc::<u8>(3 * MIB).unwrap();
    // The free MiB after x cannot join new memory: 5 MiB is a growth (and a segment) of its own.
    let y = p.alloc::<u8>(5 * MIB).unwrap();
    let maps = sim.mapped();
    assert_eq!(maps, vec![(SimDevice::VM_BASE, 4 * MIB), (SimDevice::VM_BASE + 4 * MIB as u64, 6 * MIB)]);
    for (b, n) in [(&x, 3 * MIB), (&y, 5 * MIB)] {
        let inside =
            maps.iter().any(|&(m, s)| b.device_ptr_raw() >= m && b.device_ptr_raw() + n as u64 <= m + s as u64);
        assert!(inside, "a buffer spans two physical allocations");
    }
    assert_eq!(p.snapshot().segments.len(), 2);
    check_invariants(&a, Some(&sim));
    drop((x, y));
    drop(p);
    assert_eq!(mapped_bytes(&sim), 0, "a released pool's memory is unmapped");
    assert!(sim.reservations().is_empty());
}

#[test]
fn expandable_pools_refuse_what_they_cannot_do() {
    let (_sim, a) = expandable(1 << 30);
    struct NoMemory;
    // SAFETY: it never hands out memory.
    unsafe impl mempool::RawAllocator for NoMemory {
        fn name(&self) -> &str {
            "none"
        }
        fn alloc(&self, _: usize, _: usize, _: mempool::StreamId) -> Result<u64, mempool::BackendError> {
            Err(mempool::BackendError::OutOfMemory)
        }
        unsafe fn free(&self, _: u64, _: usize, _: usize, _: mempool::StreamId) -> Result<(), mempool::BackendError> {
            Ok(())
        }
    }
    let e = MemPool::on(&a, PoolOptions::new().expandable(true).allocator(NoMemory)).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("RawAllocator"), "{e}");
    let h = Allocator::host();
    let e = MemPool::on(&h, PoolOptions::new().expandable(true)).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("virtual memory"), "{e}");
}

/// Random allocations, frees and cache emptying on three streams, in the default pools and in a
/// `no_span` pool, under a capacity that forces the ladder: after every step, every live buffer
/// lies in mapped memory, no two overlap, and the statistics match the block table.
#[test]
fn random_campaign_never_hands_out_unmapped_memory() {
    for seed in 1..=6u64 {
        let (sim, a) = expandable(768 * MIB);
        let pool = MemPool::on(&a, PoolOptions::new().expandable(true).no_span(seed % 2 == 0)).unwrap();
        let streams = [sim.new_stream(), sim.new_stream(), sim.default_stream()];
        let mut rng = Rng(seed);
        let mut live: Vec<(u64, usize, Buffer<u8, Sim>)> = Vec::new();
        for step in 0..1500 {
            let r = rng.below(100);
            if r < 55 || live.is_empty() {
                let s = streams[rng.below(3) as usize];
                let _g = a.set_stream(&s).unwrap();
                let n = rng.size(27).max(1);
                let got = if rng.below(3) == 0 { pool.alloc::<u8>(n) } else { a.alloc::<u8>(n) };
                match got {
                    Ok(b) => {
                        let p = b.device_ptr_raw();
                        assert!(sim.is_mapped(p, n), "seed {seed} step {step}: {n} bytes at {p:#x} not mapped");
                        for (q, m, _) in &live {
                            assert!(p + n as u64 <= *q || q + *m as u64 <= p, "seed {seed} step {step}: overlap");
                        }
                        live.push((p, n, b));
                    }
                    Err(Error::OutOfMemory(_)) => {}
                    Err(e) => panic!("seed {seed} step {step}: {e}"),
                }
            } else if r < 97 {
                let i = rng.below(live.len() as u64) as usize;
                live.swap_remove(i);
            } else {
                a.empty_cache().unwrap();
                pool.empty_cache().unwrap();
            }
            if step % 50 == 0 {
                check_invariants(&a, Some(&sim));
            }
        }
        check_invariants(&a, Some(&sim));
        live.clear();
        a.empty_cache().unwrap();
        pool.empty_cache().unwrap();
        assert_eq!(mapped_bytes(&sim), 0, "seed {seed}: memory left mapped");
        check_invariants(&a, Some(&sim));
        drop(pool);
        assert!(sim.reservations().is_empty(), "seed {seed}: reservations left");
    }
}

#[test]
fn large_blocks_in_expandable_memory_split_off_any_rest() {
    let (sim, a) = expandable(1 << 30);
    // 4 MiB − 512 B in two mapped pages: the 512 B rest is split off (PyTorch's rule for
    // expandable memory; ordinary large blocks keep a rest of 1 MiB or less).
    let x = a.alloc::<u8>(4 * MIB - 512).unwrap();
    let snap = a.snapshot();
    let sizes: Vec<usize> = snap.segments[0].blocks.iter().map(|b| b.size).collect();
    assert_eq!(sizes, vec![4 * MIB - 512, 512]);
    assert_eq!(a.memory_stats().allocated_bytes.all.current, (4 * MIB - 512) as i64);
    check_invariants(&a, Some(&sim));
    drop(x);
}

/// A guard like mempool-nccl's ledger: the live physical allocations, some of them held.
#[derive(Default)]
struct Ledger {
    live: Mutex<std::collections::BTreeMap<u64, usize>>,
    held: Mutex<Vec<u64>>,
    /// `mapped` calls that found the hooks had already seen the map.
    late: Mutex<usize>,
    hooked: Mutex<Vec<u64>>,
    panic_on_unmap: std::sync::atomic::AtomicBool,
}

struct Guard(Arc<Ledger>);

impl mempool::MapGuard for Guard {
    fn mapped(&self, addr: u64, size: usize) {
        if self.0.hooked.lock().unwrap().contains(&addr) {
            *self.0.late.lock().unwrap() += 1;
        }
        self.0.live.lock().unwrap().insert(addr, size);
    }
    fn unmapping(&self, addr: u64, _size: usize) -> Result<(), String> {
        if self.0.panic_on_unmap.load(std::sync::atomic::Ordering::Relaxed) {
            panic!("guard panics");
        }
        if self.0.held.lock().unwrap().contains(&addr) {
            return Err(format!("{addr:#x} is held"));
        }
        self.0.live.lock().unwrap().remove(&addr);
        Ok(())
    }
}

#[test]
fn a_map_guard_sees_every_map_first_and_can_keep_memory_mapped() {
    let (sim, a) = expandable(1 << 30);
    let ledger = Arc::new(Ledger::default());
    let p =
        MemPool::on(&a, PoolOptions::new().expandable(true).no_span(true).map_guard(Guard(ledger.clone()))).unwrap();
    let (me, l2) = (a.id(), ledger.clone());
    let _h = trace::attach(move |e| {
        if e.allocator == me && e.action == Action::SegmentMap {
            l2.hooked.lock().unwrap().push(e.addr);
        }
    })
    .unwrap();
    let x = p.alloc::<u8>(3 * MIB).unwrap();
    let y = p.alloc::<u8>(5 * MIB).unwrap();
    let live: Vec<(u64, usize)> = ledger.live.lock().unwrap().iter().map(|(&a, &s)| (a, s)).collect();
    assert_eq!(live, sim.mapped(), "the guard knows every physical allocation");
    assert_eq!(*ledger.late.lock().unwrap(), 0, "told before the hooks");
    let snap = p.snapshot();
    let maps: Vec<(u64, usize)> = snap.segments.iter().flat_map(|s| s.mappings.clone()).collect();
    assert_eq!(maps, sim.mapped(), "snapshots list each segment's physical allocations");
    // The first allocation is held (a registration whose deregistration failed, say).
    ledger.held.lock().unwrap().push(SimDevice::VM_BASE);
    drop((x, y));
    let e = p.empty_cache().unwrap_err();
    assert!(e.to_string().contains("is held"), "{e}");
    assert_eq!(sim.mapped(), vec![(SimDevice::VM_BASE, 4 * MIB)], "the held one stays mapped, the other goes");
    assert_eq!(ledger.live.lock().unwrap().len(), 1);
    assert_eq!(p.memory_stats().reserved_bytes.current, (4 * MIB) as i64);
    check_invariants(&a, Some(&sim));
    // Still usable while held.
    let z = p.alloc::<u8>(4 * MIB).unwrap();
    assert_eq!(z.device_ptr_raw(), SimDevice::VM_BASE);
    drop(z);
    // A guard that panics keeps it mapped too, and says so.
    ledger.held.lock().unwrap().clear();
    ledger.panic_on_unmap.store(true, std::sync::atomic::Ordering::Relaxed);
    let e = p.empty_cache().unwrap_err();
    assert!(e.to_string().contains("guard panics"), "{e}");
    assert_eq!(sim.mapped().len(), 1);
    check_invariants(&a, Some(&sim));
    ledger.panic_on_unmap.store(false, std::sync::atomic::Ordering::Relaxed);
    p.empty_cache().unwrap();
    assert!(sim.mapped().is_empty());
    assert!(ledger.live.lock().unwrap().is_empty());
    // Refused on a pool that maps nothing.
    let e = MemPool::on(&a, PoolOptions::new().map_guard(Guard(ledger.clone()))).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("not expandable"), "{e}");
}

#[test]
fn a_failed_unmap_after_the_guard_let_go_tells_the_guard_it_is_back() {
    let (sim, a) = expandable(1 << 30);
    let ledger = Arc::new(Ledger::default());
    let p = MemPool::on(&a, PoolOptions::new().expandable(true).map_guard(Guard(ledger.clone()))).unwrap();
    drop(p.alloc::<u8>(3 * MIB).unwrap());
    sim.fail_next_unmaps(1);
    assert!(p.empty_cache().is_err());
    let live: Vec<(u64, usize)> = ledger.live.lock().unwrap().iter().map(|(&a, &s)| (a, s)).collect();
    assert_eq!(live, sim.mapped(), "mapped again in the guard's eyes");
    p.empty_cache().unwrap();
    assert!(ledger.live.lock().unwrap().is_empty() && sim.mapped().is_empty());
}

/// PyTorch's best-fit rule in expandable memory: the free block at the end of the mapped range
/// counts as big as it can grow, so a bigger free block elsewhere is taken first and the end
/// stays free to grow into (a ResNet trace reserved 1.94 GB without the rule, 1.44 GB with it,
/// as PyTorch expandable).
#[test]
fn best_fit_keeps_the_growable_end_free() {
    let (sim, a) = expandable(1 << 30);
    let x = a.alloc::<u8>(8 * MIB).unwrap();
    let y = a.alloc::<u8>(2 * MIB).unwrap();
    let z = a.alloc::<u8>(4 * MIB).unwrap();
    assert_eq!(z.device_ptr_raw(), SimDevice::VM_BASE + 10 * MIB as u64);
    drop(x); // 8 MiB free at the start
    drop(z); // 4 MiB free at the end, unmapped space after it
    let w = a.alloc::<u8>(3 * MIB).unwrap();
    assert_eq!(w.device_ptr_raw(), SimDevice::VM_BASE, "the end block was taken before a bigger one");
    // A request only the end can serve, with growth, still gets it.
    let v = a.alloc::<u8>(6 * MIB).unwrap();
    assert_eq!(v.device_ptr_raw(), SimDevice::VM_BASE + 10 * MIB as u64);
    assert_eq!(mapped_bytes(&sim), 16 * MIB, "the end grew by 2 MiB");
    check_invariants(&a, Some(&sim));
    drop((w, y, v));
    check_invariants(&a, Some(&sim));
}
