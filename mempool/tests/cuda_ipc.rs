//! CUDA IPC (`mempool::ipc`) between processes, on the GPU machine: each test runs parts of
//! itself in child processes (the same test binary, with `MEMPOOL_IPC_CHILD` set).

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use mempool::backend::stream_ordered::{StreamOrderedAllocator, StreamOrderedOptions};
use mempool::ipc::{self, Exported, IpcHandle};
use mempool::{Allocator, Error, MemPool, PoolOptions};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Runs test `name` of this binary as a child with `role` and `handles`, stdin/stdout piped.
fn child(name: &str, role: &str, handles: &[IpcHandle]) -> std::process::Child {
    let hs: Vec<String> = handles.iter().map(|h| hex(&h.to_bytes())).collect();
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--include-ignored", "--nocapture", "--test-threads=1"])
        .env("MEMPOOL_IPC_CHILD", role)
        .env("MEMPOOL_IPC_HANDLES", hs.join(","))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

fn role() -> Option<String> {
    std::env::var("MEMPOOL_IPC_CHILD").ok()
}

fn handles() -> Vec<IpcHandle> {
    let v = std::env::var("MEMPOOL_IPC_HANDLES").unwrap();
    v.split(',').map(|h| IpcHandle::from_bytes(&unhex(h)).unwrap()).collect()
}

fn finish(c: std::process::Child) -> String {
    let out = c.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success() && text.contains("1 passed"), "child failed:\n{text}");
    text
}

fn stream_on(device: usize) -> Arc<CudaStream> {
    CudaContext::new(device).unwrap().new_stream().unwrap()
}

/// A producer fills two buffers (the second at a non-zero offset in its segment); a consumer
/// on GPU 0 and one on GPU 1 (when there is one) read and check them and write their own
/// values; the producer sees each consumer's writes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn consumers_on_both_gpus_read_and_modify_exported_buffers() {
    const NAME: &str = "consumers_on_both_gpus_read_and_modify_exported_buffers";
    const N: usize = 1 << 16;
    if let Some(role) = role() {
        let device: usize = role.parse().unwrap();
        let stream = stream_on(device);
        for (k, h) in handles().iter().enumerate() {
            let mut view = ipc::import::<f32>(h, &stream).unwrap();
            assert_eq!(cudarc::driver::DeviceSlice::len(&view), N);
            let got = stream.clone_dtoh(&view).unwrap();
            let want: Vec<f32> = (0..N).map(|i| (i + k * N) as f32 + device as f32).collect();
            assert_eq!(got, want, "buffer {k} on device {device}");
            let next: Vec<f32> = got.iter().map(|x| x + 1.0).collect();
            stream.memcpy_htod(&next, &mut view).unwrap();
        }
        return;
    }
    let a = Allocator::cuda(0).unwrap();
    let s = a.current_stream();
    let small = a.alloc::<u8>(512).unwrap(); // the next buffer lies after it in the segment
    let mut bufs = Vec::new();
    for k in 0..2 {
        let mut b = a.alloc::<f32>(N).unwrap();
        let host: Vec<f32> = (0..N).map(|i| (i + k * N) as f32).collect();
        s.memcpy_htod(&host, &mut b).unwrap();
        bufs.push(Exported::new(b).unwrap());
    }
    let hs: Vec<IpcHandle> = bufs.iter().map(|e| e.handle().unwrap()).collect();
    assert!(hs.iter().any(|h| h.offset() > 0), "a buffer inside its segment: {hs:?}");
    let gpus = mempool::device_count().unwrap().min(2);
    for device in 0..gpus {
        finish(child(NAME, &device.to_string(), &hs));
        for (k, e) in bufs.iter().enumerate() {
            let got = s.clone_dtoh(e.buffer()).unwrap();
            let want: Vec<f32> = (0..N).map(|i| (i + k * N) as f32 + device as f32 + 1.0).collect();
            assert_eq!(got, want, "consumer {device}'s writes to buffer {k}");
            assert_eq!(e.leases(), 0);
        }
    }
    drop((bufs, small));
    assert_eq!(ipc::reclaim(), 0);
}

