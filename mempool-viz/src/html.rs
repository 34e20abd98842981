//! A self-contained page to explore a snapshot offline: the timeline stacked by pool (drag to
//! zoom, wheel to zoom, hover for the figures at a time), the segments with their blocks (hover
//! a block for its size, state, pool, stream and allocation stack), and the top allocation
//! sites. Script and style are inline: the page loads nothing from anywhere.
//!
//! Its size is bounded whatever the trace's length: the timeline is downsampled (peaks kept) to
//! [`TIMELINE_BUCKETS`] buckets; for detail inside a long trace, write a page of a range
//! (`--from/--to`).

use std::fmt::Write as _;
use std::path::Path;

use crate::{Error, SnapshotView, StackId};

/// The timeline's resolution in the page (time buckets, each up to four points and one per pool).
pub const TIMELINE_BUCKETS: usize = 2000;

const SCRIPT: &str = include_str!("page.js");
const STYLE: &str = include_str!("page.css");

/// A JSON string literal.
fn js_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            // `<` escaped so no text can close the script element.
            '<' => out.push_str("\\u003c"),
            c if (c as u32) < 0x20 || c == '\u{2028}' || c == '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn js_f64(out: &mut String, v: f64) {
    if v.is_finite() {
        let _ = write!(out, "{v}");
    } else {
        out.push('0');
    }
}

