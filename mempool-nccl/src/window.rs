//! Symmetric windows (`ncclCommWindowRegister`): a [`Window`] borrows the buffer it covers, so the
//! buffer cannot be dropped (its memory given back) while NCCL has it registered.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaStream, DevicePtr, DeviceSlice};
use mempool::{Allocator, BlockState, Buffer};

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::handle::CommHandle;
use crate::ledger::{self, Hold};

impl Communicator {
    /// Registers `buf` as an NCCL window for symmetric collectives (`ncclCommWindowRegister` with
    /// `NCCL_WIN_COLL_SYMMETRIC`, NCCL 2.27 or newer). Collective: every rank calls it, with a
    /// buffer of the same size, and a `stream` of the communicator's device.
    ///
    /// The window covers the buffer rounded up to the device's allocation granularity (2 MiB on
    /// Hopper). That range must start at a granularity boundary, belong to the buffer's own block
    /// (so that no other buffer lies inside the window) and lie inside one `ncclMemAlloc`
    /// segment: a buffer of an [`nccl_pool_with`](crate::nccl_pool_with) pool with
    /// `no_split(true)` starts its own segment and owns all of it. The rules are checked first,
    /// the same way on every rank so that none is left waiting in NCCL: NCCL's version, the
    /// range, and equal sizes on every rank (gathered through the communicator on `stream`).
    ///
    /// The window borrows the buffer mutably until it is deregistered: use the buffer through it
    /// (`&mut *window` in a collective, or [`Window::buffer_mut`]). The buffer cannot be dropped
    /// meanwhile:
    ///
    /// ```compile_fail,E0505
    /// # fn f(comm: &mempool_nccl::Communicator, pool: &mempool::MemPool) -> mempool_nccl::Result<()> {
    /// let stream = pool.allocator().current_stream();
    /// let mut buf = pool.alloc::<f32>(1 << 20)?;
    /// let window = comm.register_window(&mut buf, &stream)?;
    /// drop(buf); // error[E0505]: cannot move out of `buf` because it is borrowed
    /// window.deregister()?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// (The same lines with the buffer dropped after the window compile:)
    ///
    /// ```no_run
    /// # fn f(comm: &mempool_nccl::Communicator, pool: &mempool::MemPool) -> mempool_nccl::Result<()> {
    /// let stream = pool.allocator().current_stream();
    /// let mut buf = pool.alloc::<f32>(1 << 20)?;
    /// let window = comm.register_window(&mut buf, &stream)?;
    /// window.deregister()?;
    /// drop(buf);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// In use:
    ///
    /// ```no_run
    /// # fn f(comm: &mempool_nccl::Communicator) -> mempool_nccl::Result<()> {
    /// use mempool::PoolOptions;
    /// use mempool_nccl::{nccl_pool_with, ReduceOp};
    /// let pool = nccl_pool_with(comm.device(), PoolOptions::new().no_split(true))?;
    /// let stream = pool.allocator().current_stream();
    /// let mut buf = pool.alloc::<f32>(1 << 20)?;
    /// let mut window = comm.register_window(&mut buf, &stream)?;
    /// comm.all_reduce_in_place(&mut *window, ReduceOp::Sum, &stream)?;
    /// window.deregister()?; // waits for the all-reduce, then deregisters
    /// drop(buf);
    /// # Ok(())
    /// # }
    /// ```
    pub fn register_window<'a, T>(&self, buf: &'a mut Buffer<T>, stream: &Arc<CudaStream>) -> Result<Window<'a, T>> {
        let (major, minor, patch) = crate::alloc::nccl_version()?;
        if (major, minor) < (2, 27) {
            return Err(Error::Window(format!("needs NCCL 2.27 or newer; this is {major}.{minor}.{patch}")));
        }
        // From here on every rank takes part in the gathering below whatever its own verdict, so
        // that none is left waiting in it.
        let addr = buf.device_ptr_raw();
        let gran = crate::alloc::recommended_granularity(self.context());
        let size = gran.as_ref().map_or(0, |g| buf.num_bytes().next_multiple_of(*g));
        // The local verdict, with the range held in the ledger if it is good (so its segment
        // cannot be freed from here on, whatever happens below).
        let local = match gran {
            Ok(gran) => self.window_verdict(buf, addr, size, gran),
            Err(e) => Err(format!("the allocation granularity is unknown: {e}")),
        };
        let verdict = self.check_window_everywhere(size, local.is_ok(), stream);
        let hold = match (local, verdict) {
            (Ok(hold), Ok(())) => hold,
            (Ok(hold), Err(e)) => {
                ledger::release(hold);
                return Err(e);
            }
            (Err(m), _) => return Err(Error::Window(m)),
        };
        let win = {
            let guard = self.handle().lock();
            match guard.as_ref() {
                // SAFETY: `addr..addr+size` lies inside a live `ncclMemAlloc` segment of this
                // device (the buffer is this device's, and the ledger checked the range when it
                // gave the hold); the hold keeps that segment from `ncclMemFree` until the window
                // is deregistered or the communicator is gone, and the buffer, borrowed by the
                // window, keeps its block allocated meanwhile.
                Some(ops) => unsafe { ops.window_register(addr, size) },
                None => Err(Error::Closed),
            }
        };
        match win {
            Ok(win) => Ok(Window { buf, comm: self.handle().clone(), win, addr, size, hold: Some(hold) }),
            Err(e) => {
                ledger::release(hold);
                Err(e)
            }
        }
    }

    /// This rank's verdict on registering `addr..addr+size` (`buf` rounded up to `gran`): the
    /// range held in the ledger if it may be registered.
    fn window_verdict<T>(
        &self,
        buf: &Buffer<T>,
        addr: u64,
        size: usize,
        gran: usize,
    ) -> std::result::Result<Hold, String> {
        if buf.device() != self.device() {
            return Err(format!(
                "the buffer is on device {}, the communicator on device {}",
                buf.device(),
                self.device()
            ));
        }
        if size == 0 {
            return Err("the buffer is empty".into());
        }
        if addr % gran as u64 != 0 {
            return Err(format!("address {addr:#x} is not a multiple of the allocation granularity ({gran} bytes)"));
        }
        if !Allocator::cuda(self.device()).is_ok_and(|a| owns(&a, addr, size)) {
            return Err(format!(
                "the buffer's block does not cover {addr:#x}..+{size} (the buffer rounded up to the {gran}-byte \
                 granularity), so other buffers could be used inside the window; allocate it from an \
                 nccl_pool_with(.., PoolOptions::new().no_split(true)) pool, whose blocks are whole segments"
            ));
        }
        ledger::hold_within_segment(self.handle().owner(), addr, size).ok_or_else(|| {
            format!(
                "{addr:#x}..+{size} (the buffer rounded up to the {gran}-byte granularity) does not lie inside one \
                 ncclMemAlloc segment; allocate it from an nccl_pool_with(.., PoolOptions::new().no_split(true)) pool"
            )
        })
    }

    /// Every rank learns every rank's size and verdict before anyone calls NCCL's collective.
    fn check_window_everywhere(&self, size: usize, local_ok: bool, stream: &Arc<CudaStream>) -> Result<()> {
        let alloc = Allocator::cuda(self.device())?;
        let mine = [size as u64, u64::from(local_ok)];
        let mut send = alloc.alloc::<u64>(2)?;
        stream.memcpy_htod(&mine, &mut send).map_err(Error::cuda)?;
        let mut all = alloc.alloc::<u64>(2 * self.world_size())?;
        self.all_gather(&send, &mut all, stream)?;
        let all = stream.clone_dtoh(&all).map_err(Error::cuda)?;
        if let Some(r) = (0..self.world_size()).find(|&r| all[2 * r + 1] == 0) {
            return Err(Error::Window(format!("rank {r}'s buffer does not meet the window rules")));
        }
        let sizes: Vec<u64> = (0..self.world_size()).map(|r| all[2 * r]).collect();
        if sizes.iter().any(|s| *s != size as u64) {
            return Err(Error::Window(format!("every rank must register the same size; the sizes are {sizes:?}")));
        }
        Ok(())
    }
}

