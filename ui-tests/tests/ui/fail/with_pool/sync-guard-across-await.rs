// A (non-async) scope guard held across an .await in a future that must be Send.
#![allow(unused)]
use std::future::Future;

use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};

async fn tick() {}

fn require_send<F: Future + Send>(_: F) {}

fn main() {
    let alloc = Allocator::sim(SimDevice::new(1 << 20));
    let pool = MemPool::on(&alloc, PoolOptions::new()).unwrap();
    require_send(async move {
        let _scope = pool.scope();
        tick().await;
    });
}
