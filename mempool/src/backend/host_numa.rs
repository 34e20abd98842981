//! Host memory on a chosen NUMA node, mapped for a GPU: a segment source for any pool
//! (`PoolOptions::shared_allocator(Arc::new(HostNumaAllocator::new(device, node)?))`), so a region
//! of code can route its allocations to host memory (PyTorch's pools RFC: `cuMemCreate` with
//! `CU_MEM_LOCATION_TYPE_HOST_NUMA`; Extended GPU Memory on Grace systems).
//!
//! Each segment is one physical allocation (`cuMemCreate` on the node), mapped at a reserved
//! address (`cuMemAddressReserve` + `cuMemMap`) with read/write access granted to the device and,
//! where the driver allows it, to the host CPU. Kernels and copies reach it through the device
//! address like device memory (over the host link); the CPU reads it at the same address once the
//! device's work is done.
//!
//! What the machine supports is probed, not assumed ([`HostNumaSupport`]): virtual memory on host
//! NUMA nodes (whether the driver gives an allocation granularity for them), the device's
//! nearest node (`CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID`), and whether device memory is itself a NUMA
//! node of a coherent system (Grace class: `CU_DEVICE_ATTRIBUTE_NUMA_CONFIG`).

use cudarc::driver::sys::{self, CUdevice_attribute as A, CUresult};
use cudarc::driver::CudaContext;
use std::sync::Arc;

use super::{BackendError, RawAllocator};
use crate::error::{Error, Result};
use crate::id::StreamId;

/// What a device and its host support for host-NUMA memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostNumaSupport {
    /// The device.
    pub device: usize,
    /// `cuMemCreate` can place memory on a host NUMA node for this device.
    pub virtual_memory: bool,
    /// The host NUMA node nearest the device, if the driver names one.
    pub nearest_node: Option<i32>,
    /// The host's NUMA nodes (from `/sys/devices/system/node`).
    pub nodes: Vec<i32>,
    /// Device memory is itself a NUMA node of a coherent system (Grace class), so the CPU
    /// reaches device memory and the device host memory at cache-line grain.
    pub coherent: bool,
}

impl std::fmt::Display for HostNumaSupport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "device {}: host-NUMA virtual memory {}, nearest node {}, host nodes {:?}, {}",
            self.device,
            if self.virtual_memory { "supported" } else { "not supported" },
            self.nearest_node.map_or("unknown".to_string(), |n| n.to_string()),
            self.nodes,
            if self.coherent {
                "coherent (device memory is a NUMA node)"
            } else {
                "not a coherent system (device memory is not a NUMA node)"
            }
        )
    }
}

fn host_nodes() -> Vec<i32> {
    let mut nodes: Vec<i32> = std::fs::read_dir("/sys/devices/system/node")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.strip_prefix("node")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    nodes.sort_unstable();
    nodes
}

/// Asks device `device` (and the host) what host-NUMA memory they support.
pub fn probe(device: usize) -> Result<HostNumaSupport> {
    // The driver first: without one, cudarc would panic opening a context.
    let count = super::cuda::device_count()?;
    if device >= count {
        return Err(Error::InvalidDevice { device, count });
    }
    let ctx = CudaContext::new(device).map_err(|e| super::cuda::driver_error("opening the device", e))?;
    let attr = |a| ctx.attribute(a).unwrap_or(-1);
    let id = attr(A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID);
    let nodes = host_nodes();
    // The attribute that says so (141) postdates the API level we build against: ask the driver
    // for the allocation granularity of host-NUMA memory instead, which it gives only where it
    // can create such memory.
    let probe_node = if id >= 0 { id } else { nodes.first().copied().unwrap_or(0) };
    let virtual_memory = ctx.bind_to_thread().is_ok() && {
        let mut g = 0usize;
        let p = prop(probe_node);
        // SAFETY: `p` is a valid property struct and `g` a place for the answer.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &p,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        r == CUresult::CUDA_SUCCESS && g > 0
    };
    Ok(HostNumaSupport {
        device,
        virtual_memory,
        nearest_node: (id >= 0).then_some(id),
        nodes,
        // CU_DEVICE_NUMA_CONFIG_NUMA_NODE = 1: the device's memory is a NUMA node.
        coherent: attr(A::CU_DEVICE_ATTRIBUTE_NUMA_CONFIG) == 1,
    })
}

