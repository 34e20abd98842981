//! What NCCL may still hold: a process-wide ledger of the live `ncclMemAlloc` segments and of the
//! device ranges that communicators have registered (segments through `ncclCommRegister`,
//! windows through `ncclCommWindowRegister`).
//!
//! [`NcclMemAllocator`](crate::NcclMemAllocator) frees a segment only through [`free_segment`],
//! which refuses while any hold overlaps it; the caching allocator then keeps the segment cached
//! and a later `empty_cache` tries again. A hold goes when its deregistration succeeds, or when
//! its communicator is destroyed or aborted successfully (NCCL then never reads or writes the
//! memory again on that communicator's behalf). A hold that is lost without
//! being released keeps its range out of `ncclMemFree` for the rest of the process: the safe way
//! to fail.
//!
//! Keys are device addresses, unique in the process's unified address space. Only this crate's
//! NCCL code writes the ledger; the `Registration` bookkeeping tested on simulated devices never
//! touches it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The communicator a hold belongs to: its holds go when it is destroyed or aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owner(u64);

impl Owner {
    pub(crate) fn fresh() -> Owner {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Owner(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// One held range, until [`release`]d or its owner is released. Dropping it does not release it.
#[derive(Debug)]
#[must_use = "a hold that is dropped keeps its range out of ncclMemFree for good; release it"]
pub(crate) struct Hold(u64);

struct Ledger {
    next: u64,
    /// id -> (owner, address, size).
    holds: BTreeMap<u64, (Owner, u64, usize)>,
    /// Live `ncclMemAlloc` segments: address -> size.
    segments: BTreeMap<u64, usize>,
}

static LEDGER: Mutex<Ledger> = Mutex::new(Ledger { next: 1, holds: BTreeMap::new(), segments: BTreeMap::new() });

fn ledger() -> MutexGuard<'static, Ledger> {
    // Nothing panics while it is held; a poisoned ledger is still the best record there is.
    LEDGER.lock().unwrap_or_else(|p| p.into_inner())
}

fn overlaps(a: u64, a_size: usize, b: u64, b_size: usize) -> bool {
    a < b.saturating_add(b_size as u64) && b < a.saturating_add(a_size as u64)
}

impl Ledger {
    fn within_segment(&self, addr: u64, size: usize) -> bool {
        self.segments
            .range(..=addr)
            .next_back()
            .is_some_and(|(&start, &len)| addr.saturating_add(size as u64) <= start.saturating_add(len as u64))
    }

    fn held(&self, addr: u64, size: usize) -> bool {
        self.holds.values().any(|&(_, a, s)| overlaps(a, s, addr, size))
    }
}

/// A segment `ncclMemAlloc` just returned.
pub(crate) fn add_segment(addr: u64, size: usize) {
    ledger().segments.insert(addr, size);
}

/// Whether `addr..addr+size` lies inside one live `ncclMemAlloc` segment.
pub(crate) fn within_segment(addr: u64, size: usize) -> bool {
    ledger().within_segment(addr, size)
}

/// Holds `addr..addr+size` for `owner` if it lies inside one live `ncclMemAlloc` segment (checked
/// and taken at once, so the segment cannot be freed in between).
pub(crate) fn hold_within_segment(owner: Owner, addr: u64, size: usize) -> Option<Hold> {
    let mut l = ledger();
    if !l.within_segment(addr, size) {
        return None;
    }
    let id = l.next;
    l.next += 1;
    l.holds.insert(id, (owner, addr, size));
    Some(Hold(id))
}

/// Gives a hold back.
pub(crate) fn release(h: Hold) {
    ledger().holds.remove(&h.0);
}

/// Gives back every hold of `owner` (its communicator is gone).
pub(crate) fn release_owner(owner: Owner) {
    ledger().holds.retain(|_, (o, _, _)| *o != owner);
}

/// Whether any hold overlaps `addr..addr+size`.
pub(crate) fn is_held(addr: u64, size: usize) -> bool {
    ledger().held(addr, size)
}

/// Frees the segment at `addr` through `free` unless a hold overlaps it. The check and the
/// segment's removal from the live set happen at once, so no registration or window can take
/// hold of it meanwhile; if `free` fails, the segment is live again.
pub(crate) fn free_segment<E>(
    addr: u64,
    size: usize,
    free: impl FnOnce() -> Result<(), E>,
) -> Result<(), FreeError<E>> {
    {
        let mut l = ledger();
        if l.held(addr, size) {
            return Err(FreeError::Held);
        }
        l.segments.remove(&addr);
    }
    free().map_err(|e| {
        add_segment(addr, size);
        FreeError::Free(e)
    })
}

/// Takes the physical allocation at `addr` off the live set unless a hold overlaps it (checked
/// and done in one step, as [`free_segment`] does); `false`: held, left live.
pub(crate) fn let_go_unless_held(addr: u64, size: usize) -> bool {
    let mut l = ledger();
    if l.held(addr, size) {
        return false;
    }
    l.segments.remove(&addr);
    true
}

/// A segment whose free failed half-way: no longer a live segment of ours (leaked).
pub(crate) fn forget_segment(addr: u64) {
    ledger().segments.remove(&addr);
}

/// Why [`free_segment`] did not free.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum FreeError<E> {
    /// A registration or window still holds part of the segment.
    Held,
    /// The free itself failed.
    Free(E),
}

#[cfg(test)]
mod tests {
    use super::*;

