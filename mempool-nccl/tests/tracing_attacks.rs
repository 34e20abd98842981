//! Hostile-review probe (issue 19): a panicking `tracing` subscriber and the Registration hook.
//! `cargo test -p mempool-nccl --features tracing --test tracing_attacks`
#![cfg(feature = "tracing")]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions};
use mempool_nccl::{Registrar, Registration};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

#[derive(Clone, Default)]
struct Recording(Arc<Mutex<Vec<(u64, u64, usize)>>>, Arc<Mutex<u64>>);

impl Registrar for Recording {
    fn register(&self, addr: u64, size: usize) -> Result<u64, String> {
        let mut n = self.1.lock().unwrap();
        *n += 1;
        self.0.lock().unwrap().push((*n, addr, size));
        Ok(*n)
    }
    fn deregister(&self, handle: u64) -> Result<(), String> {
        self.0.lock().unwrap().retain(|l| l.0 != handle);
        Ok(())
    }
}

/// Panics on every event whose message contains `needle`.
struct PanicOn(&'static str);

struct Msg(String);
impl tracing::field::Visit for Msg {
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        self.0 += &format!(" {}={v:?}", f.name());
    }
}

impl Subscriber for PanicOn {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::TRACE)
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, e: &Event<'_>) {
        let mut m = Msg(String::new());
        e.record(&mut m);
        if m.0.contains(self.0) {
            panic!("subscriber panics on {}", self.0);
        }
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// mempool's subscriber delivery runs before the hooks and outside their catch_unwind: a panic
/// on "segment freed" keeps the Registration hook from seeing SegmentFree, and the segment is
/// given back while still registered.
#[test]
fn probe_panicking_subscriber_leaves_a_freed_segment_registered() {
    let r = Recording::default();
    let a = Allocator::sim(SimDevice::new(1 << 30));
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let reg = Registration::attach(&a, Some(pool.id()), Arc::new(r.clone())).unwrap();
    drop(pool.alloc::<u8>(8 << 20).unwrap());
    assert_eq!(r.0.lock().unwrap().len(), 1);
    tracing::subscriber::with_default(PanicOn("segment freed"), || {
        let _ = catch_unwind(AssertUnwindSafe(|| pool.empty_cache()));
    });
    let segs = pool.snapshot().segments.len();
    let live = r.0.lock().unwrap().clone();
    assert!(
        live.is_empty() || segs > 0,
        "{segs} segment(s) left in the pool, still registered: {live:x?}; reg {:?}",
        reg.segments()
    );
}

/// Registration's Drop tells tracing its deregistrations (with_state) outside any
/// catch_unwind: dropped while a panic unwinds, a panicking subscriber aborts the process.
#[test]
fn probe_registration_dropped_during_unwind_with_panicking_subscriber() {
    if std::env::var_os("REV19_CHILD").is_some() {
        let r = Recording::default();
        let a = Allocator::sim(SimDevice::new(1 << 30));
        let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
        let _x = pool.alloc::<u8>(8 << 20).unwrap();
        tracing::subscriber::with_default(PanicOn("segment deregistered"), || {
            let res = catch_unwind(AssertUnwindSafe(|| {
                let _reg = Registration::attach(&a, Some(pool.id()), Arc::new(r.clone())).unwrap();
                panic!("the user's own panic");
            }));
            assert!(res.is_err());
        });
        println!("CHILD SURVIVED");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "probe_registration_dropped_during_unwind_with_panicking_subscriber", "--nocapture"])
        .env("REV19_CHILD", "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("CHILD SURVIVED"), "child: {:?}\n{text}", out.status);
}
