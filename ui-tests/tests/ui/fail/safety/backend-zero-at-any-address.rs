// Zeroing an arbitrary address is the caller's promise: the backend's raw-address methods are
// `unsafe fn`.
use mempool::backend::host::HostBackend;
use mempool::{Backend, StreamId};

fn main() {
    let host = HostBackend::plain();
    let _ = host.zero(0x10, 64, StreamId(0));
}