    // Addresses of their own (the ledger is process-wide; tests run in parallel).
    const BASE: u64 = 0x5a00_0000_0000;

    #[test]
    fn a_held_segment_is_not_freed_until_its_hold_goes() {
        let seg = BASE;
        add_segment(seg, 4 << 20);
        let owner = Owner::fresh();
        // A window inside the segment's second half.
        let h = hold_within_segment(owner, seg + (2 << 20), 2 << 20).expect("inside the segment");
        assert!(is_held(seg, 4 << 20));
        let mut freed = false;
        let r = free_segment(seg, 4 << 20, || -> Result<(), ()> {
            freed = true;
            Ok(())
        });
        assert_eq!(r, Err(FreeError::Held));
        assert!(!freed);
        assert!(within_segment(seg, 4 << 20), "a refused segment stays live");
        release(h);
        assert_eq!(free_segment(seg, 4 << 20, || -> Result<(), ()> { Ok(()) }), Ok(()));
        assert!(!within_segment(seg, 1), "a freed segment is no longer live");
        assert!(hold_within_segment(owner, seg, 1).is_none(), "nothing can take hold of freed memory");
    }

    #[test]
    fn a_failed_free_leaves_the_segment_live() {
        let seg = BASE + (1 << 30);
        add_segment(seg, 2 << 20);
        assert_eq!(free_segment(seg, 2 << 20, || Err("driver")), Err(FreeError::Free("driver")));
        assert!(within_segment(seg, 2 << 20));
        assert_eq!(free_segment(seg, 2 << 20, || -> Result<(), ()> { Ok(()) }), Ok(()));
    }

    #[test]
    fn releasing_an_owner_releases_all_its_holds_and_no_other() {
        let seg = BASE + (2 << 30);
        add_segment(seg, 8 << 20);
        let (a, b) = (Owner::fresh(), Owner::fresh());
        let _lost = hold_within_segment(a, seg, 2 << 20).unwrap();
        let _also = hold_within_segment(a, seg + (4 << 20), 2 << 20).unwrap();
        let hb = hold_within_segment(b, seg + (6 << 20), 2 << 20).unwrap();
        release_owner(a);
        assert!(!is_held(seg, 6 << 20));
        assert!(is_held(seg, 8 << 20), "b's hold stays");
        release(hb);
        assert!(!is_held(seg, 8 << 20));
        assert_eq!(free_segment(seg, 8 << 20, || -> Result<(), ()> { Ok(()) }), Ok(()));
    }

    #[test]
    fn ranges_outside_every_segment_are_refused() {
        let seg = BASE + (3 << 30);
        add_segment(seg, 2 << 20);
        let o = Owner::fresh();
        assert!(hold_within_segment(o, seg + (1 << 20), 2 << 20).is_none(), "runs past the segment's end");
        assert!(hold_within_segment(o, seg - 512, 1024).is_none(), "starts before it");
        release(hold_within_segment(o, seg, 2 << 20).unwrap());
        assert_eq!(free_segment(seg, 2 << 20, || -> Result<(), ()> { Ok(()) }), Ok(()));
    }
}
