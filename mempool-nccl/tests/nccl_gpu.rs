//! On GPUs with NCCL (the `nvidia-h200-x2` machine, through `shared/tools/gpu-bundle`):
//! all-reduce correctness on registered pool buffers, registration of segments allocated later,
//! deregistration before every `ncclMemFree`, communicator destruction, and the launcher
//! environment with two processes.

mod common;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use mempool::{with_pool, Allocator, BackendError, Buffer, MemPool, PoolOptions, RawAllocator, StreamId};
use mempool_nccl::{
    nccl_pool, nccl_pool_with, nccl_registers_spans, Bf16, Communicator, NcclMapGuard, NcclMemAllocator, NcclType,
    ReduceOp, Registration,
};

fn gpus() -> usize {
    mempool::device_count().expect("a CUDA driver")
}

/// Runs `f(comm)` on one thread per local GPU, communicators from `ncclCommInitAll`.
fn on_every_gpu<T: Send + 'static>(f: impl Fn(Communicator) -> T + Send + Sync + 'static) -> Vec<T> {
    let devices: Vec<usize> = (0..gpus()).collect();
    common::on_gpus(&devices, f).into_iter().map(|r| r.unwrap_or_else(|p| panic!("rank thread: {p}"))).collect()
}

#[with_pool(pool)]
fn filled<T: NcclType + Copy>(pool: &MemPool, stream: &Arc<CudaStream>, value: T, n: usize) -> Buffer<T> {
    let mut b = pool.allocator().alloc::<T>(n).expect("alloc");
    stream.memcpy_htod(&vec![value; n], &mut b).expect("copy");
    b
}

fn check_all_reduce<T: NcclType + Copy + PartialEq + std::fmt::Debug>(
    comm: &Communicator,
    pool: &MemPool,
    stream: &Arc<CudaStream>,
    mine: T,
    want: T,
) {
    let n = 1 << 20;
    let send = filled(pool, stream, mine, n);
    let mut recv = filled(pool, stream, mine, n);
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum, stream).expect("all_reduce");
    let got = stream.clone_dtoh(&recv).expect("copy back");
    assert!(got.iter().all(|x| *x == want), "out of place: {:?} != {want:?}", got[0]);
    let mut inplace = filled(pool, stream, mine, n);
    comm.all_reduce_in_place(&mut inplace, ReduceOp::Sum, stream).expect("all_reduce in place");
    let got = stream.clone_dtoh(&inplace).expect("copy back");
    assert!(got.iter().all(|x| *x == want), "in place: {:?} != {want:?}", got[0]);
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL"]
fn all_reduce_on_registered_pool_buffers_threads() {
    let world = gpus();
    let results = on_every_gpu(move |comm| {
        let rank = comm.rank();
        let alloc = Allocator::cuda(comm.device()).unwrap();
        let stream = alloc.current_stream();
        let pool = nccl_pool(comm.device()).unwrap();
        let reg = comm.register_pool(&pool).unwrap();
        let sum_ranks: i32 = (0..world as i32).map(|r| r + 1).sum();
        check_all_reduce(&comm, &pool, &stream, 1.5f32 * (rank + 1) as f32, 1.5 * sum_ranks as f32);
        check_all_reduce(&comm, &pool, &stream, (rank as i32 + 1) * 7, sum_ranks * 7);
        check_all_reduce(&comm, &pool, &stream, Bf16::from_f32((rank + 1) as f32), Bf16::from_f32(sum_ranks as f32));
        // A segment allocated after the registration is registered before its first collective.
        let big = filled(&pool, &stream, 1.0f32, 48 << 20);
        let seg = pool
            .snapshot()
            .segments
            .iter()
            .find(|s| s.address <= big.device_ptr_raw() && big.device_ptr_raw() < s.address + s.total_size as u64)
            .map(|s| s.address)
            .unwrap();
        assert!(reg.segments().iter().any(|s| s.0 == seg), "a new segment was not registered before use");
        let mut big = big;
        comm.all_reduce_in_place(&mut big, ReduceOp::Sum, &stream).unwrap();
        let got = stream.clone_dtoh(&big).unwrap();
        assert!(got.iter().all(|x| *x == world as f32));
        // A buffer of another device, or too short, is refused before NCCL is called.
        let short = filled(&pool, &stream, 0f32, 10);
        let mut out = filled(&pool, &stream, 0f32, 5);
        let e = comm.all_reduce(&short, &mut out, ReduceOp::Sum, &stream).unwrap_err();
        assert!(e.to_string().contains("needs 10 elements, but the buffer holds 5"), "{e}");
        if world > 1 {
            // A buffer of another device: refused before NCCL is called.
            let other = (comm.device() + 1) % world;
            let mut theirs = Allocator::cuda(other).unwrap().alloc::<f32>(16).unwrap();
            let e = comm.all_reduce_in_place(&mut theirs, ReduceOp::Sum, &stream).unwrap_err();
            assert_eq!(
                e,
                mempool_nccl::Error::WrongDevice { what: "all_reduce_in_place", expected: comm.device(), found: other }
            );
        }
        assert!(reg.take_errors().is_empty(), "{:?}", reg.take_errors());
        stream.synchronize().unwrap();
        rank
    });
    assert_eq!(results, (0..world).collect::<Vec<_>>());
}

/// The physical allocations of `pool` under `buf`.
fn mappings_under(pool: &MemPool, ptr: u64, bytes: usize) -> Vec<(u64, usize)> {
    let snap = pool.snapshot();
    let maps = snap.segments.iter().flat_map(|s| s.mappings.iter().copied());
    maps.filter(|&(a, s)| a < ptr + bytes as u64 && ptr < a + s as u64).collect()
}

