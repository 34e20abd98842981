//! The plain allocation-trace format of the anchors (`shared/anchors/README.md`), as
//! `shared/anchors/capture_traces.py` records it from PyTorch and `mempool-bench replay` plays it.
//!
//! One event a line, fields separated by blanks; blank lines are skipped, but count in line
//! numbers (the first line is line 1):
//!
//! - `a <id> <bytes> [<stream>]` allocates `bytes` bytes and names the allocation `id`;
//! - `f <id>` frees the allocation named `id`.
//!
//! Every field is a decimal number. `<id>` is any `u64`; an id names one allocation from its `a`
//! line to its `f` line, and may be used again after that. `<bytes>` is 1 to [`MAX_BYTES`] (1 TiB).
//! `<stream>` is the stream the allocation was made on, as PyTorch's memory snapshot records it:
//! the `cudaStream_t` handle's value as an `int64`, so 0 to [`MAX_STREAM`], 0 being the default
//! stream (the one a line without `<stream>` gets). A trace is a sequence of events of a real
//! program, so [`parse_trace`] also refuses a free of an id that is not live and an allocation of
//! an id that is.
//!
//! ```
//! use mempool_bench::trace::{parse_trace, Problem, TraceOp};
//! let ops = parse_trace("a 0 4096 0\na 1 100\nf 0\n")?;
//! assert_eq!(ops[0], TraceOp::Alloc { id: 0, bytes: 4096, stream: 0 });
//! assert_eq!(ops[2], TraceOp::Free { id: 0 });
//!
//! let e = parse_trace("a 0 4096 0\nf 0\nf 0\n").unwrap_err();
//! assert_eq!((e.line, &e.problem), (3, &Problem::DoubleFree { id: 0, freed_at: 2 }));
//! # Ok::<(), mempool_bench::trace::TraceError>(())
//! ```

use std::collections::HashMap;
use std::fmt;

/// The largest allocation a trace may ask for: 1 TiB, far above any GPU's memory today, so that
/// a size that is really a corrupted field is caught here rather than as an out-of-memory error.
pub const MAX_BYTES: u64 = 1 << 40;

/// The largest stream value: PyTorch records a stream handle as an `int64`.
pub const MAX_STREAM: u64 = i64::MAX as u64;

/// One event of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceOp {
    /// Allocate `bytes` under the name `id` on `stream` (0 when the line gives none).
    Alloc {
        /// The allocation's name.
        id: u64,
        /// Its size: 1 to [`MAX_BYTES`].
        bytes: usize,
        /// The stream the trace recorded: 0 (the default stream) to [`MAX_STREAM`].
        stream: u64,
    },
    /// Free the allocation named `id`.
    Free {
        /// The allocation's name.
        id: u64,
    },
}

/// Why [`parse_trace`] refused a trace: the line (counted from 1, blank lines included) and what
/// is wrong with it. Its `Display` reads `line <n>: <problem>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceError {
    /// The line, counted from 1.
    pub line: usize,
    /// What is wrong with it.
    pub problem: Problem,
}

/// A field of a trace line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// `<id>` of `a` or `f`.
    Id,
    /// `<bytes>` of `a`.
    Bytes,
    /// `<stream>` of `a`.
    Stream,
}

/// What is wrong with a line of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// The line starts with neither `a` nor `f`.
    UnknownEvent(String),
    /// The line ends before this field.
    Missing(Field),
    /// The field is not made of decimal digits.
    NotANumber(Field, String),
    /// The field is a negative number.
    Negative(Field, String),
    /// The field is above its largest value (`u64::MAX`, [`MAX_BYTES`], [`MAX_STREAM`]).
    TooLarge(Field, String),
    /// An allocation of 0 bytes.
    ZeroSize,
    /// Something follows the event's last field.
    Trailing(String),
    /// An allocation of an id that is live: line `since` allocated it and no line since freed it.
    AllocOfLiveId {
        /// The id.
        id: u64,
        /// The line that allocated it.
        since: usize,
    },
    /// A free of an id that no earlier line allocated.
    FreeOfUnknownId(u64),
    /// A free of an id that line `freed_at` already freed (and no line allocated again since).
    DoubleFree {
        /// The id.
        id: u64,
        /// The line that freed it.
        freed_at: usize,
    },
}

impl Field {
    fn name(self) -> &'static str {
        match self {
            Field::Id => "<id>",
            Field::Bytes => "<bytes>",
            Field::Stream => "<stream>",
        }
    }

    fn max(self) -> u64 {
        match self {
            Field::Id => u64::MAX,
            Field::Bytes => MAX_BYTES,
            Field::Stream => MAX_STREAM,
        }
    }
}

