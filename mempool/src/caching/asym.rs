//! Asymmetric fences for the thread caches: the owner of a cache takes a block out of its own
//! slot with a plain load and store (no locked instruction), and the rare other thread that
//! drains the cache pays for both with one `membarrier` system call.
//!
//! The owner's take: `busy = true`; (compiler fence); `drainers` read (acquire); if 0, the slot
//! is read and zeroed with plain accesses, then `busy = false` (release); otherwise the slot is
//! swapped as before. A drainer: `drainers += 1` on every cache it will touch; [`heavy`]; then,
//! per cache, it waits until `busy` is false (acquire), swaps the slots, and lowers `drainers`
//! (release) when done. `heavy` makes every thread of the process run a full memory barrier
//! (`MEMBARRIER_CMD_PRIVATE_EXPEDITED`; a thread that is not running gets one when it is
//! switched in), at one point of its instruction stream. If that point is before the owner's
//! `busy = true`, the owner's later read of `drainers` sees the drainer's increment and it
//! swaps; if after, `busy = true` is visible when `heavy` returns and the drainer waits for the
//! owner's `busy = false`, whose release publishes the zeroed slot. So a block is never both
//! read by the owner and swapped out by a drainer. An owner that reads `drainers` as 0 after a
//! drainer lowered it synchronises with that release and sees the slots the drainer zeroed.
//!
//! Where the kernel has no expedited `membarrier` (or `MEMPOOL_NO_MEMBARRIER` is set, or under
//! loom or Miri, which cannot model it), [`on`] is false and owners swap, as drainers always do.
//! (So loom's models check the swapping protocol; `tests/asym_drain.rs` runs owners and
//! drainers against each other in both modes, and fails when the owner's check is removed.)

/// Whether owners take with plain accesses (decided once per process, before any cache uses
/// it: both sides read the same answer).
#[cfg(all(target_os = "linux", not(loom), not(miri)))]
pub(super) fn on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        if std::env::var_os("MEMPOOL_NO_MEMBARRIER").is_some() {
            return false;
        }
        let supported = membarrier(QUERY);
        supported > 0
            && supported & i64::from(PRIVATE_EXPEDITED) != 0
            && supported & i64::from(REGISTER_PRIVATE_EXPEDITED) != 0
            && membarrier(REGISTER_PRIVATE_EXPEDITED) == 0
    })
}

/// See above: never on this platform.
#[cfg(not(all(target_os = "linux", not(loom), not(miri))))]
pub(super) fn on() -> bool {
    false
}

/// A full memory barrier on every running thread of the process (see the module). Only called
/// when [`on`] is true.
#[cfg(all(target_os = "linux", not(loom), not(miri)))]
pub(super) fn heavy() {
    if membarrier(PRIVATE_EXPEDITED) != 0 {
        // Registered once and for all by `on`: the kernel does not refuse it afterwards. Were it
        // to, an owner could be reading a slot this drain is about to take: stopping is the
        // only answer that keeps memory safe.
        eprintln!("mempool: membarrier failed after registration: {}", std::io::Error::last_os_error());
        std::process::abort();
    }
}

/// See above: never called on this platform.
#[cfg(not(all(target_os = "linux", not(loom), not(miri))))]
pub(super) fn heavy() {}

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
