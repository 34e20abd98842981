//! `pool_scope!` as an expression, with `?` and a stream.
use mempool::sim::SimDevice;
use mempool::{pool_scope, Allocator, MemPool, PoolOptions};

fn main() -> mempool::Result<()> {
    let sim = SimDevice::new(64 << 20);
    let alloc = Allocator::sim(sim.clone());
    let pool = MemPool::on(&alloc, PoolOptions::new()).unwrap();
    let n = pool_scope!(pool => { alloc.alloc::<u8>(10)?.len() });
    assert_eq!(n, 10);
    let side = sim.new_stream();
    let _g = alloc.set_stream(&side)?;
    let b = pool_scope!(&pool, stream = side => { alloc.alloc::<u8>(10)? });
    assert_eq!(b.stream_id(), side.id);
    assert_eq!(pool.memory_stats().allocation.allocated, 2);
    Ok(())
}
