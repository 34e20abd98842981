//! Buffers shared with other processes on the same machine (CUDA IPC), as PyTorch shares CUDA
//! tensors between processes.
//!
//! The exporter turns a [`Buffer`] into an [`Exported`] and sends its [`IpcHandle`] (plain
//! bytes: [`IpcHandle::to_bytes`]) to another process by any channel; that process opens it
//! with [`import`] on a stream of its own, on the same GPU or another one that can reach it,
//! and gets an [`Imported`] view that cudarc's copies and kernels take like a `CudaSlice`.
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
//! (`/dev/shm/mempool-ipc-<pid>-<n>`): every import takes a lease before it maps anything and
//! gives it back when the view is dropped, after its stream's work on the memory is done. When
//! the `Exported` is dropped with leases out, its buffer waits (is not freed, so its block is not
//! reused) until the last lease is back: [`reclaim`] frees the buffers whose leases are all
//! back, and every new export calls it. An export closed for good refuses new imports (a stale
//! handle: a clear error, nothing mapped). A consumer that dies holding a lease keeps the buffer
//! until the producer exits, as with PyTorch's reference-counting files; the files of producers
//! that are gone are removed by the next export on the machine.
//!
//! **What exports.** Buffers of the default pools and of pools without their own segment
//! source, in `cuMemAlloc` segments: `cuIpcGetMemHandle` maps a whole allocation, so the handle
//! carries the buffer's offset in its segment. Expandable segments, pinned memory and pools with
//! a segment source of their own (stream-ordered pools, `ncclMemAlloc`) are refused with an
//! error that says so. One mapping per segment and context in the importer, however many views
//! share it (the driver maps an allocation once per context).

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use crate::backend::cuda::driver_error;
use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::kind::Cuda;

const MAGIC: [u8; 8] = *b"MPIPC\x00\x00\x01";
const LEN: usize = 8 + 16 + 16 + 4 + 8 + 64 + 64 + 8 + 8 + 4;
/// The lease counter's "closed for good" bit: no import may take a lease any more.
const CLOSED: u64 = 1 << 63;

/// What another process needs to open an exported buffer: plain bytes, safe to send anywhere
/// (opening it checks it). Made by [`Exported::handle`], read by [`import`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle {
    boot_id: [u8; 16],
    device_uuid: [u8; 16],
    pid: u32,
    export: u64,
    mem: [u8; 64],
    event: [u8; 64],
    offset: u64,
    bytes: u64,
    elem_size: u32,
}

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcHandle")
            .field("pid", &self.pid)
            .field("export", &self.export)
            .field("offset", &self.offset)
            .field("bytes", &self.bytes)
            .field("elem_size", &self.elem_size)
            .finish_non_exhaustive()
    }
}

impl IpcHandle {
    /// The handle as bytes (a fixed layout), for any channel between processes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(LEN);
        v.extend_from_slice(&MAGIC);
        v.extend_from_slice(&self.boot_id);
        v.extend_from_slice(&self.device_uuid);
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.export.to_le_bytes());
        v.extend_from_slice(&self.mem);
        v.extend_from_slice(&self.event);
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.bytes.to_le_bytes());
        v.extend_from_slice(&self.elem_size.to_le_bytes());
        v
    }

    /// Reads [`to_bytes`](Self::to_bytes). Errors: not a handle (wrong length or marker).
    pub fn from_bytes(b: &[u8]) -> Result<IpcHandle> {
        if b.len() != LEN || b[..8] != MAGIC {
            return Err(Error::backend(
                "reading an IPC handle",
                format!("not a mempool IPC handle ({} bytes; a handle is {LEN}, from IpcHandle::to_bytes)", b.len()),
            ));
        }
        let mut at = 8;
        let mut take = |n: usize| {
            let s = &b[at..at + n];
            at += n;
            s
        };
        let arr16 = |s: &[u8]| <[u8; 16]>::try_from(s).unwrap_or_default();
        let arr64 = |s: &[u8]| <[u8; 64]>::try_from(s).unwrap_or([0; 64]);
        let boot_id = arr16(take(16));
        let device_uuid = arr16(take(16));
        let pid = u32::from_le_bytes(take(4).try_into().unwrap_or_default());
        let export = u64::from_le_bytes(take(8).try_into().unwrap_or_default());
        let mem = arr64(take(64));
        let event = arr64(take(64));
        let offset = u64::from_le_bytes(take(8).try_into().unwrap_or_default());
        let bytes = u64::from_le_bytes(take(8).try_into().unwrap_or_default());
        let elem_size = u32::from_le_bytes(take(4).try_into().unwrap_or_default());
        Ok(IpcHandle { boot_id, device_uuid, pid, export, mem, event, offset, bytes, elem_size })
    }

    /// The exported buffer's size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.bytes as usize
    }

    /// The exporting process.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The buffer's offset in the allocation the handle maps (a buffer of the caching allocator
    /// usually lies inside a larger segment).
    pub fn offset(&self) -> u64 {
        self.offset
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

fn lease_path(pid: u32, export: u64) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/dev/shm/mempool-ipc-{pid}-{export}"))
}