/// Segments of host memory on one NUMA node, mapped for one device (and the CPU).
pub struct HostNumaAllocator {
    ctx: Arc<CudaContext>,
    node: i32,
    granularity: usize,
    /// The CPU is granted access too (decided once, at creation, by mapping a probe page);
    /// else only the device reaches the memory.
    cpu_access: bool,
    name: String,
}

impl std::fmt::Debug for HostNumaAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostNumaAllocator").field("device", &self.ctx.ordinal()).field("node", &self.node).finish()
    }
}

fn prop(node: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all-zero is its "nothing requested" value.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location = super::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA, node);
    p
}

impl HostNumaAllocator {
    /// Memory on host NUMA node `node` (`None`: the node nearest `device`) for `device`. Errors,
    /// naming what is missing: a device without host-NUMA virtual memory, a node that does not
    /// exist, a driver that refuses the node.
    pub fn new(device: usize, node: Option<i32>) -> Result<HostNumaAllocator> {
        let support = probe(device)?;
        if !support.virtual_memory {
            return Err(Error::Config(format!(
                "host-NUMA memory: {support} (the driver gives no allocation granularity for CU_MEM_LOCATION_TYPE_HOST_NUMA)"
            )));
        }
        let node = match node.or(support.nearest_node) {
            Some(n) => n,
            None => {
                return Err(Error::Config(format!(
                    "host-NUMA memory: {support}: the driver names no node near the device; pass one"
                )))
            }
        };
        if !support.nodes.is_empty() && !support.nodes.contains(&node) {
            return Err(Error::Config(format!(
                "host-NUMA memory: NUMA node {node} does not exist (this host's nodes: {:?})",
                support.nodes
            )));
        }
        let ctx = CudaContext::new(device).map_err(|e| super::cuda::driver_error("opening the device", e))?;
        ctx.bind_to_thread().map_err(|e| super::cuda::driver_error("binding the device", e))?;
        let mut g = 0usize;
        let p = prop(node);
        // SAFETY: `p` is a valid property struct and `g` a place for the answer.
        let r = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &p,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        if r != CUresult::CUDA_SUCCESS {
            return Err(Error::Config(format!(
                "host-NUMA memory on node {node} for device {device}: the driver refuses it ({r:?})"
            )));
        }
        let granularity = g.max(512).next_power_of_two();
        let mut me =
            HostNumaAllocator { ctx, node, granularity, cpu_access: true, name: format!("host-numa node {node}") };
        // Whether the driver grants the CPU access: one probe segment, mapped and given back.
        me.cpu_access = match me.map(granularity, true) {
            Ok(addr) => {
                // SAFETY: mapped just above by `map`, of `granularity` bytes, used by nobody.
                let _ = unsafe { me.unmap(addr, granularity) };
                true
            }
            Err(_) => false,
        };
        Ok(me)
    }

    /// The NUMA node.
    pub fn node(&self) -> i32 {
        self.node
    }

    /// Whether the CPU may read and write the memory at the device address (the driver grants
    /// it: probed at creation). Then the pool's buffers have host views
    /// ([`Buffer::host_slice`](crate::Buffer::host_slice)).
    pub fn cpu_access(&self) -> bool {
        self.cpu_access
    }

    /// `size` bytes (a granularity multiple) created on the node, mapped at a range reserved for
    /// them alone, with read/write access for the device, and the CPU if `cpu`.
    fn map(&self, size: usize, cpu: bool) -> Result<u64, BackendError> {
        self.ctx.bind_to_thread().map_err(BackendError::from)?;
        let p = prop(self.node);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-parameter and a valid property struct; `size` is a granularity multiple.
        let r = unsafe { sys::cuMemCreate(&mut handle, size, &p, 0) };
        match r {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => return Err(BackendError::OutOfMemory),
            r => return Err(BackendError::Failed(format!("cuMemCreate on NUMA node {}: {r:?}", self.node))),
        }
        let release = |h| {
            // SAFETY: `h` came from `cuMemCreate` above and is released once.
            let _ = unsafe { sys::cuMemRelease(h) };
        };
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: out-parameter; a fresh range of `size` bytes aligned to the granularity.
        let r = unsafe { sys::cuMemAddressReserve(&mut addr, size, self.granularity, 0, 0) };
        if r != CUresult::CUDA_SUCCESS {
            release(handle);
            return Err(match r {
                CUresult::CUDA_ERROR_OUT_OF_MEMORY => BackendError::OutOfMemory,
                r => BackendError::Failed(format!("cuMemAddressReserve: {r:?}")),
            });
        }
        let unreserve = |a| {
            // SAFETY: `a` is the range reserved above, with nothing mapped, freed once.
            let _ = unsafe { sys::cuMemAddressFree(a, size) };
        };
        // SAFETY: the whole allocation mapped at the start of its own reserved range.
        let r = unsafe { sys::cuMemMap(addr, size, 0, handle, 0) };
        // The mapping (if made) holds the memory: the handle goes either way.
        release(handle);
        if r != CUresult::CUDA_SUCCESS {
            unreserve(addr);
            return Err(BackendError::Failed(format!("cuMemMap: {r:?}")));
        }
        let desc = self.access(cpu);
        // SAFETY: `addr..addr + size` is mapped above; `desc` lists valid descriptors.
        let r = unsafe { sys::cuMemSetAccess(addr, size, desc.as_ptr(), desc.len()) };
        if r != CUresult::CUDA_SUCCESS {
            // SAFETY: the mapping made above, unmapped once (then its range freed).
            let _ = unsafe { sys::cuMemUnmap(addr, size) };
            unreserve(addr);
            return Err(BackendError::Failed(format!("cuMemSetAccess: {r:?}")));
        }
        Ok(addr)
    }

