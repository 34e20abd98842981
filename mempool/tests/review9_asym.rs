//! Hostile review of 4e6b1b7 (asym: the mode's decision keyed by the deciding process's pid).
//! It found that a descendant with the deciding process's pid (pid 1 of a new pid namespace,
//! or a reused pid) waited for ever for a decider it did not have; now no thread waits for
//! another to decide (each undecided thread registers, the first answer published stands).
//!
//! Each test runs its body in a fresh process (this binary re-run with `--exact NAME`,
//! `REVIEW9_CHILD` set), so the process-wide decision is still to be made there.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::procs::{
    child_result as result, first_call_on_a_thread, fork_and_wait, pin_to_cpu0, run_test_child, Ended,
};
use mempool::sim::SimDevice;
use mempool::{Allocator, Sim};

fn setup(capacity: usize) -> (Arc<SimDevice>, Allocator<Sim>) {
    let sim = SimDevice::new(capacity);
    (sim.clone(), Allocator::sim(sim))
}

fn is_child(name: &str) -> bool {
    std::env::var("REVIEW9_CHILD").is_ok_and(|v| v == name)
}

/// Runs test `name` in a fresh process; `wrap`: a command line put in front (`unshare ...`).
fn run_child(name: &str, wrap: &[&str], timeout: Duration) -> (Option<i32>, String) {
    let (code, _, out) = run_test_child("REVIEW9_CHILD", name, wrap, timeout, |cmd| {
        cmd.env_remove("MEMPOOL_NO_MEMBARRIER");
    });
    (code, out)
}

fn unshare_available() -> bool {
    std::process::Command::new("unshare").args(["-Urp", "--fork", "true"]).status().is_ok_and(|s| s.success())
}

/// The body shared by the two pid-namespace tests: this process (pid 1 of a fresh pid
/// namespace, under `unshare -Urp --fork`) forks over and over while its worker thread makes the
/// first thread cache (the mode's decision: DECISION = 1, this process's pid). Each child makes
/// a grandchild, in a new pid namespace (`new_ns`, so the grandchild's pid is 1 again) or not,
/// and the grandchild makes its first thread cache under an alarm.
fn fork_chain_body(new_ns: bool) {
    // SAFETY: getpid.
    assert_eq!(unsafe { libc::getpid() }, 1, "run under unshare -Urp --fork");
    let (_sa, a) = setup(1 << 30);
    let (_sb, b) = setup(1 << 30);
    let (w, done) = first_call_on_a_thread(&a, 4096);
    let (mut hung, mut forks) = (0u32, 0u32);
    while !done.load(Ordering::SeqCst) && forks < 100 {
        // SAFETY: the child calls only async-signal-safe functions before its own fork; the
        // grandchild calls the allocator (as review_asym's fork test does) under an alarm.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: the forked child: unshare, fork, alarm-free waits, kill and _exit only
            // (async-signal-safe), and the grandchild's allocator calls as review_asym's.
            unsafe {
                if new_ns && libc::unshare(libc::CLONE_NEWPID) != 0 {
                    libc::_exit(3);
                }
                let g = libc::fork();
                if g == 0 {
                    libc::alarm(3);
                    std::hint::black_box(b.memory_stats());
                    drop(b.alloc::<u8>(512).unwrap());
                    libc::_exit(0);
                }
                // Not `alarm` in the grandchild: pid 1 of a namespace ignores signals it has
                // no handler for (SIGALRM included); SIGKILL from here reaches it.
                let mut st = 0;
                let mut waited = 0;
                while libc::waitpid(g, &mut st, libc::WNOHANG) == 0 {
                    if waited >= 3000 {
                        libc::kill(g, libc::SIGKILL);
                        libc::waitpid(g, &mut st, 0);
                        libc::_exit(2);
                    }
                    libc::usleep(1000);
                    waited += 1;
                }
                libc::_exit(if libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0 { 0 } else { 1 });
            }
        }
        assert!(pid > 0);
        forks += 1;
        let mut st = 0;
        // SAFETY: waits for our child.
        unsafe { libc::waitpid(pid, &mut st, 0) };
        assert!(!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 3), "unshare(CLONE_NEWPID) refused");
        if !libc::WIFEXITED(st) || libc::WEXITSTATUS(st) != 0 {
            hung += 1;
        }
    }
    w.join().unwrap();
    println!("CHILD-RESULT hung={hung} forks={forks}");
}

/// The two pid-namespace tests' common part: as the child, runs `fork_chain_body(new_ns)`; as
/// the parent, runs that child `rounds` times (skipped without `unshare -Urp`). The grandchildren
/// that hung and the forks, for the parent only.
fn chain_test(name: &str, new_ns: bool, rounds: usize) -> Option<(u32, u32)> {
    if is_child(name) {
        fork_chain_body(new_ns);
        return None;
    }
    if !unshare_available() {
        eprintln!("skipped: no unshare -Urp");
        return None;
    }
    let (mut hung, mut forks) = (0, 0);
    for _ in 0..rounds {
        let (code, out) = run_child(name, &["unshare", "-Urp", "--fork"], Duration::from_secs(300));
        assert_eq!(code, Some(0), "{out}");
        hung += result(&out, "hung=");
        forks += result(&out, "forks=");
    }
    Some((hung, forks))
}

