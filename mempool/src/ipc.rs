//! Buffers shared with other processes on the same machine (CUDA IPC), as PyTorch shares CUDA
//! tensors between processes.
//!
//! The exporter turns a [`Buffer`] into an [`Exported`] and sends its [`IpcHandle`] (plain
//! bytes: [`IpcHandle::to_bytes`]) to another process by any channel; that process opens it
//! with [`import`] on a stream of its own, on the same GPU or another one that can reach it,
//! and gets an [`Imported`] view that cudarc's copies take like a `CudaSlice` (a kernel takes
//! the address `device_ptr(&stream)` gives, which orders that stream after the view's).
//!
//! ```no_run
//! # fn send(_: &[u8]) {}
//! # fn receive() -> Vec<u8> { Vec::new() }
//! use mempool::ipc::{self, Exported, IpcHandle};
//! // The producer.
//! let alloc = mempool::Allocator::cuda(0)?;
//! let stream = alloc.current_stream();
//! let mut x = alloc.alloc::<f32>(1 << 20)?;
//! stream.memcpy_htod(&vec![1.0f32; 1 << 20], &mut x)?;
//! let shared = Exported::new(x)?;                // the buffer's block is held for importers
//! send(&shared.handle()?.to_bytes());            // an event after the work queued so far
//! // The consumer, in another process.
//! let handle = IpcHandle::from_bytes(&receive())?;
//! let ctx = cudarc::driver::CudaContext::new(1)?; // another GPU, or the same
//! let view = ipc::import::<f32>(&handle, &ctx.default_stream())?; // waits for the producer's work
//! let host = ctx.default_stream().clone_dtoh(&view)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **Lifetime.** An export holds a lease counter in a small shared-memory file
//! (`/dev/shm/mempool-ipc-<random token>`, mode 0600: importers run as the same user), next to
//! a fingerprint of the handle: every import checks the fingerprint (a handle altered, or
//! pieced together from two exports, is refused) and takes a lease before it maps anything,
//! and gives it back when the view is dropped, after its stream's work on the memory is done.
//! When the `Exported` is dropped with leases out, its buffer waits (is not freed, so its block
//! is not reused) until the last lease is back: [`reclaim`] frees the buffers whose leases are
//! all back, and every new export calls it. An export closed for good refuses new imports (a
//! stale handle: a clear error, nothing mapped). The exporter holds a lock on its file while
//! the export lives; files nobody holds (their process ended) are removed by the next export on
//! the machine, whatever pid namespace they came from. A consumer that dies holding a lease
//! keeps the buffer until the producer exits, as with PyTorch's reference-counting files.
//! The view's reach is checked against the allocation the driver opened.
//!
//! **What exports, and how.**
//! - Buffers in `cuMemAlloc` segments (the default pools, pools without a segment source of
//!   their own): `cuIpcGetMemHandle` of the segment plus the buffer's offset; plain bytes, so
//!   [`import`] needs nothing else. One mapping per segment and context in the importer, however
//!   many views share it (the driver maps an allocation once per context).
//! - Buffers of a stream-ordered pool made with `StreamOrderedOptions { exportable: true, .. }`:
//!   the pool's POSIX file descriptor (`cuMemPoolExportToShareableHandle`) and the allocation's
//!   export data (`cuMemPoolExportPointer`); the importer imports the pool (and sets its
//!   device's access when it is another GPU) and the pointer.
//! - Buffers of expandable segments: one POSIX file descriptor per physical allocation under the
//!   buffer (`cuMemExportToShareableHandle`; at most [`MAX_FDS`]), mapped in order into a
//!   reservation of the importer with its device's access.
//!
//! File descriptors travel over a Unix socket: [`send`] writes the handle and its descriptors
//! (`SCM_RIGHTS`) as one message, [`receive`] reads it and imports; [`Exported::fds`] and
//! [`import_with_fds`] serve a transport of your own. Pinned memory and pools whose segment
//! source has no export (`ncclMemAlloc`, your own) are refused with an error that says so.

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use crate::backend::cuda::driver_error;
use crate::buffer::Buffer;
use crate::caching::ExportSource;
use crate::error::{Error, Result};
use crate::kind::Cuda;

const MAGIC: [u8; 8] = *b"MPIPC\x00\x00\x02";
const FIXED: usize = 8 + 1 + 16 + 16 + 4 + 16 + 16 + 64 + 64 + 8 + 8 + 4 + 4;
/// The most physical allocations one exported buffer of an expandable segment may span (each
/// travels as a file descriptor).
pub const MAX_FDS: usize = 64;
/// The lease counter's "closed for good" bit: no import may take a lease any more.
const CLOSED: u64 = 1 << 63;

/// How the exported memory is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    /// `cuIpcGetMemHandle` of a `cuMemAlloc` segment: plain bytes.
    Legacy = 1,
    /// A stream-ordered pool's file descriptor and the allocation's export data.
    Pool = 2,
    /// The file descriptors of an expandable segment's physical allocations.
    Mapped = 3,
}

/// What another process needs to open an exported buffer: plain bytes, safe to send anywhere
/// (opening it checks it), plus, for stream-ordered pools and expandable segments, file
/// descriptors that travel over a Unix socket ([`send`] / [`receive`]). Made by
/// [`Exported::handle`], opened by [`import`] / [`import_with_fds`].
#[derive(Clone, PartialEq, Eq)]
pub struct IpcHandle {
    via: Via,
    boot_id: [u8; 16],
    device_uuid: [u8; 16],
    /// The exporting process (for messages: pids are per namespace).
    pid: u32,
    /// Random: names the export's lease file, and tells this process's own exports apart.
    token: [u8; 16],
    /// Pool: which driver pool (the exporting process's random id and its pool's), so an
    /// importer imports each pool once however many handles name it; zeros otherwise.
    pool_key: [u8; 16],
    /// Legacy: the `CUipcMemHandle`; pool: the `CUmemPoolPtrExportData`.
    mem: [u8; 64],
    event: [u8; 64],
    /// From the segment's base (legacy, pool) or the first physical allocation's (mapped).
    offset: u64,
    bytes: u64,
    elem_size: u32,
    /// Mapped: the sizes of the physical allocations, in address order (one descriptor each).
    maps: Vec<u64>,
}

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcHandle")
            .field("via", &self.via)
            .field("pid", &self.pid)
            .field("token", &hex(&self.token))
            .field("offset", &self.offset)
            .field("bytes", &self.bytes)
            .field("elem_size", &self.elem_size)
            .field("maps", &self.maps)
            .finish_non_exhaustive()
    }
}

