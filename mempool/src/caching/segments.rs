//! Segments: taking a new one into the cache, giving wholly free ones back (to the outbox),
//! garbage collection, the out-of-memory report, and retiring released pools.

use super::state::{Block, Released, SegIdx, Segment, SetKey, Slot, Source, State, Work};
use crate::backend::{Backend, Keep};
use crate::error::{Error, OomReport};
use crate::id::{PoolId, StreamRef};
use crate::snapshot::BlockState;
use crate::trace::Action;

impl State {
    /// The segment size for a block of `rounded` bytes in `pool`; `None` if rounding up to the
    /// pool's granularity would overflow.
    pub(super) fn segment_size_for(&self, pool: Slot, rounded: usize) -> Option<usize> {
        let spec = &self.pools[pool.get()].spec;
        let size = if spec.no_split { rounded } else { crate::rules::segment_size(rounded) };
        // No block may pass the largest size the free sets hold, so neither may a segment.
        size.checked_next_multiple_of(spec.granularity).filter(|&s| s <= crate::rules::MAX_BLOCK)
    }

    /// Whether `size` more bytes fit under the memory-fraction limit, counting what other threads
    /// are obtaining right now and what is on its way back.
    pub(super) fn within_limit(&self, size: usize) -> bool {
        self.limit.is_none_or(|limit| {
            let reserved = self.stats.reserved_bytes.current() as usize + self.releasing;
            reserved.saturating_add(self.growing()).saturating_add(size) <= limit
        })
    }

    /// Whether the memory-fraction limit refuses `size` more bytes only because of the growths
    /// under way (without them they would fit).
    pub(super) fn limited_by_growth(&self, size: usize) -> bool {
        self.limit.is_some_and(|limit| {
            let reserved = (self.stats.reserved_bytes.current() as usize + self.releasing).saturating_add(size);
            reserved <= limit && reserved.saturating_add(self.growing()) > limit
        })
    }

    /// Takes a new segment into the cache as one free block in `set`, and tells the hooks.
    pub(super) fn insert_segment(
        &mut self,
        addr: u64,
        size: usize,
        (pool, _, small): SetKey,
        stream: StreamRef,
        keep: Option<Keep>,
        fresh: bool,
    ) -> super::state::BlockIdx {
        let block = self.link_segment(addr, size, (pool, stream.key, small), stream, keep, None);
        self.count_segment(pool, small, size, true, fresh);
        if fresh {
            self.pools[pool.get()].segments += 1;
        }
        if crate::trace::segments_wanted() {
            self.emit(Action::SegmentAlloc, block);
        }
        block
    }

