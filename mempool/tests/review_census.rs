//! Hostile review of 443d1bf (the solo census: `Board::solo`, a census by the board's one
//! member sums its own and the retired counters without the members' lock).
mod common;

use common::model::Model;
use common::{check_invariants, Rng};
use mempool::sim::SimDevice;
use mempool::{Allocator, Buffer, Config, Sim};
use std::sync::mpsc::{channel, Receiver, Sender};

/// A buffer and the bytes it was asked for.
type Sized = (Buffer<u8, Sim>, usize);

const MIB: usize = 1 << 20;
const KIB: usize = 1 << 10;

fn size_of(rng: &mut Rng) -> usize {
    let small_sizes = [512, 4 * KIB, 64 * KIB, 1000 * KIB];
    let large_sizes = [2 * MIB, 3 * MIB, 8 * MIB, 19 * MIB + 512 * KIB];
    match rng.below(5) {
        0 => small_sizes[rng.below(4) as usize],
        1 => large_sizes[rng.below(4) as usize],
        2 => 1 + rng.below(MIB as u64) as usize,
        3 => MIB + 1 + rng.below(30 * MIB as u64) as usize,
        _ => small_sizes[0],
    }
}

/// One thread's random steps (alloc/free, resets, empty_cache), checked against the model.
fn solo_steps(
    a: &Allocator<Sim>,
    rng: &mut Rng,
    m: &mut Model,
    live: &mut Vec<(Buffer<u8, Sim>, usize)>,
    steps: usize,
    what: &str,
) {
    for step in 0..steps {
        let op = rng.below(20);
        if op == 0 {
            a.reset_peak_stats();
            m.reset();
        } else if op == 1 {
            a.empty_cache().unwrap();
        } else if op < 11 || live.is_empty() {
            let size = size_of(rng);
            live.push((a.alloc::<u8>(size).unwrap(), size));
            m.add(size, 1);
        } else {
            let i = rng.below(live.len() as u64) as usize;
            let (b, size) = live.swap_remove(i);
            drop(b);
            m.add(size, -1);
        }
        m.check(a, &format!("{what} step {step} op {op}"));
    }
}

/// C1: one thread, resets and empty_cache interleaved, every step checked (cached, deferred
/// and parked blocks), with and without expandable segments.
#[test]
fn solo_peaks_exact_with_resets() {
    for expandable in [false, true] {
        for seed in 1..60u64 {
            let sim = SimDevice::new(64 << 30);
            let a =
                Allocator::sim_with(sim.clone(), Config::builder().expandable_segments(expandable).build().unwrap());
            let (mut rng, mut m, mut live) = (Rng(seed), Model::default(), Vec::new());
            solo_steps(&a, &mut rng, &mut m, &mut live, 300, &format!("exp {expandable} seed {seed}"));
            drop(live);
            check_invariants(&a, Some(&sim));
        }
    }
}

/// C2: threads take turns (each exits, some orphaned with cached/deferred blocks, some
/// retired by a drain), handing blocks to the main thread; then main alone after a reset.
#[test]
fn solo_after_exited_threads() {
    for seed in 1..40u64 {
        let sim = SimDevice::new(64 << 30);
        let a = Allocator::sim(sim.clone());
        let (mut rng, mut m, mut live) = (Rng(seed), Model::default(), Vec::new());
        // Main's cache exists first.
        solo_steps(&a, &mut rng, &mut m, &mut live, 20, &format!("seed {seed} pre"));
        for t in 0..6u64 {
            let a2 = a.clone();
            let s2 = seed * 100 + t;
            let (kept, freed): (Vec<Sized>, Vec<usize>) = std::thread::spawn(move || {
                let mut r = Rng(s2);
                let mut kept = Vec::new();
                let mut freed = Vec::new();
                for _ in 0..1 + r.below(12) {
                    let size = size_of(&mut r);
                    let b = a2.alloc::<u8>(size).unwrap();
                    if r.below(2) == 0 {
                        kept.push((b, size));
                    } else {
                        drop(b); // cached in its cache (deferred), orphaned at exit
                        freed.push(size);
                    }
                }
                (kept, freed)
            })
            .join()
            .unwrap();
            let _ = freed;
            for (b, size) in kept {
                m.add(size, 1);
                live.push((b, size));
            }
            // The model's peaks across turns are not checked (another thread's climb);
            // currents are, and then main restarts the peaks and goes on alone.
            if rng.below(2) == 0 {
                a.empty_cache().unwrap();
            }
            a.reset_peak_stats();
            m.reset();
            m.check(&a, &format!("seed {seed} after thread {t}"));
            solo_steps(&a, &mut rng, &mut m, &mut live, 40, &format!("seed {seed} after thread {t}"));
        }
        drop(live);
        check_invariants(&a, Some(&sim));
    }
}

