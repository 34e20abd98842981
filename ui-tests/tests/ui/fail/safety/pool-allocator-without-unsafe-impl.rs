// A pool allocator's addresses are written through by safe code: implementing it is a promise
// the compiler cannot check, so it takes `unsafe impl`.
use mempool::{BackendError, RawAllocator, StreamId};

struct MadeUp;

impl RawAllocator for MadeUp {
    fn name(&self) -> &str {
        "made-up"
    }
    fn alloc(&self, _: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        Ok(0x10)
    }
    unsafe fn free(&self, _: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        Ok(())
    }
}

fn main() {}
