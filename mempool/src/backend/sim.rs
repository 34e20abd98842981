//! A deterministic simulated device, for mempool's tests and for yours.
//!
//! It holds no memory, only addresses: segments are laid out one after another from
//! [`SimDevice::BASE`], each start aligned to 2 MiB, so a test can assert exact addresses.
//! Capacity is enforced; failures can be injected; streams are plain ids; an event completes
//! only when the test says so ([`SimDevice::complete_stream`]) or when the allocator waits on it.
//!
//! ```
//! use mempool::{Allocator, sim::SimDevice};
//! let sim = SimDevice::new(64 << 20);
//! let alloc = Allocator::sim(sim.clone());
//! let a = alloc.alloc::<f32>(1000)?;
//! assert_eq!(a.device_ptr_raw(), SimDevice::BASE);
//! assert_eq!(sim.live_segments(), vec![(SimDevice::BASE, 2 << 20)]);
//! # Ok::<(), mempool::Error>(())
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Backend, BackendError, EventId, StreamId};

const ALIGN: u64 = 2 << 20;

/// A stream of a simulated device: its device index and id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimStream {
    /// The device it belongs to.
    pub device: usize,
    /// Its id (0: the default stream).
    pub id: StreamId,
}

impl From<SimStream> for StreamId {
    fn from(s: SimStream) -> StreamId {
        s.id
    }
}

/// A simulated device. Share it as `Arc<SimDevice>` between the allocator and the test.
#[derive(Debug)]
pub struct SimDevice {
    device: usize,
    /// Its memory counts as pinned host memory ([`SimDevice::pinned`]).
    host_visible: bool,
    state: Mutex<SimState>,
}

#[derive(Debug, Default)]
struct SimState {
    capacity: usize,
    used: usize,
    next_addr: u64,
    segments: BTreeMap<u64, usize>,
    allocs: u64,
    frees: u64,
    syncs: u64,
    fail_allocs: usize,
    fail_frees: usize,
    fail_queries: usize,
    next_stream: u64,
    streams: HashMap<StreamId, (u64, u64)>, // recorded, completed
    events: HashMap<u64, (StreamId, u64)>,
    next_event: u64,
    /// Virtual memory: reservations (address → size), mappings (address → (size, handle)).
    next_reserve: u64,
    reservations: BTreeMap<u64, usize>,
    mappings: BTreeMap<u64, (usize, u64)>,
    next_handle: u64,
    maps: u64,
    unmaps: u64,
    fail_maps: usize,
    fail_unmaps: usize,
    synced_streams: Vec<StreamId>,
    /// Streams being captured, with their capture's id.
    captures: HashMap<StreamId, u64>,
    next_capture: u64,
    /// Calls CUDA forbids during a capture (in its global mode) that were made during one.
    capture_violations: Vec<String>,
    graph_launches: u64,
}

impl SimDevice {
    /// The address of the first segment.
    pub const BASE: u64 = 0x1_0000_0000;
    /// The address of the first reservation (virtual memory for expandable segments).
    pub const VM_BASE: u64 = 0x100_0000_0000;
    /// The page size of its virtual memory.
    pub const PAGE: usize = 2 << 20;

    /// A device with `capacity` bytes, index 0.
    pub fn new(capacity: usize) -> Arc<SimDevice> {
        Self::with_index(0, capacity)
    }

    /// A device with `capacity` bytes whose memory counts as pinned host memory
    /// ([`Backend::host_visible`]): its allocators behave as
    /// [`Allocator::pinned`](crate::Allocator::pinned) ones do (a block the device used waits for
    /// the work of its own stream at its free; the `pinned_*` settings apply), so their rules can
    /// be tested without a GPU. It still holds no memory: simulated buffers have no host view.
    pub fn pinned(capacity: usize) -> Arc<SimDevice> {
        Self::make(0, capacity, true)
    }

    /// A device with `capacity` bytes and the given index (for multi-device tests).
    pub fn with_index(device: usize, capacity: usize) -> Arc<SimDevice> {
        Self::make(device, capacity, false)
    }

