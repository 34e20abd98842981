//! Host memory for a GPU program: pinned staging buffers whose reuse waits for the copies that
//! read them, and a region of code routed to memory on a host NUMA node.
//!
//!     cargo run --release --example host_memory
//!
//! Needs a CUDA GPU; says what the machine supports and skips what it does not.

use std::sync::Arc;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use mempool::backend::host_numa::{probe, HostNumaAllocator};
use mempool::{Allocator, MemPool, PoolOptions};

/// `read_sum(const uint4* src, u64 n, u32* out)`: every thread reads 16-byte words of `src`
/// (grid-stride) and writes the xor of what it read to `out[thread]` (so nothing is skipped).
const READ_SUM: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry read_sum(.param .u64 p_src, .param .u64 p_n, .param .u64 p_out)
{
    .reg .pred %p<2>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<10>;
    ld.param.u64 %rd1, [p_src];
    ld.param.u64 %rd2, [p_n];
    ld.param.u64 %rd3, [p_out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mad.lo.u32 %r4, %r1, %r2, %r3;
    mov.u32 %r5, %nctaid.x;
    mul.lo.u32 %r6, %r5, %r2;
    cvt.u64.u32 %rd4, %r4;
    cvt.u64.u32 %rd5, %r6;
    mov.u32 %r7, 0;
LOOP:
    setp.ge.u64 %p1, %rd4, %rd2;
    @%p1 bra DONE;
    shl.b64 %rd6, %rd4, 4;
    add.u64 %rd7, %rd1, %rd6;
    ld.global.v4.u32 {%r8, %r9, %r10, %r11}, [%rd7];
    xor.b32 %r7, %r7, %r8;
    xor.b32 %r7, %r7, %r9;
    xor.b32 %r7, %r7, %r10;
    xor.b32 %r7, %r7, %r11;
    add.u64 %rd4, %rd4, %rd5;
    bra LOOP;
DONE:
    cvt.u64.u32 %rd8, %r4;
    shl.b64 %rd8, %rd8, 2;
    add.u64 %rd9, %rd3, %rd8;
    st.global.u32 [%rd9], %r7;
    ret;
}
"#;

/// Bandwidth of a kernel reading all of `src` (host memory read over the bus, or device
/// memory), best of 10, in GB/s.
fn kernel_read(gpu: &Allocator, src: &mempool::Buffer<u8>) -> Result<f64, Box<dyn std::error::Error>> {
    let ctx = gpu.context();
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(READ_SUM))?;
    let f = module.load_function("read_sum")?;
    let sms = ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
    let cfg = LaunchConfig { grid_dim: (sms * 8, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let stream = gpu.current_stream();
    let mut out = gpu.alloc::<u32>((sms * 8 * 256) as usize)?;
    let (ptr, n) = (src.device_ptr_raw(), (src.num_bytes() / 16) as u64);
    let mut t = f64::MAX;
    for _ in 0..10 {
        stream.synchronize()?;
        let start = std::time::Instant::now();
        let mut launch = stream.launch_builder(&f);
        launch.arg(&ptr).arg(&n).arg(&mut out);
        // SAFETY: read_sum takes (const uint4*, u64, u32*): `ptr` holds `n` 16-byte words the
        // device can read (device memory, or host memory mapped for it), `out` one u32 per
        // thread of the grid; `src` is not written meanwhile.
        unsafe { launch.launch(cfg) }?;
        stream.synchronize()?;
        t = t.min(start.elapsed().as_secs_f64());
    }
    Ok(src.num_bytes() as f64 / t / 1e9)
}

/// Host-to-device copy bandwidth out of pinned memory (`cuMemHostAlloc`) and out of the host-NUMA
/// pool, the same way (copy engine, 256 MiB, best of 10), in the same run.
fn bandwidth(gpu: &Allocator, pinned: &Allocator, numa: &MemPool) -> Result<(), Box<dyn std::error::Error>> {
    const BYTES: usize = 256 << 20;
    let stream = gpu.current_stream();
    let mut dst = gpu.alloc::<u8>(BYTES)?;
    let from_pinned = pinned.alloc_zeros::<u8>(BYTES)?;
    let from_numa = {
        let _in = numa.scope();
        gpu.alloc_zeros::<u8>(BYTES)?
    };
    let mut best = |src: &mempool::Buffer<u8>| -> Result<f64, Box<dyn std::error::Error>> {
        let mut t = f64::MAX;
        for _ in 0..10 {
            stream.synchronize()?;
            let start = std::time::Instant::now();
            stream.memcpy_dtod(src, &mut dst)?;
            stream.synchronize()?;
            t = t.min(start.elapsed().as_secs_f64());
        }
        Ok(BYTES as f64 / t / 1e9)
    };
    let (p, n) = (best(&from_pinned)?, best(&from_numa)?);
    println!("host-to-device copies: pinned {p:.1} GB/s, host-NUMA pool {n:.1} GB/s ({:.0}% of pinned)", n / p * 100.0);
    // A kernel reading host memory directly (zero-copy): the host-NUMA pool's buffer against
    // the copy engine's host-to-device bandwidth out of pinned memory, and pinned memory read
    // the same way.
    let (kn, kp, kd) = (kernel_read(gpu, &from_numa)?, kernel_read(gpu, &from_pinned)?, kernel_read(gpu, &dst)?);
    println!(
        "kernel reads: host-NUMA pool {kn:.1} GB/s ({:.0}% of pinned host-to-device copies), pinned {kp:.1} GB/s, \
         device memory {kd:.1} GB/s",
        kn / p * 100.0
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gpu = match Allocator::cuda(0) {
        Ok(a) => a,
        Err(e) => {
            println!("no CUDA GPU here ({e}): nothing to show");
            return Ok(());
        }
    };
    let stream = gpu.current_stream();

    // Pinned staging: fill on the host, copy to the device asynchronously, drop at once.
    let pinned = Allocator::pinned(0)?;
    let mut staging = pinned.alloc::<f32>(1 << 20)?;
    staging.host_slice_mut()?.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
    let mut weights = gpu.alloc::<f32>(1 << 20)?;
    stream.memcpy_dtod(&staging, &mut weights)?;
    drop(staging); // its memory is handed out again only after the copy has read it
    let back = stream.clone_dtoh(&weights)?;
    println!("pinned staging: copied {} floats, last {}", back.len(), back[back.len() - 1]);

    // A region routed to host-NUMA memory (Extended GPU Memory on Grace; the near node elsewhere).
    let support = probe(0)?;
    println!("{support}");
    if !support.virtual_memory {
        println!("host-NUMA pools need host-NUMA virtual memory: skipped");
        return Ok(());
    }
    let numa = Arc::new(HostNumaAllocator::new(0, None)?);
    let offload = MemPool::on(&gpu, PoolOptions::new().shared_allocator(numa.clone()))?;
    let optimizer_state = {
        let _in = offload.scope(); // allocations of this thread on this stream go to host memory
        gpu.alloc_zeros::<f32>(16 << 20)?
    };
    let in_gpu_memory = gpu.alloc::<f32>(1 << 20)?; // outside the scope: device memory
    bandwidth(&gpu, &pinned, &offload)?;
    println!(
        "optimizer state: {} MiB on host NUMA node {} (pool {} reserves {} MiB); device buffer at {:#x}",
        (optimizer_state.len() * 4) >> 20,
        numa.node(),
        offload.id().0,
        offload.memory_stats().reserved_bytes.current >> 20,
        in_gpu_memory.device_ptr_raw()
    );
    Ok(())
}
