//! Size rules, as PyTorch's CUDACachingAllocator has them.

use crate::config::Config;

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

/// The block size a request of `size` bytes gets.
pub fn round_size(size: usize, config: &Config) -> usize {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let divisions = config.divisions_for(size);
    if divisions > 1 && size > MIN_BLOCK_SIZE * divisions {
        next_division(size, divisions)
    } else {
        size.next_multiple_of(MIN_BLOCK_SIZE)
    }
}

/// Rounds `size` up to the next of `divisions` equal steps between the powers of two around it.
fn next_division(size: usize, divisions: usize) -> usize {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1usize << (usize::BITS - 1 - size.leading_zeros());
    let step = floor / divisions;
    if step == 0 {
        return floor << 1;
    }
    size.next_multiple_of(step)
}

/// Whether a block of this (rounded) size lives in the small pool.
pub fn is_small(size: usize) -> bool {
    size <= SMALL_SIZE
}

/// The size of the segment to allocate for a block of `size` bytes.
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

    fn cfg(div: usize) -> Config {
        Config::builder().roundup_power2_divisions(div).build().unwrap()
    }

    #[test]
    fn rounds_to_512() {
        let c = Config::default();
        assert_eq!(round_size(0, &c), 512);
        assert_eq!(round_size(1, &c), 512);
        assert_eq!(round_size(512, &c), 512);
        assert_eq!(round_size(513, &c), 1024);
        assert_eq!(round_size(1_000_000, &c), 1_000_448);
    }

    #[test]
    fn power2_divisions() {
        let c = cfg(4);
        // Steps of 256 KiB between 1 MiB and 2 MiB.
        assert_eq!(round_size((1 << 20) + 1, &c), (1 << 20) + (256 << 10));
        assert_eq!(round_size(1 << 20, &c), 1 << 20);
        assert_eq!(round_size(1200 << 10, &c), 1280 << 10);
        // At or below 512 * divisions the plain rule applies.
        assert_eq!(round_size(2000, &c), 2048);
        assert_eq!(round_size(2049, &c), 2560);
        assert_eq!(round_size(2100, &c), 2560); // 2048 / 4 = 512-byte steps
        let c = cfg(8);
        assert_eq!(round_size(5000, &c), 5120); // 4096 / 8 = 512
        assert_eq!(round_size(33 << 20, &c), 36 << 20); // 32 MiB / 8 = 4 MiB steps
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