impl IpcHandle {
    /// The handle as bytes, for any channel between processes (its file descriptors, if it
    /// has any, travel separately: [`send`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(FIXED + 8 * self.maps.len());
        v.extend_from_slice(&MAGIC);
        v.push(self.via as u8);
        v.extend_from_slice(&self.boot_id);
        v.extend_from_slice(&self.device_uuid);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.token);
        v.extend_from_slice(&self.pool_key);
        v.extend_from_slice(&self.mem);
        v.extend_from_slice(&self.event);
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.bytes.to_le_bytes());
        v.extend_from_slice(&self.elem_size.to_le_bytes());
        v.extend_from_slice(&(self.maps.len() as u32).to_le_bytes());
        for m in &self.maps {
            v.extend_from_slice(&m.to_le_bytes());
        }
        v
    }

    /// Reads [`to_bytes`](Self::to_bytes). Errors: not a handle (wrong length or marker, an
    /// unknown kind, too many physical allocations).
    pub fn from_bytes(b: &[u8]) -> Result<IpcHandle> {
        let bad = |why: String| Error::backend("reading an IPC handle", format!("not a mempool IPC handle: {why}"));
        if b.len() < FIXED || b[..8] != MAGIC {
            return Err(bad(format!("{} bytes without the marker (a handle is IpcHandle::to_bytes)", b.len())));
        }
        let mut at = 8;
        let mut take = |n: usize| {
            let s = &b[at..at + n];
            at += n;
            s
        };
        let via = match take(1)[0] {
            1 => Via::Legacy,
            2 => Via::Pool,
            3 => Via::Mapped,
            k => return Err(bad(format!("unknown kind {k}"))),
        };
        let arr16 = |s: &[u8]| <[u8; 16]>::try_from(s).unwrap_or_default();
        let arr64 = |s: &[u8]| <[u8; 64]>::try_from(s).unwrap_or([0; 64]);
        let u32le = |s: &[u8]| u32::from_le_bytes(s.try_into().unwrap_or_default());
        let u64le = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap_or_default());
        let boot_id = arr16(take(16));
        let device_uuid = arr16(take(16));
        let pid = u32le(take(4));
        let token = arr16(take(16));
        let pool_key = arr16(take(16));
        let mem = arr64(take(64));
        let event = arr64(take(64));
        let offset = u64le(take(8));
        let bytes = u64le(take(8));
        let elem_size = u32le(take(4));
        let n = u32le(take(4)) as usize;
        if n > MAX_FDS || b.len() != FIXED + 8 * n || (via == Via::Mapped) != (n > 0) {
            return Err(bad(format!("{n} physical allocations in {} bytes", b.len())));
        }
        let maps = (0..n).map(|_| u64le(take(8))).collect();
        Ok(IpcHandle { via, boot_id, device_uuid, pid, token, pool_key, mem, event, offset, bytes, elem_size, maps })
    }

    /// The exported buffer's size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.bytes as usize
    }

    /// The exporting process (its pid in its own pid namespace).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The buffer's offset in the memory the handle maps (a buffer of the caching allocator
    /// usually lies inside a larger segment).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// What the export's lease file must say for this handle to open (FNV-1a of every field
    /// that says which memory it is): a handle with one export's memory and another's lease, or
    /// altered on the way, is refused.
    fn fingerprint(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |b: &[u8]| {
            for &x in b {
                h = (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        eat(&[self.via as u8]);
        eat(&self.device_uuid);
        eat(&self.token);
        eat(&self.pool_key);
        eat(&self.mem);
        eat(&self.event);
        eat(&self.offset.to_le_bytes());
        eat(&self.bytes.to_le_bytes());
        eat(&self.elem_size.to_le_bytes());
        for m in &self.maps {
            eat(&m.to_le_bytes());
        }
        h
    }

    /// How many file descriptors go with the handle (0: the bytes are enough, [`import`]).
    pub fn num_fds(&self) -> usize {
        match self.via {
            Via::Legacy => 0,
            Via::Pool => 1,
            Via::Mapped => self.maps.len(),
        }
    }
}

/// This boot of this machine (`/proc/sys/kernel/random/boot_id`): a handle made elsewhere, or
/// before a reboot, is refused by it.
fn boot_id() -> [u8; 16] {
    static ID: OnceLock<[u8; 16]> = OnceLock::new();
    *ID.get_or_init(|| {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let hex: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
        let mut id = [0u8; 16];
        for (i, pair) in hex.chunks(2).take(16).enumerate() {
            let s = std::str::from_utf8(pair).unwrap_or("0");
            id[i] = u8::from_str_radix(s, 16).unwrap_or(0);
        }
        id
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

const LEASE_DIR: &str = "/dev/shm";
const LEASE_PREFIX: &str = "mempool-ipc-";
/// A lease file: the counter, then the handle's fingerprint.
const LEASE_BYTES: usize = 16;

fn lease_path(token: &[u8; 16]) -> std::path::PathBuf {
    std::path::Path::new(LEASE_DIR).join(format!("{LEASE_PREFIX}{}", hex(token)))
}

/// A fresh random token (the kernel's `getrandom`).
fn random_token() -> std::io::Result<[u8; 16]> {
    let mut t = [0u8; 16];
    let mut got = 0;
    while got < t.len() {
        // SAFETY: writes at most the rest of `t`, which is ours.
        let n = unsafe { libc::getrandom(t[got..].as_mut_ptr().cast(), t.len() - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
            continue;
        }
        got += n as usize;
    }
    Ok(t)
}

/// This process's random id (pool keys: a driver pool's handle is unique only in its process).
fn process_id() -> u64 {
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(|| {
        random_token()
            .map_or(u64::from(std::process::id()), |t| u64::from_le_bytes(t[..8].try_into().unwrap_or_default()))
    })
}

/// The tokens of this process's live exports.
fn our_tokens() -> &'static Mutex<std::collections::HashSet<[u8; 16]>> {
    static OURS: OnceLock<Mutex<std::collections::HashSet<[u8; 16]>>> = OnceLock::new();
    OURS.get_or_init(|| Mutex::new(std::collections::HashSet::new()))
}

/// A lease file, mapped: the counter and the fingerprint.
struct Lease {
    ptr: std::ptr::NonNull<AtomicU64>,
    /// The exporter's open file, which holds the file's lock (a live export's lease file is
    /// never swept); `None` for an importer.
    _file: Option<std::fs::File>,
}

// SAFETY: the mapping is process memory that lives as long as the `Lease`; it is only touched
// through atomics, which may be shared between threads (and processes).
unsafe impl Send for Lease {}
// SAFETY: as above.
unsafe impl Sync for Lease {}

impl Lease {
    /// Maps the first [`LEASE_BYTES`] of `file`, which must be a regular file at least that
    /// long (a shorter one would fault on access: SIGBUS).
    fn map(file: &std::fs::File) -> std::io::Result<Lease> {
        use std::os::fd::AsRawFd;
        let meta = file.metadata()?;
        if !meta.file_type().is_file() || meta.len() < LEASE_BYTES as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("not a lease file ({} bytes, {:?})", meta.len(), meta.file_type()),
            ));
        }
        // SAFETY: maps `LEASE_BYTES` of an open regular file at least that long, shared and
        // read-write; the result is checked for failure.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEASE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = std::ptr::NonNull::new(p.cast::<AtomicU64>()).ok_or_else(std::io::Error::last_os_error)?;
        Ok(Lease { ptr, _file: None })
    }

    fn counter(&self) -> &AtomicU64 {
        // SAFETY: a live, page-aligned mapping of `LEASE_BYTES` (so aligned for a u64), only
        // ever accessed atomically, in this process and the others that map it.
        unsafe { self.ptr.as_ref() }
    }

    fn fingerprint(&self) -> &AtomicU64 {
        // SAFETY: the second word of the same mapping, as above.
        unsafe { &*self.ptr.as_ptr().add(1) }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // SAFETY: the mapping made by `map`, unmapped once; nothing refers to it any more.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), LEASE_BYTES) };
    }
}

/// Creates a new export's lease file, fingerprinted and locked, under its final name (made
/// whole under a temporary name first, so no importer ever sees it short).
fn create_lease(token: &[u8; 16], fingerprint: u64) -> Result<(Lease, std::path::PathBuf)> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let path = lease_path(token);
    let tmp = std::path::Path::new(LEASE_DIR).join(format!(".{LEASE_PREFIX}{}", hex(token)));
    let made = (|| {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        file.set_len(LEASE_BYTES as u64)?;
        // SAFETY: `flock` on our open file; held as long as the file is open (the export).
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut lease = Lease::map(&file)?;
        lease.fingerprint().store(fingerprint, Ordering::Release);
        std::fs::rename(&tmp, &path)?;
        lease._file = Some(file);
        Ok(lease)
    })();
    match made {
        Ok(l) => Ok((l, path)),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(io_err("creating the export's lease file", &path, e))
        }
    }
}

