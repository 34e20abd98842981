//! Long random sequences on the simulated device: after every step the block table tiles the
//! segments, no two live buffers overlap, and every statistic equals its value recomputed from
//! the block table. Then the same under 8 threads.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::{check_invariants, Rng};
use mempool::sim::{SimDevice, SimStream};
use mempool::{Allocator, Buffer, Config, Sim};

const MIB: usize = 1 << 20;

fn live_do_not_overlap(live: &[Buffer<u8, Sim>]) {
    let mut spans: Vec<(u64, u64)> = live
        .iter()
        .filter(|b| b.num_bytes() > 0)
        .map(|b| (b.device_ptr_raw(), b.device_ptr_raw() + b.num_bytes() as u64))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "live buffers overlap: {:#x?} and {:#x?}", w[0], w[1]);
    }
}

fn run_random(seed: u64, steps: usize, config: Config) {
    let sim = SimDevice::new(256 * MIB);
    let a = Allocator::sim_with(sim.clone(), config);
    let streams: Vec<SimStream> =
        std::iter::once(sim.default_stream()).chain((0..3).map(|_| sim.new_stream())).collect();
    let mut rng = Rng(seed);
    let mut live: Vec<Buffer<u8, Sim>> = Vec::new();
    let mut ooms = 0;
    for step in 0..steps {
        match rng.below(100) {
            0..=44 => {
                let s = streams[rng.below(streams.len() as u64) as usize];
                let _g = a.set_stream(&s).unwrap();
                let size = if rng.below(4) == 0 { rng.size(27) } else { rng.size(20) };
                if rng.below(200) == 0 {
                    sim.fail_next_allocs(1);
                }
                match a.alloc::<u8>(size) {
                    Ok(b) => {
                        assert_eq!(b.stream_id(), s.id);
                        live.push(b);
                    }
                    Err(mempool::Error::OutOfMemory(_)) => ooms += 1,
                    Err(e) => panic!("step {step}: {e}"),
                }
            }
            45..=84 if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                drop(live.swap_remove(i));
            }
            85..=92 if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                let s = streams[rng.below(streams.len() as u64) as usize];
                live[i].record_stream(&s).unwrap();
            }
            93..=97 => sim.complete_stream(streams[rng.below(streams.len() as u64) as usize]),
            98 => a.empty_cache().unwrap(),
            _ => {
                // Raw API round trip, and a bad free that must change nothing.
                if let Ok(p) = a.alloc_bytes(rng.size(16)) {
                    let before = a.memory_stats();
                    assert!(a.free_bytes(p + 1).is_err());
                    assert_eq!(a.memory_stats(), before);
                    a.free_bytes(p).unwrap();
                }
            }
        }
        check_invariants(&a, Some(&sim));
        if step % 64 == 0 {
            live_do_not_overlap(&live);
        }
    }
    live.clear();
    sim.complete_all();
    a.empty_cache().unwrap();
    check_invariants(&a, Some(&sim));
    let s = a.memory_stats();
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.reserved_bytes.all.current, 0, "segments left after empty_cache with nothing live");
    assert!(sim.live_segments().is_empty());
    assert!(ooms > 0 || steps < 1000, "the sequence never hit the capacity: make it harder");
}

#[test]
fn random_sequences_keep_every_invariant() {
    for seed in [1, 2, 3] {
        run_random(seed, 6000, Config::default());
    }
}

#[test]
fn random_sequences_with_every_option() {
    let cfg =
        Config::parse("max_split_size_mb:32,garbage_collection_threshold:0.6,roundup_power2_divisions:[1:4,64:8,>:2]")
            .unwrap();
    let cfg = Config { memory_fraction: 0.8, ..cfg };
    run_random(7, 6000, cfg);
}

#[test]
fn eight_threads_hammering_one_allocator() {
    const THREADS: usize = 8;
    const OPS: usize = 100_000;
    let sim = SimDevice::new(4096 * MIB);
    let a = Allocator::sim(sim.clone());
    let streams: Arc<Vec<SimStream>> =
        Arc::new(std::iter::once(sim.default_stream()).chain((0..3).map(|_| sim.new_stream())).collect());
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, sim, streams, done) = (a.clone(), sim.clone(), streams.clone(), done_tx.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(1000 + t as u64);
                let mut live: Vec<Buffer<u8, Sim>> = Vec::new();
                let mut owners: BTreeMap<u64, usize> = BTreeMap::new();
                let my_stream = streams[t % streams.len()];
                let _g = a.set_stream(&my_stream).unwrap();
                for _ in 0..OPS {
                    match rng.below(10) {
                        0..=4 => {
                            if let Ok(b) = a.alloc::<u8>(rng.size(18)) {
                                assert_eq!(b.stream_id(), my_stream.id);
                                assert!(owners.insert(b.device_ptr_raw(), t).is_none(), "address handed out twice");
                                live.push(b);
                            }
                        }
                        5..=8 if !live.is_empty() => {
                            let b = live.swap_remove(rng.below(live.len() as u64) as usize);
                            owners.remove(&b.device_ptr_raw());
                        }
                        _ => {
                            if let Some(b) = live.last() {
                                b.record_stream(&streams[rng.below(streams.len() as u64) as usize]).unwrap();
                            }
                            sim.complete_stream(streams[rng.below(streams.len() as u64) as usize]);
                        }
                    }
                }
                done.send(()).unwrap();
                live
            })
        })
        .collect();
    drop(done_tx);
    // Watchdog: a deadlock fails the test instead of hanging it.
    for _ in 0..THREADS {
        done_rx.recv_timeout(std::time::Duration::from_secs(300)).expect("a thread did not finish: deadlock?");
    }
    let mut all: Vec<Buffer<u8, Sim>> = handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
    live_do_not_overlap(&all);
    check_invariants(&a, Some(&sim));
    all.clear();
    sim.complete_all();
    a.empty_cache().unwrap();
    check_invariants(&a, Some(&sim));
    assert_eq!(a.memory_stats().reserved_bytes.all.current, 0);
    assert_eq!(a.memory_stats().allocation.all.allocated, a.memory_stats().allocation.all.freed);
}
