//! The allocator's data behind its lock, and carving: best fit, split, merge, counting.
//!
//! Everything here is plain data manipulation: no device call, no user code, no lock. The
//! device and user code are reached only from `segments.rs` and `events.rs` (backend calls that
//! cannot be made up: addresses this state holds) and from the work queue of `mod.rs`.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::num::NonZeroU32;
use std::sync::Arc;

use super::freeset::{key, key_idx, key_size, FreeSet};
use crate::backend::{Keep, RawAllocator};
use crate::config::Config;
use crate::error::Error;
use crate::id::{EventId, PoolId, PoolRef, StreamKey, StreamRef};
use crate::rules::{self, should_split};
use crate::snapshot::BlockState;
use crate::stats::{Counters, PoolCounters};
use crate::trace::{Action, TraceEntry};

/// A multiply-rotate hasher for the small integer keys of the allocator's maps: SipHash's
/// resistance to crafted keys buys nothing here and costs a third of an allocation.
#[derive(Default)]
pub(super) struct IdHasher(u64);

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
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }
}

pub(super) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// A block's index in the slab (stored as index + 1, so `Option<BlockIdx>` is four bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct BlockIdx(NonZeroU32);

impl BlockIdx {
    fn new(i: usize) -> BlockIdx {
        let n = u32::try_from(i + 1).expect("more than 2^32 blocks");
        BlockIdx(NonZeroU32::new(n).expect("i + 1 > 0"))
    }
    #[inline(always)]
    pub(super) fn get(self) -> usize {
        self.0.get() as usize - 1
    }
    /// For the free-set keys, which hold the index in 32 bits.
    #[inline(always)]
    pub(super) fn to_key(self) -> u32 {
        self.0.get()
    }
    #[inline(always)]
    pub(super) fn from_key(k: u32) -> BlockIdx {
        BlockIdx(NonZeroU32::new(k).expect("free-set keys hold index + 1"))
    }
}

/// A segment's index in the segment table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct SegIdx(pub(super) u32);

/// A free set's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct SetIdx(pub(super) u32);

/// A pool's slot in the pool table (0: the default pools).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Slot(pub(super) u32);

impl Slot {
    pub(super) const DEFAULT: Slot = Slot(0);
    #[inline(always)]
    pub(super) fn get(self) -> usize {
        self.0 as usize
    }
}

/// What a user pool brings: where its memory comes from and how it is carved.
pub(crate) struct PoolSpec {
    pub(crate) id: PoolId,
    pub(crate) raw: Option<Arc<dyn RawAllocator>>,
    pub(crate) use_on_oom: bool,
    pub(crate) no_split: bool,
    /// No caching: a wholly free segment goes back to its source at once.
    pub(crate) no_cache: bool,
    /// Segment sizes are multiples of this.
    pub(crate) granularity: usize,
    /// Segment addresses must be multiples of this: what the segment source promises (its own
    /// `granularity`, 512 for the backend), not what the options ask of sizes.
    pub(crate) align: usize,
    pub(crate) name: String,
    /// Memory is mapped on demand into reserved address ranges (`expand.rs`).
    pub(crate) expandable: bool,
    /// With `expandable`: whether a block may span two physical allocations (not when NCCL
    /// older than 2.29.2 registers the pool: it registers one physical allocation per buffer).
    pub(crate) merge_runs: bool,
    /// With `expandable`: told of every physical allocation mapped, asked before each unmap.
    pub(crate) map_guard: Option<Arc<dyn crate::backend::MapGuard>>,
    /// Its segment source's memory is host-visible (`RawAllocator::host_visible`).
    pub(crate) host_visible: bool,
}

impl std::fmt::Debug for PoolSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolSpec").field("id", &self.id).field("name", &self.name).finish()
    }
}

#[derive(Debug)]
pub(super) struct PoolState {
    pub(super) spec: PoolSpec,
    pub(super) stats: PoolCounters,
    pub(super) segments: usize,
    /// Its last handle is gone: segments go back as soon as they are wholly free.
    pub(super) released: bool,
    /// The slot is in use (a released pool's slot is reused once its last segment is gone).
    pub(super) live: bool,
    /// Captures and graphs holding the pool's memory: while any does, none of its segments
    /// goes back (a graph's replays use the memory its capture freed).
    pub(super) pinned: u32,
}

