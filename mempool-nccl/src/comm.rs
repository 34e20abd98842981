//! `Communicator`: a safe wrapper over NCCL's communicator (cudarc's `nccl::result`/`sys`; its own
//! `Comm` hides the raw handle that registration needs).

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice};
use cudarc::nccl::{result, sys};
use mempool::{Allocator, MemPool};

use crate::alloc::check_nccl;
pub use crate::env::LaunchEnv;
use crate::error::{nccl, Error, Result};
use crate::register::{NcclRegistrar, RegState, Registrar, Registration};
pub use crate::types::{Bf16, NcclType, ReduceOp};

/// A communicator's unique id: made by one rank and handed to the others by any means.
#[derive(Clone, Copy)]
pub struct Id(sys::ncclUniqueId);

impl Id {
    /// A new id. Uses `NCCL_COMM_ID` when it is set (every rank then gets the same id).
    pub fn new() -> Result<Id> {
        check_nccl()?;
        result::get_uniqueid().map(Id).map_err(|e| nccl("ncclGetUniqueId", e))
    }

    /// Its 128 bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|c| c as u8)
    }

    /// An id received from the rank that made it.
    pub fn from_bytes(bytes: [u8; 128]) -> Id {
        Id(sys::ncclUniqueId { internal: bytes.map(|b| b as std::ffi::c_char) })
    }
}

impl std::fmt::Debug for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Id(..)")
    }
}

/// The raw handle, movable between threads (NCCL allows a communicator to be used from any
/// thread, one call at a time; the mutex around it sees to that).
pub(crate) struct RawComm(pub(crate) sys::ncclComm_t);

// SAFETY: an ncclComm_t is a heap object NCCL allows to be used from any thread; every use goes
// through the `Mutex` in `CommInner`, so calls never overlap.
unsafe impl Send for RawComm {}

pub(crate) struct CommInner {
    pub(crate) raw: Mutex<Option<RawComm>>,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) ctx: Arc<CudaContext>,
    registrations: Mutex<Vec<Weak<Mutex<RegState>>>>,
}

impl CommInner {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Option<RawComm>> {
        self.raw.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Deregisters every registration, then destroys (or aborts) the communicator.
    fn close(&self, abort: bool) -> Result<()> {
        let regs = std::mem::take(&mut *self.registrations.lock().unwrap_or_else(|p| p.into_inner()));
        for r in regs.iter().filter_map(Weak::upgrade) {
            RegState::close(&r);
        }
        let Some(raw) = self.lock().take() else { return Ok(()) };
        self.ctx.bind_to_thread().map_err(|e| Error::Cuda(e.to_string()))?;
        // SAFETY: `raw` is a live communicator taken out of the mutex, so no other call can use it
        // again; it is destroyed (or aborted) once.
        let r = unsafe {
            if abort {
                result::comm_abort(raw.0)
            } else {
                result::comm_finalize(raw.0).and_then(|_| result::comm_destroy(raw.0))
            }
        };
        r.map(|_| ()).map_err(|e| nccl(if abort { "ncclCommAbort" } else { "ncclCommDestroy" }, e))
    }
}

impl Drop for CommInner {
    fn drop(&mut self) {
        // `Drop` never panics: an error destroying the communicator is dropped with it.
        let _ = self.close(false);
    }
}

/// An NCCL communicator: one rank of a group of devices. Collectives take cudarc buffers or
/// mempool `Buffer`s (anything `DevicePtr`/`DevicePtrMut`) and a stream of this device.
#[derive(Clone)]
pub struct Communicator {
    pub(crate) inner: Arc<CommInner>,
}

impl std::fmt::Debug for CommInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommInner").field("rank", &self.rank).field("world_size", &self.world).finish()
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.world)
            .field("device", &self.device())
            .finish()
    }
}

fn context(device: usize) -> Result<Arc<CudaContext>> {
    Ok(Allocator::cuda(device)?.context().clone())
}

