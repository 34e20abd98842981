//! Small all-reduces on every GPU of the machine (one thread per GPU): NCCL's all-reduce on
//! registered `ncclMemAlloc` pool buffers next to a one-shot all-reduce over symmetric memory
//! (`mempool_nccl::symm`: every rank reads every rank's data through its peer mappings, with a
//! signal-pad barrier before and after). Results checked; bus bandwidth as nccl-tests computes
//! it (algbw × 2(n−1)/n), in one run.
//!
//! ```sh
//! cargo run --release --example symm_allreduce            # 4 KiB .. 1 MiB
//! cargo run --release --example symm_allreduce -- --iters 500
//! ```
//!
//! NVLink multicast is never forced on (NCCL decides; nothing here creates a multicast object).

use std::sync::{Arc, Barrier, Mutex};
use std::time::Instant;

use mempool_nccl::symm::symm_empty;
use mempool_nccl::{nccl_pool, Communicator, ReduceOp};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SIZES: [usize; 5] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20];

/// One size's seconds per call on one rank: NCCL's, the one-shot's, and the host's time to
/// queue each (time per call near the queueing time means the host is the bound).
struct Row {
    nccl: f64,
    symm: f64,
    /// The two-shot's (in place).
    two: f64,
    nccl_host: f64,
    symm_host: f64,
}

/// One rank: for every size, NCCL then symmetric memory, each timed over `iters` calls after a
/// checked warm-up; returns a row per size.
fn rank(comm: Communicator, iters: usize, barrier: Arc<Barrier>) -> Res<Vec<Row>> {
    let (r, world) = (comm.rank(), comm.world_size());
    let stream = comm.context().new_stream()?;
    // Buffers made on the stream the collectives run on (one made on another stream would be
    // ordered with it on every call: cudarc's slices synchronise a foreign stream after use).
    let alloc = mempool::Allocator::cuda(comm.device())?;
    let _current = alloc.set_stream(&stream)?;
    let pool = nccl_pool(comm.device())?;
    let _registration = comm.register_pool(&pool)?;
    let mut rows = Vec::new();
    for bytes in SIZES {
        let n = bytes / 4;
        let mine: Vec<f32> = (0..n).map(|i| ((i % 97) + r) as f32).collect();
        let want: Vec<f32> = (0..n).map(|i| (0..world).map(|q| ((i % 97) + q) as f32).sum()).collect();
        // NCCL on a registered pool buffer, in place.
        let mut buf = pool.alloc::<f32>(n)?;
        stream.memcpy_htod(&mine, &mut buf)?;
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &stream)?;
        if stream.clone_dtoh(&buf)? != want {
            return Err(format!("rank {r}: NCCL's sum is wrong at {bytes} bytes").into());
        }
        barrier.wait();
        stream.synchronize()?;
        let t = Instant::now();
        for _ in 0..iters {
            comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &stream)?;
        }
        let nccl_host = t.elapsed().as_secs_f64() / iters as f64;
        stream.synchronize()?;
        let nccl = t.elapsed().as_secs_f64() / iters as f64;
        // Symmetric memory, one-shot, into a buffer of this rank.
        let symm = symm_empty::<f32>(&comm, n, &stream)?;
        stream.memcpy_htod(&mine, &mut symm.peer(r, &stream)?)?;
        let mut out = alloc.alloc::<f32>(n)?;
        symm.one_shot_all_reduce(&mut out, &stream)?;
        if stream.clone_dtoh(&out)? != want {
            return Err(format!("rank {r}: the one-shot sum is wrong at {bytes} bytes").into());
        }
        barrier.wait();
        stream.synchronize()?;
        let t = Instant::now();
        for _ in 0..iters {
            symm.one_shot_all_reduce(&mut out, &stream)?;
        }
        let symm_host = t.elapsed().as_secs_f64() / iters as f64;
        stream.synchronize()?;
        let one_shot = t.elapsed().as_secs_f64() / iters as f64;
        // Two-shot, in place in the symmetric buffer (checked once; the timed calls go on
        // summing the sums).
        barrier.wait();
        stream.memcpy_htod(&mine, &mut symm.peer(r, &stream)?)?;
        symm.two_shot_all_reduce_in_place(&stream)?;
        if stream.clone_dtoh(&symm.peer(r, &stream)?)? != want {
            return Err(format!("rank {r}: the two-shot sum is wrong at {bytes} bytes").into());
        }
        barrier.wait();
        stream.synchronize()?;
        let t = Instant::now();
        for _ in 0..iters {
            symm.two_shot_all_reduce_in_place(&stream)?;
        }
        stream.synchronize()?;
        let two = t.elapsed().as_secs_f64() / iters as f64;
        rows.push(Row { nccl, symm: one_shot, two, nccl_host, symm_host });
        barrier.wait();
    }
    Ok(rows)
}

/// Bytes of each peer copy.
const COPY: usize = 64 << 20;