fn io_err(op: &'static str, path: &std::path::Path, e: std::io::Error) -> Error {
    Error::with_cause(op, path.display().to_string(), e)
}

/// Removes the lease files no exporter holds any more (the exporter holds its file's lock while
/// the export lives; a process that ended let go of its locks). Once per process. Files it
/// cannot open or lock (another user's, or live) are left alone.
fn sweep_dead_exporters() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let Ok(dir) = std::fs::read_dir(LEASE_DIR) else { return };
        for entry in dir.flatten() {
            let name = entry.file_name();
            if !name.to_str().is_some_and(|n| n.starts_with(LEASE_PREFIX)) {
                continue;
            }
            let path = entry.path();
            let Ok(file) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path) else {
                continue;
            };
            // SAFETY: `flock` on our open file: taken only if no exporter holds it.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                let _ = std::fs::remove_file(&path);
            }
        }
    });
}

/// An interprocess CUDA event, destroyed on drop.
struct IpcEvent {
    ctx: Arc<CudaContext>,
    event: sys::CUevent,
}

// SAFETY: a CUDA event handle may be used from any thread (with its context bound).
unsafe impl Send for IpcEvent {}
// SAFETY: as above; recording is serialised by `Exported`'s mutex.
unsafe impl Sync for IpcEvent {}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: an event this value created, destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
        }
    }
}

/// A buffer exported to other processes: its block is held (not freed, not reused) while it
/// lives and while any importer holds a lease. See the [module](self).
pub struct Exported<T: crate::AnyBitPattern> {
    inner: Option<Held<T>>,
    base: IpcHandle,
}

struct Held<T> {
    buffer: Buffer<T, Cuda>,
    lease: Lease,
    path: std::path::PathBuf,
    event: Mutex<IpcEvent>,
    /// The file descriptors importers need (a pool's, or the physical allocations').
    fds: Vec<std::os::fd::OwnedFd>,
    token: [u8; 16],
}

impl<T: crate::AnyBitPattern> fmt::Debug for Exported<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exported").field("handle", &self.base).field("leases", &self.leases()).finish()
    }
}

/// Exports waiting for their last lease (their `Exported` was dropped).
static LIMBO: Mutex<Vec<Box<dyn Reclaim>>> = Mutex::new(Vec::new());

trait Reclaim: Send {
    /// Frees the buffer if no lease is out (and closes the export for good); `false`: not yet.
    fn try_close(&mut self) -> bool;
}

impl<T: Send> Reclaim for Held<T> {
    fn try_close(&mut self) -> bool {
        self.lease.counter().compare_exchange(0, CLOSED, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }
}

/// Frees the exported buffers whose `Exported` was dropped and whose leases are all back;
/// returns how many still wait. Every export calls it; call it after importers let go to get
/// the memory back sooner.
pub fn reclaim() -> usize {
    let mut done = Vec::new();
    let left = {
        let mut limbo = LIMBO.lock().unwrap_or_else(|p| p.into_inner());
        let mut i = 0;
        while i < limbo.len() {
            if limbo[i].try_close() {
                done.push(limbo.swap_remove(i));
            } else {
                i += 1;
            }
        }
        limbo.len()
    };
    // Buffers (and their files) are let go outside the lock: a buffer's drop runs the
    // allocator's hooks.
    drop(done);
    left
}

impl<T> Drop for Held<T> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        our_tokens().lock().unwrap_or_else(|p| p.into_inner()).remove(&self.token);
    }
}

