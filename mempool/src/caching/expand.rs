//! Expandable segments: one reserved address range per (pool, stream, pool kind), memory mapped
//! into it on demand.
//!
//! A reservation holds no memory. When no free block fits a request, pages are mapped into it
//! (`plan_map`, then the backend's `map` outside the lock, then `finish_map`), where that costs
//! the fewest new bytes: right after a segment whose last block is free (the block grows into
//! the new pages, so only the difference is mapped), else at the lowest unmapped address. The
//! mapped ranges are ordinary segments of the state (`Segment::res` names the reservation): a
//! segment grows at its end when memory is mapped right after it, and is cut when memory inside
//! it is unmapped, so best fit, split and merge are the ordinary ones, and a block never spans
//! unmapped memory.
//!
//! Memory is mapped as physical allocations ("runs") of at most one chunk each (2 MiB for the
//! small pool, 20 MiB for the large one, as PyTorch maps them): `empty_cache`, the
//! out-of-memory ladder and garbage collection unmap every run that lies wholly in free blocks
//! (`unmap_free_runs`), after the hooks have seen its `SegmentUnmap` and the backend has
//! waited for the segment's stream. Runs a request mapped and did not take (its map failed
//! partway, or its pool was released meanwhile) are unmapped at once, or when the last graph
//! capture ends unless a graph holds their pool (`give_back_runs`). In a pool whose blocks
//! must not span two physical allocations (`merge_runs` off: NCCL before 2.29.2 registers one
//! physical allocation per buffer), each growth is one run and one segment of its own, and
//! segments never grow.
//!
//! Statistics: reserved bytes are mapped bytes; a map is a device allocation, an unmap a device
//! free; a segment is a contiguous mapped range (as snapshots show them). Oversize segments
//! are not counted for expandable memory.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::state::{Block, BlockIdx, SegIdx, SetKey, Slot, State, Work};
use crate::backend::Keep;
use crate::error::Error;
use crate::id::StreamRef;
use crate::snapshot::BlockState;
use crate::trace::Action;

/// The largest physical allocation of a growth, per pool kind, when blocks may span them.
const SMALL_CHUNK: usize = 2 << 20;
const LARGE_CHUNK: usize = 20 << 20;

/// One reserved address range.
#[derive(Debug)]
pub(crate) struct Reservation {
    pub(super) addr: u64,
    pub(super) size: usize,
    pub(super) key: SetKey,
    pub(super) stream: StreamRef,
    /// Holds the stream alive while the reservation exists (unmaps wait for it).
    pub(super) keep: Option<Keep>,
    /// Whether a block may span two physical allocations.
    pub(super) merge: bool,
    /// Mapped physical allocations: address → (size, handle).
    runs: BTreeMap<u64, (usize, u64)>,
    /// Ranges with nothing mapped and no map or unmap under way: address → size.
    free: BTreeMap<u64, usize>,
    /// Its live segments (contiguous mapped ranges): address → index.
    segs: BTreeMap<u64, SegIdx>,
    /// Maps and unmaps under way.
    busy: u32,
}

/// Where memory is to be mapped for a request (the range is taken out of the reservation's
/// free ranges until `finish_map` or `cancel_map`).
#[derive(Debug, Clone, Copy)]
pub(super) struct MapPlan {
    pub(super) res: u32,
    pub(super) addr: u64,
    pub(super) size: usize,
    /// The size of each physical allocation (the last may be smaller).
    pub(super) chunk: usize,
    /// What the request leaves free of the block the map makes (the free block before it
    /// included, when the map extends it).
    pub(super) spare: usize,
}

impl MapPlan {
    /// The physical allocations to make, in address order.
    pub(super) fn chunks(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        let end = self.addr + self.size as u64;
        std::iter::successors(Some(self.addr), move |&a| Some(a + self.chunk as u64))
            .take_while(move |&a| a < end)
            .map(move |a| (a, self.chunk.min((end - a) as usize)))
    }
}

/// A physical allocation taken out of its segment, to be unmapped outside the lock.
pub(crate) struct Unmapping {
    pub(super) res: u32,
    pub(super) addr: u64,
    pub(super) size: usize,
    pub(super) handle: u64,
    pub(super) slot: Slot,
    pub(super) small: bool,
    pub(super) stream: StreamRef,
    /// Holds the stream alive for the wait.
    pub(super) _keep: Option<Keep>,
    /// The pool's guard, asked first.
    pub(super) guard: Option<Arc<dyn crate::backend::MapGuard>>,
}