/// Found by review (fixed: the test asserts no grandchild hangs): DECISION held a pid, and a pid names a process only within one pid namespace and
/// only while that process lives. A grandchild whose pid (in its own namespace) equals the
/// pid of the process that was deciding when its ancestor forked finds "its own" pid in
/// DECISION and waits in `wait_while` for a thread that does not exist: its first thread cache
/// hangs for ever. Here: the deciding process is pid 1 (a container's init, as under Docker);
/// a child forked during the decision makes a grandchild in a new pid namespace (a sandbox),
/// which is pid 1 again. (The same happens with pid reuse after wrap-around: process P
/// deciding forks C; P exits; C's later descendant gets P's old pid.)
#[test]
fn finding_a_descendant_with_the_deciders_pid_hangs() {
    const NAME: &str = "finding_a_descendant_with_the_deciders_pid_hangs";
    let Some((hung, forks)) = chain_test(NAME, true, 3) else { return };
    eprintln!("new pid namespace: {hung} of {forks} grandchildren hung");
    assert_eq!(
        hung, 0,
        "{hung} of {forks} grandchildren (pid 1 of a new pid namespace) hung in their first allocator call"
    );
}

/// Control for the finding above: the same chain without the new namespace (grandchildren
/// with pids of their own) never hangs.
#[test]
fn held_a_descendant_with_its_own_pid_takes_the_decision_over() {
    const NAME: &str = "held_a_descendant_with_its_own_pid_takes_the_decision_over";
    let Some((hung, forks)) = chain_test(NAME, false, 6) else { return };
    eprintln!("same pid namespace: {hung} of {forks} grandchildren hung");
    assert_eq!(hung, 0);
}

/// Held: a fork child that takes the decision over while it forks a grandchild of its own
/// (the child's worker deciding, the child forking in a loop), and many threads of one
/// process racing to decide while the main thread forks: no hang, nobody fails.
#[test]
fn held_forks_in_every_window_and_racing_threads() {
    const NAME: &str = "held_forks_in_every_window_and_racing_threads";
    if is_child(NAME) {
        let (_sa, a) = setup(1 << 30);
        let (_sb, b) = setup(1 << 30);
        let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let barrier = Arc::new(std::sync::Barrier::new(9));
        let ws: Vec<_> = (0..8)
            .map(|_| {
                let (a, done, barrier) = (a.clone(), done.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    drop(a.alloc::<u8>(4096).unwrap());
                    done.fetch_add(1, Ordering::SeqCst);
                })
            })
            .collect();
        barrier.wait();
        let (mut hung, mut forks) = (0u32, 0u32);
        while done.load(Ordering::SeqCst) < 8 && forks < 300 {
            // SAFETY: the child uses the allocator and threads under an alarm, as above.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: alarm in the child.
                unsafe { libc::alarm(5) };
                // The child decides on a worker thread while it forks grandchildren.
                let b2 = b.clone();
                let w = std::thread::spawn(move || drop(b2.alloc::<u8>(512).unwrap()));
                let mut bad = 0;
                for _ in 0..3 {
                    // SAFETY: the grandchild calls the allocator under an alarm, as above.
                    let ended = unsafe {
                        fork_and_wait(3, || {
                            drop(b.alloc::<u8>(512).unwrap());
                            0
                        })
                    };
                    if ended != Ended::Exited(0) {
                        bad += 1;
                    }
                }
                w.join().unwrap();
                drop(b.alloc::<u8>(512).unwrap());
                // SAFETY: _exit in the child.
                unsafe { libc::_exit(bad) };
            }
            forks += 1;
            let mut st = 0;
            // SAFETY: waits for our child.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            if !libc::WIFEXITED(st) || libc::WEXITSTATUS(st) != 0 {
                hung += 1;
            }
        }
        for w in ws {
            w.join().unwrap();
        }
        println!("CHILD-RESULT hung={hung} forks={forks}");
        return;
    }
    let (mut hung, mut forks) = (0, 0);
    for _ in 0..4 {
        let (code, out) = run_child(NAME, &[], Duration::from_secs(300));
        assert_eq!(code, Some(0), "{out}");
        hung += result(&out, "hung=");
        forks += result(&out, "forks=");
    }
    eprintln!("{hung} of {forks} children failed");
    assert_eq!(hung, 0);
}

/// Held: a SCHED_FIFO thread pinned to the deciding thread's processor, deciding while a
/// normal thread it preempted decides too, is never held up by it (nobody waits now; with
/// the waiting version, `wait_while` slept).
#[test]
fn held_a_realtime_waiter_lets_the_decider_finish() {
    const NAME: &str = "held_a_realtime_waiter_lets_the_decider_finish";
    if is_child(NAME) {
        let (_sa, a) = setup(1 << 30);
        let a2 = a.clone();
        let go = Arc::new(AtomicBool::new(false));
        let go2 = go.clone();
        let rt = std::thread::spawn(move || {
            let _ = pin_to_cpu0();
            let p = libc::sched_param { sched_priority: 10 };
            // SAFETY: sets this thread's policy.
            if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) } != 0 {
                return None;
            }
            while !go2.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_micros(50));
            }
            // Wake while the decider (same processor) is registering.
            std::thread::sleep(Duration::from_micros(20));
            let t = Instant::now();
            drop(a2.alloc::<u8>(512).unwrap());
            Some(t.elapsed())
        });
        let _ = pin_to_cpu0();
        go.store(true, Ordering::Release);
        drop(a.alloc::<u8>(512).unwrap());
        let t = rt.join().unwrap();
        println!("CHILD-RESULT ms={} skipped={}", t.map_or(0, |t| t.as_millis() as u32), t.is_none() as u32);
        return;
    }
    let mut worst = 0;
    for _ in 0..20 {
        let (code, out) = run_child(NAME, &[], Duration::from_secs(30));
        assert_eq!(code, Some(0), "hang or failure: {out}");
        if result(&out, "skipped=") == 1 {
            eprintln!("skipped: SCHED_FIFO refused");
            return;
        }
        worst = worst.max(result(&out, "ms="));
    }
    eprintln!("worst real-time wait: {worst} ms");
    assert!(worst < 1000);
}
