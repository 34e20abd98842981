//! Second adversarial review: attacks on the fixes of the first one (`attacks.rs`) and on what is
//! new since (the outbox and its `RUNNING` list, free-set retirement, `free_failed`, the
//! allocator's `Drop`, `Counting`, `MemPool::on`'s granularities, the size limits), through the
//! safe API on the simulated and host backends.
//!
//! Tests named `held_*` are attacks that did not get through. Every other test states what the
//! crate promises and failed when the review wrote it (a finding, fixed since: RELIABILITY.md);
//! its doc comment says what happened, why, and where.
//!
//! Hangs are caught by [`within`] (a watchdog thread); panics by `catch_unwind`.
//!
//! Run: `cargo test -p cuda-mempool --test attacks2`.

mod common;

use common::watch::{panic_text, sim, wait_for, within};

use std::cell::RefCell;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mempool::backend::host::HostBackend;
use mempool::sim::SimDevice;
use mempool::trace::{self, Action};
use mempool::{
    Allocator, BackendError, Buffer, Config, Counting, Error, MemPool, PoolOptions, RawAllocator, Sim, StreamId,
};

const MIB: usize = 1 << 20;

// ------------------------------------------------------------------------------------------
// Harness
// ------------------------------------------------------------------------------------------

/// 4 KiB allocated with `s` current.
fn alloc_on(a: &Allocator<Sim>, s: &mempool::sim::SimStream) -> Buffer<u8, Sim> {
    let _g = a.set_stream(s).unwrap();
    a.alloc::<u8>(4096).unwrap()
}

/// The stream of the segment that holds `addr`, from a snapshot.
fn segment_stream(a: &Allocator<Sim>, addr: u64) -> StreamId {
    a.snapshot()
        .segments
        .iter()
        .find(|s| s.address <= addr && addr < s.address + s.total_size as u64)
        .map(|s| s.stream)
        .expect("a segment holds the address")
}

const USER_BASE: u64 = 0x7000_0000_0000;

/// A pool allocator over made-up addresses (sim allocators never touch memory): each range is
/// distinct from every live one, 2 MiB aligned, handed out again only after it was given back.
#[derive(Clone, Default)]
struct Ledger {
    st: Arc<Mutex<LedgerState>>,
}

#[derive(Default)]
struct LedgerState {
    next: u64,
    live: Vec<(u64, usize)>,
    foreign_frees: Vec<u64>,
    /// `free` refuses (and keeps the range) this many more times.
    refuse_frees: usize,
}

impl Ledger {
    fn with_base(base: u64) -> Ledger {
        let l = Ledger::default();
        l.state().next = base;
        l
    }
    fn state(&self) -> std::sync::MutexGuard<'_, LedgerState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }
}

// SAFETY: addresses only (used with simulated allocators, which never read or write memory):
// each range it hands out is distinct from every live one, and a refused `free` keeps the range.
unsafe impl RawAllocator for Ledger {
    fn name(&self) -> &str {
        "ledger"
    }
    fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        let mut s = self.state();
        if s.next == 0 {
            s.next = USER_BASE;
        }
        let addr = s.next;
        s.next += (size as u64).next_multiple_of(2 * MIB as u64);
        s.live.push((addr, size));
        Ok(addr)
    }
    unsafe fn free(&self, ptr: u64, size: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        let mut s = self.state();
        if s.refuse_frees > 0 {
            s.refuse_frees -= 1;
            return Err(BackendError::Failed("free refused".into()));
        }
        match s.live.iter().position(|l| *l == (ptr, size)) {
            Some(i) => {
                s.live.remove(i);
            }
            None => s.foreign_frees.push(ptr),
        }
        Ok(())
    }
}

/// What a [`Scripted`] allocator does on one call of `alloc`: runs (any safe code: what another
/// thread could do while the allocator's lock is let go), then answers, or lets the ledger answer.
type Step = Box<dyn FnOnce() -> Option<Result<u64, BackendError>> + Send>;

/// A ledger whose `alloc` calls follow a script, by call number (0 = the first call).
#[derive(Clone, Default)]
struct Scripted {
    inner: Ledger,
    calls: Arc<AtomicUsize>,
    script: Arc<Mutex<HashMap<usize, Step>>>,
}

impl Scripted {
    fn on_call(&self, n: usize, step: Step) {
        self.script.lock().unwrap().insert(n, step);
    }
}

fn out_of_memory() -> Step {
    Box::new(|| Some(Err(BackendError::OutOfMemory)))
}

// SAFETY: forwards to `Ledger`; a scripted answer is an error, never an address.
unsafe impl RawAllocator for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }
    fn alloc(&self, size: usize, d: usize, s: StreamId) -> Result<u64, BackendError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        // Taken out before it runs: a step may make the allocator call us again.
        let step = self.script.lock().unwrap().remove(&n);
        if let Some(r) = step.and_then(|f| f()) {
            return r;
        }
        self.inner.alloc(size, d, s)
    }
    unsafe fn free(&self, ptr: u64, size: usize, d: usize, s: StreamId) -> Result<(), BackendError> {
        // SAFETY: forwarded unchanged.
        unsafe { self.inner.free(ptr, size, d, s) }
    }
}

// ------------------------------------------------------------------------------------------
// Findings: undefined behaviour (CUDA) through a free set retired twice
// ------------------------------------------------------------------------------------------

