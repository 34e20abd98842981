//! The allocator's state lock, biased towards the thread that keeps taking it: while one
//! thread takes it call after call (one thread whose sizes never repeat, or a training loop's
//! replay: every allocation takes the lock), it takes and lets go with plain stores, no locked
//! instruction. Another thread that wants the lock revokes the bias with the asymmetric fence
//! of the thread caches ([`super::asym`]): a `membarrier`, once.
//!
//! **The protocol.** Each thread that may be biased has a slot number (1 to [`SLOTS`], reused
//! after its thread exits), and each mutex a `busy` flag per slot, written only by the thread
//! of that slot. `bias` names the biased thread's slot, or none (0); it is set and cleared only
//! under `inner`, the real lock. The biased thread's take: [`asym::fast`] read; `bias` read;
//! its own `busy = true` (plain), a compiler fence, `bias` read again: still its own, it holds
//! the state; it lets go with `busy = false` (release). Any other take locks `inner`; if `bias`
//! names another slot, it stores 0 there, runs [`asym::fence`] and waits while that slot's
//! `busy` is set (acquire), then holds the state. The fence is a full barrier on every thread of
//! the process at one point of its instruction stream: if the biased thread's point is before
//! its `busy = true`, its second read of `bias` sees the 0 and it takes `inner` instead; if
//! after, `busy` is visible when the fence returns and the revoker waits for the release of
//! `busy = false`, which publishes the biased thread's writes. The writes of whoever held the
//! state before the bias was set reach the biased thread through `inner`, which it held when
//! it set it. So the state is never held twice. (One flag per thread, not per mutex: a thread
//! that read `bias` as its own just before a revocation, then stalled, still stores and
//! clears its flag around its second read after another thread was biased; a flag shared by
//! all threads would then be cleared under the new biased thread's feet.) A slot passes to a
//! new thread only after its old thread has exited, so a bias that names it hands the lock to
//! the new thread, which sees the old one's writes through the free-slot bits (released by the
//! old thread, acquired by the new). Where `membarrier` is refused, [`asym::fence`] turns the
//! fast mode off and waits out the grace time, and biased threads, which read [`asym::fast`]
//! first, stop taking the fast way, as the thread caches' owners do (see there for the argument
//! and its limit). Without `membarrier` at all (or under loom or Miri) no thread is ever biased;
//! nor is a thread beyond the first [`SLOTS`] alive at once. A revoker waiting for the biased
//! thread spins briefly, yields, then sleeps (a yield gives the processor only to threads of its
//! own priority).
//!
//! **When.** A thread becomes biased when it lets go of `inner` having taken it [`REBIAS`]
//! times in a row with no other thread taking it in between (never while it holds `inner`, so a
//! thread that took the lock again would block on `inner`, as with a `Mutex`; one that holds it
//! the biased way and takes it again panics): a revocation costs one `membarrier`
//! (microseconds), so threads that take turns never pay it more than once per that many calls.
//! The background event thread's looks revoke a bias like any other thread's take.
//!
//! **Fork.** A child has only the thread that forked. A biased thread caught inside would leave
//! its `busy` set: the child's takes then wait for ever, as a `std::sync::Mutex` held by a
//! vanished thread makes them. (The forking thread itself is never inside: no user code runs
//! under the lock.)

use std::cell::{Cell, UnsafeCell};
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{compiler_fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::asym;

/// Takes of `inner` in a row by one thread after which it is biased.
pub(super) const REBIAS: u32 = 1024;

/// Threads alive at once that may be biased (one `busy` flag each per mutex).
pub(super) const SLOTS: usize = 64;

/// A mutex that one thread at a time may hold with plain stores (see the module).
pub(super) struct BiasedMutex<T> {
    inner: Mutex<Streak>,
    /// The biased thread's slot (0: none); written under `inner`.
    bias: AtomicU32,
    /// Per slot: its thread holds the state without `inner` (written by that thread only).
    busy: [AtomicBool; SLOTS],
    /// The slot of the thread holding the state the biased way: written and read only by the
    /// holder.
    holder: UnsafeCell<u32>,
    /// The guard of `inner` while a thread holds the state the slow way (`None` while it is
    /// held the biased way, or not held): written and read only by the holder. Kept here,
    /// not in [`BiasedGuard`], so that a guard is one pointer (a guard of three words, moved
    /// out of the call that took it, was read back with wider loads than it was written with:
    /// a store-forwarding stall on every locked call). Its lifetime is `inner`'s borrow,
    /// which outlives every guard of this mutex.
    held: UnsafeCell<Option<MutexGuard<'static, Streak>>>,
    data: UnsafeCell<T>,
}

// SAFETY: the state is reached only through a guard, and guards exclude each other (the
// module's protocol), so `T` moves between threads as it would inside a `Mutex`.
unsafe impl<T: Send> Send for BiasedMutex<T> {}
// SAFETY: as above: shared references hand out `&mut T` to one guard at a time.
unsafe impl<T: Send> Sync for BiasedMutex<T> {}

/// Who took `inner` last (a slot, or [`NO_SLOT`]), and how many times in a row.
#[derive(Debug, Default)]
struct Streak {
    last: u32,
    times: u32,
}

/// Holds the state of a [`BiasedMutex`]; lets go when dropped (by the thread that took it:
/// not `Send`, as a `MutexGuard` is not).
pub(super) struct BiasedGuard<'a, T> {
    m: &'a BiasedMutex<T>,
    _not_send: PhantomData<*const ()>,
}

