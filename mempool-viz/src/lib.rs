//! # mempool-viz
//!
//! Reads a memory snapshot — mempool's `Snapshot::write_pickle`, or PyTorch's
//! `torch.cuda.memory._snapshot()` pickled — and shows it: an SVG timeline of allocated bytes
//! (stacked by pool) and reserved bytes over the recorded trace, with axes, units and a legend,
//! and a text summary per pool (segments, reserved, allocated, largest free block,
//! fragmentation).
//!
//! ```no_run
//! let view = mempool_viz::SnapshotView::read("snapshot.pickle")?;
//! print!("{}", mempool_viz::format_summary(&view.summary()));
//! mempool_viz::render_timeline(&view, "timeline.svg")?;
//! # Ok::<(), mempool_viz::Error>(())
//! ```
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

/// What can go wrong reading or drawing a snapshot.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The file could not be read or written.
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// What the system said (also the [`source`](std::error::Error::source)).
        error: std::io::Error,
    },
    /// Not a pickle, or not a snapshot.
    Format(String),
    /// The chart could not be drawn.
    Draw(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // The system's words are the source; the kind says enough on its own.
            Error::Io { path, error } => write!(f, "{}: {}", path.display(), error.kind()),
            Error::Format(m) => write!(f, "not a memory snapshot: {m}"),
            Error::Draw(m) => write!(f, "drawing the timeline: {m}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { error, .. } => Some(error),
            _ => None,
        }
    }
}

pub mod html;
mod pickle;

use pickle::{Pickle, Value};

/// One frame of a call stack.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Function (demangled).
    pub name: String,
    /// Source file (`??` or empty where unknown).
    pub filename: String,
    /// Line (0 where unknown).
    pub line: u64,
}

impl Frame {
    /// Whether the frame names a source line (not `??`, not line 0).
    pub fn has_source(&self) -> bool {
        self.line > 0 && !self.filename.is_empty() && self.filename != "??"
    }
}

impl std::fmt::Display for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.has_source() {
            write!(f, "{} ({}:{})", self.name, self.filename, self.line)
        } else {
            write!(f, "{}", self.name)
        }
    }
}

/// Index into [`SnapshotView::stacks`]; 0 is the empty stack (nothing recorded).
pub type StackId = u32;

/// A block of a segment.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// Device address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes the caller asked for.
    pub requested_size: u64,
    /// `active_allocated`, `active_pending_free` or `inactive`.
    pub state: String,
    /// Where it was allocated (0: not recorded).
    pub stack: StackId,
}

/// A segment.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// Device index.
    pub device: u64,
    /// Device address.
    pub address: u64,
    /// Stream it serves.
    pub stream: u64,
    /// Pool id (the second number of PyTorch's `segment_pool_id`; 0: the default pools).
    pub pool: u64,
    /// Bytes.
    pub total_size: u64,
    /// Whether it is (part of) an expandable segment.
    pub is_expandable: bool,
    /// Its blocks in address order.
    pub blocks: Vec<Block>,
}

/// A trace event.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Device index.
    pub device: u64,
    /// `alloc`, `free_requested`, `free_completed`, `segment_alloc`, `segment_free`, `oom`,
    /// `segment_map`, `segment_unmap`, `snapshot`...
    pub action: Action,
    /// Device address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Stream.
    pub stream: u64,
    /// Pool id (0 where the snapshot does not say, as in PyTorch's).
    pub pool: u64,
    /// Microseconds.
    pub time_us: u64,
    /// Where it happened (0: not recorded).
    pub stack: StackId,
}

/// What a trace event records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Action {
    /// A block handed out.
    Alloc,
    /// Its owner freed it; other streams may still use it.
    FreeRequested,
    /// It is free.
    FreeCompleted,
    /// A segment obtained from the device.
    SegmentAlloc,
    /// A segment given back.
    SegmentFree,
    /// Memory mapped into an expandable segment.
    SegmentMap,
    /// Memory unmapped from an expandable segment.
    SegmentUnmap,
    /// Out of memory.
    Oom,
    /// A snapshot was taken.
    Snapshot,
    /// Anything else.
    Other,
}

