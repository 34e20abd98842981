//! A bounded fuzzer of our own (no nightly toolchain here for cargo-fuzz) for the trace reader:
//! structured random and byte-mutated traces. Every input must give events or a clear error, never
//! a panic; errors must name the first wrong line, and what parses must be a sequence a program
//! could make. `MEMPOOL_FUZZ_ITERS` sets the number of inputs (CI: 20,000).

use std::collections::HashSet;

use mempool_bench::trace::{parse_trace, Problem, TraceOp, MAX_BYTES, MAX_STREAM};

fn iters() -> usize {
    std::env::var("MEMPOOL_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000)
}

#[path = "../../mempool/tests/common/mutate.rs"]
mod mutate;
use mutate::{mutate, random_from};

/// xorshift64, as in the anchors' workloads.
struct Rng(u64);

impl mutate::Below for Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn trace_reader_never_panics_and_names_the_line() {
    let mut r = Rng(0x7AACE);
    let good = "a 0 4096 0\na 1 1048576 140000\nf 0\n\na 2 512\nf 1\nf 2\n";
    let pieces = &[
        "a",
        "f",
        " ",
        "\n",
        "0",
        "1",
        "42",
        "-1",
        "18446744073709551615",
        "99999999999999999999",
        "x",
        "\t",
        "4096",
        "\r\n",
    ];
    for i in 0..iters() {
        let input = if i % 2 == 0 { random_from(&mut r, pieces, 30) } else { mutate(&mut r, good) };
        match std::panic::catch_unwind(|| parse_trace(&input)) {
            Ok(Ok(ops)) => {
                let lines = input.lines().filter(|l| !l.trim().is_empty()).count();
                assert_eq!(ops.len(), lines, "{input:?}");
                // What parses is a sequence a program could make, within the documented ranges.
                let mut live = HashSet::new();
                for op in ops {
                    match op {
                        TraceOp::Alloc { id, bytes, stream } => {
                            assert!(live.insert(id), "{input:?}: id {id} allocated while live");
                            assert!((1..=MAX_BYTES).contains(&(bytes as u64)), "{input:?}");
                            assert!(stream <= MAX_STREAM, "{input:?}");
                        }
                        TraceOp::Free { id } => assert!(live.remove(&id), "{input:?}: id {id} freed while not live"),
                    }
                }
            }
            Ok(Err(e)) => {
                // The error names the first wrong line: every line before it parses.
                let m = e.to_string();
                assert!(m.starts_with(&format!("line {}: ", e.line)) && m.len() > 20, "{input:?} -> {m}");
                let before: Vec<&str> = input.lines().take(e.line - 1).collect();
                assert_eq!(before.len(), e.line - 1, "{input:?} -> {m}: past the last line");
                assert!(parse_trace(&before.join("\n")).is_ok(), "{input:?} -> {m}: an earlier line is wrong");
            }
            Err(_) => panic!("parse_trace panicked on {input:?}"),
        }
    }
    // Findings of the first fuzzer kept as tests: trailing fields, a size above usize on 32-bit
    // hosts (now above MAX_BYTES everywhere), a truncated line.
    assert_eq!(parse_trace("a 1 2 3 4").unwrap_err().problem, Problem::Trailing("4".into()));
    assert!(matches!(parse_trace("a 1 18446744073709551615").unwrap_err().problem, Problem::TooLarge(..)));
    assert_eq!(
        parse_trace("f").unwrap_err().to_string(),
        "line 1: missing <id>: an allocation is `a <id> <bytes> [<stream>]`, a free is `f <id>`"
    );
}
