//! Memory statistics, with the names and meaning of `torch.cuda.memory_stats()`.

use crate::sync::{fence, Arc, AtomicBool, AtomicI64, AtomicU64, Mutex, MutexGuard, Ordering};
use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::format::bytes;

/// One statistic: its current value, peak, and the totals of increases and decreases.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stat {
    /// The value now.
    pub current: i64,
    /// The highest value since creation or the last [`reset_peak_stats`](crate::Allocator::reset_peak_stats).
    pub peak: i64,
    /// Sum of all increases.
    pub allocated: u64,
    /// Sum of all decreases.
    pub freed: u64,
}

/// The allocator's own counters: all, small and large side by side in arrays, so an update is a
/// few branch-free instructions (this runs several times per allocation). `freed` is derived as
/// `allocated - current` when the public [`MemoryStats`] is made.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Tally {
    cur: [i64; 3],
    peak: [i64; 3],
    total: [u64; 3],
}

impl Tally {
    #[inline]
    pub(crate) fn add(&mut self, small: bool, n: usize) {
        let i = 2 - small as usize;
        let n = n as i64;
        self.cur[0] += n;
        self.cur[i] += n;
        self.total[0] += n as u64;
        self.total[i] += n as u64;
        self.peak[0] = self.peak[0].max(self.cur[0]);
        self.peak[i] = self.peak[i].max(self.cur[i]);
    }

    #[inline]
    pub(crate) fn sub(&mut self, small: bool, n: usize) {
        let i = 2 - small as usize;
        self.cur[0] -= n as i64;
        self.cur[i] -= n as i64;
    }

    /// Undoes a `sub` (the current value and peak go back up; the totals stay).
    pub(crate) fn unsub(&mut self, small: bool, n: usize) {
        let i = 2 - small as usize;
        for j in [0, i] {
            self.cur[j] += n as i64;
            self.peak[j] = self.peak[j].max(self.cur[j]);
        }
    }

    /// The current value over all blocks.
    #[inline]
    pub(crate) fn current(&self) -> i64 {
        self.cur[0]
    }

    fn reset_peak(&mut self) {
        self.peak = self.cur;
    }

    fn stat(&self, i: usize) -> Stat {
        Stat {
            current: self.cur[i],
            peak: self.peak[i],
            allocated: self.total[i],
            freed: self.total[i] - self.cur[i] as u64,
        }
    }

    fn array(&self) -> StatArray {
        StatArray { all: self.stat(0), small_pool: self.stat(1), large_pool: self.stat(2) }
    }
}

/// A single running statistic: current, peak, total of increases.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Tally1 {
    cur: i64,
    peak: i64,
    total: u64,
}

impl Tally1 {
    #[inline]
    pub(crate) fn add(&mut self, n: usize) {
        self.cur += n as i64;
        self.total += n as u64;
        self.peak = self.peak.max(self.cur);
    }

    #[inline]
    pub(crate) fn sub(&mut self, n: usize) {
        self.cur -= n as i64;
    }

    /// Undoes a `sub`.
    pub(crate) fn unsub(&mut self, n: usize) {
        self.cur += n as i64;
        self.peak = self.peak.max(self.cur);
    }

    fn stat(&self) -> Stat {
        Stat { current: self.cur, peak: self.peak, allocated: self.total, freed: self.total - self.cur as u64 }
    }
}

/// A user pool's own counters: the ones worth their cost on the allocation path (see
/// [`PoolStats`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct PoolCounters {
    pub(crate) allocation: Tally1,
    pub(crate) allocated_bytes: Tally1,
    pub(crate) requested_bytes: Tally1,
    pub(crate) segment: Tally1,
    pub(crate) reserved_bytes: Tally1,
    pub(crate) num_ooms: u64,
    pub(crate) num_device_alloc: u64,
    pub(crate) num_device_free: u64,
}

impl PoolCounters {
    /// The peaks restart from the values now, less the pool's blocks threads hold as deferred
    /// frees (`deferred`: count, bytes, bytes asked for).
    pub(crate) fn reset_peak_less(&mut self, deferred: [i64; 3]) {
        self.reset_peak();
        let t = [&mut self.allocation, &mut self.allocated_bytes, &mut self.requested_bytes];
        for (t, d) in t.into_iter().zip(deferred) {
            t.peak -= d;
        }
    }

    pub(crate) fn reset_peak(&mut self) {
        for t in [
            &mut self.allocation,
            &mut self.allocated_bytes,
            &mut self.requested_bytes,
            &mut self.segment,
            &mut self.reserved_bytes,
        ] {
            t.peak = t.cur;
        }
    }

    pub(crate) fn report(&self, active_bytes: usize, inactive_split_bytes: usize) -> PoolStats {
        PoolStats {
            allocation: self.allocation.stat(),
            allocated_bytes: self.allocated_bytes.stat(),
            requested_bytes: self.requested_bytes.stat(),
            segment: self.segment.stat(),
            reserved_bytes: self.reserved_bytes.stat(),
            active_bytes,
            inactive_split_bytes,
            num_ooms: self.num_ooms,
            num_segment_alloc: self.num_device_alloc,
            num_segment_free: self.num_device_free,
        }
    }
}

/// What [`MemPool::memory_stats`](crate::MemPool::memory_stats) returns: one pool's own figures.
/// The device's [`MemoryStats`] include every pool; a pool tracks the statistics that matter per
/// pool (with peaks and totals) and reports its active and non-releasable bytes as they are now,
/// so that allocating inside a scope costs no more than outside one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Allocated blocks.
    pub allocation: Stat,
    /// Bytes in allocated blocks.
    pub allocated_bytes: Stat,
    /// Bytes the callers asked for.
    pub requested_bytes: Stat,
    /// Segments.
    pub segment: Stat,
    /// Bytes of all segments.
    pub reserved_bytes: Stat,
    /// Bytes in blocks that are allocated or awaiting other streams, now.
    pub active_bytes: usize,
    /// Bytes in free blocks of split segments, now.
    pub inactive_split_bytes: usize,
    /// Allocations into this pool that failed for lack of memory.
    pub num_ooms: u64,
    /// Segments obtained from the pool's allocator (or the device).
    pub num_segment_alloc: u64,
    /// Segments given back.
    pub num_segment_free: u64,
}

/// The allocator's segment-side counters, kept under its lock (segments are made and given back
/// there, so these change only on slow paths). The block-side counters are per thread: [`ThreadStats`].
#[derive(Debug, Clone, Default)]
pub(crate) struct Counters {
    pub(crate) segment: Tally,
    pub(crate) reserved_bytes: Tally,
    pub(crate) num_alloc_retries: u64,
    pub(crate) num_ooms: u64,
    pub(crate) num_sync_all_streams: u64,
    pub(crate) num_device_alloc: u64,
    pub(crate) num_device_free: u64,
    pub(crate) oversize_segments: Tally,
}

impl Counters {
    /// A segment whose free was refused is back: its release is undone (no total changes).
    pub(crate) fn on_segment_restored(&mut self, small: bool, size: usize, oversize: bool) {
        self.segment.unsub(small, 1);
        self.reserved_bytes.unsub(small, size);
        if oversize {
            self.oversize_segments.unsub(false, 1);
        }
        self.num_device_free -= 1;
    }

    /// Memory mapped into an expandable segment (`added`) or unmapped: reserved bytes and a
    /// device call. (Its segments, the contiguous mapped ranges, are counted by `on_range`.)
    pub(crate) fn on_map(&mut self, small: bool, size: usize, added: bool) {
        if added {
            self.reserved_bytes.add(small, size);
            self.num_device_alloc += 1;
        } else {
            self.reserved_bytes.sub(small, size);
            self.num_device_free += 1;
        }
    }

    /// An unmap that failed: its memory is reserved again (no total changes).
    pub(crate) fn on_map_restored(&mut self, small: bool, size: usize) {
        self.reserved_bytes.unsub(small, size);
        self.num_device_free -= 1;
    }

    /// A contiguous mapped range of an expandable segment appeared (`added`) or went.
    pub(crate) fn on_range(&mut self, small: bool, added: bool) {
        if added {
            self.segment.add(small, 1);
        } else {
            self.segment.sub(small, 1);
        }
    }

