//! A parsed trace made ready to replay on one allocator, so that the timed loop does no lookups:
//! each id becomes a slot of a table of live buffers (slots are reused, so the table is as long as
//! the most allocations live at once, whatever the ids), and each distinct stream value becomes a
//! stream of the backend, made current with [`Allocator::set_stream`] for the allocations recorded
//! on it. Stream value 0 is the default stream; the others get new streams, in the order they first
//! appear.
//!
//! ```
//! use mempool::{sim::SimDevice, Allocator};
//! use mempool_bench::{playback::Playback, trace::parse_trace};
//!
//! let sim = SimDevice::new(1 << 30);
//! let a = Allocator::sim(sim.clone());
//! let ops = parse_trace("a 0 4096 0\na 7 4096 140000\nf 0\nf 7\n")?;
//! let play = Playback::new(&ops, sim.default_stream(), || Ok::<_, String>(sim.new_stream()))?;
//! assert_eq!(play.stream_values(), [0, 140000]);
//! let rep = play.run(&a)?;
//! // Two streams never share a block: one 2 MiB segment each.
//! assert_eq!((rep.peak_allocated, rep.peak_reserved), (8192, 4 << 20));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::fmt;
use std::time::Instant;

use mempool::{Allocator, Buffer, Kind};

use crate::trace::TraceOp;

/// One event with its names resolved.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// Allocate `bytes` into `slot` with `stream` (an index of [`Playback::streams`]) current.
    Alloc { slot: usize, bytes: usize, stream: usize },
    /// Drop the buffer in `slot`.
    Free { slot: usize },
}

/// A trace ready to replay on allocators of kind `K`: see the [module](self) docs.
pub struct Playback<K: Kind> {
    steps: Vec<Step>,
    slots: usize,
    /// The trace's stream values, and the stream each one stands for; index 0: value 0, the
    /// default stream.
    values: Vec<u64>,
    streams: Vec<K::Stream>,
}

/// What one replay of a trace measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rep {
    /// The events replayed.
    pub events: usize,
    /// Wall time of the replay loop per event, in nanoseconds.
    pub ns_per_event: f64,
    /// The allocator's peak allocated bytes during the replay.
    pub peak_allocated: i64,
    /// The allocator's peak reserved bytes during the replay.
    pub peak_reserved: i64,
}

impl<K: Kind> Playback<K> {
    /// Prepares `ops`, which must be a sequence a program could make (as
    /// [`parse_trace`](crate::trace::parse_trace) guarantees): stream value 0 stands for `default`,
    /// each other distinct value for a stream from `new_stream`. Errors if `new_stream` does, or if
    /// `ops` frees an id that is not live or allocates one that is.
    pub fn new<E: fmt::Display>(
        ops: &[TraceOp],
        default: K::Stream,
        mut new_stream: impl FnMut() -> Result<K::Stream, E>,
    ) -> Result<Playback<K>, String> {
        let mut play =
            Playback { steps: Vec::with_capacity(ops.len()), slots: 0, values: vec![0], streams: vec![default] };
        let mut stream_of: HashMap<u64, usize> = HashMap::from([(0, 0)]);
        let mut slot_of: HashMap<u64, usize> = HashMap::new();
        let mut free_slots: Vec<usize> = Vec::new();
        for (n, op) in ops.iter().enumerate() {
            let step = match *op {
                TraceOp::Alloc { id, bytes, stream } => {
                    let stream = match stream_of.get(&stream) {
                        Some(&i) => i,
                        None => {
                            let s = new_stream().map_err(|e| format!("a stream for trace stream {stream}: {e}"))?;
                            play.values.push(stream);
                            play.streams.push(s);
                            stream_of.insert(stream, play.streams.len() - 1);
                            play.streams.len() - 1
                        }
                    };
                    let slot = free_slots.pop().unwrap_or_else(|| {
                        play.slots += 1;
                        play.slots - 1
                    });
                    if slot_of.insert(id, slot).is_some() {
                        return Err(format!("event {}: allocation of id {id}, which is live", n + 1));
                    }
                    Step::Alloc { slot, bytes, stream }
                }
                TraceOp::Free { id } => {
                    let slot = slot_of
                        .remove(&id)
                        .ok_or_else(|| format!("event {}: free of id {id}, which is not live", n + 1))?;
                    free_slots.push(slot);
                    Step::Free { slot }
                }
            };
            play.steps.push(step);
        }
        Ok(play)
    }

    /// The number of events.
    pub fn events(&self) -> usize {
        self.steps.len()
    }

    /// The trace's distinct stream values, 0 first, then in the order they first appear; the
    /// stream standing for each is at the same index of [`streams`](Self::streams).
    pub fn stream_values(&self) -> &[u64] {
        &self.values
    }

    /// The backend's streams the replay makes current, one per [stream value](Self::stream_values).
    pub fn streams(&self) -> &[K::Stream] {
        &self.streams
    }

    /// The most allocations the trace holds live at once (the length of the replay's table).
    pub fn max_live(&self) -> usize {
        self.slots
    }

