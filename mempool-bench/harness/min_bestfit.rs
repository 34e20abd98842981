// min_bestfit: what a `mixed` step costs with PyTorch's placement rules and nothing else.
//
// A best-fit caching allocator reduced to the rules alone: sizes rounded to 512 B; requests of
// at most 1 MiB from 2 MiB segments, below 10 MiB from 20 MiB segments, larger ones from their
// own segments rounded to 2 MiB; best fit by (size, address) in an ordered set per kind; a small
// block split when 512 B or more remain, a large one when more than 1 MiB remains; neighbours
// merged on free; segments from a counter (no device). No streams, pools, statistics, events,
// thread caches, hooks or error paths. It runs `mempool-bench latency mixed`'s workload (the
// same xorshift64 sequence, 16 then 256 live allocations on one allocator, 200,000 timed steps;
// ITERS overrides) twice: with the ordered sets as `BTreeSet`s (`btree`), then as size bins
// (`binned`: a bin per 512 B below 32 KiB, eight per power of two above, each a sorted vector,
// and a bitmap of the bins that hold blocks: the shape of mempool's `caching/freeset.rs`). It
// prints `mixed <live> <ns> ns  segs <segments made so far>  <sets>`.
//
// `min_bestfit replay <trace>...` replays plain traces (the anchors' format: `a <id> <bytes>
// <stream>`, `f <id>`; every stream on one, as the project's traces are) three times on one
// allocator per set kind, as `mempool-bench replay` does (rep 0 from nothing, reps 1 and 2 on
// what it left), ids mapped to slots beforehand, and prints
// `replay <trace> rep=<r> <cold|warm> ns_per_event=<x> segs <n>  <sets>`: the floor of a warm
// replay event under PyTorch's native rules.
//
//   rustc -O mempool-bench/harness/min_bestfit.rs -o /tmp/min_bestfit && /tmp/min_bestfit
//
// Standard library only, so it builds wherever rustc is (and runs on the GPU hosts, copied).
use std::collections::BTreeSet;
use std::time::Instant;

/// A set of free blocks' keys (size, address, index), ordered.
trait FreeSet {
    fn insert(&mut self, k: u128);
    fn remove(&mut self, k: u128);
    /// The least key of at least `size` bytes, taken out.
    fn take_best_fit(&mut self, size: usize) -> Option<u128>;
}

impl FreeSet for BTreeSet<u128> {
    fn insert(&mut self, k: u128) {
        BTreeSet::insert(self, k);
    }
    fn remove(&mut self, k: u128) {
        BTreeSet::remove(self, &k);
    }
    fn take_best_fit(&mut self, size: usize) -> Option<u128> {
        let k = self.range((size as u128) << 88..).next().copied()?;
        BTreeSet::remove(self, &k);
        Some(k)
    }
}

/// Size bins: exact below 64 units of 512 B, then eight per power of two; each bin sorted.
const EXACT: usize = 64;
const BINS: usize = 256;
struct Binned {
    bins: Vec<Vec<u128>>,
    nonempty: [u64; BINS / 64],
}

impl Binned {
    fn new() -> Binned {
        Binned { bins: (0..BINS).map(|_| Vec::new()).collect(), nonempty: [0; BINS / 64] }
    }
    fn bin(size: usize) -> usize {
        let units = size >> 9;
        if units < EXACT {
            return units;
        }
        let e = usize::BITS as usize - 1 - units.leading_zeros() as usize;
        (EXACT + (e - 6) * 8 + ((units >> (e - 3)) & 7)).min(BINS - 1)
    }
    fn next_nonempty(&self, from: usize) -> Option<usize> {
        let mut w = from / 64;
        if w >= self.nonempty.len() {
            return None;
        }
        let mut bits = self.nonempty[w] & (!0u64 << (from % 64));
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            if w == self.nonempty.len() {
                return None;
            }
            bits = self.nonempty[w];
        }
    }
}

