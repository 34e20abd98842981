//! All-reduce across every GPU of the machine on `ncclMemAlloc` pool buffers registered with the
//! communicator (and as symmetric windows), on an expandable registered pool (memory mapped on
//! demand, each physical allocation registered), verified, with a bus-bandwidth table like
//! nccl-tests' next to unregistered default-pool buffers, and mempool's own one-shot and
//! two-shot kernels over symmetric memory (`mempool_nccl::symm`, between threads or processes).
//!
//! ```sh
//! cargo run --release --example allreduce                 # one thread per GPU
//! cargo run --release --example allreduce -- --procs      # one process per GPU (launches itself)
//! torchrun --nproc-per-node 8 target/release/examples/allreduce   # or srun / mpirun: one rank each
//! ```
//! Options: `--min-mb N` (1), `--max-mb N` (1024), `--iters N` (20 timed calls per measurement at
//! 16 MiB and up; below, `N × 16 / MiB`, so that a latency-bound size is timed over as long as
//! 16 MiB is and its ratios are not one scheduling hiccup's), `--no-window` (skip the
//! symmetric-window column, which needs NCCL 2.27+), `--no-symm` (skip the symmetric-memory
//! kernels' columns).
//!
//! NVLink multicast (NVLS) is never forced on: the example says whether this machine could use
//! it, and NCCL decides (`NCCL_NVLS_ENABLE` is left as the environment has it).

use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use cudarc::driver::{result, sys, CudaStream};
use mempool::{with_pool, Allocator, Buffer, MemPool, PoolOptions};
use mempool_nccl::symm::{symm_empty, SymmMemory};
use mempool_nccl::{nccl_pool, nccl_pool_with, nccl_version, Communicator, ReduceOp};

#[derive(Clone, Copy, Debug)]
struct Opts {
    procs: bool,
    window: bool,
    symm: bool,
    min_mb: usize,
    max_mb: usize,
    iters: usize,
}

fn opts() -> Result<Opts, String> {
    let mut o = Opts { procs: false, window: true, symm: true, min_mb: 1, max_mb: 1024, iters: 20 };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> Result<usize, String> {
            args.next().and_then(|v| v.parse().ok()).ok_or_else(|| format!("{name} needs a number"))
        };
        match a.as_str() {
            "--procs" => o.procs = true,
            "--no-window" => o.window = false,
            "--no-symm" => o.symm = false,
            "--min-mb" => o.min_mb = num("--min-mb")?,
            "--max-mb" => o.max_mb = num("--max-mb")?,
            "--iters" => o.iters = num("--iters")?,
            other => {
                return Err(format!(
                    "unknown option {other}; valid: --procs, --no-window, --no-symm, --min-mb N, --max-mb N, --iters N"
                ))
            }
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
                stream.synchronize().map_err(mempool_nccl::Error::cuda)?;
            }
        }
        Ok(())
    }
}

#[with_pool(nccl_pool)]
fn pool_buffer(nccl_pool: &MemPool, stream: &Arc<CudaStream>, n: usize, value: f32) -> mempool::Result<Buffer<f32>> {
    let mut b = nccl_pool.allocator().alloc::<f32>(n)?;
    stream.memcpy_htod(&vec![value; n], &mut b).map_err(|e| mempool::Error::caused_by("fill", e))?;
    Ok(b)
}

fn default_buffer(alloc: &Allocator, stream: &Arc<CudaStream>, n: usize, value: f32) -> mempool::Result<Buffer<f32>> {
    let mut b = alloc.alloc::<f32>(n)?;
    stream.memcpy_htod(&vec![value; n], &mut b).map_err(|e| mempool::Error::caused_by("fill", e))?;
    Ok(b)
}

/// Time per in-place all-reduce (seconds, as PyTorch's `dist.all_reduce`), after checking the
/// first result.
fn measure(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    sync: &Sync,
    alloc: &Allocator,
    buf: &mut Buffer<f32>,
    iters: usize,
) -> Result<f64, String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let world = comm.world_size();
    let want = (world * (world + 1) / 2) as f32;
    comm.all_reduce_in_place(buf, ReduceOp::Sum, stream).map_err(|x| e(&x))?;
    let got = stream.clone_dtoh(&*buf).map_err(|x| e(&x))?;
    if let Some(bad) = got.iter().position(|x| *x != want) {
        return Err(format!("rank {}: element {bad} is {} instead of {want}", comm.rank(), got[bad]));
    }
    for _ in 0..4 {
        comm.all_reduce_in_place(buf, ReduceOp::Sum, stream).map_err(|x| e(&x))?;
    }
    stream.synchronize().map_err(|x| e(&x))?;
    sync.wait(comm, stream, alloc).map_err(|x| e(&x))?;
    let t = Instant::now();
    for _ in 0..iters {
        comm.all_reduce_in_place(buf, ReduceOp::Sum, stream).map_err(|x| e(&x))?;
    }
    stream.synchronize().map_err(|x| e(&x))?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