/// All-reduces on an expandable registered `nccl_pool` (every buffer inside one physical
/// allocation, each registered) and on an expandable pool whose buffers may span two
/// (registered piece by piece: NCCL before 2.29.2 must not take such a buffer zero-copy, and the
/// result shows whether it did), results checked; then everything is deregistered before it is
/// unmapped.
fn check_expandable_pools(comm: &Communicator) {
    let world = comm.world_size();
    let dev = comm.device();
    let alloc = Allocator::cuda(dev).unwrap();
    let stream = alloc.current_stream();
    let rank = comm.rank();
    let sum_ranks: i32 = (0..world as i32).map(|r| r + 1).sum();
    let pool = nccl_pool_with(dev, PoolOptions::new().expandable(true)).unwrap();
    let reg = comm.register_pool(&pool).unwrap();
    check_all_reduce(comm, &pool, &stream, 1.5f32 * (rank + 1) as f32, 1.5 * sum_ranks as f32);
    check_all_reduce(comm, &pool, &stream, (rank as i32 + 1) * 7, sum_ranks * 7);
    // 30 MiB: one physical allocation of its own when NCCL needs that, and registered.
    let mut big = filled(&pool, &stream, (rank + 1) as f32, 30 << 18);
    let (ptr, bytes) = (big.device_ptr_raw(), 30 << 20);
    let under = mappings_under(&pool, ptr, bytes);
    assert_eq!(under.len(), 1, "a buffer spans physical allocations: {under:?}");
    let _ = nccl_registers_spans().unwrap();
    for m in &under {
        assert!(reg.segments().contains(m), "{m:x?} is not registered: {:x?}", reg.segments());
    }
    comm.all_reduce_in_place(&mut big, ReduceOp::Sum, &stream).unwrap();
    let got = stream.clone_dtoh(&big).unwrap();
    assert!(got.iter().all(|x| *x == sum_ranks as f32), "rank {rank}: {}", got[0]);
    drop(big);
    // A pool whose buffers span physical allocations (20 MiB each for large blocks).
    let spans = MemPool::on(&alloc, PoolOptions::new().expandable(true).map_guard(NcclMapGuard)).unwrap();
    let sreg = comm.register_pool(&spans).unwrap();
    let mut wide = filled(&spans, &stream, (rank + 1) as f32, 30 << 18);
    let under = mappings_under(&spans, wide.device_ptr_raw(), 30 << 20);
    assert!(under.len() >= 2, "meant to span two physical allocations: {under:?}");
    for m in &under {
        assert!(sreg.segments().contains(m), "{m:x?} is not registered");
    }
    comm.all_reduce_in_place(&mut wide, ReduceOp::Sum, &stream).unwrap();
    let got = stream.clone_dtoh(&wide).unwrap();
    let bad = got.iter().position(|x| *x != sum_ranks as f32);
    assert!(bad.is_none(), "rank {rank}: element {bad:?} of a spanning buffer is {}", got[bad.unwrap_or(0)]);
    stream.synchronize().unwrap();
    drop(wide);
    spans.empty_cache().unwrap();
    assert!(sreg.segments().is_empty(), "unmapped memory still registered: {:x?}", sreg.segments());
    assert!(sreg.take_errors().is_empty() && reg.take_errors().is_empty());
    // Every rank is done with the collectives before memory goes.
    let mut one = filled(&pool, &stream, 1f32, 1);
    comm.all_reduce_in_place(&mut one, ReduceOp::Sum, &stream).unwrap();
    stream.synchronize().unwrap();
    drop(one);
    pool.empty_cache().unwrap();
    let left = reg.segments();
    let snap: Vec<(u64, usize)> = pool.snapshot().segments.iter().flat_map(|s| s.mappings.clone()).collect();
    assert_eq!(left, snap, "registered exactly what is still mapped");
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL"]
fn all_reduce_on_expandable_registered_pools_threads() {
    on_every_gpu(|comm| check_expandable_pools(&comm));
}

/// `ncclMemAlloc`, checking at every free that no registration still holds the segment.
struct CheckedNccl {
    inner: NcclMemAllocator,
    registration: Arc<OnceLock<Registration>>,
    frees: Arc<Mutex<usize>>,
}

// SAFETY: forwards to `NcclMemAllocator`, whose own `unsafe impl` holds; `free` passes the
// caller's promise on unchanged.
unsafe impl RawAllocator for CheckedNccl {
    fn name(&self) -> &str {
        "checked-ncclMemAlloc"
    }
    fn alloc(&self, size: usize, device: usize, stream: StreamId) -> Result<u64, BackendError> {
        self.inner.alloc(size, device, stream)
    }
    unsafe fn free(&self, ptr: u64, size: usize, device: usize, stream: StreamId) -> Result<(), BackendError> {
        if let Some(r) = self.registration.get() {
            assert!(!r.segments().iter().any(|s| s.0 == ptr), "segment {ptr:#x} still registered at ncclMemFree");
        }
        *self.frees.lock().unwrap() += 1;
        // SAFETY: the caller's promise for this free is the inner allocator's.
        unsafe { self.inner.free(ptr, size, device, stream) }
    }
    fn granularity(&self) -> usize {
        self.inner.granularity()
    }
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL"]
fn every_segment_is_deregistered_before_ncclmemfree_and_destroy_cleans_up() {
    on_every_gpu(|comm| {
        let dev = comm.device();
        let alloc = Allocator::cuda(dev).unwrap();
        let stream = alloc.current_stream();
        let registration = Arc::new(OnceLock::new());
        let frees = Arc::new(Mutex::new(0));
        let raw = CheckedNccl {
            inner: NcclMemAllocator::new(dev).unwrap(),
            registration: registration.clone(),
            frees: frees.clone(),
        };
        let pool = MemPool::on(&alloc, PoolOptions::new().allocator(raw)).unwrap();
        let a = filled(&pool, &stream, 1f32, 1 << 20);
        registration.set(comm.register_pool(&pool).unwrap()).ok();
        let b = filled(&pool, &stream, 1f32, 40 << 20);
        let reg = registration.get().unwrap();
        assert_eq!(reg.segments().len(), 2);
        drop(b);
        pool.empty_cache().unwrap(); // the 40 MiB segment: deregistered, then freed (checked)
        assert_eq!(*frees.lock().unwrap(), 1);
        assert_eq!(reg.segments().len(), 1);
        let mut c = filled(&pool, &stream, 2f32, 1 << 10);
        comm.all_reduce_in_place(&mut c, ReduceOp::Max, &stream).unwrap();
        stream.synchronize().unwrap();
        // Destroying the communicator deregisters what is left, without error.
        comm.destroy().unwrap();
        assert!(reg.segments().is_empty());
        assert!(reg.take_errors().is_empty());
        drop((a, c));
        drop(pool); // the remaining segments (a's, and c's small one) go back: no registration holds them
        assert_eq!(*frees.lock().unwrap(), 3);
    });
}

const CHILD: &str = "MEMPOOL_NCCL_TEST_CHILD";

#[test]
#[ignore = "needs CUDA GPUs and NCCL"]
fn environment_bootstrap_with_two_processes() {
    if gpus() < 2 {
        eprintln!("one GPU here: two processes need two");
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args(["child_rank_from_environment", "--exact", "--include-ignored", "--nocapture"])
                .env(CHILD, "1")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(180);
    for mut c in children {
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                assert!(status.success(), "a rank process failed: {status}");
                break;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!("a rank process did not finish in time");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// One rank of `environment_bootstrap_with_two_processes` (does nothing unless launched by it).
#[test]
#[ignore = "needs CUDA GPUs and NCCL"]
fn child_rank_from_environment() {
    if std::env::var(CHILD).is_err() {
        return;
    }
    let comm = Communicator::from_env().expect("communicator from the environment");
    assert_eq!(comm.world_size(), 2);
    let pool = nccl_pool(comm.device()).unwrap();
    let _reg = comm.register_pool(&pool).unwrap();
    let stream = pool.allocator().current_stream();
    let mut b = filled(&pool, &stream, (comm.rank() + 1) as f32, 1 << 20);
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &stream).unwrap();
    let got = stream.clone_dtoh(&b).unwrap();
    assert!(got.iter().all(|x| *x == 3.0), "rank {} got {}", comm.rank(), got[0]);
    check_expandable_pools(&comm);
    comm.destroy().unwrap();
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL"]
fn window_registration_checks_its_rules_on_every_rank() {
    on_every_gpu(|comm| {
        let dev = comm.device();
        let alloc = Allocator::cuda(dev).unwrap();
        let stream = alloc.current_stream();
        let whole = mempool_nccl::nccl_pool_with(dev, PoolOptions::new().no_split(true)).unwrap();
        let split = nccl_pool(dev).unwrap();
        // Not ncclMemAlloc memory (the default pool): refused on every rank, before NCCL.
        let mut def = alloc.alloc::<f32>(1 << 20).unwrap();
        let e = comm.register_window(&mut def, &stream).unwrap_err();
        assert!(matches!(e, mempool_nccl::Error::Window(_)), "{e}");
        // Not at a granularity boundary (the second block of a segment): refused everywhere.
        let mut first = filled(&split, &stream, 0f32, 128);
        let mut second = filled(&split, &stream, 0f32, 128);
        let e = comm.register_window(&mut second, &stream).unwrap_err();
        assert!(e.to_string().contains("not a multiple of the allocation granularity"), "{e}");
        // At the start of a segment, but its block (512 bytes) does not cover the rounded range,
        // where other buffers (`second`) live: refused.
        let e = comm.register_window(&mut first, &stream).unwrap_err();
        assert!(e.to_string().contains("block does not cover"), "{e}");
        // Sizes that differ between ranks: every rank learns it and refuses.
        if comm.world_size() > 1 {
            let n = if comm.rank() == 0 { 1 << 20 } else { 1 << 19 };
            let mut b = filled(&whole, &stream, 0f32, n);
            let e = comm.register_window(&mut b, &stream).unwrap_err();
            assert!(e.to_string().contains("the same size"), "{e}");
        }
        // By the rules: registered, used through the window, deregistered (waiting for the
        // all-reduce first).
        let mut buf = filled(&whole, &stream, (comm.rank() + 1) as f32, 1 << 20);
        let mut w = comm.register_window(&mut buf, &stream).unwrap();
        assert_eq!(w.range(), (w.device_ptr_raw(), 4 << 20));
        comm.all_reduce_in_place(&mut *w, ReduceOp::Sum, &stream).unwrap();
        w.deregister().unwrap();
        let world = comm.world_size();
        let want = (world * (world + 1) / 2) as f32;
        assert!(stream.clone_dtoh(&buf).unwrap().iter().all(|x| *x == want));
        // Dropping a window right after queueing work on it waits for that work, deregisters,
        // and the segment can then go back to the device.
        let mut w = comm.register_window(&mut buf, &stream).unwrap();
        comm.all_reduce_in_place(&mut *w, ReduceOp::Sum, &stream).unwrap();
        drop(w);
        assert!(stream.clone_dtoh(&buf).unwrap().iter().all(|x| *x == want * world as f32));
        drop(buf);
        whole.empty_cache().unwrap();
        assert!(whole.snapshot().segments.iter().all(|s| s.total_size != 4 << 20), "the window's segment was kept");
        comm.destroy().unwrap();
    });
}

/// Runs `f` on a thread and fails the test if it takes longer than `secs` (the thread is left
/// behind: the point is that it would hang).
fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).unwrap_or_else(|_| panic!("{what} did not return in {secs} s"))
}

/// Dropping a communicator whose peer never joins an outstanding all-reduce returns at once:
/// `Drop` aborts (`ncclCommFinalize` would wait for the peer forever).
#[test]
#[ignore = "needs CUDA GPUs and NCCL"]
fn dropping_a_communicator_with_a_peer_gone_does_not_hang() {
    if gpus() < 2 {
        eprintln!("one GPU here: a missing peer needs two");
        return;
    }
    let mut comms = Communicator::all_local(&[0, 1]).expect("communicators");
    let silent = comms.pop().unwrap(); // rank 1: one all-reduce, then never again
    let comm = comms.pop().unwrap();
    // Both ranks run one all-reduce together, so NCCL's connections are up (its first collective
    // sets them up on the host, and would wait for the peer there).
    let (joined_tx, joined_rx) = std::sync::mpsc::channel();
    let peer = std::thread::spawn(move || {
        let alloc = Allocator::cuda(silent.device()).unwrap();
        let stream = alloc.current_stream();
        let pool = nccl_pool(silent.device()).unwrap();
        let mut b = filled(&pool, &stream, 1f32, 1 << 20);
        silent.all_reduce_in_place(&mut b, ReduceOp::Sum, &stream).unwrap();
        stream.synchronize().unwrap();
        joined_tx.send(()).unwrap();
        (silent, b, pool)
    });
    let stream = within(60, "rank 0's all-reduces", move || {
        let alloc = Allocator::cuda(comm.device()).unwrap();
        let stream = alloc.current_stream();
        let pool = nccl_pool(comm.device()).unwrap();
        let reg = comm.register_pool(&pool).unwrap();
        let mut b = filled(&pool, &stream, 1f32, 1 << 20);
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &stream).unwrap();
        joined_rx.recv().unwrap();
        // Rank 1 is gone now: this one waits for it on the device, forever.
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &stream).unwrap();
        drop(reg);
        drop(comm); // aborts: returns although rank 1 never came
        (stream, b, pool)
    });
    let silent = peer.join().expect("rank 1");
    within(60, "rank 1's drop", move || drop(silent));
    // The aborted all-reduce left the stream (NCCL's kernels watch the abort flag).
    within(60, "the aborted stream", move || {
        let _ = stream.0.synchronize();
        drop(stream);
    });
}

/// A hook owning the last clone of a communicator drops it inside the hook: the abort runs
/// there, and the allocation that triggered the hook returns.
#[test]
#[ignore = "needs CUDA GPUs and NCCL"]
fn last_communicator_dropped_inside_a_hook() {
    within(120, "an allocation whose hook drops the last communicator", || {
        let comm = Communicator::all_local(&[0]).expect("communicator").pop().unwrap();
        let alloc = Allocator::cuda(0).unwrap();
        let pool = nccl_pool(0).unwrap();
        let reg = comm.register_pool(&pool).unwrap();
        let owned = Arc::new(Mutex::new(Some((comm, reg))));
        let (o, me) = (owned.clone(), alloc.id());
        let _hook = mempool::trace::attach(move |e| {
            if e.allocator == me && e.action == mempool::trace::Action::SegmentAlloc {
                drop(o.lock().unwrap().take());
            }
        })
        .unwrap();
        let b = pool.alloc::<f32>(16 << 20).unwrap();
        assert!(owned.lock().unwrap().is_none(), "the hook did not run");
        drop(b);
        pool.empty_cache().unwrap();
    });
}

/// An NCCL pool as a graph's pool: a registered `nccl_pool`, grown before the capture (as a
/// warm-up step does), serves a capture of a memset and an all-reduce on every GPU; replays
/// give the reduced values each time and allocate nothing.
#[test]
#[ignore = "needs CUDA GPUs and NCCL"]
fn all_reduce_captured_in_a_graph_on_an_nccl_pool() {
    let world = gpus();
    on_every_gpu(move |comm| {
        let alloc = Allocator::cuda(comm.device()).unwrap();
        let s = alloc.context().new_stream().unwrap();
        let _cur = alloc.set_stream(&s).unwrap();
        let pool = nccl_pool(comm.device()).unwrap();
        let reg = comm.register_pool(&pool).unwrap();
        let n = 1 << 20;
        // Warm-up outside the capture: the communicator's first collective, and the pool's segment.
        let mut warm = filled(&pool, &s, 1i32, n);
        comm.all_reduce_in_place(&mut warm, ReduceOp::Sum, &s).unwrap();
        s.synchronize().unwrap();
        drop(warm);
        let segments = alloc.memory_stats().segment.all.allocated;
        let cap = alloc.begin_capture(&s, &pool, mempool::CaptureMode::ThreadLocal).unwrap();
        let mut x = alloc.alloc::<i32>(n).unwrap();
        // SAFETY: the range is exactly the buffer's, written on its own stream.
        unsafe { cudarc::driver::result::memset_d8_async(x.device_ptr_raw(), 1, n * 4, s.cu_stream()) }.unwrap();
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &s).unwrap();
        let graph = cap.end().unwrap();
        assert_eq!(pool.memory_stats().allocated_bytes.current, (n * 4) as i64);
        // SAFETY: as above.
        unsafe { cudarc::driver::result::memset_d8_async(x.device_ptr_raw(), 0, n * 4, s.cu_stream()) }.unwrap();
        for _ in 0..20 {
            // SAFETY: `x` is alive and only read after the replays; no other graph shares the pool.
            unsafe { graph.replay() }.unwrap();
        }
        s.synchronize().unwrap();
        let got = s.clone_dtoh(&x).unwrap();
        let want = 0x0101_0101i32.wrapping_mul(world as i32);
        assert!(got.iter().all(|&v| v == want), "{} != {want}", got[0]);
        assert_eq!(alloc.memory_stats().segment.all.allocated, segments, "the capture or a replay made a segment");
        assert!(reg.take_errors().is_empty(), "{:?}", reg.take_errors());
        drop((x, graph, reg, pool));
    });
}

