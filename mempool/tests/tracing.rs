//! The `tracing` feature: the allocator's rare events reach a subscriber, in their spans, outside
//! every lock (a subscriber that allocates gets `Reentrant`, not a deadlock).
//! `cargo test -p cuda-mempool --features tracing --test tracing` (CI runs it).
#![cfg(feature = "tracing")]

use std::cell::RefCell;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use mempool::sim::SimDevice;
use mempool::{Allocator, Error, MemPool, PoolOptions, Sim};
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Records every event as `LEVEL target [innermost span] field=value ...`.
struct Recorder {
    log: Arc<Mutex<Vec<String>>>,
    names: Mutex<Vec<&'static str>>,
    next: AtomicU64,
    /// Allocates from inside each "segment allocated" event, and logs what it got.
    alloc: Mutex<Option<Allocator<Sim>>>,
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

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::TRACE)
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut names = self.names.lock().unwrap();
        names.push(span.metadata().name());
        let _ = self.next.fetch_add(1, Ordering::Relaxed);
        Id::from_u64(names.len() as u64)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let m = event.metadata();
        let span = ENTERED.with(|e| e.borrow().last().copied());
        let span = span.map_or("-", |i| self.names.lock().unwrap()[i as usize - 1]);
        let mut f = Fields(String::new());
        event.record(&mut f);
        let line = format!("{} {} [{span}]{}", m.level(), m.target(), f.0);
        let again = line.contains("segment allocated");
        self.log.lock().unwrap().push(line);
        if again {
            if let Some(a) = self.alloc.lock().unwrap().as_ref() {
                let r = a.alloc::<u8>(1 << 20).map(drop);
                self.log.lock().unwrap().push(format!("inner alloc: {r:?}"));
            }
        }
    }
    fn enter(&self, span: &Id) {
        ENTERED.with(|e| e.borrow_mut().push(span.into_u64()));
    }
    fn exit(&self, _: &Id) {
        ENTERED.with(|e| e.borrow_mut().pop());
    }
}

#[test]
fn segments_ladder_and_pool_release_reach_the_subscriber() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let rec =
        Recorder { log: log.clone(), names: Mutex::new(Vec::new()), next: AtomicU64::new(0), alloc: Mutex::new(None) };
    let a = Allocator::sim(SimDevice::new(64 << 20));
    *rec.alloc.lock().unwrap() = Some(a.clone());
    let take = || std::mem::take(&mut *log.lock().unwrap());
    tracing::subscriber::with_default(rec, || {
        // A segment: its event, and the subscriber's own allocation refused (no deadlock).
        let x = a.alloc::<u8>(8 << 20).unwrap();
        let seen = take();
        let seg = seen.iter().find(|l| l.contains("segment allocated")).expect("segment allocated");
        assert!(seg.starts_with("DEBUG mempool [-]"), "{seg}");
        assert!(seg.contains("device=0") && seg.contains("pool=0") && seg.contains("size="), "{seg}");
        let inner = seen.iter().find(|l| l.starts_with("inner alloc")).expect("the subscriber allocated");
        assert_eq!(inner, &format!("inner alloc: {:?}", Err::<(), _>(Error::Reentrant)));
        // empty_cache: the segment's free inside its span.
        drop(x);
        a.empty_cache().unwrap();
        let seen = take();
        assert!(seen.iter().any(|l| l.contains("segment freed") && l.contains("[empty_cache]")), "{seen:#?}");
        // The out-of-memory ladder: its span, its first rung, the failure.
        let e = a.alloc::<u8>(1 << 30).unwrap_err();
        assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
        let seen = take();
        assert!(
            seen.iter().any(|l| l.starts_with("INFO mempool [out_of_memory_ladder]") && l.contains("retrying")),
            "{seen:#?}"
        );
        let oom = seen.iter().find(|l| l.contains("out of memory")).expect("out of memory");
        assert!(oom.starts_with("WARN mempool") && oom.contains(&format!("requested={}", 1u64 << 30)), "{oom}");
        // A pool released with a block still live: the event says a segment is left.
        let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
        let id = pool.id().0;
        let y = pool.alloc::<u8>(1 << 20).unwrap();
        drop(pool);
        let seen = take();
        let rel = seen.iter().find(|l| l.contains("pool released")).expect("pool released");
        assert!(rel.contains(&format!("pool={id}")) && rel.contains("segments_left=1"), "{rel}");
        drop(y);
        let seen = take();
        assert!(seen.iter().any(|l| l.contains("segment freed") && l.contains(&format!("pool={id}"))), "{seen:#?}");
    });
    // No subscriber any more: nothing is recorded.
    drop(a.alloc::<u8>(4 << 20).unwrap());
    a.empty_cache().unwrap();
    assert!(take().is_empty());
}
