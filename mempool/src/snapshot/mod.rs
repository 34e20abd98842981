//! What a device's memory looks like now: segments and their blocks.

mod pickle;

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
    /// Where it was allocated ([`crate::stacks::frames`]), when stacks are recorded; else 0.
    pub stack: crate::stacks::StackId,
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
    /// For a segment of an expandable pool: its physical allocations `(address, size)` in
    /// address order, which cover it exactly (each registered with NCCL on its own). Empty for
    /// an ordinary segment.
    pub mappings: Vec<(u64, usize)>,
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
