//! Second hostile review: the background event thread's raw address (commit 462fb46) under
//! Miri's aliasing model. Runs only under Miri:
//! `MIRIFLAGS=-Zmiri-disable-isolation cargo +nightly miri test -p cuda-mempool --test review2_miri`
//! (ignored otherwise: a normal build cannot see the aliasing violation).

mod common;

use common::pinned_sim;

const MIB: usize = 1 << 20;

/// Was a finding (medium, soundness; fixed: the thread now holds only `Arc`s of the parts a look
/// needs, never the allocator's address, and this passes under Miri): the event thread followed the allocator's address
/// (`background.rs`, `Target(*const DeviceAllocator)`, derived from a shared reference through
/// the `Arc`) while a look is under way, and the last handle's drop meanwhile makes a unique
/// reference to the same allocator: `Arc::drop_slow` -> `drop_in_place(&mut Shared)` ->
/// `<DeviceAllocator as Drop>::drop(&mut self)`, whose first act (`Poller::stop`) only then
/// waits for the look to end. A `&mut` that is live (and, as `drop`'s argument, protected)
/// while another thread reads and writes the same allocator through a pointer not derived
/// from it is undefined behaviour under Rust's aliasing rules (Stacked Borrows pops the
/// thread's tag when the `&mut` is made; the thread's next access through it is reported).
/// The gate makes the *lifetime* right, not the aliasing: the thread must be stopped before
/// any `&mut` to the allocator exists (e.g. from the handle's side, while the `Arc` is still
/// shared), or the allocator's shared part must stay behind a pointer that `drop` does not
/// reborrow uniquely.
///
/// The last buffer's drop is the natural trigger: its free records an event and wakes the
/// thread, which takes the gate and starts a look, while the buffer goes on to drop its
/// handle, the last one.
#[test]
#[cfg_attr(not(miri), ignore = "run under Miri (see the module's documentation)")]
fn finding_the_last_handle_dropped_during_a_look_is_not_an_aliasing_violation() {
    for _ in 0..8 {
        let (sim, a) = pinned_sim(1 << 30, "pinned_use_background_threads:True,thread_cache:False");
        let s = sim.new_stream();
        let on = a.set_stream(&s).unwrap();
        let x = a.alloc::<u8>(MIB).unwrap();
        let _ = x.device_ptr_raw();
        drop(on);
        drop(a); // the buffer holds the last handle now
        drop(x); // kicks the thread, then drops the last handle while it looks
        sim.complete_all();
    }
}