/// A thread's slot before it has asked for one.
const UNASKED: u32 = u32::MAX;
/// A thread with no slot (all taken, or its thread-local storage is gone): never biased.
const NO_SLOT: u32 = u32::MAX - 1;

thread_local! {
    /// This thread's slot (1 to `SLOTS`), `UNASKED` or `NO_SLOT`. No destructor: readable
    /// while other thread-local destructors run.
    static SLOT: Cell<u32> = const { Cell::new(UNASKED) };
    /// Gives the slot back when the thread exits.
    static RETURN: SlotReturn = const { SlotReturn };
}

/// Free slots: bit `k` for slot `k + 1`. Atomic, not a list under a lock: a fork while
/// another thread held such a lock (exiting, or taking its first slot) left it locked for ever
/// in the child, whose first lock of any allocator then hung.
static FREE_SLOTS: AtomicU64 = AtomicU64::new(u64::MAX);
const _: () = assert!(SLOTS == 64, "one bit of FREE_SLOTS per slot");

struct SlotReturn;

impl Drop for SlotReturn {
    fn drop(&mut self) {
        let s = SLOT.with(|c| c.replace(NO_SLOT));
        if (1..=SLOTS as u32).contains(&s) {
            // Release: the next thread given the slot (acquiring) sees all this one did.
            FREE_SLOTS.fetch_or(1 << (s - 1), Ordering::Release);
        }
    }
}

/// This thread's slot, or `UNASKED` / `NO_SLOT` (never a bias).
#[inline(always)]
fn slot() -> u32 {
    SLOT.try_with(Cell::get).unwrap_or(NO_SLOT)
}

/// Gives this thread a slot if it has none yet and one is free.
#[cold]
fn ask_slot() -> u32 {
    // Its return registered first: a thread whose destructors are under way gets none.
    if RETURN.try_with(|_| ()).is_err() {
        return NO_SLOT;
    }
    let mut free = FREE_SLOTS.load(Ordering::Relaxed);
    let s = loop {
        if free == 0 {
            break NO_SLOT;
        }
        let k = free.trailing_zeros();
        match FREE_SLOTS.compare_exchange_weak(free, free & !(1 << k), Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => break k + 1,
            Err(now) => free = now,
        }
    };
    let _ = SLOT.try_with(|c| c.set(s));
    s
}

impl<T> BiasedMutex<T> {
    pub(super) fn new(data: T) -> BiasedMutex<T> {
        BiasedMutex {
            inner: Mutex::new(Streak { last: NO_SLOT, times: 0 }),
            bias: AtomicU32::new(0),
            busy: std::array::from_fn(|_| AtomicBool::new(false)),
            holder: UnsafeCell::new(0),
            held: UnsafeCell::new(None),
            data: UnsafeCell::new(data),
        }
    }

