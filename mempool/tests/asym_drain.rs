//! The thread caches' asymmetric protocol (`caching/asym.rs`): owners take their cached blocks
//! with plain loads and stores while other threads drain their caches (`empty_cache`,
//! snapshots, the drains before a new segment) after a process-wide `membarrier`. A block
//! taken by both would be handed out twice: these runs keep every live buffer's address in a
//! shared set and fail on a second holder, and check the allocator's state and statistics
//! afterwards. They run in whichever mode the machine gives (`MEMPOOL_NO_MEMBARRIER` forces
//! the swapping one; the child test below runs both).

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use common::check_invariants;
use mempool::sim::SimDevice;
use mempool::Allocator;

const MIB: usize = 1 << 20;

/// Owners cycling alloc+free of a few sizes (each a cache hit after the first), with every
/// buffer's address claimed in `live` while it is held; a drainer calling `empty_cache`,
/// `snapshot` and `memory_stats` in turn; a grower making and freeing segments (each new
/// segment drains every thread's large block). No address is ever held twice, and the state is
/// exact at the end.
#[test]
fn owners_and_drainers_never_share_a_block() {
    let sim = SimDevice::new(64 << 30);
    let a = Allocator::sim(sim.clone());
    let live = Arc::new(Mutex::new(HashSet::<u64>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(5));
    let claim = |live: &Mutex<HashSet<u64>>, addr: u64| {
        assert!(live.lock().unwrap().insert(addr), "{addr:#x} handed out while another buffer holds it");
    };
    let mut threads = Vec::new();
    for t in 0..3usize {
        let (a, live, stop, start) = (a.clone(), live.clone(), stop.clone(), start.clone());
        threads.push(std::thread::spawn(move || {
            start.wait();
            let sizes = [512usize, 4096, 2 * MIB + 512 * t, 8 * MIB];
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) || n < 20_000 {
                let size = sizes[(n % 4) as usize];
                let b = a.alloc::<u8>(size).unwrap();
                claim(&live, b.device_ptr_raw());
                // A second live buffer of the same size now and then: the cache's other slots.
                let extra = (n % 7 == 0).then(|| a.alloc::<u8>(size).unwrap());
                if let Some(e) = &extra {
                    claim(&live, e.device_ptr_raw());
                }
                live.lock().unwrap().remove(&b.device_ptr_raw());
                drop(b);
                if let Some(e) = extra {
                    live.lock().unwrap().remove(&e.device_ptr_raw());
                }
                n += 1;
            }
            n
        }));
    }
    {
        let (a, start) = (a.clone(), start.clone());
        threads.push(std::thread::spawn(move || {
            start.wait();
            // Bounded: every `empty_cache` makes the owners' next segments at fresh simulated
            // addresses, and the simulated device's plain range ends at `VM_BASE` (1 TiB).
            let mut n = 0u64;
            while n < 6_000 {
                std::thread::sleep(std::time::Duration::from_micros(50));
                match n % 3 {
                    0 => a.empty_cache().unwrap(),
                    1 => drop(a.snapshot()),
                    _ => drop(a.memory_stats()),
                }
                n += 1;
            }
            n
        }));
    }
    {
        let (a, live, start) = (a.clone(), live.clone(), start.clone());
        threads.push(std::thread::spawn(move || {
            start.wait();
            let mut n = 0u64;
            while n < 300 {
                // Sizes no one caches for long: new segments, each draining the large blocks.
                let b = a.alloc::<u8>(40 * MIB + (n as usize % 16) * MIB).unwrap();
                claim(&live, b.device_ptr_raw());
                live.lock().unwrap().remove(&b.device_ptr_raw());
                drop(b);
                if n % 4 == 0 {
                    a.empty_cache().unwrap();
                }
                n += 1;
            }
            n
        }));
    }
    let growers = threads.split_off(3);
    let busy: Vec<u64> = growers.into_iter().map(|t| t.join().expect("no panic")).collect();
    stop.store(true, Ordering::Relaxed);
    let mut counts: Vec<u64> = threads.into_iter().map(|t| t.join().expect("no panic")).collect();
    counts.extend(busy);
    assert!(counts.iter().all(|&n| n > 0), "every thread ran: {counts:?}");
    assert!(live.lock().unwrap().is_empty());
    check_invariants(&a, Some(&sim));
    let s = a.memory_stats();
    assert_eq!(s.allocated_bytes.all.current, 0);
    assert_eq!(s.allocation.all.current, 0);
    a.empty_cache().unwrap();
    assert_eq!(sim.used(), 0, "every block came back: nothing was lost to a double take");
}

/// The same run in a child process with `MEMPOOL_NO_MEMBARRIER` set (the swapping owners),
/// so both modes are exercised wherever the machine has `membarrier`.
#[test]
fn owners_and_drainers_never_share_a_block_with_swaps() {
    if std::env::var_os("MEMPOOL_NO_MEMBARRIER").is_some() {
        return; // this is the child (or the whole run is in the swapping mode already)
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args(["--exact", "owners_and_drainers_never_share_a_block", "--test-threads=1"])
        .env("MEMPOOL_NO_MEMBARRIER", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the swapping mode's run failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
}
