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

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde_pickle::{HashableValue, Value};

/// What can go wrong reading or drawing a snapshot.
#[derive(Debug)]
pub enum Error {
    /// The file could not be read or written.
    Io(String),
    /// Not a pickle, or not a snapshot.
    Format(String),
    /// The chart could not be drawn.
    Draw(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Io(m) => write!(f, "{m}"),
            Error::Format(m) => write!(f, "not a memory snapshot: {m}"),
            Error::Draw(m) => write!(f, "drawing the timeline: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// A block of a segment.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// Bytes.
    pub size: u64,
    /// `active_allocated`, `active_pending_free` or `inactive`.
    pub state: String,
}

/// A segment.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// Device index.
    pub device: u64,
    /// Pool id (the second number of PyTorch's `segment_pool_id`; 0: the default pools).
    pub pool: u64,
    /// Bytes.
    pub total_size: u64,
    /// Its blocks in address order.
    pub blocks: Vec<Block>,
}

/// A trace event.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Device index.
    pub device: u64,
    /// `alloc`, `free_requested`, `free_completed`, `segment_alloc`, `segment_free`, `oom`,
    /// `segment_map`, `segment_unmap`.
    pub action: String,
    /// Bytes.
    pub size: u64,
    /// Pool id (0 where the snapshot does not say, as in PyTorch's).
    pub pool: u64,
    /// Microseconds.
    pub time_us: u64,
}

/// The parts of a snapshot the timeline and summary use.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SnapshotView {
    /// Segments now.
    pub segments: Vec<Segment>,
    /// Trace events of every device, in recording order.
    pub events: Vec<Event>,
}

fn key<'a>(d: &'a BTreeMap<HashableValue, Value>, k: &str) -> Option<&'a Value> {
    d.get(&HashableValue::String(k.to_string()))
}

fn num(v: Option<&Value>) -> u64 {
    match v {
        Some(Value::I64(i)) => (*i).max(0) as u64,
        Some(Value::Int(b)) => b.to_string().parse().unwrap_or(0),
        Some(Value::F64(f)) => *f as u64,
        _ => 0,
    }
}

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bytes(b)) => String::from_utf8_lossy(b).into_owned(),
        _ => String::new(),
    }
}

fn list(v: Option<&Value>) -> &[Value] {
    match v {
        Some(Value::List(l)) | Some(Value::Tuple(l)) => l,
        _ => &[],
    }
}

fn dict(v: &Value) -> Option<&BTreeMap<HashableValue, Value>> {
    match v {
        Value::Dict(d) => Some(d),
        _ => None,
    }
}

impl SnapshotView {
    /// Reads a pickled snapshot from a file.
    pub fn read(path: impl AsRef<Path>) -> Result<SnapshotView, Error> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        SnapshotView::from_pickle(&bytes)
    }

    /// Parses a pickled snapshot.
    pub fn from_pickle(bytes: &[u8]) -> Result<SnapshotView, Error> {
        let v: Value =
            serde_pickle::value_from_slice(bytes, serde_pickle::DeOptions::new().replace_unresolved_globals())
                .map_err(|e| Error::Format(e.to_string()))?;
        let top = dict(&v).ok_or_else(|| Error::Format("the pickle is not a dictionary".into()))?;
        if key(top, "segments").is_none() {
            return Err(Error::Format("no `segments`".into()));
        }
        let segments = list(key(top, "segments"))
            .iter()
            .filter_map(dict)
            .map(|s| Segment {
                device: num(key(s, "device")),
                pool: list(key(s, "segment_pool_id")).get(1).map_or(0, |p| num(Some(p))),
                total_size: num(key(s, "total_size")),
                blocks: list(key(s, "blocks"))
                    .iter()
                    .filter_map(dict)
                    .map(|b| Block { size: num(key(b, "size")), state: text(key(b, "state")) })
                    .collect(),
            })
            .collect();
        let mut events = Vec::new();
        for (device, trace) in list(key(top, "device_traces")).iter().enumerate() {
            for e in list(Some(trace)).iter().filter_map(dict) {
                events.push(Event {
                    device: device as u64,
                    action: text(key(e, "action")),
                    size: num(key(e, "size")),
                    pool: num(key(e, "pool_id")),
                    time_us: num(key(e, "time_us")),
                });
            }
        }
        Ok(SnapshotView { segments, events })
    }

    /// One line of figures per pool, in pool order.
    pub fn summary(&self) -> Vec<PoolSummary> {
        let mut by_pool: BTreeMap<u64, PoolSummary> = BTreeMap::new();
        for s in &self.segments {
            let p = by_pool.entry(s.pool).or_insert_with(|| PoolSummary { pool: s.pool, ..Default::default() });
            p.segments += 1;
            p.reserved += s.total_size;
            for b in &s.blocks {
                if b.state == "inactive" {
                    p.free += b.size;
                    p.largest_free = p.largest_free.max(b.size);
                } else {
                    p.allocated += b.size;
                }
            }
        }
        by_pool.into_values().collect()
    }
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

