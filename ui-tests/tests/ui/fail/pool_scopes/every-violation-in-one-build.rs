// Several mistakes: all are reported, each under its own call.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::{begin_pool, end_pool, pool_scopes};

#[pool_scopes]
fn work(a: &MemPool<Sim>, b: &MemPool<Sim>) {
    end_pool!(a);
    begin_pool!(a);
    if true {
        begin_pool!(b);
    }
    begin_pool!(b);
}

fn main() {}