impl Action {
    fn parse(s: &str) -> Action {
        match s {
            "alloc" => Action::Alloc,
            "free_requested" | "free" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "oom" => Action::Oom,
            "snapshot" => Action::Snapshot,
            _ => Action::Other,
        }
    }

    /// The name in the pickle.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
            Action::Snapshot => "snapshot",
            Action::Other => "other",
        }
    }
}

impl PartialEq<&str> for Action {
    fn eq(&self, other: &&str) -> bool {
        self.name() == *other
    }
}

/// The parts of a snapshot the timeline, summary and page use.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotView {
    /// Segments now.
    pub segments: Vec<Segment>,
    /// Trace events of every device, in recording order.
    pub events: Vec<Event>,
    /// Distinct frames.
    pub frames: Vec<Frame>,
    /// Distinct call stacks, as indices into `frames`, innermost first; `stacks[0]` is empty.
    pub stacks: Vec<Vec<u32>>,
    /// Whether the trace's `alloc`/`free` sizes are the sizes callers asked for (PyTorch's)
    /// rather than block sizes (mempool's): the timeline then follows requested bytes.
    pub requested_sizes: bool,
}

impl Default for SnapshotView {
    fn default() -> Self {
        SnapshotView {
            segments: Vec::new(),
            events: Vec::new(),
            frames: Vec::new(),
            stacks: vec![Vec::new()],
            requested_sizes: false,
        }
    }
}

/// Interns frames and stacks while reading: PyTorch shares frame objects between entries, so
/// frames are interned by object first (cheap), then by content.
#[derive(Default)]
struct Interner {
    frame_by_obj: HashMap<u32, u32>,
    frame_by_value: HashMap<Frame, u32>,
    frames: Vec<Frame>,
    stack_by_obj: HashMap<u32, StackId>,
    stack_by_value: HashMap<Vec<u32>, StackId>,
    stacks: Vec<Vec<u32>>,
}

impl Interner {
    fn frame(&mut self, p: &Pickle, v: Value) -> u32 {
        let obj = if let Value::Dict(i) = v { Some(i) } else { None };
        if let Some(i) = obj.and_then(|o| self.frame_by_obj.get(&o)) {
            return *i;
        }
        let f = Frame {
            name: p.get(v, "name").and_then(|x| p.text(x)).unwrap_or_default().into_owned(),
            filename: p.get(v, "filename").and_then(|x| p.text(x)).unwrap_or_default().into_owned(),
            line: p.get(v, "line").and_then(|x| p.uint(x)).unwrap_or(0),
        };
        let i = match self.frame_by_value.get(&f) {
            Some(i) => *i,
            None => {
                let n = self.frames.len() as u32;
                self.frames.push(f.clone());
                self.frame_by_value.insert(f, n);
                n
            }
        };
        if let Some(o) = obj {
            self.frame_by_obj.insert(o, i);
        }
        i
    }

    fn stack(&mut self, p: &Pickle, frames: Option<Value>) -> StackId {
        let Some(v) = frames else { return 0 };
        let obj = match v {
            Value::List(i) | Value::Tuple(i) => i,
            _ => return 0,
        };
        if let Some(s) = self.stack_by_obj.get(&obj) {
            return *s;
        }
        let ids: Vec<u32> = p.items(v).iter().filter(|f| p.is_dict(**f)).map(|f| self.frame(p, *f)).collect();
        let id = if ids.is_empty() {
            0
        } else {
            let n = self.stacks.len() as StackId;
            match self.stack_by_value.get(&ids) {
                Some(s) => *s,
                None => {
                    self.stacks.push(ids.clone());
                    self.stack_by_value.insert(ids, n);
                    n
                }
            }
        };
        self.stack_by_obj.insert(obj, id);
        id
    }
}

