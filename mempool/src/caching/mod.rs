//! The caching algorithm: blocks, segments, free sets, splitting, merging, deferred frees.
//!
//! Safe code only; every device action goes through a [`Backend`].
//!
//! Blocks live in a slab and are named by their index, so a [`Buffer`](crate::Buffer) frees its
//! block without a pointer lookup. Free blocks sit in one ordered set per (pool, stream, small or
//! large), ordered by size then address, so the best fit is the first block at or above the
//! requested size.

mod freeset;
pub(crate) mod rounding;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::{Backend, BackendError, EventId, StreamId};
use crate::config::Config;
use crate::error::{Error, OomReport, Result};
use crate::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot, Snapshot};
use crate::stats::{Counters, MemoryStats};
use freeset::{key, key_idx, FreeSet};
use rounding::{is_small, round_size, segment_size, should_split};

/// Identifies a memory pool of a device. [`PoolId::DEFAULT`] is the default caching pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PoolId(pub u64);

impl PoolId {
    /// The device's default pools (small and large).
    pub const DEFAULT: PoolId = PoolId(0);
}

const NONE: u32 = u32::MAX;

/// A multiply-rotate hasher for the small integer keys of the allocator's maps: SipHash's
/// resistance to crafted keys buys nothing here and costs a third of an allocation.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }
}

type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[derive(Debug)]
struct Block {
    addr: u64,
    size: usize,
    requested: usize,
    seg: u32,
    prev: u32,
    next: u32,
    state: BlockState,
    /// Its segment's free set and whether the segment is small (copies, so the hot path needs no
    /// segment lookup).
    set: u32,
    small: bool,
    /// Whether `State::uses` lists other streams that used it.
    has_uses: bool,
    /// Events still to complete before the block is free.
    pending: u32,
}

impl Block {
    fn is_split(&self) -> bool {
        self.prev != NONE || self.next != NONE
    }
}

#[derive(Debug)]
struct Segment {
    addr: u64,
    size: usize,
    stream: StreamId,
    pool: PoolId,
    small: bool,
    head: u32,
    /// The allocation tick at which the segment last became wholly free (for garbage collection).
    freed_at: u64,
    live: bool,
}

type SetKey = (PoolId, StreamId, bool);

/// Largest block size the packed free-set key holds (1 TiB); larger requests are refused up front.
pub(crate) const MAX_BLOCK: usize = (1 << 40) - 1;

/// Everything behind the allocator's lock.
#[derive(Debug)]
struct State {
    config: Config,
    limit: Option<usize>,
    blocks: Vec<Block>,
    free_blocks: Vec<u32>,
    segments: Vec<Segment>,
    free_segments: Vec<u32>,
    sets: Vec<FreeSet>,
    set_index: IdMap<SetKey, u32>,
    /// The set of the last allocation: most programs allocate on one stream at a time.
    last_set: (SetKey, u32),
    pending: Vec<(EventId, u32)>,
    raw: IdMap<u64, u32>,
    /// Streams other than its segment's that used a block (only blocks with `has_uses`).
    uses: IdMap<u32, Vec<StreamId>>,
    stats: Counters,
    tick: u64,
    error: Option<Error>,
}

/// The caching allocator of one device, over any [`Backend`].
pub(crate) struct DeviceAllocator {
    backend: Arc<dyn Backend>,
    state: Mutex<State>,
}

/// A block handed out by [`DeviceAllocator::malloc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Allocation {
    pub(crate) block: u32,
    pub(crate) addr: u64,
}

