// The attribute on a const fn.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::with_pool;

#[with_pool(pool)]
const fn size(pool: &MemPool<Sim>) -> usize {
    4
}

fn main() {}