/// Symmetric memory on every GPU (threads): each rank writes its data, a barrier, then every
/// rank reads every rank's data through peer slices (copy engines, into its own memory too),
/// 10,000 put/wait ping-pongs between ranks 0 and 1, a barrier with one rank arriving late, and
/// every pad zero again at the end.
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn symmetric_memory_patterns_signals_and_barriers() {
    let results = on_every_gpu(move |comm| symm_rank_checks(&comm));
    assert_eq!(results.len(), gpus());
}

/// The same checks with communicators made from an id, one thread per GPU: the rendezvous
/// between processes (sockets, descriptors), its ranks all in this process.
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn symmetric_memory_with_id_communicators_threads() {
    let id = mempool_nccl::Id::new().unwrap();
    let n = gpus();
    let threads: Vec<_> = (0..n)
        .map(|r| {
            std::thread::spawn(move || {
                let comm = Communicator::new(&id, r, n, r).expect("communicator");
                symm_rank_checks(&comm)
            })
        })
        .collect();
    for t in threads {
        t.join().expect("rank thread");
    }
}

/// One rank's symmetric-memory checks (every rank of `comm` runs them): see
/// `symmetric_memory_patterns_signals_and_barriers`.
fn symm_rank_checks(comm: &Communicator) -> usize {
    use mempool_nccl::symm::{symm_empty, CHANNELS};
    const N: usize = 1 << 20;
    let pattern =
        |r: usize| -> Vec<u32> { (0..N as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ (r as u32 + 1)).collect() };
    {
        let (rank, world) = (comm.rank(), comm.world_size());
        let stream = comm.context().new_stream().unwrap();
        assert!(mempool_nccl::symm::same_machine(comm, &stream).unwrap(), "rank {rank}: every rank is here");
        let symm = symm_empty::<u32>(comm, N, &stream).unwrap();
        assert_eq!((symm.buffer_ptrs().len(), symm.signal_pad_ptrs().len()), (world, world));
        // The device arrays hold the same addresses.
        for (dev, host) in [
            (symm.buffer_ptrs_dev(&stream).unwrap(), symm.buffer_ptrs()),
            (symm.signal_pad_ptrs_dev(&stream).unwrap(), symm.signal_pad_ptrs()),
        ] {
            let mut words = vec![0u64; world];
            comm.context().bind_to_thread().unwrap();
            // SAFETY: `dev` is a device array of `world` u64 that `symm` keeps alive; `words` has
            // room for them.
            let r = unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(words.as_mut_ptr().cast(), dev, world * 8) };
            assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
            assert_eq!(words, host, "rank {rank}: the device array");
        }
        let mut mine = symm.peer(rank, &stream).unwrap();
        stream.memcpy_htod(&pattern(rank), &mut mine).unwrap();
        symm.barrier(0, &stream).unwrap();
        let alloc = Allocator::cuda(comm.device()).unwrap();
        for q in 0..world {
            let theirs = symm.peer(q, &stream).unwrap();
            assert!(stream.clone_dtoh(&theirs).unwrap() == pattern(q), "rank {rank} reads rank {q}");
            let mut copy = alloc.alloc::<u32>(N).unwrap();
            stream.memcpy_dtod(&theirs, &mut copy).unwrap();
            assert!(stream.clone_dtoh(&copy).unwrap() == pattern(q), "rank {rank} copies rank {q}");
        }
        symm.barrier(1, &stream).unwrap();
        if world >= 2 && rank < 2 {
            let other = 1 - rank;
            for _ in 0..10_000 {
                if rank == 0 {
                    symm.put_signal(other, 2, &stream).unwrap();
                    symm.wait_signal(other, 2, &stream).unwrap();
                } else {
                    symm.wait_signal(other, 2, &stream).unwrap();
                    symm.put_signal(other, 2, &stream).unwrap();
                }
            }
        }
        stream.synchronize().unwrap();
        if rank == world - 1 {
            std::thread::sleep(Duration::from_millis(200)); // arrives late
        }
        symm.barrier(3, &stream).unwrap();
        // Timed: a barrier everyone reaches, a signal that comes, then one that never does,
        // which names its rank, and the allocation refuses signals from then on.
        symm.barrier_timeout(5, Duration::from_secs(20), &stream).unwrap();
        if world >= 2 && rank < 2 {
            if rank == 0 {
                symm.put_signal(1, 6, &stream).unwrap();
            } else {
                symm.wait_signal_timeout(0, 6, Duration::from_secs(20), &stream).unwrap();
            }
        }
        // Two signals in a row before any wait: the second waits for the first to be taken, so
        // neither is lost (both waits return).
        if world >= 2 && rank < 2 {
            if rank == 0 {
                symm.put_signal(1, 8, &stream).unwrap();
                symm.put_signal(1, 8, &stream).unwrap();
            } else {
                std::thread::sleep(Duration::from_millis(50));
                symm.wait_signal_timeout(0, 8, Duration::from_secs(20), &stream).unwrap();
                symm.wait_signal_timeout(0, 8, Duration::from_secs(20), &stream).unwrap();
            }
            stream.synchronize().unwrap();
        }
        // Ranks drop in any order: rank 0 unmaps everything and lets go of its allocation,
        // rank 1 then still reads rank 0's data through its own mapping (which keeps it).
        let kept = symm_empty::<u32>(comm, N, &stream).unwrap();
        stream.memcpy_htod(&pattern(rank), &mut kept.peer(rank, &stream).unwrap()).unwrap();
        symm.barrier(10, &stream).unwrap();
        if world >= 2 && rank < 2 {
            if rank == 0 {
                drop(kept);
                symm.put_signal(1, 11, &stream).unwrap(); // "mine is unmapped"
            } else {
                symm.wait_signal(0, 11, &stream).unwrap();
                let theirs = stream.clone_dtoh(&kept.peer(0, &stream).unwrap()).unwrap();
                assert!(theirs == pattern(0), "rank 1 reads rank 0's data after rank 0 let it go");
                drop(kept);
            }
        }
        // A wait that times out names the silent rank; the signal that comes later is taken by
        // the next wait (nothing is left out of step).
        let lone = symm_empty::<u8>(comm, 64, &stream).unwrap();
        if world >= 2 && rank < 2 {
            if rank == 1 {
                let t = Instant::now();
                let e = lone.wait_signal_timeout(0, 7, Duration::from_millis(300), &stream).unwrap_err().to_string();
                assert!(e.contains("rank(s) [0] did not signal on channel 7"), "{e}");
                assert!(t.elapsed() >= Duration::from_millis(300), "{:?}", t.elapsed());
                lone.put_signal(0, 9, &stream).unwrap(); // "I gave up"
                lone.wait_signal_timeout(0, 7, Duration::from_secs(20), &stream).unwrap();
            } else {
                lone.wait_signal(1, 9, &stream).unwrap();
                lone.put_signal(1, 7, &stream).unwrap(); // the late signal
            }
            lone.barrier_timeout(0, Duration::from_secs(20), &stream).unwrap();
        }
        assert!(symm.wait_signal_timeout(rank, 0, Duration::from_secs(1), &stream).is_err(), "from itself");
        stream.synchronize().unwrap();
        // A one-shot all-reduce of f32 symmetric memory: every rank gets the sum.
        let f = symm_empty::<f32>(comm, 1000, &stream).unwrap();
        let vals: Vec<f32> = (0..1000).map(|i| (i * (rank + 1)) as f32).collect();
        stream.memcpy_htod(&vals, &mut f.peer(rank, &stream).unwrap()).unwrap();
        let mut out = alloc.alloc::<f32>(1000).unwrap();
        for _ in 0..3 {
            f.one_shot_all_reduce(&mut out, &stream).unwrap();
        }
        let want: Vec<f32> = (0..1000).map(|i| (1..=world).map(|k| (i * k) as f32).sum()).collect();
        assert!(stream.clone_dtoh(&out).unwrap() == want, "rank {rank}: the one-shot sums");
        let mut short = alloc.alloc::<f32>(999).unwrap();
        assert!(f.one_shot_all_reduce(&mut short, &stream).is_err(), "an output too short is refused");
        // Sizes with a tail after the four-at-a-time part, and an output that is not 16-byte
        // aligned (one element into a buffer): the one-at-a-time path.
        for n in [1003usize, 4099, 262_147] {
            let g = symm_empty::<f32>(comm, n, &stream).unwrap();
            let vals: Vec<f32> = (0..n).map(|i| ((i % 1000) * (rank + 1)) as f32).collect();
            stream.memcpy_htod(&vals, &mut g.peer(rank, &stream).unwrap()).unwrap();
            let want: Vec<f32> = (0..n).map(|i| (1..=world).map(|k| ((i % 1000) * k) as f32).sum()).collect();
            let mut out = alloc.alloc::<f32>(n).unwrap();
            g.one_shot_all_reduce(&mut out, &stream).unwrap();
            assert!(stream.clone_dtoh(&out).unwrap() == want, "rank {rank}: the one-shot sums of {n}");
            let mut wide = stream.alloc_zeros::<f32>(n + 1).unwrap();
            let mut off = wide.slice_mut(1..);
            g.one_shot_all_reduce(&mut off, &stream).unwrap();
            assert!(stream.clone_dtoh(&off).unwrap() == want, "rank {rank}: unaligned output, {n}");
        }
        // New data before every call, on one allocation: each call sees its own inputs (no
        // stale reads of a peer's memory), one-shot and two-shot in turn.
        let h = symm_empty::<f32>(comm, 4099, &stream).unwrap();
        let mut out = alloc.alloc::<f32>(4099).unwrap();
        for k in 0..20usize {
            let vals = |r: usize| -> Vec<f32> { (0..4099).map(|i| ((i + 7 * k) % 1000 * (r + 1)) as f32).collect() };
            let want: Vec<f32> =
                (0..4099).map(|i| (1..=world).map(|m| ((i + 7 * k) % 1000 * m) as f32).sum()).collect();
            stream.memcpy_htod(&vals(rank), &mut h.peer(rank, &stream).unwrap()).unwrap();
            if k % 2 == 0 {
                h.one_shot_all_reduce(&mut out, &stream).unwrap();
                assert!(stream.clone_dtoh(&out).unwrap() == want, "rank {rank}: one-shot, call {k}");
            } else {
                h.two_shot_all_reduce_in_place(&stream).unwrap();
                let got = stream.clone_dtoh(&h.peer(rank, &stream).unwrap()).unwrap();
                assert!(got == want, "rank {rank}: two-shot, call {k}");
            }
            // Nobody writes its data for the next call before every rank read it (the
            // kernels' last barrier already ensures it; this orders the host's copy too).
            h.barrier(4, &stream).unwrap();
        }
        // The two-shot on sizes whose chunks and tail fall in every way, a size with fewer
        // vectors than ranks among them.
        for n in [1usize, 5, 1003, 262_147, 1 << 20] {
            let g = symm_empty::<f32>(comm, n, &stream).unwrap();
            let vals: Vec<f32> = (0..n).map(|i| ((i % 1000) * (rank + 1)) as f32).collect();
            stream.memcpy_htod(&vals, &mut g.peer(rank, &stream).unwrap()).unwrap();
            let want: Vec<f32> = (0..n).map(|i| (1..=world).map(|k| ((i % 1000) * k) as f32).sum()).collect();
            g.two_shot_all_reduce_in_place(&stream).unwrap();
            let got = stream.clone_dtoh(&g.peer(rank, &stream).unwrap()).unwrap();
            assert!(got == want, "rank {rank}: the two-shot sums of {n}");
        }
        stream.synchronize().unwrap();
        let pad = symm.signal_pad_ptrs()[rank];
        let mut words = vec![1u32; 2 * world * CHANNELS];
        comm.context().bind_to_thread().unwrap();
        // SAFETY: reads this rank's own pad's counts (`2 * world * CHANNELS` words, mapped for
        // this device) into `words`, which has room for them; the stream's work is done.
        let r = unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(words.as_mut_ptr().cast(), pad, words.len() * 4) };
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
        let (sent, taken) = words.split_at(world * CHANNELS);
        assert_eq!(sent, taken, "rank {rank}: every signal sent to it was taken");
        // One rank alone signals no one (a barrier of one waits for no one).
        assert!(world < 2 || sent.iter().any(|&w| w > 0), "rank {rank}: signals were counted");
        // Bad input: a rank or channel out of range.
        assert!(symm.put_signal(world, 0, &stream).is_err());
        assert!(symm.wait_signal(0, CHANNELS, &stream).is_err());
        rank
    }
}