/// Whether the allocated block at `addr` covers `addr..addr+size`: then no other buffer can be
/// carved out of that range while the block is allocated.
fn owns(alloc: &Allocator, addr: u64, size: usize) -> bool {
    alloc
        .snapshot()
        .segments
        .iter()
        .flat_map(|s| &s.blocks)
        .any(|b| b.address == addr && b.size >= size && b.state == BlockState::Allocated)
}

/// A buffer registered as a symmetric window with [`Communicator::register_window`]. It borrows
/// the buffer (use the buffer through it: it dereferences to it), so the buffer outlives the
/// registration.
///
/// [`deregister`](Window::deregister) waits for the work queued on the buffer so far (NCCL
/// wants no operation using a window while it is deregistered), then deregisters; dropping it
/// does the same, except that it stops waiting if the communicator reports an error (a rank
/// gone) or is closed: the window then stays registered until the communicator is aborted, and
/// its memory is never given back to the device before that (the `ncclMemAlloc` allocator
/// keeps the segment cached). Deregistering is local to each rank.
pub struct Window<'a, T> {
    buf: &'a mut Buffer<T>,
    comm: Arc<CommHandle>,
    win: usize,
    addr: u64,
    size: usize,
    /// `None` once deregistered.
    hold: Option<Hold>,
}

