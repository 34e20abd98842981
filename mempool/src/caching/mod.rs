//! The caching algorithm: blocks, segments, free sets, splitting, merging, deferred frees, pools.
//!
//! Safe code only; every device action goes through a [`Backend`] or a pool's
//! [`RawAllocator`](crate::RawAllocator).
//!
//! Blocks live in a slab and are named by their index, so a [`Buffer`](crate::Buffer) frees its
//! block without a pointer lookup. Free blocks sit in one ordered set per (pool, stream, small or
//! large), ordered by size then address, so the best fit is the first block at or above the
//! requested size.

mod freeset;
pub(crate) mod rounding;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::{Backend, BackendError, EventId, StreamId};
use crate::config::Config;
use crate::error::{Error, OomReport, Result};
use crate::pool::RawAllocator;
use crate::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot, Snapshot};
use crate::stats::{Counters, MemoryStats, PoolCounters, PoolStats};
use crate::trace::{self, Action};
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

/// Which pool an allocation goes to: its id and its slot in the allocator's pool table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolRef {
    pub(crate) id: PoolId,
    pub(crate) slot: u32,
}

impl PoolRef {
    /// The default pools.
    pub(crate) const DEFAULT: PoolRef = PoolRef { id: PoolId::DEFAULT, slot: 0 };
}

/// What a user pool brings: where its memory comes from and how it is carved.
pub(crate) struct PoolSpec {
    pub(crate) id: PoolId,
    pub(crate) raw: Option<Arc<dyn RawAllocator>>,
    pub(crate) use_on_oom: bool,
    pub(crate) no_split: bool,
    pub(crate) granularity: usize,
    pub(crate) name: String,
}

impl std::fmt::Debug for PoolSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolSpec").field("id", &self.id).field("name", &self.name).finish()
    }
}

#[derive(Debug)]
struct PoolState {
    spec: PoolSpec,
    stats: PoolCounters,
    segments: usize,
    /// Its last handle is gone: segments go back as soon as they are wholly free.
    released: bool,
    /// The slot is in use (a released pool's slot is reused once its last segment is gone).
    live: bool,
}

#[derive(Debug)]
struct Block {
    addr: u64,
    size: usize,
    requested: usize,
    seg: u32,
    prev: u32,
    next: u32,
    /// Its segment's free set, pool slot and kind (copies, so the hot path needs no segment
    /// lookup).
    set: u32,
    pool: u32,
    small: bool,
    state: BlockState,
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
    pool: u32,
    small: bool,
    head: u32,
    /// The allocation tick at which the segment last became wholly free (for garbage collection).
    freed_at: u64,
    live: bool,
}

type SetKey = (u32, StreamId, bool);

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
    /// Sets of retired pools (empty), for reuse: short-lived pools must not grow the table.
    idle_sets: Vec<u32>,
    set_index: IdMap<SetKey, u32>,
    /// The set of the last allocation: most programs allocate on one stream at a time.
    last_set: (SetKey, u32),
    /// Pool table; slot 0 is the default pools.
    pools: Vec<PoolState>,
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
    /// Work asked for inside a trace callback, when the lock was held: done at the next call.
    deferred: Mutex<Vec<Deferred>>,
    has_deferred: AtomicBool,
}

