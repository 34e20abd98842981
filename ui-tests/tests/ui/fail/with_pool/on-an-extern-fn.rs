// The attribute on an extern fn.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::with_pool;

#[with_pool(pool)]
extern "C" fn callback(pool: &MemPool<Sim>) {}

fn main() {}