/// Seconds per call of mempool's one-shot (out of place, into `out`) or two-shot (in place)
/// all-reduce over `symm`, whose data every rank filled with its rank + 1: the first call
/// checked, then `iters` timed after a wait for every rank.
#[allow(clippy::too_many_arguments)]
fn measure_symm(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    sync: &Sync,
    alloc: &Allocator,
    symm: &SymmMemory<f32>,
    out: &mut Buffer<f32>,
    two_shot: bool,
    iters: usize,
) -> Result<f64, String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let world = comm.world_size();
    let want = (world * (world + 1) / 2) as f32;
    let call = |out: &mut Buffer<f32>| {
        if two_shot {
            symm.two_shot_all_reduce_in_place(stream)
        } else {
            symm.one_shot_all_reduce(out, stream)
        }
    };
    call(out).map_err(|x| e(&x))?;
    let got = if two_shot {
        stream.clone_dtoh(&symm.peer(comm.rank(), stream).map_err(|x| e(&x))?).map_err(|x| e(&x))?
    } else {
        stream.clone_dtoh(&*out).map_err(|x| e(&x))?
    };
    if let Some(bad) = got.iter().position(|x| *x != want) {
        let what = if two_shot { "two-shot" } else { "one-shot" };
        return Err(format!("rank {}: {what}: element {bad} is {} instead of {want}", comm.rank(), got[bad]));
    }
    stream.synchronize().map_err(|x| e(&x))?;
    sync.wait(comm, stream, alloc).map_err(|x| e(&x))?;
    let t = Instant::now();
    for _ in 0..iters {
        call(out).map_err(|x| e(&x))?;
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
    // Whole-segment buffers for windows: a window covers its buffer rounded up to the allocation
    // granularity, inside one ncclMemAlloc segment (a no_split pool's buffer owns its segment).
    let win_pool = nccl_pool_with(dev, PoolOptions::new().no_split(true)).map_err(|x| e(&x))?;
    // Expandable: mapped on demand, each physical allocation registered as it is mapped.
    let exp_pool = nccl_pool_with(dev, PoolOptions::new().expandable(true)).map_err(|x| e(&x))?;
    let exp_registration = comm.register_pool(&exp_pool).map_err(|x| e(&x))?;
    if rank == 0 {
        let (a, b, c) = nccl_version().map_err(|x| e(&x))?;
        let how = if matches!(sync, Sync::Threads(_)) { "one thread per GPU" } else { "one process per GPU" };
        println!("# allreduce: {world} rank(s), NCCL {a}.{b}.{c}, {how}");
        println!("# {}", nvls_line(dev));
        println!(
            "# float32 sum, in place; time per call over {} calls ({} x 16/MiB below 16 MiB) after 5 checked/warm-up calls; busbw = algbw * 2(n-1)/n",
            o.iters, o.iters
        );
        println!("# reg: ncclMemAlloc pool buffer registered (ncclCommRegister); exp: expandable nccl_pool buffer registered; win: symmetric window (ncclCommWindowRegister); def: default pool, unregistered");
        println!("# reg and exp are measured in turns, twice each; the faster of each pair is shown; exp/reg = their busbw ratio");
        println!("# 1shot / 2shot: mempool's one-shot (out of place) and two-shot (in place) kernels over symmetric memory (mempool_nccl::symm), no NCCL in the loop");
        println!(
            "{:>6} | {:>9} {:>9} {:>9} | {:>9} {:>9} {:>7} | {:>9} {:>9} | {:>9} {:>9} {:>9} | {:>9} {:>10} {:>9} {:>10}",
            "MiB",
            "reg_us",
            "reg_algbw",
            "reg_busbw",
            "exp_us",
            "exp_busbw",
            "exp/reg",
            "win_us",
            "win_busbw",
            "def_us",
            "def_algbw",
            "def_busbw",
            "1shot_us",
            "1shot_busbw",
            "2shot_us",
            "2shot_busbw"
        );
    }
    // Symmetric memory needs every rank on this machine (launchers across nodes: the columns
    // say "-").
    let symm_here = o.symm && mempool_nccl::symm::same_machine(&comm, &stream).map_err(|x| e(&x))?;
    let factor = 2.0 * (world as f64 - 1.0) / world as f64;
    let mut mb = o.min_mb.max(1);
    while mb <= o.max_mb {
        let n = mb << 18; // MiB of f32
        let iters = o.iters * (16 / mb).max(1); // the same on every rank: the calls are collective
        let bytes = (n * 4) as f64;
        let value = (rank + 1) as f32;
        let mut reg_buf = pool_buffer(&pool, &stream, n, value).map_err(|x| e(&x))?;
        let mut exp_buf = pool_buffer(&exp_pool, &stream, n, value).map_err(|x| e(&x))?;
        let (mut reg, mut exp) = (f64::INFINITY, f64::INFINITY);
        let fill = vec![value; n];
        for round in 0..2 {
            if round > 0 {
                // `measure` checks its first result: fresh inputs.
                stream.memcpy_htod(&fill, &mut reg_buf).map_err(|x| e(&x))?;
                stream.memcpy_htod(&fill, &mut exp_buf).map_err(|x| e(&x))?;
            }
            reg = reg.min(measure(&comm, &stream, &sync, &alloc, &mut reg_buf, iters)?);
            exp = exp.min(measure(&comm, &stream, &sync, &alloc, &mut exp_buf, iters)?);
        }
        drop((reg_buf, exp_buf));
        let win = if o.window {
            let mut buf = pool_buffer(&win_pool, &stream, n, value).map_err(|x| e(&x))?;
            // The window borrows the buffer until it is deregistered; collectives use it through it.
            let mut window = comm.register_window(&mut buf, &stream).map_err(|x| e(&x))?;
            let t = measure(&comm, &stream, &sync, &alloc, &mut window, iters)?;
            window.deregister().map_err(|x| e(&x))?;
            Some(t)
        } else {
            None
        };
        let mut def_buf = default_buffer(&alloc, &stream, n, value).map_err(|x| e(&x))?;
        let def = measure(&comm, &stream, &sync, &alloc, &mut def_buf, iters)?;
        drop(def_buf);
        let symm = if symm_here {
            // Collective, like the communicator's calls: every rank, the same size.
            let symm = symm_empty::<f32>(&comm, n, &stream).map_err(|x| e(&x))?;
            let mut out = default_buffer(&alloc, &stream, n, 0.0).map_err(|x| e(&x))?;
            let mut times = [0.0; 2];
            for (two_shot, t) in [false, true].into_iter().zip(&mut times) {
                stream.memcpy_htod(&fill, &mut symm.peer(rank, &stream).map_err(|x| e(&x))?).map_err(|x| e(&x))?;
                *t = measure_symm(&comm, &stream, &sync, &alloc, &symm, &mut out, two_shot, iters)?;
            }
            Some(times)
        } else {
            None
        };
        if rank == 0 {
            let (ra, da) = (bytes / reg / 1e9, bytes / def / 1e9);
            let (wu, wb) = match win {
                Some(w) => (format!("{:.1}", w * 1e6), format!("{:.1}", bytes / w / 1e9 * factor)),
                None => ("-".into(), "-".into()),
            };
            let ea = bytes / exp / 1e9;
            let symm_cols: Vec<String> = match symm {
                Some(ts) => ts
                    .iter()
                    .flat_map(|t| [format!("{:.1}", t * 1e6), format!("{:.1}", bytes / t / 1e9 * factor)])
                    .collect(),
                None => vec!["-".into(); 4],
            };
            println!(
                "{mb:>6} | {:>9.1} {ra:>9.1} {:>9.1} | {:>9.1} {:>9.1} {:>7.3} | {wu:>9} {wb:>9} | {:>9.1} {da:>9.1} {:>9.1} | {:>9} {:>10} {:>9} {:>10}",
                reg * 1e6,
                ra * factor,
                exp * 1e6,
                ea * factor,
                ea / ra,
                def * 1e6,
                da * factor,
                symm_cols[0],
                symm_cols[1],
                symm_cols[2],
                symm_cols[3]
            );
        }
        mb *= 2;
    }
    let mut errors = registration.take_errors();
    errors.extend(exp_registration.take_errors());
    if !errors.is_empty() {
        return Err(format!("rank {rank}: registration errors: {errors:?}"));
    }
    if rank == 0 {
        println!(
            "# registered on rank 0: {} ncclMemAlloc segments, {} physical allocations of the expandable pool; every result checked",
            registration.segments().len(),
            exp_registration.segments().len()
        );
    }
    drop((registration, exp_registration));
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
