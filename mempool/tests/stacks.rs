//! Allocation stacks (`record_stacks`): recorded with each allocation, resolved when looked
//! at; in the snapshot's blocks and trace, and in the out-of-memory report's largest sites.
//! One test: the recording mode is process-wide.

use mempool::sim::SimDevice;
use mempool::stacks::{self, StackMode};
use mempool::{Allocator, BlockState, Buffer, Error, Sim};

#[inline(never)]
fn weights_here(a: &Allocator<Sim>) -> Buffer<u8, Sim> {
    a.alloc::<u8>(6 << 20).unwrap()
}

#[inline(never)]
fn activations_here(a: &Allocator<Sim>) -> Buffer<u8, Sim> {
    a.alloc::<u8>(3 << 20).unwrap()
}

fn stack_of(a: &Allocator<Sim>, addr: u64) -> u32 {
    let snap = a.snapshot();
    let b = snap.segments.iter().flat_map(|s| &s.blocks).find(|b| b.address == addr).unwrap();
    assert_eq!(b.state, BlockState::Allocated);
    b.stack
}

#[test]
fn stacks_name_the_allocation_sites() {
    let a = Allocator::sim(SimDevice::new(64 << 20));
    // Off: nothing recorded.
    let before = activations_here(&a);
    assert_eq!(stack_of(&a, before.device_ptr_raw()), 0);

    mempool::record_stacks(StackMode::Full);
    mempool::record_history(1000);
    let w = weights_here(&a);
    let id = stack_of(&a, w.device_ptr_raw());
    assert_ne!(id, 0);
    let frames = stacks::frames(id);
    assert!(frames[0].name.contains("weights_here"), "innermost frame is the caller's: {frames:?}");
    assert!(frames[0].filename.ends_with("stacks.rs") && frames[0].line > 0, "{:?}", frames[0]);
    assert!(frames.iter().any(|f| f.name.contains("stacks_name_the_allocation_sites")), "the whole stack");
    assert!(!frames.iter().any(|f| f.name.starts_with("mempool::")), "mempool's own frames left out");
    // The block allocated while recording was off still shows none.
    assert_eq!(stack_of(&a, before.device_ptr_raw()), 0);
    // The trace carries it too (the alloc event, and the frees of that block).
    let trace = a.snapshot().trace;
    assert!(trace.iter().any(|e| e.addr == w.device_ptr_raw() && e.stack == id));
    // The same stack again interns to the same id (a loop: the same return addresses).
    let ids: Vec<u32> = (0..2)
        .map(|_| {
            let w2 = weights_here(&a);
            stack_of(&a, w2.device_ptr_raw())
        })
        .collect();
    assert!(ids[0] != 0 && ids[0] == ids[1], "{ids:?}");

    // Sites: one frame.
    mempool::record_stacks(StackMode::Sites);
    assert_eq!(stacks::frames(id).len(), 1);
    assert!(stacks::site(id).unwrap().contains("weights_here"));

    // Out of memory: the report names the largest live sites, largest first.
    let act = activations_here(&a);
    let e = a.alloc::<u8>(60 << 20).unwrap_err();
    let Error::OutOfMemory(r) = &e else { panic!("{e}") };
    assert_eq!(r.sites.len(), 2, "{:?}", r.sites);
    assert!(r.sites[0].0.contains("weights_here") && r.sites[0].1 == 6 << 20, "{:?}", r.sites);
    assert!(r.sites[1].0.contains("activations_here") && r.sites[1].1 == 3 << 20, "{:?}", r.sites);
    let text = e.to_string();
    assert!(text.contains("largest live allocation sites: ") && text.contains("weights_here"), "{text}");

    // Off again: snapshots show no stacks; on again: blocks from before show none.
    mempool::record_stacks(StackMode::None);
    assert_eq!(stack_of(&a, w.device_ptr_raw()), 0);
    let e = a.alloc::<u8>(60 << 20).unwrap_err();
    let Error::OutOfMemory(r) = &e else { panic!("{e}") };
    assert!(r.sites.is_empty());
    mempool::record_stacks(StackMode::Full);
    assert_eq!(stack_of(&a, w.device_ptr_raw()), 0, "recorded before the last start: not shown");
    mempool::record_stacks(StackMode::None);
    mempool::record_history(0);
    drop((before, w, act));
}
