// A replay runs the captured launches again: their promise (every argument alive) must hold
// at each replay, which the compiler cannot check, so `replay` is `unsafe`.
use mempool::{sim::SimDevice, Allocator, CaptureMode, MemPool, PoolOptions};

fn main() {
    let sim = SimDevice::new(64 << 20);
    let alloc = Allocator::sim(sim.clone());
    let pool = MemPool::on(&alloc, PoolOptions::new()).unwrap();
    let capture = alloc.begin_capture(&sim.new_stream(), &pool, CaptureMode::Global).unwrap();
    let graph = capture.end().unwrap();
    graph.replay().unwrap();
}