    /// Takes the state (a poisoned `inner` is taken all the same: nothing panics while the
    /// state is held, and `Drop` paths must not panic on it).
    #[inline(always)]
    pub(super) fn lock(&self) -> BiasedGuard<'_, T> {
        let me = slot();
        // `bias` is a slot or 0, so only a thread with a slot gets past this.
        if asym::fast() && self.bias.load(Ordering::Relaxed) == me {
            let busy = &self.busy[(me as usize).wrapping_sub(1) % SLOTS];
            if busy.load(Ordering::Relaxed) {
                // This thread holds it already (only it sets its flag).
                reentered();
            }
            busy.store(true, Ordering::Relaxed);
            // Ordered against a revoker by its fence (see the module); the compiler must not
            // move the read of `bias` above the store.
            compiler_fence(Ordering::SeqCst);
            if self.bias.load(Ordering::Relaxed) == me {
                // SAFETY: this thread holds the state: it alone is at `holder`.
                unsafe { *self.holder.get() = me };
                return BiasedGuard { m: self, _not_send: PhantomData };
            }
            busy.store(false, Ordering::Release);
        }
        self.lock_slow(me)
    }

    #[inline(never)]
    fn lock_slow(&self, me: u32) -> BiasedGuard<'_, T> {
        // A slot only where a thread can be biased (no membarrier: never).
        let me = if me == UNASKED && asym::fast() { ask_slot() } else { me };
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        match self.bias.load(Ordering::Relaxed) {
            0 => {}
            // Its own bias, on the slow way: the fast mode went off (the bias goes), or this
            // thread holds the state the biased way already.
            b if b == me => {
                if self.busy[(me - 1) as usize].load(Ordering::Relaxed) {
                    reentered();
                }
                self.bias.store(0, Ordering::Relaxed);
            }
            b => {
                self.bias.store(0, Ordering::Relaxed);
                asym::fence();
                // The biased thread is inside a locked section (no user code, no waiting).
                let busy = &self.busy[(b - 1) as usize];
                asym::wait_while(|| busy.load(Ordering::Acquire));
            }
        }
        // The bias, if this streak earns it, is set as this thread lets go (`BiasedGuard::drop`):
        // while it holds `inner`, `bias` never names it, so a lock it took again (a bug) would
        // block on `inner` as a `Mutex`'s does, not hold the state twice.
        if g.last == me {
            g.times = g.times.saturating_add(1);
        } else {
            *g = Streak { last: me, times: 1 };
        }
        // SAFETY: only the lifetime changes: the guard borrows `self.inner`, and is dropped
        // (by `BiasedGuard::drop`) while the `BiasedGuard` that borrows `self` lives.
        let g: MutexGuard<'static, Streak> = unsafe { std::mem::transmute(g) };
        // SAFETY: this thread holds the state (the protocol above): no one else reads or
        // writes `held` until it lets go.
        unsafe { *self.held.get() = Some(g) };
        BiasedGuard { m: self, _not_send: PhantomData }
    }

    /// Whether a guard holds the state the biased way (tests; by the holder only).
    #[cfg(test)]
    fn held_biased(&self) -> bool {
        // SAFETY: called by the holder (see `held`).
        unsafe { (*self.held.get()).is_none() }
    }

    /// Whether the calling thread is the biased one now (tests).
    #[cfg(test)]
    pub(super) fn biased_here(&self) -> bool {
        self.bias.load(Ordering::Relaxed) == slot()
    }
}

/// A thread took the lock it holds: a bug in this crate (no user code runs under the lock).
#[cold]
#[inline(never)]
fn reentered() -> ! {
    panic!("mempool: the allocator's lock was taken again by the thread that holds it")
}

impl<T> Deref for BiasedGuard<'_, T> {
    type Target = T;
    #[inline(always)]
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the state (the module's protocol): no other reference to it
        // exists until the guard is dropped.
        unsafe { &*self.m.data.get() }
    }
}

impl<T> DerefMut for BiasedGuard<'_, T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference through the guard.
        unsafe { &mut *self.m.data.get() }
    }
}

impl<T> Drop for BiasedGuard<'_, T> {
    #[inline(always)]
    fn drop(&mut self) {
        let m = self.m;
        // SAFETY: this guard holds the state, so this thread is the only one at `held` and
        // `holder`.
        match unsafe { (*m.held.get()).take() } {
            // Held the slow way: `inner` is let go, and this thread biased if it has taken it
            // `REBIAS` times in a row (`last` is its slot).
            Some(g) => {
                if g.times >= REBIAS && (1..=SLOTS as u32).contains(&g.last) && asym::fast() {
                    m.bias.store(g.last, Ordering::Relaxed);
                }
                drop(g)
            }
            // Publishes this section's writes to a revoker (which reads the flag acquiring).
            None => {
                // SAFETY: as above.
                let s = unsafe { *m.holder.get() };
                m.busy[(s as usize).wrapping_sub(1) % SLOTS].store(false, Ordering::Release);
            }
        }
    }
}