impl SnapshotView {
    /// The timeline, ending at the snapshot's state: a trace that starts mid-run (a ring of the
    /// last entries) is lifted by what the snapshot shows was already there.
    pub fn timeline(&self) -> Timeline {
        let pools: Vec<u64> = self
            .segments
            .iter()
            .map(|s| s.pool)
            .chain(self.events.iter().map(|e| e.pool))
            .collect::<BTreeSet<u64>>()
            .into_iter()
            .collect();
        let index = |p: u64| pools.iter().position(|x| *x == p).unwrap_or(0);
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
        let end_alloc: Vec<i128> =
            pools.iter().map(|p| summary.iter().find(|s| s.pool == *p).map_or(0, |s| s.allocated as i128)).collect();
        let end_res: i128 = summary.iter().map(|s| s.reserved as i128).sum();
        let mut alloc: Vec<i128> = end_alloc.iter().zip(&delta_alloc).map(|(e, d)| (e - d).max(0)).collect();
        let mut res = (end_res - delta_res).max(0);
        let t0 = self.events.first().map_or(0, |e| e.time_us);
        let mut points = vec![(0.0, alloc.iter().map(|a| *a as u64).collect(), res as u64)];
        for e in &self.events {
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

/// What an event does to the timeline's two quantities.
enum Change {
    Allocated(i128),
    Reserved(i128),
}

fn change(e: &Event) -> Option<Change> {
    let n = e.size as i128;
    match e.action.as_str() {
        "alloc" => Some(Change::Allocated(n)),
        "free_completed" => Some(Change::Allocated(-n)),
        // Expandable segments map and unmap memory (PyTorch's names too).
        "segment_alloc" | "segment_map" => Some(Change::Reserved(n)),
        "segment_free" | "segment_unmap" => Some(Change::Reserved(-n)),
        _ => None,
    }
}

/// Draws the timeline as an SVG file.
pub fn render_timeline(view: &SnapshotView, path: impl AsRef<Path>) -> Result<(), Error> {
    let tl = view.timeline();
    let draw = |e: &dyn std::fmt::Display| Error::Draw(e.to_string());
    let max_bytes = tl.points.iter().map(|(_, a, r)| (*r).max(a.iter().sum())).max().unwrap_or(0).max(1);
    let (unit, div) = if max_bytes >= 4 << 30 { ("GiB", (1u64 << 30) as f64) } else { ("MiB", (1u64 << 20) as f64) };
    let t_max = tl.points.last().map_or(1.0, |p| p.0).max(1e-3);
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
        .build_cartesian_2d(0f64..t_max, 0f64..y_max)
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
        let label = if tl.pools[i] == 0 {
            "allocated, default pools".to_string()
        } else {
            format!("allocated, pool {}", tl.pools[i])
        };
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