/// Claim (RELIABILITY, retired free sets): "a set whose last segment goes is retired and reused";
/// free sets are per (pool, stream), so a block cached for one stream is never handed to another
/// without an event.
///
/// `grow`'s out-of-memory exit retires `set`, the set it looked up at the top of the loop, if it
/// has no segment (`caching/mod.rs`, `if st.set_segments[set.0 as usize] == 0 { st.retire_set(set) }`).
/// But the lock was let go for the segment source's `alloc` in between: if meanwhile the set's
/// last segment went back (another thread dropped its buffer and emptied the pool's cache; here
/// the pool allocator does it, which is the same), `release_segment` already retired it. It is
/// then pushed onto `idle_sets` a second time (`retire_set` does not check). The next two
/// `(pool, stream)` keys that need a set get the *same* set: blocks cached for stream `s1` are
/// handed to requests on stream `s2` with no event in between. On CUDA that is a data race (the
/// block is reused by `s2` while `s1`'s kernels may still use it); the buffer's `DeviceSlice::stream`
/// (from the segment's keep-alive) also names `s1`, not the stream it was allocated for.
#[test]
fn a_free_set_retired_twice_serves_two_streams() {
    let (dev, a) = sim(1 << 30);
    let script = Scripted::default();
    let pool = MemPool::on(&a, PoolOptions::new().allocator(script.clone())).unwrap();
    // Call 0: a 30 MiB segment, all of it one buffer (the set of (pool, default stream, large)).
    let held = Arc::new(Mutex::new(Some(pool.alloc::<u8>(30 * MIB).unwrap())));
    // A 40 MiB request misses that set. Call 1 (its first try): out of memory. Call 2 (the try
    // after the cache was given back): meanwhile the 30 MiB buffer is dropped and the pool's cache
    // emptied, so its set loses its last segment and is retired; still out of memory.
    script.on_call(1, out_of_memory());
    let (h, p) = (held.clone(), pool.clone());
    script.on_call(
        2,
        Box::new(move || {
            drop(h.lock().unwrap().take());
            p.empty_cache().unwrap();
            Some(Err(BackendError::OutOfMemory))
        }),
    );
    assert!(matches!(pool.alloc::<u8>(40 * MIB), Err(Error::OutOfMemory(_))));

    // Two new streams, each allocating for the first time (each needs a new set).
    let (s1, s2) = (dev.new_stream(), dev.new_stream());
    let x1 = alloc_on(&a, &s1);
    let x1_addr = x1.device_ptr_raw();
    drop(x1); // free on s1: reusable by s1 at once, by other streams only through events
    let x2 = alloc_on(&a, &s2);
    assert_eq!(x2.stream_id(), s2.id);
    let seg = segment_stream(&a, x2.device_ptr_raw());
    assert!(
        seg == s2.id && x2.device_ptr_raw() != x1_addr,
        "UB on CUDA: a request on stream {:?} got {:#x} (s1's block freed just before: {:#x}) from a \
         segment of stream {seg:?}: both streams were given the same retired-twice free set",
        s2.id,
        x2.device_ptr_raw(),
        x1_addr
    );
}

/// The double retirement of `a_free_set_retired_twice_serves_two_streams` needs no user code:
/// two threads that run out of memory at once on one stream of the default pools (the device's
/// own segments) both retire the set they both looked up before the lock was let go for
/// `alloc_segment`. A race: tried for up to 30,000 rounds (it showed within 40 to 1,000 rounds on
/// two shared cores); each round then asks two fresh streams for a block and checks they did
/// not get one set.
#[test]
fn two_threads_out_of_memory_on_one_stream_retire_its_set_twice() {
    within(300, "OOM race", || {
        for round in 0..30_000 {
            let (dev, a) = sim(0);
            let s = dev.new_stream();
            let barrier = Arc::new(std::sync::Barrier::new(2));
            let ts: Vec<_> = (0..2)
                .map(|_| {
                    let (a, b) = (a.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        let _g = a.set_stream(&s).unwrap();
                        b.wait();
                        assert!(matches!(a.alloc::<u8>(30 * MIB), Err(Error::OutOfMemory(_))));
                    })
                })
                .collect();
            for t in ts {
                t.join().unwrap();
            }
            dev.set_capacity(1 << 30);
            let (s1, s2) = (dev.new_stream(), dev.new_stream());
            let x1 = alloc_on(&a, &s1);
            let x2 = alloc_on(&a, &s2);
            let seg = segment_stream(&a, x2.device_ptr_raw());
            assert_eq!(
                seg, s2.id,
                "round {round}: two threads' OOM on one stream retired its set twice; a block for stream \
                 {:?} came from a segment of stream {:?}",
                s2.id, s1.id
            );
            drop((x1, x2));
        }
    });
}

