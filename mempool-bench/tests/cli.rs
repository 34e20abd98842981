//! The `mempool-bench` binary's line formats, which `mempool-bench/harness/join.py` and the
//! referee scripts parse, on the simulated device.

use std::process::Command;

/// The binary cargo built for this test; absent where the test binary was carried elsewhere (the
/// GPU machine runs bundled test binaries without a target folder): those runs skip, saying so.
fn binary() -> Option<&'static str> {
    let b = env!("CARGO_BIN_EXE_mempool-bench");
    if std::path::Path::new(b).exists() {
        Some(b)
    } else {
        eprintln!("{b} not found: the command-line checks are skipped here");
        None
    }
}

fn run(args: &[&str]) -> String {
    let out = Command::new(binary().expect("checked by the caller"))
        .args(args)
        .args(["--backend", "sim"])
        .env("MEMPOOL_BENCH_ITERS", "200")
        .output()
        .expect("mempool-bench runs");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

/// `mempool <name> <N> pairs_per_s <rate> scaling <x>` for N = 1, 2, 4, 8, 16, scaling 1 at N = 1.
fn check_threads(text: &str, name: &str) {
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(lines.len(), 5, "{text}");
    for (l, n) in lines.iter().zip([1, 2, 4, 8, 16]) {
        assert_eq!(l.len(), 7, "{l:?}");
        assert_eq!((l[0], l[1], l[2], l[3], l[5]), ("mempool", name, &*n.to_string(), "pairs_per_s", "scaling"));
        let rate: f64 = l[4].parse().expect("a rate");
        let scaling: f64 = l[6].parse().expect("a scaling");
        assert!(rate > 0.0 && scaling > 0.0, "{l:?}");
        if n == 1 {
            assert_eq!(l[6], "1.00");
        }
    }
}

#[test]
fn threads_prints_one_line_per_thread_count() {
    if binary().is_none() {
        return;
    }
    check_threads(&run(&["threads"]), "threads");
    check_threads(&run(&["threads", "--shared-stream"]), "threads_shared");
}

#[test]
fn threads_refuses_unknown_options() {
    let Some(b) = binary() else { return };
    let out = Command::new(b).args(["threads", "--bogus", "--backend", "sim"]).output().expect("mempool-bench runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage"));
}

/// `mempool graph <trace> events=<n> pool_reserved=<b> pool_peak_reserved=<b> live=<n>`: the
/// capture's pool holds every byte it reserved (nothing goes back during a capture), and the
/// trace's allocations never freed are still live.
#[test]
fn graph_prints_the_capture_pools_reserved_bytes() {
    if binary().is_none() {
        return;
    }
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../traces/transformer_train.trace");
    let text = std::fs::read_to_string(trace).expect("recorded trace");
    let ops = mempool_bench::trace::parse_trace(&text).expect("parses");
    let allocs: std::collections::HashSet<u64> = ops
        .iter()
        .filter_map(|o| match o {
            mempool_bench::trace::TraceOp::Alloc { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    let freed = ops.iter().filter(|o| matches!(o, mempool_bench::trace::TraceOp::Free { .. })).count();
    let out = run(&["graph", trace]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines[1].starts_with("mempool_expand graph transformer_train.trace "), "{out}");
    let w: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(w.len(), 7, "{out}");
    assert_eq!((w[0], w[1], w[2]), ("mempool", "graph", "transformer_train.trace"));
    let field = |i: usize, k: &str| -> u64 {
        w[i].strip_prefix(k).and_then(|v| v.strip_prefix('=')).expect(k).parse().expect("a number")
    };
    assert_eq!(field(3, "events"), ops.len() as u64);
    let (reserved, peak) = (field(4, "pool_reserved"), field(5, "pool_peak_reserved"));
    assert!(reserved > 0 && reserved == peak, "{out}");
    assert_eq!(field(6, "live"), (allocs.len() - freed) as u64, "{out}");
}