/// The page for `view` (the part of its trace between `from_ms` and `to_ms`).
pub fn page(view: &SnapshotView, from_ms: Option<f64>, to_ms: Option<f64>) -> String {
    let tl = view.timeline().window(from_ms, to_ms).downsample(TIMELINE_BUCKETS);
    let mut d = String::with_capacity(1 << 16);
    d.push('{');
    let devices = view.devices();
    let title = format!(
        "Memory snapshot: device{} {}, {} segments, {} trace events{}",
        if devices.len() == 1 { "" } else { "s" },
        devices.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
        view.segments.len(),
        view.events.len(),
        if view.requested_sizes { " (allocated = bytes requested, as PyTorch traces them)" } else { "" }
    );
    d.push_str("\"title\":");
    js_str(&mut d, &title);
    let _ = write!(d, ",\"pools\":{:?}", tl.pools);
    d.push_str(",\"t\":[");
    for (i, p) in tl.points.iter().enumerate() {
        if i > 0 {
            d.push(',');
        }
        js_f64(&mut d, p.0);
    }
    d.push_str("],\"a\":[");
    for k in 0..tl.pools.len() {
        if k > 0 {
            d.push(',');
        }
        d.push('[');
        for (i, p) in tl.points.iter().enumerate() {
            if i > 0 {
                d.push(',');
            }
            let _ = write!(d, "{}", p.1.get(k).copied().unwrap_or(0));
        }
        d.push(']');
    }
    d.push_str("],\"r\":[");
    for (i, p) in tl.points.iter().enumerate() {
        if i > 0 {
            d.push(',');
        }
        let _ = write!(d, "{}", p.2);
    }
    d.push_str("],\"segments\":[");
    let mut used: Vec<StackId> = Vec::new();
    for (i, s) in view.segments.iter().enumerate() {
        if i > 0 {
            d.push(',');
        }
        let _ = write!(
            d,
            "{{\"d\":{},\"addr\":{},\"size\":{},\"pool\":{},\"stream\":{},\"exp\":{},\"blocks\":[",
            s.device,
            s.address,
            s.total_size.max(1),
            s.pool,
            s.stream,
            s.is_expandable
        );
        let mut off = 0u64;
        for (j, b) in s.blocks.iter().enumerate() {
            if j > 0 {
                d.push(',');
            }
            let state = match b.state.as_str() {
                "active_allocated" => 0,
                "active_pending_free" => 1,
                _ => 2,
            };
            // Offsets from the addresses where the snapshot has them, else running sizes.
            let at = if b.address >= s.address && b.address > 0 { b.address - s.address } else { off };
            off = at.saturating_add(b.size);
            let _ = write!(d, "[{at},{},{},{state},{}]", b.size, b.requested_size, b.stack);
            if b.stack != 0 {
                used.push(b.stack);
            }
        }
        d.push_str("]}");
    }
    used.sort_unstable();
    used.dedup();
    // Only the stacks the blocks use, and only their frames (renumbered).
    let mut frame_ids: Vec<u32> =
        used.iter().flat_map(|s| view.stacks.get(*s as usize).into_iter().flatten().copied()).collect();
    frame_ids.sort_unstable();
    frame_ids.dedup();
    d.push_str("],\"stacks\":{");
    for (i, s) in used.iter().enumerate() {
        if i > 0 {
            d.push(',');
        }
        let frames = view.stacks.get(*s as usize).map_or(&[][..], |v| &v[..]);
        let renumbered: Vec<usize> = frames.iter().filter_map(|f| frame_ids.binary_search(f).ok()).collect();
        let _ = write!(d, "\"{s}\":{{\"f\":{renumbered:?},\"site\":");
        js_str(&mut d, &view.site(*s).map_or_else(String::new, |f| f.to_string()));
        d.push('}');
    }
    d.push_str("},\"frames\":[");
    for (i, f) in frame_ids.iter().enumerate() {
        if i > 0 {
            d.push(',');
        }
        let fr = view.frames.get(*f as usize);
        d.push('[');
        js_str(&mut d, fr.map_or("", |f| &f.name));
        d.push(',');
        js_str(&mut d, fr.map_or("", |f| &f.filename));
        let _ = write!(d, ",{}]", fr.map_or(0, |f| f.line));
    }
    d.push_str("],\"sites\":[");
    for (i, s) in view.top_sites(10).iter().enumerate() {
        if i > 0 {
            d.push(',');
        }
        let _ = write!(d, "{{\"pool\":{},\"bytes\":{},\"blocks\":{},\"site\":", s.pool, s.bytes, s.blocks);
        js_str(&mut d, &s.site);
        d.push('}');
    }
    d.push_str("]}");

    let mut html = String::with_capacity(d.len() + SCRIPT.len() + 4096);
    html.push_str(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>mempool-viz</title>\n<style>\n",
    );
    html.push_str(STYLE);
    html.push_str(
        "</style></head><body>\n<h1 id=\"title\"></h1>\n<div id=\"legend\"></div>\n\
         <div id=\"controls\"><button id=\"reset\">Reset zoom</button><span id=\"range\"></span></div>\n\
         <svg id=\"timeline\" xmlns=\"http://www.w3.org/2000/svg\"></svg>\n\
         <p class=\"note\">Drag across the chart to zoom into a range, or use the wheel; hover for the figures at a time.</p>\n\
         <h2>Segments</h2>\n<p class=\"note\">One row per segment, its blocks in address order (grey: free). Hover a block for its allocation.</p>\n\
         <div id=\"segments\"></div>\n<h2>Top allocation sites (live bytes)</h2>\n\
         <p id=\"sites-none\">No stacks were recorded in this snapshot.</p>\n\
         <table id=\"sites\"><thead><tr><th>pool</th><th>bytes</th><th>blocks</th><th>site</th></tr></thead><tbody></tbody></table>\n\
         <div id=\"tooltip\"></div>\n<script type=\"application/json\" id=\"snapshot-data\">",
    );
    html.push_str(&d);
    html.push_str("</script>\n<script>\n");
    html.push_str(SCRIPT);
    html.push_str("</script>\n</body></html>\n");
    html
}

/// Writes [`page`] to `path`.
pub fn write_page(
    view: &SnapshotView,
    from_ms: Option<f64>,
    to_ms: Option<f64>,
    path: impl AsRef<Path>,
) -> Result<(), Error> {
    let path = path.as_ref();
    std::fs::write(path, page(view, from_ms, to_ms)).map_err(|error| Error::Io { path: path.to_path_buf(), error })
}
