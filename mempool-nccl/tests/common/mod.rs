//! What the symmetric-memory probes share: running a body in a child process killed at a
//! deadline (a kernel that may spin forever never hangs the test run), and the two ranks.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use mempool_nccl::symm::SymmMemory;
use mempool_nccl::Communicator;

/// Set in the children `in_child` starts (the `child_*` tests do nothing without it).
const CHILD: &str = "MEMPOOL_NCCL_PROBE_CHILD";

/// Whether this process is a child started by `in_child`.
pub(crate) fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs test `name` of this binary in a child process; kills it at `limit`. Returns
/// (whether it passed, whether it ran past the limit).
pub(crate) fn in_child(name: &str, limit: Duration) -> (bool, bool) {
    let exe = std::env::current_exe().unwrap();
    let mut c = std::process::Command::new(exe)
        .args([name, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .spawn()
        .unwrap();
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = c.try_wait().unwrap() {
            return (status.success(), false);
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            return (false, true);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A probe's parent test: on a machine with two GPUs, runs child test `name` (see `in_child`)
/// and asserts it passed within `limit`, saying `hung` if it ran past it.
pub(crate) fn child_passes(name: &str, limit: Duration, hung: &str) {
    if !two_gpus() {
        return;
    }
    let (passed, timed_out) = in_child(name, limit);
    assert!(!timed_out, "{hung}");
    assert!(passed, "see the child's output");
}

/// Writes `value(i)` into element `i` of this rank's symmetric data, and waits for it.
pub(crate) fn fill(symm: &SymmMemory<f32>, stream: &Arc<CudaStream>, value: impl Fn(usize) -> f32) {
    let host: Vec<f32> = (0..symm.len()).map(value).collect();
    let mut mine = symm.peer(symm.rank(), stream).unwrap();
    stream.memcpy_htod(&host, &mut mine).unwrap();
    stream.synchronize().unwrap();
}

/// Bytes of this rank's one-shot receive slots that are not the empty mark (0xff), read with a
/// synchronous copy of the driver (it waits for none of the crate's non-blocking streams).
pub(crate) fn receive_slot_bytes_in_use<T>(symm: &SymmMemory<T>, ctx: &Arc<CudaContext>) -> usize {
    let (at, bytes) = symm.receive_slots();
    if bytes == 0 {
        return 0;
    }
    let mut back = vec![0u8; bytes];
    ctx.bind_to_thread().unwrap();
    // SAFETY: reads this rank's own receive slots (`bytes` bytes, mapped for this device) into
    // `back`, which has room for them.
    let r = unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), at, bytes) };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    back.iter().filter(|&&b| b != 0xff).count()
}

/// Whether this machine has the two GPUs the probes need (says so when not).
pub(crate) fn two_gpus() -> bool {
    let n = mempool::device_count().expect("a CUDA driver");
    if n < 2 {
        eprintln!("{n} GPU(s): these probes need two");
    }
    n >= 2
}

/// Runs `f(comm)` on one thread per rank of `all_local(&[0, 1])`; each thread's result, a panic
/// as `Err(message)`.
pub(crate) fn on_two_gpus<T: Send + 'static>(
    f: impl Fn(Communicator) -> T + Send + Sync + 'static,
) -> Vec<std::result::Result<T, String>> {
    on_gpus(&[0, 1], f)
}

/// Runs `f(comm)` on one thread per rank of `all_local(devices)`; each thread's result, a panic
/// as `Err(message)`.
pub(crate) fn on_gpus<T: Send + 'static>(
    devices: &[usize],
    f: impl Fn(Communicator) -> T + Send + Sync + 'static,
) -> Vec<std::result::Result<T, String>> {
    let comms = Communicator::all_local(devices).expect("communicators");
    let f = Arc::new(f);
    let threads: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(c))
        })
        .collect();
    threads
        .into_iter()
        .map(|t| {
            t.join().map_err(|p| {
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            })
        })
        .collect()
}

/// Asserts that every rank's thread finished without a panic.
pub(crate) fn all_ok<T: std::fmt::Debug>(got: &[std::result::Result<T, String>]) {
    for (r, g) in got.iter().enumerate() {
        assert!(g.is_ok(), "rank {r}: {g:?}");
    }
}