#[derive(Debug)]
pub(super) struct Block {
    pub(super) addr: u64,
    pub(super) size: usize,
    pub(super) requested: usize,
    pub(super) seg: SegIdx,
    pub(super) prev: Option<BlockIdx>,
    pub(super) next: Option<BlockIdx>,
    /// Its segment's free set, pool slot and kind (copies, so the hot path needs no segment
    /// lookup).
    pub(super) set: SetIdx,
    pub(super) pool: Slot,
    pub(super) small: bool,
    pub(super) state: BlockState,
    /// Whether `State::uses` lists other streams that used it.
    pub(super) has_uses: bool,
    /// Events still to complete before the block is free.
    pub(super) pending: u32,
    /// Where it was last allocated, while stacks are recorded (`stacks::current` tells whether
    /// it is this allocation's).
    pub(super) stack: crate::stacks::StackId,
    /// The recording epoch `stack` was recorded in.
    pub(super) stack_epoch: u32,
}

impl Block {
    pub(super) fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

#[derive(Debug)]
pub(super) struct Segment {
    pub(super) addr: u64,
    pub(super) size: usize,
    pub(super) stream: StreamRef,
    /// Keeps the segment's stream alive while the segment exists: its blocks are reused in that
    /// stream's order, and events and frees are recorded on it.
    pub(super) keep: Option<Keep>,
    pub(super) pool: Slot,
    pub(super) small: bool,
    pub(super) head: Option<BlockIdx>,
    /// The allocation tick at which the segment last became wholly free (for garbage collection).
    pub(super) freed_at: u64,
    pub(super) live: bool,
    /// The reservation it lies in, for a contiguous mapped range of an expandable segment
    /// (`expand.rs`): it grows when memory is mapped after it and is cut when memory is unmapped.
    pub(super) res: Option<u32>,
}

/// Another stream that used a block, kept alive until its event is recorded.
#[derive(Debug)]
pub(super) struct Use {
    pub(super) stream: StreamRef,
    pub(super) keep: Option<Keep>,
}

pub(super) type SetKey = (Slot, StreamKey, bool);

/// A segment call or a map under way with the lock let go (`DeviceAllocator::grow`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Growth {
    pub(super) id: u64,
    /// The free set it grows.
    pub(super) key: SetKey,
    /// Its bytes.
    pub(super) size: usize,
    /// Bytes its own request leaves in it for others (0 where the rest is not split off).
    pub(super) spare: usize,
    /// The fork generation it began in: in a fork child, a parent thread's growth never ends.
    pub(super) gen: u64,
}

/// Where a segment's memory goes back to.
#[derive(Clone)]
pub(super) enum Source {
    Backend,
    Pool(Arc<dyn RawAllocator>),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not `a.name()`: a `Debug` may run under the lock, and `name` is user code.
        match self {
            Source::Backend => f.write_str("Backend"),
            Source::Pool(_) => f.write_str("Pool"),
        }
    }
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Work::Event(e, _) => write!(f, "Event({e})"),
            Work::Free(r) => write!(f, "Free({:#x}, {})", r.addr, r.size),
            Work::Drop(_) => f.write_str("Drop"),
            Work::GiveBack(g) => write!(f, "GiveBack({:#x}, {})", g.addr, g.size),
            Work::Unmap(u) => write!(f, "Unmap({:#x}, {})", u.addr, u.size),
            Work::Unreserve(u) => write!(f, "Unreserve({:#x}, {})", u.addr, u.size),
        }
    }
}

/// A segment taken out of the cache, to be given back outside the lock (after the hooks have
/// seen its `SegmentFree`).
#[derive(Debug)]
pub(super) struct Released {
    pub(super) addr: u64,
    pub(super) size: usize,
    pub(super) small: bool,
    pub(super) slot: Slot,
    pub(super) pool: PoolId,
    /// The pool allocator's name as the pool recorded it (user code is not called under the lock).
    pub(super) pool_name: String,
    pub(super) stream: StreamRef,
    /// Held for the stream's sake until the segment is given back.
    pub(super) _keep: Option<Keep>,
    pub(super) source: Source,
}

/// Work for outside the lock, in the order the state produced it.
pub(super) enum Work {
    /// Unmap a physical allocation of an expandable segment (after the hooks saw its
    /// `SegmentUnmap`).
    Unmap(super::expand::Unmapping),
    /// Give back a reservation with nothing mapped in it.
    Unreserve(super::expand::Unreserving),
    /// Deliver an event to the history and the hooks.
    /// With the `tracing` feature, the subscriber of the thread that caused it goes along.
    Event(TraceEntry, crate::trace::Dispatch),
    /// Give a segment back.
    Free(Released),
    /// Let go of something whose `Drop` is user code (a retired pool's allocator).
    Drop(Box<dyn std::any::Any + Send>),
    /// Give back a segment that was never added to the cache (its pool went while it was
    /// being allocated, or its address is unusable).
    GiveBack(GiveBack),
}

/// A segment to give back that the cache never held.
pub(super) struct GiveBack {
    pub(super) source: Source,
    pub(super) addr: u64,
    pub(super) size: usize,
    pub(super) stream: crate::id::StreamRef,
    pub(super) keep: Option<crate::backend::Keep>,
}

