//! Hostile review helper-49 of `35e1cad` (`State::free_with` counts and emits a free before it
//! takes the block's recorded uses out, and frees at once a block with none): frees that must
//! wait for streams still do (pinned memory the device used, a host-visible pool's block,
//! cross-stream uses, a free during a capture), with the trace events and statistics at each
//! point. The review found no bug; these are its direct checks, kept.

mod common;

use std::sync::{Arc, Mutex};

use common::{check_invariants, pinned_sim, record_events as hook, sim_with, Seen};
use mempool::sim::SimDevice;
use mempool::trace::Action;
use mempool::{Allocator, BackendError, BlockState, CaptureMode, MemPool, PoolOptions, RawAllocator, Sim, StreamId};

struct FakeHost(Mutex<u64>);
// SAFETY: test only; never dereferenced.
unsafe impl RawAllocator for FakeHost {
    fn name(&self) -> &str {
        "fakehost"
    }
    fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        let mut n = self.0.lock().unwrap();
        let a = *n;
        *n += size as u64;
        Ok(a)
    }
    unsafe fn free(&self, _: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        Ok(())
    }
    fn host_visible(&self) -> bool {
        true
    }
}

fn state_of(a: &Allocator<Sim>, addr: u64) -> BlockState {
    a.snapshot().segments.iter().flat_map(|s| s.blocks.iter()).find(|b| b.address == addr).unwrap().state
}

fn count(seen: &Seen, act: Action, addr: u64) -> usize {
    seen.lock().unwrap().iter().filter(|(x, a)| *x == act && *a == addr).count()
}

/// Each case in its own block: the block's state, its `FreeRequested` / `FreeCompleted` events and
/// the statistics between the free and its completion.
#[test]
fn frees_that_wait_for_streams_still_wait_with_events_and_statistics_in_order() {
    // 1. Pinned, device-used: waits for its own stream.
    {
        let (sim, a) = pinned_sim(1 << 30, "thread_cache:False");
        let (_h, seen) = hook(&a);
        let s1 = sim.new_stream();
        let _g = a.set_stream(&s1).unwrap();
        let b = a.alloc::<u8>(4096).unwrap();
        let addr = b.device_ptr_raw();
        drop(b);
        assert_eq!(count(&seen, Action::FreeRequested, addr), 1);
        assert_eq!(count(&seen, Action::FreeCompleted, addr), 0);
        assert_eq!(state_of(&a, addr), BlockState::AwaitingStreams, "pinned device-used");
        let st = a.memory_stats();
        assert_eq!((st.allocation.all.current, st.active.all.current), (0, 1));
        check_invariants(&a, Some(&sim));
        sim.complete_stream(s1);
        let c = a.alloc::<u8>(4096).unwrap();
        assert_eq!(count(&seen, Action::FreeCompleted, addr), 1);
        check_invariants(&a, Some(&sim));
        drop(c);
    }
    // 2. Pinned, not device-used: at once.
    {
        let (sim, a) = pinned_sim(1 << 30, "thread_cache:False");
        let (_h, seen) = hook(&a);
        let b = a.alloc::<u8>(4096).unwrap();
        let addr = a.snapshot().segments[0].blocks[0].address;
        drop(b);
        assert_eq!(count(&seen, Action::FreeRequested, addr), 1);
        assert_eq!(count(&seen, Action::FreeCompleted, addr), 1);
        check_invariants(&a, Some(&sim));
    }
    // 3. Host-visible pool on device allocator: waits for own stream even unmarked.
    {
        let (sim, a) = sim_with(1 << 30, "");
        let p = MemPool::on(&a, PoolOptions::new().shared_allocator(Arc::new(FakeHost(Mutex::new(0x7000_0000_0000)))))
            .unwrap();
        let (_h, seen) = hook(&a);
        let s1 = sim.new_stream();
        let _g = a.set_stream(&s1).unwrap();
        let b = p.alloc::<u8>(4096).unwrap();
        let addr = 0x7000_0000_0000u64;
        drop(b);
        assert_eq!(count(&seen, Action::FreeRequested, addr), 1);
        assert_eq!(count(&seen, Action::FreeCompleted, addr), 0);
        assert_eq!(state_of(&a, addr), BlockState::AwaitingStreams, "host-visible pool");
        let ps = p.memory_stats();
        assert_eq!(ps.allocation.current, 0);
        check_invariants(&a, Some(&sim));
        sim.complete_stream(s1);
        drop(a.alloc::<u8>(1).unwrap());
        assert_eq!(count(&seen, Action::FreeCompleted, addr), 1);
        check_invariants(&a, Some(&sim));
    }
    // 4. Device memory with a cross-stream use (and without a hook: thread cache must not take it).
    for with_hook in [false, true] {
        let (sim, a) = sim_with(1 << 30, "");
        let h = if with_hook { Some(hook(&a)) } else { None };
        let (s1, s2) = (sim.new_stream(), sim.new_stream());
        let _g = a.set_stream(&s1).unwrap();
        let b = a.alloc::<u8>(4096).unwrap();
        let addr = b.device_ptr_raw();
        b.record_stream(&s2).unwrap();
        drop(b);
        assert_eq!(state_of(&a, addr), BlockState::AwaitingStreams);
        if let Some((_, seen)) = &h {
            assert_eq!(count(seen, Action::FreeRequested, addr), 1);
            assert_eq!(count(seen, Action::FreeCompleted, addr), 0);
        }
        let st = a.memory_stats();
        assert_eq!((st.allocation.all.current, st.active.all.current, st.requested_bytes.all.current), (0, 1, 0));
        check_invariants(&a, Some(&sim));
        let c = a.alloc::<u8>(4096).unwrap();
        assert_ne!(c.device_ptr_raw(), addr, "reused before s2 was done");
        sim.complete_stream(s2);
        let d = a.alloc::<u8>(4096).unwrap();
        assert_eq!(d.device_ptr_raw(), addr);
        check_invariants(&a, Some(&sim));
        drop((c, d));
    }
    // 5. Capture: a cross-stream free during a capture is deferred, not reused by the capture.
    {
        let (sim, a) = sim_with(1 << 30, "");
        let (_h, seen) = hook(&a);
        let (s, side) = (sim.new_stream(), sim.new_stream());
        let _g = a.set_stream(&s).unwrap();
        let p = MemPool::on(&a, PoolOptions::new()).unwrap();
        let pre = p.alloc::<u8>(1 << 20).unwrap();
        let addr = pre.device_ptr_raw();
        pre.record_stream(&side).unwrap();
        let cap = a.begin_capture(&s, &p, CaptureMode::Global).unwrap();
        drop(pre);
        assert_eq!(count(&seen, Action::FreeRequested, addr), 1);
        assert_eq!(count(&seen, Action::FreeCompleted, addr), 0);
        let x = a.alloc::<u8>(1 << 20).unwrap();
        assert_ne!(x.device_ptr_raw(), addr, "capture reused a block awaiting another stream");
        let g = cap.end().unwrap();
        assert_eq!(count(&seen, Action::FreeCompleted, addr), 0);
        sim.complete_all();
        drop(a.alloc::<u8>(1).unwrap());
        assert_eq!(count(&seen, Action::FreeCompleted, addr), 1);
        drop((x, g));
        assert!(sim.capture_violations().is_empty(), "{:?}", sim.capture_violations());
        check_invariants(&a, Some(&sim));
    }
    let _ = SimDevice::BASE;
}