/// What a trace callback could not do itself.
#[derive(Debug, Clone, Copy)]
enum Deferred {
    /// A `Buffer` dropped: free its block.
    Free(u32),
    /// A pool's last handle dropped: release the pool.
    Release(u32),
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
        let default_pool = PoolState {
            spec: PoolSpec {
                id: PoolId::DEFAULT,
                raw: None,
                use_on_oom: false,
                no_split: false,
                granularity: 512,
                name: backend.kind().to_string(),
            },
            stats: PoolCounters::default(),
            segments: 0,
            released: false,
            live: true,
        };
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
                idle_sets: Vec::new(),
                set_index: IdMap::default(),
                last_set: ((u32::MAX, StreamId(u64::MAX), false), 0),
                pools: vec![default_pool],
                pending: Vec::new(),
                raw: IdMap::default(),
                uses: IdMap::default(),
                stats: Counters::default(),
                tick: 0,
                error: None,
            }),
            deferred: Mutex::new(Vec::new()),
            has_deferred: AtomicBool::new(false),
        }
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// The state, locked; frees deferred by trace callbacks are done first.
    #[inline(always)]
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held is a bug in this module; the state is still the best
        // there is, and `Drop` paths must not panic on a poisoned lock.
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if self.has_deferred.load(Ordering::Relaxed) {
            self.free_deferred(&mut st);
        }
        st
    }

    #[cold]
    fn free_deferred(&self, st: &mut State) {
        self.has_deferred.store(false, Ordering::Relaxed);
        let work = std::mem::take(&mut *self.deferred.lock().unwrap_or_else(|p| p.into_inner()));
        for w in work {
            match w {
                Deferred::Free(b) => st.free(&*self.backend, b),
                Deferred::Release(slot) => st.release_pool(&*self.backend, slot),
            }
        }
    }

    fn defer(&self, w: Deferred) {
        self.deferred.lock().unwrap_or_else(|p| p.into_inner()).push(w);
        self.has_deferred.store(true, Ordering::Relaxed);
    }

    /// The state for a call that can report [`Error::Reentrant`].
    #[inline(always)]
    fn enter(&self) -> Result<MutexGuard<'_, State>> {
        if trace::in_hook() {
            return Err(Error::Reentrant);
        }
        Ok(self.lock())
    }

    /// Allocates `size` bytes (`size > 0`) for `stream` from `pool`.
    pub(crate) fn malloc(&self, size: usize, stream: StreamId, pool: PoolRef) -> Result<Allocation> {
        let mut st = self.enter()?;
        if st.error.is_some() {
            return Err(st.error.take().expect("checked"));
        }
        let be = &*self.backend;
        if !st.pending.is_empty() {
            st.process_events(be);
        }
        st.tick += 1;
        if size > MAX_BLOCK {
            return Err(st.oom(be, size, pool.slot));
        }
        let rounded = round_size(size, &st.config);
        let small = is_small(rounded);
        let set = st.set_for(pool.slot, stream, small);
        let no_split = st.no_split(pool.slot);
        let block = match st.best_fit(set, rounded, no_split) {
            Some(b) => b,
            None => st.new_segment(be, size, rounded, set, (pool.slot, stream, small))?,
        };
        let a = st.take_block(block, rounded, size);
        if trace::enabled() {
            st.emit(be, Action::Alloc, block);
        }
        Ok(a)
    }

    /// Returns a block from [`malloc`](Self::malloc). Never fails: an error on the way (an event
    /// that could not be recorded) is kept and reported by the next call.
    pub(crate) fn free(&self, block: u32) {
        if trace::in_hook() {
            // The allocator is locked by the dispatch that called this hook: free it later.
            self.defer(Deferred::Free(block));
            return;
        }
        let mut st = self.lock();
        st.free(&*self.backend, block);
    }

    /// Notes that `stream` uses the block; returns whether the stream is new to it.
    pub(crate) fn record_stream(&self, block: u32, stream: StreamId) -> bool {
        let Ok(mut st) = self.enter() else { return false };
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
    pub(crate) fn malloc_raw(&self, size: usize, stream: StreamId, pool: PoolRef) -> Result<u64> {
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
        let mut st = self.enter()?;
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

    /// Waits for every pending cross-stream free, then gives back every wholly free segment of the
    /// default pools and of released pools (live user pools keep theirs: `MemPool::empty_cache`).
    pub(crate) fn empty_cache(&self) -> Result<()> {
        let mut st = self.enter()?;
        let be = &*self.backend;
        st.synchronize_events(be);
        st.release_cached(be, |p| p.spec.id == PoolId::DEFAULT || p.released);
        st.error.take().map_or(Ok(()), Err)
    }

    /// Gives back the wholly free segments of one pool.
    pub(crate) fn empty_pool_cache(&self, slot: u32) -> Result<()> {
        let mut st = self.enter()?;
        let be = &*self.backend;
        if !st.pending.is_empty() {
            st.process_events(be);
        }
        let id = st.pools[slot as usize].spec.id;
        st.release_cached(be, |p| p.spec.id == id);
        st.error.take().map_or(Ok(()), Err)
    }

    pub(crate) fn stats(&self) -> MemoryStats {
        let st = self.lock();
        st.stats.report(st.config.max_split_size)
    }

    pub(crate) fn pool_stats(&self, slot: u32) -> PoolStats {
        let st = self.lock();
        let (mut active, mut inactive) = (0, 0);
        for s in st.segments.iter().filter(|s| s.live && s.pool == slot) {
            let mut b = s.head;
            while b != NONE {
                let blk = &st.blocks[b as usize];
                match blk.state {
                    BlockState::Free if blk.is_split() => inactive += blk.size,
                    BlockState::Free => {}
                    _ => active += blk.size,
                }
                b = blk.next;
            }
        }
        st.pools[slot as usize].stats.report(active, inactive)
    }

    pub(crate) fn reset_peak_stats(&self) {
        let mut st = self.lock();
        st.stats.reset_peak();
        for p in &mut st.pools {
            p.stats.reset_peak();
        }
    }

    pub(crate) fn set_memory_fraction(&self, fraction: f64) -> Result<()> {
        let config = Config::builder().memory_fraction(fraction).build()?;
        let mut st = self.enter()?;
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

    /// Adds a user pool; returns its slot.
    pub(crate) fn register_pool(&self, spec: PoolSpec) -> u32 {
        let mut st = self.lock();
        let p = PoolState { spec, stats: PoolCounters::default(), segments: 0, released: false, live: true };
        match st.pools.iter().position(|p| !p.live) {
            Some(i) => {
                st.pools[i] = p;
                i as u32
            }
            None => {
                st.pools.push(p);
                (st.pools.len() - 1) as u32
            }
        }
    }

    /// The pool's last handle is gone: its wholly free segments go back now, the others as soon
    /// as they become wholly free.
    pub(crate) fn release_pool(&self, slot: u32) {
        if trace::in_hook() {
            // The allocator is locked by the dispatch that called this hook: release it later.
            self.defer(Deferred::Release(slot));
            return;
        }
        let mut st = self.lock();
        st.release_pool(&*self.backend, slot);
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
                    pool: st.pools[s.pool as usize].spec.id,
                    is_small: s.small,
                    blocks,
                }
            })
            .collect();
        segments.sort_by_key(|s| s.address);
        let device = self.backend.device();
        let trace = crate::trace::history(Some(device));
        Snapshot { device, backend: self.backend.kind(), segments, trace }
    }
}