impl<T: crate::AnyBitPattern> Exported<T> {
    /// Exports `buffer` for other processes. Errors: memory that does not export (pinned host
    /// memory, a pool whose segment source has no export, an expandable buffer spanning more
    /// than [`MAX_FDS`] physical allocations or made without exportable handles), a failed
    /// driver call, no `/dev/shm`. On error the buffer is dropped as usual (freed into its cache).
    pub fn new(buffer: Buffer<T, Cuda>) -> Result<Exported<T>> {
        let op = "exporting a buffer";
        reclaim();
        sweep_dead_exporters();
        let (backend, src) = buffer.ipc_source();
        let ctx = backend.context().clone();
        if backend.is_pinned() {
            return Err(Error::backend(op, "pinned host memory cannot be exported through CUDA IPC"));
        }
        let Some(src) = src else {
            return Err(Error::backend(op, "an empty buffer has no memory to export"));
        };
        ctx.bind_to_thread().map_err(|e| driver_error("binding the device", e))?;
        let ptr = buffer.device_ptr_raw();
        let mut mem = [0u8; 64];
        let mut pool_key = [0u8; 16];
        let mut fds = Vec::new();
        let mut maps = Vec::new();
        let (via, offset) = match src {
            ExportSource::Segment(base) => {
                let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
                // SAFETY: an out-parameter; `base` is the base of a live `cuMemAlloc` allocation
                // (the buffer's segment, held by the buffer); the context is current.
                check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut h, base) })?;
                mem = h.reserved.map(|b| b as u8);
                (Via::Legacy, ptr - base)
            }
            ExportSource::Pool(raw, base) => {
                let Some(r) = raw.ipc_export(base) else {
                    return Err(Error::backend(
                        op,
                        format!(
                            "the pool's segment source `{}` does not export (a StreamOrderedAllocator exports when made \
                             with StreamOrderedOptions {{ exportable: true, .. }})",
                            raw.name()
                        ),
                    ));
                };
                let (fd, data, pool) = r.map_err(|e| e.into_error("exporting the pool's memory"))?;
                fds.push(fd);
                mem = data;
                pool_key[..8].copy_from_slice(&process_id().to_le_bytes());
                pool_key[8..].copy_from_slice(&pool.to_le_bytes());
                (Via::Pool, ptr - base)
            }
            ExportSource::Mapped(runs) => {
                if runs.len() > MAX_FDS {
                    return Err(Error::backend(
                        op,
                        format!("the buffer spans {} physical allocations (at most {MAX_FDS} export)", runs.len()),
                    ));
                }
                let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
                for &(_, size, handle) in &runs {
                    let mut fd: std::ffi::c_int = -1;
                    // SAFETY: `handle` is a live physical allocation mapped under the buffer (the
                    // block is held, so it stays mapped); the out-parameter is an `int`, as that
                    // handle type writes.
                    let r = unsafe {
                        sys::cuMemExportToShareableHandle((&mut fd as *mut std::ffi::c_int).cast(), handle, posix, 0)
                    };
                    if r != CUresult::CUDA_SUCCESS {
                        return Err(Error::with_cause(
                            op,
                            format!(
                                "the expandable segment's memory was made without exportable (POSIX file descriptor) \
                                 handles, or the driver refused ({r:?})"
                            ),
                            cudarc::driver::DriverError(r),
                        ));
                    }
                    // SAFETY: the driver just opened `fd` for us; nothing else owns it.
                    fds.push(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
                    maps.push(size as u64);
                }
                (Via::Mapped, ptr - runs[0].0)
            }
        };
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: out-parameter and the context's device.
        check("cuDeviceGetUuid", unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, ctx.cu_device()) })?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags =
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32 | sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        // SAFETY: out-parameter; the context is current.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut event, flags) })?;
        let event = IpcEvent { ctx: ctx.clone(), event };
        let mut ev = sys::CUipcEventHandle { reserved: [0; 64] };
        // SAFETY: an out-parameter and a live interprocess event of the current context.
        check("cuIpcGetEventHandle", unsafe { sys::cuIpcGetEventHandle(&mut ev, event.event) })?;
        let token = random_token().map_err(|e| Error::caused_by("drawing an export token", e))?;
        let base = IpcHandle {
            via,
            boot_id: boot_id(),
            device_uuid: uuid.bytes.map(|b| b as u8),
            pid: std::process::id(),
            token,
            pool_key,
            mem,
            event: ev.reserved.map(|b| b as u8),
            offset,
            bytes: buffer.num_bytes() as u64,
            elem_size: std::mem::size_of::<T>() as u32,
            maps,
        };
        let (lease, path) = create_lease(&token, base.fingerprint())?;
        our_tokens().lock().unwrap_or_else(|p| p.into_inner()).insert(token);
        Ok(Exported { inner: Some(Held { buffer, lease, path, event: Mutex::new(event), fds, token }), base })
    }

    /// The file descriptors that go with [`handle`](Self::handle) ([`IpcHandle::num_fds`]), for
    /// a transport of your own ([`send`] is one).
    pub fn fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.held().fds.iter().map(|f| f.as_fd()).collect()
    }

    /// A handle for another process, after an event recorded now on the buffer's stream: an
    /// importer's stream waits for the work queued so far (the producer's writes).
    pub fn handle(&self) -> Result<IpcHandle> {
        let held = self.held();
        let ev = held.event.lock().unwrap_or_else(|p| p.into_inner());
        let stream = DeviceSlice::stream(&held.buffer);
        ev.ctx.bind_to_thread().map_err(|e| driver_error("binding the device", e))?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream (the buffer holds it) and an out-parameter.
        check("cuStreamIsCapturing", unsafe { sys::cuStreamIsCapturing(stream.cu_stream(), &mut status) })?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(Error::Capture {
                what: "Exported::handle",
                message: "the buffer's stream is being captured into a graph: the event importers wait for would be \
                          a graph node, not the producer's work; make the handle outside the capture"
                    .into(),
            });
        }
        // SAFETY: a live event of this context and a live stream of it (the buffer holds it).
        check("cuEventRecord", unsafe { sys::cuEventRecord(ev.event, stream.cu_stream()) })?;
        Ok(self.base.clone())
    }

    /// The exported buffer (the producer may keep using it: `Exported` itself is a cudarc
    /// slice, writable too; ordering its later writes with the importers' reads is up to the
    /// program, as with PyTorch's shared tensors). Not handed out mutably: replacing it would
    /// free memory importers hold.
    pub fn buffer(&self) -> &Buffer<T, Cuda> {
        &self.held().buffer
    }

    /// Leases out now (views open in other processes).
    pub fn leases(&self) -> u64 {
        self.inner.as_ref().map_or(0, |h| h.lease.counter().load(Ordering::Acquire) & !CLOSED)
    }
}

impl<T: crate::AnyBitPattern> Exported<T> {
    fn held(&self) -> &Held<T> {
        self.inner.as_ref().expect("held until drop")
    }
}

impl<T: crate::AnyBitPattern> DeviceSlice<T> for Exported<T> {
    fn len(&self) -> usize {
        self.held().buffer.len()
    }

    fn stream(&self) -> &Arc<CudaStream> {
        DeviceSlice::stream(&self.held().buffer)
    }
}

impl<T: crate::AnyBitPattern> DevicePtr<T> for Exported<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.held().buffer.device_ptr(stream)
    }
}

impl<T: crate::AnyBitPattern> DevicePtrMut<T> for Exported<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.inner.as_mut().expect("held until drop").buffer.device_ptr_mut(stream)
    }
}

impl<T: crate::AnyBitPattern> Drop for Exported<T> {
    fn drop(&mut self) {
        let Some(held) = self.inner.take() else { return };
        if held.lease.counter().compare_exchange(0, CLOSED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            drop(held);
            return;
        }
        // Leases out: the buffer waits for them in the limbo ([`reclaim`]).
        LIMBO.lock().unwrap_or_else(|p| p.into_inner()).push(Box::new(held));
    }
}

fn check(op: &'static str, r: CUresult) -> Result<()> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(()),
        r => Err(driver_error(op, cudarc::driver::DriverError(r))),
    }
}

/// Keyed by (context, segment handle): the driver maps an allocation once per context.
type MapKey = (usize, [u8; 64]);

/// One mapping of an exported segment in one context, shared by the views on it.
struct Mapping {
    ctx: Arc<CudaContext>,
    base: u64,
    views: usize,
}

fn opened() -> &'static Mutex<HashMap<MapKey, Mapping>> {
    static OPENED: OnceLock<Mutex<HashMap<MapKey, Mapping>>> = OnceLock::new();
    OPENED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Lets go of one view of a mapping; the last one closes it (`cuIpcCloseMemHandle`).
