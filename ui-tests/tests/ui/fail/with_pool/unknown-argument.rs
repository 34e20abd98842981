// An argument that does not exist.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::with_pool;

#[with_pool(pool, device = 0)]
fn work(pool: &MemPool<Sim>) {}

fn main() {}
