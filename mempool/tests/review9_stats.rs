//! Hostile review of 6b7b70f (inactive-split counts changed once per step, by the step's net
//! change). Current values and peaks were the same as before on 48 configurations (thread cache
//! on and off, expandable segments, no-split, expandable and plain pools, released pools,
//! `empty_cache`; 144,000 checkpoints). The totals (`allocated`, `freed`: the sums of increases
//! and decreases) changed, as PyTorch's do: a step adds its net change, so a merge or a take
//! from a split block no longer counts an increase and a decrease.

mod common;

use common::check_invariants;
use mempool::sim::SimDevice;
use mempool::{Allocator, Config};

/// One small segment (2 MiB), carved by three allocations, freed middle, first, last; each
/// step's net inactive-split change, as PyTorch's `alloc_found_block` / `free_block` count it:
/// 512 B from the new segment: its rest enters (+1, +2,096,640); 1,024 and 4,096 B from the
/// rest: the rest shrinks (0, -1,024), (0, -4,096); the middle freed between two allocated
/// blocks: (+1, +1,024); the first freed, merged with the middle: (0, +512); the last freed,
/// merged with both neighbours into the whole segment, no longer split: (-2, -2,093,056).
#[test]
fn inactive_split_totals_add_each_steps_net_change() {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim_with(sim.clone(), Config::builder().thread_cache(false).build().unwrap());
    let x = a.alloc::<u8>(512).unwrap();
    let y = a.alloc::<u8>(1000).unwrap();
    let z = a.alloc::<u8>(4096).unwrap();
    let s = a.memory_stats();
    assert_eq!((s.inactive_split.all.current, s.inactive_split_bytes.all.current), (1, 2_091_520));
    drop(y);
    drop(x);
    drop(z);
    let s = a.memory_stats();
    check_invariants(&a, Some(&sim));
    let (n, b) = (&s.inactive_split.all, &s.inactive_split_bytes.all);
    assert_eq!((n.current, n.peak, n.allocated, n.freed), (0, 2, 2, 2));
    assert_eq!((b.current, b.peak), (0, 2_096_640));
    assert_eq!(b.allocated, 2_096_640 + 1024 + 512);
    assert_eq!(b.freed, 1024 + 4096 + 2_093_056);
    // Small blocks only: the large pool's counts never moved.
    assert_eq!(s.inactive_split.large_pool.allocated, 0);
    assert_eq!(s.inactive_split.small_pool.allocated, 2);
}