/// PyTorch's trace entries name no pool: an event at an address inside a segment the snapshot
/// shows gets that segment's pool (one of a segment freed before the snapshot stays in pool 0).
fn attribute_pools(segments: &[Segment], events: &mut [Event]) {
    let mut ranges: Vec<(u64, u64, u64, u64)> = segments
        .iter()
        .filter(|s| s.pool != 0)
        .map(|s| (s.device, s.address, s.address.saturating_add(s.total_size), s.pool))
        .collect();
    if ranges.is_empty() {
        return;
    }
    ranges.sort_unstable();
    for e in events.iter_mut().filter(|e| e.pool == 0) {
        let i = ranges.partition_point(|r| (r.0, r.1) <= (e.device, e.addr));
        if let Some(r) = i.checked_sub(1).map(|i| ranges[i]) {
            if r.0 == e.device && e.addr < r.2 {
                e.pool = r.3;
            }
        }
    }
}

impl SnapshotView {
    /// Reads a pickled snapshot from a file.
    pub fn read(path: impl AsRef<Path>) -> Result<SnapshotView, Error> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|error| Error::Io { path: path.to_path_buf(), error })?;
        SnapshotView::from_pickle(&bytes)
    }

    /// Parses a pickled snapshot: mempool's, or PyTorch's (`torch.cuda.memory._snapshot()`
    /// as `_dump_snapshot` writes it, objects shared through the pickle's memo included).
    pub fn from_pickle(bytes: &[u8]) -> Result<SnapshotView, Error> {
        let p = Pickle::parse(bytes).map_err(|e| Error::Format(e.to_string()))?;
        let top = p.root;
        if !p.is_dict(top) {
            return Err(Error::Format("the pickle is not a dictionary".into()));
        }
        let Some(segs) = p.get(top, "segments") else {
            return Err(Error::Format("no `segments`".into()));
        };
        let num = |v: Option<Value>| v.and_then(|v| p.uint(v)).unwrap_or(0);
        let mut interner = Interner { stacks: vec![Vec::new()], ..Default::default() };
        let mut segments = Vec::new();
        for s in p.items(segs).iter().copied().filter(|s| p.is_dict(*s)) {
            let blocks = p
                .items(p.get(s, "blocks").unwrap_or(Value::None))
                .iter()
                .copied()
                .filter(|b| p.is_dict(*b))
                .map(|b| {
                    // PyTorch 2.0 kept a block's allocation in `history` (`real_size`, `frames`)
                    // rather than `requested_size` and `frames`.
                    let last = p.get(b, "history").and_then(|h| p.items(h).last().copied());
                    let from_history = |k: &str| last.and_then(|h| p.get(h, k));
                    Block {
                        address: num(p.get(b, "address").or_else(|| from_history("addr"))),
                        size: num(p.get(b, "size")),
                        requested_size: num(p.get(b, "requested_size").or_else(|| from_history("real_size"))),
                        state: p.get(b, "state").and_then(|x| p.text(x)).unwrap_or_default().into_owned(),
                        stack: interner.stack(&p, p.get(b, "frames").or_else(|| from_history("frames"))),
                    }
                })
                .collect();
            segments.push(Segment {
                device: num(p.get(s, "device")),
                address: num(p.get(s, "address")),
                stream: num(p.get(s, "stream")),
                pool: p.get(s, "segment_pool_id").and_then(|v| p.items(v).get(1).copied()).map_or(0, |v| num(Some(v))),
                total_size: num(p.get(s, "total_size")),
                is_expandable: matches!(p.get(s, "is_expandable"), Some(Value::Bool(true))),
                blocks,
            });
        }
        let mut events = Vec::new();
        let traces = p.get(top, "device_traces").unwrap_or(Value::None);
        for (device, trace) in p.items(traces).iter().enumerate() {
            for e in p.items(*trace).iter().copied().filter(|e| p.is_dict(*e)) {
                events.push(Event {
                    device: device as u64,
                    action: Action::parse(p.get(e, "action").and_then(|x| p.text(x)).as_deref().unwrap_or("")),
                    addr: num(p.get(e, "addr")),
                    size: num(p.get(e, "size")),
                    stream: num(p.get(e, "stream")),
                    pool: num(p.get(e, "pool_id")),
                    time_us: num(p.get(e, "time_us")),
                    stack: interner.stack(&p, p.get(e, "frames")),
                });
            }
        }
        let ours = p
            .get(top, "allocator_settings")
            .and_then(|s| p.get(s, "allocator"))
            .and_then(|a| p.text(a))
            .is_some_and(|a| a == "mempool");
        if !ours {
            attribute_pools(&segments, &mut events);
        }
        Ok(SnapshotView { segments, events, frames: interner.frames, stacks: interner.stacks, requested_sizes: !ours })
    }

    /// The frames of a stack, innermost first.
    pub fn stack(&self, id: StackId) -> impl Iterator<Item = &Frame> {
        self.stacks.get(id as usize).map_or(&[][..], |s| &s[..]).iter().filter_map(|f| self.frames.get(*f as usize))
    }

    /// The devices the snapshot covers, in order.
    pub fn devices(&self) -> Vec<u64> {
        self.segments
            .iter()
            .map(|s| s.device)
            .chain(self.events.iter().map(|e| e.device))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    /// The part of the snapshot on one device (frames and stacks are kept whole).
    pub fn on_device(&self, device: u64) -> SnapshotView {
        SnapshotView {
            segments: self.segments.iter().filter(|s| s.device == device).cloned().collect(),
            events: self.events.iter().filter(|e| e.device == device).cloned().collect(),
            frames: self.frames.clone(),
            stacks: self.stacks.clone(),
            requested_sizes: self.requested_sizes,
        }
    }

    /// The allocation site of a stack: its innermost frame in the program's own code (frames
    /// with a source line, outside PyTorch's and Python's libraries and Rust's standard
    /// library), else its innermost frame with a source line, else its innermost frame.
    pub fn site(&self, stack: StackId) -> Option<&Frame> {
        let library = |f: &Frame| {
            let n = &f.filename;
            n.contains("/site-packages/")
                || n.contains("/lib/python3")
                || n.contains("/rustc/")
                || n.contains("/.cargo/registry/")
                || n.starts_with("<frozen")
        };
        // A stack of native frames alone (PyTorch's autograd threads): the innermost frame
        // outside the allocator's own machinery.
        let machinery = |f: &Frame| {
            let n = &f.name;
            [
                "unwind",
                "CapturedTraceback",
                "gather",
                "Allocator",
                "empty",
                "wrap_kernel_functor",
                "redispatch",
                "::call(",
            ]
            .iter()
            .any(|m| n.contains(m))
                || n.starts_with("mempool::")
                || n.starts_with("backtrace::")
                || n.starts_with("std::")
                || n.starts_with("core::")
        };
        self.stack(stack)
            .find(|f| f.has_source() && !library(f))
            .or_else(|| self.stack(stack).find(|f| f.has_source()))
            .or_else(|| self.stack(stack).find(|f| !machinery(f)))
            .or_else(|| self.stack(stack).next())
    }

    /// The allocation sites holding the most memory now, per pool, largest first (at most `n`
    /// a pool): from the blocks' stacks where the snapshot has them, else from the trace's
    /// allocations not freed by its end. Empty when nothing recorded stacks.
    pub fn top_sites(&self, n: usize) -> Vec<SiteTotal> {
        let mut live: Vec<(u64, u64, StackId)> = Vec::new(); // (pool, bytes, stack)
        for s in &self.segments {
            for b in &s.blocks {
                if b.state == "active_allocated" && b.stack != 0 {
                    live.push((s.pool, b.size, b.stack));
                }
            }
        }
        if live.is_empty() {
            let mut open: HashMap<(u64, u64), (u64, u64, StackId)> = HashMap::new();
            for e in &self.events {
                match e.action {
                    Action::Alloc if e.stack != 0 => {
                        open.insert((e.device, e.addr), (e.pool, e.size, e.stack));
                    }
                    Action::FreeRequested | Action::FreeCompleted => {
                        open.remove(&(e.device, e.addr));
                    }
                    _ => {}
                }
            }
            live = open.into_values().collect();
        }
        let mut by: HashMap<(u64, String), SiteTotal> = HashMap::new();
        for (pool, bytes, stack) in live {
            let site = self.site(stack).map_or_else(|| "(no frames)".to_string(), Frame::to_string);
            let t = by.entry((pool, site.clone())).or_insert_with(|| SiteTotal { pool, site, bytes: 0, blocks: 0 });
            t.bytes = t.bytes.saturating_add(bytes);
            t.blocks += 1;
        }
        let mut all: Vec<SiteTotal> = by.into_values().collect();
        all.sort_by(|a, b| a.pool.cmp(&b.pool).then(b.bytes.cmp(&a.bytes)).then(a.site.cmp(&b.site)));
        let mut out = Vec::new();
        let mut last = None;
        let mut k = 0;
        for t in all {
            if last != Some(t.pool) {
                last = Some(t.pool);
                k = 0;
            }
            if k < n {
                out.push(t);
            }
            k += 1;
        }
        out
    }

    /// One line of figures per pool, in pool order.
    pub fn summary(&self) -> Vec<PoolSummary> {
        self.summaries(|_| 0).into_values().next().unwrap_or_default()
    }

    /// [`summary`](Self::summary) of each device, in one pass.
    pub fn summary_by_device(&self) -> BTreeMap<u64, Vec<PoolSummary>> {
        self.summaries(|s| s.device)
    }

    fn summaries(&self, key: impl Fn(&Segment) -> u64) -> BTreeMap<u64, Vec<PoolSummary>> {
        let mut by: BTreeMap<(u64, u64), PoolSummary> = BTreeMap::new();
        for s in &self.segments {
            let p = by.entry((key(s), s.pool)).or_insert_with(|| PoolSummary { pool: s.pool, ..Default::default() });
            p.segments += 1;
            p.reserved = p.reserved.saturating_add(s.total_size);
            for b in &s.blocks {
                if b.state == "inactive" {
                    p.free = p.free.saturating_add(b.size);
                    p.largest_free = p.largest_free.max(b.size);
                } else {
                    p.allocated = p.allocated.saturating_add(b.size);
                }
            }
        }
        let mut out: BTreeMap<u64, Vec<PoolSummary>> = BTreeMap::new();
        for ((d, _), p) in by {
            out.entry(d).or_default().push(p);
        }
        out
    }
}