impl Communicator {
    fn wrap(raw: sys::ncclComm_t, rank: usize, world: usize, ctx: Arc<CudaContext>) -> Communicator {
        Communicator {
            inner: Arc::new(CommInner {
                raw: Mutex::new(Some(RawComm(raw))),
                rank,
                world,
                ctx,
                registrations: Mutex::new(Vec::new()),
            }),
        }
    }

    /// One communicator per device, all in this process (`ncclCommInitAll`); hand one to each
    /// thread. `devices[i]` gets rank `i`.
    pub fn all_local(devices: &[usize]) -> Result<Vec<Communicator>> {
        check_nccl()?;
        if devices.is_empty() {
            return Err(Error::Environment("no devices given".into()));
        }
        let ctxs = devices.iter().map(|&d| context(d)).collect::<Result<Vec<_>>>()?;
        let mut raws = vec![std::ptr::null_mut(); devices.len()];
        let list: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        // SAFETY: `raws` has room for one handle per device in `list`, both of the same length.
        unsafe { result::comm_init_all(raws.as_mut_ptr(), list.len() as i32, list.as_ptr()) }
            .map_err(|e| nccl("ncclCommInitAll", e))?;
        let world = devices.len();
        Ok(raws
            .into_iter()
            .zip(ctxs)
            .enumerate()
            .map(|(r, (raw, ctx))| Communicator::wrap(raw, r, world, ctx))
            .collect())
    }

    /// Rank `rank` of `world_size`, on CUDA device `device`, joining the communicator `id`
    /// names (`ncclCommInitRank`: blocks until every rank has joined).
    pub fn new(id: &Id, rank: usize, world_size: usize, device: usize) -> Result<Communicator> {
        check_nccl()?;
        if rank >= world_size {
            return Err(Error::InvalidRank { rank, world_size });
        }
        let ctx = context(device)?;
        ctx.bind_to_thread().map_err(|e| Error::Cuda(e.to_string()))?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out pointer; the device's context is current on this thread.
        unsafe { result::comm_init_rank(&mut raw, world_size as i32, id.0, rank as i32) }
            .map_err(|e| nccl("ncclCommInitRank", e))?;
        Ok(Communicator::wrap(raw, rank, world_size, ctx))
    }

    /// This process's rank from the launcher's environment ([`LaunchEnv`]: `RANK`/`WORLD_SIZE`/
    /// `LOCAL_RANK` as torchrun sets them, `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID`, or
    /// `OMPI_COMM_WORLD_RANK`/`_SIZE`/`_LOCAL_RANK`), bootstrapped through NCCL's own mechanism:
    /// `NCCL_COMM_ID=host:port`, or `MASTER_ADDR`/`MASTER_PORT` turned into it (one port above
    /// `MASTER_PORT` under torchrun, whose store holds that port). The device is the local rank.
    pub fn from_env() -> Result<Communicator> {
        let env = LaunchEnv::from_process()?;
        env.export_comm_id();
        let id = Id::new()?;
        Communicator::new(&id, env.rank, env.world_size, env.local_rank)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.world
    }

    /// The CUDA device.
    pub fn device(&self) -> usize {
        self.inner.ctx.ordinal()
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// Registers every segment of `pool` with this communicator, those it allocates later as
    /// they are allocated, and deregisters each before it is freed; everything is deregistered
    /// when the registration is dropped or the communicator destroyed.
    pub fn register_pool(&self, pool: &MemPool) -> Result<Registration> {
        self.check_device("register_pool", pool.device())?;
        let r = Registration::attach(pool.allocator(), Some(pool.id()), self.registrar())?;
        self.keep(&r);
        Ok(r)
    }

    /// The same for every segment of this device, of every pool (the default pools included).
    pub fn register_device_segments(&self) -> Result<Registration> {
        let alloc = Allocator::cuda(self.device())?;
        let r = Registration::attach(&alloc, None, self.registrar())?;
        self.keep(&r);
        Ok(r)
    }

    fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(NcclRegistrar { comm: self.inner.clone() })
    }

