//! A set of free blocks ordered by (size, address), answering "smallest block at or above this
//! size, lowest address first" — PyTorch's best fit — in a few nanoseconds.
//!
//! Blocks are binned by size class (exact classes up to 32 KiB, then 16 classes per power of two)
//! with a bitmap of non-empty bins. A bin is a short sorted `Vec`, so the common cycle of the
//! caching allocator (take a block, split it, merge it back) touches one or two tiny vectors and
//! never allocates; a bin that grows past [`TREE_AT`] entries becomes a `BTreeSet` so that many
//! equal-sized free blocks stay O(log n). Since every size lies in exactly one class and classes
//! are ordered, the first block at or above the request in its own class, else the first block of
//! the next non-empty class, is the exact best fit.

use std::collections::BTreeSet;

/// Entries are keys packed as (size: 40 bits, address: 56 bits, block index: 32 bits).
pub(super) type Key = u128;

pub(super) fn key(size: usize, addr: u64, idx: u32) -> Key {
    debug_assert!(size <= super::MAX_BLOCK && addr < (1 << 56));
    ((size as u128) << 88) | ((addr as u128) << 32) | idx as u128
}

pub(super) fn key_size(k: Key) -> usize {
    (k >> 88) as usize
}

pub(super) fn key_idx(k: Key) -> u32 {
    k as u32
}

/// Sizes below `EXACT * 512` bytes each have a class of their own.
const EXACT: usize = 64;
/// Classes per power of two above that.
const SUB_BITS: u32 = 4;
const SUB: usize = 1 << SUB_BITS;
/// Enough classes for every size up to `MAX_BLOCK` (2^40 bytes, i.e. 2^31 units of 512).
const CLASSES: usize = EXACT + (31 - 6 + 1) * SUB;
const WORDS: usize = CLASSES.div_ceil(64);
/// A bin with more entries than this becomes a tree.
const TREE_AT: usize = 256;

#[inline]
fn class_of(size: usize) -> usize {
    let units = size >> 9;
    if units < EXACT {
        return units;
    }
    let e = usize::BITS - 1 - units.leading_zeros(); // >= 6
    let sub = (units >> (e - SUB_BITS)) & (SUB - 1);
    EXACT + (e as usize - 6) * SUB + sub
}

#[derive(Debug)]
enum Bin {
    Sorted(Vec<Key>),
    Tree(BTreeSet<Key>),
}

#[derive(Clone, Copy)]
enum Pos {
    At(usize),
    Key(Key),
}

/// Free blocks of one (pool, stream, small/large).
#[derive(Debug)]
pub(super) struct FreeSet {
    bins: Vec<Bin>,
    nonempty: [u64; WORDS],
}

impl FreeSet {
    pub(super) fn new() -> FreeSet {
        FreeSet { bins: (0..CLASSES).map(|_| Bin::Sorted(Vec::new())).collect(), nonempty: [0; WORDS] }
    }

    /// The smallest entry whose size is at least `size` (lowest address among equals), removed
    /// if `accept` agrees.
    #[inline]
    pub(super) fn take_best_fit(&mut self, size: usize, accept: impl FnOnce(usize) -> bool) -> Option<Key> {
        let c = class_of(size);
        let k = key(size, 0, 0);
        let (bin, pos) = match self.position_at_or_above(c, k) {
            Some(p) => (c, p),
            None => {
                let next = self.next_nonempty(c + 1)?;
                (next, self.position_at_or_above(next, 0)?)
            }
        };
        let found = match (&self.bins[bin], pos) {
            (Bin::Sorted(v), Pos::At(i)) => v[i],
            (_, Pos::Key(k)) => k,
            (Bin::Tree(_), Pos::At(_)) => unreachable!("trees answer with keys"),
        };
        if !accept(key_size(found)) {
            return None;
        }
        match (&mut self.bins[bin], pos) {
            (Bin::Sorted(v), Pos::At(i)) => {
                v.remove(i);
            }
            (Bin::Tree(t), _) => {
                t.remove(&found);
            }
            (Bin::Sorted(_), Pos::Key(_)) => unreachable!("sorted bins answer with positions"),
        }
        self.after_remove(bin);
        Some(found)
    }

