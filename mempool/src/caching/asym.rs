//! Asymmetric fences for the thread caches: the owner of a cache takes a block out of its own
//! slot with a plain load and store (no locked instruction), and the rare other thread that
//! drains the cache pays for both with one `membarrier` system call.
//!
//! The owner's take: `busy = gen` (this process's fork generation, never 0); (compiler fence);
//! `drainers` read (acquire); if 0, the slot is read and zeroed with plain accesses, then
//! `busy = 0` (release); otherwise the slot is swapped as before. A drainer: `drainers += 1` on
//! every cache it will touch; [`heavy`]; then, per cache, it waits while `busy` holds this
//! generation (acquire), swaps the slots, and lowers `drainers` (release) when done. `heavy`
//! makes every thread of the process run a full memory barrier
//! (`MEMBARRIER_CMD_PRIVATE_EXPEDITED`; a thread that is not running gets one when it is
//! switched in), at one point of its instruction stream. If that point is before the owner's
//! `busy = gen`, the owner's later read of `drainers` sees the drainer's increment and it
//! swaps; if after, `busy` is visible when `heavy` returns and the drainer waits for the
//! owner's `busy = 0`, whose release publishes the zeroed slot. So a block is never both read
//! by the owner and swapped out by a drainer. An owner that reads `drainers` as 0 after a
//! drainer lowered it synchronises with that release and sees the slots the drainer zeroed.
//!
//! **Fork.** A child process has only the thread that forked; another thread caught between
//! `busy = gen` and `busy = 0` would leave its flag set for ever. The child's generation is one
//! more (a `pthread_atfork` child handler, an atomic add), so a drainer there ignores flags of
//! the parent's generation (their owners do not exist), while the forking thread's later takes
//! write the child's.
//!
//! **A refused `membarrier`.** The call is registered for once, but a seccomp filter installed
//! later (a sandbox) can still refuse it. Then owners stop taking with plain accesses ([`fast`]
//! turns false, and every later take swaps), and drains wait until [`GRACE`] has passed since
//! then before they look at the `busy` flags: an owner running inside its few instructions
//! when the mode changed has finished them, or was switched out, which publishes its `busy`
//! (a context switch is a full barrier). This rests on store buffers draining within that time,
//! as they do on every CPU this runs on, rather than on an architectural promise; the process
//! goes on rather than stop. It is said once on standard error.
//!
//! Where the kernel has no expedited `membarrier` (or `MEMPOOL_NO_MEMBARRIER` is set, or under
//! loom or Miri, which cannot model it), [`fast`] is false from the start and owners swap, as
//! drainers always do. (So loom's models check the swapping protocol; `tests/asym_drain.rs` and
//! `tests/review_asym.rs` run owners and drainers against each other in both modes, across
//! `fork` and a seccomp filter, and fail when the owner's check is removed.)

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

/// The wait of drains after a refused `membarrier` (see the module).
pub(super) const GRACE: Duration = Duration::from_millis(20);

/// The mode, one word: not decided yet, decided off (no `membarrier`), on (owners take with
/// plain accesses), or on at the start and turned off for good after a refusal. One word, so a
/// thread that reads the decision reads the mode it names.
static MODE: AtomicU8 = AtomicU8::new(UNDECIDED);
const UNDECIDED: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;
const REFUSED: u8 = 3;
/// When the mode was turned off after a refusal.
static OFF_SINCE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// Whether owners take with plain accesses (read on every take: one load of a line nobody
/// writes).
#[inline(always)]
pub(super) fn fast() -> bool {
    MODE.load(Ordering::Relaxed) == ON
}

/// The fork generation an owner writes into `busy` (never 0): one more in each child, once a
/// cache was made (`init`; where the handler cannot be registered, always 1).
#[inline(always)]
pub(super) fn generation() -> u64 {
    crate::sync::fork_generation()
}

/// Decides the mode, once per process, before any cache is made (`Registry::make` calls it):
/// every take and every drain afterwards reads the same answer. No thread waits for another
/// to decide: each undecided one registers itself (idempotent) and the first answer published
/// stands. (A `std::sync::Once` here hung fork children: registering with `membarrier` can take
/// tens of milliseconds, and a fork meanwhile left the child's `Once` running for ever; a
/// decision marked with the deciding process's id hung a descendant that had that id again, in
/// another pid namespace or after the id was reused.)
#[inline]
pub(super) fn init() {
    if MODE.load(Ordering::Acquire) == UNDECIDED {
        decide();
    }
}