/// The same double retirement from `retire_pool_if_empty`: the pool of the request is released
/// (its last handle dropped: a forgotten scope still routes to it) while its allocator is inside
/// `alloc`, the second try. Retiring the pool retires its sets; the out-of-memory exit then
/// retires the request's set again. And since the pool's slot was taken over meanwhile by a new
/// pool, the out-of-memory exit charges the *new* pool: `st.oom(be, req.size, slot)` with the
/// `slot` of the top of the loop counts `num_ooms` on the newcomer, delivers an `Oom` trace
/// entry with its id, and the error's report names it and its allocator (`pool: Some((q, ..))`),
/// a pool this request never used. (The success path in the same situation notices that the
/// pool is gone and falls back to the default pools; this path does not.)
#[test]
fn a_pool_replaced_during_its_failing_alloc_is_blamed_for_the_oom() {
    let (dev, a) = sim(1 << 30);
    let script = Scripted::default();
    let victim: Arc<Mutex<Option<MemPool<Sim>>>> = Arc::new(Mutex::new(None));
    let replacement: Arc<Mutex<Option<MemPool<Sim>>>> = Arc::new(Mutex::new(None));
    let other = Ledger::with_base(USER_BASE + (1 << 40));
    script.on_call(0, out_of_memory());
    let (v, r, a2, o) = (victim.clone(), replacement.clone(), a.clone(), other.clone());
    script.on_call(
        1,
        Box::new(move || {
            drop(v.lock().unwrap().take()); // the last handle: released, retired (no segment)
            *r.lock().unwrap() = Some(MemPool::on(&a2, PoolOptions::new().allocator(o)).unwrap());
            Some(Err(BackendError::OutOfMemory))
        }),
    );
    let pool = MemPool::on(&a, PoolOptions::new().allocator(script.clone())).unwrap();
    let pool_id = pool.id();
    std::mem::forget(pool.scope());
    *victim.lock().unwrap() = Some(pool);
    let res = a.alloc::<u8>(100);
    let q = replacement.lock().unwrap().take().unwrap();
    let mut wrong = Vec::new();
    if q.memory_stats().num_ooms != 0 {
        wrong.push(format!("the new pool {} counts {} OOM(s) it never had", q.id().0, q.memory_stats().num_ooms));
    }
    if let Err(Error::OutOfMemory(rep)) = &res {
        if rep.pool.as_ref().map(|p| p.0) == Some(q.id().0) {
            wrong.push(format!(
                "the error blames pool {} (`{}`), not the released pool {} the request was routed to",
                q.id().0,
                rep.pool.as_ref().unwrap().1,
                pool_id.0
            ));
        }
    }
    // And the request's set went onto the idle list twice: two new streams share it.
    let (s1, s2) = (dev.new_stream(), dev.new_stream());
    let x1 = alloc_on(&a, &s1);
    let x2 = alloc_on(&a, &s2);
    let seg = segment_stream(&a, x2.device_ptr_raw());
    if seg != s2.id {
        wrong.push(format!("a block for stream {:?} was carved from a segment of stream {seg:?}", s2.id));
    }
    drop((x1, x2));
    assert!(wrong.is_empty(), "{}", wrong.join("; "));
}

// ------------------------------------------------------------------------------------------
// Findings: panics
// ------------------------------------------------------------------------------------------

/// Claim: "allocating from a thread-local destructor ... the thread's context is read with
/// `try_with`" (the first review's fix), and `Buffer`'s drop never panics.
///
/// The outbox's own thread-local, `RUNNING` (`caching/mod.rs`), is read with `.with` in `flush`.
/// It holds a `Vec`, so it has a destructor; once that has run, any call that queued work
/// (a buffer of a released pool dropped: its segment's free; with a hook attached or history
/// recorded: every allocation and free) panics in `flush` ("cannot access a Thread Local Storage
/// value during or after destruction"). Thread-local destructors run in reverse order of first use,
/// so a thread-local of the program's that was set up before this thread first ran an outbox is
/// destroyed after `RUNNING`. Uncaught (as it is in a real destructor), that is an abort
/// ("thread local panicked on drop"); the segment's free also stays queued.
#[test]
fn a_buffer_dropped_by_a_thread_local_destructor_panics_in_flush() {
    struct DropsBuffer(Option<Buffer<u8, Sim>>, Arc<Mutex<Option<Result<(), String>>>>);
    impl Drop for DropsBuffer {
        fn drop(&mut self) {
            let b = self.0.take();
            let r = catch_unwind(AssertUnwindSafe(move || drop(b))).map_err(|p| panic_text(&*p));
            *self.1.lock().unwrap() = Some(r);
        }
    }
    thread_local! {
        static HOLDER: RefCell<Option<DropsBuffer>> = const { RefCell::new(None) };
    }
    let (dev, a) = sim(1 << 30);
    let ledger = Ledger::default();
    let report = Arc::new(Mutex::new(None));
    let (a2, l2, r2) = (a.clone(), ledger.clone(), report.clone());
    std::thread::spawn(move || {
        // The program's thread-local, first used before mempool ran an outbox on this thread.
        HOLDER.with(|h| *h.borrow_mut() = Some(DropsBuffer(None, r2)));
        let p = MemPool::on(&a2, PoolOptions::new().allocator(l2)).unwrap();
        let b = p.alloc::<u8>(100).unwrap();
        HOLDER.with(|h| h.borrow_mut().as_mut().unwrap().0 = Some(b));
        drop(p); // released: its segment goes back when `b` does
                 // Any segment given back on this thread runs the outbox here (first use of `RUNNING`).
        let q = MemPool::on(&a2, PoolOptions::new()).unwrap();
        drop(q.alloc::<u8>(100).unwrap());
        drop(q);
    })
    .join()
    .unwrap();
    let r = report.lock().unwrap().take();
    assert_eq!(r, Some(Ok(())), "dropping a buffer in a thread-local destructor panicked (an abort outside a test)");
    a.empty_cache().unwrap();
    assert!(ledger.state().live.is_empty());
    common::check_invariants(&a, Some(&dev));
}