/// The memory one allocation site holds in one pool.
#[derive(Debug, Clone, PartialEq)]
pub struct SiteTotal {
    /// Pool id.
    pub pool: u64,
    /// The site (`function (file:line)`).
    pub site: String,
    /// Bytes of its live blocks.
    pub bytes: u64,
    /// Its live blocks.
    pub blocks: u64,
}

/// The sites as a table, per pool.
pub fn format_sites(sites: &[SiteTotal]) -> String {
    let mut s = String::new();
    let mut last = None;
    for t in sites {
        if last != Some(t.pool) {
            last = Some(t.pool);
            let name = if t.pool == 0 { "default pools".to_string() } else { format!("pool {}", t.pool) };
            let _ = writeln!(s, "top allocation sites, {name} (live bytes):");
        }
        let _ = writeln!(s, "  {:>12} {:>7} blocks  {}", human(t.bytes), t.blocks, t.site);
    }
    s
}

/// One pool's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolSummary {
    /// Pool id (0: the default pools).
    pub pool: u64,
    /// Segments.
    pub segments: u64,
    /// Bytes of its segments.
    pub reserved: u64,
    /// Bytes in allocated (or awaiting) blocks.
    pub allocated: u64,
    /// Bytes in free blocks.
    pub free: u64,
    /// The largest free block.
    pub largest_free: u64,
}

