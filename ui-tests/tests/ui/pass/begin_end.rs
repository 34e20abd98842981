//! PyTorch-style begin/end pairs under `#[pool_scopes]`, nested and in a loop.
use mempool::sim::SimDevice;
use mempool::{begin_pool, end_pool, pool_scopes, Allocator, MemPool, PoolOptions, Sim};

#[pool_scopes]
fn step(alloc: &Allocator<Sim>, a: &MemPool<Sim>, b: &MemPool<Sim>) -> mempool::Result<()> {
    begin_pool!(a);
    let _x = alloc.alloc::<u8>(10)?;
    for _ in 0..3 {
        begin_pool!(b);
        let _y = alloc.alloc::<u8>(10)?;
        end_pool!(b);
    }
    end_pool!(a);
    Ok(())
}

fn main() {
    let alloc = Allocator::sim(SimDevice::new(64 << 20));
    let (a, b) = (MemPool::on(&alloc, PoolOptions::new()).unwrap(), MemPool::on(&alloc, PoolOptions::new()).unwrap());
    step(&alloc, &a, &b).unwrap();
    assert_eq!(a.memory_stats().allocation.allocated, 1);
    assert_eq!(b.memory_stats().allocation.allocated, 3);
}