    /// A segment obtained from the device (`added`) or given back.
    pub(crate) fn on_segment(&mut self, small: bool, size: usize, oversize: bool, added: bool, _device_call: bool) {
        if added {
            self.segment.add(small, 1);
            self.reserved_bytes.add(small, size);
            if oversize {
                self.oversize_segments.add(false, 1);
            }
            self.num_device_alloc += 1;
        } else {
            self.segment.sub(small, 1);
            self.reserved_bytes.sub(small, size);
            if oversize {
                self.oversize_segments.sub(false, 1);
            }
            self.num_device_free += 1;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Block-side statistics: per thread, without a shared hot cache line.
//
// Every change to the block-side counters (allocations, active and inactive-split blocks,
// allocated, active, requested bytes, oversize allocations) is made by some thread, and goes to
// that thread's [`ThreadStats`]: its current values and totals, atomics written by that thread
// only (a load and a store, no read-modify-write), per counter and pool kind (small, large); the
// "all" figures are their sums. A device-wide *current* value is the sum over threads
// (`Board::sum`): exact whenever the allocator is quiescent.
//
// A *peak* cannot be summed. Each thread also keeps, per entry, `committed`: how much of its
// current value it has added to a device-wide atomic `g` (so `g` = Σ committed, and never below
// the true sum: a thread commits at once when its value rises above what it committed, and
// lets it fall up to a slack below before it commits the decrease). Only when a commit takes
// `g` (for "all": the two kinds' `g` together) above the peak is the true sum read from every
// thread (`Board::census`, under the members' lock); the peak becomes the smaller of the two.
// So the peak is exact while one thread works and the others hold no uncommitted decreases
// (one thread; threads that take turns without caching in between). It can fall short when a
// thread rises back within its slack after another thread's census (RELIABILITY.md, "Known
// gaps", gives the sequence); making every thread commit
// after such a census was tried and collapsed 16 threads to a twentieth of their throughput
// (each census set off commits that set off the next census). With threads racing, the sum read
// may miss what the others change meanwhile. A thread that cycles allocations and frees within
// its slack (the hot case) touches no shared cache line at all.
// ---------------------------------------------------------------------------------------------

/// Block-side counters, in this order; each has all / small / large. (The scheme: see the
/// comment above.)
pub(crate) const ALLOCATION: usize = 0;
pub(crate) const ACTIVE: usize = 1;
pub(crate) const INACTIVE_SPLIT: usize = 2;
pub(crate) const ALLOCATED_BYTES: usize = 3;
pub(crate) const ACTIVE_BYTES: usize = 4;
pub(crate) const INACTIVE_SPLIT_BYTES: usize = 5;
pub(crate) const REQUESTED_BYTES: usize = 6;
pub(crate) const OVERSIZE_ALLOCATIONS: usize = 7;
const STATS: usize = 8;
/// Public entries: counter * 3 + (0 all, 1 small, 2 large).
pub(crate) const N: usize = STATS * 3;
/// Per-thread entries: counter * 2 + (0 small, 1 large).
const M: usize = STATS * 2;

/// How far below its committed value a thread's count may fall before it commits.
const COUNT_SLACK: i64 = 4096;
/// The least byte slack; a thread's grows to twice the largest block it freed into its cache.
pub(crate) const MIN_BYTE_SLACK: i64 = 1 << 30;
const MAX_BYTE_SLACK: i64 = 16 << 30;

#[inline(always)]
const fn is_bytes(s: usize) -> bool {
    matches!(s, ALLOCATED_BYTES | ACTIVE_BYTES | INACTIVE_SPLIT_BYTES | REQUESTED_BYTES)
}

/// The device-wide side: `g[e]` = Σ over threads of their committed values, `peak[i]` the
/// peaks (public entries); and every thread's counters (`members`, and `retired` for
/// threads that exited), so that a new peak is checked against the true sum.
#[derive(Debug)]
pub(crate) struct Board {
    /// Not a statistic, but shared the same way (the allocator's state and its thread caches):
    /// a generation per free set, bumped under the lock at each change of the set.
    pub(crate) gens: SetGens,
    /// `g[e] + g_shared[e]` = Σ committed of entry `e`. `g` is written by the one member
    /// named by `solo` only, with a load and a store (no locked instruction: a commit per
    /// rising allocation on the locked path cost a sixteenth of a `latency mixed` step);
    /// `g_shared` by everyone else, with atomic adds. One writer: a thread is named `solo` only
    /// after every other member has retired, and a member retires only after its thread is
    /// done with its counters (its cache's orphan flag, released, read by the drain that
    /// retires it, which then names the new `solo` under the members' lock); the retired
    /// counters and cache-less threads are never `solo`.
    g: [AtomicI64; M],
    g_shared: [AtomicI64; M],
    peak: [AtomicI64; N],
    members: Mutex<Vec<Arc<ThreadStats>>>,
    /// The address of the one member while there is exactly one (0 otherwise), set under the
    /// members' lock: its census needs no lock (see `census`).
    solo: AtomicU64,
    /// Written only under the registry's retired lock, and only after `retired_written` is set
    /// (`retired_to_write`, `retire`).
    retired: Arc<ThreadStats>,
    /// Whether `retired` was ever written (set before the first write, never cleared): until
    /// then its counters are all zero, and the one member's census (see `census`) skips them.
    retired_written: AtomicBool,
    /// Exited threads' elided pool allocations (see `ThreadStats::pool_elided`), moved here
    /// under the members' lock when they retire; added to their pools' counters under the
    /// allocator's lock.
    retired_pools: Mutex<Vec<[u64; 5]>>,
}

impl Default for Board {
    fn default() -> Board {
        Board {
            gens: SetGens::default(),
            g: std::array::from_fn(|_| AtomicI64::new(0)),
            g_shared: std::array::from_fn(|_| AtomicI64::new(0)),
            peak: std::array::from_fn(|_| AtomicI64::new(0)),
            members: Mutex::new(Vec::new()),
            solo: AtomicU64::new(0),
            retired: Arc::new(ThreadStats::default()),
            retired_written: AtomicBool::new(false),
            retired_pools: Mutex::new(Vec::new()),
        }
    }
}

/// Free sets sharing one generation counter (by set index modulo this).
const GENS: usize = 64;

/// A generation per free set, changed (under the allocator's lock) whenever a block enters or
/// leaves the set; sets that share a counter only bump it more often. A thread that cached a
/// block compares the generation of its set when it reuses it with the one right after it was
/// handed out: equal, the set is as it was, so freeing the block and best fit again would hand
/// out the same block at the same address (see `tcache`, the large bin).
#[derive(Debug)]
pub(crate) struct SetGens([AtomicU64; GENS]);

impl Default for SetGens {
    fn default() -> SetGens {
        SetGens(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl SetGens {
    /// Under the allocator's lock (the only writer).
    #[inline(always)]
    pub(crate) fn bump(&self, set: u32) {
        let g = &self.0[set as usize % GENS];
        g.store(g.load(Ordering::Relaxed).wrapping_add(1), Ordering::Release);
    }

    #[inline(always)]
    pub(crate) fn get(&self, set: u32) -> u64 {
        self.0[set as usize % GENS].load(Ordering::Acquire)
    }
}

/// The members' lock, held: its thread may not take it again (a census or a sum inside a
/// filing would wait for ever on itself). Debug builds check that rule on every take.
pub(crate) struct Members<'a> {
    guard: MutexGuard<'a, Vec<Arc<ThreadStats>>>,
}

#[cfg(all(debug_assertions, not(loom)))]
std::thread_local! {
    /// Whether this thread holds a members' lock (of any board: none is taken inside another).
    static HOLDS_MEMBERS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl std::ops::Deref for Members<'_> {
    type Target = Vec<Arc<ThreadStats>>;
    fn deref(&self) -> &Self::Target {
        &self.guard
    }
}

impl std::ops::DerefMut for Members<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.guard
    }
}

impl Drop for Members<'_> {
    fn drop(&mut self) {
        #[cfg(all(debug_assertions, not(loom)))]
        let _ = HOLDS_MEMBERS.try_with(|h| h.set(false));
    }
}

fn lock_members(m: &Mutex<Vec<Arc<ThreadStats>>>) -> Members<'_> {
    #[cfg(all(debug_assertions, not(loom)))]
    let _ = HOLDS_MEMBERS.try_with(|h| {
        assert!(
            !h.replace(true),
            "a members' lock taken by the thread that holds one (a census or sum inside a filing?)"
        )
    });
    Members { guard: m.lock().unwrap_or_else(|p| p.into_inner()) }
}

/// One thread's block-side counters (see the comment above [`ALLOCATION`]). Written by their
/// thread only (a load and a store, no read-modify-write: nothing is shared on the hot path),
/// or, for a thread that has exited or has no locals left, under the registry's `retired`
/// lock; read by anyone.
#[derive(Debug)]
pub(crate) struct ThreadStats {
    cur: [AtomicI64; M],
    total: [AtomicU64; M],
    committed: [AtomicI64; M],
    /// The block its thread cached last, while that free is not counted yet (a *deferred*
    /// free, see `caching::tcache`): the cache slot's word (0: none), its size with the flags
    /// [`DEF_SMALL`] and [`DEF_SPLIT`], and the bytes asked for. `cur` still counts the block
    /// allocated; every reader takes it off ([`ThreadStats::deferred`]), so sums and censuses
    /// are those of the true state. Written by the owner (set, cleared), and cleared by a
    /// drain that takes the block (a compare-exchange on the word).
    def_word: AtomicU64,
    def_size: AtomicU64,
    def_req: AtomicU64,
    /// The deferred block's pool (its id; 0: the default pools).
    def_pool: AtomicU64,
    /// A peak census (device or pool) left the deferred block out of a sum below the
    /// committed one: taking it back may make a new peak (see `take_clipped`).
    def_clipped: AtomicBool,
    /// Deferred frees of one user pool's blocks that its thread took back, not yet added to
    /// the pool's totals: the pool (id, slot; id 0: none), count, bytes, bytes asked for.
    /// Written by its thread; added to the pool's counters (and zeroed) by its thread under
    /// the allocator's lock, so readers of pool statistics, who hold that lock, see each once.
    pool_elided: [AtomicU64; 5],
    /// Deferred frees whose block its thread took back (an allocation and a free that cancel
    /// out, counted in the totals only), per kind (`kind * ELIDED + field`): count, bytes,
    /// bytes asked for, and of those, blocks and bytes of split segments.
    elided: [AtomicU64; 2 * ELIDED],
    /// Take-backs of deferred blocks described by the record now in `def_size` and `def_req`
    /// (whatever `def_word` says) not yet added to `elided`: a take-back bumps this one
    /// counter, and the record's figures times it join `elided` when a deferred free with
    /// other figures replaces the record (a thread that frees and allocates one size in turn
    /// keeps one record). Readers add it in (`add_into`, `absorb`).
    def_hits: AtomicU64,
    /// The peaks were reset (by another thread) while this thread held uncommitted decreases:
    /// the new peaks are below the committed sum, so before its next rise (`before_rise`: its
    /// next locked call, or counted reuse from its cache) it commits everything and checks
    /// every peak (a rise back within its own committed value would otherwise pass a peak
    /// unseen). Once per thread per reset.
    recheck: AtomicBool,
    /// Odd while its thread is inside a step that moves its record and its counters together
    /// (`settle_record`): readers of other threads' counters (a census, a sum) read again
    /// until they saw it even and unchanged around their reads, so they never see the record
    /// gone and the counters not yet moved (the block counted allocated as well as free).
    /// No commit (so no census, which takes the members' lock) inside a step.
    seq: AtomicU64,
    /// The process's fork generation when its thread last entered a step: a reader in a child
    /// process reads at once a number left odd by a thread of the parent (which does not exist
    /// there, so would never finish its step).
    seq_gen: AtomicU64,
}

/// Fields of `ThreadStats::elided` per kind.
const ELIDED: usize = 5;
/// `def_size` flags: the deferred block is small; its segment is split.
const DEF_SMALL: u64 = 1 << 63;
const DEF_SPLIT: u64 = 1 << 62;

impl Default for ThreadStats {
    fn default() -> ThreadStats {
        ThreadStats {
            cur: std::array::from_fn(|_| AtomicI64::new(0)),
            total: std::array::from_fn(|_| AtomicU64::new(0)),
            committed: std::array::from_fn(|_| AtomicI64::new(0)),
            def_word: AtomicU64::new(0),
            def_size: AtomicU64::new(0),
            def_req: AtomicU64::new(0),
            def_pool: AtomicU64::new(0),
            def_clipped: AtomicBool::new(false),
            pool_elided: std::array::from_fn(|_| AtomicU64::new(0)),
            elided: std::array::from_fn(|_| AtomicU64::new(0)),
            def_hits: AtomicU64::new(0),
            recheck: AtomicBool::new(false),
            seq: AtomicU64::new(0),
            seq_gen: AtomicU64::new(0),
        }
    }
}

/// The byte slack a thread that caches blocks of `size` bytes wants: twice that, at least
/// [`MIN_BYTE_SLACK`], at most 16 GiB. (A large slack costs nothing in exactness: a new peak is
/// checked against the true sum; it only lets a thread's frees and allocations go uncommitted.)
pub(crate) fn slack_for(size: usize) -> i64 {
    (size as i64).saturating_mul(2).clamp(MIN_BYTE_SLACK, MAX_BYTE_SLACK)
}

impl ThreadStats {
    /// Its thread (the only writer) changes counter `s` of one pool kind by `n`.
    #[inline(always)]
    fn change(&self, board: &Board, s: usize, small: bool, n: i64, byte_slack: i64) {
        let e = s * 2 + !small as usize;
        let c = self.apply(e, n);
        self.commit_if_due(board, s, e, c, byte_slack);
    }

