//! Hostile-review probes (issue 14) for `mempool::ipc` that need a GPU (two for one of them).
//! Each asserts the behaviour the module must have (they were findings, now fixed). Run:
//! `cargo test -p cuda-mempool --test cuda_ipc_attacks -- --include-ignored --test-threads=1`.
//! Children are this binary again, with `REV14_IPC_CHILD` set; forged handles travel as hex.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaContext, CudaStream, DeviceSlice};
use mempool::backend::stream_ordered::{StreamOrderedAllocator, StreamOrderedOptions};
use mempool::ipc::{self, Exported, IpcHandle};
use mempool::{Allocator, MemPool, PoolOptions};

mod common;

const ROLE: &str = "REV14_IPC_CHILD";
const HANDLES: &str = "REV14_IPC_HANDLES";
/// Field offsets in `IpcHandle::to_bytes`.
const AT_TOKEN: usize = 45;
const AT_MEM: usize = 77;
const AT_OFFSET: usize = 205;
const AT_BYTES: usize = 213;
const AT_MAPS: usize = 229;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

fn handles() -> Vec<IpcHandle> {
    let v = std::env::var(HANDLES).unwrap();
    v.split(',').filter(|s| !s.is_empty()).map(|h| IpcHandle::from_bytes(&unhex(h)).unwrap()).collect()
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn command(name: &str, role: &str, handles: &[Vec<u8>]) -> Command {
    let hs: Vec<String> = handles.iter().map(|h| hex(h)).collect();
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", name, "--include-ignored", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(HANDLES, hs.join(","))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    c
}

fn child(name: &str, role: &str, handles: &[Vec<u8>]) -> Child {
    command(name, role, handles).stdin(Stdio::piped()).spawn().unwrap()
}

/// A child whose stdin is one end of a Unix socket pair; the other end is returned.
fn child_with_socket(name: &str, role: &str) -> (Child, UnixStream) {
    let (mine, theirs) = UnixStream::pair().unwrap();
    let c = command(name, role, &[]).stdin(Stdio::from(std::os::fd::OwnedFd::from(theirs))).spawn().unwrap();
    (c, mine)
}

fn finish(c: Child, what: &str) -> String {
    let out = c.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{what}: the child failed ({:?}, signal {:?}; SIGBUS is {}):\n{text}",
        out.status,
        out.status.signal(),
        libc::SIGBUS
    );
    text
}

/// The child's socket (its stdin).
fn stdin_socket() -> UnixStream {
    use std::os::fd::FromRawFd;
    // SAFETY: the parent made stdin one end of a socket pair, owned here alone.
    unsafe { UnixStream::from_raw_fd(0) }
}

/// Sends `handle` (forged or not) and `fds` as `ipc::send` frames them.
fn send_forged(sock: &UnixStream, handle: &[u8], fds: &[RawFd]) {
    let mut data = (handle.len() as u32).to_le_bytes().to_vec();
    data.extend_from_slice(handle);
    let n = common::sock::sendmsg_raw(sock, &data, fds);
    assert_eq!(n as usize, data.len(), "sendmsg: {}", std::io::Error::last_os_error());
}

fn raw_fds<T: mempool::AnyBitPattern>(e: &Exported<T>) -> Vec<RawFd> {
    e.fds().iter().map(|f| f.as_raw_fd()).collect()
}

fn stream_on(device: usize) -> Arc<CudaStream> {
    CudaContext::new(device).unwrap().new_stream().unwrap()
}

fn exportable_pool(a: &Allocator) -> MemPool {
    let so = StreamOrderedAllocator::new(0, StreamOrderedOptions { exportable: true, ..Default::default() }).unwrap();
    MemPool::on(a, PoolOptions::new().shared_allocator(Arc::new(so))).unwrap()
}

fn pattern(n: usize, k: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ k).collect()
}