impl PoolSummary {
    /// `1 - largest free block / free bytes`: 0 when the free memory is one block (or there is
    /// none), near 1 when it is scattered in small pieces no large request can use.
    pub fn fragmentation(&self) -> f64 {
        if self.free == 0 {
            0.0
        } else {
            1.0 - self.largest_free as f64 / self.free as f64
        }
    }
}

fn human(b: u64) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.2} KiB", b / 1024.0)
    } else {
        format!("{b} B")
    }
}

/// The summary as a table.
pub fn format_summary(pools: &[PoolSummary]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<12} {:>9} {:>12} {:>12} {:>14} {:>14}",
        "pool", "segments", "reserved", "allocated", "largest free", "fragmentation"
    );
    for p in pools {
        let name = if p.pool == 0 { "0 (default)".to_string() } else { p.pool.to_string() };
        let _ = writeln!(
            s,
            "{name:<12} {:>9} {:>12} {:>12} {:>14} {:>14.3}",
            p.segments,
            human(p.reserved),
            human(p.allocated),
            human(p.largest_free),
            p.fragmentation()
        );
    }
    s
}

/// Allocated bytes per pool and reserved bytes over the trace.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timeline {
    /// Pools in legend order.
    pub pools: Vec<u64>,
    /// `(milliseconds since the first event, allocated per pool in `pools` order, reserved)`.
    pub points: Vec<(f64, Vec<u64>, u64)>,
}