impl FreeSet for Binned {
    fn insert(&mut self, k: u128) {
        let c = Binned::bin((k >> 88) as usize);
        let v = &mut self.bins[c];
        let at = v.partition_point(|x| *x < k);
        v.insert(at, k);
        self.nonempty[c / 64] |= 1 << (c % 64);
    }
    fn remove(&mut self, k: u128) {
        let c = Binned::bin((k >> 88) as usize);
        let v = &mut self.bins[c];
        if let Ok(at) = v.binary_search(&k) {
            v.remove(at);
        }
        if v.is_empty() {
            self.nonempty[c / 64] &= !(1 << (c % 64));
        }
    }
    fn take_best_fit(&mut self, size: usize) -> Option<u128> {
        let c = Binned::bin(size);
        let lo = (size as u128) << 88;
        let v = &self.bins[c];
        let at = v.partition_point(|x| *x < lo);
        let (c, at) = if at < v.len() { (c, at) } else { (self.next_nonempty(c + 1)?, 0) };
        let v = &mut self.bins[c];
        let k = v.remove(at);
        if v.is_empty() {
            self.nonempty[c / 64] &= !(1 << (c % 64));
        }
        Some(k)
    }
}

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
struct A<S> {
    blocks: Vec<Block>,
    spare: Vec<u32>,
    sets: [S; 2],
    top: u64,
    segs: usize,
}
fn key(b: &Block, i: u32) -> u128 {
    ((b.size as u128) << 88) | ((b.addr as u128) << 32) | i as u128
}
impl<S: FreeSet> A<S> {
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
        let i = match self.sets[small as usize].take_best_fit(size) {
            Some(k) => k as u32,
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
    /// Merges block `b`'s successor into `b` (neither in a set).
    fn merge_next_into(&mut self, b: u32) {
        let n = self.blocks[b as usize].next;
        let nb = self.blocks[n as usize];
        let bm = &mut self.blocks[b as usize];
        bm.size += nb.size;
        bm.next = nb.next;
        if nb.next != NONE {
            self.blocks[nb.next as usize].prev = b;
        }
        self.spare.push(n);
    }
    fn free(&mut self, i: u32) {
        let mut cur = i;
        let small = self.blocks[i as usize].small;
        self.blocks[i as usize].free = true;
        let p = self.blocks[cur as usize].prev;
        if p != NONE && self.blocks[p as usize].free {
            let pb = self.blocks[p as usize];
            self.sets[small as usize].remove(key(&pb, p));
            self.merge_next_into(p);
            cur = p;
        }
        let n = self.blocks[cur as usize].next;
        if n != NONE && self.blocks[n as usize].free {
            let nb = self.blocks[n as usize];
            self.sets[small as usize].remove(key(&nb, n));
            self.merge_next_into(cur);
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
fn run<S: FreeSet>(sets: [S; 2], name: &str, iters: usize) {
    let mut a = A { blocks: Vec::new(), spare: Vec::new(), sets, top: 1 << 32, segs: 0 };
    for live in [16usize, 256] {
        let mut rng = Rng(42);
        let mut v: Vec<u32> = (0..live).map(|_| a.alloc(rng.size())).collect();
        let t = Instant::now();
        for _ in 0..iters {
            let k = (rng.next() % live as u64) as usize;
            a.free(v[k]);
            v[k] = a.alloc(rng.size());
        }
        println!("mixed {live} {:.1} ns  segs {}  {name}", t.elapsed().as_nanos() as f64 / iters as f64, a.segs);
        for i in v {
            a.free(i);
        }
    }
}

/// A trace's events with ids mapped to dense slots: (slot, bytes) for an allocation, (slot, 0)
/// for a free.
fn load(path: &str) -> (Vec<(usize, usize)>, usize) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {}", path, e));
    let mut slot_of = std::collections::HashMap::new();
    let mut spare = Vec::new();
    let mut slots = 0;
    let mut ev = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w[0] {
            "a" => {
                let s = spare.pop().unwrap_or_else(|| {
                    slots += 1;
                    slots - 1
                });
                slot_of.insert(w[1].to_string(), s);
                ev.push((s, w[2].parse::<usize>().expect("bytes").max(1)));
            }
            "f" => {
                let s = slot_of.remove(w[1]).expect("a free of a live id");
                spare.push(s);
                ev.push((s, 0));
            }
            x => panic!("{}: unknown event {}", path, x),
        }
    }
    (ev, slots)
}

fn replay<S: FreeSet>(sets: [S; 2], name: &str, path: &str) {
    let (ev, slots) = load(path);
    let file = path.rsplit('/').next().unwrap_or(path);
    let mut a = A { blocks: Vec::new(), spare: Vec::new(), sets, top: 1 << 32, segs: 0 };
    for rep in 0..3 {
        let mut live = vec![NONE; slots];
        let t = Instant::now();
        for &(s, bytes) in &ev {
            if bytes == 0 {
                a.free(live[s]);
                live[s] = NONE;
            } else {
                live[s] = a.alloc(bytes);
            }
        }
        let ns = t.elapsed().as_nanos() as f64 / ev.len() as f64;
        println!("replay {file} rep={rep} {} ns_per_event={ns:.1} segs {}  {name}", if rep == 0 { "cold" } else { "warm" }, a.segs);
        for i in live.into_iter().filter(|&i| i != NONE) {
            a.free(i);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("replay") {
        for t in &args[1..] {
            replay([BTreeSet::new(), BTreeSet::new()], "btree", t);
            replay([Binned::new(), Binned::new()], "binned", t);
        }
        return;
    }
    let iters: usize = std::env::var("ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000);
    run([BTreeSet::new(), BTreeSet::new()], "btree", iters);
    run([Binned::new(), Binned::new()], "binned", iters);
}