/// FINDING (UB-adjacent): legacy and pool imports never check `offset + bytes` against the
/// memory they map: the view is `base + offset` for `bytes`, straight from the handle. A forged
/// (or corrupted) handle yields a safe `Imported` whose cudarc copies read and write outside the
/// mapping: a device fault (sticky: the importer's context is dead) or, where the address is
/// mapped, the importer's own device buffers, and, through UVA, its pinned host memory (which
/// safe `host_slice` borrows read: UB in this process, not only a device fault). Expected: the
/// import is refused. Fix: after opening, `cuMemGetAddressRange_v2(base)` (legacy: the segment;
/// pool: the imported allocation) and refuse unless `offset.checked_add(bytes) <= size`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_handle_reaching_beyond_its_memory_is_refused() {
    const NAME: &str = "probe_handle_reaching_beyond_its_memory_is_refused";
    if let Some(role) = role() {
        let stream = stream_on(0);
        let r = if role.starts_with("legacy") {
            ipc::import::<u8>(&handles()[0], &stream)
        } else {
            let (h, fds) = ipc::receive_handle(&stdin_socket()).unwrap();
            ipc::import_with_fds::<u8>(&h, fds, &stream)
        };
        if let Ok(v) = &r {
            println!("{role}: accepted a view of {} bytes at {:#x}", v.num_bytes(), v.device_ptr_raw());
        }
        assert!(r.is_err(), "{role}: a view beyond the mapped memory was handed out");
        return;
    }
    let a = Allocator::cuda(0).unwrap();
    let e = Exported::new(a.alloc::<u8>(1 << 20).unwrap()).unwrap();
    let good = e.handle().unwrap().to_bytes();
    let mut big = good.clone();
    put_u64(&mut big, AT_BYTES, 1 << 40);
    finish(child(NAME, "legacy-bytes", &[big]), "legacy, 1 TiB");
    let mut far = good.clone();
    put_u64(&mut far, AT_OFFSET, get_u64(&good, AT_OFFSET) + (1 << 36));
    finish(child(NAME, "legacy-offset", &[far]), "legacy, offset + 64 GiB");
    assert_eq!(e.leases(), 0);

    let pool = exportable_pool(&a);
    let p = Exported::new(pool.alloc::<u8>(4096).unwrap()).unwrap();
    let mut big = p.handle().unwrap().to_bytes();
    put_u64(&mut big, AT_BYTES, 1 << 40);
    let (c, sock) = child_with_socket(NAME, "pool-bytes");
    send_forged(&sock, &big, &raw_fds(&p));
    finish(c, "pool, 1 TiB");
}

/// FINDING (panic / bounds bypass): for expandable-segment handles, `import_with_fds` checks
/// `handle.offset + handle.bytes > handle.maps.iter().sum::<u64>()` in plain u64 arithmetic: a
/// forged offset near `u64::MAX` (or map sizes summing past it) panics with "attempt to add with
/// overflow" in debug builds, and in release wraps, passes the check and makes
/// `ptr = base + offset` point before the reservation. Expected: an error. Fix: `checked_add`
/// / `checked_sum`, refusing on overflow (and refuse map sizes of 0 or not a multiple of the
/// granularity).
#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_mapped_handle_overflow_is_an_error_not_a_panic() {
    const NAME: &str = "probe_mapped_handle_overflow_is_an_error_not_a_panic";
    if let Some(role) = role() {
        let stream = stream_on(0);
        let (h, fds) = ipc::receive_handle(&stdin_socket()).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ipc::import_with_fds::<u8>(&h, fds, &stream).map(|v| v.num_bytes())
        }));
        assert!(matches!(r, Ok(Err(_))), "{role}: not a clean error: {:?}", r.map_err(|_| "PANIC"));
        return;
    }
    let a = Allocator::cuda(0).unwrap();
    let ex = MemPool::on(&a, PoolOptions::new().expandable(true)).unwrap();
    // 2.5 MiB first (two 2 MiB pages, 1.5 MiB left): the 5 MiB block then grows across.
    let _first = ex.alloc::<u8>(5 << 19).unwrap();
    let e = Exported::new(ex.alloc::<u8>(5 << 20).unwrap()).unwrap();
    let good = e.handle().unwrap().to_bytes();
    let n = e.handle().unwrap().num_fds();
    assert!(n >= 2, "a buffer across two physical allocations: {:?}", e.handle().unwrap());
    let mut off = good.clone();
    put_u64(&mut off, AT_OFFSET, u64::MAX - 4095);
    let (c, sock) = child_with_socket(NAME, "offset-overflow");
    send_forged(&sock, &off, &raw_fds(&e));
    finish(c, "offset + bytes overflows");
    let mut maps = good.clone();
    for i in 0..n {
        put_u64(&mut maps, AT_MAPS + 8 * i, u64::MAX / 2 + 1);
    }
    let (c, sock) = child_with_socket(NAME, "maps-overflow");
    send_forged(&sock, &maps, &raw_fds(&e));
    finish(c, "the map sizes' sum overflows");
}