/// C3: the main thread is the one member while another thread, its locals gone (a
/// thread-local destructor after the allocator's), allocates and frees through the retired
/// counters, in turns; main's peaks after each reset are exact.
#[test]
fn solo_with_locals_gone_thread_in_turns() {
    for (seed, had_cache) in [(1u64, true), (2, false), (3, true), (4, false)] {
        let sim = SimDevice::new(64 << 30);
        let a = Allocator::sim(sim.clone());
        let (mut rng, mut m, mut live) = (Rng(seed), Model::default(), Vec::new());
        solo_steps(&a, &mut rng, &mut m, &mut live, 10, "pre");
        let (go_tx, go_rx): (Sender<Option<usize>>, Receiver<Option<usize>>) = channel();
        let (done_tx, done_rx) = channel::<()>();
        let a2 = a.clone();
        let t = std::thread::spawn(move || {
            common::at_exit_first(); // registered first: destroyed after the allocator's locals
            if had_cache {
                drop(a2.alloc::<u8>(4 * KIB).unwrap());
            } else {
                // Another allocator first: this thread's list of caches exists before the exit
                // closure runs (else its first call there makes the list, and a cache of `a`
                // with it: no thread whose locals are gone at all; review21.rs found that).
                let other = Allocator::sim(SimDevice::new(1 << 30));
                drop(other.alloc::<u8>(4 * KIB).unwrap());
            }
            let a3 = a2.clone();
            common::at_exit(move || {
                let mut held: Vec<Buffer<u8, Sim>> = Vec::new();
                while let Ok(msg) = go_rx.recv() {
                    match msg {
                        Some(size) => held.push(a3.alloc::<u8>(size).unwrap()),
                        None => {
                            held.pop();
                        }
                    }
                    done_tx.send(()).unwrap();
                }
                drop(held);
            });
        });
        let mut theirs: Vec<usize> = Vec::new();
        // Wait until the other thread's destructor runs (its first turn answers).
        for round in 0..40 {
            // Its turn: alloc or free (peaks not checked across), then reset and main alone.
            if theirs.is_empty() || rng.below(2) == 0 {
                let size = size_of(&mut rng);
                go_tx.send(Some(size)).unwrap();
                theirs.push(size);
                m.add(size, 1);
            } else {
                go_tx.send(None).unwrap();
                let size = theirs.pop().unwrap();
                m.add(size, -1);
            }
            done_rx.recv().unwrap();
            a.reset_peak_stats();
            m.reset();
            solo_steps(&a, &mut rng, &mut m, &mut live, 25, &format!("seed {seed} round {round}"));
        }
        drop(go_tx);
        t.join().unwrap();
        for s in theirs {
            m.add(s, -1);
        }
        drop(live);
        check_invariants(&a, Some(&sim));
    }
}