/// Everything behind the allocator's lock.
#[derive(Debug)]
pub(super) struct State {
    pub(super) config: Config,
    pub(super) limit: Option<usize>,
    pub(super) blocks: Vec<Block>,
    pub(super) free_blocks: Vec<BlockIdx>,
    pub(super) segments: Vec<Segment>,
    pub(super) free_segments: Vec<SegIdx>,
    pub(super) sets: Vec<FreeSet>,
    /// Live segments per free set (a set whose count falls to 0 is retired).
    pub(super) set_segments: Vec<u32>,
    /// Sets of retired pools (empty), for reuse: short-lived pools must not grow the table.
    pub(super) idle_sets: Vec<SetIdx>,
    pub(super) set_index: IdMap<SetKey, SetIdx>,
    /// The set of the last allocation: most programs allocate on one stream at a time.
    pub(super) last_set: Option<(SetKey, SetIdx)>,
    /// Pool table; slot 0 is the default pools.
    pub(super) pools: Vec<PoolState>,
    pub(super) pending: Vec<(EventId, BlockIdx)>,
    /// Graph captures under way (see `capture.rs`): their capture ids and pools.
    pub(super) captures: Vec<super::capture::Underway>,
    /// Blocks freed during a capture after use on other streams: their events are recorded
    /// once no capture is under way (an event recorded on a captured stream is a graph node).
    pub(super) deferred: Vec<(BlockIdx, Vec<Use>)>,
    /// Segment frees, unmaps and reservation frees that reached the outbox's run while a
    /// capture was under way (queued before it began, or left behind by a slow hook): they run
    /// once the last capture ends.
    pub(super) held_back: Vec<Work>,
    /// Physical allocations (reservation, address, size, handle) a request mapped and did not
    /// take during a graph capture: unmapped when the last capture ends, if still free and no
    /// graph holds their pool (`expand::give_back_runs`).
    pub(super) unmap_after_capture: Vec<(u32, u64, usize, u64)>,
    /// Uses whose stream was being captured by someone else when the block was freed: their
    /// events are recorded once that capture is over (`events::retry_foreign`).
    pub(super) foreign: Vec<(BlockIdx, Use)>,
    /// The host reads and writes the memory (pinned): a freed block waits for the work queued
    /// on its own stream too (`Backend::host_visible`).
    pub(super) host_visible: bool,
    /// Frees, unmaps and reservation frees running outside the lock now: a capture begins only
    /// when there are none (`begin_capture` waits), so none runs during a capture.
    pub(super) freeing: u32,
    pub(super) raw: IdMap<u64, BlockIdx>,
    /// Streams other than its segment's that used a block (only blocks with `has_uses`).
    pub(super) uses: IdMap<BlockIdx, Vec<Use>>,
    /// Segment-side counters.
    pub(super) stats: Counters,
    /// Where the block-side counter changes of the locked section under way go (the calling
    /// thread's statistics: see `caching::Locked`).
    pub(super) sink: super::tcache::Sink,
    pub(super) tick: u64,
    pub(super) error: Option<Error>,
    /// A map guard's refusal to let memory be unmapped: reported by the next `empty_cache`,
    /// never to an allocation (`error` is).
    pub(super) vetoed: Option<Error>,
    /// Events and segment frees for outside the lock (see `DeviceAllocator::flush`).
    pub(super) outbox: Vec<Work>,
    /// Outbox items taken by runners so far (the sequence number of the next one to run).
    pub(super) taken: u64,
    /// Segment calls and maps under way outside the lock (see `begin_growth`).
    pub(super) growths: Vec<Growth>,
    /// The id of the next growth.
    pub(super) next_growth: u64,
    /// Bytes taken out of the cache and not yet given back (in the outbox or being freed).
    pub(super) releasing: usize,
    /// The allocator's id, for trace entries.
    pub(super) allocator: crate::id::AllocatorId,
    pub(super) device: usize,
    /// Expandable segments: their reservations (a slot is `None` once given back), the page
    /// size of the backend (`None`: it has no virtual memory) and the size of a reservation.
    pub(super) reservations: Vec<Option<super::expand::Reservation>>,
    pub(super) vm_page: Option<usize>,
    pub(super) reserve_size: usize,
    /// A pinned allocator's reserve segment (`pinned_reserve_segment_size_mb`): never given
    /// back while the allocator lives (`kept`); `Drop` clears it first.
    pub(super) kept_segment: Option<SegIdx>,
    /// A background thread files completed cross-stream frees (`background.rs`): allocations
    /// query no event, and a new pending event wakes the thread (`kick`).
    pub(super) background: bool,
    /// An event was queued for the background thread in this locked section (it is woken once
    /// the lock is let go).
    pub(super) kick: bool,
}

