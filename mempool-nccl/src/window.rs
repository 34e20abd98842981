//! Symmetric windows (`ncclCommWindowRegister`).

use std::sync::Arc;

use cudarc::driver::CudaStream;
use mempool::Allocator;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::handle::CommHandle;

impl Communicator {
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
        let gran = crate::alloc::recommended_granularity(self.context())?;
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
        let guard = self.handle().lock();
        let ops = guard.as_ref().ok_or(Error::Closed)?;
        // SAFETY: NOT upheld yet: nothing ties the window to the memory it covers, which may be
        // freed while it is registered (the next commits make the window borrow its buffer). The
        // range is checked aligned and of equal size on every rank.
        let win = unsafe { ops.window_register(addr, size) }?;
        Ok(Window { comm: self.handle().clone(), win, addr, size, open: true })
    }
}

/// A window registered with [`Communicator::register_window`]. Deregistering is local to each
/// rank: call [`deregister`](Window::deregister) (dropping it does the same).
#[derive(Debug)]
pub struct Window {
    comm: Arc<CommHandle>,
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

    /// Deregisters the window.
    pub fn deregister(mut self) -> Result<()> {
        self.close()
    }

    fn close(&mut self) -> Result<()> {
        if !std::mem::replace(&mut self.open, false) {
            return Ok(());
        }
        let guard = self.comm.lock();
        let Some(ops) = guard.as_ref() else { return Ok(()) };
        // SAFETY: `win` came from `window_register` on this communicator and is deregistered
        // once (`open` is cleared above).
        unsafe { ops.window_deregister(self.win) }
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
