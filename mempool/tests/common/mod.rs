//! Shared checks for the sim-backed tests, and the GPU tests' kernels.
#![allow(dead_code)]

pub(crate) mod drains;
pub(crate) mod model;
pub(crate) mod mutate;
pub(crate) mod procs;
pub(crate) mod ptx;
pub(crate) mod sock;
pub(crate) mod sources;
pub(crate) mod watch;

use mempool::sim::SimDevice;
use mempool::{Allocator, BlockState, Kind, MemPool, MemoryStats, Snapshot, StatArray};

/// The block events (action, address) a hook saw.
pub(crate) type Seen = std::sync::Arc<std::sync::Mutex<Vec<(mempool::trace::Action, u64)>>>;

/// Attaches a hook that records allocator `a`'s events (no other allocator's) while the
/// returned handle lives.
pub(crate) fn record_events<K: Kind>(a: &Allocator<K>) -> (mempool::trace::TraceHandle, Seen) {
    let seen: Seen = Default::default();
    let s2 = seen.clone();
    let id = a.id();
    let h = mempool::trace::attach(move |e| {
        if e.allocator == id {
            s2.lock().unwrap().push((e.action, e.addr));
        }
    })
    .unwrap();
    (h, seen)
}

/// xorshift64, as in the anchors' workloads.
pub(crate) struct Rng(pub u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Log-uniform size between 1 byte and `1 << max_log2` bytes.
    pub(crate) fn size(&mut self, max_log2: u32) -> usize {
        let lo = 1usize << self.below(u64::from(max_log2));
        lo + self.below(lo as u64) as usize
    }
}

/// Every structural invariant of a snapshot, and every statistic recomputed from it.
pub(crate) fn check_invariants<K: Kind>(alloc: &Allocator<K>, sim: Option<&SimDevice>) {
    let snap = alloc.snapshot();
    let stats = alloc.memory_stats();
    check_snapshot(&snap);
    if let Some(sim) = sim {
        // Segments of pools with their own allocator live elsewhere (the tests' user allocators
        // hand out addresses from 0x7000_0000_0000, far above anything the sim reaches).
        let segs: Vec<(u64, usize)> = snap
            .segments
            .iter()
            .filter(|s| s.address < SimDevice::VM_BASE)
            .map(|s| (s.address, s.total_size))
            .collect();
        assert_eq!(segs, sim.live_segments(), "allocator segments differ from the device's");
        // Expandable segments: every segment mapped, and the mapped bytes exactly theirs.
        let vm: Vec<(u64, usize)> = snap
            .segments
            .iter()
            .filter(|s| (SimDevice::VM_BASE..1 << 46).contains(&s.address))
            .map(|s| (s.address, s.total_size))
            .collect();
        for &(a, n) in &vm {
            assert!(sim.is_mapped(a, n), "segment {a:#x} ({n} bytes) is not all mapped");
        }
        let mapped: usize = sim.mapped().iter().map(|m| m.1).sum();
        assert_eq!(vm.iter().map(|s| s.1).sum::<usize>(), mapped, "memory mapped outside every segment");
    }
    check_stats(&snap, &stats);
}

pub(crate) fn check_snapshot(snap: &Snapshot) {
    let mut last_end = 0u64;
    for s in &snap.segments {
        assert!(s.address >= last_end, "segments overlap at {:#x}", s.address);
        last_end = s.address + s.total_size as u64;
        assert!(!s.blocks.is_empty());
        let mut at = s.address;
        let mut prev_free = false;
        for b in &s.blocks {
            assert_eq!(b.address, at, "blocks of segment {:#x} do not tile it", s.address);
            assert!(b.size >= 512 && b.size % 512 == 0, "block size {}", b.size);
            at += b.size as u64;
            let free = b.state == BlockState::Free;
            assert!(!(free && prev_free), "two adjacent free blocks at {:#x}: missed merge", b.address);
            prev_free = free;
            if b.state == BlockState::Allocated {
                assert!(b.requested_size <= b.size);
            }
        }
        assert_eq!(at, s.address + s.total_size as u64, "blocks do not cover segment {:#x}", s.address);
    }
}

fn current(a: &StatArray) -> (i64, i64, i64) {
    (a.all.current, a.small_pool.current, a.large_pool.current)
}

pub(crate) fn check_stats(snap: &Snapshot, stats: &MemoryStats) {
    let mut want: [(i64, i64, i64); 9] = Default::default();
    let add = |t: &mut (i64, i64, i64), small: bool, n: usize| {
        t.0 += n as i64;
        if small {
            t.1 += n as i64
        } else {
            t.2 += n as i64
        }
    };
    for s in &snap.segments {
        add(&mut want[0], s.is_small, 1);
        add(&mut want[1], s.is_small, s.total_size);
        // Expandable segments stay out of the inactive-split counts (PyTorch's rule).
        let split = s.blocks.len() > 1 && s.mappings.is_empty();
        for b in &s.blocks {
            match b.state {
                BlockState::Allocated => {
                    add(&mut want[2], s.is_small, 1);
                    add(&mut want[3], s.is_small, b.size);
                    add(&mut want[4], s.is_small, b.requested_size);
                    add(&mut want[5], s.is_small, 1);
                    add(&mut want[6], s.is_small, b.size);
                }
                BlockState::AwaitingStreams => {
                    add(&mut want[5], s.is_small, 1);
                    add(&mut want[6], s.is_small, b.size);
                }
                BlockState::Free => {
                    if split {
                        add(&mut want[7], s.is_small, 1);
                        add(&mut want[8], s.is_small, b.size);
                    }
                }
            }
        }
    }
    let got = [
        current(&stats.segment),
        current(&stats.reserved_bytes),
        current(&stats.allocation),
        current(&stats.allocated_bytes),
        current(&stats.requested_bytes),
        current(&stats.active),
        current(&stats.active_bytes),
        current(&stats.inactive_split),
        current(&stats.inactive_split_bytes),
    ];
    let names = [
        "segment",
        "reserved_bytes",
        "allocation",
        "allocated_bytes",
        "requested_bytes",
        "active",
        "active_bytes",
        "inactive_split",
        "inactive_split_bytes",
    ];
    for i in 0..9 {
        assert_eq!(got[i], want[i], "stat {} (all, small, large) differs from the block table", names[i]);
    }
    for a in [&stats.segment, &stats.reserved_bytes, &stats.allocation, &stats.allocated_bytes, &stats.active_bytes] {
        assert!(a.all.peak >= a.all.current);
        assert_eq!(a.all.allocated as i64 - a.all.freed as i64, a.all.current);
    }
}

