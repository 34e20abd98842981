//! `ncclMemAlloc` as a pool's allocator.

use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys as cu;
use cudarc::driver::CudaContext;
use cudarc::nccl::sys;
use mempool::{Allocator, BackendError, MapGuard, MemPool, PoolOptions, RawAllocator, StreamId};

use crate::error::{Error, Result};
use crate::ledger;

/// Whether libnccl can be loaded (probed once: cudarc panics when it cannot).
pub(crate) fn check_nccl() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to open the library by name.
    if *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() }) {
        Ok(())
    } else {
        Err(Error::NoNccl)
    }
}

/// NCCL's version as `(major, minor, patch)`.
pub fn nccl_version() -> Result<(u32, u32, u32)> {
    check_nccl()?;
    let v = cudarc::nccl::result::get_nccl_version().map_err(|e| crate::error::nccl("ncclGetVersion", e))? as u32;
    Ok((v / 10000, v / 100 % 100, v % 100))
}

/// The driver's recommended allocation granularity for device memory of `device` (2 MiB on
/// Hopper): segments are sized and aligned to it, as NCCL's registration and NVLS want.
pub fn recommended_granularity(ctx: &Arc<CudaContext>) -> Result<usize> {
    ctx.bind_to_thread().map_err(Error::cuda)?;
    // SAFETY: every field of the C struct is an integer, an enum with a zero variant (`INVALID`,
    // `NONE`) or a pointer, so all-zero is a valid value; the fields that matter are set below.
    let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::MaybeUninit::zeroed().assume_init() };
    prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location =
        mempool::backend::cuda::mem_location(cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, ctx.ordinal() as i32);
    let mut gran = 0usize;
    // SAFETY: `prop` describes device memory of an existing device; `gran` is a valid out pointer.
    unsafe {
        cu::cuMemGetAllocationGranularity(
            &mut gran,
            &prop,
            cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    }
    .result()
    .map_err(Error::cuda)?;
    Ok(gran.max(512))
}

/// A [`RawAllocator`] over `ncclMemAlloc` / `ncclMemFree`: memory NCCL can register for zero-copy
/// collectives (and, where the machine allows, NVLS reductions).
///
/// Its `free` refuses a segment that a communicator may still have registered (a
/// deregistration that failed, a window that could not be deregistered): the pool keeps such a
/// segment cached, and it is freed by a later `empty_cache` once the registration is undone or
/// its communicator is destroyed or aborted. Only segments of this allocator are ever registered
/// with NCCL by this crate (see [`Registrar::covers`](crate::Registrar::covers)).
#[derive(Debug, Clone)]
pub struct NcclMemAllocator {
    ctx: Arc<CudaContext>,
    granularity: usize,
}

impl NcclMemAllocator {
    /// For CUDA device `device`. Errors: no NCCL, no such device.
    pub fn new(device: usize) -> Result<NcclMemAllocator> {
        check_nccl()?;
        let ctx = Allocator::cuda(device)?.context().clone();
        let granularity = recommended_granularity(&ctx)?;
        Ok(NcclMemAllocator { ctx, granularity })
    }
}

// SAFETY: `alloc` returns what `ncclMemAlloc` returned for exactly `size` bytes of this device
// (a cuMem allocation sized and aligned to the recommended granularity, which `granularity`
// reports), owned by the caller until `free` gives it to `ncclMemFree`; other devices are refused.
// NCCL only ever reads or writes it during collectives the caller issues on it.
unsafe impl RawAllocator for NcclMemAllocator {
    fn name(&self) -> &str {
        "ncclMemAlloc"
    }

    fn alloc(&self, size: usize, device: usize, _stream: StreamId) -> Result<u64, BackendError> {
        if device != self.ctx.ordinal() {
            return Err(BackendError::Failed(format!(
                "ncclMemAlloc allocator of device {} asked for memory of device {device}",
                self.ctx.ordinal()
            )));
        }
        self.ctx.bind_to_thread().map_err(BackendError::from)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: the device's context is current; `p` is a valid out pointer; the memory is
        // owned by the caller until `free`.
        let r = unsafe { sys::ncclMemAlloc(&mut p, size) };
        if r == sys::ncclResult_t::ncclSuccess && !p.is_null() {
            ledger::add_segment(p as u64, size);
            return Ok(p as u64);
        }
        // NCCL reports a failed cuMem allocation as an unhandled CUDA error: tell out-of-memory
        // apart by what the device has left.
        let free = self.ctx.mem_get_info().map(|(free, _)| free).unwrap_or(usize::MAX);
        if size > free || r == sys::ncclResult_t::ncclSuccess {
            Err(BackendError::OutOfMemory)
        } else {
            Err(BackendError::Failed(format!("ncclMemAlloc({size}) returned {r:?}")))
        }
    }