/// A lease counter in a shared-memory file, mapped.
struct Lease {
    ptr: std::ptr::NonNull<AtomicU64>,
}

// SAFETY: the mapping is process memory that lives as long as the `Lease`; it is only touched
// through the atomic, which may be shared between threads (and processes).
unsafe impl Send for Lease {}
// SAFETY: as above.
unsafe impl Sync for Lease {}

impl Lease {
    fn map(file: &std::fs::File) -> std::io::Result<Lease> {
        use std::os::fd::AsRawFd;
        // SAFETY: maps 8 bytes of an open file (its length is at least 8: the exporter sets it
        // before anyone can know the name's export number) shared and read-write; the result is
        // checked for failure.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8,
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
        Ok(Lease { ptr })
    }

    fn counter(&self) -> &AtomicU64 {
        // SAFETY: a live, page-aligned mapping of 8 bytes (so aligned for a u64), only ever
        // accessed atomically, in this process and the others that map it.
        unsafe { self.ptr.as_ref() }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // SAFETY: the mapping made by `map`, unmapped once; nothing refers to it any more.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), 8) };
    }
}

fn io_err(op: &'static str, path: &std::path::Path, e: std::io::Error) -> Error {
    Error::with_cause(op, format!("{}: {e}", path.display()), e)
}

/// Removes the lease files of exporting processes that are gone (their buffers went with
/// them). Once per process.
fn sweep_dead_exporters() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let Ok(dir) = std::fs::read_dir("/dev/shm") else { return };
        for entry in dir.flatten() {
            let name = entry.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("mempool-ipc-")) else { continue };
            let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else { continue };
            // SAFETY: `kill` with signal 0 sends nothing; it only asks whether `pid` exists.
            let gone = unsafe { libc::kill(pid, 0) } != 0
                && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
            if gone {
                let _ = std::fs::remove_file(entry.path());
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
pub struct Exported<T: Send + 'static> {
    inner: Option<Held<T>>,
    base: IpcHandle,
}

struct Held<T> {
    buffer: Buffer<T, Cuda>,
    lease: Lease,
    path: std::path::PathBuf,
    event: Mutex<IpcEvent>,
}

impl<T: Send + 'static> fmt::Debug for Exported<T> {
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
    }
}

static NEXT_EXPORT: AtomicU64 = AtomicU64::new(1);

impl<T: Send + 'static> Exported<T> {
    /// Exports `buffer` for other processes. Errors: memory CUDA IPC cannot export (see the
    /// [module](self)), a failed driver call, no `/dev/shm`. On error the buffer is dropped as
    /// usual (freed into its cache).
    pub fn new(buffer: Buffer<T, Cuda>) -> Result<Exported<T>> {
        reclaim();
        sweep_dead_exporters();
        let (backend, seg) = buffer.ipc_segment();
        let ctx = backend.context().clone();
        if backend.is_pinned() {
            return Err(Error::backend("exporting a buffer", "pinned host memory cannot be exported through CUDA IPC"));
        }
        let Some((seg_addr, _)) = seg else {
            let what = if buffer.num_bytes() == 0 {
                "an empty buffer has no memory to export"
            } else {
                "only buffers in cuMemAlloc segments export through CUDA IPC (not expandable segments, nor pools with \
                 their own segment source such as stream-ordered or ncclMemAlloc pools)"
            };
            return Err(Error::backend("exporting a buffer", what));
        };
        ctx.bind_to_thread().map_err(|e| driver_error("binding the device", e))?;
        let mut mem = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: an out-parameter; `seg_addr` is the base of a live `cuMemAlloc` allocation
        // (the buffer's segment, held by the buffer); the context is current.
        check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut mem, seg_addr) })?;
        let mut uuid: sys::CUuuid = sys::CUuuid { bytes: [0; 16] };
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
        let pid = std::process::id();
        let export = NEXT_EXPORT.fetch_add(1, Ordering::Relaxed);
        let path = lease_path(pid, export);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_err("creating the export's lease file", &path, e))?;
        let lease = file.set_len(8).and_then(|()| Lease::map(&file));
        let lease = match lease {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(io_err("mapping the export's lease file", &path, e));
            }
        };
        let offset = buffer.device_ptr_raw() - seg_addr;
        let base = IpcHandle {
            boot_id: boot_id(),
            device_uuid: uuid.bytes.map(|b| b as u8),
            pid,
            export,
            mem: mem.reserved.map(|b| b as u8),
            event: ev.reserved.map(|b| b as u8),
            offset,
            bytes: buffer.num_bytes() as u64,
            elem_size: std::mem::size_of::<T>() as u32,
        };
        Ok(Exported { inner: Some(Held { buffer, lease, path, event: Mutex::new(event) }), base })
    }

    /// A handle for another process, after an event recorded now on the buffer's stream: an
    /// importer's stream waits for the work queued so far (the producer's writes).
    pub fn handle(&self) -> Result<IpcHandle> {
        let held = self.held();
        let ev = held.event.lock().unwrap_or_else(|p| p.into_inner());
        let stream = DeviceSlice::stream(&held.buffer);
        ev.ctx.bind_to_thread().map_err(|e| driver_error("binding the device", e))?;
        // SAFETY: a live event of this context and a live stream of it (the buffer holds it).
        check("cuEventRecord", unsafe { sys::cuEventRecord(ev.event, stream.cu_stream()) })?;
        Ok(self.base)
    }

    /// The exported buffer (the producer may keep using it; ordering its later writes with the
    /// importers' reads is up to the program, as with PyTorch's shared tensors).
    pub fn buffer(&self) -> &Buffer<T, Cuda> {
        &self.held().buffer
    }

    /// The exported buffer, mutably.
    pub fn buffer_mut(&mut self) -> &mut Buffer<T, Cuda> {
        &mut self.inner.as_mut().expect("held until drop").buffer
    }

    /// Leases out now (views open in other processes).
    pub fn leases(&self) -> u64 {
        self.inner.as_ref().map_or(0, |h| h.lease.counter().load(Ordering::Acquire) & !CLOSED)
    }
}