fn limit_for(backend: &dyn Backend, fraction: f64) -> Option<usize> {
    if fraction >= 1.0 {
        return None;
    }
    backend.memory_info().map(|(_, total)| (total as f64 * fraction) as usize)
}

impl State {
    fn release_pool(&mut self, be: &dyn Backend, slot: u32) {
        self.pools[slot as usize].released = true;
        if !self.pending.is_empty() {
            self.process_events(be);
        }
        let id = self.pools[slot as usize].spec.id;
        self.release_cached(be, |p| p.spec.id == id);
        self.retire_pool_if_empty(slot);
    }

    /// Reports `action` on `block` to the trace hooks (the caller checked `trace::enabled`).
    fn emit(&self, be: &dyn Backend, action: Action, block: u32) {
        let b = &self.blocks[block as usize];
        let stream = self.segments[b.seg as usize].stream;
        trace::dispatch(action, be.device(), self.pools[b.pool as usize].spec.id, b.addr, b.size, stream);
    }

    #[inline(always)]
    fn set_for(&mut self, pool: u32, stream: StreamId, small: bool) -> u32 {
        let k = (pool, stream, small);
        if self.last_set.0 == k {
            return self.last_set.1;
        }
        if let Some(&i) = self.set_index.get(&k) {
            self.last_set = (k, i);
            return i;
        }
        let i = match self.idle_sets.pop() {
            Some(i) => i,
            None => {
                self.sets.push(FreeSet::new());
                (self.sets.len() - 1) as u32
            }
        };
        self.set_index.insert(k, i);
        i
    }

    #[inline(always)]
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
    /// In a `no_split` pool, a block serves only requests within 20 MiB of its size.
    #[inline(always)]
    fn best_fit(&mut self, set: u32, size: usize, no_split: bool) -> Option<u32> {
        let max_split = self.config.max_split_size;
        let k = self.sets[set as usize].take_best_fit(size, |block| {
            let whole_only = no_split || size >= max_split;
            !((size < max_split && block >= max_split) || (whole_only && block >= size + rounding::LARGE_BUFFER))
        })?;
        Some(key_idx(k))
    }

