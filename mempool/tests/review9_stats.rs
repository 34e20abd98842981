//! Hostile review of 6b7b70f (inactive-split counts changed once per step, by the step's net
//! change). Current values and peaks were the same as before on 48 configurations (thread cache
//! on and off, expandable segments, no-split, expandable and plain pools, released pools,
//! `empty_cache`; 144,000 checkpoints). The totals (`allocated`, `freed`: the sums of increases
//! and decreases) changed, as PyTorch's do: a step adds its net change, so a merge or a take
//! from a split block no longer counts an increase and a decrease. It also found that blocks of
//! expandable segments were counted, which PyTorch leaves out; now they are not.

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

/// Found by the same review: PyTorch leaves blocks of expandable segments out of
/// `inactive_split` (their free pages can always be given back); this crate counted them. Now
/// it does not, in the free sets as in the thread caches, while ordinary segments count as
/// before (here the same carving on a plain allocator).
#[test]
fn expandable_segments_stay_out_of_the_inactive_split_counts() {
    for expandable in [true, false] {
        for thread_cache in [true, false] {
            let sim = SimDevice::new(1 << 30);
            let config = Config::builder().expandable_segments(expandable).thread_cache(thread_cache).build().unwrap();
            let a = Allocator::sim_with(sim.clone(), config);
            let mut held: Vec<_> =
                [512usize, 1000, 4096, 3 << 20, 5 << 20, 700].iter().map(|&n| a.alloc::<u8>(n).unwrap()).collect();
            // Free every other block (holes between allocated ones), then reuse a size.
            for i in [1, 3, 5] {
                held[i] = a.alloc::<u8>(1).unwrap();
            }
            drop(a.alloc::<u8>(1000).unwrap());
            let s = a.memory_stats();
            check_invariants(&a, Some(&sim));
            let (n, b) = (&s.inactive_split.all, &s.inactive_split_bytes.all);
            if expandable {
                assert_eq!(
                    (n.current, n.peak, n.allocated, b.current, b.peak),
                    (0, 0, 0, 0, 0),
                    "thread cache {thread_cache}"
                );
            } else {
                assert!(n.peak > 0 && b.current > 0, "plain segments count (thread cache {thread_cache}): {n:?} {b:?}");
            }
            drop(held);
            check_invariants(&a, Some(&sim));
        }
    }
}