    /// Moves entry `e` by `n` (its total too, for a rise): the new value.
    #[inline(always)]
    fn apply(&self, e: usize, n: i64) -> i64 {
        let c = self.cur[e].load(Ordering::Relaxed) + n;
        self.cur[e].store(c, Ordering::Relaxed);
        if n > 0 {
            let t = self.total[e].load(Ordering::Relaxed) + n as u64;
            self.total[e].store(t, Ordering::Relaxed);
        }
        c
    }

    /// Commits entry `e` (of counter `s`, now `c`) if it rose above its committed value or fell
    /// more than its slack below.
    #[inline(always)]
    fn commit_if_due(&self, board: &Board, s: usize, e: usize, c: i64, byte_slack: i64) {
        let k = self.committed[e].load(Ordering::Relaxed);
        let slack = if is_bytes(s) { byte_slack } else { COUNT_SLACK };
        if c > k || k - c > slack {
            self.commit(board, e);
        }
    }

    /// Before its thread counts a rise (the lock taken, or a counted reuse from its cache):
    /// see `recheck`.
    #[inline(always)]
    pub(crate) fn before_rise(&self, board: &Board) {
        if self.recheck.load(Ordering::Relaxed) {
            self.recheck_all(board);
        }
    }

    /// Whether this thread holds an uncommitted decrease (read by others under the members'
    /// lock: a snapshot, as good as the reset that asks).
    fn holds_decrease(&self) -> bool {
        (0..M).any(|e| self.committed[e].load(Ordering::Relaxed) > self.cur[e].load(Ordering::Relaxed))
    }

    /// See `recheck`: commits every entry, then checks every peak against the filter (a census
    /// where it is above: the true sum, as after a reset, which the rise that follows then
    /// passes only by committing).
    #[cold]
    #[inline(never)]
    fn recheck_all(&self, board: &Board) {
        self.recheck.store(false, Ordering::Relaxed);
        self.commit_all(board);
        for e in 0..M {
            let (s, large) = (e / 2, e % 2);
            let g = board.g(e);
            if g > board.peak[s * 3 + 1 + large].load(Ordering::Relaxed) {
                board.census(s * 3 + 1 + large, g, self);
            }
            let all = g + board.g(e ^ 1);
            if all > board.peak[s * 3].load(Ordering::Relaxed) {
                board.census(s * 3, all, self);
            }
        }
    }

    #[inline(never)]
    fn commit(&self, board: &Board, e: usize) {
        let c = self.cur[e].load(Ordering::Relaxed);
        let d = c - self.committed[e].load(Ordering::Relaxed);
        if d == 0 {
            return;
        }
        let g = board.add_g(self, e, d);
        self.committed[e].store(c, Ordering::Relaxed);
        if d > 0 {
            // A read first: most commits set no new peak, and a load leaves the line shared.
            let (s, large) = (e / 2, e % 2);
            if g > board.peak[s * 3 + 1 + large].load(Ordering::Relaxed) {
                board.census(s * 3 + 1 + large, g, self);
            }
            // The other kind's `g` counts its uncommitted decreases (never less than its true
            // sum), so a filter under the peak needs nothing more. Above it, those decreases
            // are committed first: then, with one thread, the filter is exact, a census runs
            // only for a true new peak, and "all" cannot pass that peak later through the other
            // kind rising back within its slack unchecked. (Committing them at every rising
            // commit cost a second atomic add per allocation whenever kinds alternate.)
            let peak = board.peak[s * 3].load(Ordering::Relaxed);
            let mut all = g + board.g(e ^ 1);
            if all > peak && self.cur[e ^ 1].load(Ordering::Relaxed) != self.committed[e ^ 1].load(Ordering::Relaxed) {
                self.commit(board, e ^ 1);
                all = g + board.g(e ^ 1);
            }
            if all > peak {
                board.census(s * 3, all, self);
            }
        }
    }

    /// Its thread cached a block without counting the free (a deferred free): `word` is the
    /// cache slot's word for it (never 0).
    #[inline(always)]
    pub(crate) fn defer(&self, word: u64, small: bool, size: usize, requested: usize, split: bool, pool: u64) {
        let flags = if small { DEF_SMALL } else { 0 } | if split { DEF_SPLIT } else { 0 };
        let v = size as u64 | flags;
        if self.def_size.load(Ordering::Relaxed) != v || self.def_req.load(Ordering::Relaxed) != requested as u64 {
            self.change_record(v, requested as u64);
        }
        self.def_pool.store(pool, Ordering::Relaxed);
        self.def_clipped.store(false, Ordering::Relaxed);
        self.def_word.store(word, Ordering::Release);
    }

    /// Its thread took back a deferred block of user pool `(id, slot)`: the pool's totals
    /// move by one allocation (added to the pool's counters at its next locked call).
    #[inline(always)]
    pub(crate) fn on_pool_elided(&self, id: u64, slot: u32, size: usize, requested: usize) {
        let e = &self.pool_elided;
        if e[0].load(Ordering::Relaxed) != id {
            e[0].store(id, Ordering::Relaxed);
            e[1].store(u64::from(slot), Ordering::Relaxed);
        }
        for (a, n) in e[2..].iter().zip([1, size as u64, requested as u64]) {
            a.store(a.load(Ordering::Relaxed) + n, Ordering::Relaxed);
        }
    }

    /// The pool whose elided allocations this thread holds (id 0: none).
    #[inline(always)]
    pub(crate) fn pool_elided_id(&self) -> u64 {
        self.pool_elided[0].load(Ordering::Relaxed)
    }