/// A reservation with nothing mapped, to be given back outside the lock.
#[derive(Debug)]
pub(crate) struct Unreserving {
    pub(super) addr: u64,
    pub(super) size: usize,
    pub(super) slot: Slot,
    pub(super) _keep: Option<Keep>,
}

fn insert_range(free: &mut BTreeMap<u64, usize>, mut addr: u64, mut size: usize) {
    if let Some((&a, &s)) = free.range(..addr).next_back() {
        if a + s as u64 == addr {
            free.remove(&a);
            addr = a;
            size += s;
        }
    }
    let end = addr + size as u64;
    if let Some(s) = free.remove(&end) {
        size += s;
    }
    free.insert(addr, size);
}

impl State {
    pub(super) fn res(&self, r: u32) -> &Reservation {
        self.reservations[r as usize].as_ref().expect("a live reservation")
    }

    fn res_mut(&mut self, r: u32) -> &mut Reservation {
        self.reservations[r as usize].as_mut().expect("a live reservation")
    }

    /// The last block of a segment.
    fn last_block(&self, seg: SegIdx) -> BlockIdx {
        let mut b = self.seg(seg).head.expect("a live segment has a block");
        while let Some(n) = self.block(b).next {
            b = n;
        }
        b
    }

    /// Where to map memory for a block of `rounded` bytes in the reservations of `key`: the
    /// place needing the fewest new bytes, then the lowest address. `None`: no reservation has
    /// room (a new one is needed).
    pub(super) fn plan_map(&mut self, key: SetKey, rounded: usize) -> Option<MapPlan> {
        let page = self.vm_page?;
        let whole = rounded.checked_next_multiple_of(page)?;
        // (bytes to map, where, reservation, start of the free range it comes from, the free
        // tail it extends)
        let mut best: Option<(usize, u64, u32, u64, usize)> = None;
        for (ri, r) in self.reservations.iter().enumerate() {
            let Some(r) = r.as_ref().filter(|r| r.key == key) else { continue };
            for (&at, &len) in &r.free {
                let (mut need, mut addr, mut tail) = (whole, at, 0);
                if r.merge {
                    let before = r.segs.range(..at).next_back().map(|(_, &s)| s);
                    if let Some(s) = before.filter(|&s| self.seg(s).addr + self.seg(s).size as u64 == at) {
                        let last = self.block(self.last_block(s));
                        if last.state == BlockState::Free {
                            if last.size < rounded {
                                need = (rounded - last.size).next_multiple_of(page);
                                tail = last.size;
                            } else {
                                // Big enough, yet best fit passed it over (`max_split_size`, or
                                // a block too large for a whole-block request): new memory must
                                // not merge into it. A page's gap keeps them apart.
                                addr = at + page as u64;
                            }
                        }
                    }
                }
                let room = len.saturating_sub((addr - at) as usize);
                if need <= room && best.is_none_or(|(n, a, _, _, _)| (need, addr) < (n, a)) {
                    best = Some((need, addr, ri as u32, at, tail));
                }
            }
        }
        let (size, addr, res, from, tail) = best?;
        let small = key.2;
        let r = self.res_mut(res);
        let len = r.free.remove(&from).expect("a free range");
        if addr > from {
            r.free.insert(from, (addr - from) as usize);
        }
        let end = from + len as u64;
        if addr + (size as u64) < end {
            r.free.insert(addr + size as u64, (end - addr) as usize - size);
        }
        r.busy += 1;
        let chunk = match (r.merge, small) {
            (false, _) => size,
            (true, true) => SMALL_CHUNK.max(page),
            (true, false) => LARGE_CHUNK.next_multiple_of(page),
        };
        Some(MapPlan { res, addr, size, chunk, spare: (tail + size).saturating_sub(rounded) })
    }

    /// A planned map that will not be made (over the memory limit).
    pub(super) fn cancel_map(&mut self, plan: &MapPlan) {
        let r = self.res_mut(plan.res);
        r.busy -= 1;
        insert_range(&mut r.free, plan.addr, plan.size);
        self.maybe_unreserve(plan.res);
    }