impl DeviceAllocator {
    pub(crate) fn new(backend: Arc<dyn Backend>, config: Config) -> DeviceAllocator {
        let limit = limit_for(&*backend, config.memory_fraction);
        let stats = Counters::default();
        DeviceAllocator {
            backend,
            state: Mutex::new(State {
                config,
                limit,
                blocks: Vec::new(),
                free_blocks: Vec::new(),
                segments: Vec::new(),
                free_segments: Vec::new(),
                sets: Vec::new(),
                set_index: IdMap::default(),
                last_set: ((PoolId(u64::MAX), StreamId(u64::MAX), false), 0),
                pending: Vec::new(),
                raw: IdMap::default(),
                uses: IdMap::default(),
                stats,
                tick: 0,
                error: None,
            }),
        }
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held is a bug in this module; the state is still the best
        // there is, and `Drop` paths must not panic on a poisoned lock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Allocates `size` bytes (`size > 0`) for `stream` from `pool`.
    pub(crate) fn malloc(&self, size: usize, stream: StreamId, pool: PoolId) -> Result<Allocation> {
        let mut st = self.lock();
        if st.error.is_some() {
            return Err(st.error.take().expect("checked"));
        }
        let be = &*self.backend;
        if !st.pending.is_empty() {
            st.process_events(be);
        }
        st.tick += 1;
        if size > MAX_BLOCK {
            st.stats.num_ooms += 1;
            return Err(st.oom(be, size));
        }
        let rounded = round_size(size, &st.config);
        let small = is_small(rounded);
        let set = st.set_for(pool, stream, small);
        let block = match st.best_fit(set, rounded) {
            Some(b) => b,
            None => st.new_segment(be, size, rounded, set, (pool, stream, small))?,
        };
        Ok(st.take_block(block, rounded, size))
    }

    /// Returns a block from [`malloc`](Self::malloc). Never fails: an error on the way (an event
    /// that could not be recorded) is kept and reported by the next call.
    pub(crate) fn free(&self, block: u32) {
        let mut st = self.lock();
        st.free(&*self.backend, block);
    }

    /// Notes that `stream` uses the block; returns whether the stream is new to it.
    pub(crate) fn record_stream(&self, block: u32, stream: StreamId) -> bool {
        let mut st = self.lock();
        let seg_stream = st.segments[st.blocks[block as usize].seg as usize].stream;
        if stream == seg_stream {
            return false;
        }
        st.blocks[block as usize].has_uses = true;
        let uses = st.uses.entry(block).or_default();
        if uses.contains(&stream) {
            return false;
        }
        uses.push(stream);
        true
    }

    /// `alloc_bytes` for FFI users: the pointer is the handle.
    pub(crate) fn malloc_raw(&self, size: usize, stream: StreamId, pool: PoolId) -> Result<u64> {
        if size == 0 {
            return Ok(0);
        }
        let a = self.malloc(size, stream, pool)?;
        self.lock().raw.insert(a.addr, a.block);
        Ok(a.addr)
    }

    pub(crate) fn free_raw(&self, ptr: u64) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        let mut st = self.lock();
        match st.raw.remove(&ptr) {
            Some(b) => {
                st.free(&*self.backend, b);
                Ok(())
            }
            None => Err(Error::InvalidFree { ptr, device: self.backend.device() }),
        }
    }

    /// The block of a live raw allocation.
    pub(crate) fn raw_block(&self, ptr: u64) -> Option<u32> {
        self.lock().raw.get(&ptr).copied()
    }

    /// Waits for every pending cross-stream free, then gives back every wholly free segment.
    pub(crate) fn empty_cache(&self) -> Result<()> {
        let mut st = self.lock();
        let be = &*self.backend;
        st.synchronize_events(be);
        st.release_cached(be);
        match st.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(crate) fn stats(&self) -> MemoryStats {
        let st = self.lock();
        st.stats.report(st.config.max_split_size)
    }

    pub(crate) fn reset_peak_stats(&self) {
        self.lock().stats.reset_peak();
    }

    pub(crate) fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        let config = Config::builder().memory_fraction(fraction).build()?;
        let mut st = self.lock();
        st.config.memory_fraction = config.memory_fraction;
        st.limit = limit_for(&*self.backend, fraction);
        Ok(())
    }

