// A scope guard sent to another thread: routing is per thread.
#![allow(unused)]
use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions, Sim};

fn main() {
    let alloc = Allocator::sim(SimDevice::new(1 << 20));
    let pool: &'static MemPool<Sim> = Box::leak(Box::new(MemPool::on(&alloc, PoolOptions::new()).unwrap()));
    let scope = pool.scope();
    std::thread::spawn(move || drop(scope));
}
