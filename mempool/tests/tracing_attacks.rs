//! Hostile-review probes (issue 19): hostile `tracing` subscribers.
//! `cargo test -p cuda-mempool --features tracing --test tracing_attacks -- --test-threads=1`
#![cfg(feature = "tracing")]

use std::cell::{Cell, RefCell};
use std::fmt::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use mempool::sim::SimDevice;
use mempool::trace::{self, Action};
use mempool::{Allocator, Error, MemPool, PoolOptions, Sim};
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

const MIB: usize = 1 << 20;

type OnEvent = Box<dyn Fn(&str) + Send + Sync>;
type OnSpan = Box<dyn Fn(&'static str) + Send + Sync>;

/// A subscriber whose behaviour is given by closures: `on_event(line)`, `on_enter(name)`,
/// `on_exit(name)`. Logs `LEVEL [span] message fields`.
struct Hostile {
    log: Arc<Mutex<Vec<String>>>,
    names: Mutex<Vec<&'static str>>,
    level: LevelFilter,
    on_event: OnEvent,
    on_enter: OnSpan,
    on_exit: OnSpan,
}

thread_local! {
    static ENTERED: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={:?}", field.name(), value);
    }
}

impl Hostile {
    fn new(log: &Arc<Mutex<Vec<String>>>) -> Hostile {
        Hostile {
            log: log.clone(),
            names: Mutex::new(Vec::new()),
            level: LevelFilter::TRACE,
            on_event: Box::new(|_| {}),
            on_enter: Box::new(|_| {}),
            on_exit: Box::new(|_| {}),
        }
    }
    fn name(&self, id: &Id) -> &'static str {
        self.names.lock().unwrap()[id.into_u64() as usize - 1]
    }
}

impl Subscriber for Hostile {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        *m.level() <= self.level
    }
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.level)
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut names = self.names.lock().unwrap();
        names.push(span.metadata().name());
        Id::from_u64(names.len() as u64)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let span = ENTERED.with(|e| e.borrow().last().copied());
        let span = span.map_or("-", |i| self.names.lock().unwrap()[i as usize - 1]);
        let mut f = Fields(String::new());
        event.record(&mut f);
        let line = format!("{} [{span}]{}", event.metadata().level(), f.0);
        self.log.lock().unwrap().push(line.clone());
        (self.on_event)(&line);
    }
    fn enter(&self, span: &Id) {
        ENTERED.with(|e| e.borrow_mut().push(span.into_u64()));
        (self.on_enter)(self.name(span));
    }
    fn exit(&self, span: &Id) {
        ENTERED.with(|e| e.borrow_mut().pop());
        (self.on_exit)(self.name(span));
    }
}

fn quiet_panics() {
    let _ = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
}

/// The hooks (trace::attach) must not depend on what a subscriber does. A subscriber that
/// panics on "segment freed" makes `deliver` unwind before the hooks are called (to_tracing is
/// not inside the catch_unwind that guards the hooks): the hook never sees the `SegmentFree`.
/// mempool-nccl's Registration is such a hook (it deregisters on SegmentFree before the memory
/// goes back).
#[test]
fn probe_panicking_subscriber_hides_segment_free_from_hooks() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut sub = Hostile::new(&log);
    sub.on_event = Box::new(|l| {
        if l.contains("segment freed") {
            panic!("subscriber panics on segment freed");
        }
    });
    let a = Allocator::sim(SimDevice::new(64 * MIB));
    let me = a.id();
    let frees = Arc::new(AtomicUsize::new(0));
    let f2 = frees.clone();
    let _h = trace::attach(move |e| {
        if e.allocator == me && e.action == Action::SegmentFree {
            f2.fetch_add(1, Ordering::SeqCst);
        }
    })
    .unwrap();
    tracing::subscriber::with_default(sub, || {
        drop(a.alloc::<u8>(8 * MIB).unwrap());
        let r = catch_unwind(AssertUnwindSafe(|| a.empty_cache()));
        assert!(
            matches!(r, Ok(Ok(()))),
            "empty_cache: {:?}",
            r.as_ref().map(|x| x.as_ref().map_err(|e| e.to_string()))
        );
    });
    assert_eq!(a.snapshot().segments.len(), 0);
    assert_eq!(frees.load(Ordering::SeqCst), 1, "the hook missed the SegmentFree; log: {:#?}", log.lock().unwrap());
}