/// One rank's copy and barrier figures: GB/s reading the next rank's memory through its
/// symmetric mapping (a cudarc copy, so the copy engines), GB/s of `cuMemcpyPeerAsync` from a
/// plain `cuMemAlloc`-class buffer of the same rank (the driver's peer copy), and µs per
/// `SymmMemory::barrier` (stream memory operations).
fn copies_and_barriers(
    comm: &Communicator,
    iters: usize,
    barrier: &Barrier,
    plain: &Mutex<Vec<u64>>,
) -> Res<(f64, f64, f64)> {
    let (r, world) = (comm.rank(), comm.world_size());
    let peer = (r + 1) % world;
    let stream = comm.context().new_stream()?;
    let alloc = mempool::Allocator::cuda(comm.device())?;
    let _current = alloc.set_stream(&stream)?;
    let symm = symm_empty::<u8>(comm, COPY, &stream)?;
    let theirs = symm.peer(peer, &stream)?;
    let mut local = alloc.alloc::<u8>(COPY)?;
    let mine = alloc.alloc::<u8>(COPY)?;
    plain.lock().map_err(|_| "poisoned")?[r] = mine.device_ptr_raw();
    let time = |f: &mut dyn FnMut() -> Res<()>| -> Res<f64> {
        f()?;
        stream.synchronize()?;
        barrier.wait();
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        stream.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / iters as f64)
    };
    let symm_copy = time(&mut || Ok(stream.memcpy_dtod(&theirs, &mut local)?))?;
    let src = plain.lock().map_err(|_| "poisoned")?[peer];
    let peer_ctx = cudarc::driver::CudaContext::new(peer)?;
    let dst = local.device_ptr_raw();
    let driver_copy = time(&mut || {
        // SAFETY: `dst` is `COPY` bytes of this device owned by `local`, alive for the loop;
        // `src` is the peer's `mine`, `COPY` bytes its thread keeps alive until after the last
        // barrier below; both contexts are primary contexts held here; the stream is this
        // device's.
        let r = unsafe {
            cudarc::driver::sys::cuMemcpyPeerAsync(
                dst,
                comm.context().cu_ctx(),
                src,
                peer_ctx.cu_ctx(),
                COPY,
                stream.cu_stream(),
            )
        };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemcpyPeerAsync: {r:?}").into());
        }
        Ok(())
    })?;
    let barrier_call = time(&mut || Ok(symm.barrier(0, &stream)?))?;
    barrier.wait(); // every rank's copies from `mine` are done before it goes
    drop(mine);
    let gbps = |t: f64| COPY as f64 / t / 1e9;
    Ok((gbps(symm_copy), gbps(driver_copy), barrier_call * 1e6))
}

fn main() -> Res<()> {
    let mut iters = 200;
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, n] = &args[..] {
        if flag == "--iters" {
            iters = n.parse()?;
        }
    }
    let gpus = mempool::device_count()?;
    if gpus < 2 {
        println!("symm_allreduce needs two GPUs; this machine has {gpus}");
        return Ok(());
    }
    let comms = Communicator::all_local(&(0..gpus).collect::<Vec<_>>())?;
    let barrier = Arc::new(Barrier::new(gpus));
    let plain = Arc::new(Mutex::new(vec![0u64; gpus]));
    let threads: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let (b, plain) = (barrier.clone(), plain.clone());
            std::thread::spawn(move || -> Res<_> {
                let rows = rank(c.clone(), iters, b.clone())?;
                let copies = copies_and_barriers(&c, iters.min(100), &b, &plain)?;
                Ok((rows, copies))
            })
        })
        .collect();
    let mut results = Vec::new();
    let mut copies = Vec::new();
    for t in threads {
        let (rows, c) = t.join().map_err(|_| "a rank panicked")??;
        results.push(rows);
        copies.push(c);
    }
    let factor = 2.0 * (gpus as f64 - 1.0) / gpus as f64;
    println!("# {gpus} GPUs, float32 sum, {iters} calls per size; the slowest rank's time per call");
    println!(
        "{:>10} {:>12} {:>12} {:>12} {:>12} {:>8} {:>14} {:>14} {:>10} {:>10}",
        "bytes",
        "nccl_us",
        "nccl_busbw",
        "symm_us",
        "symm_busbw",
        "ratio",
        "nccl_host_us",
        "symm_host_us",
        "two_us",
        "two_ratio"
    );
    for (i, &bytes) in SIZES.iter().enumerate() {
        let slowest = |f: fn(&Row) -> f64| results.iter().map(|r| f(&r[i])).fold(0.0, f64::max);
        let (nccl, symm) = (slowest(|r| r.nccl), slowest(|r| r.symm));
        let (nccl_host, symm_host) = (slowest(|r| r.nccl_host), slowest(|r| r.symm_host));
        let two = slowest(|r| r.two);
        let bw = |t: f64| bytes as f64 / t / 1e9 * factor;
        println!(
            "{bytes:>10} {:>12.2} {:>12.2} {:>12.2} {:>12.2} {:>8.2} {:>14.2} {:>14.2} {:>10.2} {:>10.2}",
            nccl * 1e6,
            bw(nccl),
            symm * 1e6,
            bw(symm),
            nccl / symm,
            nccl_host * 1e6,
            symm_host * 1e6,
            two * 1e6,
            nccl / two
        );
    }
    println!("# peer copies of {} MiB (every rank reads the next one at once) and barriers", COPY >> 20);
    println!("{:>6} {:>16} {:>18} {:>8} {:>12}", "rank", "symm_copy_GB/s", "memcpy_peer_GB/s", "ratio", "barrier_us");
    for (r, (symm, driver, bar)) in copies.iter().enumerate() {
        println!("{r:>6} {symm:>16.1} {driver:>18.1} {:>8.3} {bar:>12.2}", symm / driver);
    }
    Ok(())
}
