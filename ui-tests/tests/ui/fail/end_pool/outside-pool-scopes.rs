// end_pool! in a function without #[pool_scopes].
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::end_pool;

fn work(pool: &MemPool<Sim>) {
    end_pool!(pool);
}

fn main() {}
