//! Hostile use of allocation stacks (`record_stacks`): concurrent toggling while allocating,
//! stale stacks of reused blocks, leaks across epochs, user pools and expandable segments, the
//! out-of-memory report's cost. Stack mode, history and hooks are process-wide: every probe
//! takes `SERIAL` (and restores the mode, history and hooks it changed).
//!
//! Probes marked `Found by review` failed before their fixes.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mempool::sim::SimDevice;
use mempool::stacks::{self, StackMode};
use mempool::trace::{self, Action};
use mempool::{Allocator, BlockState, Buffer, Config, Error, MemPool, PoolOptions, Sim};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    let g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    mempool::record_stacks(StackMode::None);
    mempool::record_history(0);
    g
}

#[inline(never)]
fn site_one(a: &Allocator<Sim>, n: usize) -> Buffer<u8, Sim> {
    std::hint::black_box(a.alloc::<u8>(n).unwrap())
}

#[inline(never)]
fn site_two(a: &Allocator<Sim>, n: usize) -> Buffer<u8, Sim> {
    std::hint::black_box(a.alloc::<u8>(n).unwrap())
}

#[inline(never)]
fn pool_site(p: &MemPool<Sim>, n: usize) -> Buffer<u8, Sim> {
    std::hint::black_box(p.alloc::<u8>(n).unwrap())
}

fn block_stack(a: &Allocator<Sim>, addr: u64) -> u32 {
    let snap = a.snapshot();
    let b = snap.segments.iter().flat_map(|s| &s.blocks).find(|b| b.address == addr).expect("block");
    assert_eq!(b.state, BlockState::Allocated);
    b.stack
}

fn names(id: u32) -> String {
    stacks::frames(id).iter().map(|f| f.name.clone()).collect::<Vec<_>>().join(" | ")
}

// Found by review (fixed): a block allocated while nothing listened (no stacks, history or hook: no `emit`, so its
// `stack` field is not reset) keeps the stack id of the block's *previous* allocation; when
// stacks and history are turned on again and it is freed, its `free_requested` /
// `free_completed` events (hooks, history, the snapshot pickle's trace) carry that stale id and
// name the previous allocation's site. Snapshots' blocks and the OOM report filter ids with
// `stacks::current`; `State::emit` (caching/state.rs) does not for frees (nor does
// `free_cached`'s emit of a block cached before the hook).
#[test]
fn free_events_do_not_carry_a_previous_allocations_stack() {
    let _g = serial();
    let a = Allocator::sim(SimDevice::new(64 << 20));
    mempool::record_stacks(StackMode::Full);
    mempool::record_history(1000);
    let first = site_one(&a, 3 << 20);
    let addr = first.device_ptr_raw();
    let id_one = block_stack(&a, addr);
    assert!(names(id_one).contains("site_one"), "{}", names(id_one));
    drop(first);
    // Nothing listens: the same block (best fit, same size) is handed out at another site.
    mempool::record_stacks(StackMode::None);
    mempool::record_history(0);
    let second = site_two(&a, 3 << 20);
    assert_eq!(second.device_ptr_raw(), addr, "the same block again");
    // Listening again: the block's free is traced.
    mempool::record_stacks(StackMode::Full);
    mempool::record_history(1000);
    assert_eq!(block_stack(&a, addr), 0, "allocated while off: no stack in the snapshot (held)");
    drop(second);
    let frees: Vec<_> = trace::history(Some(a.id()))
        .into_iter()
        .filter(|e| e.addr == addr && matches!(e.action, Action::FreeRequested | Action::FreeCompleted))
        .collect();
    assert!(!frees.is_empty());
    mempool::record_stacks(StackMode::None);
    mempool::record_history(0);
    for e in frees {
        assert!(
            e.stack == 0 || !names(e.stack).contains("site_one"),
            "the free of the block allocated at site_two names site_one: {:?} stack {} = {:?}",
            e.action,
            e.stack,
            stacks::site(e.stack)
        );
    }
}

