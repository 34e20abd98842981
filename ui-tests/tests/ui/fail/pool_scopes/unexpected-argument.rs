// An argument #[pool_scopes] does not take.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};
use mempool::pool_scopes;

#[pool_scopes(strict)]
fn work(pool: &MemPool<Sim>) {}

fn main() {}