impl Timeline {
    /// The part between `from_ms` and `to_ms` (either end open): it starts with the memory in
    /// use at `from_ms`.
    pub fn window(&self, from_ms: Option<f64>, to_ms: Option<f64>) -> Timeline {
        let mut points = Vec::new();
        let from = from_ms.unwrap_or(f64::NEG_INFINITY);
        let to = to_ms.unwrap_or(f64::INFINITY);
        let before = self.points.iter().rposition(|p| p.0 < from);
        if let Some(i) = before {
            let (_, a, r) = &self.points[i];
            points.push((from, a.clone(), *r));
        }
        points.extend(self.points.iter().filter(|p| p.0 >= from && p.0 <= to).cloned());
        // The range ends at `to`: what is in use then holds until it.
        if to.is_finite() {
            if let Some(last) = self.points.iter().rev().find(|p| p.0 <= to) {
                if points.last().is_some_and(|p| p.0 < to) || points.is_empty() {
                    points.push((to, last.1.clone(), last.2));
                }
            }
        }
        Timeline { pools: self.pools.clone(), points }
    }

    /// At most about `(4 + pools) * buckets` points with the same look: per bucket of time, the
    /// first point, the one of most allocated in all, the one of most allocated in each pool,
    /// the one of most reserved, and the last, in time order (no peak is lost).
    pub fn downsample(&self, buckets: usize) -> Timeline {
        let n = self.points.len();
        let per = 4 + self.pools.len();
        if n <= per.saturating_mul(buckets.max(1)) {
            return self.clone();
        }
        let (t0, t1) = (self.points[0].0, self.points[n - 1].0);
        let width = ((t1 - t0) / buckets as f64).max(f64::MIN_POSITIVE);
        let bucket = |k: usize| ((self.points[k].0 - t0) / width) as usize;
        let total = |k: usize| self.points[k].1.iter().fold(0u64, |a, x| a.saturating_add(*x));
        let mut keep = vec![false; n];
        let mut i = 0;
        while i < n {
            let b = bucket(i);
            let mut j = i;
            let (mut most_a, mut most_r) = (i, i);
            let mut most_pool = vec![i; self.pools.len()];
            while j < n && bucket(j) == b {
                if total(j) > total(most_a) {
                    most_a = j;
                }
                if self.points[j].2 > self.points[most_r].2 {
                    most_r = j;
                }
                for (p, m) in most_pool.iter_mut().enumerate() {
                    if self.points[j].1.get(p) > self.points[*m].1.get(p) {
                        *m = j;
                    }
                }
                j += 1;
            }
            for k in [i, most_a, most_r, j - 1].into_iter().chain(most_pool) {
                keep[k] = true;
            }
            i = j;
        }
        let points = self.points.iter().zip(keep).filter(|(_, k)| *k).map(|(p, _)| p.clone()).collect();
        Timeline { pools: self.pools.clone(), points }
    }
}

