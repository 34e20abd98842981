//! `Communicator`: a safe NCCL communicator (over cudarc's `nccl::result`/`sys`) and its
//! collectives. The handle itself and how it ends live in `handle`; registrations in
//! `register` (a communicator owns links to its registrations, never the other way round);
//! windows in `window`.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice};
use cudarc::nccl::{result, sys};
use mempool::{Allocator, MemPool};

use crate::alloc::check_nccl;
pub use crate::env::LaunchEnv;
use crate::error::{nccl, Error, Result};
use crate::handle::{Close, CommHandle, NcclComm};
use crate::register::Registration;
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

    /// A 64-bit FNV-1a hash of the bytes: the same in every process and every build.
    pub(crate) fn fingerprint(&self) -> u64 {
        self.to_bytes().iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
    }
}

impl std::fmt::Debug for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Id(..)")
    }
}

struct CommInner {
    handle: Arc<CommHandle>,
    rank: usize,
    world: usize,
    ctx: Arc<CudaContext>,
    /// A hash of the id every rank joined with (`None`: `ncclCommInitAll`, every rank in this
    /// process), which names the communicator's rendezvous sockets (symmetric memory).
    bootstrap: Option<u64>,
    /// Symmetric allocations begun on this rank (collective, so the same count on every rank).
    symm_seq: std::sync::atomic::AtomicU64,
}