    /// A new reservation for `key`, with nothing mapped.
    pub(super) fn add_reservation(
        &mut self,
        addr: u64,
        size: usize,
        key: SetKey,
        stream: StreamRef,
        keep: Option<Keep>,
        merge: bool,
    ) {
        let r = Reservation {
            addr,
            size,
            key,
            stream,
            keep,
            merge,
            runs: BTreeMap::new(),
            free: BTreeMap::from([(addr, size)]),
            segs: BTreeMap::new(),
            busy: 0,
        };
        self.pools[key.0.get()].segments += 1;
        match self.reservations.iter().position(Option::is_none) {
            Some(i) => self.reservations[i] = Some(r),
            None => self.reservations.push(Some(r)),
        }
    }

    /// The planned map is done: `mapped` are the physical allocations made, a prefix of the
    /// plan's (the rest failed and goes back to the free ranges). The new memory joins the
    /// segment that ends where it starts (its last block grows if free), or becomes a segment.
    ///
    /// Returns the free block that holds the new memory (filed in its free set).
    pub(super) fn finish_map(&mut self, plan: &MapPlan, mapped: &[(u64, usize, u64)]) -> Option<BlockIdx> {
        let ok: usize = mapped.iter().map(|m| m.1).sum();
        let (key, stream, merge) = {
            let r = self.res_mut(plan.res);
            r.busy -= 1;
            if ok < plan.size {
                insert_range(&mut r.free, plan.addr + ok as u64, plan.size - ok);
            }
            for &(a, s, h) in mapped {
                r.runs.insert(a, (s, h));
            }
            (r.key, r.stream, r.merge)
        };
        let (slot, small) = (key.0, key.2);
        let id = self.pools[slot.get()].spec.id;
        for &(a, s, _) in mapped {
            self.stats.on_map(small, s, true);
            self.pools[slot.get()].stats.on_map(s, true);
            self.pools[slot.get()].segments += 1;
            if crate::trace::segments_wanted() {
                self.emit_entry(Action::SegmentMap, id, a, s, stream.raw);
            }
        }
        let block = (ok > 0).then(|| self.attach(plan.res, plan.addr, ok, key, merge));
        self.maybe_unreserve(plan.res);
        block
    }

    /// Newly mapped memory at `addr` becomes free blocks: the end of the segment just before it
    /// (if blocks may span physical allocations), or a segment of its own.
    fn attach(&mut self, res: u32, addr: u64, size: usize, key: SetKey, merge: bool) -> BlockIdx {
        let before = self.res(res).segs.range(..addr).next_back().map(|(_, &s)| s);
        let extend = before.filter(|&s| merge && self.seg(s).addr + self.seg(s).size as u64 == addr);
        let Some(seg) = extend else {
            let (stream, keep) = (self.res(res).stream, self.res(res).keep.clone());
            return self.new_range(res, addr, size, key, stream, keep);
        };
        self.segments[seg.0 as usize].size += size;
        let last = self.last_block(seg);
        if self.block(last).state == BlockState::Free {
            self.count_inactive(last, false);
            self.remove_free(last);
            self.block_mut(last).size += size;
            self.insert_free(last);
            self.count_inactive(last, true);
            last
        } else {
            let l = self.block(last);
            let (set, pool, small) = (l.set, l.pool, l.small);
            let b = self.new_block(Block {
                addr,
                size,
                requested: 0,
                seg,
                prev: Some(last),
                next: None,
                set,
                pool,
                small,
                state: BlockState::Free,
                has_uses: false,
                pending: 0,
                stack: 0,
                stack_epoch: 0,
            });
            self.block_mut(last).next = Some(b);
            self.insert_free(b);
            self.count_inactive(b, true);
            b
        }
    }

    /// A contiguous mapped range of reservation `res` becomes a segment: one free block, filed.
    fn new_range(
        &mut self,
        res: u32,
        addr: u64,
        size: usize,
        key: SetKey,
        stream: StreamRef,
        keep: Option<Keep>,
    ) -> BlockIdx {
        let b = self.link_segment(addr, size, key, stream, keep, Some(res));
        let seg = self.block(b).seg;
        self.segments[seg.0 as usize].freed_at = self.tick;
        self.res_mut(res).segs.insert(addr, seg);
        self.insert_free(b);
        self.count_range(key.0, key.2, true);
        b
    }

    /// Gives back the reservations of the pools `which` selects that have nothing mapped and
    /// nothing under way (one made for a request that then found a block another thread freed).
    pub(super) fn release_idle_reservations(&mut self, which: impl Fn(&super::state::PoolState) -> bool) {
        for r in 0..self.reservations.len() as u32 {
            let idle = self.reservations[r as usize].as_ref().is_some_and(|x| which(&self.pools[x.key.0.get()]));
            if idle {
                self.maybe_unreserve(r);
            }
        }
    }

