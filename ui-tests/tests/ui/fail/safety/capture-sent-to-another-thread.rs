// A capture ends on the thread that began it (CUDA's thread-local capture mode depends on it):
// the guard cannot be sent to another thread.
use mempool::{sim::SimDevice, Allocator, CaptureMode, MemPool, PoolOptions};

fn main() {
    let sim = SimDevice::new(64 << 20);
    let alloc = Allocator::sim(sim.clone());
    let pool = MemPool::on(&alloc, PoolOptions::new()).unwrap();
    let capture = alloc.begin_capture(&sim.new_stream(), &pool, CaptureMode::Global).unwrap();
    std::thread::spawn(move || drop(capture));
}
