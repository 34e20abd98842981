//! Host-NUMA pools on a real GPU: memory on a host NUMA node (`cuMemCreate` with
//! `CU_MEM_LOCATION_TYPE_HOST_NUMA`), routed into a region of code through a pool; the device
//! writes it, the CPU reads it back; the pool grows and shrinks, and the host's memory comes back
//! when it is released. Run on the GPU machine through `shared/tools/gpu-bundle`.

use std::sync::Arc;

use mempool::backend::host_numa::{probe, HostNumaAllocator};
use mempool::{Allocator, Error, MemPool, PoolOptions};

fn mem_available() -> u64 {
    let t = std::fs::read_to_string("/proc/meminfo").unwrap();
    let l = t.lines().find(|l| l.starts_with("MemAvailable:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn what_the_machine_supports_and_bad_nodes() {
    let s = probe(0).unwrap();
    println!("{s}");
    if let Some(n) = s.nearest_node {
        assert!(s.nodes.is_empty() || s.nodes.contains(&n), "{s}");
    }
    let e = HostNumaAllocator::new(0, Some(9999)).unwrap_err();
    let Error::Config(m) = &e else { panic!("{e}") };
    assert!(m.contains("NUMA node 9999 does not exist") || m.contains("not supported"), "{m}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_region_routed_to_host_numa_memory() {
    let support = probe(0).unwrap();
    if !support.virtual_memory {
        // Say so, and check the refusal is clear.
        let e = HostNumaAllocator::new(0, None).unwrap_err();
        assert!(e.to_string().contains("not supported"), "{e}");
        eprintln!("skipped: {support}");
        return;
    }
    let numa = Arc::new(HostNumaAllocator::new(0, None).unwrap());
    let gpu = Allocator::cuda(0).unwrap();
    let stream = gpu.current_stream();
    let pool = MemPool::on(&gpu, PoolOptions::new().shared_allocator(numa.clone())).unwrap();
    const N: usize = 64 << 20; // 256 MiB of u32
    let data: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let mut dev = gpu.alloc::<u32>(N).unwrap();
    stream.memcpy_htod(&data, &mut dev).unwrap();
    stream.synchronize().unwrap();
    let before = mem_available();
    let mut buf = {
        let _in = pool.scope();
        gpu.alloc::<u32>(N).unwrap() // routed to the pool: host memory on the node
    };
    assert_eq!(pool.memory_stats().reserved_bytes.current as usize, N * 4);
    stream.memcpy_dtod(&dev, &mut buf).unwrap(); // the device writes the host-NUMA buffer
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), data, "read back through the device");
    stream.synchronize().unwrap();
    let held = before.saturating_sub(mem_available());
    println!("node {}: {} MiB taken from the host while held", numa.node(), held >> 20);
    assert!(held >= (N as u64 * 4) * 9 / 10, "the buffer's memory came from the host: {held}");
    if numa.cpu_access() {
        // The safe host view: it waits for the device's writes first.
        assert_eq!(buf.host_slice().unwrap(), &data[..], "the CPU reads what the device wrote");
        buf.host_slice_mut().unwrap()[0] = 12345;
        assert_eq!(stream.clone_dtoh(&buf).unwrap()[0], 12345, "the device reads what the CPU wrote");
    } else {
        println!("the driver granted the device alone: no CPU view");
        assert!(buf.host_slice().is_err());
    }
    // Device memory of the same allocator has no host view.
    assert!(dev.host_slice().unwrap_err().to_string().contains("no host view"));
    // Grows: a second buffer in the pool; shrinks: both freed and the cache emptied.
    let two = {
        let _in = pool.scope();
        gpu.alloc::<u8>(32 << 20).unwrap()
    };
    assert!(pool.memory_stats().reserved_bytes.current as usize >= N * 4 + (32 << 20));
    drop((buf, two));
    stream.synchronize().unwrap();
    pool.empty_cache().unwrap();
    assert_eq!(pool.memory_stats().reserved_bytes.current, 0, "the pool gave its segments back");
    let after = mem_available();
    println!("host memory available: before {} MiB, held -{} MiB, after {} MiB", before >> 20, held >> 20, after >> 20);
    // The host's memory is back (within 128 MiB of noise from the rest of the machine).
    assert!(after + (128 << 20) >= before, "before {before}, after {after}");
}