// Found by review (fixed; a leak): turning recording off and on clears the interning index but keeps every stack
// ever recorded (`Table::stacks` only grows): the same call site re-interns as a new id in each
// epoch, so a program that toggles stacks (e.g. per training step, or per snapshot) grows the
// table by one copy of each of its stacks (~96 return addresses) per toggle, forever.
// stacks.rs `record_stacks` / `capture`.
#[test]
fn toggling_stacks_does_not_grow_the_stack_table_without_bound() {
    let _g = serial();
    let a = Allocator::sim(SimDevice::new(64 << 20));
    let last = Arc::new(AtomicU64::new(0));
    let l2 = last.clone();
    let id = a.id();
    let hook = trace::attach(move |e| {
        if e.allocator == id && e.action == Action::Alloc {
            l2.store(e.stack as u64, Ordering::Relaxed);
        }
    })
    .unwrap();
    let mut ids = Vec::new();
    for _ in 0..2000 {
        mempool::record_stacks(StackMode::Sites);
        drop(site_one(&a, 4096));
        ids.push(last.load(Ordering::Relaxed));
        mempool::record_stacks(StackMode::None);
    }
    drop(hook);
    let distinct: std::collections::BTreeSet<u64> = ids.iter().copied().collect();
    assert!(
        distinct.len() < 50,
        "one call site interned as {} distinct stacks over 2000 off/on toggles (ids {}..{})",
        distinct.len(),
        ids[0],
        ids[ids.len() - 1]
    );
}

/// A block freed while nothing listens goes to the thread cache; one freed while something
/// listens goes straight back to the shared sets. Whether caching is on for this thread now
/// (i.e. `trace::enabled()` is false), seen through a hook: a cached block's free is reported
/// when a snapshot drains the caches.
fn caching_is_on(a: &Allocator<Sim>) -> bool {
    let b = a.alloc::<u8>(8192).unwrap();
    let addr = b.device_ptr_raw();
    drop(b);
    let seen = Arc::new(AtomicBool::new(false));
    let s2 = seen.clone();
    let hook = trace::attach(move |e| {
        if e.addr == addr && e.action == Action::FreeCompleted {
            s2.store(true, Ordering::Relaxed);
        }
    })
    .unwrap();
    let _ = a.snapshot();
    drop(hook);
    seen.load(Ordering::Relaxed)
}

#[test]
fn toggling_from_many_threads_while_allocating_leaves_a_consistent_state() {
    let _g = serial();
    let a = Allocator::sim(SimDevice::new(1 << 30));
    assert!(caching_is_on(&a), "nothing listens at the start");
    let stop = Arc::new(AtomicBool::new(false));
    let mut hs = Vec::new();
    for t in 0..4 {
        let a = a.clone();
        let stop = stop.clone();
        hs.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let b = if t % 2 == 0 { site_one(&a, 4096 + t * 512) } else { site_two(&a, 1 << 20) };
                drop(b);
                n += 1;
            }
            n
        }));
    }
    let mut ts = Vec::new();
    for t in 0..4 {
        ts.push(std::thread::spawn(move || {
            for i in 0..20_000u32 {
                let m = match (i + t) % 3 {
                    0 => StackMode::None,
                    1 => StackMode::Sites,
                    _ => StackMode::Full,
                };
                mempool::record_stacks(m);
            }
        }));
    }
    for t in ts {
        t.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let allocs: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(allocs > 0);
    // Off: caches on again (the listener count is back to zero, not stuck above it).
    mempool::record_stacks(StackMode::None);
    assert!(caching_is_on(&a), "trace::enabled() stuck true after concurrent toggles");
    // On: stacks recorded (the count is not stuck at zero either).
    mempool::record_stacks(StackMode::Sites);
    let b = site_one(&a, 5 << 20);
    let id = block_stack(&a, b.device_ptr_raw());
    assert!(id != 0 && stacks::site(id).unwrap().contains("site_one"), "{id}");
    assert!(!caching_is_on(&a), "stacks on: the caches stand aside");
    mempool::record_stacks(StackMode::None);
    drop(b);
    // The allocator's books balance.
    let s = a.memory_stats();
    assert_eq!((s.allocation.all.current, s.allocated_bytes.all.current), (0, 0));
}

