// min_bestfit: the least a `mixed` step can cost with PyTorch's placement rules, for reference.
//
// A best-fit caching allocator reduced to the rules alone: sizes rounded to 512 B; requests of
// at most 1 MiB from 2 MiB segments, below 10 MiB from 20 MiB segments, larger ones from their
// own segments rounded to 2 MiB; best fit by (size, address) in a `BTreeSet` per kind; a small
// block split when 512 B or more remain, a large one when more than 1 MiB remains; neighbours
// merged on free; segments from a counter (no device). No streams, pools, statistics, events,
// thread caches, hooks or error paths. It runs `mempool-bench latency mixed`'s workload (the
// same xorshift64 sequence, 16 then 256 live allocations on one allocator, 200,000 timed steps;
// ITERS overrides) and prints `mixed <live> <ns> ns  segs <segments made so far>`.
//
//   rustc -O mempool-bench/harness/min_bestfit.rs -o /tmp/min_bestfit && /tmp/min_bestfit
//
// Standard library only, so it builds wherever rustc is (and runs on the GPU hosts, copied).
use std::collections::BTreeSet;
use std::time::Instant;

const SMALL: usize = 1 << 20;
#[derive(Clone, Copy)]
struct Block {
    addr: u64,
    size: usize,
    prev: u32,
    next: u32,
    free: bool,
    small: bool,
}
const NONE: u32 = u32::MAX;
struct A {
    blocks: Vec<Block>,
    spare: Vec<u32>,
    sets: [BTreeSet<u128>; 2],
    top: u64,
    segs: usize,
}
fn key(b: &Block, i: u32) -> u128 {
    ((b.size as u128) << 88) | ((b.addr as u128) << 32) | i as u128
}
impl A {
    fn new_block(&mut self, b: Block) -> u32 {
        match self.spare.pop() {
            Some(i) => {
                self.blocks[i as usize] = b;
                i
            }
            None => {
                self.blocks.push(b);
                (self.blocks.len() - 1) as u32
            }
        }
    }
    fn round(s: usize) -> usize {
        if s < 512 {
            512
        } else {
            (s + 511) & !511
        }
    }
    fn alloc(&mut self, req: usize) -> u32 {
        let size = Self::round(req);
        let small = size <= SMALL;
        let set = &mut self.sets[small as usize];
        let lo = (size as u128) << 88;
        let found = set.range(lo..).next().copied();
        let i = match found {
            Some(k) => {
                set.remove(&k);
                k as u32
            }
            None => {
                let seg = if small {
                    2 << 20
                } else if size < (10 << 20) {
                    20 << 20
                } else {
                    (size + (2 << 20) - 1) & !((2 << 20) - 1)
                };
                let addr = self.top;
                self.top += seg as u64;
                self.segs += 1;
                self.new_block(Block { addr, size: seg, prev: NONE, next: NONE, free: true, small })
            }
        };
        let b = self.blocks[i as usize];
        let rest = b.size - size;
        if (small && rest >= 512) || (!small && rest > SMALL) {
            let r = self.new_block(Block {
                addr: b.addr + size as u64,
                size: rest,
                prev: i,
                next: b.next,
                free: true,
                small,
            });
            if b.next != NONE {
                self.blocks[b.next as usize].prev = r;
            }
            let bm = &mut self.blocks[i as usize];
            bm.next = r;
            bm.size = size;
            let rb = self.blocks[r as usize];
            self.sets[small as usize].insert(key(&rb, r));
        }
        self.blocks[i as usize].free = false;
        i
    }
    fn free(&mut self, i: u32) {
        let mut cur = i;
        let small = self.blocks[i as usize].small;
        self.blocks[i as usize].free = true;
        let p = self.blocks[cur as usize].prev;
        if p != NONE && self.blocks[p as usize].free {
            let pb = self.blocks[p as usize];
            self.sets[small as usize].remove(&key(&pb, p));
            let cb = self.blocks[cur as usize];
            let pm = &mut self.blocks[p as usize];
            pm.size += cb.size;
            pm.next = cb.next;
            if cb.next != NONE {
                self.blocks[cb.next as usize].prev = p;
            }
            self.spare.push(cur);
            cur = p;
        }
        let n = self.blocks[cur as usize].next;
        if n != NONE && self.blocks[n as usize].free {
            let nb = self.blocks[n as usize];
            self.sets[small as usize].remove(&key(&nb, n));
            let cm = &mut self.blocks[cur as usize];
            cm.size += nb.size;
            cm.next = nb.next;
            if nb.next != NONE {
                self.blocks[nb.next as usize].prev = cur;
            }
            self.spare.push(n);
        }
        let cb = self.blocks[cur as usize];
        self.sets[small as usize].insert(key(&cb, cur));
    }
}
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn size(&mut self) -> usize {
        let lo = 1usize << (9 + self.next() % 18);
        lo + (self.next() % lo as u64) as usize
    }
}
fn main() {
    let iters: usize = std::env::var("ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000);
    let mut a =
        A { blocks: Vec::new(), spare: Vec::new(), sets: [BTreeSet::new(), BTreeSet::new()], top: 1 << 32, segs: 0 };
    for live in [16usize, 256] {
        let mut rng = Rng(42);
        let mut v: Vec<u32> = (0..live).map(|_| a.alloc(rng.size())).collect();
        let t = Instant::now();
        for _ in 0..iters {
            let k = (rng.next() % live as u64) as usize;
            a.free(v[k]);
            v[k] = a.alloc(rng.size());
        }
        println!("mixed {live} {:.1} ns  segs {}", t.elapsed().as_nanos() as f64 / iters as f64, a.segs);
        for i in v {
            a.free(i);
        }
    }
}