/// FINDING (crash): the importer maps the lease file the handle names without checking its size
/// (see the CPU probe `ipc::probes::probe_lease_map_of_an_empty_file_is_an_error_not_sigbus`).
/// A handle naming an empty file in /dev/shm (any local user can create
/// `mempool-ipc-<pid>-<n>` for a future or made-up `n`, mode 0666; or a real export caught
/// between `create_new` and `set_len`) kills the importer with SIGBUS. Expected: an error.
#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_empty_lease_file_is_refused_not_sigbus() {
    const NAME: &str = "probe_empty_lease_file_is_refused_not_sigbus";
    if role().is_some() {
        let r = ipc::import::<u8>(&handles()[0], &stream_on(0));
        assert!(r.is_err(), "imported through an empty lease file");
        return;
    }
    let a = Allocator::cuda(0).unwrap();
    let e = Exported::new(a.alloc::<u8>(4096).unwrap()).unwrap();
    let mut h = e.handle().unwrap().to_bytes();
    let forged = [0x5au8; 16];
    h[AT_TOKEN..AT_TOKEN + 16].copy_from_slice(&forged);
    let path = format!("/dev/shm/mempool-ipc-{}", hex(&forged));
    std::fs::File::create(&path).unwrap(); // 0 bytes
    let r = std::panic::catch_unwind(|| finish(child(NAME, "import", &[h]), "an empty lease file"));
    let _ = std::fs::remove_file(&path);
    if let Err(p) = r {
        std::panic::resume_unwind(p);
    }
}

/// FINDING (lease not bound to memory): the lease file is chosen by (pid, export) and the memory
/// by `mem`/`offset`, with nothing tying them: a handle carrying export A's segment and export
/// B's number takes B's lease and maps A's memory. A's exporter then sees no lease, frees A's
/// block and reuses it while this process still writes it through the view. Expected: refused.
/// Fix: a random 128-bit token per export, stored in the lease file next to the counter
/// together with a digest of (via, mem, offset, bytes, maps), checked by `import` before it
/// takes the lease.
#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_lease_of_another_export_is_refused() {
    const NAME: &str = "probe_lease_of_another_export_is_refused";
    if role().is_some() {
        let r = ipc::import::<u8>(&handles()[0], &stream_on(0));
        assert!(r.is_err(), "mapped export A under export B's lease");
        return;
    }
    let a = Allocator::cuda(0).unwrap();
    let ea = Exported::new(a.alloc::<u8>(3 << 20).unwrap()).unwrap();
    let eb = Exported::new(a.alloc::<u8>(4096).unwrap()).unwrap();
    let mut h = ea.handle().unwrap().to_bytes();
    let hb = eb.handle().unwrap().to_bytes();
    h[AT_TOKEN..AT_TOKEN + 16].copy_from_slice(&hb[AT_TOKEN..AT_TOKEN + 16]);
    finish(child(NAME, "import", &[h]), "a mismatched lease");
}

unsafe extern "C" fn sleep_half_a_second(_: *mut std::ffi::c_void) {
    std::thread::sleep(Duration::from_millis(500));
}

/// FINDING (missing ordering, needs 2 GPUs): `Imported::order` compares only the `CUstream`
/// values; cudarc's `default_stream()` is the null stream of *every* context, so a view opened
/// on GPU 1's default stream and used by a copy on GPU 0's default stream counts as "the same
/// stream": no join, no sync at the end of the borrow. The copy reads before the view's queued
/// writes (and the view's drop, which syncs only its own stream, can give the lease back, and
/// unmap, under the other context's work). `Buffer::use_on` compares the context too.
/// Expected: zeros in both reads; the default-stream read sees the old ones. Fix: also compare
/// `stream.context() == self.stream.context()` in `order`.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn probe_view_used_on_another_gpus_default_stream_is_ordered() {
    const NAME: &str = "probe_view_used_on_another_gpus_default_stream_is_ordered";
    const N: usize = 1 << 20;
    if role().is_some() {
        let ctx1 = CudaContext::new(1).unwrap();
        let ctx0 = CudaContext::new(0).unwrap();
        let s1 = ctx1.default_stream();
        let mut view = ipc::import::<f32>(&handles()[0], &s1).unwrap();
        let mut stale = Vec::new();
        for (what, other) in
            [("a new stream", ctx0.new_stream().unwrap()), ("the default stream", ctx0.default_stream())]
        {
            s1.memcpy_htod(&vec![1.0f32; N], &mut view).unwrap();
            s1.synchronize().unwrap();
            ctx1.bind_to_thread().unwrap();
            // SAFETY: a host function that only sleeps, queued on a live stream.
            let r = unsafe { sys::cuLaunchHostFunc(s1.cu_stream(), Some(sleep_half_a_second), std::ptr::null_mut()) };
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
            s1.memset_zeros(&mut view).unwrap(); // queued after the sleep
            let got = other.clone_dtoh(&view).unwrap(); // must wait for it
            if got.iter().any(|&x| x != 0.0) {
                stale.push(what);
            }
            s1.synchronize().unwrap();
        }
        assert!(stale.is_empty(), "GPU 0's copy ran before the view's queued writes on: {stale:?}");
        return;
    }
    if mempool::device_count().unwrap() < 2 {
        eprintln!("skipped: one GPU");
        return;
    }
    let a = Allocator::cuda(0).unwrap();
    let e = Exported::new(a.alloc_zeros::<f32>(N).unwrap()).unwrap();
    finish(child(NAME, "read", &[e.handle().unwrap().to_bytes()]), "the cross-GPU reader");
}