/// While a consumer holds a view, the exporter's dropped buffer is not freed: no allocation
/// gets its memory until the consumer lets go and `reclaim` runs.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_block_with_a_lease_out_is_not_reused() {
    const NAME: &str = "a_block_with_a_lease_out_is_not_reused";
    const N: usize = 3 << 20; // a large block of its own
    if role().is_some() {
        let stream = stream_on(0);
        let h = handles().remove(0);
        let view = ipc::import::<u8>(&h, &stream).unwrap();
        println!("holding");
        std::io::stdout().flush().unwrap();
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).unwrap();
        drop(view);
        return;
    }
    let a = Allocator::cuda(0).unwrap();
    let s = a.current_stream();
    let x = a.alloc::<u8>(N).unwrap();
    let addr = x.device_ptr_raw();
    let e = Exported::new(x).unwrap();
    let h = e.handle().unwrap();
    let mut c = child(NAME, "hold", &[h]);
    let mut out = std::io::BufReader::new(c.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("holding") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the child ended early");
    }
    assert_eq!(e.leases(), 1);
    drop(e);
    assert_eq!(ipc::reclaim(), 1, "waits for the consumer");
    let again: Vec<_> = (0..4).map(|_| a.alloc::<u8>(N).unwrap()).collect();
    assert!(again.iter().all(|b| b.device_ptr_raw() != addr), "the held block was handed out again");
    drop(again);
    writeln!(c.stdin.take().unwrap(), "go").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let status = c.wait().unwrap();
    assert!(status.success() && rest.contains("1 passed"), "{rest}");
    let held = a.memory_stats().allocated_bytes.all.current;
    assert_eq!(ipc::reclaim(), 0, "the lease is back");
    let freed = held - a.memory_stats().allocated_bytes.all.current;
    assert_eq!(freed, N as i64, "the block is back in the cache");
    s.synchronize().unwrap();
}

/// Handles that must not open: a stale one (the export is gone), one of another machine, one
/// of this very process, bytes that are not a handle; and memory that does not export.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_handles_and_unexportable_memory_are_refused() {
    const NAME: &str = "bad_handles_and_unexportable_memory_are_refused";
    if let Some(role) = role() {
        let stream = stream_on(0);
        let h = handles().remove(0);
        let e = ipc::import::<f32>(&h, &stream).unwrap_err();
        match role.as_str() {
            "stale" => assert!(e.to_string().contains("the export is gone"), "{e}"),
            "foreign" => assert!(e.to_string().contains("another machine"), "{e}"),
            "wrong-size" => assert!(e.to_string().contains("whole number"), "{e}"),
            "no-fds" => assert!(e.to_string().contains("file descriptor"), "{e}"),
            r => panic!("{r}"),
        }
        return;
    }
    let a = Allocator::cuda(0).unwrap();
    let stream = a.current_stream();
    // Stale: exported, then dropped with no lease out.
    let e = Exported::new(a.alloc::<f32>(1024).unwrap()).unwrap();
    let h = e.handle().unwrap();
    drop(e);
    finish(child(NAME, "stale", &[h]));
    // Another machine: the boot id differs.
    let e = Exported::new(a.alloc::<f32>(1024).unwrap()).unwrap();
    let mut b = e.handle().unwrap().to_bytes();
    b[9] ^= 0xff; // the boot id (after the marker and the kind)
    finish(child(NAME, "foreign", &[IpcHandle::from_bytes(&b).unwrap()]));
    // Not a whole number of elements.
    let odd = Exported::new(a.alloc::<u8>(1023).unwrap()).unwrap();
    finish(child(NAME, "wrong-size", &[odd.handle().unwrap()]));
    // This process.
    let own = ipc::import::<f32>(&e.handle().unwrap(), &stream).unwrap_err();
    assert!(own.to_string().contains("this process"), "{own}");
    // Not a handle.
    assert!(IpcHandle::from_bytes(&[1, 2, 3]).is_err());
    assert_eq!(e.leases(), 0, "no lease taken by the refusals");
    // Memory that does not export, with clear errors.
    let pinned = Allocator::pinned(0).unwrap();
    let err = Exported::new(pinned.alloc::<f32>(16).unwrap()).unwrap_err();
    assert!(err.to_string().contains("pinned"), "{err}");
    let so = mempool::backend::stream_ordered::StreamOrderedAllocator::new(0, Default::default()).unwrap();
    let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(Arc::new(so))).unwrap();
    let err = Exported::new(pool.alloc::<f32>(16).unwrap()).unwrap_err();
    assert!(err.to_string().contains("does not export") && err.to_string().contains("exportable: true"), "{err}");
    // A handle that needs descriptors, opened without them.
    let expandable = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
    let ex = Exported::new(expandable.alloc::<f32>(16).unwrap()).unwrap();
    finish(child(NAME, "no-fds", &[ex.handle().unwrap()]));
    let err = Exported::new(a.alloc::<f32>(0).unwrap()).unwrap_err();
    assert!(matches!(err, Error::Backend { .. }) && err.to_string().contains("empty"), "{err}");
}

