// An end with no begin.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::{end_pool, pool_scopes};

#[pool_scopes]
fn work(alloc: &Allocator<Sim>, pool: &MemPool<Sim>) {
    drop(alloc.alloc::<u8>(1));
    end_pool!(pool);
}

fn main() {}
