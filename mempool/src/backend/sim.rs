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
}

impl SimDevice {
    /// The address of the first segment.
    pub const BASE: u64 = 0x1_0000_0000;

    /// A device with `capacity` bytes, index 0.
    pub fn new(capacity: usize) -> Arc<SimDevice> {
        Self::with_index(0, capacity)
    }

    /// A device with `capacity` bytes and the given index (for multi-device tests).
    pub fn with_index(device: usize, capacity: usize) -> Arc<SimDevice> {
        Arc::new(SimDevice {
            device,
            state: Mutex::new(SimState { capacity, next_addr: Self::BASE, next_stream: 1, ..Default::default() }),
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

    /// `(segment allocations, segment frees, event synchronizations)` so far.
    pub fn counters(&self) -> (u64, u64, u64) {
        let s = self.lock();
        (s.allocs, s.frees, s.syncs)
    }
}

// SAFETY: the simulated device has no memory at all: nothing is ever written through its
// addresses (`zero` only checks the range), and its segments never overlap (laid out one after
// another, each start 2 MiB aligned).
unsafe impl Backend for SimDevice {
    fn kind(&self) -> &'static str {
        "sim"
    }

    fn device(&self) -> usize {
        self.device
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
        if s.fail_queries > 0 {
            s.fail_queries -= 1;
            return Err(BackendError::Failed("sim: injected event query failure".into()));
        }
        let (stream, seq) = *s.events.get(&event.0).ok_or_else(|| BackendError::Failed("sim: unknown event".into()))?;
        Ok(s.streams.get(&stream).is_some_and(|e| e.1 >= seq))
    }

    unsafe fn synchronize_event(&self, event: EventId) -> Result<(), BackendError> {
        let mut s = self.lock();
        let (stream, seq) = *s.events.get(&event.0).ok_or_else(|| BackendError::Failed("sim: unknown event".into()))?;
        s.syncs += 1;
        let e = s.streams.entry(stream).or_default();
        e.1 = e.1.max(seq);
        Ok(())
    }

    unsafe fn release_event(&self, event: EventId) {
        self.lock().events.remove(&event.0);
    }
}