const FORMS: &str = "an allocation is `a <id> <bytes> [<stream>]`, a free is `f <id>`";

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::UnknownEvent(w) => write!(f, "unknown event {w:?}: {FORMS}"),
            Problem::Missing(field) => write!(f, "missing {}: {FORMS}", field.name()),
            Problem::NotANumber(field, w) => {
                write!(f, "{} {w:?} is not a number (decimal digits expected)", field.name())
            }
            Problem::Negative(Field::Stream, w) => write!(
                f,
                "<stream> {w} is negative: a stream is a CUDA stream handle as PyTorch records it (0 is the default \
                 stream), never below 0"
            ),
            Problem::Negative(field, w) => write!(f, "{} {w} is negative", field.name()),
            Problem::TooLarge(Field::Bytes, w) => write!(
                f,
                "<bytes> {w} is above 1 TiB ({MAX_BYTES}), the largest allocation a trace may ask for: is the field \
                 corrupted?"
            ),
            Problem::TooLarge(field, w) => write!(f, "{} {w} is above {}", field.name(), field.max()),
            Problem::ZeroSize => write!(f, "<bytes> is 0: an allocation is at least 1 byte"),
            Problem::Trailing(w) => write!(f, "unexpected {w:?} after the last field: {FORMS}"),
            Problem::AllocOfLiveId { id, since } => write!(
                f,
                "allocation of id {id}, which is live (allocated at line {since}, not freed since): free it first, \
                 or name the new allocation otherwise"
            ),
            Problem::FreeOfUnknownId(id) => {
                write!(f, "free of id {id}, which is not live (never allocated)")
            }
            Problem::DoubleFree { id, freed_at } => {
                write!(f, "free of id {id}, which is not live (already freed at line {freed_at})")
            }
        }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.problem)
    }
}

impl std::error::Error for TraceError {}

/// Parses a whole trace, and checks that it is a sequence a program could have made: frees only of
/// live ids, allocations only of ids that are not live. The error names the first line that is
/// wrong and what is wrong with it.
pub fn parse_trace(text: &str) -> Result<Vec<TraceOp>, TraceError> {
    /// Where an id stands: live since a line, or freed at one.
    enum Life {
        Live(usize),
        Freed(usize),
    }
    let mut ids: HashMap<u64, Life> = HashMap::new();
    let mut ops = Vec::new();
    for (i, text) in text.lines().enumerate() {
        let line = i + 1;
        let Some(op) = parse_line(text).map_err(|problem| TraceError { line, problem })? else {
            continue;
        };
        let life = match op {
            TraceOp::Alloc { id, .. } => match ids.insert(id, Life::Live(line)) {
                Some(Life::Live(since)) => Err(Problem::AllocOfLiveId { id, since }),
                _ => Ok(()),
            },
            TraceOp::Free { id } => match ids.get_mut(&id) {
                Some(l @ Life::Live(_)) => {
                    *l = Life::Freed(line);
                    Ok(())
                }
                Some(Life::Freed(freed_at)) => Err(Problem::DoubleFree { id, freed_at: *freed_at }),
                None => Err(Problem::FreeOfUnknownId(id)),
            },
        };
        life.map_err(|problem| TraceError { line, problem })?;
        ops.push(op);
    }
    Ok(ops)
}

/// One line on its own: `None` for a blank one.
fn parse_line(text: &str) -> Result<Option<TraceOp>, Problem> {
    let mut words = text.split_whitespace();
    let Some(event) = words.next() else { return Ok(None) };
    let op = match event {
        "a" => {
            let id = number(words.next(), Field::Id)?;
            let bytes = number(words.next(), Field::Bytes)?;
            if bytes == 0 {
                return Err(Problem::ZeroSize);
            }
            // 1 TiB fits a 64-bit usize; on a 32-bit host the bound is usize::MAX.
            let bytes = usize::try_from(bytes).map_err(|_| Problem::TooLarge(Field::Bytes, bytes.to_string()))?;
            let stream = match words.next() {
                None => 0,
                s => number(s, Field::Stream)?,
            };
            TraceOp::Alloc { id, bytes, stream }
        }
        "f" => TraceOp::Free { id: number(words.next(), Field::Id)? },
        other => return Err(Problem::UnknownEvent(other.into())),
    };
    match words.next() {
        None => Ok(Some(op)),
        Some(w) => Err(Problem::Trailing(w.into())),
    }
}