/// Ranks asking for different sizes: every rank gets the same clear error, nothing mapped.
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn symmetric_memory_size_mismatch_fails_on_every_rank() {
    if gpus() < 2 {
        eprintln!("one GPU here: a mismatch needs two ranks");
        return;
    }
    let results = on_every_gpu(move |comm| {
        let stream = comm.context().new_stream().unwrap();
        let len = if comm.rank() == 0 { 1 << 20 } else { 1 << 22 };
        mempool_nccl::symm::symm_empty::<f32>(&comm, len, &stream).map(|_| ()).map_err(|e| e.to_string())
    });
    for r in &results {
        let e = r.as_ref().unwrap_err();
        assert!(e.contains("same size"), "{e}");
    }
}

/// The one-shot all-reduce with one rank (the kernel's path for a last rank without a partner):
/// the output is the rank's own data, four at a time and in the tail.
#[test]
#[ignore = "needs a CUDA GPU with NCCL"]
fn one_shot_all_reduce_on_one_rank() {
    use mempool_nccl::symm::symm_empty;
    let comm = Communicator::all_local(&[0]).expect("a communicator").pop().expect("one rank");
    let stream = comm.context().new_stream().unwrap();
    let alloc = mempool::Allocator::cuda(0).unwrap();
    for n in [4096usize, 1003] {
        let g = symm_empty::<f32>(&comm, n, &stream).unwrap();
        let vals: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        stream.memcpy_htod(&vals, &mut g.peer(0, &stream).unwrap()).unwrap();
        let mut out = alloc.alloc::<f32>(n).unwrap();
        g.one_shot_all_reduce(&mut out, &stream).unwrap();
        assert!(stream.clone_dtoh(&out).unwrap() == vals, "one rank: the sum is its data ({n})");
    }
}

