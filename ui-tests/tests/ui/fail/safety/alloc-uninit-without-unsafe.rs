// `alloc_uninit` hands out memory that is not a valid `T` yet: only `unsafe` code may call it.
use mempool::{sim::SimDevice, Allocator};

fn main() {
    let alloc = Allocator::sim(SimDevice::new(64 << 20));
    let _chars = alloc.alloc_uninit::<char>(16);
}
