// A named argument where the pool should come first.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::with_pool;

#[with_pool(stream = s, pool)]
fn work(pool: &MemPool<Sim>, s: mempool::sim::SimStream) {}

fn main() {}