    #[inline]
    fn position_at_or_above(&self, c: usize, k: Key) -> Option<Pos> {
        if self.nonempty[c / 64] & (1 << (c % 64)) == 0 {
            return None;
        }
        match &self.bins[c] {
            Bin::Sorted(v) => {
                let i = if v.len() == 1 || v[0] >= k { 0 } else { v.partition_point(|x| *x < k) };
                (v.get(i).is_some_and(|x| *x >= k)).then_some(Pos::At(i))
            }
            Bin::Tree(t) => t.range(k..).next().map(|k| Pos::Key(*k)),
        }
    }

    #[inline]
    fn next_nonempty(&self, from: usize) -> Option<usize> {
        let mut w = from / 64;
        if w >= WORDS {
            return None;
        }
        let mut bits = self.nonempty[w] & (!0u64).checked_shl((from % 64) as u32).unwrap_or(0);
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            if w == WORDS {
                return None;
            }
            bits = self.nonempty[w];
        }
    }

    #[inline]
    pub(super) fn insert(&mut self, k: Key) {
        let c = class_of(key_size(k));
        self.nonempty[c / 64] |= 1 << (c % 64);
        match &mut self.bins[c] {
            Bin::Sorted(v) => {
                if v.last().is_none_or(|l| *l < k) {
                    v.push(k);
                } else {
                    let at = v.partition_point(|x| *x < k);
                    v.insert(at, k);
                }
                if v.len() > TREE_AT {
                    self.bins[c] = Bin::Tree(std::mem::take(v).into_iter().collect());
                }
            }
            Bin::Tree(t) => {
                t.insert(k);
            }
        }
    }

    /// Removes `k`; returns whether it was there.
    #[inline]
    pub(super) fn remove(&mut self, k: Key) -> bool {
        let c = class_of(key_size(k));
        let found = match &mut self.bins[c] {
            Bin::Sorted(v) if v.len() == 1 && v[0] == k => {
                v.clear();
                true
            }
            Bin::Sorted(v) => match v.binary_search(&k) {
                Ok(i) => {
                    v.remove(i);
                    true
                }
                Err(_) => false,
            },
            Bin::Tree(t) => t.remove(&k),
        };
        self.after_remove(c);
        found
    }

    #[inline]
    fn after_remove(&mut self, c: usize) {
        let empty = match &self.bins[c] {
            Bin::Sorted(v) => v.is_empty(),
            Bin::Tree(t) => t.is_empty(),
        };
        if empty {
            self.nonempty[c / 64] &= !(1 << (c % 64));
            if matches!(self.bins[c], Bin::Tree(_)) {
                self.bins[c] = Bin::Sorted(Vec::new());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_ordered_and_cover_every_size() {
        let mut last = 0;
        let mut size = 512;
        while size <= super::super::MAX_BLOCK {
            let c = class_of(size);
            assert!(c >= last && c < CLASSES, "size {size}: class {c} after {last}");
            last = c;
            size += if size < (1 << 20) { 512 } else { size / 37 / 512 * 512 + 512 };
        }
    }

    /// Against a `BTreeSet` doing the same, with many equal sizes so bins become trees and back.
    #[test]
    fn best_fit_matches_an_ordered_set() {
        let mut fs = FreeSet::new();
        let mut reference = BTreeSet::new();
        let mut x = 42u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..40_000u32 {
            let size = if next() % 3 == 0 { 512 * (1 + next() % 4) as usize } else { 512 << (next() % 30) };
            let k = key(size, next() % (1 << 40), i);
            if next() % 3 != 0 {
                fs.insert(k);
                reference.insert(k);
            } else if let Some(&victim) = reference.iter().nth((next() % 8) as usize) {
                assert!(fs.remove(victim));
                reference.remove(&victim);
            }
            let want_size = 512 << (next() % 31);
            let want = reference.range(key(want_size, 0, 0)..).next().copied();
            let take = next() % 2 == 0;
            assert_eq!(fs.take_best_fit(want_size, |_| take), want.filter(|_| take), "request {want_size}");
            if let (Some(w), true) = (want, take) {
                reference.remove(&w);
            }
        }
        assert!(!fs.remove(key(512, 1, 1)));
    }
}