/// The one-shot that pushes (data of at most `PUSH_MAX` bytes) called back to back with no
/// barrier and no host wait between calls: each rank writes new data right after each call (a
/// copy in stream order), every call's sums go to their own output and all are checked at the
/// end; a rank refusing its output in the middle, an input whose bits are all set (read as
/// NaN), and the receive slots empty (every byte 0xff) afterwards. The size just above
/// `PUSH_MAX` takes the path with barriers, with no receive slots.
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn one_shot_pushes_back_to_back() {
    use mempool_nccl::symm::{symm_empty, PUSH_MAX};
    let results = on_every_gpu(move |comm| {
        let (rank, world) = (comm.rank(), comm.world_size());
        let stream = comm.context().new_stream().unwrap();
        let alloc = mempool::Allocator::cuda(comm.device()).unwrap();
        let _current = alloc.set_stream(&stream).unwrap();
        for n in [1usize, 5, 64, 4099, PUSH_MAX / 4, PUSH_MAX / 4 + 1] {
            let g = symm_empty::<f32>(&comm, n, &stream).unwrap();
            let (_, slots) = g.receive_slots();
            assert_eq!(slots > 0, n <= PUSH_MAX / 4, "rank {rank}: receive slots for {n} elements");
            let value = |k: usize, r: usize, i: usize| ((i + 3 * k) % 1000 * (r + 1)) as f32;
            const CALLS: usize = 31;
            let refuses = |k: usize| k == 11 && rank == world - 1 && n > 1;
            let mut outs: Vec<_> = (0..CALLS).map(|_| alloc.alloc::<f32>(n).unwrap()).collect();
            for (k, out) in outs.iter_mut().enumerate() {
                let mut vals: Vec<f32> = (0..n).map(|i| value(k, rank, i)).collect();
                if k == 7 && rank == 0 {
                    vals[0] = f32::from_bits(u32::MAX);
                }
                stream.memcpy_htod(&vals, &mut g.peer(rank, &stream).unwrap()).unwrap();
                if refuses(k) {
                    let mut short = alloc.alloc::<f32>(n - 1).unwrap();
                    assert!(g.one_shot_all_reduce(&mut short, &stream).is_err(), "rank {rank}: too short");
                } else {
                    g.one_shot_all_reduce(out, &stream).unwrap();
                }
            }
            stream.synchronize().unwrap();
            for (k, out) in outs.iter().enumerate() {
                if refuses(k) {
                    continue;
                }
                let got = stream.clone_dtoh(out).unwrap();
                for (i, &x) in got.iter().enumerate() {
                    let want: f32 = (0..world).map(|r| value(k, r, i)).sum();
                    if k == 7 && i == 0 {
                        assert!(x.is_nan(), "rank {rank}: an all-ones input sums to NaN, got {x}");
                    } else {
                        assert_eq!(x, want, "rank {rank}: {n} elements, call {k}, element {i}");
                    }
                }
            }
            let full = common::receive_slot_bytes_in_use(&g, comm.context());
            assert_eq!(full, 0, "rank {rank}: the receive slots are empty again ({n})");
        }
        rank
    });
    assert_eq!(results.len(), gpus());
}

