//! The registration bookkeeping on the simulated device, through a recording registrar: which
//! segment is registered, in which order, across pool growth, release, failed deregistrations,
//! drops inside hooks, and other allocators of the same device index.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use mempool::sim::SimDevice;
use mempool::trace::{self, Action};
use mempool::{Allocator, BackendError, MemPool, PoolOptions, RawAllocator, Sim, StreamId};
use mempool_nccl::{Error, LaunchEnv, Registrar, Registration};

#[derive(Default)]
struct Book {
    next_handle: u64,
    live: Vec<(u64, u64, usize)>, // handle, addr, size
    log: Vec<String>,
    refuse: Option<u64>,
    /// Failure injection: `deregister` fails (and the registration stays live) while set.
    fail_deregister: bool,
}

/// Records every call; a registration is live from `register` to a successful `deregister`.
#[derive(Clone, Default)]
struct Recording(Arc<Mutex<Book>>);

impl Recording {
    fn live(&self) -> Vec<(u64, usize)> {
        let mut v: Vec<_> = self.0.lock().unwrap().live.iter().map(|l| (l.1, l.2)).collect();
        v.sort_unstable();
        v
    }
    fn log(&self) -> Vec<String> {
        self.0.lock().unwrap().log.clone()
    }
    fn fail_deregister(&self, yes: bool) {
        self.0.lock().unwrap().fail_deregister = yes;
    }
}

impl Registrar for Recording {
    fn register(&self, addr: u64, size: usize) -> Result<u64, String> {
        let mut b = self.0.lock().unwrap();
        if b.refuse == Some(addr) {
            return Err("ncclInvalidArgument".into());
        }
        b.next_handle += 1;
        let h = b.next_handle;
        b.live.push((h, addr, size));
        b.log.push(format!("register {addr:#x}"));
        Ok(h)
    }
    fn deregister(&self, handle: u64) -> Result<(), String> {
        let mut b = self.0.lock().unwrap();
        let i = b.live.iter().position(|l| l.0 == handle).ok_or("unknown handle")?;
        let addr = b.live[i].1;
        if b.fail_deregister {
            b.log.push(format!("deregister {addr:#x} failed"));
            return Err("ncclInternalError".into());
        }
        b.live.remove(i);
        b.log.push(format!("deregister {addr:#x}"));
        Ok(())
    }
}

/// A pool allocator that refuses to free a segment still registered anywhere, as
/// `NcclMemAllocator` does (the caching allocator then keeps it cached), and records it.
struct Checked {
    next: Mutex<u64>,
    registrars: Vec<Recording>,
    frees: Arc<Mutex<Vec<u64>>>,
    refused: Arc<Mutex<Vec<u64>>>,
}

// SAFETY: only ever used with simulated allocators, whose memory is never read or written;
// the addresses it makes up are distinct, granularity-aligned ranges, each handed out once.
unsafe impl RawAllocator for Checked {
    fn name(&self) -> &str {
        "checked"
    }
    fn alloc(&self, size: usize, _: usize, _: StreamId) -> Result<u64, BackendError> {
        let mut n = self.next.lock().unwrap();
        let a = 0x7000_0000_0000 + *n;
        *n += (size as u64).next_multiple_of(2 << 20);
        Ok(a)
    }
    unsafe fn free(&self, ptr: u64, _: usize, _: usize, _: StreamId) -> Result<(), BackendError> {
        if self.registrars.iter().any(|r| r.live().iter().any(|l| l.0 == ptr)) {
            self.refused.lock().unwrap().push(ptr);
            return Err(BackendError::Failed(format!("segment {ptr:#x} is still registered")));
        }
        self.frees.lock().unwrap().push(ptr);
        Ok(())
    }
    fn granularity(&self) -> usize {
        2 << 20
    }
}

struct Setup {
    a: Allocator<Sim>,
    pool: MemPool<Sim>,
    frees: Arc<Mutex<Vec<u64>>>,
    /// Frees refused because a registration was still live: none, unless a deregistration failed.
    refused: Arc<Mutex<Vec<u64>>>,
}

