// An end naming another pool than the innermost begin.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::{begin_pool, end_pool, pool_scopes};

#[pool_scopes]
fn work(alloc: &Allocator<Sim>, pool: &MemPool<Sim>, other: &MemPool<Sim>) {
    begin_pool!(pool);
    drop(alloc.alloc::<u8>(1));
    end_pool!(other);
    end_pool!(pool);
}

fn main() {}