/// OPEN QUESTION (expected unsafe): pool imports are not cached per process as legacy mappings
/// are. Two buffers of one stream-ordered pool segment (the same `CUmemPoolPtrExportData`) and
/// a second view of the same buffer are imported in one process: each view imports the pool
/// again and `cuMemPoolImportPointer`s the same allocation again; dropping the first view
/// `cuMemFree`s its pointer and `cuMemPoolDestroy`s its pool. If the driver hands back the same
/// pool or pointer (as it does for an allocation mapped once per context), the later views are
/// left dangling (device fault, or memory reused by this process); if it refuses the second
/// import, two views of one segment are a spurious error. Expected: both later views still read
/// their data. Fix, if it fails: a per-(context, pool) cache of imported pools and
/// per-(context, export data) refcounted pointers, as `open_legacy` keeps for segments.
#[test]
#[ignore = "needs a CUDA GPU"]
fn probe_two_views_of_one_pool_segment_in_one_process() {
    const NAME: &str = "probe_two_views_of_one_pool_segment_in_one_process";
    const N: usize = 1024;
    if role().is_some() {
        let sock = stdin_socket();
        let stream = stream_on(0);
        let v1 = ipc::receive::<u32>(&sock, &stream).unwrap();
        let v2 = ipc::receive::<u32>(&sock, &stream);
        let v2b = ipc::receive::<u32>(&sock, &stream);
        let (v2, v2b) = match (v2, v2b) {
            (Ok(a), Ok(b)) => (a, b),
            (a, b) => panic!("a second import from one pool segment failed: {:?} / {:?}", a.err(), b.err()),
        };
        println!("pointers {:#x} {:#x} {:#x}", v1.device_ptr_raw(), v2.device_ptr_raw(), v2b.device_ptr_raw());
        drop(v1);
        assert_eq!(stream.clone_dtoh(&v2).unwrap(), pattern(N, 2), "the second buffer after the first view closed");
        drop(v2);
        assert_eq!(stream.clone_dtoh(&v2b).unwrap(), pattern(N, 2), "the same buffer's other view");
        return;
    }
    let a = Allocator::cuda(0).unwrap();
    let s = a.current_stream();
    let pool = exportable_pool(&a);
    let mut b1 = pool.alloc::<u32>(N).unwrap();
    let mut b2 = pool.alloc::<u32>(N).unwrap();
    s.memcpy_htod(&pattern(N, 1), &mut b1).unwrap();
    s.memcpy_htod(&pattern(N, 2), &mut b2).unwrap();
    let (e1, e2) = (Exported::new(b1).unwrap(), Exported::new(b2).unwrap());
    let (h1, h2) = (e1.handle().unwrap().to_bytes(), e2.handle().unwrap().to_bytes());
    assert_eq!(h1[AT_MEM..AT_MEM + 64], h2[AT_MEM..AT_MEM + 64], "precondition: one pool segment");
    let (c, sock) = child_with_socket(NAME, "views");
    for e in [&e1, &e2, &e2] {
        ipc::send(&sock, e).unwrap();
    }
    finish(c, "two views of one pool segment");
    let _ = DeviceSlice::len(e1.buffer());
}
