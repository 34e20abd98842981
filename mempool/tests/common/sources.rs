//! Segment sources, map guards and set-ups shared by the out-of-memory reviews
//! (`review17.rs`, `review18.rs`): a [`Gate`] that holds calls open, a [`Script`]ed segment
//! source (capacity, refusals, delay, gate), a map guard that holds a map open ([`HoldGuard`]),
//! allocators without thread caches or under a memory limit.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use mempool::sim::SimDevice;
use mempool::{Allocator, BackendError, Config, MapGuard, RawAllocator, StreamId};

const MIB: usize = 1 << 20;

pub(crate) fn no_thread_cache(sim: &Arc<SimDevice>) -> Allocator<mempool::Sim> {
    Allocator::sim_with(sim.clone(), Config::builder().thread_cache(false).build().unwrap())
}

/// An allocator whose memory-fraction limit is `limit` bytes of a 1 GiB simulated device.
pub(crate) fn limited(limit: usize, expandable: bool) -> (Arc<SimDevice>, Allocator<mempool::Sim>) {
    let sim = SimDevice::new(1 << 30);
    let cfg = Config::builder()
        .thread_cache(false)
        .expandable_segments(expandable)
        .memory_fraction(limit as f64 / (1u64 << 30) as f64)
        .build()
        .unwrap();
    (sim.clone(), Allocator::sim_with(sim, cfg))
}

/// A gate: calls pass while open; `arm` makes the next caller(s) block until `open`.
#[derive(Default)]
pub(crate) struct Gate {
    pub(crate) state: Mutex<(bool, usize)>, // (armed, entered)
    pub(crate) cv: Condvar,
}

impl Gate {
    pub(crate) fn arm(&self) {
        self.state.lock().unwrap().0 = true;
    }
    pub(crate) fn open(&self) {
        self.state.lock().unwrap().0 = false;
        self.cv.notify_all();
    }
    pub(crate) fn pass(&self) {
        let mut s = self.state.lock().unwrap();
        if s.0 {
            s.1 += 1;
            self.cv.notify_all();
            while s.0 {
                s = self.cv.wait(s).unwrap();
            }
        }
    }
    pub(crate) fn wait_entered(&self, n: usize) {
        let mut s = self.state.lock().unwrap();
        while s.1 < n {
            let (g, t) = self.cv.wait_timeout(s, Duration::from_secs(10)).unwrap();
            assert!(!t.timed_out(), "gate never entered");
            s = g;
        }
    }
}

/// A scripted segment source: calls pass `gate`, take `delay`, then answer from a capacity,
/// except that the next `refuse` calls are refused and `answer` (if set) replaces the result.
pub(crate) struct Script {
    pub(crate) capacity: usize,
    pub(crate) in_use: Mutex<usize>,
    pub(crate) next: AtomicU64,
    pub(crate) gate: Gate,
    pub(crate) delay: Duration,
    pub(crate) refuse: AtomicUsize,
    pub(crate) calls: AtomicUsize,
    pub(crate) panic_next: AtomicBool,
    pub(crate) fail_next: AtomicBool,
    pub(crate) zero_next: AtomicBool,
    pub(crate) misalign_next: AtomicBool,
    /// Called (once) inside the next call, after the gate.
    pub(crate) inside: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    /// If not 0: only this call (1-based) waits at the (armed) gate, after its answer is
    /// decided (a yes counts against the capacity at once).
    pub(crate) hold_call: AtomicUsize,
}

impl Script {
    pub(crate) fn new(capacity: usize, delay: Duration) -> Arc<Script> {
        Arc::new(Script {
            capacity,
            in_use: Mutex::new(0),
            next: AtomicU64::new(0x7000_0000_0000),
            gate: Gate::default(),
            delay,
            refuse: AtomicUsize::new(0),
            calls: AtomicUsize::new(0),
            panic_next: AtomicBool::new(false),
            fail_next: AtomicBool::new(false),
            zero_next: AtomicBool::new(false),
            misalign_next: AtomicBool::new(false),
            inside: Mutex::new(None),
            hold_call: AtomicUsize::new(0),
        })
    }
}

impl Script {
    pub(crate) fn answer(&self, size: usize) -> Result<u64, BackendError> {
        if self.refuse.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return Err(BackendError::OutOfMemory);
        }
        let mut u = self.in_use.lock().unwrap();
        if *u + size > self.capacity {
            return Err(BackendError::OutOfMemory);
        }
        *u += size;
        Ok(self.next.fetch_add(size.next_multiple_of(2 * MIB) as u64, Ordering::SeqCst))
    }
}

// SAFETY: distinct 2 MiB-aligned ranges of a counter, never dereferenced (simulated device); a
// free takes back what an alloc gave (the misaligned answer is never counted as in use).
unsafe impl RawAllocator for Script {
    fn name(&self) -> &str {
        "script"
    }
    fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let hold = self.hold_call.load(Ordering::SeqCst);
        if hold != 0 {
            let r = self.answer(size);
            if call == hold {
                self.gate.pass();
            }
            return r;
        }
        self.gate.pass();
        if let Some(f) = self.inside.lock().unwrap().take() {
            f();
        }
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        if self.panic_next.swap(false, Ordering::SeqCst) {
            panic!("scripted panic");
        }
        if self.fail_next.swap(false, Ordering::SeqCst) {
            return Err(BackendError::Failed("scripted failure".into()));
        }
        if self.zero_next.swap(false, Ordering::SeqCst) {
            return Ok(0);
        }
        if self.misalign_next.swap(false, Ordering::SeqCst) {
            return Ok(0x7100_0000_0000 + 512);
        }
        self.answer(size)
    }
    unsafe fn free(&self, addr: u64, size: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        if addr & 0xffff_0000_0000 == 0x7100_0000_0000 {
            return Ok(());
        }
        *self.in_use.lock().unwrap() -= size;
        Ok(())
    }
    fn granularity(&self) -> usize {
        2 * MIB
    }
}

/// A map guard that can hold a map open (`gate`) and run something inside `mapped`.
#[derive(Default)]
pub(crate) struct HoldGuard {
    pub(crate) gate: Gate,
    pub(crate) mapped: AtomicUsize,
    pub(crate) on_mapped: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    pub(crate) panic_next: AtomicBool,
}

/// `HoldGuard` shared with the test.
pub(crate) struct Shared(pub(crate) Arc<HoldGuard>);

impl MapGuard for Shared {
    fn mapped(&self, _: u64, _: usize) {
        let s = &*self.0;
        s.mapped.fetch_add(1, Ordering::SeqCst);
        s.gate.pass();
        if let Some(f) = s.on_mapped.lock().unwrap().take() {
            f();
        }
        if s.panic_next.swap(false, Ordering::SeqCst) {
            panic!("scripted guard panic");
        }
    }
    fn unmapping(&self, _: u64, _: usize) -> Result<(), String> {
        Ok(())
    }
}

pub(crate) fn opener_after(gate: impl Fn() + Send + 'static, ms: u64) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(ms));
        gate();
    })
}
