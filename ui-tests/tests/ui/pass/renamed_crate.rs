//! `crate = path` for a renamed `mempool`.
mod deps {
    pub use mempool as gpu_memory;
}
use deps::gpu_memory::sim::SimDevice;
use deps::gpu_memory::{Allocator, MemPool, PoolOptions, Sim};

#[deps::gpu_memory::with_pool(pool, crate = deps::gpu_memory)]
fn work(alloc: &Allocator<Sim>, pool: &MemPool<Sim>) {
    drop(alloc.alloc::<u8>(1).unwrap());
}

#[deps::gpu_memory::pool_scopes(crate = deps::gpu_memory)]
fn pairs(alloc: &Allocator<Sim>, pool: &MemPool<Sim>) {
    deps::gpu_memory::begin_pool!(pool);
    drop(alloc.alloc::<u8>(1).unwrap());
    deps::gpu_memory::end_pool!(pool);
}

fn main() {
    let alloc = Allocator::sim(SimDevice::new(64 << 20));
    let pool = MemPool::on(&alloc, PoolOptions::new()).unwrap();
    work(&alloc, &pool);
    pairs(&alloc, &pool);
    let n = deps::gpu_memory::pool_scope!(pool, crate = deps::gpu_memory => { alloc.alloc::<u8>(1).unwrap().len() });
    assert_eq!(n, 1);
    assert_eq!(pool.memory_stats().allocation.allocated, 3);
}
