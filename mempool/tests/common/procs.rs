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

/// How a forked child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// It exited with this code.
    Exited(i32),
    /// Its alarm went off: it hung.
    Hung,
    /// Another signal ended it.
    Signaled(i32),
}

/// Forks. The child arms an alarm of `alarm_secs` seconds, runs `body` and ends with the code
/// `body` returns (101 if it panics: the child never runs on into its parent's test), running
/// no destructor of the state it shares with its parent; the parent waits for it and says how
/// it ended.
///
/// # Safety
///
/// The child of a multithreaded process may call only async-signal-safe functions and code
/// that the test means to prove works there (the allocator's calls): `body` must keep to that.
pub(crate) unsafe fn fork_and_wait(alarm_secs: u32, body: impl FnOnce() -> i32) -> Ended {
    // SAFETY: the caller vouches for what the child runs; `alarm` and `_exit` are
    // async-signal-safe.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: as above.
        unsafe { libc::alarm(alarm_secs) };
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or(101);
        // SAFETY: as above.
        unsafe { libc::_exit(code) }
    }
    assert!(pid > 0, "fork failed: {}", std::io::Error::last_os_error());
    let mut st = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(pid, &mut st, 0) };
    if libc::WIFEXITED(st) {
        Ended::Exited(libc::WEXITSTATUS(st))
    } else if libc::WIFSIGNALED(st) && libc::WTERMSIG(st) == libc::SIGALRM {
        Ended::Hung
    } else {
        Ended::Signaled(libc::WTERMSIG(st))
    }
}