    fn count_range(&mut self, slot: Slot, small: bool, added: bool) {
        self.stats.on_range(small, added);
        self.pools[slot.get()].stats.on_range(added);
    }

    /// For best fit, PyTorch's rule: a free block at the end of an expandable segment, with
    /// unmapped address space after it, counts as big as it can grow (its size plus that run);
    /// 0 for any other block (it counts as its size).
    #[inline(always)]
    pub(super) fn unmapped_after(&self, b: BlockIdx) -> usize {
        let blk = self.block(b);
        if blk.next.is_some() {
            return 0;
        }
        self.unmapped_after_last(blk.seg)
    }

    /// [`unmapped_after`](Self::unmapped_after) for the last block of segment `seg` (a call of
    /// its own: only the segment's last block looks at the reservation).
    #[inline(never)]
    fn unmapped_after_last(&self, seg: super::state::SegIdx) -> usize {
        let s = self.seg(seg);
        let Some(res) = s.res else { return 0 };
        let r = self.res(res);
        if !r.merge {
            return 0;
        }
        r.free.get(&(s.addr + s.size as u64)).copied().unwrap_or(0)
    }

    /// The physical allocations `(address, size)` of segment `seg`, in address order (none for a
    /// segment that is not expandable).
    /// The physical allocations of reservation `res` covering `start..end`: (address, size,
    /// handle), in address order.
    pub(crate) fn runs_covering(&self, res: u32, start: u64, end: u64) -> Vec<(u64, usize, u64)> {
        let runs = &self.res(res).runs;
        // The run holding `start` (runs tile the mapped part of a segment), then the rest.
        let first = runs.range(..=start).next_back().map_or(start, |(&a, _)| a);
        runs.range(first..end).map(|(&a, &(sz, h))| (a, sz, h)).collect()
    }

    pub(crate) fn mappings_of(&self, seg: SegIdx) -> Vec<(u64, usize)> {
        let s = self.seg(seg);
        let Some(res) = s.res else { return Vec::new() };
        let end = s.addr + s.size as u64;
        self.res(res).runs.range(s.addr..end).map(|(&a, &(sz, _))| (a, sz)).collect()
    }

    /// Takes every physical allocation of segment `seg`'s range that lies wholly in one free
    /// block out of it (cutting the segment) and queues its unmap.
    pub(super) fn unmap_free_runs(&mut self, seg: SegIdx) {
        let s = self.seg(seg);
        let Some(res) = s.res.filter(|_| s.live) else { return };
        let (start, end) = (s.addr, s.addr + s.size as u64);
        let runs: Vec<(u64, usize, u64)> =
            self.res(res).runs.range(start..end).map(|(&a, &(sz, h))| (a, sz, h)).collect();
        self.unmap_runs(res, &runs);
    }

    /// Takes each of `runs` (physical allocations of reservation `res`: address, size, handle)
    /// that is still mapped and lies wholly in one free block out of its segment and queues
    /// its unmap; the others stay. Besides [`unmap_free_runs`](Self::unmap_free_runs), for
    /// memory a request mapped and did not take (its map failed partway, or its pool went
    /// meanwhile; see [`give_back_runs`](Self::give_back_runs)).
    pub(super) fn unmap_runs(&mut self, res: u32, runs: &[(u64, usize, u64)]) {
        for &(a, size, handle) in runs {
            // Still this mapping (a run given back during a capture waits for its end, and may
            // have been unmapped, or its reservation given back, by then).
            let live = self.reservations.get(res as usize).and_then(Option::as_ref);
            if live.and_then(|r| r.runs.get(&a)) != Some(&(size, handle)) {
                continue;
            }
            let r = self.res(res);
            let Some((_, &seg)) = r.segs.range(..=a).next_back() else { continue };
            let run_end = a + size as u64;
            let mut b = self.seg(seg).head;
            while let Some(i) = b.filter(|&i| self.block(i).addr + self.block(i).size as u64 <= a) {
                b = self.block(i).next;
            }
            let Some(f) = b else { continue };
            let blk = self.block(f);
            if blk.state != BlockState::Free || blk.addr > a || blk.addr + (blk.size as u64) < run_end {
                continue;
            }
            self.cut(seg, f, a, size);
            let r = self.res_mut(res);
            r.runs.remove(&a);
            r.busy += 1;
            let (key, stream, keep) = (r.key, r.stream, r.keep.clone());
            let (slot, small) = (key.0, key.2);
            self.stats.on_map(small, size, false);
            self.pools[slot.get()].stats.on_map(size, false);
            self.releasing += size;
            if crate::trace::segments_wanted() {
                let id = self.pools[slot.get()].spec.id;
                self.emit_entry(Action::SegmentUnmap, id, a, size, stream.raw);
            }
            let guard = self.pools[slot.get()].spec.map_guard.clone();
            self.outbox.push(Work::Unmap(Unmapping {
                res,
                addr: a,
                size,
                handle,
                slot,
                small,
                stream,
                _keep: keep,
                guard,
            }));
        }
    }

