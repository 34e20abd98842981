//! The snapshot reader on random and mutated pickles (a bounded fuzzer of our own): a view or a
//! clear error, never a panic. `MEMPOOL_FUZZ_ITERS` sets the count (CI: 5,000).

use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions};
use mempool_viz::SnapshotView;

#[test]
fn snapshot_reader_never_panics() {
    let iters: usize = std::env::var("MEMPOOL_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(5_000);
    mempool::record_history(1000);
    let a = Allocator::sim(SimDevice::new(1 << 30));
    let p = MemPool::on(&a, PoolOptions::new()).unwrap();
    let _x = a.alloc::<u8>(5000).unwrap();
    let _y = p.alloc::<u8>(3 << 20).unwrap();
    let good = a.snapshot().to_pickle();
    let mut x = 0x5EED_u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..iters {
        let mut b = good.clone();
        if i % 10 == 0 {
            b = (0..next() % 200).map(|_| next() as u8).collect();
        } else {
            for _ in 0..1 + next() % 8 {
                let at = (next() % b.len() as u64) as usize;
                match next() % 3 {
                    0 => b[at] = next() as u8,
                    1 => {
                        b.truncate(at);
                    }
                    _ => b.insert(at, next() as u8),
                }
                if b.is_empty() {
                    break;
                }
            }
        }
        let r = std::panic::catch_unwind(|| SnapshotView::from_pickle(&b).map(|v| (v.summary(), v.timeline())));
        assert!(r.is_ok(), "the reader panicked on input {i}");
    }
}