impl State {
    pub(super) fn new(
        config: Config,
        limit: Option<usize>,
        default_pool: PoolSpec,
        allocator: crate::id::AllocatorId,
        device: usize,
        board: crate::sync::Arc<crate::stats::Board>,
    ) -> State {
        State {
            config,
            limit,
            blocks: Vec::new(),
            free_blocks: Vec::new(),
            segments: Vec::new(),
            free_segments: Vec::new(),
            sets: Vec::new(),
            set_segments: Vec::new(),
            idle_sets: Vec::new(),
            set_index: IdMap::default(),
            last_set: None,
            pools: vec![PoolState {
                spec: default_pool,
                stats: PoolCounters::default(),
                segments: 0,
                released: false,
                live: true,
                pinned: 0,
            }],
            pending: Vec::new(),
            captures: Vec::new(),
            deferred: Vec::new(),
            held_back: Vec::new(),
            unmap_after_capture: Vec::new(),
            foreign: Vec::new(),
            host_visible: false,
            freeing: 0,
            raw: IdMap::default(),
            uses: IdMap::default(),
            stats: Counters::default(),
            sink: super::tcache::Sink::new(board),
            tick: 0,
            error: None,
            vetoed: None,
            outbox: Vec::new(),
            taken: 0,
            growths: Vec::new(),
            next_growth: 0,
            releasing: 0,
            allocator,
            device,
            reservations: Vec::new(),
            vm_page: None,
            reserve_size: 0,
            kept_segment: None,
            background: false,
            kick: false,
        }
    }

    /// Whether segment `seg` is the reserve segment, which nothing gives back while the
    /// allocator lives.
    #[inline]
    pub(super) fn kept(&self, seg: usize) -> bool {
        self.kept_segment == Some(SegIdx(seg as u32))
    }

    #[inline(always)]
    pub(super) fn block(&self, b: BlockIdx) -> &Block {
        &self.blocks[b.get()]
    }

    #[inline(always)]
    pub(super) fn block_mut(&mut self, b: BlockIdx) -> &mut Block {
        &mut self.blocks[b.get()]
    }

    #[inline(always)]
    pub(super) fn seg(&self, s: SegIdx) -> &Segment {
        &self.segments[s.0 as usize]
    }

    /// The slot a pool reference names, if that pool is still the one in it and takes
    /// allocations: a scope that outlived its pool (`mem::forget`) must never reach the pool
    /// that took over the slot, nor a released one.
    #[inline(always)]
    pub(super) fn resolve(&self, pool: PoolRef) -> Option<Slot> {
        if pool.slot == 0 {
            return Some(Slot::DEFAULT);
        }
        let p = self.pools.get(pool.slot as usize)?;
        (p.live && !p.released && p.spec.id == pool.id).then_some(Slot(pool.slot))
    }

    /// Queues `action` on `block` for the trace hooks (the caller checked `trace::enabled`).
    pub(super) fn emit(&mut self, action: Action, block: BlockIdx) {
        let stack = if action == Action::Alloc {
            let s = crate::stacks::capture();
            let b = self.block_mut(block);
            b.stack = s;
            b.stack_epoch = crate::stacks::epoch();
            s
        } else {
            // A free names the allocation's stack only if it is that allocation's (a block
            // handed out while nothing listened keeps an older occupant's).
            let b = self.block(block);
            if crate::stacks::current(b.stack, b.stack_epoch) {
                b.stack
            } else {
                0
            }
        };
        let b = self.block(block);
        let stream = self.seg(b.seg).stream.raw;
        let (pool, addr, size) = (self.pools[b.pool.get()].spec.id, b.addr, b.size);
        let mut e = TraceEntry::new(action, self.allocator, self.device, pool, addr, size, stream);
        e.stack = stack;
        // Block events are many: only segment-level ones carry the thread's subscriber.
        let d = match action {
            Action::Alloc | Action::FreeRequested | Action::FreeCompleted => Default::default(),
            _ => crate::trace::dispatch(),
        };
        self.outbox.push(Work::Event(e, d));
    }

    pub(super) fn emit_entry(
        &mut self,
        action: Action,
        pool: PoolId,
        addr: u64,
        size: usize,
        stream: crate::id::StreamId,
    ) {
        let e = TraceEntry::new(action, self.allocator, self.device, pool, addr, size, stream);
        self.outbox.push(Work::Event(e, crate::trace::dispatch()));
    }

