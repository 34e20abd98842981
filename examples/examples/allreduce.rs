//! All-reduce across every GPU of the machine on `ncclMemAlloc` pool buffers registered with the
//! communicator, verified, with a bus-bandwidth table like nccl-tests' next to unregistered
//! default-pool buffers.
//!
//! ```sh
//! cargo run --release --example allreduce                 # one thread per GPU
//! cargo run --release --example allreduce -- --procs      # one process per GPU (launches itself)
//! torchrun --nproc-per-node 8 target/release/examples/allreduce   # or srun / mpirun: one rank each
//! ```
//! Options: `--min-mb N` (1), `--max-mb N` (1024), `--iters N` (20).
//!
//! NVLink multicast (NVLS) is never forced on: the example says whether this machine could use
//! it, and NCCL decides (`NCCL_NVLS_ENABLE` is left as the environment has it).

use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use cudarc::driver::{result, sys, CudaStream};
use mempool::{with_pool, Allocator, Buffer, MemPool};
use mempool_nccl::{nccl_pool, nccl_version, Communicator, ReduceOp};

#[derive(Clone, Copy, Debug)]
struct Opts {
    procs: bool,
    min_mb: usize,
    max_mb: usize,
    iters: usize,
}

fn opts() -> Result<Opts, String> {
    let mut o = Opts { procs: false, min_mb: 1, max_mb: 1024, iters: 20 };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> Result<usize, String> {
            args.next().and_then(|v| v.parse().ok()).ok_or_else(|| format!("{name} needs a number"))
        };
        match a.as_str() {
            "--procs" => o.procs = true,
            "--min-mb" => o.min_mb = num("--min-mb")?,
            "--max-mb" => o.max_mb = num("--max-mb")?,
            "--iters" => o.iters = num("--iters")?,
            other => return Err(format!("unknown option {other}; valid: --procs, --min-mb N, --max-mb N, --iters N")),
        }
    }
    Ok(o)
}

/// Waits for every rank: the threads' barrier, or a one-element all-reduce between processes.
enum Sync {
    Threads(Arc<Barrier>),
    Nccl,
}

impl Sync {
    fn wait(&self, comm: &Communicator, stream: &Arc<CudaStream>, alloc: &Allocator) -> mempool_nccl::Result<()> {
        match self {
            Sync::Threads(b) => {
                b.wait();
            }
            Sync::Nccl => {
                let mut x = alloc.alloc_zeros::<f32>(1)?;
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum, stream)?;
                stream.synchronize().map_err(|e| mempool_nccl::Error::Cuda(e.to_string()))?;
            }
        }
        Ok(())
    }
}

#[with_pool(nccl_pool)]
fn pool_buffers(
    nccl_pool: &MemPool,
    stream: &Arc<CudaStream>,
    n: usize,
    value: f32,
) -> mempool::Result<(Buffer<f32>, Buffer<f32>)> {
    let alloc = nccl_pool.allocator();
    let mut send = alloc.alloc::<f32>(n)?;
    let recv = alloc.alloc::<f32>(n)?;
    stream
        .memcpy_htod(&vec![value; n], &mut send)
        .map_err(|e| mempool::Error::Backend { op: "fill", message: e.to_string() })?;
    Ok((send, recv))
}

fn default_buffers(
    alloc: &Allocator,
    stream: &Arc<CudaStream>,
    n: usize,
    value: f32,
) -> mempool::Result<(Buffer<f32>, Buffer<f32>)> {
    let mut send = alloc.alloc::<f32>(n)?;
    let recv = alloc.alloc::<f32>(n)?;
    stream
        .memcpy_htod(&vec![value; n], &mut send)
        .map_err(|e| mempool::Error::Backend { op: "fill", message: e.to_string() })?;
    Ok((send, recv))
}

/// Time per all-reduce (seconds), after checking the first result.
fn measure(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    sync: &Sync,
    alloc: &Allocator,
    (send, mut recv): (Buffer<f32>, Buffer<f32>),
    want: f32,
    iters: usize,
) -> Result<f64, String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, stream).map_err(|x| e(&x))?;
    let got = stream.clone_dtoh(&recv).map_err(|x| e(&x))?;
    if let Some(bad) = got.iter().position(|x| *x != want) {
        return Err(format!("rank {}: element {bad} is {} instead of {want}", comm.rank(), got[bad]));
    }
    for _ in 0..4 {
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum, stream).map_err(|x| e(&x))?;
    }
    stream.synchronize().map_err(|x| e(&x))?;
    sync.wait(comm, stream, alloc).map_err(|x| e(&x))?;
    let t = Instant::now();
    for _ in 0..iters {
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum, stream).map_err(|x| e(&x))?;
    }
    stream.synchronize().map_err(|x| e(&x))?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

fn nvls_line(device: usize) -> String {
    let supported = result::device::get(device as i32)
        .and_then(|d| {
            // SAFETY: `d` is a valid device handle; the attribute query has no other effect.
            unsafe {
                result::device::get_attribute(d, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)
            }
        })
        .map(|v| v != 0)
        .unwrap_or(false);
    let env = std::env::var("NCCL_NVLS_ENABLE").ok();
    match (supported, env.as_deref()) {
        (false, _) => "NVLS: not possible here (the GPUs do not support multicast)".into(),
        (true, Some("0")) => {
            "NVLS: supported by the GPUs, but NCCL_NVLS_ENABLE=0 keeps it off (as set by the environment)".into()
        }
        (true, Some(v)) => format!("NVLS: supported by the GPUs; NCCL_NVLS_ENABLE={v}: NCCL decides"),
        (true, None) => "NVLS: supported by the GPUs; NCCL decides (NCCL_NVLS_ENABLE unset)".into(),
    }
}

