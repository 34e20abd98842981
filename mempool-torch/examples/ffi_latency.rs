//! Cost of one allocation + free through the C entry points PyTorch calls, next to the same pair
//! through `Allocator::alloc_bytes` / `free_bytes` (GPU 0; sizes cycling 512 B, 4 KiB, 64 KiB,
//! 1 MiB, as the `pair` latency rows do).
//!
//! ```sh
//! cargo run --release -p mempool-torch --example ffi_latency
//! ```

use std::ffi::c_void;
use std::time::Instant;

use mempool::Allocator;
use mempool_torch::{mempool_free, mempool_malloc};

const SIZES: [usize; 4] = [512, 4096, 65536, 1 << 20];

fn main() {
    let n = 200_000;
    let a = match Allocator::cuda(0) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ffi_latency: {e}");
            std::process::exit(1);
        }
    };
    let side = a.context().new_stream().expect("a stream");
    for (name, raw) in [("null stream", std::ptr::null_mut()), ("own stream", side.cu_stream() as *mut c_void)] {
        for round in 0..2 {
            let t = Instant::now();
            for i in 0..n {
                let size = SIZES[i % 4];
                // SAFETY: `raw` is null or a live stream of device 0; the pointer is freed at once,
                // unused.
                unsafe {
                    let p = mempool_malloc(size as isize, 0, raw);
                    assert!(!p.is_null());
                    mempool_free(p, size as isize, 0, raw);
                }
            }
            let ns = t.elapsed().as_nanos() as f64 / n as f64;
            if round == 1 {
                println!("ffi_latency: C entry points, {name}: {ns:.1} ns per alloc+free pair");
            }
        }
    }
    for round in 0..2 {
        let t = Instant::now();
        for i in 0..n {
            let p = a.alloc_bytes(SIZES[i % 4]).unwrap();
            a.free_bytes(p).unwrap();
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        if round == 1 {
            println!("ffi_latency: Allocator::alloc_bytes/free_bytes, null stream: {ns:.1} ns per pair");
        }
    }
}