impl<T> std::fmt::Debug for BiasedMutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BiasedMutex").field("bias", &self.bias.load(Ordering::Relaxed)).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// One thread takes the lock over and over (biased after `REBIAS` takes, and again after
    /// each revocation) while two others take it now and then, revoking the bias. Two fields
    /// moved apart and back under the lock stay in step (a section another holder entered
    /// would see them differ, or lose an increment). Without the revoker's wait for `busy` it
    /// failed three runs of three here (`a_revoker_waits_for_the_biased_holder` fails every run);
    /// without the fence, rarely (a store buffer's window).
    #[test]
    fn biased_and_revoked_sections_exclude_each_other() {
        asym::init();
        let m = Arc::new(BiasedMutex::new((0u64, 0u64)));
        let stop = Arc::new(AtomicBool::new(false));
        let biased = Arc::new(AtomicU64::new(0));
        let section = |g: &mut BiasedGuard<'_, (u64, u64)>| {
            let a = g.0;
            g.0 = a + 1;
            // Long enough for another taker to overlap it (no `spin_loop`: a `pause` takes
            // some 140 cycles on recent Intel cores, and 1,024 such sections in a row must fit
            // between two revocations for the bias to come back).
            for _ in 0..50 {
                std::hint::black_box(&mut **g);
            }
            assert_eq!(g.1 + 1, g.0, "a torn section");
            g.1 += 1;
        };
        let revokers: Vec<_> = (0..2)
            .map(|_| {
                let (m, stop) = (m.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(std::time::Duration::from_millis(2));
                        section(&mut m.lock());
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let start = std::time::Instant::now();
        let mut mine = 0u64;
        while start.elapsed() < std::time::Duration::from_millis(400) {
            for _ in 0..256 {
                let mut g = m.lock();
                if m.held_biased() {
                    biased.fetch_add(1, Ordering::Relaxed);
                }
                section(&mut g);
                mine += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        let theirs: u64 = revokers.into_iter().map(|t| t.join().unwrap()).sum();
        let g = m.lock();
        assert_eq!((g.0, g.1), (mine + theirs, mine + theirs));
        if asym::fast() {
            assert!(biased.load(Ordering::Relaxed) > 0, "no section was taken the biased way");
        }
    }

    /// Four threads take the lock in bursts longer than `REBIAS`, so the bias passes from one
    /// to another, revoked each time, while former biased threads still try the fast way.
    /// Sections never overlap, and no thread is taken for one that holds the lock already.
    #[test]
    fn the_bias_passes_between_threads_taking_turns() {
        asym::init();
        let m = Arc::new(BiasedMutex::new((0u64, 0u64)));
        const BURST: u64 = REBIAS as u64 + 64;
        let start = std::time::Instant::now();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while start.elapsed() < std::time::Duration::from_millis(300) {
                        for _ in 0..BURST {
                            let mut g = m.lock();
                            g.0 += 1;
                            std::hint::black_box(&mut *g);
                            assert_eq!(g.1 + 1, g.0, "a torn section");
                            g.1 += 1;
                        }
                        n += BURST;
                        std::thread::yield_now();
                    }
                    n
                })
            })
            .collect();
        let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        let g = m.lock();
        assert_eq!((g.0, g.1), (total, total));
    }

    /// A thread that wants the lock while the biased thread holds it waits until the biased
    /// thread lets go (and then sees what it wrote).
    #[test]
    fn a_revoker_waits_for_the_biased_holder() {
        asym::init();
        if !asym::fast() {
            return;
        }
        let m = Arc::new(BiasedMutex::new(0u32));
        for _ in 0..REBIAS {
            *m.lock() += 1;
        }
        let released = Arc::new(AtomicBool::new(false));
        let mut g = m.lock();
        assert!(m.held_biased());
        let other = {
            let (m, released) = (m.clone(), released.clone());
            std::thread::spawn(move || {
                let g = m.lock();
                assert!(released.load(Ordering::Relaxed), "took the lock while the biased thread held it");
                *g
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        *g += 1;
        released.store(true, Ordering::Relaxed);
        drop(g);
        assert_eq!(other.join().unwrap(), REBIAS + 1);
        assert!(!m.biased_here(), "revoked");
    }

    /// A biased thread that takes the lock it holds panics (a `Mutex` would deadlock); it
    /// never holds the state twice, and the lock works after the unwind.
    #[test]
    fn a_biased_thread_taking_the_lock_again_panics() {
        asym::init();
        if !asym::fast() {
            return;
        }
        let m = BiasedMutex::new(0u32);
        for _ in 0..REBIAS {
            *m.lock() += 1;
        }
        assert!(m.biased_here());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _outer = m.lock();
            let _inner = m.lock();
        }));
        assert!(r.is_err());
        *m.lock() += 1;
        assert_eq!(*m.lock(), REBIAS + 1);
    }
}
