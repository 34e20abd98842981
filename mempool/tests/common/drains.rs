//! Threads allocating and freeing against a thread that drains every cache: the race the
//! thread caches' ownership protocol must win (no block handed out twice, nothing lost).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use mempool::sim::SimDevice;
use mempool::{Allocator, Buffer, Config, Sim};

use super::{check_invariants, Rng};

/// The live buffers of every worker, by address: adding one that overlaps another fails.
#[derive(Default)]
pub(crate) struct Live(Mutex<BTreeMap<u64, usize>>);

impl Live {
    pub(crate) fn add(&self, b: &Buffer<u8, Sim>) {
        let (p, size) = (b.device_ptr_raw(), b.len());
        let mut l = self.0.lock().unwrap();
        if let Some((&q, &qn)) = l.range(..p + size as u64).next_back() {
            assert!(q + qn as u64 <= p, "block {p:#x}+{size} overlaps live {q:#x}+{qn}");
        }
        l.insert(p, size);
    }

    pub(crate) fn remove(&self, b: &Buffer<u8, Sim>) {
        self.0.lock().unwrap().remove(&b.device_ptr_raw());
    }
}

/// What one worker does per step: allocate through `a`, register live buffers in `live`, keep
/// some in `held` (given back when the worker stops).
pub(crate) type Step = fn(a: &Allocator<Sim>, rng: &mut Rng, live: &Live, held: &mut Vec<Buffer<u8, Sim>>);

/// The race, with and without expandable segments: `workers` threads (those `on_stream` picks
/// on a stream of their own) run `step` at least `min_steps` times, and on until this thread
/// has run `rounds` of `empty_cache`, snapshot and statistics. At rest the invariants hold, and
/// after `empty_cache` nothing is reserved, allocated, inactive-split, mapped or live.
pub(crate) fn race_drains(
    capacity: usize,
    workers: usize,
    min_steps: u64,
    rounds: usize,
    seed: u64,
    on_stream: fn(usize) -> bool,
    step: Step,
) {
    for expandable in [false, true] {
        let sim = SimDevice::new(capacity);
        let cfg = Config::builder().expandable_segments(expandable).build().unwrap();
        let a = Allocator::sim_with(sim.clone(), cfg);
        let stop = Arc::new(AtomicBool::new(false));
        let start = Arc::new(Barrier::new(workers + 1));
        let live = Arc::new(Live::default());
        let threads: Vec<_> = (0..workers)
            .map(|t| {
                let (a, stop, start, live) = (a.clone(), stop.clone(), start.clone(), live.clone());
                let s = sim.new_stream();
                std::thread::spawn(move || {
                    let _cur = if on_stream(t) { Some(a.set_stream(&s).unwrap()) } else { None };
                    let mut rng = Rng(t as u64 + seed);
                    start.wait();
                    let mut held = Vec::new();
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) || i < min_steps {
                        step(&a, &mut rng, &live, &mut held);
                        i += 1;
                    }
                    for b in held {
                        live.remove(&b);
                    }
                })
            })
            .collect();
        start.wait();
        for k in 0..rounds {
            match k % 3 {
                0 => a.empty_cache().unwrap(),
                1 => drop(a.snapshot()),
                _ => drop(a.memory_stats()),
            }
        }
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().unwrap();
        }
        check_invariants(&a, Some(&sim));
        a.empty_cache().unwrap();
        let s = a.memory_stats();
        assert_eq!((s.reserved_bytes.all.current, s.allocated_bytes.all.current), (0, 0), "expandable {expandable}");
        assert_eq!(s.inactive_split.all.current, 0, "expandable {expandable}");
        assert!(sim.mapped().is_empty() && sim.live_segments().is_empty());
    }
}
