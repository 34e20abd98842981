//! Inputs for the bounded fuzzers: random strings from pieces, and byte-level mutations. Shared
//! by `mempool/tests/fuzz.rs` and `mempool-bench/tests/trace_fuzz.rs` (through `#[path]`).

/// A source of random numbers below a bound.
pub(crate) trait Below {
    /// A number in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64;
}

/// Up to `max_len` pieces picked at random, joined.
pub(crate) fn random_from(r: &mut impl Below, pieces: &[&str], max_len: u64) -> String {
    (0..r.below(max_len)).map(|_| pieces[r.below(pieces.len() as u64) as usize]).collect()
}

/// `s` with one to four byte edits: a byte removed, inserted or bit-flipped, or a range doubled.
pub(crate) fn mutate(r: &mut impl Below, s: &str) -> String {
    let mut b = s.as_bytes().to_vec();
    for _ in 0..1 + r.below(4) {
        match r.below(4) {
            0 if !b.is_empty() => {
                let i = r.below(b.len() as u64) as usize;
                b.remove(i);
            }
            1 => {
                let i = r.below(b.len() as u64 + 1) as usize;
                b.insert(i, r.below(256) as u8);
            }
            2 if !b.is_empty() => {
                let i = r.below(b.len() as u64) as usize;
                b[i] ^= 1 << r.below(8);
            }
            _ => {
                let i = r.below(b.len() as u64 + 1) as usize;
                let j = r.below(b.len() as u64 + 1) as usize;
                let (i, j) = (i.min(j), i.max(j));
                let dup = b[i..j].to_vec();
                b.splice(i..i, dup);
            }
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}