    #[inline(always)]
    fn no_split(&self, pool: u32) -> bool {
        pool != 0 && self.pools[pool as usize].spec.no_split
    }

    #[inline(always)]
    fn insert_free(&mut self, b: u32) {
        let blk = &self.blocks[b as usize];
        self.sets[blk.set as usize].insert(key(blk.size, blk.addr, b));
    }

    #[inline(always)]
    fn remove_free(&mut self, b: u32) {
        let blk = &self.blocks[b as usize];
        self.sets[blk.set as usize].remove(key(blk.size, blk.addr, b));
    }

    /// Counts (`+1`) or uncounts (`-1`) a free block in the inactive-split stats.
    #[inline(always)]
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
        let (small, pool) = (b.small, b.pool);
        if !self.no_split(pool) && should_split(b.size, rounded, small, self.config.max_split_size) {
            let rest = Block {
                addr: b.addr + rounded as u64,
                size: b.size - rounded,
                requested: 0,
                seg: b.seg,
                prev: block,
                next: b.next,
                set: b.set,
                pool,
                small,
                state: BlockState::Free,
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
        let oversize = size >= self.config.max_split_size;
        let c = &mut self.stats;
        c.allocation.add(small, 1);
        c.allocated_bytes.add(small, size);
        c.active.add(small, 1);
        c.active_bytes.add(small, size);
        c.requested_bytes.add(small, requested);
        if oversize {
            c.oversize_allocations.add(false, 1);
        }
        if pool != 0 {
            let p = &mut self.pools[pool as usize].stats;
            p.allocation.add(1);
            p.allocated_bytes.add(size);
            p.requested_bytes.add(requested);
        }
        Allocation { block, addr }
    }

    /// Allocates a segment for a request no cached block could serve; on out-of-memory, waits for
    /// pending frees, gives back the caches of every pool and tries once more; then, for the
    /// default pools, borrows a free block of a `use_on_oom` pool.
    fn new_segment(
        &mut self,
        be: &dyn Backend,
        requested: usize,
        rounded: usize,
        set: u32,
        key: SetKey,
    ) -> Result<u32> {
        let (pool, stream, small) = key;
        let spec = &self.pools[pool as usize].spec;
        let size = if spec.no_split { rounded } else { segment_size(rounded) }.next_multiple_of(spec.granularity);
        if self.config.garbage_collection_threshold > 0.0 {
            self.garbage_collect(be);
        }
        let addr = match self.raw_alloc(be, size, key) {
            Ok(a) => a,
            Err(Error::OutOfMemory(_)) => {
                self.synchronize_events(be);
                if let Some(b) = self.best_fit(set, rounded, self.no_split(pool)) {
                    return Ok(b);
                }
                // The default pools, released pools and this pool; live user pools keep theirs
                // (they may be registered, and `use_on_oom` lenders are tried below).
                let requester = self.pools[pool as usize].spec.id;
                self.release_cached(be, |p| p.spec.id == PoolId::DEFAULT || p.released || p.spec.id == requester);
                self.stats.num_alloc_retries += 1;
                match self.raw_alloc(be, size, key) {
                    Ok(a) => a,
                    Err(Error::OutOfMemory(_)) => {
                        if pool == 0 {
                            if let Some(b) = self.borrow_from_pools(stream, small, rounded) {
                                return Ok(b);
                            }
                        }
                        return Err(self.oom(be, requested, pool));
                    }
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
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
            set,
            pool,
            small,
            state: BlockState::Free,
            has_uses: false,
            pending: 0,
        });
        self.segments[seg_idx as usize].head = block;
        self.count_segment(pool, small, size, true);
        if trace::enabled() {
            self.emit(be, Action::SegmentAlloc, block);
        }
        Ok(block)
    }

    /// A free block of a `use_on_oom` pool for a default-pool request (it stays in its pool).
    fn borrow_from_pools(&mut self, stream: StreamId, small: bool, rounded: usize) -> Option<u32> {
        let lenders: Vec<u32> = (1..self.pools.len() as u32)
            .filter(|&p| self.pools[p as usize].live && self.pools[p as usize].spec.use_on_oom)
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

    fn oom(&mut self, be: &dyn Backend, requested: usize, pool: u32) -> Error {
        self.stats.num_ooms += 1;
        self.pools[pool as usize].stats.num_ooms += 1;
        if trace::enabled() {
            trace::dispatch(Action::Oom, be.device(), self.pools[pool as usize].spec.id, 0, requested, StreamId(0));
        }
        let (free, total) = be.memory_info().unzip();
        let spec = &self.pools[pool as usize].spec;
        Error::OutOfMemory(Box::new(OomReport {
            device: be.device(),
            backend: be.kind(),
            requested,
            device_total: total,
            device_free: free,
            allocated: self.stats.allocated_bytes.current() as usize,
            reserved: self.stats.reserved_bytes.current() as usize,
            limit: self.limit,
            pool: (pool != 0).then(|| (spec.id.0, spec.name.clone())),
        }))
    }

    /// A segment from the pool's allocator or the backend; `Error::OutOfMemory` (with an empty
    /// report, filled in by the caller) when there is no memory or the memory-fraction limit
    /// would be passed.
    fn raw_alloc(&mut self, be: &dyn Backend, size: usize, (pool, stream, _): SetKey) -> Result<u64> {
        let no_memory = || Error::OutOfMemory(Box::new(OomReport::empty()));
        if let Some(limit) = self.limit {
            if self.stats.reserved_bytes.current() as usize + size > limit {
                return Err(no_memory());
            }
        }
        let spec = &self.pools[pool as usize].spec;
        let r = match &spec.raw {
            Some(raw) => raw.alloc(size, be.device(), stream),
            None => be.alloc_segment(size, stream),
        };
        let addr = match r {
            Ok(0) | Err(BackendError::OutOfMemory) => return Err(no_memory()),
            Ok(a) => a,
            Err(BackendError::Failed(m)) => return Err(self.alloc_failed(pool, m)),
        };
        let misaligned = addr % spec.granularity as u64 != 0;
        if misaligned || addr >= 1 << 56 {
            // The free sets pack addresses into 56 bits; no device hands out higher ones today.
            let _ = match &spec.raw {
                Some(raw) => raw.free(addr, size, be.device(), stream),
                None => be.free_segment(addr, size),
            };
            let why = if misaligned {
                format!("returned {addr:#x}, not aligned to its granularity of {} bytes", spec.granularity)
            } else {
                format!("returned {addr:#x}, above 2^56")
            };
            return Err(self.alloc_failed(pool, why));
        }
        Ok(addr)
    }

    fn alloc_failed(&self, pool: u32, message: String) -> Error {
        let spec = &self.pools[pool as usize].spec;
        match spec.raw {
            Some(_) => Error::PoolAllocator { pool: spec.id.0, allocator: spec.name.clone(), message },
            None => Error::Backend { op: "segment allocation", message },
        }
    }

    #[inline]
    fn free(&mut self, be: &dyn Backend, block: u32) {
        let b = &mut self.blocks[block as usize];
        debug_assert_eq!(b.state, BlockState::Allocated);
        let (size, requested, small, pool) = (b.size, b.requested, b.small, b.pool);
        let uses = if b.has_uses {
            b.has_uses = false;
            self.uses.remove(&block).unwrap_or_default()
        } else {
            Vec::new()
        };
        let oversize = size >= self.config.max_split_size;
        let c = &mut self.stats;
        c.allocation.sub(small, 1);
        c.allocated_bytes.sub(small, size);
        c.requested_bytes.sub(small, requested);
        if oversize {
            c.oversize_allocations.sub(false, 1);
        }
        if pool != 0 {
            let p = &mut self.pools[pool as usize].stats;
            p.allocation.sub(1);
            p.allocated_bytes.sub(size);
            p.requested_bytes.sub(requested);
        }
        if trace::enabled() {
            self.emit(be, Action::FreeRequested, block);
        }
        if uses.is_empty() {
            self.free_block(be, block);
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

    /// Makes a block free, merging it with free neighbours, and files it in its set. A wholly free
    /// segment of a released pool goes back at once.
    #[inline]
    fn free_block(&mut self, be: &dyn Backend, block: u32) {
        if trace::enabled() {
            self.emit(be, Action::FreeCompleted, block);
        }
        let b = &mut self.blocks[block as usize];
        let (small, size, pool) = (b.small, b.size, b.pool);
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
            if pool != 0 && self.pools[pool as usize].released {
                self.release_segment(be, seg);
                self.retire_pool_if_empty(pool);
            }
        }
    }

    /// Merges `b`'s successor into `b`; neither may be in a set.
    #[inline(always)]
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
            self.free_block(be, block);
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

    /// Gives back every wholly free segment of the pools `which` selects.
    fn release_cached(&mut self, be: &dyn Backend, which: impl Fn(&PoolState) -> bool) {
        for seg in 0..self.segments.len() {
            if self.wholly_free(seg) && which(&self.pools[self.segments[seg].pool as usize]) {
                self.release_segment(be, seg as u32);
            }
        }
        for slot in 1..self.pools.len() as u32 {
            self.retire_pool_if_empty(slot);
        }
    }

    /// Frees a released pool's slot once its last segment is gone.
    fn retire_pool_if_empty(&mut self, slot: u32) {
        let p = &mut self.pools[slot as usize];
        if slot != 0 && p.live && p.released && p.segments == 0 {
            p.live = false;
            p.spec.raw = None;
            // Its free sets are empty: keep them for reuse, and forget whose they were.
            let idle = &mut self.idle_sets;
            self.set_index.retain(|k, i| {
                let keep = k.0 != slot;
                if !keep {
                    idle.push(*i);
                }
                keep
            });
            self.last_set = ((u32::MAX, StreamId(u64::MAX), false), 0);
        }
    }

    /// Gives a wholly free segment back through its pool's free function (or the backend), after
    /// telling the trace hooks. If the free fails, the segment stays cached (still counted as
    /// reserved) and the error is kept for the next call.
    fn release_segment(&mut self, be: &dyn Backend, seg: u32) {
        let (addr, size, small, pool, stream, head) = {
            let s = &self.segments[seg as usize];
            (s.addr, s.size, s.small, s.pool, s.stream, s.head)
        };
        if trace::enabled() {
            self.emit(be, Action::SegmentFree, head);
        }
        let r = match &self.pools[pool as usize].spec.raw {
            Some(raw) => raw.free(addr, size, be.device(), stream),
            None => be.free_segment(addr, size),
        };
        if let Err(e) = r {
            let spec = &self.pools[pool as usize].spec;
            self.error.get_or_insert(match spec.raw {
                Some(_) => Error::PoolAllocator {
                    pool: spec.id.0,
                    allocator: spec.name.clone(),
                    message: format!("free of segment {addr:#x} ({size} bytes) failed: {e}"),
                },
                None => {
                    Error::Backend { op: "segment free", message: format!("{e} (segment {addr:#x}, {size} bytes)") }
                }
            });
            return;
        }
        self.remove_free(head);
        self.free_blocks.push(head);
        let s = &mut self.segments[seg as usize];
        s.live = false;
        s.head = NONE;
        self.free_segments.push(seg);
        self.count_segment(pool, small, size, false);
    }

    /// Counts a segment obtained (`added`) or given back, for the device and its pool.
    fn count_segment(&mut self, pool: u32, small: bool, size: usize, added: bool) {
        let oversize = size >= self.config.max_split_size;
        let (c, p) = (&mut self.stats, &mut self.pools[pool as usize]);
        if added {
            p.segments += 1;
            c.segment.add(small, 1);
            c.reserved_bytes.add(small, size);
            c.num_device_alloc += 1;
            if oversize {
                c.oversize_segments.add(false, 1);
            }
            p.stats.segment.add(1);
            p.stats.reserved_bytes.add(size);
            p.stats.num_device_alloc += 1;
        } else {
            p.segments -= 1;
            c.segment.sub(small, 1);
            c.reserved_bytes.sub(small, size);
            c.num_device_free += 1;
            if oversize {
                c.oversize_segments.sub(false, 1);
            }
            p.stats.segment.sub(1);
            p.stats.reserved_bytes.sub(size);
            p.stats.num_device_free += 1;
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
