//! Hostile review (helper, session 17) of 5042eda: the one member's census reads its own
//! counters with `current_now` and skips the retired counters until `Board::retired_written`.
//! Every write to the retired counters found sets the flag first (held_…: each fails with
//! its flag store removed). Found, older than the commit (both fail at 5042eda~1 too): the
//! retired counters have several writers (the background event thread, threads whose locals
//! are gone), so a rise of theirs within a decrease another writer left uncommitted commits
//! nothing and no census sees it: `f1_…` (one user thread, inactive-split peak low), `f2_…`
//! (active-bytes peak low). Fixed: every section that writes the retired counters commits
//! them at its end (`Board::commit_retired`, from `Locked`'s drop and the event thread's look),
//! so a later writer's rise is above what is committed and checks the peaks.
mod common;

use common::check_invariants;
use mempool::sim::SimDevice;
use mempool::{Allocator, Buffer, Sim};

const MIB: usize = 1 << 20;
const KIB: usize = 1 << 10;

/// Frees `b` after the device used it on stream `s` (its free waits for `s`), then lets the
/// stream complete and waits for the background event thread to file it.
fn free_via_event_thread(sim: &SimDevice, a: &Allocator<Sim>, b: Buffer<u8, Sim>, s: &mempool::sim::SimStream) {
    let _ = b.device_ptr_raw();
    let before = a.memory_stats().active.all.current;
    drop(b);
    sim.complete_stream(*s);
    assert!(
        common::eventually(|| a.memory_stats().active.all.current == before - 1),
        "the event thread files the block"
    );
}

/// F1 (older than 5042eda): a single user thread with `pinned_use_background_threads`. After
/// a reset, the event thread's filings make the retired counters' inactive-split count fall
/// (a merge: uncommitted, within its slack), then rise back (two unmerged frees): the rise
/// stays within what the retired counters committed, so it commits nothing, no census runs,
/// and `inactive_split.all.peak` misses the 3 inactive-split blocks that existed at once.
#[test]
fn f1_event_thread_rise_within_retired_slack_misses_inactive_split_peak() {
    let (sim, a) = common::pinned_sim(1 << 30, "pinned_use_background_threads:True,thread_cache:False");
    let s = sim.new_stream();
    let _on = a.set_stream(&s).unwrap();
    // One 20 MiB segment, made and left whole free.
    drop(a.alloc::<u8>(4 * MIB).unwrap());
    a.reset_peak_stats();
    // x y z and the rest (8 MiB); x filed by the event thread: 2 inactive-split blocks.
    let x = a.alloc::<u8>(4 * MIB).unwrap();
    let y = a.alloc::<u8>(4 * MIB).unwrap();
    let z = a.alloc::<u8>(4 * MIB).unwrap();
    free_via_event_thread(&sim, &a, x, &s);
    free_via_event_thread(&sim, &a, y, &s);
    free_via_event_thread(&sim, &a, z, &s); // all merged: the retired count falls by 2
    assert_eq!(a.memory_stats().inactive_split.all.current, 0);
    assert_eq!(a.memory_stats().inactive_split.all.peak, 2);
    // b1..b4 and the rest (4 MiB): 1 inactive-split block.
    let b: Vec<Buffer<u8, Sim>> = (0..4).map(|_| a.alloc::<u8>(4 * MIB).unwrap()).collect();
    assert_eq!(a.snapshot().segments.len(), 1);
    let mut b = b.into_iter();
    let (b1, b2, b3, b4) = (b.next().unwrap(), b.next().unwrap(), b.next().unwrap(), b.next().unwrap());
    // b1 and b3 filed: b1, b3 and the rest free, none adjacent: 3 inactive-split blocks.
    free_via_event_thread(&sim, &a, b1, &s);
    free_via_event_thread(&sim, &a, b3, &s);
    let snap = a.snapshot();
    let free = snap.segments[0].blocks.iter().filter(|b| b.state == mempool::BlockState::Free).count();
    assert_eq!(free, 3, "three free blocks of one split segment");
    free_via_event_thread(&sim, &a, b2, &s);
    free_via_event_thread(&sim, &a, b4, &s);
    let st = a.memory_stats();
    assert_eq!(st.inactive_split.all.current, 0);
    check_invariants(&a, Some(&sim));
    assert_eq!(st.inactive_split.all.peak, 3, "3 inactive-split blocks existed at once");
}