impl SnapshotView {
    /// The timeline, ending at the snapshot's state: a trace that starts mid-run (a ring of the
    /// last entries) is lifted by what the snapshot shows was already there.
    pub fn timeline(&self) -> Timeline {
        // Pools by weight (bytes reserved now plus bytes allocated over the trace): the heaviest
        // `MAX_POOLS - 1` are drawn on their own, the rest as one band, `OTHER_POOLS` (a trace
        // of thousands of pools must not cost events × pools).
        let mut weight: HashMap<u64, u64> = HashMap::new();
        for s in &self.segments {
            let w = weight.entry(s.pool).or_default();
            *w = w.saturating_add(s.total_size);
        }
        for e in &self.events {
            let w = weight.entry(e.pool).or_default();
            if e.action == Action::Alloc {
                *w = w.saturating_add(e.size);
            }
        }
        let mut pools: Vec<u64> = weight.keys().copied().collect();
        if pools.len() > MAX_POOLS {
            pools.sort_by(|a, b| weight[b].cmp(&weight[a]).then(a.cmp(b)));
            pools.truncate(MAX_POOLS - 1);
        }
        pools.sort_unstable();
        let mut slot: HashMap<u64, usize> = pools.iter().enumerate().map(|(i, p)| (*p, i)).collect();
        if weight.len() > pools.len() {
            pools.push(OTHER_POOLS);
        }
        if pools.is_empty() {
            pools.push(0);
        }
        let other = pools.len() - 1;
        for p in weight.keys() {
            slot.entry(*p).or_insert(other);
        }
        let index = |p: u64| slot.get(&p).copied().unwrap_or(other);
        let mut delta_alloc = vec![0i128; pools.len()];
        let mut delta_res = 0i128;
        for e in &self.events {
            match change(e) {
                Some(Change::Allocated(d)) => delta_alloc[index(e.pool)] += d,
                Some(Change::Reserved(d)) => delta_res += d,
                None => {}
            }
        }
        let summary = self.summary();
        let mut end_alloc = vec![0i128; pools.len()];
        for s in &self.segments {
            for b in s.blocks.iter().filter(|b| b.state != "inactive") {
                end_alloc[index(s.pool)] += if self.requested_sizes { b.requested_size } else { b.size } as i128;
            }
        }
        let end_res: i128 = summary.iter().map(|s| s.reserved as i128).sum();
        let mut alloc: Vec<i128> = end_alloc.iter().zip(&delta_alloc).map(|(e, d)| (e - d).max(0)).collect();
        let mut res = (end_res - delta_res).max(0);
        // Devices' traces are concatenated: merge them in time order.
        let mut order: Vec<&Event> = self.events.iter().collect();
        order.sort_by_key(|e| e.time_us);
        let t0 = order.first().map_or(0, |e| e.time_us);
        let mut points = vec![(0.0, alloc.iter().map(|a| *a as u64).collect(), res as u64)];
        for e in order {
            match change(e) {
                Some(Change::Allocated(d)) => alloc[index(e.pool)] += d,
                Some(Change::Reserved(d)) => res += d,
                None => continue,
            }
            let t = e.time_us.saturating_sub(t0) as f64 / 1000.0;
            points.push((t, alloc.iter().map(|a| (*a).max(0) as u64).collect(), res.max(0) as u64));
        }
        Timeline { pools, points }
    }
}

/// The most bands a timeline draws: beyond, the lightest pools share one, [`OTHER_POOLS`].
pub const MAX_POOLS: usize = 16;

/// The pool id of the band holding the pools beyond [`MAX_POOLS`].
pub const OTHER_POOLS: u64 = u64::MAX;

/// A pool's name in legends: the default pools, a pool's id, or the band of the others.
pub fn pool_label(pool: u64) -> String {
    match pool {
        0 => "default pools".to_string(),
        OTHER_POOLS => "other pools".to_string(),
        p => format!("pool {p}"),
    }
}

