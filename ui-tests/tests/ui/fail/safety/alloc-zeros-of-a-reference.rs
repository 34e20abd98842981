// All-zero bits is not a valid reference: `alloc_zeros` takes only `ValidAsZeroBits` types.
use mempool::{sim::SimDevice, Allocator};

fn main() {
    let alloc = Allocator::sim(SimDevice::new(64 << 20));
    let _refs = alloc.alloc_zeros::<&'static u8>(16);
}