    /// Runs a request mapped and did not take go back: at once, or, during a graph capture
    /// (when nothing may be unmapped, and a cut segment would leave memory mapped outside every
    /// segment until the capture ends), when the last capture ends, if still free then and no
    /// graph holds the pool.
    pub(super) fn give_back_runs(&mut self, res: u32, runs: &[(u64, usize, u64)]) {
        if self.captures.is_empty() {
            self.unmap_runs(res, runs);
        } else {
            self.unmap_after_capture.extend(runs.iter().map(|&(a, s, h)| (res, a, s, h)));
        }
    }

    /// The last capture ended: the runs [`give_back_runs`](Self::give_back_runs) kept for it,
    /// except those of a pool a graph now holds (a capture may have used the run for a
    /// temporary, which every replay writes: `empty_cache` or the pool's release gives them
    /// back once no graph holds the pool, as its other memory).
    pub(super) fn give_back_runs_after_capture(&mut self) {
        for (res, a, s, h) in std::mem::take(&mut self.unmap_after_capture) {
            let Some(r) = self.reservations.get(res as usize).and_then(Option::as_ref) else { continue };
            if self.pools[r.key.0.get()].pinned > 0 {
                continue;
            }
            self.unmap_runs(res, &[(a, s, h)]);
        }
    }

    /// Takes `addr..addr + size` out of the free block `f` of segment `seg`: the pieces of `f`
    /// before and after stay free, and the segment becomes the part before the hole and, if
    /// anything follows it, a new segment after.
    fn cut(&mut self, seg: SegIdx, f: BlockIdx, addr: u64, size: usize) {
        self.count_inactive(f, false);
        self.remove_free(f);
        let end = addr + size as u64;
        let blk = self.block(f);
        let (f_addr, f_end, prev, next) = (blk.addr, blk.addr + blk.size as u64, blk.prev, blk.next);
        let (set, pool, small) = (blk.set, blk.pool, blk.small);
        // The piece after the hole, if any (`rest`), and what starts the part after it.
        let rest = if end < f_end {
            let r = self.new_block(Block {
                addr: end,
                size: (f_end - end) as usize,
                requested: 0,
                seg,
                prev: None,
                next,
                set,
                pool,
                small,
                state: BlockState::Free,
                has_uses: false,
                pending: 0,
                stack: 0,
                stack_epoch: 0,
            });
            if let Some(n) = next {
                self.block_mut(n).prev = Some(r);
            }
            Some(r)
        } else {
            if let Some(n) = next {
                self.block_mut(n).prev = None;
            }
            None
        };
        let after = rest.or(next);
        let kept = f_addr < addr;
        let before = if kept {
            let b = self.block_mut(f);
            b.size = (addr - f_addr) as usize;
            b.next = None;
            Some(f)
        } else {
            if let Some(p) = prev {
                self.block_mut(p).next = None;
            }
            self.free_blocks.push(f);
            prev
        };
        let s = &self.segments[seg.0 as usize];
        let (s_addr, s_end, res) = (s.addr, s.addr + s.size as u64, s.res.expect("an expandable segment"));
        match (before, after) {
            (None, None) => {
                let s = &mut self.segments[seg.0 as usize];
                s.live = false;
                s.head = None;
                s.keep = None;
                self.res_mut(res).segs.remove(&s_addr);
                self.free_segments.push(seg);
                self.drop_from_set(set);
                self.count_range(pool, small, false);
            }
            (Some(_), None) => self.segments[seg.0 as usize].size = (addr - s_addr) as usize,
            (None, Some(h)) => {
                let s = &mut self.segments[seg.0 as usize];
                s.addr = end;
                s.size = (s_end - end) as usize;
                s.head = Some(h);
                let r = self.res_mut(res);
                r.segs.remove(&s_addr);
                r.segs.insert(end, seg);
            }
            (Some(_), Some(h)) => {
                self.segments[seg.0 as usize].size = (addr - s_addr) as usize;
                let (stream, keep, freed_at) = {
                    let s = &self.segments[seg.0 as usize];
                    (s.stream, s.keep.clone(), s.freed_at)
                };
                let new = super::state::Segment {
                    addr: end,
                    size: (s_end - end) as usize,
                    stream,
                    keep,
                    pool,
                    small,
                    head: Some(h),
                    freed_at,
                    live: true,
                    res: Some(res),
                };
                let idx = match self.free_segments.pop() {
                    Some(i) => {
                        self.segments[i.0 as usize] = new;
                        i
                    }
                    None => {
                        self.segments.push(new);
                        SegIdx((self.segments.len() - 1) as u32)
                    }
                };
                let mut b = Some(h);
                while let Some(i) = b {
                    self.block_mut(i).seg = idx;
                    b = self.block(i).next;
                }
                self.set_segments[set.0 as usize] += 1;
                self.res_mut(res).segs.insert(end, idx);
                self.count_range(pool, small, true);
            }
        }
        for p in [kept.then_some(f), rest].into_iter().flatten() {
            self.insert_free(p);
            self.count_inactive(p, true);
        }
    }