const SYMM_CHILD: &str = "MEMPOOL_SYMM_TEST_CHILD";
const SYMM_ID: &str = "MEMPOOL_SYMM_TEST_ID";

/// Runs `test` (a `child_*` test of this file) as `ranks` processes, rank `r` on GPU `r`, all
/// joining one communicator id; each must pass within three minutes.
fn symm_processes(test: &str, ranks: usize) {
    symm_processes_within(test, ranks, 180);
}

/// As [`symm_processes`], each rank given `secs` seconds.
fn symm_processes_within(test: &str, ranks: usize, secs: u64) {
    let id = mempool_nccl::Id::new().unwrap();
    let hex: String = id.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..ranks)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args([test, "--exact", "--include-ignored", "--nocapture"])
                .env(SYMM_CHILD, rank.to_string())
                .env(SYMM_ID, &hex)
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(secs);
    for (rank, mut c) in children.into_iter().enumerate() {
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                assert!(status.success(), "rank {rank}'s process failed: {status}");
                break;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!("rank {rank}'s process did not finish in time");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// This process's rank and communicator, when `symm_processes` launched it.
fn symm_child(world: usize) -> Option<Communicator> {
    let rank: usize = std::env::var(SYMM_CHILD).ok()?.parse().unwrap();
    let hex = std::env::var(SYMM_ID).unwrap();
    let bytes: Vec<u8> = (0..128).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap()).collect();
    let id = mempool_nccl::Id::from_bytes(bytes.try_into().unwrap());
    Some(Communicator::new(&id, rank, world, rank).expect("communicator"))
}

