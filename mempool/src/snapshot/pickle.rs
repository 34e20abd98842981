//! A snapshot as a pickle in the layout of `torch.cuda.memory._snapshot()`, which PyTorch's
//! `_memory_viz` and its web viewer read.

use std::io::Write;
use std::path::Path;

use serde::Serialize;

use super::{BlockState, Snapshot};
use crate::error::{Error, Result};

// The layout of `torch.cuda.memory._snapshot()`, which PyTorch's `_memory_viz` and its web
// viewer read: field names and strings are theirs. Frames are the allocation stacks where they
// were recorded (`record_stacks`), resolved here, each distinct stack once.

#[derive(Serialize, Clone)]
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

/// Resolves stacks for the pickle, each once.
#[derive(Default)]
struct Frames(std::collections::HashMap<crate::stacks::StackId, Vec<PyFrame>>);

impl Frames {
    fn of(&mut self, id: crate::stacks::StackId) -> Vec<PyFrame> {
        if id == 0 {
            return Vec::new();
        }
        self.0
            .entry(id)
            .or_insert_with(|| {
                crate::stacks::frames(id)
                    .into_iter()
                    .map(|f| PyFrame { filename: f.filename, line: f.line as u64, name: f.name })
                    .collect()
            })
            .clone()
    }
}

impl Snapshot {
    fn to_py(&self) -> PySnapshot {
        let mut frames = Frames::default();
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
                is_expandable: !s.mappings.is_empty(),
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
                        frames: frames.of(b.stack),
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
                frames: frames.of(e.stack),
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
        w.write_all(&self.to_pickle()).map_err(|e| Error::caused_by("writing a snapshot", e))
    }

    /// Writes [`to_pickle`](Self::to_pickle) to the file at `path`.
    pub fn write_pickle(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_pickle())
            .map_err(|e| Error::with_cause("writing a snapshot", path.display().to_string(), e))
    }
}

#[cfg(test)]
mod tests {
    /// A snapshot that cannot be written: the path in the message, the I/O error as the source.
    #[test]
    fn a_failed_snapshot_write_names_the_path_and_keeps_the_io_error() {
        let a = crate::Allocator::sim(crate::sim::SimDevice::new(1 << 30));
        let path = std::env::temp_dir().join("mempool-no-such-dir").join("deeper").join("s.pickle");
        let e = a.snapshot().write_pickle(&path).unwrap_err();
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        let src = std::error::Error::source(&e);
        let io = src.and_then(|s| s.downcast_ref::<std::io::Error>()).expect("an io::Error source");
        assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    }
}