    /// One segment fewer in `set`: an emptied set is retired.
    fn drop_from_set(&mut self, set: super::state::SetIdx) {
        self.set_segments[set.0 as usize] -= 1;
        if self.set_segments[set.0 as usize] == 0 {
            self.retire_set(set);
        }
    }

    /// An unmap is done (`Ok`), or failed: the memory is still mapped, and comes back as a
    /// segment of its own (announced to the hooks again: they saw it go).
    ///
    /// A refusal of the pool's `MapGuard` (`veto`) is the guard's normal answer, not a device
    /// failure: it is kept for the `empty_cache` that asks next, never handed to an allocation.
    pub(super) fn unmapped(&mut self, u: Unmapping, result: Result<(), String>, veto: bool) {
        self.releasing -= u.size;
        let r = self.res_mut(u.res);
        r.busy -= 1;
        match result {
            Ok(()) => {
                insert_range(&mut r.free, u.addr, u.size);
                self.pools[u.slot.get()].segments -= 1;
            }
            Err(m) => {
                r.runs.insert(u.addr, (u.size, u.handle));
                let key = r.key;
                let e = Error::backend("unmap", format!("{m} ({} bytes at {:#x})", u.size, u.addr));
                if veto {
                    self.vetoed.get_or_insert(e);
                } else {
                    self.error.get_or_insert(e);
                }
                self.stats.on_map_restored(u.small, u.size);
                self.pools[u.slot.get()].stats.on_map_restored(u.size);
                if crate::trace::segments_wanted() {
                    let id = self.pools[u.slot.get()].spec.id;
                    self.emit_entry(Action::SegmentMap, id, u.addr, u.size, u.stream.raw);
                }
                // A segment of its own (blocks may join it only as it grows at its end).
                let (stream, keep) = (self.res(u.res).stream, self.res(u.res).keep.clone());
                let _ = self.new_range(u.res, u.addr, u.size, key, stream, keep);
            }
        }
        self.maybe_unreserve(u.res);
        self.retire_pool_if_empty(u.slot);
    }

    /// A reservation with nothing mapped and nothing under way is given back when its pool is
    /// released, or when it was emptied (by `empty_cache` and the like: the next growth makes
    /// a new one).
    fn maybe_unreserve(&mut self, res: u32) {
        let r = self.res(res);
        if !(r.runs.is_empty() && r.segs.is_empty() && r.busy == 0) {
            return;
        }
        let r = self.reservations[res as usize].take().expect("a live reservation");
        self.outbox.push(Work::Unreserve(Unreserving { addr: r.addr, size: r.size, slot: r.key.0, _keep: r.keep }));
    }

    /// A reservation is given back (or could not be: it is forgotten all the same, with the
    /// error kept; nothing is mapped in it).
    pub(super) fn unreserved(&mut self, u: &Unreserving, result: Result<(), String>) {
        if let Err(m) = result {
            self.error.get_or_insert(Error::backend(
                "address reservation free",
                format!("{m} ({} bytes at {:#x})", u.size, u.addr),
            ));
        }
        self.pools[u.slot.get()].segments -= 1;
        self.retire_pool_if_empty(u.slot);
    }
}
