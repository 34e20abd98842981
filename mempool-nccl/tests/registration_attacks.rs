//! Hostile review (review-mapguard): registrations attached and dropped while other threads map
//! and unmap an expandable pool whose guard vetoes unmaps of registered memory.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use mempool::sim::SimDevice;
use mempool::{Allocator, MapGuard, MemPool, PoolOptions};
use mempool_nccl::{Registrar, Registration};

const MIB: usize = 1 << 20;

#[derive(Default)]
struct Book {
    next: u64,
    live: Vec<(u64, u64, usize)>,
    fail_deregister: bool,
}

/// A registrar that checks, as it registers, that the memory is mapped and not registered yet.
#[derive(Clone)]
struct Strict {
    book: Arc<Mutex<Book>>,
    sim: Arc<SimDevice>,
    stale: Arc<AtomicUsize>,
    double: Arc<AtomicUsize>,
}

impl Registrar for Strict {
    fn register(&self, addr: u64, size: usize) -> Result<u64, String> {
        let mut b = self.book.lock().unwrap();
        if !self.sim.is_mapped(addr, size) {
            self.stale.fetch_add(1, Ordering::Relaxed);
        }
        if b.live.iter().any(|l| l.1 < addr + size as u64 && addr < l.1 + l.2 as u64) {
            self.double.fetch_add(1, Ordering::Relaxed);
        }
        b.next += 1;
        let h = b.next;
        b.live.push((h, addr, size));
        Ok(h)
    }
    fn deregister(&self, handle: u64) -> Result<(), String> {
        let mut b = self.book.lock().unwrap();
        if b.fail_deregister {
            return Err("injected".into());
        }
        let i = b.live.iter().position(|l| l.0 == handle).ok_or("unknown handle")?;
        b.live.remove(i);
        Ok(())
    }
}

/// Vetoes the unmap of anything the registrar holds.
struct Guard(Arc<Mutex<Book>>, Arc<AtomicUsize>);
impl MapGuard for Guard {
    fn mapped(&self, _: u64, _: usize) {}
    fn unmapping(&self, addr: u64, size: usize) -> Result<(), String> {
        if self.0.lock().unwrap().live.iter().any(|l| l.1 < addr + size as u64 && addr < l.1 + l.2 as u64) {
            self.1.fetch_add(1, Ordering::Relaxed);
            return Err(format!("{addr:#x} registered"));
        }
        Ok(())
    }
}

#[test]
fn registrations_come_and_go_while_threads_map_and_unmap() {
    for no_span in [true, false] {
        let sim = SimDevice::new(512 * MIB);
        let a = Allocator::sim(sim.clone());
        let book = Arc::new(Mutex::new(Book::default()));
        let vetoes = Arc::new(AtomicUsize::new(0));
        let p = MemPool::on(
            &a,
            PoolOptions::new().expandable(true).no_span(no_span).map_guard(Guard(book.clone(), vetoes.clone())),
        )
        .unwrap();
        let r = Strict { book: book.clone(), sim: sim.clone(), stale: Arc::default(), double: Arc::default() };
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..2u64)
            .map(|t| {
                let (p, stop) = (p.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1);
                    let mut held = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        match x % 5 {
                            0 | 1 => {
                                if let Ok(b) = p.alloc::<u8>((x as usize >> 8) % (30 * MIB) + 1) {
                                    held.push(b);
                                }
                            }
                            2 | 3 if !held.is_empty() => {
                                held.swap_remove((x >> 20) as usize % held.len());
                            }
                            _ => {
                                let _ = p.empty_cache();
                            }
                        }
                        if held.len() > 6 {
                            held.clear();
                        }
                    }
                })
            })
            .collect();
        for i in 0..300 {
            let reg = Registration::attach(&a, Some(p.id()), Arc::new(r.clone())).unwrap();
            book.lock().unwrap().fail_deregister = i % 3 == 0;
            std::thread::yield_now();
            book.lock().unwrap().fail_deregister = false;
            let _ = reg.take_errors();
            drop(reg);
        }
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            w.join().unwrap();
        }
        assert_eq!(r.stale.load(Ordering::Relaxed), 0, "no_span {no_span}: registered memory that was not mapped");
        assert_eq!(r.double.load(Ordering::Relaxed), 0, "no_span {no_span}: registered memory twice");
        // A registration attached at rest holds exactly the pool's physical allocations.
        let reg = Registration::attach(&a, Some(p.id()), Arc::new(r.clone())).unwrap();
        let runs: Vec<(u64, usize)> = p.snapshot().segments.iter().flat_map(|s| s.mappings.clone()).collect();
        assert_eq!(reg.segments(), runs, "no_span {no_span}");
        assert_eq!(reg.segments(), sim.mapped());
        drop(reg);
        assert!(book.lock().unwrap().live.is_empty(), "no_span {no_span}: still registered after the drop");
        p.empty_cache().unwrap();
        assert!(sim.mapped().is_empty(), "no_span {no_span}: left mapped {:?}", sim.mapped());
        eprintln!("no_span {no_span}: vetoes {}", vetoes.load(Ordering::Relaxed));
    }
}