/// Symmetric memory between two processes (descriptors over Unix sockets): every check of
/// the threaded test, then ranks asking for different sizes get the same error.
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn symmetric_memory_across_two_processes() {
    if gpus() < 2 {
        eprintln!("one GPU here: two processes need two");
        return;
    }
    symm_processes("child_symmetric_memory_rank", 2);
}

/// One rank of `symmetric_memory_across_two_processes`.
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn child_symmetric_memory_rank() {
    let Some(comm) = symm_child(2) else { return };
    symm_rank_checks(&comm);
    let stream = comm.context().new_stream().unwrap();
    let len = if comm.rank() == 0 { 1 << 20 } else { 1 << 22 };
    let e = mempool_nccl::symm::symm_empty::<f32>(&comm, len, &stream).unwrap_err().to_string();
    assert!(e.contains("same size"), "rank {}: {e}", comm.rank());
    // Still usable after the failed one: the next rendezvous has a name of its own.
    let again = mempool_nccl::symm::symm_empty::<f32>(&comm, 4096, &stream).unwrap();
    again.barrier(0, &stream).unwrap();
    stream.synchronize().unwrap();
    drop(again);
    comm.destroy().unwrap();
}

/// A rank that leaves before the rendezvous: the other times out naming it, and gets back its
/// device memory and file descriptors.
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn symmetric_rendezvous_names_a_rank_that_left() {
    if gpus() < 2 {
        eprintln!("one GPU here: two processes need two");
        return;
    }
    symm_processes("child_symmetric_rank_that_leaves", 2);
}