fn pattern(n: usize, k: usize, round: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ (k as u32 * 7919 + round as u32)).collect()
}

/// Buffers of an exportable stream-ordered pool (one descriptor: the pool's) and of an
/// expandable pool (one descriptor per physical allocation: a buffer inside one, one across
/// two, one across several) travel over a Unix socket; consumers on GPU 0 and GPU 1 check and
/// write them, the producer sees the writes.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pool_and_expandable_buffers_travel_with_their_descriptors() {
    const NAME: &str = "pool_and_expandable_buffers_travel_with_their_descriptors";
    const MIB: usize = 1 << 20;
    let sizes = [MIB, 4096, 5 * MIB / 2, 5 * MIB, 50 * MIB];
    if let Some(role) = role() {
        use std::os::fd::FromRawFd;
        let device: usize = role.parse().unwrap();
        let round = device;
        // SAFETY: the parent made this process's stdin one end of a socket pair, owned here alone.
        let sock = unsafe { std::os::unix::net::UnixStream::from_raw_fd(0) };
        let stream = stream_on(device);
        for (k, &bytes) in sizes.iter().enumerate() {
            let mut view = ipc::receive::<u32>(&sock, &stream).unwrap();
            let got = stream.clone_dtoh(&view).unwrap();
            assert!(got == pattern(bytes / 4, k, round), "buffer {k} on device {device}");
            stream.memcpy_htod(&pattern(bytes / 4, k, round + 1), &mut view).unwrap();
        }
        return;
    }
    let a = Allocator::cuda(0).unwrap();
    let s = a.current_stream();
    let so = StreamOrderedAllocator::new(0, StreamOrderedOptions { exportable: true, ..Default::default() }).unwrap();
    let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(Arc::new(so))).unwrap();
    let expandable = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
    let mut exported = Vec::new();
    for (k, &bytes) in sizes.iter().enumerate() {
        let mut b = if k < 2 { pool.alloc::<u32>(bytes / 4) } else { expandable.alloc::<u32>(bytes / 4) }.unwrap();
        s.memcpy_htod(&pattern(bytes / 4, k, 0), &mut b).unwrap();
        exported.push(Exported::new(b).unwrap());
    }
    let hs: Vec<IpcHandle> = exported.iter().map(|e| e.handle().unwrap()).collect();
    assert_eq!((hs[0].num_fds(), hs[1].num_fds()), (1, 1), "the pool's descriptor");
    assert!(hs[1].offset() > 0, "the second pool buffer lies inside its segment: {:?}", hs[1]);
    assert!(hs[3].num_fds() >= 2 && hs[4].num_fds() >= 2, "across physical allocations: {hs:?}");
    let gpus = mempool::device_count().unwrap().min(2);
    for device in 0..gpus {
        let (mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let c = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--include-ignored", "--nocapture", "--test-threads=1"])
            .env("MEMPOOL_IPC_CHILD", device.to_string())
            .stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        for e in &exported {
            ipc::send(&mine, e).unwrap();
        }
        finish(c);
        for (k, (e, &bytes)) in exported.iter().zip(&sizes).enumerate() {
            let got = s.clone_dtoh(e.buffer()).unwrap();
            assert!(got == pattern(bytes / 4, k, device + 1), "device {device}'s writes to buffer {k}");
            assert_eq!(e.leases(), 0);
        }
    }
    // A peer that closed the socket: a clear error, not a hang.
    let (mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    drop(theirs);
    let e = ipc::receive::<u32>(&mine, &s).unwrap_err();
    assert!(e.to_string().contains("closed"), "{e}");
}

/// The exporter exits while this process holds views of its buffers (a `cuMemAlloc` segment, an
/// exportable stream-ordered pool's, an expandable segment's): the views' memory stays valid
/// until they drop (the driver keeps it), their data intact and writable.
#[test]
#[ignore = "needs a CUDA GPU"]
fn views_outlive_the_exporting_process() {
    const NAME: &str = "views_outlive_the_exporting_process";
    const N: usize = 1 << 18;
    if role().is_some() {
        use std::io::Read;
        use std::os::fd::FromRawFd;
        // SAFETY: the parent made this process's stdin one end of a socket pair, owned here alone.
        let sock = unsafe { std::os::unix::net::UnixStream::from_raw_fd(0) };
        let a = Allocator::cuda(0).unwrap();
        let s = a.current_stream();
        let so =
            StreamOrderedAllocator::new(0, StreamOrderedOptions { exportable: true, ..Default::default() }).unwrap();
        let pool = MemPool::on(&a, PoolOptions::new().shared_allocator(Arc::new(so))).unwrap();
        let expandable = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
        let bufs = [a.alloc::<u32>(N).unwrap(), pool.alloc::<u32>(N).unwrap(), expandable.alloc::<u32>(N).unwrap()];
        for (k, mut b) in bufs.into_iter().enumerate() {
            s.memcpy_htod(&pattern(N, k, 7), &mut b).unwrap();
            let e = Exported::new(b).unwrap();
            ipc::send(&sock, &e).unwrap();
            std::mem::forget(e); // still exported when the process ends
        }
        let mut go = [0u8; 1];
        (&sock).read_exact(&mut go).unwrap();
        std::process::exit(0); // no destructor runs: the process simply ends
    }
    let (mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--include-ignored", "--nocapture", "--test-threads=1"])
        .env("MEMPOOL_IPC_CHILD", "exporter")
        .stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stream = stream_on(0);
    let mut views: Vec<_> = (0..3).map(|_| ipc::receive::<u32>(&mine, &stream).unwrap()).collect();
    for (k, v) in views.iter().enumerate() {
        assert!(stream.clone_dtoh(v).unwrap() == pattern(N, k, 7), "view {k} before the exporter exits");
    }
    (&mine).write_all(&[1]).unwrap();
    assert!(c.wait().unwrap().success(), "the exporter");
    for (k, v) in views.iter_mut().enumerate() {
        assert!(stream.clone_dtoh(&*v).unwrap() == pattern(N, k, 7), "view {k} after the exporter exited");
        stream.memcpy_htod(&pattern(N, k, 8), v).unwrap();
        assert!(stream.clone_dtoh(&*v).unwrap() == pattern(N, k, 8), "view {k} written after the exporter exited");
    }
    drop(views);
}