fn unmap(key: &MapKey) {
    let mut m = opened().lock().unwrap_or_else(|p| p.into_inner());
    let Some(e) = m.get_mut(key) else { return };
    e.views -= 1;
    if e.views == 0 {
        if let Some(e) = m.remove(key) {
            if e.ctx.bind_to_thread().is_ok() {
                // SAFETY: a mapping `cuIpcOpenMemHandle` made in this context, no view left.
                let _ = unsafe { sys::cuIpcCloseMemHandle(e.base) };
            }
        }
    }
}

/// What an import holds open.
enum Opened {
    /// A legacy mapping, shared per context (closed with its last view).
    Legacy(MapKey),
    /// A pointer imported from a stream-ordered pool (shared per process; by export data).
    Pool { key: [u8; 64], base: u64 },
    /// Imported physical allocations mapped into a reservation of this process.
    Mapped { base: u64, span: usize, handles: Vec<sys::CUmemGenericAllocationHandle> },
}

/// A view of a buffer exported by another process, on a stream of this one: cudarc's copies
/// and kernels take it (`DeviceSlice`, `DevicePtr`, `DevicePtrMut`). Dropping it waits for its
/// stream's work, lets go of what it opened (a legacy mapping once no view of the segment is
/// left in this context) and gives the exporter its lease back.
pub struct Imported<T> {
    stream: Arc<CudaStream>,
    ptr: u64,
    len: usize,
    opened: Opened,
    lease: Lease,
    _elem: PhantomData<T>,
}

// SAFETY: the view owns device-side resources (driver handles usable from any thread with the
// context bound) and a shared-memory counter touched atomically; no `T` lives in it.
unsafe impl<T> Send for Imported<T> {}
// SAFETY: `&Imported` only reads its fields and hands out the device address.
unsafe impl<T> Sync for Imported<T> {}

impl<T> fmt::Debug for Imported<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Imported").field("ptr", &format_args!("{:#x}", self.ptr)).field("len", &self.len).finish()
    }
}

/// Opens a buffer another process exported, on `stream` (its context's device: the exporter's
/// GPU or a peer that can reach it), after the exporter's work queued before the handle was
/// made. For handles with file descriptors (stream-ordered pools, expandable segments) use
/// [`import_with_fds`] or [`receive`]. Errors, with nothing mapped and no lease taken: a handle
/// of another machine (or from before a reboot), of this very process, of an export that is
/// gone (stale), a size that is not a whole number of `T`, a driver refusal (a device that
/// cannot reach the memory).
pub fn import<T: crate::AnyBitPattern>(handle: &IpcHandle, stream: &Arc<CudaStream>) -> Result<Imported<T>> {
    import_with_fds(handle, Vec::new(), stream)
}

/// [`import`] of a handle that comes with file descriptors ([`IpcHandle::num_fds`]), in the
/// order [`Exported::fds`] gave them; they are consumed (closed once imported).
pub fn import_with_fds<T: crate::AnyBitPattern>(
    handle: &IpcHandle,
    fds: Vec<std::os::fd::OwnedFd>,
    stream: &Arc<CudaStream>,
) -> Result<Imported<T>> {
    use std::os::unix::fs::OpenOptionsExt;
    let op = "importing a buffer";
    if handle.boot_id != boot_id() {
        return Err(Error::backend(op, "the handle was made on another machine, or before this machine restarted"));
    }
    if our_tokens().lock().unwrap_or_else(|p| p.into_inner()).contains(&handle.token) {
        return Err(Error::backend(op, "the handle was made by this process: use the exported buffer itself"));
    }
    if fds.len() != handle.num_fds() {
        return Err(Error::backend(
            op,
            format!(
                "the handle needs {} file descriptor(s), {} given (send them with ipc::send, receive with ipc::receive)",
                handle.num_fds(),
                fds.len()
            ),
        ));
    }
    let size = std::mem::size_of::<T>();
    if size == 0 || handle.bytes % size as u64 != 0 {
        return Err(Error::backend(
            op,
            format!("{} bytes are not a whole number of {size}-byte elements", handle.bytes),
        ));
    }
    let end = handle.offset.checked_add(handle.bytes);
    if handle.via == Via::Mapped {
        let span = handle.maps.iter().try_fold(0u64, |a, &m| a.checked_add(m));
        if end.zip(span).is_none_or(|(e, s)| e > s) {
            return Err(Error::backend(op, "the buffer does not lie within the physical allocations the handle names"));
        }
    }
    let Some(end) = end else {
        return Err(Error::backend(op, "the handle's offset and size overflow"));
    };
    let path = lease_path(&handle.token);
    let stale = |why: &str| {
        Error::backend(op, format!("the export is gone ({why}): its buffer was freed, or its process exited"))
    };
    let file = match std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(stale("no lease file")),
        Err(e) => return Err(io_err("opening the export's lease file", &path, e)),
    };
    let lease = Lease::map(&file).map_err(|e| io_err("mapping the export's lease file", &path, e))?;
    if lease.fingerprint().load(Ordering::Acquire) != handle.fingerprint() {
        return Err(Error::backend(
            op,
            "the handle does not match its export's lease file (altered, or pieced together from two exports)",
        ));
    }
    if lease
        .counter()
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| (c & CLOSED == 0).then_some(c + 1))
        .is_err()
    {
        return Err(stale("closed"));
    }
    // From here, a failure gives the lease back.
    let lease = scopeguard::guard(lease, |l| {
        l.counter().fetch_sub(1, Ordering::AcqRel);
    });
    let ctx = stream.context().clone();
    ctx.bind_to_thread().map_err(|e| driver_error("binding the device", e))?;
    let opened = match handle.via {
        Via::Legacy => open_legacy(handle, &ctx)?,
        Via::Pool => open_pool(handle, fds, &ctx)?,
        Via::Mapped => open_mapped(handle, fds, &ctx)?,
    };
    // From here, a failure closes what was opened.
    let opened = scopeguard::guard(opened, close);
    let mut eh: sys::CUipcEventHandle = sys::CUipcEventHandle { reserved: [0; 64] };
    for (d, s) in eh.reserved.iter_mut().zip(handle.event) {
        *d = s as _;
    }
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: out-parameter; the exporter's event is alive while a lease is out (it is dropped
    // with the export, after the last lease).
    check("cuIpcOpenEventHandle", unsafe { sys::cuIpcOpenEventHandle(&mut ev, eh) })?;
    // SAFETY: a live stream of the current context and the event just opened.
    let waited = check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(stream.cu_stream(), ev, 0) });
    // SAFETY: the opened event, destroyed once (the wait keeps what it needs).
    let _ = unsafe { sys::cuEventDestroy_v2(ev) };
    waited?;
    let base = match &*opened {
        Opened::Legacy(key) => opened_base(key),
        Opened::Pool { base, .. } | Opened::Mapped { base, .. } => *base,
    };
    if !matches!(*opened, Opened::Mapped { .. }) {
        // The handle's offset and size are only words: the allocation opened says how far the
        // view may reach.
        let (mut start, mut size) = (0, 0usize);
        // SAFETY: out-parameters; `base` is the start of the allocation just opened here.
        check("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) })?;
        if start != base || end > size as u64 {
            return Err(Error::backend(
                op,
                format!("the handle names bytes {}..{end} of an allocation of {size} bytes", handle.offset),
            ));
        }
    }
    let opened = scopeguard::ScopeGuard::into_inner(opened);
    Ok(Imported {
        stream: stream.clone(),
        ptr: base + handle.offset,
        len: (handle.bytes / size as u64) as usize,
        opened,
        lease: scopeguard::ScopeGuard::into_inner(lease),
        _elem: PhantomData,
    })
}

