// begin_pool! in a function without #[pool_scopes].
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::begin_pool;

fn work(pool: &MemPool<Sim>) {
    begin_pool!(pool);
}

fn main() {}
