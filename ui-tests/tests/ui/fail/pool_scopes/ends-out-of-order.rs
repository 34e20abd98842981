// Scopes ended in the wrong order: they must nest.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::{begin_pool, end_pool, pool_scopes};

#[pool_scopes]
fn work(a: &MemPool<Sim>, b: &MemPool<Sim>) {
    begin_pool!(a);
    begin_pool!(b);
    end_pool!(a);
    end_pool!(b);
}

fn main() {}