    fn keep(&self, r: &Registration) {
        let mut regs = self.inner.registrations.lock().unwrap_or_else(|p| p.into_inner());
        regs.retain(|w| w.strong_count() > 0);
        regs.push(Arc::downgrade(&r.state));
    }

    fn check_device(&self, what: &'static str, found: usize) -> Result<()> {
        if found != self.device() {
            return Err(Error::WrongDevice { what, expected: self.device(), found });
        }
        Ok(())
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.world_size() {
            return Err(Error::InvalidRank { rank, world_size: self.world_size() });
        }
        Ok(())
    }

    fn check_buf<T, B: DeviceSlice<T>>(&self, what: &'static str, b: &B, needed: usize) -> Result<()> {
        self.check_device(what, b.stream().context().ordinal())?;
        if b.len() < needed {
            return Err(Error::BufferTooShort { what, needed, len: b.len() });
        }
        Ok(())
    }

    /// Runs `f` with the raw communicator, the device bound, and the stream as NCCL takes it.
    fn call(
        &self,
        op: &'static str,
        stream: &CudaStream,
        f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<(), result::NcclError>,
    ) -> Result<()> {
        self.check_device(op, stream.context().ordinal())?;
        let guard = self.inner.lock();
        let raw = guard.as_ref().ok_or(Error::Closed)?;
        self.inner.ctx.bind_to_thread().map_err(|e| Error::Cuda(e.to_string()))?;
        f(raw.0, stream.cu_stream() as sys::cudaStream_t).map_err(|e| nccl(op, e))
    }