fn setup(registrars: Vec<Recording>) -> Setup {
    let a = Allocator::sim(SimDevice::new(1 << 30));
    let (frees, refused) = (Arc::default(), Arc::default());
    let raw = Checked { next: Mutex::new(0), registrars, frees: Arc::clone(&frees), refused: Arc::clone(&refused) };
    let pool = MemPool::on(&a, PoolOptions::new().allocator(raw)).unwrap();
    Setup { a, pool, frees, refused }
}

fn attach(a: &Allocator<Sim>, pool: &MemPool<Sim>, r: &Recording) -> Registration {
    Registration::attach(a, Some(pool.id()), Arc::new(r.clone())).unwrap()
}

#[test]
fn existing_segments_then_growth_then_release() {
    let r = Recording::default();
    let Setup { a, pool, frees, refused } = setup(vec![r.clone()]);
    let x = pool.alloc::<u8>(100).unwrap(); // small segment, before the registration
    let reg = attach(&a, &pool, &r);
    assert_eq!(r.live(), pool.snapshot().segments.iter().map(|s| (s.address, s.total_size)).collect::<Vec<_>>());
    let y = pool.alloc::<u8>(30 << 20).unwrap(); // a new segment: registered as it is made
    let big = pool.snapshot().segments.iter().find(|s| s.total_size >= 30 << 20).unwrap().address;
    assert!(r.live().iter().any(|l| l.0 == big), "a segment allocated after registration was not registered");
    assert_eq!(reg.segments(), r.live());
    // Blocks of the default pools are none of this registration's business.
    let _d = a.alloc::<u8>(30 << 20).unwrap();
    assert_eq!(r.live().len(), 2);
    drop(y);
    pool.empty_cache().unwrap(); // the big segment goes: deregistered first (checked by the allocator)
    assert!(!r.live().iter().any(|l| l.0 == big));
    assert_eq!(*frees.lock().unwrap(), vec![big]);
    let log = r.log();
    assert_eq!(log.last().unwrap(), &format!("deregister {big:#x}"));
    drop(x);
    drop(reg); // everything left is deregistered
    assert!(r.live().is_empty());
    drop(pool);
    assert_eq!(frees.lock().unwrap().len(), 2);
    assert!(refused.lock().unwrap().is_empty(), "a segment was freed while still registered");
}

#[test]
fn a_segment_on_several_communicators() {
    let (r1, r2) = (Recording::default(), Recording::default());
    let Setup { a, pool, refused, .. } = setup(vec![r1.clone(), r2.clone()]);
    let reg1 = attach(&a, &pool, &r1);
    let x = pool.alloc::<u8>(100).unwrap();
    let reg2 = attach(&a, &pool, &r2);
    assert_eq!(r1.live(), r2.live());
    assert_eq!(r1.live().len(), 1);
    drop(reg1);
    assert!(r1.live().is_empty());
    assert_eq!(r2.live().len(), 1);
    drop(x);
    drop(pool); // released: the segment goes back, deregistered from r2 first
    assert!(r2.live().is_empty());
    drop(reg2);
    assert!(refused.lock().unwrap().is_empty(), "a segment was freed while still registered");
}

#[test]
fn pool_release_deregisters_before_every_free() {
    let r = Recording::default();
    let Setup { a, pool, frees, refused } = setup(vec![r.clone()]);
    let _reg = attach(&a, &pool, &r);
    let keep = pool.alloc::<u8>(5 << 20).unwrap();
    drop(pool.alloc::<u8>(100).unwrap());
    assert_eq!(r.live().len(), 2);
    drop(pool); // the free small segment goes at once
    assert_eq!(r.live().len(), 1);
    assert_eq!(frees.lock().unwrap().len(), 1);
    drop(keep); // and the other with its last block
    assert!(r.live().is_empty());
    assert_eq!(frees.lock().unwrap().len(), 2);
    assert!(refused.lock().unwrap().is_empty(), "a segment was freed while still registered");
}