fn run_rank(comm: Communicator, sync: Sync, o: Opts) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let (rank, world, dev) = (comm.rank(), comm.world_size(), comm.device());
    let alloc = Allocator::cuda(dev).map_err(|x| e(&x))?;
    let stream = alloc.current_stream();
    let pool = nccl_pool(dev).map_err(|x| e(&x))?;
    let registration = comm.register_pool(&pool).map_err(|x| e(&x))?;
    if rank == 0 {
        let (a, b, c) = nccl_version().map_err(|x| e(&x))?;
        println!(
            "# allreduce: {world} rank(s), NCCL {a}.{b}.{c}, {}",
            if matches!(sync, Sync::Threads(_)) { "one thread per GPU" } else { "one process per GPU" }
        );
        println!("# {}", nvls_line(dev));
        println!(
            "# float32 sum, out of place; time per call over {} calls after 5 warm-up calls; busbw = algbw * 2(n-1)/n",
            o.iters
        );
        println!(
            "{:>10} {:>10} {:>11} {:>11} {:>10} {:>11} {:>11}",
            "size", "reg_us", "reg_algbw", "reg_busbw", "def_us", "def_algbw", "def_busbw"
        );
        println!(
            "{:>10} {:>10} {:>11} {:>11} {:>10} {:>11} {:>11}",
            "(MiB)", "", "(GB/s)", "(GB/s)", "", "(GB/s)", "(GB/s)"
        );
    }
    let want = (world * (world + 1) / 2) as f32;
    let mut mb = o.min_mb.max(1);
    while mb <= o.max_mb {
        let n = mb << 18; // MiB of f32
        let bytes = (n * 4) as f64;
        let reg_buffers = pool_buffers(&pool, &stream, n, (rank + 1) as f32).map_err(|x| e(&x))?;
        let reg = measure(&comm, &stream, &sync, &alloc, reg_buffers, want, o.iters)?;
        let def_buffers = default_buffers(&alloc, &stream, n, (rank + 1) as f32).map_err(|x| e(&x))?;
        let def = measure(&comm, &stream, &sync, &alloc, def_buffers, want, o.iters)?;
        let factor = 2.0 * (world as f64 - 1.0) / world as f64;
        if rank == 0 {
            let (ra, da) = (bytes / reg / 1e9, bytes / def / 1e9);
            println!(
                "{mb:>10} {:>10.1} {ra:>11.1} {:>11.1} {:>10.1} {da:>11.1} {:>11.1}",
                reg * 1e6,
                ra * factor,
                def * 1e6,
                da * factor
            );
        }
        mb *= 2;
    }
    let errors = registration.take_errors();
    if !errors.is_empty() {
        return Err(format!("rank {rank}: registration errors: {errors:?}"));
    }
    if rank == 0 {
        println!("# registered segments on rank 0: {}; every result checked", registration.segments().len());
    }
    drop(registration);
    comm.destroy().map_err(|x| e(&x))
}

fn main() -> ExitCode {
    let o = match opts() {
        Ok(o) => o,
        Err(m) => {
            eprintln!("allreduce: {m}");
            return ExitCode::from(2);
        }
    };
    let gpus = match mempool::device_count() {
        Ok(n) if n > 0 => n,
        Ok(_) => {
            eprintln!(
                "allreduce: no CUDA GPU on this machine; this example needs at least one (ideally all of a node's)"
            );
            return ExitCode::FAILURE;
        }
        Err(err) => {
            eprintln!("allreduce: {err}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(err) = nccl_version() {
        eprintln!("allreduce: {err}");
        return ExitCode::FAILURE;
    }
    let outcome = if ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"].iter().any(|v| std::env::var(v).is_ok()) {
        // Launched as one rank (by --procs, torchrun, srun or mpirun).
        Communicator::from_env().map_err(|e| e.to_string()).and_then(|c| run_rank(c, Sync::Nccl, o))
    } else if o.procs {
        launch_processes(gpus)
    } else {
        run_threads(gpus, o)
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(m) => {
            eprintln!("allreduce: {m}");
            ExitCode::FAILURE
        }
    }
}

fn run_threads(gpus: usize, o: Opts) -> Result<(), String> {
    let devices: Vec<usize> = (0..gpus).collect();
    let comms = Communicator::all_local(&devices).map_err(|e| e.to_string())?;
    let barrier = Arc::new(Barrier::new(gpus));
    let threads: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let b = barrier.clone();
            std::thread::spawn(move || run_rank(c, Sync::Threads(b), o))
        })
        .collect();
    let mut first = Ok(());
    for t in threads {
        let r = t.join().unwrap_or_else(|_| Err("a rank thread panicked".into()));
        first = first.and(r);
    }
    first
}

/// Starts this program once per GPU with the launcher environment torchrun would set.
fn launch_processes(gpus: usize) -> Result<(), String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port for the NCCL bootstrap: {e}"))?
        .port();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--procs").collect();
    let mut children = Vec::new();
    for rank in 0..gpus {
        let child = std::process::Command::new(&exe)
            .args(&args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", gpus.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn()
            .map_err(|e| format!("starting rank {rank}: {e}"))?;
        children.push(child);
    }
    let mut failed = Vec::new();
    for (rank, mut c) in children.into_iter().enumerate() {
        match c.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("rank {rank}: {s}")),
            Err(e) => failed.push(format!("rank {rank}: {e}")),
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}