    unsafe fn free(&self, ptr: u64, size: usize, _device: usize, stream: StreamId) -> Result<(), BackendError> {
        // A communicator may still have part of it registered (a deregistration that failed, a
        // window whose deregistration could not wait): refused before anything else, so the
        // segment stays cached, whole and usable, and a later `empty_cache` tries again.
        if ledger::is_held(ptr, size) {
            return Err(held(ptr, size));
        }
        self.ctx.bind_to_thread().map_err(BackendError::from)?;
        // Work queued on the segment's stream may still use it: the unmap inside ncclMemFree
        // must come after it.
        // SAFETY: the caller promises `stream` is the segment's stream, alive during this call.
        unsafe { cudarc::driver::result::stream::synchronize(stream.0 as cu::CUstream) }
            .map_err(|e| BackendError::Failed(format!("synchronizing the segment's stream: {e}")))?;
        // The ledger checks again, and takes the segment off its live set in the same step, so no
        // registration or window can take hold of it between the check and the free.
        let r = ledger::free_segment(ptr, size, || {
            // SAFETY: the caller promises `ptr` came from `ncclMemAlloc` above, is given back once
            // and is unused; no communicator holds any of it (the ledger just checked, and
            // registrations hold a segment in the ledger for as long as NCCL has it registered).
            match unsafe { sys::ncclMemFree(ptr as *mut c_void) } {
                sys::ncclResult_t::ncclSuccess => Ok(()),
                r => Err(format!("ncclMemFree returned {r:?}")),
            }
        });
        match r {
            Ok(()) => Ok(()),
            Err(ledger::FreeError::Held) => Err(held(ptr, size)),
            // ncclMemFree unmaps, releases and frees the address range in steps: after a failure
            // there is no telling which were done, so the memory must not be used again. The
            // contract of `free` says so: report the leak, and answer that it is gone.
            Err(ledger::FreeError::Free(m)) => {
                ledger::forget_segment(ptr);
                eprintln!("mempool-nccl: {m}; segment {ptr:#x} ({size} bytes) is leaked, never reused");
                Ok(())
            }
        }
    }

    fn granularity(&self) -> usize {
        self.granularity
    }

    /// `ncclMemAlloc` gives CUDA device memory: only CUDA allocators take it.
    fn serves(&self, backend_kind: &str) -> bool {
        backend_kind == "cuda"
    }
}

fn held(ptr: u64, size: usize) -> BackendError {
    BackendError::Failed(format!(
        "segment {ptr:#x} ({size} bytes) is still registered with an NCCL communicator (a deregistration \
         failed or is still pending); it stays cached until it is deregistered or the communicator is \
         destroyed or aborted"
    ))
}

/// The [`MapGuard`] that makes an expandable pool's memory registrable: every physical
/// allocation the pool maps (`cuMemCreate`, the handle types NCCL's registration needs) joins the
/// crate's ledger of live segments, which communicators register; an unmap waits until no
/// communicator holds it (a deregistration that failed keeps it mapped, and a later
/// `empty_cache` tries again), as `ncclMemFree` does for [`NcclMemAllocator`].
///
/// [`nccl_pool_with`] puts it on expandable pools; put it on a pool of your own with
/// [`PoolOptions::map_guard`].
#[derive(Debug, Clone, Copy, Default)]
pub struct NcclMapGuard;

impl MapGuard for NcclMapGuard {
    fn mapped(&self, addr: u64, size: usize) {
        ledger::add_segment(addr, size);
    }

    fn unmapping(&self, addr: u64, size: usize) -> std::result::Result<(), String> {
        if ledger::let_go_unless_held(addr, size) {
            Ok(())
        } else {
            Err(format!(
                "physical allocation {addr:#x} ({size} bytes) is still registered with an NCCL communicator; \
                 it stays mapped until it is deregistered or the communicator is destroyed or aborted"
            ))
        }
    }
}

/// Whether NCCL registers a buffer that spans two physical allocations (2.29.2 and later).
pub fn nccl_registers_spans() -> Result<bool> {
    Ok(nccl_version()? >= (2, 29, 2))
}

/// A pool of CUDA device `device` whose segments come from `ncclMemAlloc`.
///
/// ```no_run
/// use mempool::with_pool;
/// let nccl_pool = mempool_nccl::nccl_pool(0)?;
/// # Ok::<(), mempool_nccl::Error>(())
/// ```
pub fn nccl_pool(device: usize) -> Result<MemPool> {
    nccl_pool_with(device, PoolOptions::new())
}

/// Like [`nccl_pool`], with options (`no_split`, `use_on_oom`...); the allocator is set here.
///
/// With [`PoolOptions::expandable`]: no `ncclMemAlloc`; the pool maps the device's memory on
/// demand into reserved address ranges (with the handle types and access NCCL's registration
/// needs, as `ncclMemAlloc` does), guarded by [`NcclMapGuard`], so a communicator registers each
/// physical allocation as it is mapped. The pool is also made [`no_span`](PoolOptions::no_span):
/// every buffer lies in one physical allocation, the unit NCCL before 2.29.2 registers, so every
/// collective on it can be zero-copy. (NCCL 2.29.2 and later can register a buffer across
/// physical allocations, [`nccl_registers_spans`]; registering mapped runs for it is not done yet,
/// so spanning stays off there too.)
///
/// ```no_run
/// use mempool::PoolOptions;
/// let pool = mempool_nccl::nccl_pool_with(0, PoolOptions::new().expandable(true))?;
/// # Ok::<(), mempool_nccl::Error>(())
/// ```
pub fn nccl_pool_with(device: usize, options: PoolOptions) -> Result<MemPool> {
    if options.is_expandable() {
        check_nccl()?;
        if options.has_map_guard() {
            return Err(Error::Mempool(mempool::Error::Config(
                "nccl_pool_with: an expandable NCCL pool's map guard is NcclMapGuard; it cannot take another \
                 (make the pool with MemPool::on and a guard that does both)"
                    .into(),
            )));
        }
        return Ok(MemPool::on(&Allocator::cuda(device)?, options.no_span(true).map_guard(NcclMapGuard))?);
    }
    let a = NcclMemAllocator::new(device)?;
    Ok(MemPool::on(&Allocator::cuda(device)?, options.allocator(a))?)
}