    #[inline(always)]
    pub(super) fn set_for(&mut self, pool: Slot, stream: StreamKey, small: bool) -> SetIdx {
        let k = (pool, stream, small);
        if let Some((lk, i)) = self.last_set {
            if lk == k {
                return i;
            }
        }
        let i = match self.set_index.get(&k) {
            Some(&i) => i,
            None => {
                let i = match self.idle_sets.pop() {
                    Some(i) => i,
                    None => {
                        self.sets.push(FreeSet::new());
                        self.set_segments.push(0);
                        SetIdx((self.sets.len() - 1) as u32)
                    }
                };
                self.set_index.insert(k, i);
                i
            }
        };
        self.last_set = Some((k, i));
        i
    }

    #[inline(always)]
    pub(super) fn new_block(&mut self, b: Block) -> BlockIdx {
        match self.free_blocks.pop() {
            Some(i) => {
                self.blocks[i.get()] = b;
                i
            }
            None => {
                self.blocks.push(b);
                BlockIdx::new(self.blocks.len() - 1)
            }
        }
    }

    /// The best fitting free block of the set, removed from it; PyTorch's rule: the smallest block
    /// at or above `size`, unless it is an unsplittable oversize block that would waste too much.
    /// In a `no_split` pool, a block serves only requests within 20 MiB of its size.
    #[inline(always)]
    pub(super) fn best_fit(&mut self, set: SetIdx, size: usize, no_split: bool) -> Option<BlockIdx> {
        let max_split = self.config.max_split_size;
        let accept = |block: usize| {
            let whole_only = no_split || size >= max_split;
            !((size < max_split && block >= max_split) || (whole_only && block >= size + rules::LARGE_BUFFER))
        };
        let s = set.0 as usize;
        let (c1, k1) = self.sets[s].best_fit(size)?;
        if !accept(key_size(k1)) {
            return None;
        }
        let first = BlockIdx::from_key(key_idx(k1));
        let mut take = (c1, k1, first);
        // Expandable memory (PyTorch's rule): the free block at the end of a segment, with
        // unmapped space after it, counts as big as it can grow, so the next block in (size,
        // address) order is taken instead when what it can grow to is smaller, and the end
        // stays free to grow into. (No reservation, nothing expandable: no call, no segment
        // looked at.) The second block is looked at in place: only the one taken leaves the set.
        let grow = if self.reservations.is_empty() { 0 } else { self.unmapped_after(first) };
        if grow != 0 {
            if let Some((c2, k2)) = self.sets[s].next_after(c1, k1) {
                if accept(key_size(k2)) {
                    let second = BlockIdx::from_key(key_idx(k2));
                    let first_can = key_size(k1).saturating_add(grow);
                    let second_can = key_size(k2).saturating_add(self.unmapped_after(second));
                    if second_can < first_can {
                        take = (c2, k2, second);
                    }
                }
            }
        }
        self.sets[s].take(take.0, take.1);
        self.sink.gens().bump(set.0);
        Some(take.2)
    }

    #[inline(always)]
    pub(super) fn no_split(&self, pool: Slot) -> bool {
        pool != Slot::DEFAULT && self.pools[pool.get()].spec.no_split
    }

    #[inline(always)]
    pub(super) fn insert_free(&mut self, b: BlockIdx) {
        let blk = self.block(b);
        let (k, set) = (key(blk.size, blk.addr, b.to_key()), blk.set.0 as usize);
        self.sets[set].insert(k);
        self.sink.gens().bump(set as u32);
    }

    #[inline(always)]
    pub(super) fn remove_free(&mut self, b: BlockIdx) {
        let blk = self.block(b);
        let (k, set) = (key(blk.size, blk.addr, b.to_key()), blk.set.0 as usize);
        self.sets[set].remove(k);
        self.sink.gens().bump(set as u32);
    }

    /// Whether `b`'s segment counts in the inactive-split statistics: not an expandable one,
    /// a mapped range of a reservation (PyTorch leaves them out: their free pages can always
    /// be given back). A pinned reserve segment of an expandable pool is an ordinary one.
    #[inline(always)]
    pub(super) fn counts_inactive(&self, b: &Block) -> bool {
        self.segments[b.seg.0 as usize].res.is_none()
    }

    /// Counts (`add`) or uncounts a free block in the inactive-split stats.
    #[inline(always)]
    pub(super) fn count_inactive(&mut self, b: BlockIdx, add: bool) {
        let blk = self.block(b);
        if blk.state == BlockState::Free && blk.is_split() && self.counts_inactive(blk) {
            let (small, size) = (blk.small, blk.size);
            let (n, bytes) = (1, size as i64);
            self.sink.on_inactive_delta(small, if add { (n, bytes) } else { (-n, -bytes) });
        }
    }

    /// Hands out `block` (free, out of its set) for a request of `requested` bytes, `rounded`
    /// being the configuration's rounding of them: splits off the rest if the rules say so,
    /// counts it, and returns what the caller holds of it.
    #[inline]
    pub(super) fn take_block(&mut self, block: BlockIdx, rounded: usize, requested: usize) -> super::Allocation {
        self.take_block_inline(block, rounded, requested)
    }