/// One rank of `symmetric_rendezvous_names_a_rank_that_left`: rank 1 exits at once.
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn child_symmetric_rank_that_leaves() {
    let Some(comm) = symm_child(2) else { return };
    if comm.rank() == 1 {
        std::process::exit(0);
    }
    let stream = comm.context().new_stream().unwrap();
    stream.synchronize().unwrap();
    comm.context().bind_to_thread().unwrap();
    let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
    let (free_before, _) = cudarc::driver::result::mem_get_info().unwrap();
    let opts = mempool_nccl::symm::SymmOptions::new().timeout(Duration::from_secs(3));
    // Twice: NCCL's own threads may open or close descriptors while the first one waits (its
    // peer is gone), so the second attempt is measured against the first, which must leave
    // exactly as many open as it found.
    let mut open_after = Vec::new();
    for _ in 0..2 {
        let t = Instant::now();
        let e = mempool_nccl::symm::symm_empty_with::<f32>(&comm, 1 << 20, &stream, &opts).unwrap_err().to_string();
        assert!(e.contains("rank 1 never opened its rendezvous socket"), "{e}");
        assert!(t.elapsed() >= Duration::from_secs(3) && t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
        let (free_after, _) = cudarc::driver::result::mem_get_info().unwrap();
        assert_eq!(free_after, free_before, "device memory is back");
        open_after.push(fds());
    }
    assert_eq!(open_after[1], open_after[0], "no descriptor is left open");
    comm.abort().unwrap();
}

/// Symmetric memory registered as an NCCL window, two processes: NCCL's all-reduce on it, in
/// place, gives the sums, the one-shot kernel on the same memory too, and the window is
/// deregistered before the memory goes. (Each rank has a minute: a hang fails, it never waits.)
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn symmetric_memory_as_an_nccl_window_across_two_processes() {
    if gpus() < 2 {
        eprintln!("one GPU here: two processes need two");
        return;
    }
    symm_processes_within("child_symmetric_window_rank", 2, 60);
}

/// One rank of `symmetric_memory_as_an_nccl_window_across_two_processes`.
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn child_symmetric_window_rank() {
    let Some(comm) = symm_child(2) else { return };
    let (rank, n) = (comm.rank(), 1usize << 20);
    let stream = comm.context().new_stream().unwrap();
    let mut symm = mempool_nccl::symm::symm_empty::<f32>(&comm, n, &stream).unwrap();
    let vals: Vec<f32> = (0..n).map(|i| ((i % 100) * (rank + 1)) as f32).collect();
    let want: Vec<f32> = (0..n).map(|i| ((i % 100) * 3) as f32).collect();
    stream.memcpy_htod(&vals, &mut symm.peer(rank, &stream).unwrap()).unwrap();
    let window = symm.register_window(&comm, &stream).unwrap();
    comm.all_reduce_in_place(&mut window.peer(rank, &stream).unwrap(), ReduceOp::Sum, &stream).unwrap();
    let got = stream.clone_dtoh(&window.peer(rank, &stream).unwrap()).unwrap();
    assert!(got == want, "rank {rank}: NCCL's sums on the window");
    // The allocation's own kernels on the same memory while it is registered.
    stream.memcpy_htod(&vals, &mut window.peer(rank, &stream).unwrap()).unwrap();
    let mut out = stream.alloc_zeros::<f32>(n).unwrap();
    window.one_shot_all_reduce(&mut out, &stream).unwrap();
    assert!(stream.clone_dtoh(&out).unwrap() == want, "rank {rank}: the one-shot's sums on the window");
    window.deregister().unwrap();
    drop(symm);
    comm.destroy().unwrap();
}

/// The same with every rank a thread of one process (`all_local` communicators), in a child
/// process given a minute.
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn symmetric_memory_as_an_nccl_window_threads() {
    if gpus() < 2 {
        eprintln!("one GPU here: a window needs two ranks");
        return;
    }
    symm_processes_within("child_symmetric_window_threads", 1, 60);
}

/// The body of `symmetric_memory_as_an_nccl_window_threads` (does nothing unless launched by it).
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn child_symmetric_window_threads() {
    if std::env::var(SYMM_CHILD).is_err() {
        return;
    }
    on_every_gpu(|comm| {
        let (rank, world, n) = (comm.rank(), comm.world_size(), 1usize << 16);
        let stream = comm.context().new_stream().unwrap();
        let mut symm = mempool_nccl::symm::symm_empty::<f32>(&comm, n, &stream).unwrap();
        let vals: Vec<f32> = (0..n).map(|i| ((i % 100) * (rank + 1)) as f32).collect();
        let want: Vec<f32> = (0..n).map(|i| (1..=world).map(|k| ((i % 100) * k) as f32).sum()).collect();
        stream.memcpy_htod(&vals, &mut symm.peer(rank, &stream).unwrap()).unwrap();
        let window = symm.register_window(&comm, &stream).unwrap();
        comm.all_reduce_in_place(&mut window.peer(rank, &stream).unwrap(), ReduceOp::Sum, &stream).unwrap();
        assert!(stream.clone_dtoh(&window.peer(rank, &stream).unwrap()).unwrap() == want, "rank {rank}");
        window.deregister().unwrap();
    });
}
