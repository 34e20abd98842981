// A begin inside a loop, ended after the loop.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::{begin_pool, end_pool, pool_scopes};

#[pool_scopes]
fn work(alloc: &Allocator<Sim>, pool: &MemPool<Sim>) {
    for _ in 0..3 {
        begin_pool!(pool);
        drop(alloc.alloc::<u8>(1));
    }
    end_pool!(pool);
}

fn main() {}
