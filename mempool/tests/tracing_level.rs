//! Hostile-review probe (issue 19): a subscriber at WARN (a typical production filter) never gets the
//! WARN "out of memory" event: `segments_wanted()` queues segment-level events, Oom included,
//! only when the global max level is DEBUG or more.
//! Own binary: the global max level is process-wide.
//! `cargo test -p cuda-mempool --features tracing --test tracing_level`
#![cfg(feature = "tracing")]

use std::sync::{Arc, Mutex};

use mempool::sim::SimDevice;
use mempool::{Allocator, Error};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

struct WarnOnly(Arc<Mutex<Vec<String>>>);

impl Subscriber for WarnOnly {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        *m.level() <= tracing::Level::WARN
    }
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::WARN)
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, e: &Event<'_>) {
        self.0.lock().unwrap().push(format!("{} {}", e.metadata().level(), e.metadata().name()));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn probe_oom_warning_reaches_a_warn_level_subscriber() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let a = Allocator::sim(SimDevice::new(4 << 20));
    tracing::subscriber::with_default(WarnOnly(log.clone()), || {
        assert_eq!(LevelFilter::current(), LevelFilter::WARN);
        let e = a.alloc::<u8>(1 << 30).unwrap_err();
        assert!(matches!(e, Error::OutOfMemory(_)));
        // Control: a WARN event of our own gets through.
        tracing::warn!("control");
    });
    let seen = log.lock().unwrap().clone();
    assert!(
        seen.iter().any(|l| l.starts_with("WARN") && l.contains("trace.rs")),
        "WARN-level subscriber saw only: {seen:?}"
    );
}