#[cold]
fn decide() {
    let on = register();
    let _ = MODE.compare_exchange(UNDECIDED, if on { ON } else { OFF }, Ordering::AcqRel, Ordering::Acquire);
}

/// The drainer's fence, once it has raised the `drainers` count of every cache it will take
/// from: `membarrier` while the mode is on; after a refusal (this one or an earlier one), the
/// mode is off and the drain waits until [`GRACE`] has passed since it went off.
pub(super) fn fence() {
    let mode = MODE.load(Ordering::Acquire);
    if mode == UNDECIDED || mode == OFF {
        return;
    }
    if mode == ON && heavy() {
        return;
    }
    let since = *OFF_SINCE.get_or_init(Instant::now);
    if MODE.compare_exchange(ON, REFUSED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
        // Never a panic here (`eprintln!` panics on a closed pipe): a revoker of the state
        // lock's bias (`bias.rs`) runs this between clearing the bias and waiting for its
        // holder, and must not unwind out of that.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "mempool: membarrier was refused ({}); thread caches take with atomic swaps from now on",
            std::io::Error::last_os_error()
        );
    }
    let left = GRACE.saturating_sub(since.elapsed());
    if !left.is_zero() {
        std::thread::sleep(left);
    }
}

/// Waits while `busy()` (a thread inside its few plain-access instructions, switched out
/// there perhaps), backing off as [`crate::sync::back_off`] does.
pub(super) fn wait_while(busy: impl Fn() -> bool) {
    let mut spins = 0u32;
    while busy() {
        spins += 1;
        crate::sync::back_off(spins);
    }
}

#[cfg(all(target_os = "linux", not(loom), not(miri)))]
fn register() -> bool {
    // The fork generation counts in every mode: a reader of the statistics needs it too (a
    // thread of the parent caught inside a step, `ThreadStats::seq`).
    // SAFETY: registers a child handler that only adds to an atomic (async-signal-safe, as a
    // fork child handler must be); the function lives as long as the program.
    let counted = unsafe { libc::pthread_atfork(None, None, Some(forked)) } == 0;
    if std::env::var_os("MEMPOOL_NO_MEMBARRIER").is_some() {
        return false;
    }
    let supported = membarrier(QUERY);
    let ok = supported > 0
        && supported & i64::from(PRIVATE_EXPEDITED) != 0
        && supported & i64::from(REGISTER_PRIVATE_EXPEDITED) != 0
        && membarrier(REGISTER_PRIVATE_EXPEDITED) == 0;
    ok && counted
}

#[cfg(all(target_os = "linux", not(loom), not(miri)))]
extern "C" fn forked() {
    crate::sync::count_fork();
}

#[cfg(not(all(target_os = "linux", not(loom), not(miri))))]
fn register() -> bool {
    false
}

/// A full memory barrier on every running thread of the process (see the module); false if
/// the kernel refused it.
#[cfg(all(target_os = "linux", not(loom), not(miri)))]
fn heavy() -> bool {
    membarrier(PRIVATE_EXPEDITED) == 0
}

/// See above: never called with the mode on, on this platform.
#[cfg(not(all(target_os = "linux", not(loom), not(miri))))]
fn heavy() -> bool {
    false
}

#[cfg(all(target_os = "linux", not(loom), not(miri)))]
const QUERY: i32 = 0;
#[cfg(all(target_os = "linux", not(loom), not(miri)))]
const PRIVATE_EXPEDITED: i32 = 1 << 3;
#[cfg(all(target_os = "linux", not(loom), not(miri)))]
const REGISTER_PRIVATE_EXPEDITED: i32 = 1 << 4;

#[cfg(all(target_os = "linux", not(loom), not(miri)))]
fn membarrier(cmd: i32) -> i64 {
    // SAFETY: the membarrier system call with a command, no flags and no CPU: it reads and
    // writes no memory of this process.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0u32, 0i32) }
}
