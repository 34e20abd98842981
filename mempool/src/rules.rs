//! Size rules, as PyTorch's CUDACachingAllocator has them: pure functions of sizes, imported by
//! the configuration and the caching algorithm alike.

/// Every block size is a multiple of this (and at least this).
pub const MIN_BLOCK_SIZE: usize = 512;
/// Requests up to this size come from small segments.
pub const SMALL_SIZE: usize = 1 << 20;
/// The size of a small segment.
pub const SMALL_BUFFER: usize = 2 << 20;
/// Requests below this (and above [`SMALL_SIZE`]) come from segments of [`LARGE_BUFFER`].
pub const MIN_LARGE_ALLOC: usize = 10 << 20;
/// The size of a mid-size segment; also the slack an unsplittable block may have.
pub const LARGE_BUFFER: usize = 20 << 20;
/// Larger segments are rounded up to a multiple of this.
pub const ROUND_LARGE: usize = 2 << 20;
/// Number of power-of-two intervals `roundup_power2_divisions` can set, from 1 MiB up.
pub const POWER2_INTERVALS: usize = 16;

/// Largest block the caching algorithm handles (1 TiB - 512 B, the largest multiple of 512 that
/// its packed free-set keys hold); larger requests are refused as out-of-memory.
pub const MAX_BLOCK: usize = (1 << 40) - MIN_BLOCK_SIZE;

/// The block size a request of `size` bytes gets with `divisions` round-up steps per power of
/// two ([`divisions_index`] picks the configured value); `None` when it would pass [`MAX_BLOCK`].
pub fn round_size(size: usize, divisions: usize) -> Option<usize> {
    if size < MIN_BLOCK_SIZE {
        return Some(MIN_BLOCK_SIZE);
    }
    let rounded = if divisions > 1 && MIN_BLOCK_SIZE.checked_mul(divisions).is_some_and(|m| size > m) {
        next_division(size, divisions)?
    } else {
        size.checked_next_multiple_of(MIN_BLOCK_SIZE)?
    };
    (rounded <= MAX_BLOCK).then_some(rounded)
}

/// Which power-of-two interval (from 1 MiB up, the last one open) a request of `size` bytes
/// falls in, for `roundup_power2_divisions`.
pub fn divisions_index(size: usize) -> usize {
    let log = usize::BITS as usize - 1 - size.max(1).leading_zeros() as usize;
    log.saturating_sub(20).min(POWER2_INTERVALS - 1)
}

/// Rounds `size` up to the next of `divisions` equal steps between the powers of two around it.
fn next_division(size: usize, divisions: usize) -> Option<usize> {
    if size.is_power_of_two() {
        return Some(size);
    }
    let floor = 1usize << (usize::BITS - 1 - size.leading_zeros());
    // A whole number of 512 B units: blocks must stay 512-byte aligned whatever the divisions
    // (a power of two gives that already; a hand-made `Config` might not).
    let step = (floor / divisions).checked_next_multiple_of(MIN_BLOCK_SIZE)?;
    if step == 0 {
        return floor.checked_mul(2);
    }
    size.checked_next_multiple_of(step)
}

/// Whether a block of this (rounded) size lives in the small pool.
pub fn is_small(size: usize) -> bool {
    size <= SMALL_SIZE
}

/// The size of the segment to allocate for a block of `size` bytes (at most [`MAX_BLOCK`], so
/// the result cannot overflow).
pub fn segment_size(size: usize) -> usize {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.next_multiple_of(ROUND_LARGE)
    }
}

/// Whether a free block of `block` bytes serving `size` bytes is split, leaving the rest free.
pub fn should_split(block: usize, size: usize, small: bool, max_split_size: usize) -> bool {
    let rest = block - size;
    if small {
        rest >= MIN_BLOCK_SIZE
    } else {
        size < max_split_size && rest > SMALL_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `round_size` with `div` divisions in every interval.
    fn r(size: usize, div: usize) -> usize {
        round_size(size, div).unwrap()
    }

    #[test]
    fn rounds_to_512() {
        assert_eq!(r(0, 0), 512);
        assert_eq!(r(1, 0), 512);
        assert_eq!(r(512, 0), 512);
        assert_eq!(r(513, 0), 1024);
        assert_eq!(r(1_000_000, 0), 1_000_448);
    }

    #[test]
    fn power2_divisions() {
        // Steps of 256 KiB between 1 MiB and 2 MiB.
        assert_eq!(r((1 << 20) + 1, 4), (1 << 20) + (256 << 10));
        assert_eq!(r(1 << 20, 4), 1 << 20);
        assert_eq!(r(1200 << 10, 4), 1280 << 10);
        // At or below 512 * divisions the plain rule applies.
        assert_eq!(r(2000, 4), 2048);
        assert_eq!(r(2049, 4), 2560);
        assert_eq!(r(2100, 4), 2560); // 2048 / 4 = 512-byte steps
        assert_eq!(r(5000, 8), 5120); // 4096 / 8 = 512
        assert_eq!(r(33 << 20, 8), 36 << 20); // 32 MiB / 8 = 4 MiB steps
    }

    #[test]
    fn sizes_past_the_largest_block_are_refused_not_wrapped() {
        // 2^40 - 1 bytes rounds to 2^40: one past the largest block, so refused.
        assert_eq!(round_size((1 << 40) - 1, 0), None);
        assert_eq!(round_size(MAX_BLOCK, 0), Some(MAX_BLOCK));
        assert_eq!(round_size(usize::MAX, 0), None);
        assert_eq!(round_size(usize::MAX, 1 << 20), None);
        assert_eq!(round_size(usize::MAX - 5, 4), None);
    }

    #[test]
    fn segment_sizes() {
        assert_eq!(segment_size(512), 2 << 20);
        assert_eq!(segment_size(1 << 20), 2 << 20);
        assert_eq!(segment_size((1 << 20) + 512), 20 << 20);
        assert_eq!(segment_size((10 << 20) - 512), 20 << 20);
        assert_eq!(segment_size(10 << 20), 10 << 20);
        assert_eq!(segment_size((10 << 20) + 512), 12 << 20);
    }

    #[test]
    fn split_rules() {
        assert!(should_split(2 << 20, (2 << 20) - 512, true, usize::MAX));
        assert!(!should_split(2 << 20, (2 << 20) - 511, true, usize::MAX));
        assert!(should_split(20 << 20, (19 << 20) - 512, false, usize::MAX));
        assert!(!should_split(20 << 20, 19 << 20, false, usize::MAX)); // exactly 1 MiB left: not > 1 MiB
        assert!(!should_split(40 << 20, 21 << 20, false, 21 << 20)); // at max_split_size: never
    }
}
