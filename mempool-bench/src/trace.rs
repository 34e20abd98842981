//! The plain allocation-trace format of the anchors (`shared/anchors/README.md`): one event a
//! line, `a <id> <bytes> <stream>` allocates and `f <id>` frees. Used by `mempool-bench replay`.
//!
//! ```
//! let ops = mempool_bench::trace::parse_trace("a 0 4096 0\na 1 100 0\nf 0\n")?;
//! assert_eq!(ops[0], mempool_bench::trace::TraceOp::Alloc { id: 0, bytes: 4096, stream: 0 });
//! # Ok::<(), String>(())
//! ```

/// One event of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceOp {
    /// Allocate `bytes` under the name `id` on `stream` (0 when the line gives none).
    Alloc {
        /// The allocation's name.
        id: u64,
        /// Its size.
        bytes: usize,
        /// The stream the trace recorded.
        stream: u64,
    },
    /// Free the allocation named `id`.
    Free {
        /// The allocation's name.
        id: u64,
    },
}

/// Parses a whole trace; the error names the line and what it expected. Blank lines are skipped.
pub fn parse_trace(text: &str) -> Result<Vec<TraceOp>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| {
            let bad = || format!("line {}: expected `a <id> <bytes> [<stream>]` or `f <id>`, got {l:?}", n + 1);
            let mut w = l.split_whitespace();
            let op = w.next().ok_or_else(bad)?;
            let mut num = || -> Result<u64, String> { w.next().and_then(|x| x.parse().ok()).ok_or_else(bad) };
            let parsed = match op {
                "a" => {
                    let id = num()?;
                    let bytes = usize::try_from(num()?).map_err(|_| bad())?;
                    let stream = match w.next() {
                        None => 0,
                        Some(s) => s.parse::<i64>().map_err(|_| bad())? as u64,
                    };
                    TraceOp::Alloc { id, bytes, stream }
                }
                "f" => TraceOp::Free { id: num()? },
                _ => return Err(bad()),
            };
            match w.next() {
                None => Ok(parsed),
                Some(_) => Err(bad()),
            }
        })
        .collect()
}
