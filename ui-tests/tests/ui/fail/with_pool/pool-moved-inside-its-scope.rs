// The pool is moved (dropped) inside its own scope: the guard borrows it.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::with_pool;

#[with_pool(pool)]
fn work(alloc: &Allocator<Sim>, pool: MemPool<Sim>) {
    drop(pool);
    drop(alloc.alloc::<u8>(1));
}

fn main() {
    let alloc = Allocator::sim(SimDevice::new(1 << 20));
    let pool = MemPool::on(&alloc, PoolOptions::new()).unwrap();
    work(&alloc, pool);
}