    /// Unmaps a range `map` made and frees its address range (the memory goes with the unmap).
    ///
    /// # Safety
    /// `ptr..ptr + size` is exactly a range `map` returned, not unmapped yet, unused.
    unsafe fn unmap(&self, ptr: u64, size: usize) -> Result<(), BackendError> {
        self.ctx.bind_to_thread().map_err(BackendError::from)?;
        // SAFETY: the caller's contract.
        let r = unsafe { sys::cuMemUnmap(ptr, size) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(BackendError::Failed(format!("cuMemUnmap: {r:?}")));
        }
        // SAFETY: the range reserved for this segment, with nothing mapped any more. The memory
        // went back with the unmap: a failure here leaks address space only, so it is `Ok`.
        let _ = unsafe { sys::cuMemAddressFree(ptr, size) };
        Ok(())
    }

    fn access(&self, node_too: bool) -> Vec<sys::CUmemAccessDesc> {
        // SAFETY: plain C structs; all-zero is a valid start.
        let mut dev: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        dev.location =
            super::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, self.ctx.ordinal() as i32);
        dev.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        let mut v = vec![dev];
        if node_too {
            // SAFETY: as above.
            let mut host: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            host.location =
                super::cuda::mem_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA, self.node);
            host.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            v.push(host);
        }
        v
    }
}

// SAFETY: `alloc` returns the address of `size` bytes (a multiple of the granularity, aligned to
// it) freshly created with `cuMemCreate` on the node and mapped read/write for the device at an
// address reserved for this segment alone, so nothing else uses it until `free`; `free` unmaps
// and releases exactly that segment, and reports `Err` only when nothing was released (the
// segment is still mapped and usable). `host_visible` is true only when every segment is mapped
// with read/write access for the CPU too (decided once at creation; `map` fails otherwise).
unsafe impl RawAllocator for HostNumaAllocator {
    fn name(&self) -> &str {
        &self.name
    }

    fn granularity(&self) -> usize {
        self.granularity
    }

    fn host_visible(&self) -> bool {
        self.cpu_access
    }

    fn alloc(&self, size: usize, device: usize, _stream: StreamId) -> Result<u64, BackendError> {
        if device != self.ctx.ordinal() {
            return Err(BackendError::Failed(format!(
                "{} serves device {}, not device {device}",
                self.name,
                self.ctx.ordinal()
            )));
        }
        self.map(size, self.cpu_access)
    }

    unsafe fn free(&self, ptr: u64, size: usize, _device: usize, stream: StreamId) -> Result<(), BackendError> {
        self.ctx.bind_to_thread().map_err(BackendError::from)?;
        // Work queued on the segment's stream may still use it, and an unmap does not wait for
        // queued work: the stream's work comes first.
        // SAFETY: the caller promises `stream` is the segment's stream, alive during the call.
        unsafe { cudarc::driver::result::stream::synchronize(stream.0 as sys::CUstream) }
            .map_err(|e| BackendError::Failed(format!("synchronizing the segment's stream: {e}")))?;
        // SAFETY: the caller's contract: a segment `alloc` (so `map`) made, with no block handed
        // out, and the work queued on its stream done (just above).
        unsafe { self.unmap(ptr, size) }
    }

    fn serves(&self, backend_kind: &str) -> bool {
        backend_kind == "cuda"
    }
}