    /// Takes this thread's elided pool allocations out (by its thread, under the allocator's
    /// lock): (pool id, slot, count, bytes, bytes asked for).
    pub(crate) fn take_pool_elided(&self) -> Option<[u64; 5]> {
        if self.pool_elided_id() == 0 {
            return None;
        }
        let v = std::array::from_fn(|i| self.pool_elided[i].load(Ordering::Relaxed));
        for a in &self.pool_elided {
            a.store(0, Ordering::Relaxed);
        }
        Some(v)
    }

    /// This thread's deferred block if it is of pool `id`: (1, bytes, bytes asked for).
    fn deferred_in_pool(&self, id: u64) -> [i64; 3] {
        if id == 0 || self.def_word.load(Ordering::Acquire) == 0 || self.def_pool.load(Ordering::Relaxed) != id {
            return [0; 3];
        }
        let size = (self.def_size.load(Ordering::Relaxed) & !(DEF_SMALL | DEF_SPLIT)) as i64;
        [1, size, self.def_req.load(Ordering::Relaxed) as i64]
    }

    /// The deferred free is settled (counted, or cancelled by a reuse): by its thread.
    #[inline(always)]
    pub(crate) fn undefer(&self) {
        self.def_word.store(0, Ordering::Release);
    }

    /// Its thread enters a step (see `seq`): returns the number to end it with.
    #[inline(always)]
    fn step_begin(&self) -> u64 {
        let gen = crate::sync::fork_generation();
        if self.seq_gen.load(Ordering::Relaxed) != gen {
            self.seq_gen.store(gen, Ordering::Relaxed);
        }
        let q = self.seq.load(Ordering::Relaxed);
        // Release: a reader that reads the odd number reads this step's `seq_gen`.
        self.seq.store(q.wrapping_add(1), Ordering::Release);
        // The odd number is seen by any reader that sees a store of the step.
        fence(Ordering::Release);
        q.wrapping_add(2)
    }

    #[inline(always)]
    fn step_end(&self, q: u64) {
        self.seq.store(q, Ordering::Release);
    }

    /// The record's figures change (no record is set): its take-backs join `elided`, and the
    /// figures are replaced, in one step for readers (a sum reads `def_hits`, the figures and
    /// `elided` together: between the fold's stores it counted the take-backs twice, or with
    /// the next record's figures, and a total went down at the next read).
    #[cold]
    #[inline(never)]
    fn change_record(&self, v: u64, requested: u64) {
        let q = self.step_begin();
        self.fold_def_hits();
        self.def_size.store(v, Ordering::Relaxed);
        self.def_req.store(requested, Ordering::Relaxed);
        self.step_end(q);
    }

    /// Its thread counts the free of its deferred block, cached (as `undefer` then `on_cache`),
    /// in one step for readers (see `seq`); the commits follow the step.
    #[inline(never)]
    pub(crate) fn settle_record(
        &self,
        board: &Board,
        slack: i64,
        small: bool,
        size: usize,
        requested: usize,
        split: bool,
    ) {
        let k = !small as usize;
        let sz = size as i64;
        let moves = [
            (ALLOCATION, -1),
            (ALLOCATED_BYTES, -sz),
            (REQUESTED_BYTES, -(requested as i64)),
            (ACTIVE, -1),
            (ACTIVE_BYTES, -sz),
            (INACTIVE_SPLIT, 1),
            (INACTIVE_SPLIT_BYTES, sz),
        ];
        let moves = &moves[..if split { 7 } else { 5 }];
        let q = self.step_begin();
        self.def_word.store(0, Ordering::Release);
        for &(c, n) in moves {
            self.apply(c * 2 + k, n);
        }
        self.step_end(q);
        for &(c, _) in moves {
            let e = c * 2 + k;
            self.commit_if_due(board, c, e, self.cur[e].load(Ordering::Relaxed), slack);
        }
    }

    /// `read` of this thread's counters as of one moment between its steps (see `seq`): by
    /// another thread, or by its own between steps (then at once).
    #[inline]
    fn read<T>(&self, read: impl Fn() -> T) -> T {
        let mut spins = 0u32;
        loop {
            let q = self.seq.load(Ordering::Acquire);
            if q & 1 == 0 || self.seq_gen.load(Ordering::Relaxed) != crate::sync::fork_generation() {
                // (Odd in another generation: a thread of the parent process, caught inside a
                // step by a fork; its counters are read as they are.)
                let v = read();
                fence(Ordering::Acquire);
                if self.seq.load(Ordering::Relaxed) == q {
                    return v;
                }
                // A step came and went: read again at once (the wait is for a step under way,
                // and a reader holds the members' lock, perhaps the allocator's too).
                spins = 0;
                continue;
            }
            spins += 1;
            // (A step is a few stores, but its thread may be switched out inside.)
            crate::sync::back_off(spins);
        }
    }