    pub(crate) fn config(&self) -> Config {
        self.lock().config.clone()
    }

    /// An error kept from a call that could not return one (a `Drop`), taken.
    pub(crate) fn take_error(&self) -> Option<Error> {
        self.lock().error.take()
    }

    pub(crate) fn snapshot(&self) -> Snapshot {
        let st = self.lock();
        let mut segments: Vec<SegmentSnapshot> = st
            .segments
            .iter()
            .filter(|s| s.live)
            .map(|s| {
                let mut blocks = Vec::new();
                let mut b = s.head;
                while b != NONE {
                    let blk = &st.blocks[b as usize];
                    blocks.push(BlockSnapshot {
                        address: blk.addr,
                        size: blk.size,
                        requested_size: if blk.state == BlockState::Free { 0 } else { blk.requested },
                        state: blk.state,
                    });
                    b = blk.next;
                }
                SegmentSnapshot {
                    address: s.addr,
                    total_size: s.size,
                    stream: s.stream,
                    pool: s.pool,
                    is_small: s.small,
                    blocks,
                }
            })
            .collect();
        segments.sort_by_key(|s| s.address);
        Snapshot { device: self.backend.device(), backend: self.backend.kind(), segments }
    }
}

fn limit_for(backend: &dyn Backend, fraction: f64) -> Option<usize> {
    if fraction >= 1.0 {
        return None;
    }
    backend.memory_info().map(|(_, total)| (total as f64 * fraction) as usize)
}

impl State {
    #[inline]
    fn set_for(&mut self, pool: PoolId, stream: StreamId, small: bool) -> u32 {
        let k = (pool, stream, small);
        if self.last_set.0 == k {
            return self.last_set.1;
        }
        if let Some(&i) = self.set_index.get(&k) {
            self.last_set = (k, i);
            return i;
        }
        let i = self.sets.len() as u32;
        self.sets.push(FreeSet::new());
        self.set_index.insert((pool, stream, small), i);
        i
    }