#[test]
fn a_refused_registration_is_reported_and_the_pool_keeps_working() {
    let r = Recording::default();
    let Setup { a, pool, .. } = setup(vec![r.clone()]);
    let reg = attach(&a, &pool, &r);
    r.0.lock().unwrap().refuse = Some(0x7000_0000_0000);
    let x = pool.alloc::<u8>(100).unwrap();
    assert_eq!(x.device_ptr_raw(), 0x7000_0000_0000);
    let errors = reg.take_errors();
    assert_eq!(errors.len(), 1);
    let msg = errors[0].to_string();
    assert!(matches!(errors[0], Error::Registration { segment: 0x7000_0000_0000, .. }));
    assert!(msg.contains("0x700000000000") && msg.contains("keeps working"), "{msg}");
    let y = pool.alloc::<u8>(100).unwrap(); // same segment: the pool works on
    assert!(reg.take_errors().is_empty());
    drop((x, y));
}

#[test]
fn device_wide_registration_covers_every_pool() {
    let r = Recording::default();
    let Setup { a, pool, .. } = setup(vec![r.clone()]);
    let reg = Registration::attach(&a, None, Arc::new(r.clone())).unwrap();
    let _x = pool.alloc::<u8>(100).unwrap();
    let _y = a.alloc::<u8>(100).unwrap();
    assert_eq!(r.live().len(), 2);
    drop(reg);
    assert!(r.live().is_empty());
}

/// A failed deregistration keeps its handle: the segment is still registered, so its free is
/// refused and the caching allocator keeps it (announcing it again, which must not register it a
/// second time); the next free retries the deregistration and then the segment goes.
#[test]
fn a_failed_deregistration_keeps_the_handle_and_the_segment_until_a_retry() {
    let r = Recording::default();
    let Setup { a, pool, frees, refused } = setup(vec![r.clone()]);
    let reg = attach(&a, &pool, &r);
    drop(pool.alloc::<u8>(100).unwrap());
    let seg = r.live()[0];
    r.fail_deregister(true);
    let e = pool.empty_cache().unwrap_err();
    assert!(e.to_string().contains("still registered"), "{e}");
    assert_eq!(*refused.lock().unwrap(), [seg.0]);
    assert!(frees.lock().unwrap().is_empty());
    assert_eq!(r.live(), [seg], "announced again, the segment was registered twice");
    assert_eq!(reg.segments(), [seg], "the registration dropped a handle that is still registered");
    let errors = reg.take_errors();
    assert!(matches!(&errors[..], [Error::Registration { segment, .. }] if *segment == seg.0), "{errors:?}");
    // The pool works on with the cached segment.
    let x = pool.alloc::<u8>(100).unwrap();
    assert_eq!(x.device_ptr_raw(), seg.0);
    drop(x);
    // Once NCCL can deregister it, the next free does, and the segment goes back.
    r.fail_deregister(false);
    pool.empty_cache().unwrap();
    assert_eq!(*frees.lock().unwrap(), [seg.0]);
    assert!(r.live().is_empty());
    assert!(reg.segments().is_empty());
    let registers = r.log().iter().filter(|l| l.starts_with("register")).count();
    assert_eq!(registers, 1, "{:?}", r.log());
    assert_eq!(r.log().last().unwrap(), &format!("deregister {:#x}", seg.0));
}

/// A registration dropped inside a trace hook detaches: what it had registered is deregistered
/// there, and later segments are not registered.
#[test]
fn a_registration_dropped_inside_a_hook_detaches() {
    let r = Recording::default();
    let Setup { a, pool, frees, refused } = setup(vec![r.clone()]);
    let reg = attach(&a, &pool, &r);
    let small = pool.alloc::<u8>(100).unwrap();
    assert_eq!(r.live().len(), 1);
    let owned = Arc::new(Mutex::new(Some(reg)));
    let dropped_in_hook = Arc::new(AtomicBool::new(false));
    let (o, flag, me) = (owned.clone(), dropped_in_hook.clone(), a.id());
    let _hook = trace::attach(move |e| {
        if e.allocator == me && e.action == Action::SegmentAlloc && e.size >= 30 << 20 {
            if let Some(reg) = o.lock().unwrap().take() {
                drop(reg);
                flag.store(true, Ordering::SeqCst);
            }
        }
    })
    .unwrap();
    let big = pool.alloc::<u8>(30 << 20).unwrap(); // its SegmentAlloc drops the registration
    assert!(dropped_in_hook.load(Ordering::SeqCst));
    assert!(r.live().is_empty(), "still registered after the registration was dropped: {:?}", r.live());
    let before = r.log().len();
    let later = pool.alloc::<u8>(50 << 20).unwrap(); // another new segment
    assert_eq!(r.log().len(), before, "a segment was registered after the registration was dropped: {:?}", r.log());
    drop((small, big, later));
    pool.empty_cache().unwrap();
    assert_eq!(frees.lock().unwrap().len(), 3);
    assert!(refused.lock().unwrap().is_empty());
}

