//! Child processes and threads for the tests that fork or need a fresh process (the thread
//! caches' mode is decided once per process).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mempool::{Allocator, Sim};

/// Runs test `name` of this test binary alone in a child process, with `var=name` set (the
/// test's body acts as the child when it finds it), after `wrap` (a command line put in front,
/// e.g. `unshare -Urp --fork`; empty: none), with `adjust` applied to the command (its
/// environment); killed after `timeout`. Its exit code, signal and output.
pub(crate) fn run_test_child(
    var: &str,
    name: &str,
    wrap: &[&str],
    timeout: Duration,
    adjust: impl FnOnce(&mut std::process::Command),
) -> (Option<i32>, Option<i32>, String) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match wrap {
        [] => std::process::Command::new(&exe),
        [first, rest @ ..] => {
            let mut c = std::process::Command::new(first);
            c.args(rest).arg(&exe);
            c
        }
    };
    cmd.args(["--exact", name, "--test-threads=1", "--nocapture", "--include-ignored"]).env(var, name);
    adjust(&mut cmd);
    cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > timeout {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    use std::os::unix::process::ExitStatusExt;
    let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), out.status.signal(), text)
}

/// The child's `CHILD-RESULT ...` line (the harness may print its test name before it).
pub(crate) fn result_line(out: &str) -> Option<&str> {
    out.lines().find_map(|l| l.find("CHILD-RESULT").map(|i| &l[i..]))
}

/// The number after `key` (`hung=`, say) in the child's `CHILD-RESULT` line.
pub(crate) fn child_result(out: &str, key: &str) -> u32 {
    let l = result_line(out).unwrap_or_else(|| panic!("no result:\n{out}"));
    l.split_whitespace().find_map(|w| w.strip_prefix(key)).unwrap().parse().unwrap()
}

/// Pins the calling thread to processor 0; whether the kernel agreed.
pub(crate) fn pin_to_cpu0() -> bool {
    // SAFETY: plain libc calls on a zeroed cpu_set_t for the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// A thread's first call on `a` (an allocation of `size` bytes: its thread cache made and, in
/// a fresh process, the thread caches' mode decided), under way when this returns; the flag
/// is set once that call has returned.
pub(crate) fn first_call_on_a_thread(
    a: &Allocator<Sim>,
    size: usize,
) -> (std::thread::JoinHandle<()>, Arc<AtomicBool>) {
    let (started, done) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let (a, s, d) = (a.clone(), started.clone(), done.clone());
    let w = std::thread::spawn(move || {
        s.store(true, Ordering::SeqCst);
        drop(a.alloc::<u8>(size).unwrap());
        d.store(true, Ordering::SeqCst);
    });
    while !started.load(Ordering::SeqCst) {
        std::hint::spin_loop();
    }
    (w, done)
}
