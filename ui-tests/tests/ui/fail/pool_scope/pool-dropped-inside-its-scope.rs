// The pool is dropped inside its own scope.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::pool_scope;

fn main() {
    let alloc = Allocator::sim(SimDevice::new(1 << 20));
    let pool = MemPool::on(&alloc, PoolOptions::new()).unwrap();
    pool_scope!(pool => {
        drop(pool);
    });
}