/// A field as a number from 0 to `field.max()`: decimal digits only (no sign, no `0x`).
fn number(word: Option<&str>, field: Field) -> Result<u64, Problem> {
    let word = word.ok_or(Problem::Missing(field))?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(word) {
        return Err(match word.strip_prefix('-') {
            Some(rest) if digits(rest) => Problem::Negative(field, word.into()),
            _ => Problem::NotANumber(field, word.into()),
        });
    }
    // All digits: the only way to fail is to be above u64::MAX.
    match word.parse::<u64>() {
        Ok(n) if n <= field.max() => Ok(n),
        _ => Err(Problem::TooLarge(field, word.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asserts that `text` is refused at `line` for `problem`; returns the message.
    #[track_caller]
    fn refused(text: &str, line: usize, problem: Problem) -> String {
        let e = parse_trace(text).unwrap_err();
        assert_eq!(e, TraceError { line, problem }, "{text:?}");
        let msg = e.to_string();
        assert!(msg.starts_with(&format!("line {line}: ")), "{msg}");
        msg
    }

    #[test]
    fn accepts_every_documented_form() {
        let text = "a 0 4096 0\r\n\n   \na\t1 100\nf 0\na 0 1 7\na 2 1099511627776 9223372036854775807\nf 1\nf 0\n";
        let ops = parse_trace(text).unwrap();
        assert_eq!(
            ops,
            [
                TraceOp::Alloc { id: 0, bytes: 4096, stream: 0 },
                TraceOp::Alloc { id: 1, bytes: 100, stream: 0 },
                TraceOp::Free { id: 0 },
                // An id may name a new allocation once freed.
                TraceOp::Alloc { id: 0, bytes: 1, stream: 7 },
                TraceOp::Alloc { id: 2, bytes: 1 << 40, stream: i64::MAX as u64 },
                TraceOp::Free { id: 1 },
                TraceOp::Free { id: 0 },
            ]
        );
        assert_eq!(parse_trace("").unwrap(), []);
    }

    #[test]
    fn free_of_an_id_never_allocated() {
        let msg = refused("a 0 512\n\na 1 512\nf 0\nf 3\n", 5, Problem::FreeOfUnknownId(3));
        assert_eq!(msg, "line 5: free of id 3, which is not live (never allocated)");
    }

    #[test]
    fn double_free() {
        let msg = refused("a 3 512\nf 3\na 4 512\nf 3\n", 4, Problem::DoubleFree { id: 3, freed_at: 2 });
        assert_eq!(msg, "line 4: free of id 3, which is not live (already freed at line 2)");
    }

    #[test]
    fn allocation_of_an_id_that_is_live() {
        let msg = refused("a 3 512\na 4 512\nf 4\na 3 1024 0\n", 4, Problem::AllocOfLiveId { id: 3, since: 1 });
        assert!(msg.contains("allocation of id 3, which is live (allocated at line 1, not freed since)"), "{msg}");
    }

    #[test]
    fn zero_size() {
        let msg = refused("a 0 512\na 1 0 0\n", 2, Problem::ZeroSize);
        assert!(msg.contains("<bytes> is 0"), "{msg}");
    }

    #[test]
    fn size_above_one_tib() {
        let msg = refused("a 0 1099511627777\n", 1, Problem::TooLarge(Field::Bytes, "1099511627777".into()));
        assert!(msg.contains("above 1 TiB (1099511627776)"), "{msg}");
        refused("a 0 99999999999999999999\n", 1, Problem::TooLarge(Field::Bytes, "99999999999999999999".into()));
    }

    #[test]
    fn negative_stream() {
        let msg = refused("a 0 512 0\na 1 512 -1\n", 2, Problem::Negative(Field::Stream, "-1".into()));
        assert!(msg.contains("<stream> -1 is negative"), "{msg}");
    }

    #[test]
    fn stream_above_int64() {
        let msg =
            refused("a 0 512 9223372036854775808\n", 1, Problem::TooLarge(Field::Stream, "9223372036854775808".into()));
        assert!(msg.contains("above 9223372036854775807"), "{msg}");
    }

    #[test]
    fn truncated_lines() {
        refused("a 0 512\na\n", 2, Problem::Missing(Field::Id));
        refused("f\n", 1, Problem::Missing(Field::Id));
        let msg = refused("a 5\n", 1, Problem::Missing(Field::Bytes));
        assert!(msg.contains("missing <bytes>: an allocation is `a <id> <bytes> [<stream>]`"), "{msg}");
    }

    #[test]
    fn fields_that_are_not_numbers() {
        refused("a x 512\n", 1, Problem::NotANumber(Field::Id, "x".into()));
        refused("a 0 12x\n", 1, Problem::NotANumber(Field::Bytes, "12x".into()));
        refused("a 0 +512\n", 1, Problem::NotANumber(Field::Bytes, "+512".into()));
        refused("a 0 512 0x7f\n", 1, Problem::NotANumber(Field::Stream, "0x7f".into()));
        refused("a 0 512\nf -\n", 2, Problem::NotANumber(Field::Id, "-".into()));
        refused("a -1 512\n", 1, Problem::Negative(Field::Id, "-1".into()));
        refused("a 18446744073709551616 512\n", 1, Problem::TooLarge(Field::Id, "18446744073709551616".into()));
        let msg = refused("a 0 1.5\n", 1, Problem::NotANumber(Field::Bytes, "1.5".into()));
        assert!(msg.contains("<bytes> \"1.5\" is not a number"), "{msg}");
    }

    #[test]
    fn trailing_fields() {
        refused("a 0 512 0 junk\n", 1, Problem::Trailing("junk".into()));
        let msg = refused("a 0 512\nf 0 0\n", 2, Problem::Trailing("0".into()));
        assert!(msg.contains("unexpected \"0\" after the last field"), "{msg}");
    }

    #[test]
    fn unknown_events() {
        refused("alloc 0 512\n", 1, Problem::UnknownEvent("alloc".into()));
        refused("a 0 512\nA 1 512\n", 2, Problem::UnknownEvent("A".into()));
    }
}
