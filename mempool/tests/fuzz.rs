//! A bounded fuzzer of our own (no nightly toolchain here for cargo-fuzz): structured random and
//! mutated inputs for the config parser (the trace reader's fuzzer is in `mempool-bench`). Every
//! input must give a value or a clear error, never a panic, and errors must name what was wrong.
//! `MEMPOOL_FUZZ_ITERS` sets the number of inputs per target (CI: 20,000).

mod common;

use common::mutate::{mutate, random_from};
use common::Rng;
use mempool::config::Config;

fn iters() -> usize {
    std::env::var("MEMPOOL_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000)
}

const CONFIG_PIECES: &[&str] = &[
    "max_split_size_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    ":",
    ",",
    "[",
    "]",
    ">",
    "0",
    "1",
    "2",
    "4",
    "21",
    "256",
    "0.5",
    "0.8",
    "1.5",
    "-1",
    "nan",
    "inf",
    "1e400",
    "18446744073709551616",
    " ",
    "\t",
    "\u{feff}",
    "é",
    "max_split_size_mb:",
    ":4",
    "[1:2,>:4]",
    "[",
    "::",
    ",,",
];

#[test]
fn config_parser_never_panics_and_names_the_problem() {
    let mut r = Rng(0xC0FF1E);
    let seeds = [
        "max_split_size_mb:256,garbage_collection_threshold:0.8,roundup_power2_divisions:4",
        "roundup_power2_divisions:[1:2,256:8,>:1]",
    ];
    for i in 0..iters() {
        let input = if i % 2 == 0 { random_from(&mut r, CONFIG_PIECES, 12) } else { mutate(&mut r, seeds[i % 4 / 2]) };
        match std::panic::catch_unwind(|| Config::parse(&input)) {
            Ok(Ok(c)) => {
                // Whatever parses is within the documented ranges.
                assert!(c.max_split_size > 20 << 20, "{input:?} -> {c:?}");
                assert!(c.garbage_collection_threshold >= 0.0 && c.garbage_collection_threshold < 1.0, "{input:?}");
                assert!(c.roundup_power2_divisions.iter().all(|d| *d <= 1 || d.is_power_of_two()), "{input:?}");
            }
            Ok(Err(e)) => {
                let m = e.to_string();
                assert!(m.starts_with("invalid allocator config: ") && m.len() > 30, "{input:?} -> {m}");
            }
            Err(_) => panic!("Config::parse panicked on {input:?}"),
        }
    }
}