fn opened_base(key: &MapKey) -> u64 {
    opened().lock().unwrap_or_else(|p| p.into_inner()).get(key).map_or(0, |m| m.base)
}

/// Maps a legacy handle's segment in `ctx` (once per context; the mapping is shared).
fn open_legacy(handle: &IpcHandle, ctx: &Arc<CudaContext>) -> Result<Opened> {
    let key: MapKey = (ctx.cu_ctx() as usize, handle.mem);
    let mut m = opened().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = m.get_mut(&key) {
        e.views += 1;
        return Ok(Opened::Legacy(key));
    }
    let mut mh = sys::CUipcMemHandle { reserved: [0; 64] };
    for (d, s) in mh.reserved.iter_mut().zip(handle.mem) {
        *d = s as _;
    }
    let mut base = 0;
    let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: out-parameter; the handle's bytes are checked by the driver, which refuses what
    // it did not make; the context is current.
    check("cuIpcOpenMemHandle", unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, mh, flags) })?;
    m.insert(key, Mapping { ctx: ctx.clone(), base, views: 1 });
    Ok(Opened::Legacy(key))
}

fn device_of(uuid: &[u8; 16]) -> Option<usize> {
    let n = crate::backend::cuda::device_count().ok()?;
    (0..n).find(|&d| {
        let mut dev = 0;
        let mut u = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: out-parameters of two plain queries.
        let ok = unsafe {
            sys::cuDeviceGet(&mut dev, d as i32) == CUresult::CUDA_SUCCESS
                && sys::cuDeviceGetUuid_v2(&mut u, dev) == CUresult::CUDA_SUCCESS
        };
        ok && u.bytes.map(|b| b as u8) == *uuid
    })
}

fn access_desc(device: usize) -> sys::CUmemAccessDesc {
    // SAFETY: a plain C struct of integers; all zeros is valid.
    let mut d: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    d.location = crate::backend::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, device as i32);
    d.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    d
}

/// Stream-ordered pools and pointers imported by this process, each once (the driver gives the
/// same address when an allocation is imported again, so one free would pull it from under
/// every view): counted, let go of with their last view.
#[derive(Default)]
struct PoolImports {
    /// By pool key: the imported pool, the imports using it, the devices given access.
    pools: HashMap<[u8; 16], (usize, usize, Vec<usize>)>,
    /// By export data: the address, the views, the pool key.
    ptrs: HashMap<[u8; 64], (u64, usize, [u8; 16])>,
}

fn pool_imports() -> &'static Mutex<PoolImports> {
    static IMPORTS: OnceLock<Mutex<PoolImports>> = OnceLock::new();
    IMPORTS.get_or_init(|| Mutex::new(PoolImports::default()))
}

/// Imports a stream-ordered pool from its descriptor (once per process) and the allocation
/// from its export data (once per process), and gives `ctx`'s device access when it is not the
/// pool's own.
fn open_pool(handle: &IpcHandle, fds: Vec<std::os::fd::OwnedFd>, ctx: &Arc<CudaContext>) -> Result<Opened> {
    use std::os::fd::AsRawFd;
    let mut im = pool_imports().lock().unwrap_or_else(|p| p.into_inner());
    let device = ctx.ordinal();
    let fresh_pool = !im.pools.contains_key(&handle.pool_key);
    if fresh_pool {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: out-parameter; a POSIX descriptor handle is passed as the descriptor's value
        // in the pointer argument, as the driver documents; the driver checks what it names.
        check("cuMemPoolImportFromShareableHandle", unsafe {
            sys::cuMemPoolImportFromShareableHandle(
                &mut pool,
                fds[0].as_raw_fd() as usize as *mut std::ffi::c_void,
                posix,
                0,
            )
        })?;
        im.pools.insert(handle.pool_key, (pool as usize, 0, Vec::new()));
    }
    let forget_fresh = |im: &mut PoolImports| {
        if fresh_pool {
            if let Some((p, _, _)) = im.pools.remove(&handle.pool_key) {
                // SAFETY: the pool imported above, used by nothing yet, given back once.
                let _ = unsafe { sys::cuMemPoolDestroy(p as sys::CUmemoryPool) };
            }
        }
    };
    let (pool, _, access) = im.pools.get(&handle.pool_key).cloned().unwrap_or_default();
    let pool = pool as sys::CUmemoryPool;
    if device_of(&handle.device_uuid) != Some(device) && !access.contains(&device) {
        let d = access_desc(device);
        // SAFETY: a live imported pool and one valid descriptor.
        if let Err(e) = check("cuMemPoolSetAccess", unsafe { sys::cuMemPoolSetAccess(pool, &d, 1) }) {
            forget_fresh(&mut im);
            return Err(e);
        }
        if let Some(p) = im.pools.get_mut(&handle.pool_key) {
            p.2.push(device);
        }
    }
    if let Some(e) = im.ptrs.get_mut(&handle.mem) {
        e.1 += 1;
        return Ok(Opened::Pool { key: handle.mem, base: e.0 });
    }
    let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
    data.reserved.copy_from_slice(&handle.mem);
    let mut base = 0;
    // SAFETY: out-parameter, the imported pool and the exporter's data for one of its
    // allocations (checked by the driver).
    if let Err(e) = check("cuMemPoolImportPointer", unsafe { sys::cuMemPoolImportPointer(&mut base, pool, &mut data) })
    {
        forget_fresh(&mut im);
        return Err(e);
    }
    im.ptrs.insert(handle.mem, (base, 1, handle.pool_key));
    if let Some(p) = im.pools.get_mut(&handle.pool_key) {
        p.1 += 1;
    }
    Ok(Opened::Pool { key: handle.mem, base })
}