/// A subscriber that panics on the use_on_oom event: the block borrowed from the lender is
/// taken (state says allocated) but the `Allocation` never reaches a Buffer: leaked for good.
#[test]
fn probe_panicking_subscriber_on_use_on_oom_event_leaks_the_block() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut sub = Hostile::new(&log);
    sub.on_event = Box::new(|l| {
        if l.contains("use_on_oom") {
            panic!("subscriber panics on use_on_oom");
        }
    });
    let a = Allocator::sim(SimDevice::new(4 * MIB));
    let lender = MemPool::on(&a, PoolOptions::new().use_on_oom(true)).unwrap();
    drop(lender.alloc::<u8>(MIB).unwrap()); // 2 MiB segment cached in the lender
    let _fill = a.alloc::<u8>(MIB).unwrap();
    let _fill2 = a.alloc::<u8>(MIB - 512).unwrap();
    let r = tracing::subscriber::with_default(sub, || catch_unwind(AssertUnwindSafe(|| a.alloc::<u8>(MIB).map(drop))));
    let panicked = r.is_err();
    let live = lender.memory_stats().allocation.current;
    assert!(
        !panicked && live == 0,
        "alloc panicked={panicked}; lender's live allocations afterwards: {live} (nothing holds them)"
    );
}

/// A subscriber that panics when the out-of-memory ladder's span is exited: grow() returns
/// `Ok(a)` (a plain struct), `_ladder` is dropped after it, the panic loses `a`: leaked.
#[test]
fn probe_panicking_subscriber_on_ladder_span_exit_leaks_the_allocation() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut sub = Hostile::new(&log);
    sub.on_exit = Box::new(|name| {
        if name == "out_of_memory_ladder" && !std::thread::panicking() {
            panic!("subscriber panics on exit of the ladder span");
        }
    });
    let a = Allocator::sim(SimDevice::new(64 * MIB));
    drop(a.alloc::<u8>(40 * MIB).unwrap()); // cached
    let r =
        tracing::subscriber::with_default(sub, || catch_unwind(AssertUnwindSafe(|| a.alloc::<u8>(50 * MIB).map(drop))));
    let panicked = r.is_err();
    let allocated = a.memory_stats().allocated_bytes.all.current;
    assert!(
        !panicked && allocated == 0,
        "alloc panicked={panicked}; allocated bytes afterwards: {allocated} (no Buffer holds them); log {:#?}",
        log.lock().unwrap()
    );
}

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// The commit says "a subscriber is a hook: allocating from it gets Reentrant". Not for the
/// events and spans mempool emits directly (ladder, use_on_oom, pool release, empty_cache): an
/// allocation there runs (no lock is held, so no deadlock; tracing-core's own re-entrance guard
/// sends the nested ladder event to no subscriber, so no recursion either).
#[test]
fn probe_subscriber_allocating_in_the_ladder_event_is_not_refused() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let a = Allocator::sim(SimDevice::new(16 * MIB));
    let inner: Arc<Mutex<Vec<String>>> = Arc::default();
    let (a2, inner2) = (a.clone(), inner.clone());
    let max_depth = Arc::new(AtomicUsize::new(0));
    let md = max_depth.clone();
    let mut sub = Hostile::new(&log);
    sub.on_event = Box::new(move |l| {
        if l.contains("no memory for a new segment") {
            let d = DEPTH.with(|c| {
                c.set(c.get() + 1);
                c.get()
            });
            md.fetch_max(d as usize, Ordering::SeqCst);
            if d < 4 {
                let r = a2.alloc::<u8>(64 * MIB).map(drop);
                inner2.lock().unwrap().push(format!("depth {d}: {:?}", r.map_err(|e| matches!(e, Error::Reentrant))));
            }
            DEPTH.with(|c| c.set(c.get() - 1));
        }
    });
    tracing::subscriber::with_default(sub, || {
        let _ = a.alloc::<u8>(64 * MIB);
    });
    let inner = inner.lock().unwrap().clone();
    assert!(
        max_depth.load(Ordering::SeqCst) == 1 && inner.iter().all(|l| l.contains("Err(true)")),
        "the subscriber's allocations: {inner:?}; ladder re-entered to depth {}",
        max_depth.load(Ordering::SeqCst)
    );
}