    fn make(device: usize, capacity: usize, host_visible: bool) -> Arc<SimDevice> {
        Arc::new(SimDevice {
            device,
            host_visible,
            state: Mutex::new(SimState {
                capacity,
                next_addr: Self::BASE,
                next_reserve: Self::VM_BASE,
                next_stream: 1,
                next_handle: 1,
                ..Default::default()
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new stream of this device.
    pub fn new_stream(&self) -> SimStream {
        let mut s = self.lock();
        let id = StreamId(s.next_stream);
        s.next_stream += 1;
        SimStream { device: self.device, id }
    }

    /// The device's default stream (id 0).
    pub fn default_stream(&self) -> SimStream {
        SimStream { device: self.device, id: StreamId(0) }
    }

    /// Starts a graph capture on `stream`; returns its capture id.
    pub fn begin_capture(&self, stream: impl Into<StreamId>) -> u64 {
        let mut s = self.lock();
        s.next_capture += 1;
        let id = s.next_capture;
        s.captures.insert(stream.into(), id);
        id
    }

    /// `stream` joins capture `id` (as a stream forked from a captured one by an event wait).
    pub fn join_capture(&self, stream: impl Into<StreamId>, id: u64) {
        self.lock().captures.insert(stream.into(), id);
    }

    /// Ends the capture `stream` takes part in, for every stream of it.
    pub fn end_capture(&self, stream: impl Into<StreamId>) {
        let mut s = self.lock();
        if let Some(id) = s.captures.get(&stream.into()).copied() {
            s.captures.retain(|_, c| *c != id);
        }
    }

    /// A graph launch (replay): counted.
    pub fn launch_graph(&self) {
        self.lock().graph_launches += 1;
    }

    /// Graph launches so far.
    pub fn graph_launches(&self) -> u64 {
        self.lock().graph_launches
    }

    /// The calls made during a capture that CUDA forbids then (event queries and waits, segment
    /// frees and unmaps while any stream captures; an event recorded on a captured stream).
    pub fn capture_violations(&self) -> Vec<String> {
        self.lock().capture_violations.clone()
    }

    /// Completes every event recorded on `stream` so far.
    pub fn complete_stream(&self, stream: impl Into<StreamId>) {
        let stream = stream.into();
        let mut s = self.lock();
        let e = s.streams.entry(stream).or_default();
        e.1 = e.0;
    }

    /// Completes every event recorded so far.
    pub fn complete_all(&self) {
        for e in self.lock().streams.values_mut() {
            e.1 = e.0;
        }
    }

    /// Events recorded on `stream` that have not completed.
    pub fn pending_events(&self, stream: impl Into<StreamId>) -> u64 {
        self.lock().streams.get(&stream.into()).map_or(0, |e| e.0 - e.1)
    }

    /// Changes the capacity (segments already allocated stay).
    pub fn set_capacity(&self, capacity: usize) {
        self.lock().capacity = capacity;
    }

    /// The next `n` segment allocations fail with out-of-memory.
    pub fn fail_next_allocs(&self, n: usize) {
        self.lock().fail_allocs = n;
    }

    /// The next `n` segment frees fail (the segment stays allocated on the device).
    pub fn fail_next_frees(&self, n: usize) {
        self.lock().fail_frees = n;
    }

    /// The next `n` event queries fail.
    pub fn fail_next_event_queries(&self, n: usize) {
        self.lock().fail_queries = n;
    }

    /// Segments currently allocated, `(address, size)` in address order.
    pub fn live_segments(&self) -> Vec<(u64, usize)> {
        self.lock().segments.iter().map(|(a, s)| (*a, *s)).collect()
    }

    /// Bytes currently allocated on the device.
    pub fn used(&self) -> usize {
        self.lock().used
    }

    /// Mapped physical allocations, `(address, size)` in address order.
    pub fn mapped(&self) -> Vec<(u64, usize)> {
        self.lock().mappings.iter().map(|(a, (s, _))| (*a, *s)).collect()
    }

    /// Live reservations, `(address, size)` in address order.
    pub fn reservations(&self) -> Vec<(u64, usize)> {
        self.lock().reservations.iter().map(|(a, s)| (*a, *s)).collect()
    }

    /// Whether every byte of `addr..addr + size` is mapped (by one mapping or adjacent ones).
    pub fn is_mapped(&self, addr: u64, size: usize) -> bool {
        self.lock().covered(addr, size)
    }

    /// `(maps, unmaps)` so far.
    pub fn map_counters(&self) -> (u64, u64) {
        let s = self.lock();
        (s.maps, s.unmaps)
    }

    /// The next `n` maps fail with out-of-memory.
    pub fn fail_next_maps(&self, n: usize) {
        self.lock().fail_maps = n;
    }

    /// The next `n` unmaps fail (the memory stays mapped).
    pub fn fail_next_unmaps(&self, n: usize) {
        self.lock().fail_unmaps = n;
    }

    /// The streams waited for before unmapping, in order.
    pub fn unmap_syncs(&self) -> Vec<StreamId> {
        self.lock().synced_streams.clone()
    }

    /// `(segment allocations, segment frees, event synchronizations)` so far.
    pub fn counters(&self) -> (u64, u64, u64) {
        let s = self.lock();
        (s.allocs, s.frees, s.syncs)
    }
}

impl SimState {
    fn violation_if_capturing(&mut self, what: &str) {
        if !self.captures.is_empty() {
            self.capture_violations.push(format!("{what} during a capture"));
        }
    }

    /// Whether `addr..addr + size` is covered by adjacent mappings.
    fn covered(&self, addr: u64, size: usize) -> bool {
        let Some(end) = addr.checked_add(size as u64) else { return false };
        let mut at = addr;
        while at < end {
            match self.mappings.range(..=at).next_back() {
                Some((a, (sz, _))) if a + *sz as u64 > at => at = a + *sz as u64,
                _ => return false,
            }
        }
        true
    }
}

// SAFETY: the simulated device has no memory at all: nothing is ever written through its
// addresses (`zero` only checks the range), and its segments never overlap (laid out one after
// another, each start 2 MiB aligned); mappings lie inside reservations, above every segment,
// and `map` refuses a range that overlaps one already mapped.
unsafe impl Backend for SimDevice {
    fn kind(&self) -> &'static str {
        "sim"
    }

    fn device(&self) -> usize {
        self.device
    }

    fn host_visible(&self) -> bool {
        self.host_visible
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        let s = self.lock();
        Some((s.capacity.saturating_sub(s.used), s.capacity))
    }

    fn alloc_segment(&self, size: usize, _stream: StreamId) -> Result<u64, BackendError> {
        let mut s = self.lock();
        if s.fail_allocs > 0 {
            s.fail_allocs -= 1;
            return Err(BackendError::OutOfMemory);
        }
        if size == 0 || s.used.checked_add(size).is_none_or(|u| u > s.capacity) {
            return Err(BackendError::OutOfMemory);
        }
        let addr = s.next_addr;
        s.next_addr += (size as u64).div_ceil(ALIGN) * ALIGN;
        s.used += size;
        s.allocs += 1;
        s.segments.insert(addr, size);
        Ok(addr)
    }

    unsafe fn free_segment(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        let mut s = self.lock();
        s.violation_if_capturing("segment free");
        if s.fail_frees > 0 {
            s.fail_frees -= 1;
            return Err(BackendError::Failed("sim: injected free failure".into()));
        }
        match s.segments.get(&addr) {
            Some(&sz) if sz == size => {
                s.segments.remove(&addr);
                s.used -= size;
                s.frees += 1;
                Ok(())
            }
            Some(&sz) => Err(BackendError::Failed(format!("sim: segment {addr:#x} has size {sz}, freed as {size}"))),
            None => Err(BackendError::Failed(format!("sim: {addr:#x} is not a live segment"))),
        }
    }

    unsafe fn zero(&self, addr: u64, size: usize, _stream: StreamId) -> Result<(), BackendError> {
        let s = self.lock();
        let end = addr.checked_add(size as u64);
        if (Self::VM_BASE..s.next_reserve).contains(&addr) {
            return if s.covered(addr, size) {
                Ok(())
            } else {
                Err(BackendError::Failed(format!("sim: zero of {size} bytes at {addr:#x} outside the mapped memory")))
            };
        }
        if addr >= s.next_addr || end.is_none() {
            // Not an address this device handed out (a user pool's made-up segment): there is no
            // memory to fill and nothing to check.
            return Ok(());
        }
        match s.segments.range(..=addr).next_back() {
            Some((a, sz)) if end.is_some_and(|e| e <= a + *sz as u64) => Ok(()),
            _ => Err(BackendError::Failed(format!("sim: zero of {size} bytes at {addr:#x} outside every segment"))),
        }
    }

    unsafe fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError> {
        let mut s = self.lock();
        if s.captures.contains_key(&stream) {
            s.capture_violations.push(format!("event recorded on captured stream {}", stream.0));
        }
        let e = s.streams.entry(stream).or_default();
        e.0 += 1;
        let seq = e.0;
        let id = s.next_event;
        s.next_event += 1;
        s.events.insert(id, (stream, seq));
        Ok(EventId(id))
    }

    unsafe fn query_event(&self, event: EventId) -> Result<bool, BackendError> {
        let mut s = self.lock();
        s.violation_if_capturing("event query");
        if s.fail_queries > 0 {
            s.fail_queries -= 1;
            return Err(BackendError::Failed("sim: injected event query failure".into()));
        }
        let (stream, seq) = *s.events.get(&event.0).ok_or_else(|| BackendError::Failed("sim: unknown event".into()))?;
        Ok(s.streams.get(&stream).is_some_and(|e| e.1 >= seq))
    }

    unsafe fn synchronize_event(&self, event: EventId) -> Result<(), BackendError> {
        let mut s = self.lock();
        s.violation_if_capturing("event synchronize");
        let (stream, seq) = *s.events.get(&event.0).ok_or_else(|| BackendError::Failed("sim: unknown event".into()))?;
        s.syncs += 1;
        let e = s.streams.entry(stream).or_default();
        e.1 = e.1.max(seq);
        Ok(())
    }

    unsafe fn release_event(&self, event: EventId) {
        self.lock().events.remove(&event.0);
    }

    unsafe fn capture_id(&self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        Ok(self.lock().captures.get(&stream).copied())
    }

    fn vm_granularity(&self) -> Option<usize> {
        Some(Self::PAGE)
    }

    fn reserve(&self, size: usize) -> Result<u64, BackendError> {
        let mut s = self.lock();
        if size == 0 || size % Self::PAGE != 0 {
            return Err(BackendError::Failed(format!("sim: reserve of {size} bytes, not a multiple of the page")));
        }
        let addr = s.next_reserve;
        // A page of address space left between reservations, so that a range running past its
        // reservation is caught.
        s.next_reserve += size as u64 + Self::PAGE as u64;
        s.reservations.insert(addr, size);
        Ok(addr)
    }

    unsafe fn unreserve(&self, addr: u64, size: usize) -> Result<(), BackendError> {
        let mut s = self.lock();
        if s.reservations.get(&addr) != Some(&size) {
            return Err(BackendError::Failed(format!("sim: {addr:#x} ({size} bytes) is not a reservation")));
        }
        if s.mappings.range(addr..addr + size as u64).next().is_some() {
            return Err(BackendError::Failed(format!("sim: reservation {addr:#x} still has memory mapped")));
        }
        s.reservations.remove(&addr);
        Ok(())
    }

    unsafe fn map(&self, addr: u64, size: usize) -> Result<u64, BackendError> {
        let mut s = self.lock();
        if s.fail_maps > 0 {
            s.fail_maps -= 1;
            return Err(BackendError::OutOfMemory);
        }
        let end = addr + size as u64;
        let inside = s.reservations.range(..=addr).next_back().is_some_and(|(a, sz)| end <= a + *sz as u64);
        let overlaps = s.mappings.range(..end).next_back().is_some_and(|(a, (sz, _))| a + *sz as u64 > addr);
        if size == 0 || addr % Self::PAGE as u64 != 0 || size % Self::PAGE != 0 || !inside || overlaps {
            return Err(BackendError::Failed(format!(
                "sim: map of {size} bytes at {addr:#x}: outside a reservation, misaligned or already mapped"
            )));
        }
        if s.used.checked_add(size).is_none_or(|u| u > s.capacity) {
            return Err(BackendError::OutOfMemory);
        }
        s.used += size;
        s.maps += 1;
        let h = s.next_handle;
        s.next_handle += 1;
        s.mappings.insert(addr, (size, h));
        Ok(h)
    }

    unsafe fn unmap(&self, addr: u64, size: usize, handle: u64, stream: StreamId) -> Result<(), BackendError> {
        let mut s = self.lock();
        s.violation_if_capturing("unmap");
        if s.fail_unmaps > 0 {
            s.fail_unmaps -= 1;
            return Err(BackendError::Failed("sim: injected unmap failure".into()));
        }
        if s.mappings.get(&addr) != Some(&(size, handle)) {
            return Err(BackendError::Failed(format!(
                "sim: {addr:#x} ({size} bytes, handle {handle}) is not a mapping"
            )));
        }
        s.synced_streams.push(stream);
        s.mappings.remove(&addr);
        s.used -= size;
        s.unmaps += 1;
        Ok(())
    }
}