    /// Replays every event once on `a`, each allocation with its stream current, and times the
    /// loop. Resets `a`'s peak statistics first and reads them at the end, before freeing what the
    /// trace leaves live. The stream that was current before is current again afterwards.
    pub fn run(&self, a: &Allocator<K>) -> mempool::Result<Rep> {
        let mut live: Vec<Option<Buffer<u8, K>>> = (0..self.slots).map(|_| None).collect();
        a.reset_peak_stats();
        let t = Instant::now();
        // The guard stays while allocations stay on its stream, so a trace on one stream costs
        // one `set_stream` per replay, not one per event.
        let mut guard = None;
        let mut current = usize::MAX;
        for step in &self.steps {
            match *step {
                Step::Alloc { slot, bytes, stream } => {
                    if stream != current {
                        // The old guard goes first: dropping it restores the stream it replaced.
                        drop(guard.take());
                        guard = Some(a.set_stream(&self.streams[stream])?);
                        current = stream;
                    }
                    live[slot] = Some(a.alloc(bytes)?);
                }
                Step::Free { slot } => live[slot] = None,
            }
        }
        let ns_per_event = t.elapsed().as_nanos() as f64 / self.steps.len().max(1) as f64;
        drop(guard);
        let s = a.memory_stats();
        drop(live);
        Ok(Rep {
            events: self.steps.len(),
            ns_per_event,
            peak_allocated: s.allocated_bytes.all.peak,
            peak_reserved: s.reserved_bytes.all.peak,
        })
    }
}

impl<K: Kind> fmt::Debug for Playback<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Playback")
            .field("events", &self.steps.len())
            .field("max_live", &self.slots)
            .field("stream_values", &self.values)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::parse_trace;
    use mempool::sim::{SimDevice, SimStream};
    use mempool::StreamId;
    use std::sync::Arc;

    fn sim_playback(text: &str) -> (Arc<SimDevice>, Allocator<mempool::Sim>, Playback<mempool::Sim>) {
        let sim = SimDevice::new(1 << 40);
        let a = Allocator::sim(sim.clone());
        let ops = parse_trace(text).unwrap();
        let play = Playback::new(&ops, sim.default_stream(), || Ok::<_, String>(sim.new_stream())).unwrap();
        (sim, a, play)
    }

    #[test]
    fn each_distinct_stream_value_gets_its_own_stream_and_0_the_default() {
        let (sim, _, play) = sim_playback("a 0 512 5\na 1 512 0\na 2 512 9\na 3 512 5\nf 0\na 4 512 9\n");
        assert_eq!(play.stream_values(), [0, 5, 9]);
        let ids: Vec<StreamId> = play.streams().iter().map(|s| s.id).collect();
        assert_eq!(ids[0], sim.default_stream().id);
        assert!(ids[1] != ids[0] && ids[2] != ids[0] && ids[1] != ids[2], "{ids:?}");
    }

    #[test]
    fn allocations_happen_on_their_recorded_stream() {
        // Freed on stream 5, the block cannot serve stream 0 or stream 9: PyTorch's rules keep
        // blocks on their stream, so three streams take three segments. Ignoring the column
        // would take one.
        let (_, a, play) = sim_playback("a 0 512 5\nf 0\na 1 512 0\nf 1\na 2 512 9\nf 2\n");
        let rep = play.run(&a).unwrap();
        assert_eq!((rep.events, rep.peak_allocated, rep.peak_reserved), (6, 512, 3 * (2 << 20)));
        let snap = a.snapshot();
        let mut streams: Vec<StreamId> = snap.segments.iter().map(|s| s.stream).collect();
        streams.sort();
        let mut want: Vec<StreamId> = play.streams().iter().map(|s| s.id).collect();
        want.sort();
        assert_eq!(streams, want);
    }

    #[test]
    fn the_stream_current_before_is_current_after() {
        let (sim, a, play) = sim_playback("a 0 512 3\na 1 512 0\na 2 512 4\n");
        let mine: SimStream = sim.new_stream();
        let _guard = a.set_stream(&mine).unwrap();
        play.run(&a).unwrap();
        assert_eq!(a.current_stream(), mine);
    }

    #[test]
    fn slots_are_reused_so_sparse_ids_cost_nothing() {
        let (_, a, play) = sim_playback("a 1000000000000 512\nf 1000000000000\na 18446744073709551615 512\na 5 512\n");
        assert_eq!(play.max_live(), 2);
        let rep = play.run(&a).unwrap();
        assert_eq!(rep.peak_allocated, 1024);
        // What the trace left live is freed at the end.
        assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
    }

    #[test]
    fn inconsistent_events_and_stream_failures_are_errors() {
        let sim = SimDevice::new(1 << 30);
        let free = [TraceOp::Free { id: 3 }];
        let e = Playback::<mempool::Sim>::new(&free, sim.default_stream(), || Ok::<_, String>(sim.new_stream()));
        assert_eq!(e.unwrap_err(), "event 1: free of id 3, which is not live");
        let twice = [TraceOp::Alloc { id: 3, bytes: 1, stream: 0 }, TraceOp::Alloc { id: 3, bytes: 1, stream: 0 }];
        let e = Playback::<mempool::Sim>::new(&twice, sim.default_stream(), || Ok::<_, String>(sim.new_stream()));
        assert_eq!(e.unwrap_err(), "event 2: allocation of id 3, which is live");
        let side = [TraceOp::Alloc { id: 0, bytes: 1, stream: 7 }];
        let e = Playback::<mempool::Sim>::new(&side, sim.default_stream(), || Err("no streams left"));
        assert_eq!(e.unwrap_err(), "a stream for trace stream 7: no streams left");
    }
}
