// Giving a pool allocator back a pointer it never gave out is the caller's promise to keep:
// `RawAllocator::free` is an `unsafe fn`.
use mempool::{BackendError, RawAllocator, StreamId};

fn free_anything(a: &dyn RawAllocator) -> Result<(), BackendError> {
    a.free(0xdead_0000, 4096, 0, StreamId(0))
}

fn main() {
    let _ = free_anything;
}