#[test]
fn blocks_reused_from_thread_caches_show_no_stale_stack() {
    let _g = serial();
    let a = Allocator::sim(SimDevice::new(64 << 20));
    mempool::record_stacks(StackMode::Sites);
    let b = site_one(&a, 8192);
    let addr = b.device_ptr_raw();
    assert!(stacks::site(block_stack(&a, addr)).unwrap().contains("site_one"));
    mempool::record_stacks(StackMode::None);
    drop(b); // into this thread's cache
    let c = site_two(&a, 8192); // from it, no capture
    assert_eq!(c.device_ptr_raw(), addr, "the cached block");
    mempool::record_stacks(StackMode::Sites);
    assert_eq!(block_stack(&a, addr), 0, "stale stack shown for a block reused from a thread cache");
    // OOM report: no stale site either.
    let e = a.alloc::<u8>(1 << 30).unwrap_err();
    let Error::OutOfMemory(r) = &e else { panic!("{e}") };
    assert!(r.sites.iter().all(|(s, _)| !s.contains("site_one")), "{:?}", r.sites);
    mempool::record_stacks(StackMode::None);
    drop(c);
}

#[test]
fn stacks_of_user_pools_and_expandable_segments() {
    let _g = serial();
    // User pool.
    let a = Allocator::sim(SimDevice::new(256 << 20));
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    mempool::record_stacks(StackMode::Full);
    let p = pool_site(&pool, 3 << 20);
    let id = block_stack(&a, p.device_ptr_raw());
    assert!(id != 0 && names(id).contains("pool_site"), "user pool: {}", names(id));
    // Expandable segments.
    let cfg = Config::builder().expandable_segments(true).build().unwrap();
    let e = Allocator::sim_with(SimDevice::new(256 << 20), cfg);
    let bufs: Vec<_> = (0..5).map(|i| if i % 2 == 0 { site_one(&e, 7 << 20) } else { site_two(&e, 3 << 20) }).collect();
    let snap = e.snapshot();
    for (i, b) in bufs.iter().enumerate() {
        let blk = snap.segments.iter().flat_map(|s| &s.blocks).find(|x| x.address == b.device_ptr_raw()).unwrap();
        let want = if i % 2 == 0 { "site_one" } else { "site_two" };
        assert!(
            stacks::site(blk.stack).is_some_and(|s| s.contains(want)),
            "expandable block {i}: {:?}",
            stacks::site(blk.stack)
        );
    }
    // The pickle names them (frames of blocks and of the trace's allocs).
    let pk = snap.to_pickle();
    let hay = String::from_utf8_lossy(&pk);
    assert!(hay.contains("site_one") && hay.contains("site_two"));
    // OOM in the user pool: sites named.
    let err = pool.alloc::<u8>(1 << 30).unwrap_err();
    let Error::OutOfMemory(r) = &err else { panic!("{err}") };
    assert!(r.sites.iter().any(|(s, _)| s.contains("pool_site")), "{:?}", r.sites);
    // frames/site of ids never handed out.
    assert!(stacks::frames(0).is_empty() && stacks::frames(u32::MAX).is_empty());
    assert!(stacks::site(u32::MAX).is_none());
    mempool::record_stacks(StackMode::None);
    drop((p, bufs));
}

#[inline(never)]
fn deep(a: &Allocator<Sim>, depth: usize, out: &mut Vec<Buffer<u8, Sim>>) {
    if depth == 0 {
        out.push(site_one(a, 64 << 10));
    } else {
        deep(a, depth - 1, out);
        std::hint::black_box(depth);
    }
}