/// A thread that runs `f` on each message from its thread-local destructor (after the
/// allocator's locals are gone: its calls count in the retired counters), answering each.
struct LocalsGone {
    tx: Option<std::sync::mpsc::Sender<Box<dyn FnOnce() + Send>>>,
    done: std::sync::mpsc::Receiver<()>,
    h: Option<std::thread::JoinHandle<()>>,
}

impl LocalsGone {
    /// `had_cache`: the thread made its cache of `a` first (a cache, then orphaned). Without
    /// one, it uses another allocator first: its thread-local list of caches must exist before
    /// the exit closure runs (else the closure's first call makes it, and a cache of `a` with
    /// it: not a thread whose locals are gone at all).
    fn start(a: &Allocator<Sim>, had_cache: bool) -> LocalsGone {
        let (tx, rx) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let (done_tx, done) = std::sync::mpsc::channel();
        let a2 = a.clone();
        let h = std::thread::spawn(move || {
            common::at_exit_first();
            if had_cache {
                drop(a2.alloc::<u8>(4 * KIB).unwrap());
            } else {
                let other = Allocator::sim(SimDevice::new(1 << 30));
                drop(other.alloc::<u8>(4 * KIB).unwrap());
            }
            common::at_exit(move || {
                while let Ok(f) = rx.recv() {
                    f();
                    done_tx.send(()).unwrap();
                }
                drop(a2);
            });
        });
        let lg = LocalsGone { tx: Some(tx), done, h: Some(h) };
        lg.run(|| ()); // its destructor runs
        lg
    }

    fn run(&self, f: impl FnOnce() + Send + 'static) {
        self.tx.as_ref().unwrap().send(Box::new(f)).unwrap();
        self.done.recv().unwrap();
    }
}

impl Drop for LocalsGone {
    fn drop(&mut self) {
        drop(self.tx.take());
        self.h.take().unwrap().join().unwrap();
    }
}

type Held = std::sync::Arc<std::sync::Mutex<Vec<Buffer<u8, Sim>>>>;

/// F2 (older than 5042eda): the event thread's filing of main's 8 MiB block leaves an
/// uncommitted decrease of active bytes in the retired counters; main allocates 4 MiB (its
/// census reads the true 4 MiB: the peak stays 8 MiB); a thread whose locals are gone (its
/// counts go to the same retired counters) allocates 6 MiB, within that decrease: no commit,
/// no census, and `active_bytes.all.peak` says 8 MiB though 10 MiB were active at once
/// (`allocated_bytes`, whose decrease main counted, is right).
#[test]
fn f2_locals_gone_rise_within_event_threads_retired_decrease_misses_active_peak() {
    let (sim, a) = common::pinned_sim(1 << 30, "pinned_use_background_threads:True,thread_cache:False");
    let x = LocalsGone::start(&a, true);
    let s = sim.new_stream();
    let on = a.set_stream(&s).unwrap();
    a.reset_peak_stats();
    let b = a.alloc::<u8>(8 * MIB).unwrap();
    free_via_event_thread(&sim, &a, b, &s); // retired active bytes: -8 MiB, uncommitted
    let m = a.alloc::<u8>(4 * MIB).unwrap(); // census: the true 4 MiB, peak stays 8 MiB
    let held: Held = Default::default();
    let (a2, h2) = (a.clone(), held.clone());
    x.run(move || h2.lock().unwrap().push(a2.alloc::<u8>(6 * MIB).unwrap())); // 10 MiB active
    let st = a.memory_stats();
    assert_eq!(st.active_bytes.all.current, (10 * MIB) as i64);
    let h2 = held.clone();
    x.run(move || drop(h2.lock().unwrap().pop()));
    drop(m);
    drop(on);
    let st = a.memory_stats();
    assert_eq!(st.allocated_bytes.all.peak, (10 * MIB) as i64, "allocated bytes peak");
    assert_eq!(st.active_bytes.all.peak, (10 * MIB) as i64, "10 MiB were active at once");
    drop(x);
    check_invariants(&a, Some(&sim));
}

