// A begin never ended.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::{begin_pool, pool_scopes};

#[pool_scopes]
fn work(alloc: &Allocator<Sim>, pool: &MemPool<Sim>) {
    begin_pool!(pool);
    drop(alloc.alloc::<u8>(1));
}

fn main() {}