/// A pool's statistics against its own segments.
pub(crate) fn check_pool<K: Kind>(pool: &MemPool<K>) {
    let snap = pool.snapshot();
    check_snapshot(&snap);
    let s = pool.memory_stats();
    let blocks = || snap.segments.iter().flat_map(|seg| seg.blocks.iter().map(move |b| (seg, b)));
    let allocated = || blocks().filter(|(_, b)| b.state == BlockState::Allocated);
    assert_eq!(s.segment.current as usize, snap.segments.len());
    assert_eq!(s.reserved_bytes.current as usize, snap.reserved());
    assert_eq!(s.allocation.current as usize, allocated().count());
    assert_eq!(s.allocated_bytes.current as usize, allocated().map(|(_, b)| b.size).sum::<usize>());
    assert_eq!(s.requested_bytes.current as usize, allocated().map(|(_, b)| b.requested_size).sum::<usize>());
    assert_eq!(
        s.active_bytes,
        blocks().filter(|(_, b)| b.state != BlockState::Free).map(|(_, b)| b.size).sum::<usize>()
    );
    let inactive = blocks()
        .filter(|(seg, b)| b.state == BlockState::Free && seg.blocks.len() > 1 && seg.mappings.is_empty())
        .map(|(_, b)| b.size);
    assert_eq!(s.inactive_split_bytes, inactive.sum::<usize>());
    for st in [&s.segment, &s.reserved_bytes, &s.allocation, &s.allocated_bytes, &s.requested_bytes] {
        assert!(st.peak >= st.current);
        assert_eq!(st.allocated as i64 - st.freed as i64, st.current);
    }
}

impl mutate::Below for Rng {
    fn below(&mut self, n: u64) -> u64 {
        Rng::below(self, n)
    }
}

/// A simulated device of `capacity` bytes whose memory counts as pinned (`SimDevice::pinned`),
/// and an allocator on it with the settings `conf` (`MEMPOOL_ALLOC_CONF` syntax).
pub(crate) fn pinned_sim(capacity: usize, conf: &str) -> (std::sync::Arc<SimDevice>, Allocator<mempool::Sim>) {
    let sim = SimDevice::pinned(capacity);
    let config = mempool::Config::parse(conf).expect("a valid config");
    (sim.clone(), Allocator::sim_with(sim, config))
}

/// A simulated device of `capacity` bytes and an allocator on it with the settings `conf`
/// (`MEMPOOL_ALLOC_CONF` syntax; empty: the defaults).
pub(crate) fn sim_with(capacity: usize, conf: &str) -> (std::sync::Arc<SimDevice>, Allocator<mempool::Sim>) {
    let sim = SimDevice::new(capacity);
    let config = mempool::Config::parse(conf).expect("a valid config");
    (sim.clone(), Allocator::sim_with(sim, config))
}

/// After `empty_cache`, everything freed and given back: the invariants hold, no allocation,
/// active block, segment or reserved byte is counted, and the device holds no segment, mapping
/// or reservation.
pub(crate) fn all_given_back(sim: &SimDevice, a: &Allocator<mempool::Sim>) {
    a.empty_cache().unwrap();
    check_invariants(a, Some(sim));
    let st = a.memory_stats();
    assert_eq!(st.allocation.all.current, 0, "allocations left");
    assert_eq!(st.active.all.current, 0, "active blocks left");
    assert_eq!(st.segment.all.current, 0, "segments left: {}", a.snapshot().segments.len());
    assert_eq!(st.reserved_bytes.all.current, 0, "reserved bytes left");
    assert_eq!(sim.used(), 0, "device memory left: {:?}", sim.live_segments());
    assert!(sim.mapped().is_empty(), "mappings left: {:?}", sim.mapped());
    assert!(sim.reservations().is_empty(), "reservations left: {:?}", sim.reservations());
}

/// Waits (at most 10 s) until `cond` holds, looking every millisecond; whether it did.
pub(crate) fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let since = std::time::Instant::now();
    while since.elapsed() < std::time::Duration::from_secs(10) {
        if cond() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    cond()
}

/// A closure its thread runs while its thread-locals are destroyed (see `at_exit_first`).
struct AtExit(Option<Box<dyn FnOnce()>>);

impl Drop for AtExit {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

thread_local! {
    static AT_EXIT: std::cell::RefCell<AtExit> = const { std::cell::RefCell::new(AtExit(None)) };
}

/// Registers this thread's exit closure before anything else of the thread's locals (call it
/// before the allocator's are made): it then runs after theirs are destroyed, a thread with no
/// locals left.
pub(crate) fn at_exit_first() {
    AT_EXIT.with(|_| ());
}

/// Sets the closure this thread runs at its exit (registered first by `at_exit_first`, or now).
pub(crate) fn at_exit(f: impl FnOnce() + 'static) {
    AT_EXIT.with(|e| e.borrow_mut().0 = Some(Box::new(f)));
}