/// Held: a thread whose locals are gone and that never had a cache of this allocator (it used
/// another one first) is the first to write the retired counters, through its locked calls
/// (`Sink::retired`, no retirement before it). The main thread, the one member, then climbs
/// after a reset: its census counts the other thread's 8 MiB (skipping the retired counters,
/// it would read 4 MiB and keep the 8 MiB peak of the reset).
#[test]
fn held_solo_census_reads_retired_first_written_by_a_locals_gone_call() {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    drop(a.alloc::<u8>(4 * KIB).unwrap()); // main's cache: main is the one member
    let x = LocalsGone::start(&a, false);
    let held: Held = Default::default();
    let (a2, h2) = (a.clone(), held.clone());
    x.run(move || h2.lock().unwrap().push(a2.alloc::<u8>(8 * MIB).unwrap()));
    a.reset_peak_stats();
    let st = a.memory_stats();
    assert_eq!(st.allocated_bytes.all.peak, (8 * MIB) as i64);
    let m = a.alloc::<u8>(4 * MIB).unwrap();
    assert_eq!(a.memory_stats().allocated_bytes.all.current, (12 * MIB) as i64);
    drop(m); // (a peak is reported at least the current value: read it below that)
    let st = a.memory_stats();
    assert_eq!(st.allocated_bytes.all.current, (8 * MIB) as i64);
    assert_eq!(st.allocated_bytes.all.peak, (12 * MIB) as i64, "the other thread's 8 MiB in the census");
    assert_eq!(st.requested_bytes.all.peak, (12 * MIB) as i64);
    assert_eq!(st.allocation.all.peak, 2);
    let h2 = held.clone();
    x.run(move || drop(h2.lock().unwrap().pop()));
    drop(x);
    check_invariants(&a, Some(&sim));
}

/// Held: an exited thread's block (absorbed into the retired counters by a drain, `retire`)
/// counts in the one member's census after a reset, through the public API.
#[test]
fn held_solo_census_reads_an_exited_threads_block() {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    drop(a.alloc::<u8>(4 * KIB).unwrap());
    let a2 = a.clone();
    let b = std::thread::spawn(move || a2.alloc::<u8>(8 * MIB).unwrap()).join().unwrap();
    a.empty_cache().unwrap(); // retires the exited thread: main is the one member again
    a.reset_peak_stats();
    drop(a.alloc::<u8>(4 * MIB).unwrap());
    let st = a.memory_stats();
    assert_eq!(st.allocated_bytes.all.current, (8 * MIB) as i64);
    assert_eq!(st.allocated_bytes.all.peak, (12 * MIB) as i64, "the exited thread's 8 MiB in the census");
    drop(b); // main frees the exited thread's block: main's counters go below zero
    let m2 = a.alloc::<u8>(6 * MIB).unwrap();
    a.reset_peak_stats();
    drop(a.alloc::<u8>(2 * MIB).unwrap());
    let st = a.memory_stats();
    assert_eq!(st.allocated_bytes.all.current, (6 * MIB) as i64);
    assert_eq!(st.allocated_bytes.all.peak, (8 * MIB) as i64, "6 MiB + 2 MiB");
    drop(m2);
    check_invariants(&a, Some(&sim));
}

fn size_of(rng: &mut common::Rng) -> usize {
    match rng.below(5) {
        0 => [512, 4 * KIB, 64 * KIB, 1000 * KIB][rng.below(4) as usize],
        1 => [2 * MIB, 3 * MIB, 8 * MIB, 19 * MIB + 512 * KIB][rng.below(4) as usize],
        2 => 1 + rng.below(MIB as u64) as usize,
        3 => MIB + 1 + rng.below(30 * MIB as u64) as usize,
        _ => 512,
    }
}

/// Waits until the event thread filed every block whose stream completed.
fn settle_events(a: &Allocator<Sim>) {
    assert!(
        common::eventually(|| a
            .snapshot()
            .segments
            .iter()
            .all(|s| s.blocks.iter().all(|b| b.state != mempool::BlockState::AwaitingStreams))),
        "the event thread files every completed block"
    );
}

