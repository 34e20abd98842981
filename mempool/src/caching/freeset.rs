//! A set of free blocks ordered by (size, address), answering "smallest block at or above this
//! size, lowest address first" — PyTorch's best fit — in a few nanoseconds.
//!
//! Blocks are binned by size class (exact classes up to 32 KiB, then 16 classes per power of two)
//! with a bitmap of non-empty bins. A bin is a short sorted `Vec`, so the common cycle of the
//! caching allocator (take a block, split it, merge it back) touches one or two tiny vectors and
//! never allocates; a bin that grows past [`TREE_AT`] entries becomes a `BTreeSet` so that many
//! equal-sized free blocks stay O(log n). Since every size lies in exactly one class and classes
//! are ordered, the first block at or above the request in its own class, else the first block of
//! the next non-empty class, is the exact best fit. The best fit and the entry after it are named
//! in place, and only the one a caller takes leaves the set.

use std::collections::BTreeSet;

/// Entries are keys packed as (size: 40 bits, address: 56 bits, block index: 32 bits).
pub(super) type Key = u128;

pub(super) fn key(size: usize, addr: u64, idx: u32) -> Key {
    debug_assert!(size <= crate::rules::MAX_BLOCK && addr < (1 << 56));
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
/// Bins allocated: a power of two at least `CLASSES`, so masked indices need no bounds checks.
const SLOTS: usize = CLASSES.next_power_of_two();
const WORDS: usize = SLOTS / 64;
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
    (EXACT + (e as usize - 6) * SUB + sub) & (SLOTS - 1)
}

/// Free blocks of one (pool, stream, small/large).
#[derive(Debug)]
pub(super) struct FreeSet {
    /// Sorted bins; a bin whose bit is set in `tree` lives in `trees` instead.
    bins: Box<[Vec<Key>; SLOTS]>,
    trees: Vec<(usize, BTreeSet<Key>)>,
    nonempty: [u64; WORDS],
    tree: [u64; WORDS],
}

#[inline]
fn bit(words: &[u64; WORDS], c: usize) -> bool {
    words[(c / 64) & (WORDS - 1)] & (1 << (c % 64)) != 0
}

#[inline]
fn set_bit(words: &mut [u64; WORDS], c: usize, on: bool) {
    let w = &mut words[(c / 64) & (WORDS - 1)];
    if on {
        *w |= 1 << (c % 64);
    } else {
        *w &= !(1 << (c % 64));
    }
}

impl FreeSet {
    pub(super) fn new() -> FreeSet {
        let bins: Box<[Vec<Key>]> = (0..SLOTS).map(|_| Vec::new()).collect();
        FreeSet {
            bins: bins.try_into().expect("SLOTS bins"),
            trees: Vec::new(),
            nonempty: [0; WORDS],
            tree: [0; WORDS],
        }
    }

    fn tree_mut(&mut self, c: usize) -> &mut BTreeSet<Key> {
        let i = self.trees.iter().position(|(b, _)| *b == c).expect("tree bin listed");
        &mut self.trees[i].1
    }

    fn tree_ref(&self, c: usize) -> &BTreeSet<Key> {
        &self.trees.iter().find(|(b, _)| *b == c).expect("tree bin listed").1
    }

    /// The smallest entry whose size is at least `size` (lowest address among equals), and its
    /// bin; left in the set.
    #[inline(always)]
    pub(super) fn best_fit(&self, size: usize) -> Option<(usize, Key)> {
        self.first_from(class_of(size), key(size, 0, 0))
    }

    /// The entry after `k` (an entry of bin `c`) in the set's order, and its bin; left in the
    /// set. After a best fit, the second best.
    #[inline]
    pub(super) fn next_after(&self, c: usize, k: Key) -> Option<(usize, Key)> {
        // Keys are distinct (the block index is part of each), and never the largest value.
        self.first_from(c, k + 1)
    }

    /// The first entry at or above `k` in bin `c` (`k`'s own bin), else the first of the next
    /// non-empty bin; and its bin.
    #[inline(always)]
    fn first_from(&self, c: usize, k: Key) -> Option<(usize, Key)> {
        match self.first_at_or_above(c, k) {
            Some(f) => Some((c, f)),
            None => {
                let next = self.next_nonempty(c + 1)?;
                Some((next, self.first_at_or_above(next, 0)?))
            }
        }
    }

    /// Takes out entry `k` of bin `c` (as [`best_fit`](Self::best_fit) or
    /// [`next_after`](Self::next_after) named it).
    #[inline]
    pub(super) fn take(&mut self, c: usize, k: Key) {
        let found = self.remove_from(c, k);
        debug_assert!(found, "a key the set named");
    }

    #[inline(always)]
    fn first_at_or_above(&self, c: usize, k: Key) -> Option<Key> {
        if !bit(&self.nonempty, c) {
            return None;
        }
        if bit(&self.tree, c) {
            return self.tree_ref(c).range(k..).next().copied();
        }
        let v = &self.bins[c];
        let first = *v.first()?;
        if first >= k {
            return Some(first);
        }
        v.get(v.partition_point(|x| *x < k)).copied()
    }