    /// [`take_block`](Self::take_block), inlined into the locked allocation (its one hot caller).
    #[inline(always)]
    pub(super) fn take_block_inline(&mut self, block: BlockIdx, rounded: usize, requested: usize) -> super::Allocation {
        let b = self.block(block);
        let (small, pool) = (b.small, b.pool);
        // The inactive-split change of the whole step, counted once (as PyTorch counts a
        // step's net change): the block leaves, its rest (if split off) enters.
        let counted = self.counts_inactive(b);
        let mut inactive = if b.is_split() { (-1, -(b.size as i64)) } else { (0, 0) };
        // In expandable memory a large block splits as a small one does (PyTorch's rule there
        // too): a big free block costs no segment of its own, so its rest is worth keeping.
        let split = if small || !self.pools[pool.get()].spec.expandable {
            should_split(b.size, rounded, small, self.config.max_split_size)
        } else {
            should_split(b.size, rounded, true, self.config.max_split_size)
        };
        if !self.no_split(pool) && split {
            let rest_size = b.size - rounded;
            let rest = Block {
                addr: b.addr + rounded as u64,
                size: rest_size,
                requested: 0,
                seg: b.seg,
                prev: Some(block),
                next: b.next,
                set: b.set,
                pool,
                small,
                state: BlockState::Free,
                has_uses: false,
                pending: 0,
                stack: 0,
                stack_epoch: 0,
            };
            let next = b.next;
            let r = self.new_block(rest);
            if let Some(n) = next {
                self.block_mut(n).prev = Some(r);
            }
            let b = self.block_mut(block);
            b.next = Some(r);
            b.size = rounded;
            self.insert_free(r);
            inactive.0 += 1;
            inactive.1 += rest_size as i64;
        }
        if counted {
            self.sink.on_inactive_delta(small, inactive);
        }
        let b = self.block_mut(block);
        b.state = BlockState::Allocated;
        b.requested = requested;
        let size = b.size;
        let oversize = size >= self.config.max_split_size;
        self.sink.on_alloc(small, size, requested, oversize);
        if pool != Slot::DEFAULT {
            // A new peak of the pool leaves out its blocks other threads hold as deferred frees.
            let board = self.sink.board();
            let p = &mut self.pools[pool.get()];
            let id = p.spec.id.0;
            p.stats.on_alloc(size, requested, || board.pool_deferred(id));
        }
        if crate::trace::enabled() {
            self.emit(Action::Alloc, block);
        }
        self.allocation(block, rounded)
    }

    /// Elided allocations of a user pool (see `ThreadStats::pool_elided`: id, slot, count,
    /// bytes, bytes asked for) join its totals, if the pool is still the slot's.
    pub(super) fn fold_pool_elided(&mut self, e: [u64; 5]) {
        if let Some(p) = self.pools.get_mut(e[1] as usize) {
            if p.live && p.spec.id.0 == e[0] {
                p.stats.on_elided(e[2], e[3], e[4]);
            }
        }
    }

    /// What a caller holds of a block just handed out for a request whose rounded size is
    /// `rounded` (the configuration's rounding of the bytes asked for).
    #[inline(always)]
    fn allocation(&self, block: BlockIdx, rounded: usize) -> super::Allocation {
        let b = self.block(block);
        let p = &self.pools[b.pool.get()];
        super::Allocation {
            block,
            addr: b.addr,
            size: b.size,
            small: b.small,
            // As counted in the inactive-split statistics (never for expandable segments).
            split: b.is_split() && self.counts_inactive(b),
            pool: PoolRef { id: p.spec.id, slot: b.pool.0 },
            // Large blocks too: the cache keeps one, reused only while its free set is as it
            // was (so exactly where best fit would put it again), and filed back at this
            // thread's next locked call and before any segment is made.
            // Only blocks of the rounded size of their request (not those that kept a rest too
            // small to split off): a thread cache finds a block by the bytes asked for.
            // User pools' blocks only while the pool is live, caches its segments, and its
            // memory is not for the host (see `tcache`: they are cached as deferred frees).
            cacheable: b.size < self.config.max_split_size
                && b.size == rounded
                && (b.pool == Slot::DEFAULT
                    || (!p.released
                        && !p.spec.no_cache
                        && !p.spec.host_visible
                        && p.spec.map_guard.is_none()
                        && p.pinned == 0)),
            set: u64::from(b.set.0),
            gen: self.sink.gens().get(b.set.0),
        }
    }

    /// Its owner gives a block back: uncounted, and either free at once or, if other streams
    /// used it, awaiting their events.
    #[inline]
    pub(super) fn free(&mut self, be: &dyn crate::backend::Backend, block: BlockIdx) {
        self.free_with(be, block, true);
    }