    /// `recv = op(send of every rank)`, `send.len()` elements.
    pub fn all_reduce<T: NcclType, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        let n = send.len();
        self.check_buf("all_reduce", send, n)?;
        self.check_buf("all_reduce", recv, n)?;
        let (s, _s) = send.device_ptr(stream);
        let (r, _r) = recv.device_ptr_mut(stream);
        self.call("ncclAllReduce", stream, |c, st| {
            // SAFETY: both buffers are live device memory of this communicator's device holding at
            // least `n` elements of `T` (checked above), and stay borrowed until the call returns;
            // NCCL orders its work on `st`.
            unsafe { result::all_reduce(s as *const c_void, r as *mut c_void, n, T::TYPE, op.raw(), c, st) }.map(drop)
        })
    }

    /// `buf = op(buf of every rank)`, in place.
    pub fn all_reduce_in_place<T: NcclType, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        let n = buf.len();
        self.check_buf("all_reduce_in_place", buf, n)?;
        let (p, _p) = buf.device_ptr_mut(stream);
        self.call("ncclAllReduce", stream, |c, st| {
            // SAFETY: as in `all_reduce`; NCCL allows the same buffer as input and output.
            unsafe { result::all_reduce(p as *const c_void, p as *mut c_void, n, T::TYPE, op.raw(), c, st) }.map(drop)
        })
    }

    /// Each rank gets its `recv.len()`-element share of `op(send of every rank)`;
    /// `send` holds `world_size * recv.len()` elements.
    pub fn reduce_scatter<T: NcclType, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        let n = recv.len();
        self.check_buf("reduce_scatter", send, n * self.world_size())?;
        self.check_buf("reduce_scatter", recv, n)?;
        let (s, _s) = send.device_ptr(stream);
        let (r, _r) = recv.device_ptr_mut(stream);
        self.call("ncclReduceScatter", stream, |c, st| {
            // SAFETY: `send` holds world*n and `recv` n elements of this device (checked above).
            unsafe { result::reduce_scatter(s as *const c_void, r as *mut c_void, n, T::TYPE, op.raw(), c, st) }
                .map(drop)
        })
    }

    /// `recv` gets every rank's `send`, in rank order; it holds `world_size * send.len()`.
    pub fn all_gather<T: NcclType, S: DevicePtr<T>, R: DevicePtrMut<T>>(
        &self,
        send: &S,
        recv: &mut R,
        stream: &CudaStream,
    ) -> Result<()> {
        let n = send.len();
        self.check_buf("all_gather", send, n)?;
        self.check_buf("all_gather", recv, n * self.world_size())?;
        let (s, _s) = send.device_ptr(stream);
        let (r, _r) = recv.device_ptr_mut(stream);
        self.call("ncclAllGather", stream, |c, st| {
            // SAFETY: `send` holds n and `recv` world*n elements of this device (checked above).
            unsafe { result::all_gather(s as *const c_void, r as *mut c_void, n, T::TYPE, c, st) }.map(drop)
        })
    }

    /// Every rank's `buf` becomes `root`'s.
    pub fn broadcast<T: NcclType, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.check_rank(root)?;
        let n = buf.len();
        self.check_buf("broadcast", buf, n)?;
        let (p, _p) = buf.device_ptr_mut(stream);
        self.call("ncclBroadcast", stream, |c, st| {
            // SAFETY: `buf` holds n elements of this device; root is a valid rank.
            unsafe { result::broadcast(p as *const c_void, p as *mut c_void, n, T::TYPE, root as i32, c, st) }.map(drop)
        })
    }

    /// Sends `buf` to `peer` (pair it with `recv` there; inside [`group`](Self::group) for both ways).
    pub fn send<T: NcclType, B: DevicePtr<T>>(&self, buf: &B, peer: usize, stream: &CudaStream) -> Result<()> {
        self.check_rank(peer)?;
        let n = buf.len();
        self.check_buf("send", buf, n)?;
        let (p, _p) = buf.device_ptr(stream);
        self.call("ncclSend", stream, |c, st| {
            // SAFETY: `buf` holds n elements of this device; peer is a valid rank.
            unsafe { result::send(p as *const c_void, n, T::TYPE, peer as i32, c, st) }.map(drop)
        })
    }

    /// Receives `buf.len()` elements from `peer`.
    pub fn recv<T: NcclType, B: DevicePtrMut<T>>(&self, buf: &mut B, peer: usize, stream: &CudaStream) -> Result<()> {
        self.check_rank(peer)?;
        let n = buf.len();
        self.check_buf("recv", buf, n)?;
        let (p, _p) = buf.device_ptr_mut(stream);
        self.call("ncclRecv", stream, |c, st| {
            // SAFETY: `buf` holds n elements of this device; peer is a valid rank.
            unsafe { result::recv(p as *mut c_void, n, T::TYPE, peer as i32, c, st) }.map(drop)
        })
    }

    /// Runs `f` between `ncclGroupStart` and `ncclGroupEnd` (several collectives or sends and
    /// receives issued as one).
    pub fn group<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
        check_nccl()?;
        result::group_start().map_err(|e| nccl("ncclGroupStart", e))?;
        let r = f();
        let end = result::group_end().map_err(|e| nccl("ncclGroupEnd", e));
        let r = r?;
        end?;
        Ok(r)
    }

    /// Registers `size` bytes at `addr` as an NCCL window for symmetric collectives
    /// (`ncclCommWindowRegister` with `NCCL_WIN_COLL_SYMMETRIC`, NCCL 2.27 or newer). Collective:
    /// every rank calls it with the same size. The rules are checked first, the same way on every
    /// rank so that none is left waiting: NCCL's version, `addr` and `size` multiples of the
    /// device's allocation granularity (memory from an `ncclMemAlloc` pool with `no_split`, say),
    /// and equal sizes on every rank (gathered through the communicator on `stream`).
    pub fn register_window(&self, addr: u64, size: usize, stream: &Arc<CudaStream>) -> Result<Window> {
        let (major, minor, patch) = crate::alloc::nccl_version()?;
        if (major, minor) < (2, 27) {
            return Err(Error::Window(format!("needs NCCL 2.27 or newer; this is {major}.{minor}.{patch}")));
        }
        let gran = crate::alloc::recommended_granularity(&self.inner.ctx)?;
        let local_ok = size > 0 && addr % gran as u64 == 0 && size % gran == 0;
        // Every rank learns every rank's size and verdict before anyone calls NCCL's collective.
        let alloc = Allocator::cuda(self.device())?;
        let mine = [size as u64, u64::from(local_ok)];
        let mut send = alloc.alloc::<u64>(2)?;
        stream.memcpy_htod(&mine, &mut send).map_err(|e| Error::Cuda(e.to_string()))?;
        let mut all = alloc.alloc::<u64>(2 * self.world_size())?;
        self.all_gather(&send, &mut all, stream)?;
        let all = stream.clone_dtoh(&all).map_err(|e| Error::Cuda(e.to_string()))?;
        if !local_ok {
            return Err(Error::Window(format!(
                "address {addr:#x} and size {size} must be non-zero multiples of the allocation granularity ({gran} bytes)"
            )));
        }
        if let Some(r) = (0..self.world_size()).find(|&r| all[2 * r + 1] == 0) {
            return Err(Error::Window(format!("rank {r}'s range is not aligned to the allocation granularity")));
        }
        let sizes: Vec<u64> = (0..self.world_size()).map(|r| all[2 * r]).collect();
        if sizes.iter().any(|s| *s != size as u64) {
            return Err(Error::Window(format!("every rank must register the same size; the sizes are {sizes:?}")));
        }
        let guard = self.inner.lock();
        let raw = guard.as_ref().ok_or(Error::Closed)?;
        self.inner.ctx.bind_to_thread().map_err(|e| Error::Cuda(e.to_string()))?;
        let mut win: sys::ncclWindow_t = std::ptr::null_mut();
        const NCCL_WIN_COLL_SYMMETRIC: i32 = 1;
        // SAFETY: `raw` is a live communicator; `addr..addr+size` is device memory of this device
        // (checked aligned, same size on every rank); `win` is a valid out pointer.
        unsafe { sys::ncclCommWindowRegister(raw.0, addr as *mut c_void, size, &mut win, NCCL_WIN_COLL_SYMMETRIC) }
            .result()
            .map_err(|e| nccl("ncclCommWindowRegister", e))?;
        Ok(Window { comm: self.inner.clone(), win: win as usize, addr, size, open: true })
    }

    /// Deregisters everything and destroys the communicator (every rank must call it).
    pub fn destroy(self) -> Result<()> {
        self.inner.close(false)
    }

    /// Deregisters everything and aborts the communicator (after an error, or when other ranks
    /// are gone); pending work is abandoned.
    pub fn abort(self) -> Result<()> {
        self.inner.close(true)
    }
}

/// A window registered with [`Communicator::register_window`]. Deregistering is collective too:
/// call [`deregister`](Window::deregister) on every rank (dropping it does the same).
#[derive(Debug)]
pub struct Window {
    comm: Arc<CommInner>,
    win: usize,
    addr: u64,
    size: usize,
    open: bool,
}

impl Window {
    /// The registered range.
    pub fn range(&self) -> (u64, usize) {
        (self.addr, self.size)
    }

    /// Deregisters the window (collective).
    pub fn deregister(mut self) -> Result<()> {
        self.close()
    }

    fn close(&mut self) -> Result<()> {
        if !std::mem::replace(&mut self.open, false) {
            return Ok(());
        }
        let guard = self.comm.lock();
        let Some(raw) = guard.as_ref() else { return Ok(()) };
        self.comm.ctx.bind_to_thread().map_err(|e| Error::Cuda(e.to_string()))?;
        // SAFETY: `win` came from `ncclCommWindowRegister` on this live communicator and is
        // deregistered once.
        unsafe { sys::ncclCommWindowDeregister(raw.0, self.win as sys::ncclWindow_t) }
            .result()
            .map(drop)
            .map_err(|e| nccl("ncclCommWindowDeregister", e))
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