/// Claim: "every call into user code is wrapped (`catch_unwind` → the pool allocator's error)";
/// a pool allocator's `Arc` is let go outside the lock because its `Drop` is user code.
///
/// `DeviceAllocator::run` does `Work::Drop(x) => drop(x)` with no `catch_unwind`. A pool
/// allocator whose `Drop` panics unwinds out of `flush` in the middle of a batch: the rest of
/// the batch is dropped unrun. Here that batch holds another pool's `SegmentFree` event and
/// `Work::Free`: that segment is never given back (its allocator keeps it; the allocator has
/// forgotten it: not in the cache, not in the outbox, so neither `empty_cache` nor the
/// allocator's `Drop` can return it), its pool never retires (`segments` stays 1), `releasing`
/// stays up (under a memory fraction, that much of the limit is gone for good). The panic
/// itself surfaces from whatever call was running the outbox, here an `alloc` of the default
/// pools, after it had taken its block: that block is allocated for ever with no `Buffer`.
#[test]
fn a_pool_allocator_drop_panicking_in_the_outbox_loses_another_pools_segment() {
    struct PanicsOnDrop(Ledger);
    // SAFETY: forwards to `Ledger`.
    unsafe impl RawAllocator for PanicsOnDrop {
        fn name(&self) -> &str {
            "panics-on-drop"
        }
        fn alloc(&self, size: usize, d: usize, s: StreamId) -> Result<u64, BackendError> {
            self.0.alloc(size, d, s)
        }
        unsafe fn free(&self, ptr: u64, size: usize, d: usize, s: StreamId) -> Result<(), BackendError> {
            // SAFETY: forwarded unchanged.
            unsafe { self.0.free(ptr, size, d, s) }
        }
    }
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            if !std::thread::panicking() {
                panic!("pool allocator's drop panicked");
            }
        }
    }
    let (dev, a) = sim(1 << 30);
    let me = a.id();
    let p1 = MemPool::on(&a, PoolOptions::new().allocator(PanicsOnDrop(Ledger::default()))).unwrap();
    let l2 = Ledger::with_base(USER_BASE + (1 << 40));
    let p2 = MemPool::on(&a, PoolOptions::new().allocator(l2.clone())).unwrap();
    let b2 = p2.alloc::<u8>(100).unwrap();
    drop(p2); // released: its segment goes back with `b2`
    let victims = Arc::new(Mutex::new(Some((p1, b2))));
    let v = victims.clone();
    let hook = trace::attach(move |e| {
        if e.allocator != me || e.action != Action::SegmentAlloc || e.addr >= USER_BASE {
            return;
        }
        let taken = v.lock().unwrap().take();
        if let Some((p1, b2)) = taken {
            drop(p1); // no segment: retired at once, its allocator queued as `Work::Drop`
            drop(b2); // its segment queued as `Work::Free`, after it
        }
    })
    .unwrap();
    let r = catch_unwind(AssertUnwindSafe(|| a.alloc::<u8>(100)));
    drop(hook);
    let mut wrong = Vec::new();
    match r {
        Ok(b) => drop(b),
        Err(p) => wrong.push(format!("`alloc` panicked: {}", panic_text(&*p))),
    }
    a.empty_cache().unwrap();
    if !l2.state().live.is_empty() {
        wrong.push(format!("pool 2's segment was never given back: {:x?}", l2.state().live));
    }
    let alloc_now = a.memory_stats().allocation.all.current;
    if alloc_now != 0 {
        wrong.push(format!("{alloc_now} block(s) still allocated with every buffer dropped"));
    }
    let _ = dev;
    assert!(wrong.is_empty(), "{}", wrong.join("; "));
}

/// A panic payload whose own `Drop` panics (`std::panic::panic_any(Bomb)`).
struct Bomb;
impl Drop for Bomb {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("the panic payload's drop panicked");
        }
    }
}

/// Claim: "a panic in either [pool allocator function] is caught and reported as the pool
/// allocator's error, and the allocator's state stays exact".
///
/// `backend::contain` catches the panic and then drops the payload (end of its `Err(p)` arm);
/// a payload whose `Drop` panics unwinds out of `contain` anyway. In `grow`, that is between
/// `st.growing += size` and `st.growing -= size`: the panic escapes `alloc`, and `growing` stays
/// up for ever, so under a memory fraction that much of the limit is gone (here a 400 MiB request
/// that panicked leaves a 512 MiB limit unable to give 200 MiB). The same in `run(Work::Free)`
/// (the segment being freed is dropped unaccounted: neither freed, by the contract, nor
/// re-cached), `give_back`, `MemPool::on`.
#[test]
fn a_panic_payload_that_panics_on_drop_escapes_the_pool_allocators_containment() {
    struct Throws;
    // SAFETY: never returns an address.
    unsafe impl RawAllocator for Throws {
        fn name(&self) -> &str {
            "throws"
        }
        fn alloc(&self, _: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
            std::panic::panic_any(Bomb)
        }
        unsafe fn free(&self, _: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
            Ok(())
        }
    }
    let dev = SimDevice::new(1 << 30);
    let a = Allocator::sim_with(dev.clone(), Config::builder().memory_fraction(0.5).build().unwrap());
    let pool = MemPool::on(&a, PoolOptions::new().allocator(Throws)).unwrap();
    let mut wrong = Vec::new();
    match catch_unwind(AssertUnwindSafe(|| pool.alloc::<u8>(400 * MIB))) {
        Ok(Err(Error::PoolAllocator { .. })) => {}
        Ok(other) => wrong.push(format!("the pool allocator's panic gave {other:?}")),
        Err(p) => wrong.push(format!("a panic escaped `alloc`: {}", panic_text(&*p))),
    }
    if let Err(e) = a.alloc::<u8>(200 * MIB) {
        wrong.push(format!("200 MiB under a 512 MiB limit with nothing reserved: {e}"));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("; "));
}