    /// [`free`](Self::free); `device_used`: for host-visible memory, whether the device may have
    /// used the block since it was handed out.
    pub(super) fn free_with(&mut self, be: &dyn crate::backend::Backend, block: BlockIdx, device_used: bool) {
        let b = self.block_mut(block);
        if b.state != BlockState::Allocated {
            // Unreachable through the API (a block is freed by its one owner); never corrupt
            // the free sets over it.
            debug_assert!(false, "double free of block {block:?}");
            return;
        }
        let (size, requested, small, pool, has_uses) = (b.size, b.requested, b.small, b.pool, b.has_uses);
        let own_stream = (self.host_visible && device_used) || self.pools[pool.get()].spec.host_visible;
        let oversize = size >= self.config.max_split_size;
        self.sink.on_free_requested(small, size, requested, oversize);
        if pool != Slot::DEFAULT {
            self.pools[pool.get()].stats.on_free_requested(size, requested);
        }
        if crate::trace::enabled() {
            self.emit(Action::FreeRequested, block);
        }
        if !has_uses && !own_stream {
            // No other stream used it and nothing waits on its own: free at once (no vector of
            // uses made and dropped, the common case).
            self.free_block(block);
            return;
        }
        let mut uses = if has_uses {
            self.block_mut(block).has_uses = false;
            self.uses.remove(&block).unwrap_or_default()
        } else {
            Vec::new()
        };
        if own_stream {
            // The next owner may write it from the host at once, not in stream order: wait for
            // the block's own stream as for the others (its segment keeps that stream alive).
            let seg = self.block(block).seg;
            uses.push(Use { stream: self.seg(seg).stream, keep: None });
        }
        if uses.is_empty() {
            self.free_block(block);
            return;
        }
        self.block_mut(block).state = BlockState::AwaitingStreams;
        if !self.captures.is_empty() {
            self.deferred.push((block, uses));
            return;
        }
        self.record_uses(be, block, uses);
    }

    /// Makes a block free, merging it with free neighbours, and files it in its set. A wholly free
    /// segment of a released pool goes back at once.
    #[inline]
    pub(super) fn free_block(&mut self, block: BlockIdx) {
        if crate::trace::enabled() {
            self.emit(Action::FreeCompleted, block);
        }
        let b = self.block(block);
        let (small, size) = (b.small, b.size);
        self.sink.on_free_completed(small, size);
        self.file_free(block, (0, 0));
    }

    /// A block a thread cache held goes back to its free set: its owner's free and its
    /// completion were counted when it was cached (as inactive-split if `split`, its segment's
    /// state then), so only the filing is left; or, for a deferred free (`uncounted`), they
    /// are counted now.
    pub(super) fn free_cached(&mut self, c: super::tcache::Cached) {
        let block = c.block;
        let b = self.block(block);
        if b.state != BlockState::Allocated {
            debug_assert!(false, "a cached block that is not allocated: {block:?}");
            return;
        }
        let (small, size, requested) = (b.small, b.size, b.requested);
        if crate::trace::enabled() {
            self.emit(Action::FreeRequested, block);
            self.emit(Action::FreeCompleted, block);
        }
        if let Some(owner) = &c.uncounted {
            // Counted, and its owner's record of it goes, in one step for censuses and sums
            // (`Board::filing`); then the decrease is committed, so that an allocation after
            // it checks the peaks (a census may have left this block out while it waited).
            let board = self.sink.board().clone();
            {
                let _both = board.filing();
                // Cached blocks are never oversize.
                self.sink.on_free_requested(small, size, requested, false);
                self.sink.on_free_completed(small, size);
                owner.undefer_taken(c.word());
            }
            let pool = self.block(block).pool;
            if pool != Slot::DEFAULT {
                self.pools[pool.get()].stats.on_free_requested(size, requested);
            }
            self.sink.commit_kind(small);
            self.file_free(block, (0, 0));
            return;
        }
        if c.split {
            // It is filed below as any freed block, which counts the merged block as
            // inactive-split afresh; its own count from the cache goes, as it was counted
            // then, in the filing's one change.
            self.file_free(block, (-1, -(size as i64)));
            return;
        }
        self.file_free(block, (0, 0));
    }

