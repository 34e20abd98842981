//! Peaks when threads take turns: a thread that freed (a decrease its counters have not
//! committed) and allocates again after another thread's `reset_peak_stats`, within what it
//! committed, still makes the peak it reaches (missed before: a rise within a thread's
//! committed value skipped the peak check). The same after another thread's census is a known
//! gap (RELIABILITY.md, "Peaks when threads take turns").

use std::sync::mpsc::{channel, Receiver, Sender};

use mempool::sim::SimDevice;
use mempool::{Allocator, Buffer, Config, Sim};

/// Work run on a worker's thread, over the buffers it keeps.
type Job = Box<dyn FnOnce(&mut Vec<Buffer<u8, Sim>>) + Send>;

/// A thread that runs the closures it is sent, in turn with the caller.
struct Worker {
    jobs: Sender<Job>,
    done: Receiver<()>,
    join: std::thread::JoinHandle<()>,
}

impl Worker {
    fn new() -> Worker {
        let (jobs, rx) = channel::<Job>();
        let (tx, done) = channel();
        let join = std::thread::spawn(move || {
            let mut live = Vec::new();
            for job in rx {
                job(&mut live);
                tx.send(()).unwrap();
            }
        });
        Worker { jobs, done, join }
    }
    fn run(&self, f: impl FnOnce(&mut Vec<Buffer<u8, Sim>>) + Send + 'static) {
        self.jobs.send(Box::new(f)).unwrap();
        self.done.recv().unwrap();
    }
    fn end(self) {
        drop(self.jobs);
        self.join.join().unwrap();
    }
}

fn allocator() -> Allocator<Sim> {
    Allocator::sim_with(SimDevice::new(1 << 32), Config::builder().thread_cache(true).build().unwrap())
}

/// A frees blocks, the main thread resets the peaks, A allocates again: the peak after is what
/// A reached, not the value at the reset.
#[test]
fn a_rise_back_after_a_reset_by_another_thread_makes_its_peak() {
    let a = allocator();
    let ta = Worker::new();
    let x = a.clone();
    ta.run(move |l| l.extend((0..8).map(|i| x.alloc::<u8>(1000 * (i + 1)).unwrap())));
    ta.run(|l| l.truncate(5));
    a.reset_peak_stats();
    assert_eq!(a.memory_stats().allocation.all.peak, 5);
    let x = a.clone();
    ta.run(move |l| {
        l.extend((0..2).map(|i| x.alloc::<u8>(6000 + 1000 * i).unwrap()));
        l.truncate(5);
    });
    let s = a.memory_stats();
    assert_eq!(s.allocation.all.current, 5);
    assert_eq!(s.allocation.all.peak, 7, "the rise after the reset was its peak");
    ta.end();
}
