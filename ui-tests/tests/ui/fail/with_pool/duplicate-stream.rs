// The stream given twice.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::with_pool;

#[with_pool(pool, stream = a, stream = b)]
fn work(pool: &MemPool<Sim>, a: mempool::sim::SimStream, b: mempool::sim::SimStream) {}

fn main() {}