impl<T: Send + 'static> Exported<T> {
    fn held(&self) -> &Held<T> {
        self.inner.as_ref().expect("held until drop")
    }
}

impl<T: Send + 'static> Drop for Exported<T> {
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

/// A view of a buffer exported by another process, on a stream of this one: cudarc's copies
/// and kernels take it (`DeviceSlice`, `DevicePtr`, `DevicePtrMut`). Dropping it waits for its
/// stream's work, closes the mapping (once no view of the segment is left in this context) and
/// gives the exporter its lease back.
pub struct Imported<T> {
    stream: Arc<CudaStream>,
    ptr: u64,
    len: usize,
    key: MapKey,
    lease: Lease,
    _elem: PhantomData<T>,
}

impl<T> fmt::Debug for Imported<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Imported").field("ptr", &format_args!("{:#x}", self.ptr)).field("len", &self.len).finish()
    }
}

/// Opens a buffer another process exported, on `stream` (its context's device: the exporter's
/// GPU or a peer that can reach it), after the exporter's work queued before the handle was
/// made. Errors, with nothing mapped and no lease taken: a handle of another machine (or from
/// before a reboot), of this very process, of an export that is gone (stale), a size that is
/// not a whole number of `T`, a driver refusal (a device that cannot reach the memory).
pub fn import<T: crate::AnyBitPattern>(handle: &IpcHandle, stream: &Arc<CudaStream>) -> Result<Imported<T>> {
    let op = "importing a buffer";
    if handle.boot_id != boot_id() {
        return Err(Error::backend(op, "the handle was made on another machine, or before this machine restarted"));
    }
    if handle.pid == std::process::id() {
        return Err(Error::backend(op, "the handle was made by this process: use the exported buffer itself"));
    }
    let size = std::mem::size_of::<T>();
    if size == 0 || handle.bytes % size as u64 != 0 {
        return Err(Error::backend(
            op,
            format!("{} bytes are not a whole number of {size}-byte elements", handle.bytes),
        ));
    }
    let path = lease_path(handle.pid, handle.export);
    let stale = |why: &str| {
        Error::backend(op, format!("the export is gone ({why}): its buffer was freed, or its process exited"))
    };
    let file = match std::fs::OpenOptions::new().read(true).write(true).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(stale("no lease file")),
        Err(e) => return Err(io_err("opening the export's lease file", &path, e)),
    };
    let lease = Lease::map(&file).map_err(|e| io_err("mapping the export's lease file", &path, e))?;
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
    let key: MapKey = (ctx.cu_ctx() as usize, handle.mem);
    let base = {
        let mut m = opened().lock().unwrap_or_else(|p| p.into_inner());
        match m.get_mut(&key) {
            Some(e) => {
                e.views += 1;
                e.base
            }
            None => {
                let mut mh: sys::CUipcMemHandle = sys::CUipcMemHandle { reserved: [0; 64] };
                for (d, s) in mh.reserved.iter_mut().zip(handle.mem) {
                    *d = s as _;
                }
                let mut base = 0;
                let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
                // SAFETY: out-parameter; the handle's bytes are checked by the driver, which
                // refuses what it did not make; the context is current.
                check("cuIpcOpenMemHandle", unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, mh, flags) })?;
                m.insert(key, Mapping { ctx: ctx.clone(), base, views: 1 });
                base
            }
        }
    };
    let mapped = scopeguard::guard((), |()| unmap(&key));
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
    scopeguard::ScopeGuard::into_inner(mapped);
    Ok(Imported {
        stream: stream.clone(),
        ptr: base + handle.offset,
        len: (handle.bytes / size as u64) as usize,
        key,
        lease: scopeguard::ScopeGuard::into_inner(lease),
        _elem: PhantomData,
    })
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
        if stream.cu_stream() == self.stream.cu_stream() {
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
        unmap(&self.key);
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