/// Other allocators' memory never reaches a registration, even where they call themselves the
/// same device: a host allocator and another simulated one, both device 0.
#[test]
fn other_allocators_of_the_same_device_index_never_reach_the_registrar() {
    let r = Recording::default();
    let target = Allocator::sim(SimDevice::new(1 << 30));
    let reg = Registration::attach(&target, None, Arc::new(r.clone())).unwrap();
    let other = Allocator::sim(SimDevice::new(1 << 30));
    let host = Allocator::host();
    assert_eq!((other.device(), host.device()), (target.device(), target.device()));
    let other_pool = MemPool::on(&other, PoolOptions::new()).unwrap();
    for size in [100usize, 3 << 20, 30 << 20] {
        drop(other.alloc::<u8>(size).unwrap());
        drop(other_pool.alloc::<u8>(size).unwrap());
        drop(host.alloc::<u8>(size).unwrap());
    }
    other.empty_cache().unwrap();
    other_pool.empty_cache().unwrap();
    host.empty_cache().unwrap();
    assert!(r.log().is_empty(), "another allocator's segments reached the registrar: {:?}", r.log());
    // The registration itself works: its own allocator's segment is registered.
    let _x = target.alloc::<u8>(100).unwrap();
    assert_eq!(r.live().len(), 1);
    assert_eq!(reg.segments(), r.live());
}

#[test]
fn same_allocation_sequence_same_offsets_on_every_rank() {
    // NVLS wants a buffer at the same offset of its segment on every local rank.
    // Each rank's allocator hands out other addresses (another device, another process).
    let offsets = |seed: u64, base: u64| {
        let a = Allocator::sim(SimDevice::new(1 << 38));
        let raw =
            Checked { next: Mutex::new(base), registrars: Vec::new(), frees: Arc::default(), refused: Arc::default() };
        let pool = MemPool::on(&a, PoolOptions::new().allocator(raw)).unwrap();
        let mut x = seed;
        let mut live = Vec::new();
        let mut out = Vec::new();
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x % 2 == 0 && !live.is_empty() {
                live.swap_remove((x % live.len() as u64) as usize);
            } else {
                let b = pool.alloc::<u8>(1 + (x % (16 << 20)) as usize).unwrap();
                let seg = pool
                    .snapshot()
                    .segments
                    .iter()
                    .find(|s| s.address <= b.device_ptr_raw() && b.device_ptr_raw() < s.address + s.total_size as u64)
                    .map(|s| s.address)
                    .unwrap();
                out.push((b.device_ptr_raw() - seg, b.num_bytes()));
                live.push(b);
            }
        }
        out
    };
    let (rank0, rank1) = (offsets(7, 0), offsets(7, 40 << 30));
    assert!(rank0.len() > 500);
    assert_eq!(rank0, rank1, "the same allocation sequence gave other offsets on another rank");
}

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: std::collections::HashMap<String, String> =
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |k| m.get(k).cloned()
}