/// An NCCL communicator: one rank of a group of devices. Collectives take cudarc buffers or
/// mempool `Buffer`s (anything `DevicePtr`/`DevicePtrMut`) and a stream of this device.
///
/// Clones share the communicator. How it ends:
/// - [`destroy`](Communicator::destroy), the orderly end, collective: every rank calls it, and
///   it waits for every rank's outstanding operations (`ncclCommFinalize`, `ncclCommDestroy`).
/// - [`abort`](Communicator::abort), local: stops this rank's outstanding operations and frees
///   the communicator without waiting for anyone (`ncclCommAbort`); for errors, and ranks that
///   are gone.
/// - Dropping the last clone (and the last registration and window, which share it) aborts:
///   a `Drop` never waits for a peer, so it cannot hang when one is gone, nor when it happens
///   inside a trace hook. Call `destroy` for the orderly end.
///
/// Either way every registration is closed first (its segments deregistered).
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<CommInner>,
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
    /// # Safety
    /// `raw` is a live communicator of `ctx`'s device, of rank `rank` in `world`, owned by
    /// nothing else.
    unsafe fn wrap(
        raw: sys::ncclComm_t,
        rank: usize,
        world: usize,
        ctx: Arc<CudaContext>,
        bootstrap: Option<u64>,
    ) -> Communicator {
        // SAFETY: passed on from the caller.
        let ops = unsafe { NcclComm::new(raw, ctx.clone()) };
        let handle = CommHandle::new(Box::new(ops));
        let symm_seq = std::sync::atomic::AtomicU64::new(0);
        Communicator { inner: Arc::new(CommInner { handle, rank, world, ctx, bootstrap, symm_seq }) }
    }

    /// The name of this communicator's next rendezvous between processes (a hash of its id, and
    /// the count of symmetric allocations before this one; the same on every rank, since they
    /// are collective), or `None` when every rank is in this process (`all_local`).
    pub(crate) fn next_rendezvous(&self) -> Option<(u64, u64)> {
        let seq = self.inner.symm_seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.bootstrap.map(|h| (h, seq))
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
            // SAFETY: `ncclCommInitAll` made `raw` for `devices[r]` as rank `r` of `world`; each
            // is wrapped once.
            .map(|(r, (raw, ctx))| unsafe { Communicator::wrap(raw, r, world, ctx, None) })
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
        ctx.bind_to_thread().map_err(Error::cuda)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out pointer; the device's context is current on this thread.
        unsafe { result::comm_init_rank(&mut raw, world_size as i32, id.0, rank as i32) }
            .map_err(|e| nccl("ncclCommInitRank", e))?;
        // SAFETY: `ncclCommInitRank` made `raw` on `device` (current above) as rank `rank` of
        // `world_size`; it is wrapped once.
        Ok(unsafe { Communicator::wrap(raw, rank, world_size, ctx, Some(id.fingerprint())) })
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

    pub(crate) fn handle(&self) -> &Arc<CommHandle> {
        &self.inner.handle
    }

    /// Registers every segment of `pool` with this communicator, those it allocates later as
    /// they are allocated, and deregisters each before it is freed; everything is deregistered
    /// when the registration is dropped or the communicator ends. Only segments from
    /// `ncclMemAlloc` are registered (an [`nccl_pool`](crate::nccl_pool)'s): their allocator
    /// refuses to free a segment NCCL may still have registered, which no other allocator does.
    pub fn register_pool(&self, pool: &MemPool) -> Result<Registration> {
        self.check_device("register_pool", pool.device())?;
        self.attach(pool.allocator(), Some(pool.id()))
    }

    /// The same for the `ncclMemAlloc` segments of every pool of this device, present and
    /// future. Segments of the default pools (cuMemAlloc memory) and of other allocators are
    /// left alone: their frees would not wait for a failed deregistration.
    pub fn register_device_segments(&self) -> Result<Registration> {
        self.attach(&Allocator::cuda(self.device())?, None)
    }

    fn attach(&self, alloc: &Allocator, pool: Option<mempool::PoolId>) -> Result<Registration> {
        let r = Registration::attach(alloc, pool, self.inner.handle.registrar())?;
        self.inner.handle.keep(r.link());
        Ok(r)
    }

    pub(crate) fn check_device(&self, what: &'static str, found: usize) -> Result<()> {
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
        let guard = self.inner.handle.lock();
        let ops = guard.as_ref().ok_or(Error::Closed)?;
        ops.bind()?;
        f(ops.raw(), stream.cu_stream() as sys::cudaStream_t).map_err(|e| nccl(op, e))
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
            // least `n` elements of `T` (checked above). NCCL queues its work on `st`, the stream
            // their pointers were taken for: on the buffers' own stream, later uses and reuse are
            // ordered after it by that stream; on another stream, the guards `_s`/`_r` wait for
            // the work when they drop after this call. Either way neither memory is freed or
            // reused before the work is done.
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
            // SAFETY: `send` holds world*n and `recv` n elements of this device (checked above);
            // their use on `st` is ordered as in `all_reduce`.
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
            // SAFETY: `send` holds n and `recv` world*n elements of this device (checked above);
            // their use on `st` is ordered as in `all_reduce`.
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
            // SAFETY: `buf` holds n elements of this device; root is a valid rank; the use on `st`
            // is ordered as in `all_reduce`.
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
            // SAFETY: `buf` holds n elements of this device; peer is a valid rank; the use on `st`
            // is ordered as in `all_reduce`.
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
            // SAFETY: `buf` holds n elements of this device; peer is a valid rank; the use on `st`
            // is ordered as in `all_reduce`.
            unsafe { result::recv(p as *mut c_void, n, T::TYPE, peer as i32, c, st) }.map(drop)
        })
    }

    /// Runs `f` between `ncclGroupStart` and `ncclGroupEnd` (several collectives or sends and
    /// receives issued as one).
    ///
    /// # Safety
    ///
    /// Inside a group NCCL queues the operations when the group ends, not when they are called,
    /// so the stream ordering each call records for its buffers (which lets a dropped buffer's
    /// memory be reused only after the work on it) is recorded before the work exists. Every
    /// buffer used inside `f` must stay alive, and unused on other streams, until the work the
    /// group queued is done: synchronize the streams used in the group after `group` returns
    /// (or failed) before dropping those buffers or touching them elsewhere.
    pub unsafe fn group<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
        check_nccl()?;
        result::group_start().map_err(|e| nccl("ncclGroupStart", e))?;
        let r = f();
        let end = result::group_end().map_err(|e| nccl("ncclGroupEnd", e));
        let r = r?;
        end?;
        Ok(r)
    }

    /// The orderly end, collective (every rank calls it; NCCL also wants every rank of a node
    /// to): closes every registration (deregistering its segments), then `ncclCommFinalize`,
    /// which waits until every rank's outstanding operations are done, and `ncclCommDestroy`.
    /// If finalizing fails the communicator is aborted and the error returned. Other clones,
    /// registrations and windows find it closed ([`Error::Closed`]).
    pub fn destroy(self) -> Result<()> {
        self.inner.handle.close(Close::Orderly)
    }

    /// Closes every registration and aborts the communicator (`ncclCommAbort`): local, it
    /// waits for no other rank; this rank's outstanding operations are stopped. For errors, and
    /// when other ranks are gone. Dropping the last handle does the same.
    pub fn abort(self) -> Result<()> {
        self.inner.handle.close(Close::Abort)
    }
}