impl<T> std::fmt::Debug for Window<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("size", &self.size)
            .field("registered", &self.hold.is_some())
            .finish()
    }
}

impl<'a, T> Window<'a, T> {
    /// The registered range: the buffer's address, and its size rounded up to the granularity.
    pub fn range(&self) -> (u64, usize) {
        (self.addr, self.size)
    }

    /// The buffer.
    pub fn buffer(&self) -> &Buffer<T> {
        self.buf
    }

    /// The buffer, to write to or to pass to a collective.
    pub fn buffer_mut(&mut self) -> &mut Buffer<T> {
        self.buf
    }

    /// Waits for the work queued on the buffer so far (its own stream, and the uses on other
    /// streams it was ordered after), then deregisters the window. Blocks while that work is
    /// not done, like a stream synchronization. On an error the window stays registered, and
    /// its memory is kept from the device until the communicator ends.
    pub fn deregister(mut self) -> Result<()> {
        self.close(None)
    }

    /// `patience`: `None` waits as long as it takes; `Some(poll)` polls every `poll` and gives
    /// up when the communicator is closed or reports an error.
    fn close(&mut self, patience: Option<Duration>) -> Result<()> {
        let Some(hold) = self.hold.take() else { return Ok(()) };
        match self.wait_for_uses(patience) {
            Ok(true) => {}
            // Gave up: left registered, held until the communicator ends.
            Ok(false) => return Ok(()),
            Err(e) => return Err(e),
        }
        let guard = self.comm.lock();
        let Some(ops) = guard.as_ref() else {
            // Destroyed or aborted: NCCL let the window go with it (and the hold went with the
            // communicator's holds, unless that failed).
            return Ok(());
        };
        // SAFETY: `win` came from `window_register` on this communicator and is deregistered
        // once (the hold was taken out above); every operation queued on the buffer so far is
        // done (waited for above), and no other can be queued on it meanwhile: the window holds
        // the only borrow of the buffer.
        unsafe { ops.window_deregister(self.win) }?;
        ledger::release(hold);
        Ok(())
    }

    /// Whether the work queued on the buffer so far is done (`false`: gave up waiting).
    fn wait_for_uses(&self, patience: Option<Duration>) -> Result<bool> {
        let own = DeviceSlice::stream(&*self.buf).clone();
        // A use on the buffer's own stream orders that stream after the buffer's last use on
        // another stream (a collective on a stream of its own, say)...
        drop(self.buf.device_ptr(&own));
        // ...so an event recorded there now completes after every use queued so far.
        let done = own.record_event(None).map_err(Error::cuda)?;
        let Some(poll) = patience else {
            done.synchronize().map_err(Error::cuda)?;
            return Ok(true);
        };
        loop {
            if done.try_is_complete().map_err(Error::cuda)? {
                return Ok(true);
            }
            let broken = match self.comm.lock().as_ref() {
                None => true,
                Some(ops) => ops.async_error().is_err(),
            };
            if broken {
                return Ok(false);
            }
            std::thread::sleep(poll);
        }
    }
}

impl<T> std::ops::Deref for Window<'_, T> {
    type Target = Buffer<T>;
    fn deref(&self) -> &Buffer<T> {
        self.buf
    }
}

impl<T> std::ops::DerefMut for Window<'_, T> {
    fn deref_mut(&mut self) -> &mut Buffer<T> {
        self.buf
    }
}

impl<T> Drop for Window<'_, T> {
    fn drop(&mut self) {
        // Waits for the buffer's work like `deregister`, but never for a communicator that is
        // broken or closed; an error is dropped (the window then stays registered and held).
        let _ = self.close(Some(Duration::from_micros(200)));
    }
}