    /// The block whose slot word is `word` was filed (its free counted): if it was the
    /// deferred one, it is no longer.
    pub(crate) fn undefer_taken(&self, word: u64) {
        let _ = self.def_word.compare_exchange(word, 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// Whether a deferred free is recorded: read by its thread after settling its own (a record
    /// left is that of a block a drain took and has not filed yet, see `Owner::put`), or for an
    /// exited thread (`Registry::retire`). Acquire: the filing's clear happens before the next
    /// record is written, so a sum that read the old word never reads the new record's figures.
    #[inline(always)]
    pub(crate) fn has_record(&self) -> bool {
        self.def_word.load(Ordering::Acquire) != 0
    }

    /// Whether a census left the deferred block out since it was deferred (then reset).
    #[inline(always)]
    pub(crate) fn take_clipped(&self) -> bool {
        self.def_clipped.load(Ordering::Relaxed) && self.def_clipped.swap(false, Ordering::Relaxed)
    }

    /// Its thread took its deferred block back (the block `def_size` and `def_req` describe):
    /// the free and this allocation cancel out; only the totals move, by the record's figures
    /// (one counter here: see `def_hits`).
    #[inline(always)]
    pub(crate) fn on_elided(&self) {
        // (Callers check the record in debug builds: `def_record_is`.)
        self.def_hits.store(self.def_hits.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    /// Whether the deferred record describes a block of these figures (debug checks).
    pub(crate) fn def_record_is(&self, small: bool, size: usize, requested: usize, split: bool) -> bool {
        let flags = if small { DEF_SMALL } else { 0 } | if split { DEF_SPLIT } else { 0 };
        self.def_size.load(Ordering::Relaxed) == size as u64 | flags
            && self.def_req.load(Ordering::Relaxed) == requested as u64
    }

    /// The record's take-backs, times its figures, per `elided` field (count, bytes, bytes
    /// asked for, split blocks, split bytes), with the kind's offset into `elided`.
    fn def_hits_figures(&self) -> (usize, [u64; ELIDED]) {
        let n = self.def_hits.load(Ordering::Relaxed);
        let v = self.def_size.load(Ordering::Relaxed);
        let (small, split) = (v & DEF_SMALL != 0, v & DEF_SPLIT != 0);
        let size = v & !(DEF_SMALL | DEF_SPLIT);
        let req = self.def_req.load(Ordering::Relaxed);
        let s = u64::from(split);
        (!small as usize * ELIDED, [n, n * size, n * req, n * s, n * s * size])
    }

    /// Adds the record's take-backs to `elided` and zeroes them (by its thread, the only
    /// writer of both).
    #[cold]
    #[inline(never)]
    fn fold_def_hits(&self) {
        if self.def_hits.load(Ordering::Relaxed) == 0 {
            return;
        }
        let (k, f) = self.def_hits_figures();
        for (a, n) in self.elided[k..k + ELIDED].iter().zip(f) {
            a.store(a.load(Ordering::Relaxed) + n, Ordering::Relaxed);
        }
        self.def_hits.store(0, Ordering::Relaxed);
    }

    /// What the deferred block, if any, changes in public entry `i` (the block counts as
    /// allocated in `cur`, but it is free: cached, and inactive-split if its segment is split).
    #[inline]
    fn deferred(&self, i: usize) -> i64 {
        if self.def_word.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let v = self.def_size.load(Ordering::Relaxed);
        let (small, split) = (v & DEF_SMALL != 0, v & DEF_SPLIT != 0);
        let size = (v & !(DEF_SMALL | DEF_SPLIT)) as i64;
        let (s, k) = (i / 3, i % 3);
        if k != 0 && (k == 1) != small {
            return 0;
        }
        match s {
            ALLOCATION | ACTIVE => -1,
            ALLOCATED_BYTES | ACTIVE_BYTES => -size,
            REQUESTED_BYTES => -(self.def_req.load(Ordering::Relaxed) as i64),
            INACTIVE_SPLIT if split => 1,
            INACTIVE_SPLIT_BYTES if split => size,
            _ => 0,
        }
    }

    /// Commits the counters of kind `small` that a free moves (after a deferred free is
    /// counted: the allocation that may follow then rises above what is committed, and its
    /// commit checks the peak).
    pub(crate) fn commit_kind(&self, board: &Board, small: bool) {
        for s in [ALLOCATION, ACTIVE, ALLOCATED_BYTES, ACTIVE_BYTES, REQUESTED_BYTES] {
            self.commit(board, s * 2 + !small as usize);
        }
    }

    /// Its thread counted the free of its deferred block, which a census had left out (the
    /// peak is below the committed sum, which counted the block): for the allocator's one
    /// thread, that free is committed at once, so the committed sum is the true one again and
    /// the next allocation that passes the peak commits and checks it (left uncommitted, an
    /// allocation could refill the freed count without passing the committed value, and a
    /// new peak went unseen). With several threads it is not: each census would set off
    /// commits that set off the next (RELIABILITY.md, "Known gaps").
    #[cold]
    pub(crate) fn settled_clipped(&self, board: &Board, small: bool) {
        if board.solo.load(Ordering::Acquire) == self as *const ThreadStats as u64 {
            self.commit_kind(board, small);
        }
    }

    /// Its thread took back a block a census had left out (see `take_clipped`): the peaks of
    /// the counters an allocation raises are checked against the true sum again (`g` counted
    /// the block all along, so a commit would not).
    #[cold]
    pub(crate) fn recheck_peaks(&self, board: &Board, small: bool) {
        for s in [ALLOCATION, ACTIVE, ALLOCATED_BYTES, ACTIVE_BYTES, REQUESTED_BYTES] {
            let e = s * 2 + !small as usize;
            let g = board.g(e);
            if g > board.peak[s * 3 + 1 + !small as usize].load(Ordering::Relaxed) {
                board.census(s * 3 + 1 + !small as usize, g, self);
            }
            let all = g + board.g(e ^ 1);
            if all > board.peak[s * 3].load(Ordering::Relaxed) {
                board.census(s * 3, all, self);
            }
        }
    }

    /// A cached block handed out again by its thread (as `on_alloc`; `split`: it leaves
    /// the inactive-split counts).
    #[inline(always)]
    pub(crate) fn on_reuse(&self, board: &Board, slack: i64, small: bool, size: usize, requested: usize, split: bool) {
        if split {
            self.on_inactive_split(board, slack, small, size, false);
        }
        self.on_alloc(board, slack, small, size, requested, false);
    }

    /// A block freed into its thread's cache: no longer allocated nor active; a block of a split
    /// segment counts as inactive-split, as it would in its free set.
    #[inline(always)]
    pub(crate) fn on_cache(&self, board: &Board, slack: i64, small: bool, size: usize, requested: usize, split: bool) {
        self.on_free_requested(board, slack, small, size, requested, false);
        self.on_free_completed(board, slack, small, size);
        if split {
            self.on_inactive_split(board, slack, small, size, true);
        }
    }

    /// A block of `size` bytes (`requested` asked for) handed out under the allocator's lock.
    #[inline(always)]
    pub(crate) fn on_alloc(
        &self,
        board: &Board,
        slack: i64,
        small: bool,
        size: usize,
        requested: usize,
        oversize: bool,
    ) {
        self.change(board, ALLOCATION, small, 1, slack);
        self.change(board, ALLOCATED_BYTES, small, size as i64, slack);
        self.change(board, ACTIVE, small, 1, slack);
        self.change(board, ACTIVE_BYTES, small, size as i64, slack);
        self.change(board, REQUESTED_BYTES, small, requested as i64, slack);
        if oversize {
            self.change(board, OVERSIZE_ALLOCATIONS, false, 1, slack);
        }
    }

    /// Its owner freed a block; it stays active until it is back in its free set.
    #[inline(always)]
    pub(crate) fn on_free_requested(
        &self,
        board: &Board,
        slack: i64,
        small: bool,
        size: usize,
        requested: usize,
        oversize: bool,
    ) {
        self.change(board, ALLOCATION, small, -1, slack);
        self.change(board, ALLOCATED_BYTES, small, -(size as i64), slack);
        self.change(board, REQUESTED_BYTES, small, -(requested as i64), slack);
        if oversize {
            self.change(board, OVERSIZE_ALLOCATIONS, false, -1, slack);
        }
    }

    /// A freed block is back in its free set (every stream that used it is done).
    #[inline(always)]
    pub(crate) fn on_free_completed(&self, board: &Board, slack: i64, small: bool, size: usize) {
        self.change(board, ACTIVE, small, -1, slack);
        self.change(board, ACTIVE_BYTES, small, -(size as i64), slack);
    }

    /// A free block of a split segment entered (`add`) or left the inactive-split counts.
    #[inline(always)]
    pub(crate) fn on_inactive_split(&self, board: &Board, slack: i64, small: bool, size: usize, add: bool) {
        let (n, b) = if add { (1, size as i64) } else { (-1, -(size as i64)) };
        self.on_inactive_delta(board, slack, small, n, b);
    }

    /// A step's net change of the inactive-split counts (nothing when it is none).
    #[inline(always)]
    pub(crate) fn on_inactive_delta(&self, board: &Board, slack: i64, small: bool, n: i64, bytes: i64) {
        if n != 0 {
            self.change(board, INACTIVE_SPLIT, small, n, slack);
        }
        if bytes != 0 {
            self.change(board, INACTIVE_SPLIT_BYTES, small, bytes, slack);
        }
    }

    /// Commits every entry (by its only writer).
    pub(crate) fn commit_all(&self, board: &Board) {
        for e in 0..M {
            self.commit(board, e);
        }
    }

    /// Adds the counters of a thread that has exited (committed values included: `g` stays
    /// Σ committed); the caller is the only writer of `self` and commits after.
    fn absorb(&self, other: &ThreadStats) {
        for e in 0..M {
            let add = |a: &AtomicI64, b: &AtomicI64| {
                a.store(a.load(Ordering::Relaxed) + b.load(Ordering::Relaxed), Ordering::Relaxed)
            };
            add(&self.cur[e], &other.cur[e]);
            add(&self.committed[e], &other.committed[e]);
            let t = self.total[e].load(Ordering::Relaxed) + other.total[e].load(Ordering::Relaxed);
            self.total[e].store(t, Ordering::Relaxed);
        }
        // A deferred free is counted by the filing of its block, before its thread retires
        // (`Registry::retire` waits for the record to go): nothing of it is left to carry over.
        debug_assert_eq!(other.def_word.load(Ordering::Acquire), 0, "retired with a deferred free recorded");
        for (a, b) in self.elided.iter().zip(&other.elided) {
            a.store(a.load(Ordering::Relaxed) + b.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        let (k, f) = other.def_hits_figures();
        for (a, n) in self.elided[k..k + ELIDED].iter().zip(f) {
            a.store(a.load(Ordering::Relaxed) + n, Ordering::Relaxed);
        }
    }

    /// Adds the current values and totals into `sum` (public entries), as of one moment
    /// between its thread's steps.
    pub(crate) fn add_into(&self, sum: &mut Sum) {
        let mine = self.read(|| {
            let mut s = Sum::default();
            self.add_into_now(&mut s);
            s
        });
        for i in 0..N {
            sum.cur[i] += mine.cur[i];
            sum.total[i] += mine.total[i];
        }
    }

    fn add_into_now(&self, sum: &mut Sum) {
        // The deferred record's take-backs not yet in `elided`.
        let (dk, df) = self.def_hits_figures();
        for e in 0..M {
            let (s, large) = (e / 2, e % 2);
            let (c, t) = (self.cur[e].load(Ordering::Relaxed), self.total[e].load(Ordering::Relaxed));
            let f = large * ELIDED;
            let elided = |x: usize| self.elided[f + x].load(Ordering::Relaxed) + if f == dk { df[x] } else { 0 };
            let t = t + match s {
                ALLOCATION | ACTIVE => elided(0),
                ALLOCATED_BYTES | ACTIVE_BYTES => elided(1),
                REQUESTED_BYTES => elided(2),
                INACTIVE_SPLIT => elided(3),
                INACTIVE_SPLIT_BYTES => elided(4),
                _ => 0,
            };
            for i in [s * 3, s * 3 + 1 + large] {
                sum.cur[i] += c;
                sum.total[i] += t;
            }
        }
        for i in 0..N {
            sum.cur[i] += self.deferred(i);
        }
    }

    /// Public entry `i` of this thread now (between its steps).
    pub(crate) fn current(&self, i: usize) -> i64 {
        self.read(|| self.current_now(i))
    }

    #[inline]
    fn current_now(&self, i: usize) -> i64 {
        let (s, k) = (i / 3, i % 3);
        let at = |e: usize| self.cur[e].load(Ordering::Relaxed);
        let c = match k {
            0 => at(s * 2) + at(s * 2 + 1),
            _ => at(s * 2 + k - 1),
        };
        c + self.deferred(i)
    }
}

impl Board {
    /// Σ committed of per-thread entry `e` (never below the true sum).
    #[inline(always)]
    fn g(&self, e: usize) -> i64 {
        self.g[e].load(Ordering::Relaxed) + self.g_shared[e].load(Ordering::Relaxed)
    }

    /// `me` commits `d` more of entry `e`; returns the new Σ committed. The one member adds
    /// with a plain load and store (the only writer of `g`, see there), the others atomically.
    #[inline(always)]
    fn add_g(&self, me: &ThreadStats, e: usize, d: i64) -> i64 {
        if self.solo.load(Ordering::Acquire) == me as *const ThreadStats as u64 {
            let g = self.g[e].load(Ordering::Relaxed) + d;
            self.g[e].store(g, Ordering::Relaxed);
            g + self.g_shared[e].load(Ordering::Relaxed)
        } else {
            self.g_shared[e].fetch_add(d, Ordering::Relaxed) + d + self.g[e].load(Ordering::Relaxed)
        }
    }

    fn peak(&self, i: usize) -> i64 {
        self.peak[i].load(Ordering::Relaxed)
    }

    /// The retired counters, to be written (by the holder of the registry's retired lock):
    /// from now on censuses read them.
    pub(crate) fn retired_to_write(&self) -> &Arc<ThreadStats> {
        self.retired_written.store(true, Ordering::Release);
        &self.retired
    }

    /// The retired counters commit everything (by the holder of the registry's retired lock,
    /// under which `retired_written` is set: never written, they hold nothing to commit).
    /// Also at the end of every section that wrote them: they have several writers (the event
    /// thread, threads whose locals are gone, exited threads' absorption), and a decrease one
    /// left uncommitted would let another's later rise within it pass the peak unseen.
    pub(crate) fn commit_retired(&self) {
        if self.retired_written.load(Ordering::Relaxed) {
            self.retired.commit_all(self);
        }
    }

    /// A thread's counters join the census.
    pub(crate) fn join(&self, t: Arc<ThreadStats>) {
        let mut m = lock_members(&self.members);
        m.push(t);
        self.set_solo(&m);
    }

    /// Names the one member, if there is one (under the members' lock).
    fn set_solo(&self, m: &[Arc<ThreadStats>]) {
        let solo = if let [one] = m { Arc::as_ptr(one) as u64 } else { 0 };
        self.solo.store(solo, Ordering::Release);
    }

    /// An exited thread's counters go into `retired` and leave the census, in one step under
    /// the members' lock (a sum or census never sees them twice, nor misses them); then
    /// `retired` commits. The caller holds the registry's retired lock (`retired`'s writer).
    pub(crate) fn retire(&self, t: &Arc<ThreadStats>) {
        {
            let mut m = lock_members(&self.members);
            self.retired_written.store(true, Ordering::Release);
            self.retired.absorb(t);
            if let Some(e) = t.take_pool_elided() {
                // One entry per pool (an exited thread's adds to it), so the list stays as
                // short as the pools still to be read; a released pool's goes (`forget_pool`).
                let mut r = self.retired_pools.lock().unwrap_or_else(|p| p.into_inner());
                match r.iter_mut().find(|x| x[0] == e[0] && x[1] == e[1]) {
                    Some(x) => {
                        for k in 2..5 {
                            x[k] += e[k];
                        }
                    }
                    None => r.push(e),
                }
            }
            m.retain(|x| !Arc::ptr_eq(x, t));
            self.set_solo(&m);
        }
        self.retired.commit_all(self);
    }

    /// A commit took the filter of public entry `i` to `g`, above the peak: the true sum is
    /// read, and the peak becomes the smaller of the two.
    #[cold]
    #[inline(never)]
    fn census(&self, i: usize, g: i64, me: &ThreadStats) {
        // The caller is the one member (one thread, the common case while peaks climb after a
        // reset, a census per allocation): its counters and the retired ones are the sum, with
        // no lock. (A thread joining meanwhile is missed as one racing a census always is;
        // one retiring was absorbed into `retired` before `solo` named the caller.)
        if self.solo.load(Ordering::Acquire) == me as *const ThreadStats as u64 {
            // `me` is the committing thread's own counters (a member's are written by its thread
            // alone, and the retired ones are never `solo`), between its steps (no census runs
            // inside one): read as they are, with no `seq` check. The retired counters, while
            // never written, are zero. (Written meanwhile, by a thread that is not synchronised
            // with this one: a read racing that write, as any census's read of them is.)
            debug_assert_eq!(me.seq.load(Ordering::Relaxed) & 1, 0, "a census inside a step");
            // Its own first, as before: a thread whose locals are gone filing this thread's
            // deferred block counts the free in the retired counters, then clears this one's
            // record, so the reads in this order can only miss that free (a smaller sum, which
            // a `fetch_max` ignores), never count it twice.
            let own = me.current_now(i);
            let retired = if self.retired_written.load(Ordering::Acquire) { self.retired.current(i) } else { 0 };
            let now = own + retired;
            if now < g && me.deferred(i) != 0 {
                me.def_clipped.store(true, Ordering::Relaxed);
            }
            self.peak[i].fetch_max(g.min(now), Ordering::Relaxed);
            return;
        }
        self.census_members(i, g);
    }

    /// [`census`](Self::census) when the caller is not the one member: under the members' lock.
    #[cold]
    #[inline(never)]
    fn census_members(&self, i: usize, g: i64) {
        let m = lock_members(&self.members);
        let read = || m.iter().map(|t| t.current(i)).sum::<i64>() + self.retired.current(i);
        let mut now = read();
        if now < g {
            // Threads whose deferred block this sum left out: taking it back is an allocation
            // this peak has not seen (they check again then). (Threads holding uncommitted
            // decreases are not marked here: each census would set off commits that set off
            // the next, RELIABILITY.md "Known gaps"; a reset marks them, `reset_peaks`.)
            let mut marked = false;
            for t in m.iter().filter(|t| t.deferred(i) != 0) {
                t.def_clipped.store(true, Ordering::Relaxed);
                marked = true;
            }
            if marked {
                // One that took its block back between the sum's read of it and its mark (its
                // check skipped): counted by a second read.
                now = now.max(read());
            }
        }
        // Under the lock: a `reset_peaks` (which holds it) never overwrites this with a sum
        // read before it.
        self.peak[i].fetch_max(g.min(now), Ordering::Relaxed);
        drop(m);
    }

    /// Held while a filer counts the free of another thread's deferred block (in its own
    /// counters) and clears that thread's record: two threads' counters, which censuses and
    /// sums (reading under this lock, one thread after the other) then see both moved or
    /// neither. (Without it, a census that read the filer before its count and the owner
    /// after the clear counted the block allocated twice: `review12.rs::c2_…`, once in 5,665
    /// reads on the GPU machine.) No census runs inside: a free commits no rise.
    /// Debug builds panic where a thread holding it would take it again (a census or a sum
    /// inside: see `lock_members`).
    pub(crate) fn filing(&self) -> Members<'_> {
        lock_members(&self.members)
    }

    /// The deferred blocks of pool `id` over threads: count, bytes, bytes asked for (what
    /// its counters hold as allocated but is free, cached).
    pub(crate) fn pool_deferred(&self, id: u64) -> [i64; 3] {
        self.pool_deferred_marking(id, true)
    }

    /// The same, to read: `mark`, the threads are marked as left out of a new peak.
    pub(crate) fn pool_deferred_marking(&self, id: u64, mark: bool) -> [i64; 3] {
        let m = lock_members(&self.members);
        let mut d = [0; 3];
        for t in m.iter() {
            let dt = t.deferred_in_pool(id);
            if mark && dt[0] != 0 {
                // Left out of a new pool peak: its reuse goes through the lock (see `census`).
                t.def_clipped.store(true, Ordering::Relaxed);
            }
            for (x, y) in d.iter_mut().zip(dt) {
                *x += y;
            }
        }
        d
    }

    /// A released pool's exited threads' elided allocations go (nobody can read its statistics
    /// any more).
    pub(crate) fn forget_pool(&self, id: u64) {
        let _m = lock_members(&self.members);
        self.retired_pools.lock().unwrap_or_else(|p| p.into_inner()).retain(|x| x[0] != id);
    }

    /// Elided pool allocations not yet in their pools' counters: every other thread's for
    /// pool `id` (count, bytes, bytes asked for), read; exited threads' for any pool, taken
    /// (the caller, under the allocator's lock, adds them to their pools).
    pub(crate) fn pool_elided(&self, id: u64, retired: &mut Vec<[u64; 5]>) -> [u64; 3] {
        let m = lock_members(&self.members);
        retired.append(&mut self.retired_pools.lock().unwrap_or_else(|p| p.into_inner()));
        let mut d = [0; 3];
        for t in m.iter().filter(|t| t.pool_elided_id() == id) {
            for (x, a) in d.iter_mut().zip(&t.pool_elided[2..]) {
                *x += a.load(Ordering::Relaxed);
            }
        }
        d
    }

    /// Every entry summed over threads.
    pub(crate) fn sum(&self) -> Sum {
        self.sum_of(&lock_members(&self.members))
    }

    /// The sum over `m` (the members, their lock held) and the retired counters.
    fn sum_of(&self, m: &[Arc<ThreadStats>]) -> Sum {
        let mut sum = Sum::default();
        for t in m.iter() {
            t.add_into(&mut sum);
        }
        self.retired.add_into(&mut sum);
        sum
    }

    /// The peaks start again from the values now (a later one is checked against the true
    /// sum, so other threads' uncommitted decreases do not count).
    pub(crate) fn reset_peaks(&self) {
        // Under the members' lock throughout: a census (which stores its peak under it too)
        // comes wholly before the new peaks, or after them.
        let m = lock_members(&self.members);
        // The sums leave deferred blocks out: taking one back is an allocation these peaks
        // have not seen. Marked before the sum, so a take-back after the mark checks the peaks.
        for t in m.iter().filter(|t| t.has_record()) {
            t.def_clipped.store(true, Ordering::Relaxed);
        }
        let now = self.sum_of(&m);
        for i in 0..N {
            self.peak[i].store(now.cur[i], Ordering::Relaxed);
        }
        for t in m.iter() {
            // Records made since the first mark, marked too.
            if t.has_record() {
                t.def_clipped.store(true, Ordering::Relaxed);
            }
            // Every member commits everything and checks the peaks before its next rise (see
            // `recheck`): its uncommitted decreases are below these peaks' filter, and one
            // without any when read here may free and take back within its slack before it
            // rises again (marking only those holding decreases missed, under the hostile
            // review's reset race, 72 to 111 peaks in 2,000 rounds; every member, 11 to 19,
            // the rest the gap of threads taking turns, RELIABILITY.md). Once per thread per reset.
            t.recheck.store(true, Ordering::Relaxed);
        }
        if self.retired.holds_decrease() {
            self.retired.recheck.store(true, Ordering::Relaxed);
        }
        // A take-back that read its thread's mark before it was set (its check skipped) and
        // came after the sum read that thread: counted by a second sum. (One still in flight
        // across this second read is missed: RELIABILITY.md, "Known gaps".)
        let again = self.sum_of(&m);
        for i in 0..N {
            self.peak[i].fetch_max(again.cur[i], Ordering::Relaxed);
        }
    }
}

/// The block-side counters summed over threads.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sum {
    cur: [i64; N],
    total: [u64; N],
}

impl Sum {
    /// The device-wide current value of entry `i`.
    pub(crate) fn current(&self, i: usize) -> i64 {
        self.cur[i]
    }

    fn stat(&self, board: &Board, i: usize) -> Stat {
        let current = self.cur[i];
        Stat {
            current,
            // Never below the current value (at a quiescent point it cannot be; between
            // commits of racing threads it could be read so).
            peak: board.peak(i).max(current),
            allocated: self.total[i],
            freed: self.total[i].saturating_sub(current.max(0) as u64),
        }
    }

    fn array(&self, board: &Board, s: usize) -> StatArray {
        StatArray {
            all: self.stat(board, s * 3),
            small_pool: self.stat(board, s * 3 + 1),
            large_pool: self.stat(board, s * 3 + 2),
        }
    }
}

impl PoolCounters {
    /// A block of this pool handed out; `deferred` gives the pool's blocks that threads hold
    /// as deferred frees (counted allocated here, but free), asked only at a new peak.
    #[inline(always)]
    pub(crate) fn on_alloc(&mut self, size: usize, requested: usize, deferred: impl FnOnce() -> [i64; 3]) {
        let t = [&mut self.allocation, &mut self.allocated_bytes, &mut self.requested_bytes];
        let mut rising = false;
        for (t, n) in t.into_iter().zip([1, size, requested]) {
            t.cur += n as i64;
            t.total += n as u64;
            rising |= t.cur > t.peak;
        }
        if rising {
            let d = deferred();
            let t = [&mut self.allocation, &mut self.allocated_bytes, &mut self.requested_bytes];
            for (t, d) in t.into_iter().zip(d) {
                t.peak = t.peak.max(t.cur - d);
            }
        }
    }

    /// Allocations of this pool that a thread made and freed in turn without counting (a
    /// deferred free taken back): totals only.
    pub(crate) fn on_elided(&mut self, n: u64, bytes: u64, requested: u64) {
        self.allocation.total += n;
        self.allocated_bytes.total += bytes;
        self.requested_bytes.total += requested;
    }

    /// The figures with `extra` elided allocations (count, bytes, bytes asked for) not yet
    /// added, for a report.
    /// These counters less the pool's blocks threads hold as deferred frees (count, bytes,
    /// bytes asked for): allocated here, but free (cached, or filed by a drain soon).
    pub(crate) fn less_deferred(mut self, deferred: [i64; 3]) -> PoolCounters {
        for (t, d) in
            [&mut self.allocation, &mut self.allocated_bytes, &mut self.requested_bytes].into_iter().zip(deferred)
        {
            t.cur -= d;
        }
        self
    }

    pub(crate) fn with_elided(&self, extra: [u64; 3]) -> PoolCounters {
        let mut c = self.clone();
        c.on_elided(extra[0], extra[1], extra[2]);
        c
    }

    /// A block of this pool freed by its owner.
    #[inline(always)]
    pub(crate) fn on_free_requested(&mut self, size: usize, requested: usize) {
        self.allocation.sub(1);
        self.allocated_bytes.sub(size);
        self.requested_bytes.sub(requested);
    }

    /// As [`Counters::on_segment_restored`], for the pool.
    pub(crate) fn on_segment_restored(&mut self, size: usize) {
        self.segment.unsub(1);
        self.reserved_bytes.unsub(size);
        self.num_device_free -= 1;
    }

    /// As [`Counters::on_map`], for the pool.
    pub(crate) fn on_map(&mut self, size: usize, added: bool) {
        if added {
            self.reserved_bytes.add(size);
            self.num_device_alloc += 1;
        } else {
            self.reserved_bytes.sub(size);
            self.num_device_free += 1;
        }
    }

    /// As [`Counters::on_map_restored`], for the pool.
    pub(crate) fn on_map_restored(&mut self, size: usize) {
        self.reserved_bytes.unsub(size);
        self.num_device_free -= 1;
    }

    /// As [`Counters::on_range`], for the pool.
    pub(crate) fn on_range(&mut self, added: bool) {
        if added {
            self.segment.add(1);
        } else {
            self.segment.sub(1);
        }
    }

    /// As [`Counters::on_segment`], for the pool.
    pub(crate) fn on_segment(&mut self, size: usize, added: bool, _device_call: bool) {
        if added {
            self.segment.add(1);
            self.reserved_bytes.add(size);
            self.num_device_alloc += 1;
        } else {
            self.segment.sub(1);
            self.reserved_bytes.sub(size);
            self.num_device_free += 1;
        }
    }
}

impl Counters {
    pub(crate) fn reset_peak(&mut self) {
        for t in [&mut self.segment, &mut self.reserved_bytes, &mut self.oversize_segments] {
            t.reset_peak();
        }
    }

    /// The public figures: these counters, and `blocks` (the block-side counters summed over
    /// threads) with the peaks of `board`.
    pub(crate) fn report(&self, blocks: &Sum, board: &Board, max_split_size: usize) -> MemoryStats {
        MemoryStats {
            allocation: blocks.array(board, ALLOCATION),
            segment: self.segment.array(),
            active: blocks.array(board, ACTIVE),
            inactive_split: blocks.array(board, INACTIVE_SPLIT),
            allocated_bytes: blocks.array(board, ALLOCATED_BYTES),
            reserved_bytes: self.reserved_bytes.array(),
            active_bytes: blocks.array(board, ACTIVE_BYTES),
            inactive_split_bytes: blocks.array(board, INACTIVE_SPLIT_BYTES),
            requested_bytes: blocks.array(board, REQUESTED_BYTES),
            num_alloc_retries: self.num_alloc_retries,
            num_ooms: self.num_ooms,
            num_sync_all_streams: self.num_sync_all_streams,
            num_device_alloc: self.num_device_alloc,
            num_device_free: self.num_device_free,
            oversize_allocations: blocks.stat(board, OVERSIZE_ALLOCATIONS * 3),
            oversize_segments: self.oversize_segments.stat(0),
            max_split_size,
        }
    }
}

/// A statistic for all blocks, and split by the pool kind (small: blocks ≤ 1 MiB, large: the rest).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatArray {
    /// Every block.
    pub all: Stat,
    /// Blocks of small segments.
    pub small_pool: Stat,
    /// Blocks of large segments.
    pub large_pool: Stat,
}

/// What `memory_stats()` returns. Field names follow PyTorch's keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Number of allocated blocks.
    pub allocation: StatArray,
    /// Number of segments.
    pub segment: StatArray,
    /// Number of active blocks (allocated, or freed but awaiting other streams).
    pub active: StatArray,
    /// Number of free blocks inside segments that are split.
    pub inactive_split: StatArray,
    /// Bytes in allocated blocks.
    pub allocated_bytes: StatArray,
    /// Bytes of all segments (reserved from the device).
    pub reserved_bytes: StatArray,
    /// Bytes in active blocks.
    pub active_bytes: StatArray,
    /// Bytes in free blocks of split segments (memory that cannot be given back).
    pub inactive_split_bytes: StatArray,
    /// Bytes the callers asked for, before rounding.
    pub requested_bytes: StatArray,
    /// Allocations that failed once and succeeded after the cache was emptied.
    pub num_alloc_retries: u64,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: u64,
    /// Times every pending event was waited for (empty_cache, OOM recovery).
    pub num_sync_all_streams: u64,
    /// Segments allocated from the device.
    pub num_device_alloc: u64,
    /// Segments given back to the device.
    pub num_device_free: u64,
    /// Allocated blocks of `max_split_size` or more.
    pub oversize_allocations: Stat,
    /// Segments of `max_split_size` or more.
    pub oversize_segments: Stat,
    /// The configured `max_split_size` (bytes; `usize::MAX`: none).
    pub max_split_size: usize,
}

impl MemoryStats {
    /// The stats as PyTorch's flat dictionary: `"allocated_bytes.all.current"` and so on.
    pub fn as_map(&self) -> BTreeMap<String, i64> {
        let mut m = BTreeMap::new();
        let mut stat = |name: &str, s: &Stat| {
            m.insert(format!("{name}.current"), s.current);
            m.insert(format!("{name}.peak"), s.peak);
            m.insert(format!("{name}.allocated"), s.allocated as i64);
            m.insert(format!("{name}.freed"), s.freed as i64);
        };
        for (name, a) in self.arrays() {
            stat(&format!("{name}.all"), &a.all);
            stat(&format!("{name}.small_pool"), &a.small_pool);
            stat(&format!("{name}.large_pool"), &a.large_pool);
        }
        stat("oversize_allocations", &self.oversize_allocations);
        stat("oversize_segments", &self.oversize_segments);
        m.insert("num_alloc_retries".into(), self.num_alloc_retries as i64);
        m.insert("num_ooms".into(), self.num_ooms as i64);
        m.insert("num_sync_all_streams".into(), self.num_sync_all_streams as i64);
        m.insert("num_device_alloc".into(), self.num_device_alloc as i64);
        m.insert("num_device_free".into(), self.num_device_free as i64);
        m.insert("max_split_size".into(), self.max_split_size.min(i64::MAX as usize) as i64);
        m
    }

    fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    /// A table in the manner of `torch.cuda.memory_summary()`.
    pub fn summary(&self, title: &str) -> String {
        const W: usize = 75;
        let mut s = String::new();
        let rule = |s: &mut String, c: char| {
            let _ = writeln!(s, "|{}|", c.to_string().repeat(W));
        };
        rule(&mut s, '=');
        let _ = writeln!(s, "|{:^W$}|", title);
        rule(&mut s, '-');
        let left = format!("OOMs: {}", self.num_ooms);
        let right = format!("alloc retries: {}", self.num_alloc_retries);
        let _ = writeln!(s, "|{:^37}|{:^37}|", left, right);
        rule(&mut s, '=');
        let _ = writeln!(
            s,
            "| {:<21} | {:>10} | {:>10} | {:>10} | {:>10} |",
            "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
        );
        let groups: [(&str, &StatArray, bool); 8] = [
            ("Allocated memory", &self.allocated_bytes, true),
            ("Active memory", &self.active_bytes, true),
            ("Requested memory", &self.requested_bytes, true),
            ("Reserved memory", &self.reserved_bytes, true),
            ("Non-releasable memory", &self.inactive_split_bytes, true),
            ("Allocations", &self.allocation, false),
            ("Active allocs", &self.active, false),
            ("Reserved segments", &self.segment, false),
        ];
        let cell = |v: i64, is_bytes: bool| {
            if is_bytes {
                bytes(v.max(0) as u64).to_string()
            } else {
                v.to_string()
            }
        };
        for (name, a, is_bytes) in groups {
            rule(&mut s, '-');
            for (label, st) in
                [(name, &a.all), ("      from large pool", &a.large_pool), ("      from small pool", &a.small_pool)]
            {
                let _ = writeln!(
                    s,
                    "| {:<21} | {:>10} | {:>10} | {:>10} | {:>10} |",
                    label,
                    cell(st.current, is_bytes),
                    cell(st.peak, is_bytes),
                    cell(st.allocated as i64, is_bytes),
                    cell(st.freed as i64, is_bytes)
                );
            }
        }
        rule(&mut s, '-');
        for (label, st) in
            [("Oversize allocations", &self.oversize_allocations), ("Oversize segments", &self.oversize_segments)]
        {
            let _ = writeln!(
                s,
                "| {:<21} | {:>10} | {:>10} | {:>10} | {:>10} |",
                label, st.current, st.peak, st.allocated, st.freed
            );
        }
        rule(&mut s, '=');
        s
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A reader of another thread's counters waits while that thread is inside a step (its
    /// sequence number odd in this process's generation), and reads once it is out.
    #[test]
    fn a_reader_waits_for_a_step_to_end() {
        let t = Arc::new(ThreadStats::default());
        t.seq_gen.store(crate::sync::fork_generation(), Ordering::Relaxed);
        t.seq.store(1, Ordering::Release);
        t.cur[ALLOCATION * 2].store(5, Ordering::Relaxed);
        let (t2, done) = (t.clone(), Arc::new(AtomicBool::new(false)));
        let d2 = done.clone();
        let reader = std::thread::spawn(move || {
            let v = t2.current(ALLOCATION * 3);
            d2.store(true, Ordering::Release);
            v
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!done.load(Ordering::Acquire), "read inside a step");
        t.cur[ALLOCATION * 2].store(4, Ordering::Relaxed);
        t.seq.store(2, Ordering::Release);
        assert_eq!(reader.join().unwrap(), 4);
    }

    /// A number left odd by a thread of the parent process (another fork generation: that
    /// thread does not exist in a child) is read through, not waited on for ever.
    #[test]
    fn a_step_left_open_by_a_parents_thread_is_read_through() {
        let t = ThreadStats::default();
        t.seq_gen.store(crate::sync::fork_generation().wrapping_add(1), Ordering::Relaxed);
        t.seq.store(7, Ordering::Release);
        t.cur[ALLOCATION * 2].store(3, Ordering::Relaxed);
        assert_eq!(t.current(ALLOCATION * 3), 3);
        let mut sum = Sum::default();
        t.add_into(&mut sum);
        assert_eq!(sum.cur[ALLOCATION * 3], 3);
    }

    /// Exited threads' elided pool allocations keep one entry per pool (found by the hostile
    /// review: one per thread piled up until someone read the pool's statistics), and a
    /// released pool's entry goes.
    #[test]
    fn exited_threads_pool_counters_keep_one_entry_per_pool() {
        let board = Board::default();
        for i in 0..1000u64 {
            let t = Arc::new(ThreadStats::default());
            board.join(t.clone());
            t.on_pool_elided(7 + i % 2, 1 + (i % 2) as u32, 4096, 4000);
            board.retire(&t);
        }
        assert_eq!(board.retired_pools.lock().unwrap().len(), 2, "one entry per pool");
        board.forget_pool(8);
        let mut retired = Vec::new();
        assert_eq!(board.pool_elided(7, &mut retired), [0; 3], "no live thread holds any");
        assert_eq!(retired, vec![[7, 1, 500, 500 * 4096, 500 * 4000]]);
        assert!(board.retired_pools.lock().unwrap().is_empty(), "taken by the reader");
    }

    /// The filing's rule (no census or sum inside it) fails loudly in debug builds instead of
    /// waiting for ever on the thread's own lock.
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "a members' lock taken by the thread that holds one")]
    fn a_sum_inside_a_filing_panics_in_debug_builds() {
        let board = Board::default();
        let _filing = board.filing();
        let _ = board.pool_deferred(1);
    }

    /// The one member's census reads the retired counters once anything was written there:
    /// an exited thread's allocations still count in the peaks. And a peak reset with no
    /// thread exited leaves them unread (the cheap census while peaks climb after a reset).
    #[test]
    fn an_exited_threads_blocks_count_in_the_one_members_peaks() {
        const MIB: usize = 1 << 20;
        let peak = |board: &Board| board.peak(ALLOCATED_BYTES * 3);
        let board = Board::default();
        let a = Arc::new(ThreadStats::default());
        board.join(a.clone());
        a.on_alloc(&board, MIN_BYTE_SLACK, false, 4 * MIB, 4 * MIB, false);
        a.on_free_requested(&board, MIN_BYTE_SLACK, false, 4 * MIB, 4 * MIB, false);
        board.commit_retired();
        board.reset_peaks();
        assert!(!board.retired_written.load(Ordering::Relaxed), "nothing written to the retired counters yet");
        a.before_rise(&board); // as a locked call does first
        a.on_alloc(&board, MIN_BYTE_SLACK, false, 2 * MIB, 2 * MIB, false);
        assert_eq!(peak(&board), (2 * MIB) as i64);

        // A second thread allocates 1 MiB and exits holding it: `a` is the one member again.
        let b = Arc::new(ThreadStats::default());
        board.join(b.clone());
        b.on_alloc(&board, MIN_BYTE_SLACK, false, MIB, MIB, false);
        board.retire(&b);
        board.reset_peaks();
        assert_eq!(peak(&board), (3 * MIB) as i64);
        a.before_rise(&board); // as a locked call does first
        a.on_alloc(&board, MIN_BYTE_SLACK, false, 2 * MIB, 2 * MIB, false);
        assert_eq!(peak(&board), (5 * MIB) as i64, "the exited thread's block counted");
        assert_eq!(board.sum().cur[ALLOCATED_BYTES * 3], (5 * MIB) as i64);
    }

    /// The flag goes with the lock: a filing, then a sum, then a filing again.
    #[test]
    fn the_members_lock_is_taken_again_once_let_go() {
        let board = Board::default();
        drop(board.filing());
        assert_eq!(board.pool_deferred(1), [0; 3]);
        drop(board.filing());
    }
}