/// Imports the physical allocations and maps them, in order, into a reservation of this
/// process, readable and writable by `ctx`'s device.
fn open_mapped(handle: &IpcHandle, fds: Vec<std::os::fd::OwnedFd>, ctx: &Arc<CudaContext>) -> Result<Opened> {
    use std::os::fd::AsRawFd;
    let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    let mut handles = Vec::with_capacity(fds.len());
    let release = |hs: Vec<sys::CUmemGenericAllocationHandle>| {
        for h in hs {
            // SAFETY: handles imported here, released once on a failure path.
            let _ = unsafe { sys::cuMemRelease(h) };
        }
    };
    for fd in &fds {
        let mut h = 0;
        // SAFETY: out-parameter; the descriptor's value in the pointer argument, as documented.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(&mut h, fd.as_raw_fd() as usize as *mut std::ffi::c_void, posix)
        };
        if let Err(e) = check("cuMemImportFromShareableHandle", r) {
            release(handles);
            return Err(e);
        }
        handles.push(h);
    }
    let span: usize = handle.maps.iter().sum::<u64>() as usize;
    let mut base = 0;
    // SAFETY: out-parameter; a fresh range of `span` bytes (a multiple of the granularity: the
    // sizes of physical allocations are).
    if let Err(e) = check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut base, span, 0, 0, 0) }) {
        release(handles);
        return Err(e);
    }
    let mut at = 0u64;
    let mut mapped = 0;
    let mut failed = None;
    for (&h, &size) in handles.iter().zip(&handle.maps) {
        // SAFETY: an unmapped part of the reservation just made, and a handle of `size` bytes
        // (the driver checks the size against the allocation).
        if let Err(e) = check("cuMemMap", unsafe { sys::cuMemMap(base + at, size as usize, 0, h, 0) }) {
            failed = Some(e);
            break;
        }
        mapped += 1;
        at += size;
    }
    if failed.is_none() {
        let d = access_desc(ctx.ordinal());
        // SAFETY: the whole reservation is mapped; one valid descriptor.
        failed = check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(base, span, &d, 1) }).err();
    }
    if let Some(e) = failed {
        let mut at = 0u64;
        for &size in handle.maps.iter().take(mapped) {
            // SAFETY: the mappings made above, undone once.
            let _ = unsafe { sys::cuMemUnmap(base + at, size as usize) };
            at += size;
        }
        // SAFETY: the reservation made above, now empty, given back once.
        let _ = unsafe { sys::cuMemAddressFree(base, span) };
        release(handles);
        return Err(e);
    }
    Ok(Opened::Mapped { base, span, handles })
}

/// Lets go of what an import opened (its stream's work is done).
fn close(o: Opened) {
    match o {
        Opened::Legacy(key) => unmap(&key),
        Opened::Pool { key, .. } => {
            let mut im = pool_imports().lock().unwrap_or_else(|p| p.into_inner());
            let Some(e) = im.ptrs.get_mut(&key) else { return };
            e.1 -= 1;
            if e.1 > 0 {
                return;
            }
            let Some((base, _, pool_key)) = im.ptrs.remove(&key) else { return };
            // SAFETY: the imported pointer, its last view gone, freed once (the importer frees
            // it before the exporter does: the lease keeps the exporter's allocation).
            let _ = unsafe { sys::cuMemFree_v2(base) };
            let Some(p) = im.pools.get_mut(&pool_key) else { return };
            p.1 -= 1;
            if p.1 == 0 {
                if let Some((pool, _, _)) = im.pools.remove(&pool_key) {
                    // SAFETY: the imported pool, no pointer of it left, given back once.
                    let _ = unsafe { sys::cuMemPoolDestroy(pool as sys::CUmemoryPool) };
                }
            }
        }
        Opened::Mapped { base, span, handles } => {
            // SAFETY: the reservation this import mapped whole, unmapped and given back once,
            // then its imported handles released.
            unsafe {
                let _ = sys::cuMemUnmap(base, span);
                let _ = sys::cuMemAddressFree(base, span);
                for h in handles {
                    let _ = sys::cuMemRelease(h);
                }
            }
        }
    }
}

impl<T> Imported<T> {
    /// The view's device address.
    pub fn device_ptr_raw(&self) -> u64 {
        self.ptr
    }

    /// The view's size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// Makes `stream` wait for this view's own stream (a use on another stream).
    fn order<'a>(&'a self, stream: &'a CudaStream) -> SyncOnDrop<'a> {
        // Default streams share the null handle across contexts: the context tells them apart.
        if stream.cu_stream() == self.stream.cu_stream() && stream.context() == self.stream.context() {
            return SyncOnDrop::Sync(None);
        }
        if stream.join(&self.stream).is_err() {
            let _ = self.stream.synchronize();
        }
        // The other stream's use is waited for when the borrow ends, so that dropping the view
        // (which waits for its own stream only) cannot give the lease back under it.
        SyncOnDrop::Sync(Some(stream))
    }
}

impl<T> Drop for Imported<T> {
    fn drop(&mut self) {
        // The work this process queued on the memory is done before the mapping closes and the
        // exporter may reuse the block.
        let _ = self.stream.synchronize();
        if self.stream.context().bind_to_thread().is_ok() {
            close(std::mem::replace(&mut self.opened, Opened::Legacy((0, [0; 64]))));
        }
        self.lease.counter().fetch_sub(1, Ordering::AcqRel);
    }
}

impl<T> DeviceSlice<T> for Imported<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for Imported<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.order(stream))
    }
}

impl<T> DevicePtrMut<T> for Imported<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.order(stream))
    }
}

/// Sends an export's handle ([`Exported::handle`]: an event after the work queued so far) and
/// its file descriptors over a Unix stream socket (`SCM_RIGHTS`), as one message [`receive`]
/// reads.
pub fn send<T: crate::AnyBitPattern>(sock: &std::os::unix::net::UnixStream, exported: &Exported<T>) -> Result<()> {
    let bytes = exported.handle()?.to_bytes();
    send_message(sock, &bytes, &exported.fds()).map_err(|e| Error::caused_by("sending an IPC handle", e))
}

/// Writes one message to a Unix stream socket: its length (4 bytes, little-endian), then
/// `data`, with `fds` attached to the first bytes (`SCM_RIGHTS`: the receiver gets its own
/// descriptors of the same files). [`receive_message`] reads it. This is the framing of
/// [`send`]; other rendezvous (symmetric memory across processes) use it too.
pub fn send_message(
    sock: &std::os::unix::net::UnixStream,
    data: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if fds.len() > MAX_FDS {
        return Err(std::io::Error::other(format!("{} file descriptors (at most {MAX_FDS})", fds.len())));
    }
    let len = u32::try_from(data.len()).map_err(|_| std::io::Error::other("a message over 4 GiB"))?;
    let mut msg = len.to_le_bytes().to_vec();
    msg.extend_from_slice(data);
    let fds: Vec<std::ffi::c_int> = fds.iter().map(|f| f.as_raw_fd()).collect();
    send_with_fds(sock, &msg, &fds)
}

/// The process at the other end of a Unix socket, as the kernel recorded it when the
/// connection was made (`SO_PEERCRED`): its process id and effective user id. A rendezvous on a
/// socket any local process can reach (an abstract name) uses it to hear only its own user's
/// processes, and to check that a peer is the process it says it is.
pub fn peer_credentials(sock: &std::os::unix::net::UnixStream) -> std::io::Result<(u32, u32)> {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain C struct of integers; all zeros is valid.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live out-parameters of the sizes stated, for the call.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((cred.pid as u32, cred.uid))
}