/// C4: threads join and exit (short-lived, their ThreadStats freed and addresses reused)
/// while the main thread climbs; at each quiescent point the currents are exact and the
/// peaks are at least them; after a reset main alone is exact again.
#[test]
fn join_exit_race_then_quiescent() {
    let sim = SimDevice::new(256 << 30);
    let a = Allocator::sim(sim.clone());
    let (mut rng, mut m, mut live) = (Rng(7), Model::default(), Vec::new());
    for round in 0..30u64 {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut hs = Vec::new();
        for k in 0..2u64 {
            let (a2, stop) = (a.clone(), stop.clone());
            hs.push(std::thread::spawn(move || {
                let mut r = Rng(round * 10 + k + 1);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // A short-lived thread: joins, allocates, frees, exits.
                    let a3 = a2.clone();
                    let s = r.below(1 << 30);
                    std::thread::spawn(move || {
                        let mut r = Rng(s);
                        let mut v = Vec::new();
                        for _ in 0..r.below(6) {
                            v.push(a3.alloc::<u8>(size_of(&mut r)).unwrap());
                        }
                        if r.below(3) == 0 {
                            let _ = a3.empty_cache();
                        }
                        drop(v);
                    })
                    .join()
                    .unwrap();
                }
            }));
        }
        // Main climbs meanwhile (peaks not exact while racing; currents checked after).
        for _ in 0..200 {
            if rng.below(3) != 0 || live.is_empty() {
                let size = size_of(&mut rng);
                live.push((a.alloc::<u8>(size).unwrap(), size));
                m.add(size, 1);
            } else {
                let (b, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
                drop(b);
                m.add(size, -1);
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for h in hs {
            h.join().unwrap();
        }
        let s = a.memory_stats();
        assert_eq!(s.allocation.all.current, m.n[0], "round {round}: allocation current at rest");
        assert_eq!(s.requested_bytes.all.current, m.req[0], "round {round}: requested current at rest");
        assert!(
            s.allocation.all.peak >= m.n_peak[0],
            "round {round}: allocation peak {} < main's own max {}",
            s.allocation.all.peak,
            m.n_peak[0]
        );
        assert!(
            s.requested_bytes.all.peak >= m.req_peak[0],
            "round {round}: requested peak {} < main's max {}",
            s.requested_bytes.all.peak,
            m.req_peak[0]
        );
        a.reset_peak_stats();
        m.reset();
        solo_steps(&a, &mut rng, &mut m, &mut live, 30, &format!("round {round} after"));
        // Free down so memory stays bounded.
        while live.len() > 20 {
            let (b, size) = live.pop().unwrap();
            drop(b);
            m.add(size, -1);
        }
        a.reset_peak_stats();
        m.reset();
    }
    drop(live);
    check_invariants(&a, Some(&sim));
}

/// C5: the main thread is the one member while the background event thread (no cache: it
/// counts what it files in the retired counters, which no exited thread wrote before) files
/// the free of a block the device used. After a reset, main's next allocation climbs the
/// peaks: the census must count the retired counters' decrease, or the peak of active bytes
/// would keep the filed block (one member's census skips retired counters never written).
#[test]
fn solo_while_the_event_thread_files_into_the_retired_counters() {
    let (sim, a) = common::pinned_sim(1 << 30, "pinned_use_background_threads:True,thread_cache:False");
    let s = sim.new_stream();
    let on = a.set_stream(&s).unwrap();
    let x = a.alloc::<u8>(4 * MIB).unwrap();
    let _ = x.device_ptr_raw(); // the device used it: its free waits for stream `s`
    drop(x);
    drop(on);
    sim.complete_stream(s);
    assert!(common::eventually(|| a.memory_stats().active_bytes.all.current == 0), "the event thread files the block");
    a.reset_peak_stats();
    let y = a.alloc::<u8>(2 * MIB).unwrap();
    let st = a.memory_stats();
    assert_eq!(st.active_bytes.all.current, (2 * MIB) as i64);
    assert_eq!(st.active_bytes.all.peak, (2 * MIB) as i64, "the filed 4 MiB block is not in the peak");
    assert_eq!(st.allocated_bytes.all.peak, (2 * MIB) as i64);
    drop(y);
    check_invariants(&a, Some(&sim));
}
