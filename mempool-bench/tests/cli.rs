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