/// A subscriber that does everything from every event and span (alloc/free, empty_cache, drops
/// a pool, snapshots): no deadlock (a watchdog), state consistent afterwards.
#[test]
fn probe_kitchen_sink_subscriber_does_not_deadlock() {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let log = Arc::new(Mutex::new(Vec::new()));
        let a = Allocator::sim(SimDevice::new(64 * MIB));
        let pools: Arc<Mutex<Vec<MemPool<Sim>>>> = Arc::default();
        for _ in 0..8 {
            pools.lock().unwrap().push(MemPool::on(&a, PoolOptions::new()).unwrap());
        }
        let busy = |a: &Allocator<Sim>, pools: &Mutex<Vec<MemPool<Sim>>>| {
            if DEPTH.with(|c| c.get()) > 2 {
                return;
            }
            DEPTH.with(|c| c.set(c.get() + 1));
            let _ = a.alloc::<u8>(3 * MIB).map(drop);
            let _ = a.empty_cache();
            let _ = a.snapshot();
            let p = pools.lock().unwrap().pop();
            if let Some(p) = p {
                let _ = p.alloc::<u8>(MIB).map(drop);
                let _ = p.empty_cache();
                drop(p);
            }
            DEPTH.with(|c| c.set(c.get() - 1));
        };
        let mut sub = Hostile::new(&log);
        let (a1, p1) = (a.clone(), pools.clone());
        sub.on_event = Box::new(move |_| busy(&a1, &p1));
        let (a2, p2) = (a.clone(), pools.clone());
        sub.on_enter = Box::new(move |_| busy(&a2, &p2));
        let (a3, p3) = (a.clone(), pools.clone());
        sub.on_exit = Box::new(move |_| busy(&a3, &p3));
        tracing::subscriber::with_default(sub, || {
            let mut keep = Vec::new();
            for i in 0..40 {
                if let Ok(b) = a.alloc::<u8>((i % 7 + 1) * MIB) {
                    keep.push(b);
                }
                if i % 5 == 0 {
                    keep.clear();
                    let _ = a.empty_cache();
                }
            }
            let _ = a.alloc::<u8>(1 << 30);
            drop(keep);
        });
        drop(pools);
        a.empty_cache().unwrap();
        let s = a.memory_stats();
        tx.send((s.allocated_bytes.all.current, s.reserved_bytes.all.current, log.lock().unwrap().len())).unwrap();
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok((alloc, res, n)) => assert!(alloc == 0 && res == 0, "after: allocated {alloc}, reserved {res} ({n} events)"),
        Err(e) => panic!("no answer in 60 s (deadlock?): {e}"),
    }
}

/// A scoped (thread-local) subscriber: the allocator's segment events are delivered by whichever
/// thread runs the outbox. While another thread's hook is slow, this thread's event goes to that
/// thread's dispatcher: this thread's subscriber never sees its own segment.
#[test]
fn probe_scoped_subscriber_misses_its_event_when_another_thread_delivers() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let a = Allocator::sim(SimDevice::new(256 * MIB));
    let me = a.id();
    let (started_tx, started_rx) = mpsc::channel::<()>();
    let started_tx = Mutex::new(Some(started_tx));
    let _h = trace::attach(move |e| {
        if e.allocator == me && std::thread::current().name() == Some("slow") {
            if let Some(tx) = started_tx.lock().unwrap().take() {
                tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(600));
            }
        }
    })
    .unwrap();
    let b = a.clone();
    let slow = std::thread::Builder::new()
        .name("slow".into())
        .spawn(move || {
            let x = b.alloc::<u8>(8 * MIB).unwrap(); // its event runs the slow hook
                                                     // Later calls deliver what is left in the outbox, on this thread.
            for _ in 0..20 {
                drop(b.alloc::<u8>(4 * MIB).unwrap());
                std::thread::sleep(Duration::from_millis(20));
            }
            drop(x);
        })
        .unwrap();
    started_rx.recv().unwrap();
    let sub = Hostile::new(&log);
    let y = tracing::subscriber::with_default(sub, || a.alloc::<u8>(32 * MIB).unwrap());
    slow.join().unwrap();
    drop(y);
    let seen = log.lock().unwrap().clone();
    assert!(
        seen.iter().any(|l| l.contains("segment allocated") && l.contains(&format!("size={}", 32 * MIB))),
        "this thread's subscriber saw: {seen:#?}"
    );
}

/// A subscriber that panics on "pool released": `MemPool`'s drop emits it directly (not through
/// the contained hook delivery), so the panic leaves `Drop`; a pool dropped while a panic
/// unwinds then aborts the process. Run in a child process.
#[test]
fn probe_pool_dropped_during_unwind_with_panicking_subscriber() {
    if std::env::var_os("REV19_CHILD").is_some() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut sub = Hostile::new(&log);
        sub.on_event = Box::new(|l| {
            if l.contains("pool released") {
                panic!("subscriber panics on pool released");
            }
        });
        let a = Allocator::sim(SimDevice::new(64 * MIB));
        tracing::subscriber::with_default(sub, || {
            let r = catch_unwind(AssertUnwindSafe(|| {
                let _p = MemPool::on(&a, PoolOptions::new()).unwrap();
                panic!("the user's own panic");
            }));
            assert!(r.is_err());
        });
        println!("CHILD SURVIVED");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "probe_pool_dropped_during_unwind_with_panicking_subscriber", "--nocapture"])
        .env("REV19_CHILD", "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("CHILD SURVIVED"), "child: {:?}\n{text}", out.status);
}

#[test]
fn zz_quiet() {
    // Keeps the panic messages of the probes above out of the way when run alone.
    quiet_panics();
}