#[test]
fn launcher_environments() {
    let torchrun = env(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_RUN_ID", "x"),
    ]);
    let e = LaunchEnv::read(torchrun).unwrap();
    assert_eq!((e.rank, e.world_size, e.local_rank), (3, 8, 1));
    assert_eq!(e.comm_id_to_set.as_deref(), Some("10.0.0.1:29501"), "torchrun's store holds MASTER_PORT");
    let slurm =
        env(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "16"), ("SLURM_LOCALID", "5"), ("NCCL_COMM_ID", "node0:1234")]);
    let e = LaunchEnv::read(slurm).unwrap();
    assert_eq!((e.rank, e.world_size, e.local_rank, e.comm_id_to_set), (5, 16, 5, None));
    let ompi = env(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "7000"),
    ]);
    let e = LaunchEnv::read(ompi).unwrap();
    assert_eq!((e.rank, e.local_rank, e.comm_id_to_set.as_deref()), (0, 0, Some("h:7000")));
}

#[test]
fn bad_launcher_environments_are_clear_errors() {
    let e = LaunchEnv::read(env(&[("RANK", "4"), ("WORLD_SIZE", "4"), ("NCCL_COMM_ID", "h:1")])).unwrap_err();
    assert_eq!(e, Error::InvalidRank { rank: 4, world_size: 4 });
    let e = LaunchEnv::read(env(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("SLURM_NTASKS", "8"), ("NCCL_COMM_ID", "h:1")]))
        .unwrap_err();
    assert!(e.to_string().contains("WORLD_SIZE=4 and SLURM_NTASKS=8 disagree"), "{e}");
    let e = LaunchEnv::read(env(&[("WORLD_SIZE", "4")])).unwrap_err();
    assert!(e.to_string().contains("no rank"), "{e}");
    let e = LaunchEnv::read(env(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err();
    assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
    let e = LaunchEnv::read(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
    assert!(e.to_string().contains("RANK=\"x\""), "{e}");
}

#[test]
fn without_nccl_the_error_names_the_library() {
    if mempool_nccl::nccl_version().is_ok() {
        return; // NCCL is installed here: nothing to check
    }
    let e = mempool_nccl::Id::new().unwrap_err();
    assert_eq!(e, Error::NoNccl);
    assert!(e.to_string().contains("libnccl.so.2"));
    assert!(mempool_nccl::nccl_pool(0).is_err());
}

/// A map guard that keeps a physical allocation mapped while a registrar has it, as
/// `NcclMapGuard` does through the ledger.
struct KeepRegistered(Recording);

impl mempool::MapGuard for KeepRegistered {
    fn mapped(&self, _addr: u64, _size: usize) {}
    fn unmapping(&self, addr: u64, _size: usize) -> Result<(), String> {
        if self.0.live().iter().any(|l| l.0 == addr) {
            return Err(format!("{addr:#x} still registered"));
        }
        Ok(())
    }
}

#[test]
fn expandable_pools_register_each_physical_allocation_and_deregister_before_its_unmap() {
    const MIB: usize = 1 << 20;
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    let r = Recording::default();
    let p = MemPool::on(&a, PoolOptions::new().expandable(true).no_span(true).map_guard(KeepRegistered(r.clone())))
        .unwrap();
    // Mapped before the registration: registered from the snapshot, piece by piece.
    let x = p.alloc::<u8>(3 * MIB).unwrap();
    let reg = attach(&a, &p, &r);
    let y = p.alloc::<u8>(5 * MIB).unwrap();
    assert_eq!(r.live(), sim.mapped(), "each physical allocation registered on its own");
    assert!(reg.take_errors().is_empty());
    // Unmapped ones are deregistered first (the guard would refuse otherwise).
    drop(x);
    p.empty_cache().unwrap();
    assert_eq!(r.live(), sim.mapped());
    assert_eq!(r.live().len(), 1);
    // A failed deregistration keeps the memory mapped and registered, and a retry ends both.
    drop(y);
    r.fail_deregister(true);
    assert!(p.empty_cache().is_err(), "the guard refuses to unmap registered memory");
    assert_eq!(r.live(), sim.mapped());
    assert!(!reg.take_errors().is_empty());
    r.fail_deregister(false);
    p.empty_cache().unwrap();
    assert!(sim.mapped().is_empty() && r.live().is_empty());
    let log = r.log();
    assert!(log.iter().all(|l| !l.contains("failed") || log.iter().any(|m| m == &l.replace(" failed", ""))));
    drop(reg);
}
