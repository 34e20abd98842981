// Reused memory read back as `bool` could hold a 2: `alloc` takes only types valid at every bit
// pattern; `alloc_zeros` or the unsafe `alloc_uninit` are the ways to get a `bool` buffer.
use mempool::{sim::SimDevice, Allocator};

fn main() {
    let alloc = Allocator::sim(SimDevice::new(64 << 20));
    let _flags = alloc.alloc::<bool>(16);
}