    #[inline]
    fn new_block(&mut self, b: Block) -> u32 {
        match self.free_blocks.pop() {
            Some(i) => {
                self.blocks[i as usize] = b;
                i
            }
            None => {
                self.blocks.push(b);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    /// The best fitting free block of the set, removed from it; PyTorch's rule: the smallest block
    /// at or above `size`, unless it is an unsplittable oversize block that would waste too much.
    #[inline]
    fn best_fit(&mut self, set: u32, size: usize) -> Option<u32> {
        let max_split = self.config.max_split_size;
        let k = self.sets[set as usize].take_best_fit(size, |block| {
            !((size < max_split && block >= max_split) || (size >= max_split && block >= size + rounding::LARGE_BUFFER))
        })?;
        Some(key_idx(k))
    }

    #[inline]
    fn insert_free(&mut self, b: u32) {
        let blk = &self.blocks[b as usize];
        self.sets[blk.set as usize].insert(key(blk.size, blk.addr, b));
    }

    #[inline]
    fn remove_free(&mut self, b: u32) {
        let blk = &self.blocks[b as usize];
        self.sets[blk.set as usize].remove(key(blk.size, blk.addr, b));
    }

    /// Counts (`+1`) or uncounts (`-1`) a free block in the inactive-split stats.
    #[inline]
    fn count_inactive(&mut self, b: u32, add: bool) {
        let blk = &self.blocks[b as usize];
        if blk.state != BlockState::Free || !blk.is_split() {
            return;
        }
        let (size, small) = (blk.size, blk.small);
        if add {
            self.stats.inactive_split.add(small, 1);
            self.stats.inactive_split_bytes.add(small, size);
        } else {
            self.stats.inactive_split.sub(small, 1);
            self.stats.inactive_split_bytes.sub(small, size);
        }
    }

    /// Hands out `block` (free, out of its set) for a request: splits off the rest if the rules
    /// say so, and counts it.
    #[inline]
    fn take_block(&mut self, block: u32, rounded: usize, requested: usize) -> Allocation {
        self.count_inactive(block, false);
        let b = &self.blocks[block as usize];
        let small = b.small;
        if should_split(b.size, rounded, small, self.config.max_split_size) {
            let rest = Block {
                addr: b.addr + rounded as u64,
                size: b.size - rounded,
                requested: 0,
                seg: b.seg,
                prev: block,
                next: b.next,
                state: BlockState::Free,
                set: b.set,
                small,
                has_uses: false,
                pending: 0,
            };
            let next = b.next;
            let r = self.new_block(rest);
            if next != NONE {
                self.blocks[next as usize].prev = r;
            }
            let b = &mut self.blocks[block as usize];
            b.next = r;
            b.size = rounded;
            self.insert_free(r);
            self.count_inactive(r, true);
        }
        let b = &mut self.blocks[block as usize];
        b.state = BlockState::Allocated;
        b.requested = requested;
        let (size, addr) = (b.size, b.addr);
        let s = &mut self.stats;
        s.allocation.add(small, 1);
        s.allocated_bytes.add(small, size);
        s.active.add(small, 1);
        s.active_bytes.add(small, size);
        s.requested_bytes.add(small, requested);
        if size >= self.config.max_split_size {
            s.oversize_allocations.add(false, 1);
        }
        Allocation { block, addr }
    }

    /// Allocates a segment for a request no cached block could serve; on out-of-memory, waits for
    /// pending frees, gives back the cache and tries once more.
    fn new_segment(
        &mut self,
        be: &dyn Backend,
        requested: usize,
        rounded: usize,
        set: u32,
        key: SetKey,
    ) -> Result<u32> {
        let size = segment_size(rounded);
        if self.config.garbage_collection_threshold > 0.0 {
            self.garbage_collect(be);
        }
        let addr = match self.raw_alloc(be, size, key.1) {
            Ok(a) => a,
            Err(BackendError::OutOfMemory) => {
                self.synchronize_events(be);
                if let Some(b) = self.best_fit(set, rounded) {
                    return Ok(b);
                }
                self.release_cached(be);
                self.stats.num_alloc_retries += 1;
                match self.raw_alloc(be, size, key.1) {
                    Ok(a) => a,
                    Err(BackendError::OutOfMemory) => {
                        self.stats.num_ooms += 1;
                        return Err(self.oom(be, requested));
                    }
                    Err(BackendError::Failed(m)) => {
                        return Err(Error::Backend { op: "segment allocation", message: m })
                    }
                }
            }
            Err(BackendError::Failed(m)) => return Err(Error::Backend { op: "segment allocation", message: m }),
        };
        if addr >= 1 << 56 {
            // The free sets pack addresses into 56 bits; no device hands out higher ones today.
            let _ = be.free_segment(addr, size);
            return Err(Error::Backend { op: "segment allocation", message: format!("address {addr:#x} above 2^56") });
        }
        let (pool, stream, small) = key;
        let seg = Segment { addr, size, stream, pool, small, head: NONE, freed_at: 0, live: true };
        let seg_idx = match self.free_segments.pop() {
            Some(i) => {
                self.segments[i as usize] = seg;
                i
            }
            None => {
                self.segments.push(seg);
                (self.segments.len() - 1) as u32
            }
        };
        let block = self.new_block(Block {
            addr,
            size,
            requested: 0,
            seg: seg_idx,
            prev: NONE,
            next: NONE,
            state: BlockState::Free,
            set,
            small,
            has_uses: false,
            pending: 0,
        });
        self.segments[seg_idx as usize].head = block;
        let s = &mut self.stats;
        s.segment.add(small, 1);
        s.reserved_bytes.add(small, size);
        s.num_device_alloc += 1;
        if size >= self.config.max_split_size {
            s.oversize_segments.add(false, 1);
        }
        Ok(block)
    }

    fn oom(&self, be: &dyn Backend, requested: usize) -> Error {
        let (free, total) = be.memory_info().unzip();
        Error::OutOfMemory(Box::new(OomReport {
            device: be.device(),
            backend: be.kind(),
            requested,
            device_total: total,
            device_free: free,
            allocated: self.stats.allocated_bytes.current() as usize,
            reserved: self.stats.reserved_bytes.current() as usize,
            limit: self.limit,
        }))
    }

    /// The backend's allocation, refused up front when it would pass the memory-fraction limit.
    fn raw_alloc(&mut self, be: &dyn Backend, size: usize, stream: StreamId) -> Result<u64, BackendError> {
        if let Some(limit) = self.limit {
            if self.stats.reserved_bytes.current() as usize + size > limit {
                return Err(BackendError::OutOfMemory);
            }
        }
        be.alloc_segment(size, stream)
    }

    #[inline]
    fn free(&mut self, be: &dyn Backend, block: u32) {
        let b = &mut self.blocks[block as usize];
        debug_assert_eq!(b.state, BlockState::Allocated);
        let (size, requested, small) = (b.size, b.requested, b.small);
        let uses = if b.has_uses {
            b.has_uses = false;
            self.uses.remove(&block).unwrap_or_default()
        } else {
            Vec::new()
        };
        let s = &mut self.stats;
        s.allocation.sub(small, 1);
        s.allocated_bytes.sub(small, size);
        s.requested_bytes.sub(small, requested);
        if size >= self.config.max_split_size {
            s.oversize_allocations.sub(false, 1);
        }
        if uses.is_empty() {
            self.free_block(block);
            return;
        }
        self.blocks[block as usize].state = BlockState::AwaitingStreams;
        for stream in uses {
            match be.record_event(stream) {
                Ok(ev) => {
                    self.pending.push((ev, block));
                    self.blocks[block as usize].pending += 1;
                }
                Err(e) => {
                    // Without an event there is no telling when the other stream is done with the
                    // block: it stays out of circulation rather than risk handing it out early.
                    self.error.get_or_insert(Error::Backend {
                        op: "recording a cross-stream event",
                        message: format!("{e}; block {:#x} is held back", self.blocks[block as usize].addr),
                    });
                }
            }
        }
    }

    /// Makes a block free, merging it with free neighbours, and files it in its set.
    #[inline]
    fn free_block(&mut self, block: u32) {
        let b = &mut self.blocks[block as usize];
        let small = b.small;
        let size = b.size;
        b.state = BlockState::Free;
        b.requested = 0;
        b.pending = 0;
        self.stats.active.sub(small, 1);
        self.stats.active_bytes.sub(small, size);
        let mut cur = block;
        let prev = self.blocks[cur as usize].prev;
        if prev != NONE && self.blocks[prev as usize].state == BlockState::Free {
            self.count_inactive(prev, false);
            self.remove_free(prev);
            self.merge_next_into(prev);
            cur = prev;
        }
        let next = self.blocks[cur as usize].next;
        if next != NONE && self.blocks[next as usize].state == BlockState::Free {
            self.count_inactive(next, false);
            self.remove_free(next);
            self.merge_next_into(cur);
        }
        self.insert_free(cur);
        self.count_inactive(cur, true);
        let b = &self.blocks[cur as usize];
        if !b.is_split() {
            let seg = b.seg;
            self.segments[seg as usize].freed_at = self.tick;
        }
    }

    /// Merges `b`'s successor into `b`; neither may be in a set.
    #[inline]
    fn merge_next_into(&mut self, b: u32) {
        let n = self.blocks[b as usize].next;
        let (nsize, nnext) = (self.blocks[n as usize].size, self.blocks[n as usize].next);
        self.blocks[b as usize].size += nsize;
        self.blocks[b as usize].next = nnext;
        if nnext != NONE {
            self.blocks[nnext as usize].prev = b;
        }
        self.free_blocks.push(n);
    }

    /// Frees the blocks whose cross-stream events have all completed.
    fn process_events(&mut self, be: &dyn Backend) {
        let pending = std::mem::take(&mut self.pending);
        for (ev, block) in pending {
            match be.query_event(ev) {
                Ok(true) => self.event_done(be, ev, block),
                Ok(false) => self.pending.push((ev, block)),
                Err(e) => {
                    self.error
                        .get_or_insert(Error::Backend { op: "querying a cross-stream event", message: e.to_string() });
                    self.pending.push((ev, block));
                }
            }
        }
    }

    /// Waits for every pending cross-stream event and frees their blocks.
    fn synchronize_events(&mut self, be: &dyn Backend) {
        self.stats.num_sync_all_streams += 1;
        let pending = std::mem::take(&mut self.pending);
        for (ev, block) in pending {
            match be.synchronize_event(ev) {
                Ok(()) => self.event_done(be, ev, block),
                Err(e) => {
                    self.error.get_or_insert(Error::Backend {
                        op: "waiting for a cross-stream event",
                        message: e.to_string(),
                    });
                    self.pending.push((ev, block));
                }
            }
        }
    }

    fn event_done(&mut self, be: &dyn Backend, ev: EventId, block: u32) {
        be.release_event(ev);
        let b = &mut self.blocks[block as usize];
        b.pending -= 1;
        if b.pending == 0 {
            self.free_block(block);
        }
    }

    /// Whether segment `seg` is live and wholly free.
    fn wholly_free(&self, seg: usize) -> bool {
        let s = &self.segments[seg];
        s.live && {
            let b = &self.blocks[s.head as usize];
            b.state == BlockState::Free && !b.is_split()
        }
    }

    /// Gives back every wholly free segment.
    fn release_cached(&mut self, be: &dyn Backend) {
        for seg in 0..self.segments.len() {
            if self.wholly_free(seg) {
                self.release_segment(be, seg as u32);
            }
        }
    }

    /// Gives a wholly free segment back to the backend. If the backend refuses, the segment stays
    /// cached (still counted as reserved) and the error is kept for the next call.
    fn release_segment(&mut self, be: &dyn Backend, seg: u32) {
        let (addr, size, small) = {
            let s = &self.segments[seg as usize];
            (s.addr, s.size, s.small)
        };
        if let Err(e) = be.free_segment(addr, size) {
            self.error.get_or_insert(Error::Backend {
                op: "segment free",
                message: format!("{e} (segment {addr:#x}, {size} bytes)"),
            });
            return;
        }
        let head = self.segments[seg as usize].head;
        self.remove_free(head);
        self.free_blocks.push(head);
        let s = &mut self.segments[seg as usize];
        s.live = false;
        s.head = NONE;
        self.free_segments.push(seg);
        let st = &mut self.stats;
        st.segment.sub(small, 1);
        st.reserved_bytes.sub(small, size);
        st.num_device_free += 1;
        if size >= self.config.max_split_size {
            st.oversize_segments.sub(false, 1);
        }
    }

    /// With `garbage_collection_threshold` set: once reserved memory passes that fraction of the
    /// limit, gives back wholly free segments that have been free at least as long as the average
    /// one, oldest first, until reserved memory is back under the threshold.
    fn garbage_collect(&mut self, be: &dyn Backend) {
        let Some(limit) = self.limit else { return };
        let threshold = (self.config.garbage_collection_threshold * limit as f64) as usize;
        let reserved = |st: &State| st.stats.reserved_bytes.current() as usize;
        if reserved(self) <= threshold {
            return;
        }
        let mut free: Vec<(u64, u32)> = (0..self.segments.len())
            .filter(|&s| self.wholly_free(s))
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
                self.release_segment(be, seg);
            }
        }
    }
}
