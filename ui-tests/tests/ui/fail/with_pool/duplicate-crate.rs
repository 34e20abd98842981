// The crate path given twice.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::with_pool;

#[with_pool(pool, crate = mempool, crate = mempool)]
fn work(pool: &MemPool<Sim>) {}

fn main() {}