/// Held: the main thread, the one member, with every writer of the retired counters around it
/// (the background event thread filing its device-used frees, a thread whose locals are gone
/// taking turns, threads that exit holding blocks, handed to main, or cached) and resets and
/// `empty_cache` in between: requested bytes and allocation counts, current and peak, exact
/// after every step of main's (the peaks restarted after another thread's turn, as review_census
/// C3 does: turns within a slack are a known gap).
#[test]
fn held_random_solo_with_every_retired_writer() {
    let seeds = std::env::var("R21_SEEDS").ok().and_then(|v| v.parse().ok()).unwrap_or(24u64);
    for seed in 1..=seeds {
        let cache = seed % 2 == 0;
        let conf = format!("pinned_use_background_threads:True,thread_cache:{}", if cache { "True" } else { "False" });
        let (sim, a) = common::pinned_sim(64 << 30, &conf);
        let mut rng = common::Rng(seed * 7919);
        let mut m = common::model::Model::default();
        let mut live: Vec<(Buffer<u8, Sim>, usize)> = Vec::new();
        let s = sim.new_stream();
        let on = a.set_stream(&s).unwrap();
        // Main's cache first, so main is the one member from the start.
        drop(a.alloc::<u8>(512).unwrap());
        let x = LocalsGone::start(&a, rng.below(2) == 0);
        a.reset_peak_stats();
        let held: Held = Default::default();
        let mut theirs: Vec<usize> = Vec::new();
        let mut obs: Option<[i64; 2]> = None;
        for step in 0..250 {
            let op = rng.below(40);
            let what = format!("seed {seed} step {step} op {op}");
            match op {
                0..=1 => {
                    a.reset_peak_stats();
                    m.reset();
                }
                2 => a.empty_cache().unwrap(),
                3..=5 => {
                    sim.complete_all();
                    settle_events(&a);
                }
                6..=7 => {
                    // The thread whose locals are gone takes a turn.
                    let h2 = held.clone();
                    let a2 = a.clone();
                    if theirs.is_empty() || rng.below(2) == 0 {
                        let size = size_of(&mut rng);
                        x.run(move || h2.lock().unwrap().push(a2.alloc::<u8>(size).unwrap()));
                        theirs.push(size);
                        m.add(size, 1);
                    } else {
                        x.run(move || drop(h2.lock().unwrap().pop()));
                        m.add(theirs.pop().unwrap(), -1);
                    }
                    a.reset_peak_stats();
                    m.reset();
                }
                8 => {
                    // A thread allocates, hands some blocks to main, caches or frees the
                    // rest, and exits.
                    let a2 = a.clone();
                    let seed2 = rng.next();
                    let kept: Vec<(Buffer<u8, Sim>, usize)> = std::thread::spawn(move || {
                        let mut r = common::Rng(seed2 | 1);
                        let mut kept = Vec::new();
                        for _ in 0..1 + r.below(6) {
                            let size = size_of(&mut r);
                            let b = a2.alloc::<u8>(size).unwrap();
                            if r.below(2) == 0 {
                                kept.push((b, size));
                            }
                        }
                        kept
                    })
                    .join()
                    .unwrap();
                    for (b, size) in kept {
                        m.add(size, 1);
                        live.push((b, size));
                    }
                    if rng.below(2) == 0 {
                        a.empty_cache().unwrap();
                    }
                    a.reset_peak_stats();
                    m.reset();
                }
                9..=24 => {
                    let size = size_of(&mut rng);
                    live.push((a.alloc::<u8>(size).unwrap(), size));
                    m.add(size, 1);
                }
                _ => {
                    if live.is_empty() {
                        continue;
                    }
                    let (b, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
                    if rng.below(2) == 0 {
                        let _ = b.device_ptr_raw(); // its free waits for stream `s`
                    }
                    drop(b);
                    m.add(size, -1);
                }
            }
            m.check(&a, &what);
            // Allocated and active bytes: each step of main's moves them one way, so their
            // peak since the last reset is the largest value read after a step.
            let st = a.memory_stats();
            let now = [st.allocated_bytes.all.current, st.active_bytes.all.current];
            if obs.is_none() || matches!(op, 0..=1 | 6..=8) {
                obs = Some(now);
            }
            let o = obs.as_mut().unwrap();
            for k in 0..2 {
                o[k] = o[k].max(now[k]);
            }
            let peaks = [st.allocated_bytes.all.peak, st.active_bytes.all.peak];
            assert_eq!(peaks, *o, "allocated / active bytes peaks, {what}");
        }
        drop(live);
        let h2 = held.clone();
        x.run(move || h2.lock().unwrap().clear());
        drop(x);
        drop(on);
        sim.complete_all();
        settle_events(&a);
        check_invariants(&a, Some(&sim));
    }
}
