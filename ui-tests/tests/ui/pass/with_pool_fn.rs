//! `#[with_pool]` on a function and a method: the body's allocations go to the pool.
use mempool::sim::SimDevice;
use mempool::{with_pool, Allocator, MemPool, PoolOptions, Sim};

#[with_pool(pool)]
fn work(alloc: &Allocator<Sim>, pool: &MemPool<Sim>) -> mempool::Result<usize> {
    let b = alloc.alloc::<f32>(100)?;
    Ok(b.len())
}

struct Model {
    alloc: Allocator<Sim>,
    pool: MemPool<Sim>,
}

impl Model {
    #[with_pool(self.pool)]
    fn forward(&self) -> mempool::Result<()> {
        let _activations = self.alloc.alloc::<f32>(1000)?;
        Ok(())
    }
}

fn main() {
    let alloc = Allocator::sim(SimDevice::new(64 << 20));
    let pool = MemPool::on(&alloc, PoolOptions::new()).unwrap();
    assert_eq!(work(&alloc, &pool).unwrap(), 100);
    let m = Model { alloc: alloc.clone(), pool: pool.clone() };
    m.forward().unwrap();
    assert_eq!(pool.memory_stats().allocation.allocated, 2);
    drop(alloc.alloc::<u8>(1).unwrap());
    assert_eq!(pool.memory_stats().allocation.allocated, 2);
}