/// The payload of a contained panic (a pool allocator's, a hook's) is dropped, not leaked: a
/// program whose pool allocator panics now and then does not lose memory each time.
#[test]
fn contained_panic_payloads_are_dropped_once() {
    static DROPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    struct Counted;
    impl Drop for Counted {
        fn drop(&mut self) {
            DROPS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    struct Throws;
    // SAFETY: never returns an address.
    unsafe impl RawAllocator for Throws {
        fn name(&self) -> &str {
            "throws-counted"
        }
        fn alloc(&self, _: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
            std::panic::panic_any(Counted)
        }
        unsafe fn free(&self, _: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
            Ok(())
        }
    }
    let (dev, a) = sim(1 << 30);
    let pool = MemPool::on(&a, PoolOptions::new().allocator(Throws)).unwrap();
    for i in 1..=3 {
        assert!(matches!(pool.alloc::<u8>(1 << 20), Err(Error::PoolAllocator { .. })));
        assert_eq!(DROPS.load(std::sync::atomic::Ordering::SeqCst), i, "payload {i} dropped once");
    }
    let me = a.id();
    let hook = trace::attach(move |e| {
        if e.allocator == me && e.action == Action::Alloc {
            std::panic::panic_any(Counted);
        }
    })
    .unwrap();
    drop(a.alloc::<u8>(512).unwrap());
    drop(hook);
    assert_eq!(DROPS.load(std::sync::atomic::Ordering::SeqCst), 4, "the hook's payload dropped once");
    let _ = dev;
}

/// Trace hooks: "a panicking callback must not unwind into the allocator ... the panic is
/// contained here" (`trace::deliver`: `let _ = catch_unwind(..)`). The caught payload is dropped
/// right there; if its `Drop` panics, that panic unwinds out of `deliver`, out of `flush`, and
/// the rest of the batch is dropped unrun. A hook that throws such a payload on a pool's
/// `SegmentFree` loses the `Work::Free` queued right after it: the pool allocator never gets its
/// segment back, and nothing in the allocator remembers it (the pool never retires).
#[test]
fn a_hook_panic_payload_that_panics_on_drop_loses_the_segment_free_after_it() {
    let (dev, a) = sim(1 << 30);
    let me = a.id();
    let ledger = Ledger::default();
    let pool = MemPool::on(&a, PoolOptions::new().allocator(ledger.clone())).unwrap();
    drop(pool.alloc::<u8>(100).unwrap());
    let hook = trace::attach(move |e| {
        if e.allocator == me && e.action == Action::SegmentFree && e.addr >= USER_BASE {
            std::panic::panic_any(Bomb);
        }
    })
    .unwrap();
    let r = catch_unwind(AssertUnwindSafe(|| pool.empty_cache()));
    drop(hook);
    let mut wrong = Vec::new();
    if let Err(p) = r {
        wrong.push(format!("a panic escaped `empty_cache`: {}", panic_text(&*p)));
    }
    drop(pool);
    a.empty_cache().unwrap();
    if !ledger.state().live.is_empty() {
        wrong.push(format!("the pool's segment was never given back: {:x?}", ledger.state().live));
    }
    let _ = dev;
    assert!(wrong.is_empty(), "{}", wrong.join("; "));
}

// ------------------------------------------------------------------------------------------
// Findings: hangs (unbounded waits)
// ------------------------------------------------------------------------------------------

/// Claim: "no thread waits for another thread's outbox more than 200 ms"; hook events are
/// delivered "right after the call that made them".
///
/// The thread that holds the outbox mutex loops `take → run` until it finds the outbox empty
/// (`flush`, the inner `loop`), and other threads never wait (`flush(false)` returns at once
/// on `WouldBlock`, leaving their events to it). So once a thread has started delivering, it
/// delivers every other thread's events too, for as long as they keep coming faster than the
/// hooks take: one `alloc` call here does not return for as long as three other threads keep
/// allocating (a slow hook: 50 µs per event; the queue meanwhile grows without bound).
#[test]
fn one_call_delivers_other_threads_events_for_as_long_as_they_allocate() {
    within(120, "outbox runner", || {
        let (_, a) = sim(1 << 30);
        let me = a.id();
        let producing = Arc::new(AtomicBool::new(false));
        let runner_in_hook = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let runner: Arc<Mutex<Option<std::thread::ThreadId>>> = Arc::new(Mutex::new(None));
        let hook = trace::attach({
            let (producing, runner_in_hook, go, runner) =
                (producing.clone(), runner_in_hook.clone(), go.clone(), runner.clone());
            move |e| {
                if e.allocator != me {
                    return;
                }
                if e.action == Action::SegmentAlloc && !runner_in_hook.swap(true, Ordering::SeqCst) {
                    *runner.lock().unwrap() = Some(std::thread::current().id());
                    wait_for(&go, 20);
                    return;
                }
                // A hook that takes a little time (a log line, a registration).
                if producing.load(Ordering::SeqCst) && *runner.lock().unwrap() == Some(std::thread::current().id()) {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        })
        .unwrap();
        let a1 = a.clone();
        let t1 = std::thread::spawn(move || {
            let t0 = Instant::now();
            let b = a1.alloc::<u8>(100).unwrap();
            (t0.elapsed(), b)
        });
        assert!(wait_for(&runner_in_hook, 20));
        producing.store(true, Ordering::SeqCst);
        let stop_at = Instant::now() + Duration::from_secs(3);
        let producers: Vec<_> = (0..3)
            .map(|_| {
                let a = a.clone();
                std::thread::spawn(move || {
                    while Instant::now() < stop_at {
                        drop(a.alloc::<u8>(1000).unwrap());
                        std::thread::sleep(Duration::from_micros(20));
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        go.store(true, Ordering::SeqCst);
        for p in producers {
            p.join().unwrap();
        }
        producing.store(false, Ordering::SeqCst);
        let (took, b) = t1.join().unwrap();
        drop(b);
        drop(hook);
        assert!(
            took < Duration::from_millis(1500),
            "one `alloc` call took {took:?}: it delivered the other threads' events until they stopped"
        );
    });
}

// ------------------------------------------------------------------------------------------
// Findings: wrong statistics, wrong errors
// ------------------------------------------------------------------------------------------

/// `free_failed` puts the segment back with `insert_segment(.., fresh = false)`, which counts it
/// in `segment` and `reserved_bytes` as a new segment (`Stat::allocated` += 1, `segment.peak`
/// may rise) though no device call was made; `num_device_free` is decremented back instead. So
/// after one refused free, `segment.all.allocated` (PyTorch: "segment allocations") no longer
/// equals `num_device_alloc`, nor the device's own count, and `segment.freed` counts a free that
/// did not happen. The pool's `segment` stat likewise.
#[test]
fn a_refused_free_counts_a_segment_allocation_that_never_happened() {
    let (dev, a) = sim(1 << 30);
    let ledger = Ledger::default();
    let pool = MemPool::on(&a, PoolOptions::new().allocator(ledger.clone())).unwrap();
    drop(pool.alloc::<u8>(100).unwrap());
    ledger.state().refuse_frees = 1;
    assert!(pool.empty_cache().is_err());
    common::check_invariants(&a, Some(&dev));
    common::check_pool(&pool);
    let s = a.memory_stats();
    let p = pool.memory_stats();
    assert_eq!(ledger.state().live.len(), 1);
    assert_eq!((s.num_device_alloc, s.num_device_free), (1, 0));
    assert_eq!(
        (s.segment.all.allocated, s.segment.all.freed, p.segment.allocated, p.segment.freed),
        (1, 0, 1, 0),
        "segment allocated/freed totals (device, pool) after one refused free; device calls: 1 alloc, 0 frees"
    );
}

/// `Counting`'s contract: `failed_frees` counts "free calls that failed (the segment was not
/// given back)", `failed_allocs` "alloc calls that failed". A panic is a failure by
/// `RawAllocator`'s contract ("a `free` which returns `Err` (or panics) did not give it back"),
/// and mempool contains it; but `Counting` forwards without `catch_unwind`, so a panicking call
/// is counted nowhere: the counts say nothing was tried.
#[test]
fn counting_misses_calls_that_panic() {
    struct Panicky;
    // SAFETY: never returns an address.
    unsafe impl RawAllocator for Panicky {
        fn name(&self) -> &str {
            "panicky"
        }
        fn alloc(&self, _: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
            panic!("alloc panicked")
        }
        unsafe fn free(&self, _: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
            panic!("free panicked")
        }
    }
    let (_, a) = sim(1 << 30);
    let counted = Counting::new(Panicky);
    let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(counted.clone())).unwrap();
    assert!(matches!(pool.alloc::<u8>(100), Err(Error::PoolAllocator { .. })));
    assert_eq!(counted.counts().failed_allocs, 1, "a panicking alloc is a failed alloc");
}

/// Found: once mempool's thread-local is gone (code in another thread-local's `Drop`),
/// `set_stream` returned `Ok(guard)` and scopes were accepted, and both were silently ignored.
/// Now `set_stream` and `scope_on` say so (`Error::ThreadExiting`); allocations there still work,
/// on the default stream and pools.
#[test]
fn stream_and_pool_settings_in_a_thread_local_destructor_are_refused() {
    type Seen = Arc<Mutex<Option<(bool, bool, bool)>>>;
    struct Late(Allocator<Sim>, mempool::sim::SimStream, MemPool<Sim>, Seen);
    impl Drop for Late {
        fn drop(&mut self) {
            let set = matches!(self.0.set_stream(&self.1), Err(Error::ThreadExiting { .. }));
            let scoped = matches!(self.2.scope_on(&self.1), Err(Error::ThreadExiting { .. }));
            let allocated = self.0.alloc::<u8>(100).is_ok();
            *self.3.lock().unwrap() = Some((set, scoped, allocated));
        }
    }
    thread_local! {
        static LATE: RefCell<Option<Late>> = const { RefCell::new(None) };
    }
    let (dev, a) = sim(1 << 30);
    let s = dev.new_stream();
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let seen: Seen = Arc::new(Mutex::new(None));
    let (a2, p2, seen2) = (a.clone(), pool.clone(), seen.clone());
    std::thread::spawn(move || {
        LATE.with(|l| *l.borrow_mut() = Some(Late(a2.clone(), s, p2, seen2)));
        // mempool's own thread-local, first used after ours: destroyed before ours.
        drop(a2.set_stream(&s).unwrap());
    })
    .join()
    .unwrap();
    let got = seen.lock().unwrap().take().expect("the destructor ran");
    assert_eq!(got, (true, true, true), "(set_stream refused, scope_on refused, allocation works)");
}

// ------------------------------------------------------------------------------------------
// Attacks that held up (these pass)
// ------------------------------------------------------------------------------------------

/// Streams that come and go (a new stream per "request"), caches emptied in between, pools
/// made and dropped: sets are retired and reused, and a block is only ever handed to requests on
/// its own segment's stream; statistics exact throughout.
#[test]
fn held_retired_sets_never_mix_streams() {
    let (dev, a) = sim(1 << 30);
    let mut rng = common::Rng(0x9e37_79b9_7f4a_7c15);
    let mut live: Vec<(Buffer<u8, Sim>, StreamId)> = Vec::new();
    let mut pools: Vec<MemPool<Sim>> = Vec::new();
    for round in 0..300 {
        let s = dev.new_stream();
        let _g = a.set_stream(&s).unwrap();
        if rng.below(4) == 0 {
            pools.push(MemPool::on(&a, PoolOptions::new()).unwrap());
        }
        for _ in 0..1 + rng.below(4) {
            let size = rng.size(24);
            let b = match (pools.last(), rng.below(3)) {
                (Some(p), 0) => p.alloc::<u8>(size).unwrap(),
                _ => a.alloc::<u8>(size).unwrap(),
            };
            live.push((b, s.id));
        }
        while live.len() > 6 {
            let i = rng.below(live.len() as u64) as usize;
            live.swap_remove(i);
        }
        if rng.below(5) == 0 && !pools.is_empty() {
            let i = rng.below(pools.len() as u64) as usize;
            pools.swap_remove(i);
        }
        if rng.below(3) == 0 {
            a.empty_cache().unwrap();
        }
        for (b, sid) in &live {
            assert_eq!(segment_stream(&a, b.device_ptr_raw()), *sid, "round {round}");
        }
        common::check_invariants(&a, Some(&dev));
    }
}

/// Frees refused by the device, then retried: the segment is re-cached into its own pool's set,
/// reused on its stream only, statistics exact (`check_invariants`), device counters agree; the
/// allocator's drop gives it back on its second round; refusing for ever is left (stderr), no
/// panic or hang.
#[test]
fn held_refused_frees_recache_exactly() {
    within(30, "refused frees", || {
        let (dev, a) = sim(1 << 30);
        let side = dev.new_stream();
        let x = {
            let _g = a.set_stream(&side).unwrap();
            a.alloc::<u8>(3 * MIB).unwrap()
        };
        let addr = x.device_ptr_raw();
        drop(x);
        dev.fail_next_frees(1);
        assert!(a.empty_cache().is_err());
        common::check_invariants(&a, Some(&dev));
        let y = a.alloc::<u8>(3 * MIB).unwrap(); // default stream: not the side stream's segment
        assert_ne!(y.device_ptr_raw(), addr);
        let z = {
            let _g = a.set_stream(&side).unwrap();
            a.alloc::<u8>(3 * MIB).unwrap()
        };
        assert_eq!(z.device_ptr_raw(), addr, "the re-cached segment serves its own stream");
        drop((y, z));
        common::check_invariants(&a, Some(&dev));
        let s = a.memory_stats();
        let (allocs, frees, _) = dev.counters();
        assert_eq!((s.num_device_alloc, s.num_device_free), (allocs, frees));
        dev.fail_next_frees(1);
        drop(a); // first round refused, second round gives it back
        assert!(dev.live_segments().is_empty());

        let (dev, a) = sim(1 << 30);
        drop(a.alloc::<u8>(100).unwrap());
        dev.fail_next_frees(100);
        drop(a); // refused for ever: left to the process, said on stderr
        assert_eq!(dev.live_segments().len(), 1);
    });
}

/// Sizes and granularities at the edges: `MemPool::on` refuses granularities that are not
/// powers of two of at most 1 GiB (option or allocator); requests whose block or segment would
/// pass 1 TiB − 512 B are out-of-memory errors on every kind of pool, never a panic or a wrapped
/// size; the largest ones that fit are carved exactly.
#[test]
fn held_sizes_and_granularities_at_the_limits() {
    let (_, a) = sim(usize::MAX);
    for g in [0, 3, (1 << 30) + 1, 1 << 31, usize::MAX] {
        assert!(matches!(MemPool::on(&a, PoolOptions::new().granularity(g)), Err(Error::Config(_))), "{g}");
    }
    let max_block = (1usize << 40) - 512;
    let huge = MemPool::on(&a, PoolOptions::new().granularity(1 << 30)).unwrap();
    let exact = MemPool::on(&a, PoolOptions::new().no_split(true).granularity(1 << 30)).unwrap();
    let exact_512 = MemPool::on(&a, PoolOptions::new().no_split(true)).unwrap();
    for n in [max_block, max_block - 511, (1 << 40) - (2 << 20) + 1, (1 << 40) - (1 << 30) + 1, 1 << 40] {
        assert!(matches!(huge.alloc::<u8>(n), Err(Error::OutOfMemory(_))), "{n}");
        assert!(matches!(exact.alloc::<u8>(n), Err(Error::OutOfMemory(_))), "{n}");
    }
    let b = exact_512.alloc::<u8>(max_block).unwrap();
    assert_eq!(exact_512.memory_stats().reserved_bytes.current as usize, max_block);
    drop(b);
    let b = huge.alloc::<u8>((1 << 40) - (1 << 30)).unwrap();
    drop(b);
    let c = a.alloc::<u8>((1 << 40) - (2 << 20)).unwrap();
    drop(c);
    common::check_invariants(&a, None);
    // Divisions from a hand-built config near the limit.
    let cfg = Config { roundup_power2_divisions: [1024; 16], ..Config::default() };
    let b = Allocator::sim_with(SimDevice::new(usize::MAX), cfg);
    for n in [(1usize << 40) - 1, (1 << 39) + 1, max_block] {
        match b.alloc::<u8>(n) {
            Ok(x) => assert!(x.device_ptr_raw() % 512 == 0),
            Err(e) => assert!(matches!(e, Error::OutOfMemory(_)), "{n}: {e}"),
        }
    }
}

/// `in_source` and routes: a pool allocator that allocates (scratch) on the thread that asked for
/// its segment, inside that pool's scope, gets the default pools; nested pool allocators (pool A's
/// allocator allocating from pool B explicitly) work; the marker is restored after a panic.
#[test]
fn held_pool_allocators_allocating_inside_alloc() {
    struct Nested {
        inner: Ledger,
        alloc: Allocator<Sim>,
        other: Mutex<Option<MemPool<Sim>>>,
        scratch_in_default: AtomicBool,
        panic_once: AtomicBool,
    }
    // SAFETY: forwards to `Ledger`.
    unsafe impl RawAllocator for Nested {
        fn name(&self) -> &str {
            "nested"
        }
        fn alloc(&self, size: usize, d: usize, s: StreamId) -> Result<u64, BackendError> {
            let scratch = self.alloc.alloc::<u8>(4096).unwrap();
            let default_seg = self.alloc.snapshot().segments.iter().any(|seg| {
                seg.pool.0 == 0
                    && seg.address <= scratch.device_ptr_raw()
                    && scratch.device_ptr_raw() < seg.address + seg.total_size as u64
            });
            self.scratch_in_default.store(default_seg, Ordering::SeqCst);
            if let Some(p) = self.other.lock().unwrap().as_ref() {
                drop(p.alloc::<u8>(4096).unwrap());
            }
            if self.panic_once.swap(false, Ordering::SeqCst) {
                panic!("once");
            }
            self.inner.alloc(size, d, s)
        }
        unsafe fn free(&self, ptr: u64, size: usize, d: usize, s: StreamId) -> Result<(), BackendError> {
            // SAFETY: forwarded unchanged.
            unsafe { self.inner.free(ptr, size, d, s) }
        }
    }
    let (dev, a) = sim(1 << 30);
    let other = MemPool::on(&a, PoolOptions::new().allocator(Ledger::with_base(USER_BASE + (1 << 41)))).unwrap();
    let nested = Arc::new(Nested {
        inner: Ledger::default(),
        alloc: a.clone(),
        other: Mutex::new(Some(other.clone())),
        scratch_in_default: AtomicBool::new(false),
        panic_once: AtomicBool::new(true),
    });
    let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(nested.clone())).unwrap();
    {
        let _s = pool.scope();
        assert!(matches!(a.alloc::<u8>(100), Err(Error::PoolAllocator { .. })));
        let x = a.alloc::<u8>(100).unwrap();
        assert!(x.device_ptr_raw() >= USER_BASE, "the request itself went to the pool");
        assert!(nested.scratch_in_default.load(Ordering::SeqCst));
        let y = a.alloc::<u8>(100).unwrap(); // the route holds after the panic
        assert_eq!(pool.memory_stats().allocation.current, 2);
        drop((x, y));
    }
    *nested.other.lock().unwrap() = None;
    drop((pool, other));
    common::check_invariants(&a, Some(&dev));
}

/// The host backend (real memory): pools with granularities, no-split pools, zeroed buffers
/// across reuse, a `Counting` adaptor over a real allocator, everything given back on drop.
#[test]
fn held_host_pools_and_counting() {
    /// Real heap memory as a pool allocator.
    struct Heap;
    // SAFETY: `std::alloc` ranges of exactly `size` bytes, 2 MiB aligned, owned until `free`.
    unsafe impl RawAllocator for Heap {
        fn name(&self) -> &str {
            "heap"
        }
        fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
            let l = std::alloc::Layout::from_size_align(size, 2 * MIB).map_err(|_| BackendError::OutOfMemory)?;
            // SAFETY: size > 0.
            let p = unsafe { std::alloc::alloc(l) };
            Ok(p as u64)
        }
        unsafe fn free(&self, ptr: u64, size: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
            let l = std::alloc::Layout::from_size_align(size, 2 * MIB).unwrap();
            // SAFETY: from `alloc` above with this layout.
            unsafe { std::alloc::dealloc(ptr as *mut u8, l) };
            Ok(())
        }
        fn granularity(&self) -> usize {
            2 * MIB
        }
    }
    let a = Allocator::host_with(HostBackend::plain(), Config::default());
    let counted = Counting::new(Heap);
    let p = MemPool::on(&a, PoolOptions::new().shared_allocator(counted.clone()).granularity(4 * MIB)).unwrap();
    let q = MemPool::on(&a, PoolOptions::new().no_split(true)).unwrap();
    for round in 0..20 {
        let z = p.alloc_zeros::<u64>(1000 + round * 777).unwrap();
        let w = q.alloc_zeros::<u32>(5000 + round).unwrap();
        assert_eq!(z.device_ptr_raw() % 512, 0);
        assert_eq!(w.device_ptr_raw() % 512, 0);
        // SAFETY: the buffers own these ranges of host memory (plain backend, user heap pool).
        unsafe {
            let zs = std::slice::from_raw_parts_mut(z.device_ptr_raw() as *mut u64, z.len());
            assert!(zs.iter().all(|v| *v == 0));
            zs.fill(u64::MAX);
            let ws = std::slice::from_raw_parts_mut(w.device_ptr_raw() as *mut u32, w.len());
            assert!(ws.iter().all(|v| *v == 0));
            ws.fill(7);
        }
    }
    let c = counted.counts();
    assert_eq!(c.live_bytes % (4 * MIB), 0);
    drop((p, q));
    let c = counted.counts();
    assert_eq!((c.live_bytes, c.allocs, c.frees), (0, c.frees, c.allocs));
    drop(a);
}