// Found by review (fixed): the out-of-memory report resolves symbols (`stacks::site` → `backtrace::resolve`, every
// address of up to 64 stacks, whatever the mode) inside `State::oom`, i.e. under the
// allocator's lock: the first OOM with stacks on stalls every other thread of that allocator
// for as long as symbolication takes (loading the binary's debug info: here well over the
// bound below). caching/segments.rs `top_sites`, called from `oom` (the comment there says
// only the summing is under the lock).
// (Run in a fresh child process: symbols resolved by an earlier probe would hide the cost.)
#[test]
fn the_oom_report_does_not_hold_the_allocators_lock_while_resolving_symbols() {
    if std::env::var_os("STACKS_ATTACKS_CHILD").is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "the_oom_report_does_not_hold_the_allocators_lock_while_resolving_symbols",
                "--nocapture",
            ])
            .env("STACKS_ATTACKS_CHILD", "1")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let line = text.lines().find(|l| l.contains("waited") || l.contains("OOM report took")).unwrap_or("");
        assert!(out.status.success(), "in a fresh process: {line}");
        return;
    }
    let _g = serial();
    let a = Allocator::sim(SimDevice::new(256 << 20));
    mempool::record_stacks(StackMode::Full);
    // 80 distinct stacks (recursion depths), each holding a block.
    let mut held = Vec::new();
    for d in 0..80 {
        deep(&a, d, &mut held);
    }
    // Another thread allocates and frees in a loop, timing each call.
    let stop = Arc::new(AtomicBool::new(false));
    let worst = Arc::new(AtomicU64::new(0));
    let (a2, s2, w2) = (a.clone(), stop.clone(), worst.clone());
    let ready = Arc::new(AtomicBool::new(false));
    let r2 = ready.clone();
    let h = std::thread::spawn(move || {
        while !s2.load(Ordering::Relaxed) {
            let t = Instant::now();
            drop(a2.alloc::<u8>(4096).unwrap());
            w2.fetch_max(t.elapsed().as_micros() as u64, Ordering::Relaxed);
            r2.store(true, Ordering::Relaxed);
        }
    });
    while !ready.load(Ordering::Relaxed) {
        std::thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(50));
    worst.store(0, Ordering::Relaxed);
    let t = Instant::now();
    let e = a.alloc::<u8>(1 << 30).unwrap_err();
    let oom_took = t.elapsed();
    std::thread::sleep(Duration::from_millis(20));
    stop.store(true, Ordering::Relaxed);
    h.join().unwrap();
    let Error::OutOfMemory(r) = &e else { panic!("{e}") };
    assert!(r.sites.iter().any(|(s, _)| s.contains("site_one")), "{:?}", r.sites);
    mempool::record_stacks(StackMode::None);
    let worst = Duration::from_micros(worst.load(Ordering::Relaxed));
    eprintln!("OOM report took {oom_took:?}; worst concurrent alloc {worst:?}");
    assert!(worst < Duration::from_millis(100), "another thread's alloc waited {worst:?} (the OOM took {oom_took:?})");
    drop(held);
}

/// A user function exported under a C name (an FFI entry point, a callback).
#[no_mangle]
#[inline(never)]
extern "C" fn rust_entry_point(a: *const std::ffi::c_void) -> usize {
    // SAFETY: the caller passes a live `Allocator<Sim>`.
    let a = unsafe { &*(a as *const Allocator<Sim>) };
    let b = std::hint::black_box(a.alloc::<u8>(3 << 20).unwrap());
    let id = block_stack(a, b.device_ptr_raw());
    drop(b);
    id as usize
}

// Found by review (fixed; minor): `stacks::machinery` treats every frame whose name starts with `rust_` as
// mempool's or the runtime's own (meant for `rust_begin_unwind` and the like): a user function
// so named (an exported `#[no_mangle]` entry point, or any function of a crate named
// `rust_something`, whose paths start `rust_something::`) is skipped, and the site names its
// caller instead. stacks.rs `machinery`.
#[test]
fn a_user_function_named_rust_something_is_a_site() {
    let _g = serial();
    let a = Allocator::sim(SimDevice::new(64 << 20));
    mempool::record_stacks(StackMode::Sites);
    let id = rust_entry_point(&a as *const Allocator<Sim> as *const std::ffi::c_void) as u32;
    let site = stacks::site(id);
    mempool::record_stacks(StackMode::None);
    assert!(site.as_deref().is_some_and(|s| s.contains("rust_entry_point")), "site: {site:?}");
}