    /// Adds a segment to the table as one free block (not yet in its free set), uncounted.
    pub(super) fn link_segment(
        &mut self,
        addr: u64,
        size: usize,
        (pool, _, small): SetKey,
        stream: StreamRef,
        keep: Option<Keep>,
        res: Option<u32>,
    ) -> super::state::BlockIdx {
        let set = self.set_for(pool, stream.key, small);
        let seg = Segment { addr, size, stream, keep, pool, small, head: None, freed_at: 0, live: true, res };
        let seg_idx = match self.free_segments.pop() {
            Some(i) => {
                self.segments[i.0 as usize] = seg;
                i
            }
            None => {
                self.segments.push(seg);
                SegIdx((self.segments.len() - 1) as u32)
            }
        };
        let block = self.new_block(Block {
            addr,
            size,
            requested: 0,
            seg: seg_idx,
            prev: None,
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
        self.segments[seg_idx.0 as usize].head = Some(block);
        self.set_segments[set.0 as usize] += 1;
        block
    }

    /// Gives back a wholly free segment: an ordinary one to its source, the mapped range of an
    /// expandable one unmapped.
    pub(super) fn release_whole(&mut self, seg: SegIdx) {
        // No memory goes back during a graph capture; `end_capture` catches up. The reserve
        // segment stays until the allocator is dropped.
        if !self.captures.is_empty() || self.kept(seg.0 as usize) {
            return;
        }
        if self.segments[seg.0 as usize].res.is_some() {
            self.unmap_free_runs(seg);
        } else {
            self.release_segment(seg);
        }
    }

    /// Takes a wholly free segment out of the cache and queues it to be given back through its
    /// pool's free function (or the backend), after the hooks have seen its `SegmentFree`.
    pub(super) fn release_segment(&mut self, seg: SegIdx) {
        let s = &mut self.segments[seg.0 as usize];
        let head = s.head.take().expect("a live segment has a block");
        s.live = false;
        let (addr, size, small, pool, stream, keep) = (s.addr, s.size, s.small, s.pool, s.stream, s.keep.take());
        if crate::trace::segments_wanted() {
            let id = self.pools[pool.get()].spec.id;
            self.emit_entry(Action::SegmentFree, id, addr, size, stream.raw);
        }
        let set = self.block(head).set;
        self.remove_free(head);
        self.free_blocks.push(head);
        self.free_segments.push(seg);
        self.set_segments[set.0 as usize] -= 1;
        if self.set_segments[set.0 as usize] == 0 {
            self.retire_set(set);
        }
        // The pool keeps counting the segment (and so stays live) until its free is done.
        self.count_segment(pool, small, size, false, true);
        let spec = &self.pools[pool.get()].spec;
        let source = match &spec.raw {
            Some(raw) => Source::Pool(raw.clone()),
            None => Source::Backend,
        };
        self.releasing += size;
        let pool_name = spec.name.clone();
        let r = Released { addr, size, small, slot: pool, pool: spec.id, pool_name, stream, _keep: keep, source };
        self.outbox.push(Work::Free(r));
    }

    /// A segment is back with its allocator: its pool stops counting it.
    pub(super) fn freed(&mut self, r: &Released) {
        self.releasing -= r.size;
        self.pools[r.slot.get()].segments -= 1;
        self.retire_pool_if_empty(r.slot);
    }

    /// A segment whose free failed goes back into its pool's cache as a free segment (announced
    /// to the hooks again: they saw it go), counted as reserved; its error is kept, and a later
    /// `empty_cache` tries again.
    pub(super) fn free_failed(&mut self, r: Released, message: String) {
        self.releasing -= r.size;
        self.error.get_or_insert(match &r.source {
            Source::Pool(_) => Error::PoolAllocator {
                pool: r.pool.0,
                allocator: r.pool_name.clone(),
                message: format!("free of segment {:#x} ({} bytes) failed: {message}", r.addr, r.size),
            },
            Source::Backend => {
                Error::backend("segment free", format!("{message} (segment {:#x}, {} bytes)", r.addr, r.size))
            }
        });
        let Released { addr, size, slot, small, stream, _keep, source, .. } = r;
        let block = self.insert_segment(addr, size, (slot, stream.key, small), stream, _keep, false);
        // The segment's pool holds its allocator; this reference goes outside the lock.
        self.outbox.push(Work::Drop(Box::new(source)));
        self.insert_free(block);
        let seg = self.block(block).seg;
        self.segments[seg.0 as usize].freed_at = self.tick;
    }

    /// Counts a segment obtained (`added`) or given back, for the device and its pool; a segment
    /// back after a refused free (`added`, not `device_call`) only undoes its earlier release.
    pub(super) fn count_segment(&mut self, pool: Slot, small: bool, size: usize, added: bool, device_call: bool) {
        let oversize = size >= self.config.max_split_size;
        if added && !device_call {
            self.stats.on_segment_restored(small, size, oversize);
            self.pools[pool.get()].stats.on_segment_restored(size);
            return;
        }
        self.stats.on_segment(small, size, oversize, added, device_call);
        self.pools[pool.get()].stats.on_segment(size, added, device_call);
    }

    /// Gives back every wholly free segment of the pools `which` selects.
    pub(super) fn release_cached(&mut self, which: impl Fn(&super::state::PoolState) -> bool) {
        if !self.captures.is_empty() {
            return;
        }
        for seg in 0..self.segments.len() {
            let s = &self.segments[seg];
            if !s.live || self.pools[s.pool.get()].pinned > 0 || self.kept(seg) || !which(&self.pools[s.pool.get()]) {
                continue;
            }
            if s.res.is_some() {
                // Every physical allocation of it that lies in free blocks (cutting the
                // segment; the pieces left are handled as they come: new ones go at the end).
                self.unmap_free_runs(SegIdx(seg as u32));
            } else if self.wholly_free(seg) {
                self.release_segment(SegIdx(seg as u32));
            }
        }
        self.release_idle_reservations(&which);
        for slot in 1..self.pools.len() as u32 {
            self.retire_pool_if_empty(Slot(slot));
        }
    }

    /// The pool's last handle is gone: its wholly free segments go back now, the others as soon
    /// as they become wholly free.
    pub(super) fn release_pool(&mut self, be: &dyn Backend, slot: Slot, id: PoolId) {
        let p = &mut self.pools[slot.get()];
        if !p.live || p.spec.id != id {
            return;
        }
        p.released = true;
        if !self.pending.is_empty() {
            self.process_events(be);
        }
        self.release_cached(|p| p.spec.id == id);
        self.retire_pool_if_empty(slot);
    }

    /// Frees a released pool's slot once its last segment is gone.
    pub(super) fn retire_pool_if_empty(&mut self, slot: Slot) {
        let p = &mut self.pools[slot.get()];
        if slot != Slot::DEFAULT && p.live && p.released && p.segments == 0 {
            p.live = false;
            // Its allocator's `Drop` is user code: let go of it outside the lock.
            if let Some(raw) = p.spec.raw.take() {
                self.outbox.push(Work::Drop(Box::new(raw)));
            }
            if let Some(guard) = p.spec.map_guard.take() {
                self.outbox.push(Work::Drop(Box::new(guard)));
            }
            // Sets it made but never filled (a request that found no memory).
            let empty: Vec<_> = self.set_index.iter().filter(|(k, _)| k.0 == slot).map(|(_, i)| *i).collect();
            for set in empty {
                self.retire_set(set);
            }
        }
    }

    /// A free set with no segment left (its pool's or stream's last one went back) is empty:
    /// kept for reuse, and forgotten by its (pool, stream), so that streams and pools that come
    /// and go do not grow the table.
    pub(super) fn retire_set(&mut self, set: super::state::SetIdx) {
        // Only a set that is in use: a set looked up before the lock was let go may have been
        // retired meanwhile, and a set twice in `idle_sets` would serve two streams.
        let before = self.set_index.len();
        self.set_index.retain(|_, i| *i != set);
        if self.set_index.len() == before {
            return;
        }
        debug_assert_eq!(self.set_segments[set.0 as usize], 0, "retiring a set with segments");
        self.idle_sets.push(set);
        self.last_set = None;
    }

    /// A free block of a `use_on_oom` pool for a default-pool request (it stays in its pool).
    pub(super) fn borrow_from_pools(
        &mut self,
        stream: crate::id::StreamKey,
        small: bool,
        rounded: usize,
    ) -> Option<super::state::BlockIdx> {
        let lenders: Vec<Slot> = (1..self.pools.len() as u32)
            .map(Slot)
            .filter(|&p| {
                let p = &self.pools[p.get()];
                // A pool a graph holds lends nothing: its free blocks are where replays write.
                p.live && !p.released && p.spec.use_on_oom && p.pinned == 0
            })
            .collect();
        for p in lenders {
            if let Some(&set) = self.set_index.get(&(p, stream, small)) {
                if let Some(b) = self.best_fit(set, rounded, self.no_split(p)) {
                    return Some(b);
                }
            }
        }
        None
    }

    /// Counts an out-of-memory failure, tells the hooks and builds the report (its allocation
    /// sites are named once the lock is let go, from [`PENDING_SITES`]).
    pub(super) fn oom(&mut self, be: &dyn Backend, requested: usize, pool: Slot) -> Error {
        self.stats.num_ooms += 1;
        self.pools[pool.get()].stats.num_ooms += 1;
        let id = self.pools[pool.get()].spec.id;
        if crate::trace::oom_wanted() {
            self.emit_entry(Action::Oom, id, 0, requested, crate::id::StreamId(0));
        }
        let stacks = self.top_stacks();
        PENDING_SITES.with(|p| *p.borrow_mut() = stacks);
        let (free, total) = be.memory_info().unzip();
        let spec = &self.pools[pool.get()].spec;
        Error::OutOfMemory(Box::new(OomReport {
            device: be.device(),
            backend: be.kind(),
            requested,
            device_total: total,
            device_free: free,
            // Summed over threads once the lock is let go (`DeviceAllocator::completed_report`).
            allocated: 0,
            reserved: self.stats.reserved_bytes.current() as usize,
            limit: self.limit,
            pool: (pool != Slot::DEFAULT).then(|| (spec.id.0, spec.name.clone())),
            during_capture: !self.captures.is_empty(),
            // Resolved outside the lock (`completed_report`): symbols can take long the first time.
            sites: Vec::new(),
        }))
    }

    /// The stacks of the live blocks holding the most bytes (while stacks are recorded), summed
    /// per stack under the lock; their symbols are resolved once the lock is let go
    /// (`DeviceAllocator::completed_report`, through [`PENDING_SITES`]).
    fn top_stacks(&self) -> Vec<(crate::stacks::StackId, usize)> {
        if !crate::stacks::on() {
            return Vec::new();
        }
        let mut by: std::collections::HashMap<crate::stacks::StackId, usize> = std::collections::HashMap::new();
        for s in self.segments.iter().filter(|s| s.live) {
            for b in self.blocks_of(s) {
                if b.state == crate::snapshot::BlockState::Allocated && crate::stacks::current(b.stack, b.stack_epoch) {
                    let n = by.entry(b.stack).or_default();
                    *n = n.saturating_add(b.size);
                }
            }
        }
        let mut stacks: Vec<(crate::stacks::StackId, usize)> = by.into_iter().collect();
        stacks.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        stacks.truncate(64);
        stacks
    }

    pub(super) fn alloc_failed(&self, pool: Slot, e: crate::BackendError) -> Error {
        let spec = &self.pools[pool.get()].spec;
        match spec.raw {
            Some(_) => Error::PoolAllocator { pool: spec.id.0, allocator: spec.name.clone(), message: e.to_string() },
            None => e.into_error("segment allocation"),
        }
    }

    /// With `garbage_collection_threshold` set: once reserved memory passes that fraction of the
    /// limit, gives back wholly free segments that have been free at least as long as the average
    /// one, oldest first, until reserved memory is back under the threshold.
    pub(super) fn garbage_collect(&mut self) {
        // As `empty_cache`: the default pools and released pools; live user pools keep their
        // cache (they may be registered with NCCL, and have their own `empty_cache`).
        let Some(limit) = self.limit else { return };
        if !self.captures.is_empty() {
            return;
        }
        let threshold = (self.config.garbage_collection_threshold * limit as f64) as usize;
        let reserved = |st: &State| st.stats.reserved_bytes.current() as usize;
        if reserved(self) <= threshold {
            return;
        }
        let mut free: Vec<(u64, u32)> = (0..self.segments.len())
            .filter(|&s| self.wholly_free(s) && !self.kept(s))
            .filter(|&s| {
                let p = &self.pools[self.segments[s].pool.get()];
                p.spec.id == PoolId::DEFAULT || p.released
            })
            .map(|s| (self.segments[s].freed_at, s as u32))
            .collect();
        if free.is_empty() {
            return;
        }
        let avg_age = free.iter().map(|(t, _)| self.tick - t).sum::<u64>() / free.len() as u64;
        free.sort_unstable();
        for (t, seg) in free {
            if reserved(self) <= threshold {
                break;
            }
            if self.tick - t >= avg_age {
                self.release_whole(SegIdx(seg));
            }
        }
    }
}

thread_local! {
    /// The stacks the last out-of-memory report of this thread found under the lock, for
    /// `completed_report` to resolve into sites after it.
    pub(super) static PENDING_SITES: std::cell::RefCell<Vec<(crate::stacks::StackId, usize)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// The allocation sites of `stacks` (largest first, stacks of one site summed), at most `n`.
pub(super) fn sites_of(stacks: Vec<(crate::stacks::StackId, usize)>, n: usize) -> Vec<(String, usize)> {
    let mut sites: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for (id, bytes) in stacks {
        let site = crate::stacks::site(id).unwrap_or_else(|| "(unknown)".into());
        let s = sites.entry(site).or_default();
        *s = s.saturating_add(bytes);
    }
    let mut out: Vec<(String, usize)> = sites.into_iter().collect();
    out.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    out.truncate(n);
    out
}
