//! Memory statistics, with the names and meaning of `torch.cuda.memory_stats()`.

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

/// Every counter of one allocator (see [`MemoryStats`] for their meaning).
#[derive(Debug, Clone, Default)]
pub(crate) struct Counters {
    pub(crate) allocation: Tally,
    pub(crate) segment: Tally,
    pub(crate) active: Tally,
    pub(crate) inactive_split: Tally,
    pub(crate) allocated_bytes: Tally,
    pub(crate) reserved_bytes: Tally,
    pub(crate) active_bytes: Tally,
    pub(crate) inactive_split_bytes: Tally,
    pub(crate) requested_bytes: Tally,
    pub(crate) num_alloc_retries: u64,
    pub(crate) num_ooms: u64,
    pub(crate) num_sync_all_streams: u64,
    pub(crate) num_device_alloc: u64,
    pub(crate) num_device_free: u64,
    pub(crate) oversize_allocations: Tally,
    pub(crate) oversize_segments: Tally,
}

/// What each allocator event changes, in one place: the caching algorithm calls these and
/// touches no counter itself.
impl Counters {
    /// A block of `size` bytes (`requested` asked for) handed out.
    #[inline(always)]
    pub(crate) fn on_alloc(&mut self, small: bool, size: usize, requested: usize, oversize: bool) {
        self.allocation.add(small, 1);
        self.allocated_bytes.add(small, size);
        self.active.add(small, 1);
        self.active_bytes.add(small, size);
        self.requested_bytes.add(small, requested);
        if oversize {
            self.oversize_allocations.add(false, 1);
        }
    }

    /// Its owner freed a block; it stays active until it is back in its free set.
    #[inline(always)]
    pub(crate) fn on_free_requested(&mut self, small: bool, size: usize, requested: usize, oversize: bool) {
        self.allocation.sub(small, 1);
        self.allocated_bytes.sub(small, size);
        self.requested_bytes.sub(small, requested);
        if oversize {
            self.oversize_allocations.sub(false, 1);
        }
    }

    /// A freed block is back in its free set (every stream that used it is done).
    #[inline(always)]
    pub(crate) fn on_free_completed(&mut self, small: bool, size: usize) {
        self.active.sub(small, 1);
        self.active_bytes.sub(small, size);
    }

    /// A free block of a split segment entered (`add`) or left the inactive-split counts.
    #[inline(always)]
    pub(crate) fn on_inactive_split(&mut self, small: bool, size: usize, add: bool) {
        if add {
            self.inactive_split.add(small, 1);
            self.inactive_split_bytes.add(small, size);
        } else {
            self.inactive_split.sub(small, 1);
            self.inactive_split_bytes.sub(small, size);
        }
    }

    /// A segment whose free was refused is back: its release is undone (no total changes).
    pub(crate) fn on_segment_restored(&mut self, small: bool, size: usize, oversize: bool) {
        self.segment.unsub(small, 1);
        self.reserved_bytes.unsub(small, size);
        if oversize {
            self.oversize_segments.unsub(false, 1);
        }
        self.num_device_free -= 1;
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

impl PoolCounters {
    /// A block of this pool handed out.
    #[inline(always)]
    pub(crate) fn on_alloc(&mut self, size: usize, requested: usize) {
        self.allocation.add(1);
        self.allocated_bytes.add(size);
        self.requested_bytes.add(requested);
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
        for t in [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
            &mut self.oversize_allocations,
            &mut self.oversize_segments,
        ] {
            t.reset_peak();
        }
    }

    pub(crate) fn report(&self, max_split_size: usize) -> MemoryStats {
        MemoryStats {
            allocation: self.allocation.array(),
            segment: self.segment.array(),
            active: self.active.array(),
            inactive_split: self.inactive_split.array(),
            allocated_bytes: self.allocated_bytes.array(),
            reserved_bytes: self.reserved_bytes.array(),
            active_bytes: self.active_bytes.array(),
            inactive_split_bytes: self.inactive_split_bytes.array(),
            requested_bytes: self.requested_bytes.array(),
            num_alloc_retries: self.num_alloc_retries,
            num_ooms: self.num_ooms,
            num_sync_all_streams: self.num_sync_all_streams,
            num_device_alloc: self.num_device_alloc,
            num_device_free: self.num_device_free,
            oversize_allocations: self.oversize_allocations.stat(0),
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