    #[inline]
    fn next_nonempty(&self, from: usize) -> Option<usize> {
        let mut w = from / 64;
        if w >= WORDS {
            return None;
        }
        let mut bits = self.nonempty[w] & (!0u64 << (from % 64));
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

    #[inline(always)]
    pub(super) fn insert(&mut self, k: Key) {
        let c = class_of(key_size(k));
        set_bit(&mut self.nonempty, c, true);
        if bit(&self.tree, c) {
            self.tree_mut(c).insert(k);
            return;
        }
        let v = &mut self.bins[c];
        if v.last().is_none_or(|l| *l < k) {
            v.push(k);
        } else {
            let at = v.partition_point(|x| *x < k);
            v.insert(at, k);
        }
        if v.len() > TREE_AT {
            let t: BTreeSet<Key> = std::mem::take(v).into_iter().collect();
            self.trees.push((c, t));
            set_bit(&mut self.tree, c, true);
        }
    }

    /// Removes `k`; returns whether it was there.
    #[inline(always)]
    pub(super) fn remove(&mut self, k: Key) -> bool {
        let c = class_of(key_size(k));
        self.remove_from(c, k)
    }

    #[inline(always)]
    fn remove_from(&mut self, c: usize, k: Key) -> bool {
        if bit(&self.tree, c) {
            let t = self.tree_mut(c);
            let found = t.remove(&k);
            if t.is_empty() {
                self.trees.retain(|(b, _)| *b != c);
                set_bit(&mut self.tree, c, false);
                set_bit(&mut self.nonempty, c, false);
            }
            return found;
        }
        let v = &mut self.bins[c];
        let found = match v.as_slice() {
            [only] if *only == k => {
                v.clear();
                true
            }
            _ => match v.binary_search(&k) {
                Ok(i) => {
                    v.remove(i);
                    true
                }
                Err(_) => false,
            },
        };
        if v.is_empty() {
            set_bit(&mut self.nonempty, c, false);
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_ordered_and_cover_every_size() {
        let mut last = 0;
        let mut size = 512;
        while size <= crate::rules::MAX_BLOCK {
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
            // The second best, as the expandable rule looks at it, left in place.
            let named = fs.best_fit(want_size);
            assert_eq!(named.map(|(_, k)| k), want, "best fit of {want_size}");
            let after = named.and_then(|(c, k)| fs.next_after(c, k)).map(|(_, k)| k);
            let want_after = want.and_then(|w| reference.range(w + 1..).next().copied());
            assert_eq!(after, want_after, "entry after the best fit of {want_size}");
            let take = next() % 2 == 0;
            if let (Some((c, k)), true) = (named, take) {
                fs.take(c, k);
            }
            if let (Some(w), true) = (want, take) {
                reference.remove(&w);
            }
        }
        assert!(!fs.remove(key(512, 1, 1)));
    }

    /// Sizes anywhere in their class (so a bin is searched by size), trees, the top classes,
    /// block indices near `u32::MAX`, requests of any byte count: the best fit, the entry
    /// after it and their bins against a `BTreeSet`, either taken at random (hostile review
    /// helper-47: the test above passed with `next_after` naming the wrong bin, or with the
    /// best fit ignoring the size within its class).
    #[test]
    fn best_fit_and_next_after_match_an_ordered_set_with_mixed_sizes() {
        for seed in 1..40u64 {
            let mut fs = FreeSet::new();
            let mut reference = BTreeSet::new();
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            for i in 0..20_000u32 {
                // Sizes anywhere in a class (mixed sizes per bin), a few classes crowded into trees,
                // and the top classes up to MAX_BLOCK.
                let size = match next() % 6 {
                    0 => 512 * (1 + (next() % 4) as usize),
                    1 => (1 << 21) + 512 * (next() % 256) as usize,
                    2 => crate::rules::MAX_BLOCK - 512 * (next() % 4096) as usize,
                    _ => {
                        let e = 9 + next() % 31;
                        let lo = 1usize << e;
                        ((lo + (next() % lo as u64) as usize) / 512 * 512).clamp(512, crate::rules::MAX_BLOCK)
                    }
                };
                let idx = if next() % 50 == 0 { u32::MAX - (next() % 3) as u32 } else { i };
                let k = key(size, next() % (1 << 56), idx);
                if next() % 3 != 0 {
                    if reference.insert(k) {
                        fs.insert(k);
                    }
                } else if let Some(&victim) = reference.iter().nth((next() % 8) as usize) {
                    assert!(fs.remove(victim));
                    reference.remove(&victim);
                }
                let want_size = match next() % 3 {
                    0 => 1 + (next() % (1 << 22)) as usize,
                    1 => (1 << 21) + 512 * (next() % 256) as usize,
                    _ => (1 + next() % (crate::rules::MAX_BLOCK as u64)) as usize,
                };
                let want = reference.range(key(want_size, 0, 0)..).next().copied();
                let named = fs.best_fit(want_size);
                assert_eq!(named.map(|(_, k)| k), want);
                if let Some((c, k)) = named {
                    assert_eq!(c, class_of(key_size(k)), "bin of the best fit");
                }
                let after = named.and_then(|(c, k)| fs.next_after(c, k));
                let want_after = want.and_then(|w| reference.range(w + 1..).next().copied());
                assert_eq!(after.map(|(_, k)| k), want_after);
                if let Some((c, k)) = after {
                    assert_eq!(c, class_of(key_size(k)), "bin of the second");
                }
                match next() % 3 {
                    0 => {
                        if let Some((c, k)) = named {
                            fs.take(c, k);
                            reference.remove(&k);
                        }
                    }
                    1 => {
                        if let Some((c, k)) = after {
                            fs.take(c, k);
                            reference.remove(&k);
                        }
                    }
                    _ => {}
                }
            }
            for k in reference.iter().copied().collect::<Vec<_>>() {
                assert!(fs.remove(k));
            }
            assert_eq!(fs.nonempty, [0; WORDS]);
            assert!(fs.trees.is_empty());
        }
    }
}
