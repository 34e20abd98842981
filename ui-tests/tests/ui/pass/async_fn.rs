//! `#[with_pool]` on an `async fn`: a future that is still `Send`.
use std::future::Future;
use std::task::{Context, Poll, Waker};

use mempool::sim::SimDevice;
use mempool::{with_pool, Allocator, MemPool, PoolOptions, Sim};

#[with_pool(pool)]
async fn load(alloc: Allocator<Sim>, pool: MemPool<Sim>) -> mempool::Result<usize> {
    let b = alloc.alloc::<u8>(64)?;
    Ok(b.len())
}

fn require_send<F: Future + Send>(f: F) -> F {
    f
}

fn main() {
    let alloc = Allocator::sim(SimDevice::new(64 << 20));
    let pool = MemPool::on(&alloc, PoolOptions::new()).unwrap();
    let mut f = Box::pin(require_send(load(alloc, pool.clone())));
    let r = f.as_mut().poll(&mut Context::from_waker(Waker::noop()));
    assert!(matches!(r, Poll::Ready(Ok(64))));
    assert_eq!(pool.memory_stats().allocation.allocated, 1);
}
