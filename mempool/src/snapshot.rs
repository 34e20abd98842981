//! What a device's memory looks like now: segments and their blocks.

use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::id::PoolId;
use crate::id::StreamId;
use crate::trace::TraceEntry;

/// The state of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// Handed out and not yet freed.
    Allocated,
    /// Freed by its owner, but other streams that used it may still be reading or writing it:
    /// it becomes free once their events complete.
    AwaitingStreams,
    /// Cached, ready for reuse.
    Free,
}

/// One block of a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockSnapshot {
    /// Device address.
    pub address: u64,
    /// Size in bytes (rounded).
    pub size: usize,
    /// The size the caller asked for (0 for free blocks).
    pub requested_size: usize,
    /// Allocated, awaiting other streams, or free.
    pub state: BlockState,
}

/// One segment: a piece of memory obtained from the device in one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentSnapshot {
    /// Device address.
    pub address: u64,
    /// Size in bytes.
    pub total_size: usize,
    /// The stream whose allocations it serves.
    pub stream: StreamId,
    /// The pool it belongs to.
    pub pool: PoolId,
    /// Whether it is a small (2 MiB) segment.
    pub is_small: bool,
    /// Its blocks in address order; together they cover the segment exactly.
    pub blocks: Vec<BlockSnapshot>,
}

impl SegmentSnapshot {
    /// Bytes in allocated blocks.
    pub fn allocated_size(&self) -> usize {
        self.blocks.iter().filter(|b| b.state == BlockState::Allocated).map(|b| b.size).sum()
    }

    /// Bytes in allocated or awaiting blocks.
    pub fn active_size(&self) -> usize {
        self.blocks.iter().filter(|b| b.state != BlockState::Free).map(|b| b.size).sum()
    }

    /// Bytes the callers of allocated blocks asked for.
    pub fn requested_size(&self) -> usize {
        self.blocks.iter().filter(|b| b.state == BlockState::Allocated).map(|b| b.requested_size).sum()
    }
}

/// A device's segments, in address order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Device index.
    pub device: usize,
    /// Backend kind.
    pub backend: &'static str,
    /// Live segments in address order.
    pub segments: Vec<SegmentSnapshot>,
    /// The recorded trace of this device (oldest first), when history is recorded
    /// ([`record_history`](crate::record_history) or `MEMPOOL_RECORD_HISTORY`).
    pub trace: Vec<TraceEntry>,
}

impl Snapshot {
    /// Sum of segment sizes.
    pub fn reserved(&self) -> usize {
        self.segments.iter().map(|s| s.total_size).sum()
    }

    /// Sum of allocated block sizes.
    pub fn allocated(&self) -> usize {
        self.segments.iter().map(|s| s.allocated_size()).sum()
    }
}

// The layout of `torch.cuda.memory._snapshot()`, which PyTorch's `_memory_viz` and its web
// viewer read: field names and strings are theirs. Frames are empty: we record no stacks.

#[derive(Serialize)]
struct PyFrame {
    filename: String,
    line: u64,
    name: String,
}

#[derive(Serialize)]
struct PyBlock {
    address: u64,
    size: usize,
    requested_size: usize,
    state: &'static str,
    frames: Vec<PyFrame>,
}

#[derive(Serialize)]
struct PySegment {
    device: usize,
    address: u64,
    total_size: usize,
    allocated_size: usize,
    active_size: usize,
    requested_size: usize,
    stream: u64,
    segment_type: &'static str,
    segment_pool_id: (u64, u64),
    is_expandable: bool,
    frames: Vec<PyFrame>,
    blocks: Vec<PyBlock>,
}

#[derive(Serialize)]
struct PyTraceEntry {
    action: &'static str,
    addr: u64,
    size: usize,
    stream: u64,
    time_us: u64,
    frames: Vec<PyFrame>,
    /// Ours (PyTorch's readers ignore it): the pool, for per-pool timelines.
    pool_id: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    device_free: Option<u64>,
}

#[derive(Serialize)]
struct PySnapshot {
    segments: Vec<PySegment>,
    device_traces: Vec<Vec<PyTraceEntry>>,
    allocator_settings: AllocatorSettings,
}

#[derive(Serialize)]
struct AllocatorSettings {
    allocator: &'static str,
    backend: &'static str,
}

impl Snapshot {
    fn to_py(&self) -> PySnapshot {
        let segments = self
            .segments
            .iter()
            .map(|s| PySegment {
                device: self.device,
                address: s.address,
                total_size: s.total_size,
                allocated_size: s.allocated_size(),
                active_size: s.active_size(),
                requested_size: s.requested_size(),
                stream: s.stream.0,
                segment_type: if s.is_small { "small" } else { "large" },
                segment_pool_id: (0, s.pool.0),
                is_expandable: false,
                frames: Vec::new(),
                blocks: s
                    .blocks
                    .iter()
                    .map(|b| PyBlock {
                        address: b.address,
                        size: b.size,
                        requested_size: if b.state == BlockState::Free { b.size } else { b.requested_size },
                        state: match b.state {
                            BlockState::Allocated => "active_allocated",
                            BlockState::AwaitingStreams => "active_pending_free",
                            BlockState::Free => "inactive",
                        },
                        frames: Vec::new(),
                    })
                    .collect(),
            })
            .collect();
        let mut device_traces: Vec<Vec<PyTraceEntry>> = (0..=self.device).map(|_| Vec::new()).collect();
        device_traces[self.device] = self
            .trace
            .iter()
            .map(|e| PyTraceEntry {
                action: e.action.name(),
                addr: e.addr,
                size: e.size,
                stream: e.stream.0,
                time_us: e.time_us,
                frames: Vec::new(),
                pool_id: e.pool.0,
                device_free: (e.action == crate::trace::Action::Oom).then_some(0),
            })
            .collect();
        PySnapshot {
            segments,
            device_traces,
            allocator_settings: AllocatorSettings { allocator: "mempool", backend: self.backend },
        }
    }

    /// The snapshot as a pickle in the layout of `torch.cuda.memory._snapshot()`, so PyTorch's
    /// viewers read it (`python -m torch.cuda._memory_viz trace_plot snapshot.pickle`, or the web
    /// page at pytorch.org/memory_viz).
    pub fn to_pickle(&self) -> Vec<u8> {
        // Serializing plain structs of numbers and strings into memory cannot fail.
        serde_pickle::to_vec(&self.to_py(), serde_pickle::SerOptions::new()).unwrap_or_default()
    }

    /// Writes [`to_pickle`](Self::to_pickle) to `w`.
    pub fn write_pickle_to(&self, mut w: impl Write) -> Result<()> {
        w.write_all(&self.to_pickle()).map_err(|e| Error::Backend { op: "writing a snapshot", message: e.to_string() })
    }

    /// Writes [`to_pickle`](Self::to_pickle) to the file at `path`.
    pub fn write_pickle(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_pickle())
            .map_err(|e| Error::Backend { op: "writing a snapshot", message: format!("{}: {e}", path.display()) })
    }
}