/// This process's effective user id (to compare with [`peer_credentials`]).
pub fn effective_uid() -> u32 {
    // SAFETY: `geteuid` has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Writes `data` with `fds` attached to its first byte.
fn send_with_fds(sock: &std::os::unix::net::UnixStream, data: &[u8], fds: &[std::ffi::c_int]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: pure arithmetic on a length.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    // u64 words: the control buffer must be aligned for `cmsghdr`.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut std::ffi::c_void, iov_len: data.len() };
    // SAFETY: a plain C struct; all zeros is an empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` has a control buffer of `space` bytes, room for one header and `fds`;
        // the header and its data are written inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(c), fd_bytes);
        }
    }
    let n = loop {
        // SAFETY: `msg` points at live buffers (`iov`, `data`, `control`) for the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // The descriptors went with the first bytes; the rest is plain data (no SIGPIPE either).
    let mut rest = &data[n..];
    while !rest.is_empty() {
        // SAFETY: sends from `rest`, a live slice, for the call.
        let k = unsafe { libc::send(sock.as_raw_fd(), rest.as_ptr().cast(), rest.len(), libc::MSG_NOSIGNAL) };
        if k < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        rest = &rest[k as usize..];
    }
    Ok(())
}

/// Reads one message of [`send`] from a Unix stream socket: the handle and its descriptors
/// (received close-on-exec). It reads exactly one message (its length first, then that many
/// bytes), so messages sent back to back stay apart. Errors: the peer closed the socket, a
/// message that is not a handle, descriptors cut short (more than [`MAX_FDS`]), descriptors
/// that do not come with the message's first bytes.
pub fn receive_handle(sock: &std::os::unix::net::UnixStream) -> Result<(IpcHandle, Vec<std::os::fd::OwnedFd>)> {
    let op = "receiving an IPC handle";
    let (buf, fds) = receive_message(sock, FIXED + 8 * MAX_FDS).map_err(|e| match e.kind() {
        // The framing's own findings are the message; the socket's errors are the cause.
        std::io::ErrorKind::Other | std::io::ErrorKind::UnexpectedEof => Error::backend(op, e.to_string()),
        _ => Error::caused_by(op, e),
    })?;
    Ok((IpcHandle::from_bytes(&buf)?, fds))
}

/// Reads one message of [`send_message`] from a Unix stream socket: its data and the
/// descriptors that came with it (received close-on-exec, owned: closed on any error). Errors
/// (`std::io::Error`, with the socket's own errors, a read timeout included, as they are): the
/// peer closed the socket (`UnexpectedEof`), a message longer than `max_len` bytes, more than
/// [`MAX_FDS`] descriptors (cut short), descriptors that do not come with the first bytes. An
/// error after part of a message was read (a read timeout, `WouldBlock` on a non-blocking
/// socket) shuts the socket down for reading: the message is lost, and later calls fail rather
/// than read its rest as a new message.
pub fn receive_message(
    sock: &std::os::unix::net::UnixStream,
    max_len: usize,
) -> std::io::Result<(Vec<u8>, Vec<std::os::fd::OwnedFd>)> {
    // An error after part of the frame was read (a read timeout, `WouldBlock` on a
    // non-blocking socket) would leave the stream inside a frame: the socket is shut down for
    // reading then, so a later call fails instead of reading the rest as a new frame.
    let mid = |e: std::io::Error| {
        let _ = sock.shutdown(std::net::Shutdown::Read);
        std::io::Error::new(
            e.kind(),
            format!("{e} (mid-message: the socket is shut down for reading, the message lost)"),
        )
    };
    let mut fds = Vec::new();
    let mut len4 = [0u8; 4];
    let mut have = 0;
    while have < 4 {
        let before = fds.len();
        let n = match receive_some(sock, &mut len4[have..], &mut fds) {
            Ok(n) => n,
            Err(e) if have > 0 => return Err(mid(e)),
            Err(e) => return Err(e),
        };
        if n == 0 {
            let what = if have == 0 {
                "the socket is closed (by the peer, or shut down after an earlier read failed mid-message)"
            } else {
                "the peer closed the socket mid-message"
            };
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, what));
        }
        if have > 0 && fds.len() > before {
            return Err(std::io::Error::other("file descriptors came after the message's first bytes"));
        }
        have += n;
    }
    let len = u32::from_le_bytes(len4) as usize;
    if len > max_len {
        return Err(std::io::Error::other(format!("a message of {len} bytes (at most {max_len} expected)")));
    }
    let mut buf = vec![0u8; len];
    let mut got = 0;
    while got < len {
        let before = fds.len();
        let n = receive_some(sock, &mut buf[got..], &mut fds).map_err(mid)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the peer closed the socket mid-message",
            ));
        }
        if fds.len() > before {
            return Err(std::io::Error::other("file descriptors came after the message's first bytes"));
        }
        got += n;
    }
    Ok((buf, fds))
}

/// One `recvmsg` into `buf` (retried on EINTR), with room for [`MAX_FDS`] descriptors: those
/// that come are owned at once (pushed to `fds`, so closed on any error). Returns the bytes
/// read (0: the peer closed the socket). Error: descriptors cut short.
fn receive_some(
    sock: &std::os::unix::net::UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<std::os::fd::OwnedFd>,
) -> std::io::Result<usize> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let fd_bytes = MAX_FDS * std::mem::size_of::<std::ffi::c_int>();
    // Room for the descriptors, and for the credentials the kernel adds on a socket with
    // `SO_PASSCRED` on. SAFETY: pure arithmetic on lengths.
    let space =
        unsafe { libc::CMSG_SPACE(fd_bytes as u32) + libc::CMSG_SPACE(std::mem::size_of::<libc::ucred>() as u32) }
            as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    loop {
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        // SAFETY: a plain C struct; all zeros is an empty message.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` points at live buffers of the sizes it states, for the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: walks the control messages the kernel wrote into `control` (`msg` says how
        // many bytes); each `SCM_RIGHTS` payload is an array of descriptors now open here.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    let data = libc::CMSG_DATA(c);
                    for i in 0..len / std::mem::size_of::<std::ffi::c_int>() {
                        let fd = std::ptr::read_unaligned(data.cast::<std::ffi::c_int>().add(i));
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        // (The control buffer has some room past `MAX_FDS` descriptors, for credentials.)
        if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > MAX_FDS {
            return Err(std::io::Error::other(format!("more than {MAX_FDS} file descriptors: cut short")));
        }
        return Ok(n as usize);
    }
}

/// [`receive_handle`] and [`import_with_fds`]: the buffer another process [`send`]s, opened on
/// `stream`.
pub fn receive<T: crate::AnyBitPattern>(
    sock: &std::os::unix::net::UnixStream,
    stream: &Arc<CudaStream>,
) -> Result<Imported<T>> {
    let (handle, fds) = receive_handle(sock)?;
    import_with_fds(&handle, fds, stream)
}