    /// Marks a block free, merges it with free neighbours and files it in its set.
    /// `inactive`: an inactive-split change of the caller's, counted with the filing's (one
    /// change per step, as PyTorch's `free_block` counts its net change).
    #[inline]
    fn file_free(&mut self, block: BlockIdx, mut inactive: (i64, i64)) {
        let b = self.block_mut(block);
        let (pool, small) = (b.pool, b.small);
        b.state = BlockState::Free;
        b.requested = 0;
        b.pending = 0;
        let mut cur = block;
        // A free neighbour is of a split segment (it has a neighbour): it leaves the counts.
        if let Some(prev) = self.block(cur).prev {
            let p = self.block(prev);
            if p.state == BlockState::Free {
                inactive.0 -= 1;
                inactive.1 -= p.size as i64;
                self.remove_free(prev);
                self.merge_next_into(prev);
                cur = prev;
            }
        }
        if let Some(next) = self.block(cur).next {
            let n = self.block(next);
            if n.state == BlockState::Free {
                inactive.0 -= 1;
                inactive.1 -= n.size as i64;
                self.remove_free(next);
                self.merge_next_into(cur);
            }
        }
        self.insert_free(cur);
        let b = self.block(cur);
        if b.is_split() {
            inactive.0 += 1;
            inactive.1 += b.size as i64;
        }
        if self.counts_inactive(b) {
            self.sink.on_inactive_delta(small, inactive);
        }
        let b = self.block(cur);
        if !b.is_split() {
            let seg = b.seg;
            self.segments[seg.0 as usize].freed_at = self.tick;
            let p = &self.pools[pool.get()];
            if p.released {
                if pool != Slot::DEFAULT {
                    self.release_whole(seg);
                    self.retire_pool_if_empty(pool);
                }
            } else if p.spec.no_cache {
                self.release_whole(seg);
            }
        }
    }

    /// Merges `b`'s successor into `b`; neither may be in a set.
    #[inline(always)]
    fn merge_next_into(&mut self, b: BlockIdx) {
        let n = self.block(b).next.expect("a successor to merge");
        let (nsize, nnext) = (self.block(n).size, self.block(n).next);
        let blk = self.block_mut(b);
        blk.size += nsize;
        blk.next = nnext;
        if let Some(nn) = nnext {
            self.block_mut(nn).prev = Some(b);
        }
        self.free_blocks.push(n);
    }

    /// Whether segment `seg` is live and wholly free.
    pub(super) fn wholly_free(&self, seg: usize) -> bool {
        let s = &self.segments[seg];
        s.live
            && s.head.is_some_and(|h| {
                let b = self.block(h);
                b.state == BlockState::Free && !b.is_split()
            })
    }

    /// The blocks of a segment in address order.
    pub(super) fn blocks_of(&self, seg: &Segment) -> impl Iterator<Item = &Block> + '_ {
        std::iter::successors(seg.head.map(|h| self.block(h)), |b| b.next.map(|n| self.block(n)))
    }
}

impl State {
    /// Records a growth of `size` bytes for `key` (its request's leaving `spare` bytes free),
    /// before the lock is let go for it; `end_growth` with the id it returns takes it back.
    pub(super) fn begin_growth(&mut self, key: SetKey, size: usize, spare: usize) -> u64 {
        let id = self.next_growth;
        self.next_growth += 1;
        self.growths.push(Growth { id, key, size, spare, gen: crate::sync::fork_generation() });
        id
    }

    /// Best fit for a request of `rounded` bytes (`requested` asked for) in pool `slot` on
    /// `stream`, taken (split and counted) if there is one.
    pub(super) fn take_fit(
        &mut self,
        slot: Slot,
        stream: StreamKey,
        rounded: usize,
        requested: usize,
    ) -> Option<super::Allocation> {
        let set = self.set_for(slot, stream, rules::is_small(rounded));
        let b = self.best_fit(set, rounded, self.no_split(slot))?;
        Some(self.take_block(b, rounded, requested))
    }

    /// Takes back the growth `begin_growth` recorded as `id`.
    pub(super) fn end_growth(&mut self, id: u64) {
        if let Some(i) = self.growths.iter().position(|g| g.id == id) {
            self.growths.swap_remove(i);
        }
    }

    /// Bytes being obtained from the device right now, outside the lock (by threads of this
    /// process).
    pub(super) fn growing(&self) -> usize {
        let gen = crate::sync::fork_generation();
        self.growths.iter().filter(|g| g.gen == gen).map(|g| g.size).sum()
    }

    /// The id the next growth will get: growths with lower ids are those under way or ended.
    pub(super) fn growth_mark(&self) -> u64 {
        self.next_growth
    }

    /// Whether a growth begun before `mark` is still under way (in this process) that may leave
    /// a block of `rounded` bytes free in `key`'s set, or, with `any`, any growth begun before
    /// `mark` (whose bytes the memory-fraction limit counted).
    pub(super) fn growth_may_serve(&self, key: SetKey, rounded: usize, mark: u64, any: bool) -> bool {
        let gen = crate::sync::fork_generation();
        self.growths.iter().any(|g| g.gen == gen && g.id < mark && (any || (g.key == key && g.spare >= rounded)))
    }
}