/// What an event does to the timeline's two quantities.
enum Change {
    Allocated(i128),
    Reserved(i128),
}

fn change(e: &Event) -> Option<Change> {
    let n = e.size as i128;
    match e.action {
        Action::Alloc => Some(Change::Allocated(n)),
        Action::FreeCompleted => Some(Change::Allocated(-n)),
        // Expandable segments map and unmap memory (PyTorch's names too).
        Action::SegmentAlloc | Action::SegmentMap => Some(Change::Reserved(n)),
        Action::SegmentFree | Action::SegmentUnmap => Some(Change::Reserved(-n)),
        _ => None,
    }
}

/// Draws the timeline as an SVG file.
pub fn render_timeline(view: &SnapshotView, path: impl AsRef<Path>) -> Result<(), Error> {
    render_timeline_of(view, &view.timeline(), path)
}

/// Draws `tl` (the timeline of `view`, or a window of it) as an SVG file; a long trace is
/// downsampled to the chart's width first, peaks kept.
pub fn render_timeline_of(view: &SnapshotView, tl: &Timeline, path: impl AsRef<Path>) -> Result<(), Error> {
    let tl = &tl.downsample(1000);
    let draw = |e: &dyn std::fmt::Display| Error::Draw(e.to_string());
    let max_bytes = tl.points.iter().map(|(_, a, r)| (*r).max(a.iter().sum())).max().unwrap_or(0).max(1);
    let (unit, div) = if max_bytes >= 4 << 30 { ("GiB", (1u64 << 30) as f64) } else { ("MiB", (1u64 << 20) as f64) };
    let t_min = tl.points.first().map_or(0.0, |p| p.0);
    let t_max = tl.points.last().map_or(1.0, |p| p.0).max(t_min + 1e-3);
    // Headroom above the data for the legend.
    let y_max = max_bytes as f64 / div * 1.35;
    let root = SVGBackend::new(path.as_ref(), (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw(&e))?;
    let devices: BTreeSet<u64> = view.segments.iter().map(|s| s.device).collect();
    let title = format!(
        "Memory over the trace (device{} {})",
        if devices.len() > 1 { "s" } else { "" },
        devices.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(t_min..t_max, 0f64..y_max)
        .map_err(|e| draw(&e))?;
    chart
        .configure_mesh()
        .x_desc("time since the first recorded event (ms)")
        .y_desc(format!("memory ({unit})"))
        .axis_desc_style(("sans-serif", 16))
        .label_style(("sans-serif", 13))
        .x_labels(10)
        .y_labels(8)
        .light_line_style(WHITE)
        .draw()
        .map_err(|e| draw(&e))?;
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
    ];
    // Stacked: each pool's band sits on the pools before it; the largest stack is drawn first.
    for i in (0..tl.pools.len()).rev() {
        let color = colors[i % colors.len()];
        let series = tl.points.iter().map(|(t, a, _)| (*t, a[..=i].iter().sum::<u64>() as f64 / div));
        let label = format!("allocated, {}", pool_label(tl.pools[i]));
        chart
            .draw_series(AreaSeries::new(step(series), 0.0, color.mix(0.9)).border_style(color))
            .map_err(|e| draw(&e))?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.mix(0.9).filled()));
    }
    chart
        .draw_series(LineSeries::new(
            step(tl.points.iter().map(|(t, _, r)| (*t, *r as f64 / div))),
            BLACK.stroke_width(2),
        ))
        .map_err(|e| draw(&e))?
        .label("reserved, all pools")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], BLACK.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| draw(&e))?;
    root.present().map_err(|e| draw(&e))
}

/// Holds each value until the next point (memory changes in steps, not slopes).
fn step(points: impl Iterator<Item = (f64, f64)>) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = Vec::new();
    for (t, v) in points {
        if let Some(&(_, prev)) = out.last() {
            out.push((t, prev));
        }
        out.push((t, v));
    }
    out
}
