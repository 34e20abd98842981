//! The reserve segment of a pinned allocator (`pinned_reserve_segment_size_mb`): one segment
//! allocated when the allocator is made, carved like any other, and kept until the allocator is
//! dropped.
//!
//! It is a small-pool segment of the default pools on the device's default stream, so it serves
//! exactly the requests a small segment of that stream would (rounded size ≤ 1 MiB), as
//! PyTorch's reserve serves small requests. It cannot serve other streams: a segment belongs to
//! one stream, and a buffer's stream (what cudarc orders its uses on, and what a pinned block's
//! free waits for) is its segment's. Nothing gives it back while the allocator lives
//! (`State::kept`: `empty_cache`, garbage collection, the out-of-memory ladder); the
//! allocator's `Drop` gives it back with the rest.

use super::state::Slot;
use super::DeviceAllocator;
use crate::backend::contain;
use crate::error::{Error, Result};
use crate::id::{StreamId, StreamKey, StreamRef};
use crate::rules::{MAX_BLOCK, MIN_BLOCK_SIZE};

const WHAT: &str = "allocating the pinned reserve segment (pinned_reserve_segment_size_mb)";

impl DeviceAllocator {
    /// Allocates the reserve segment the settings ask for (none unless the memory is
    /// host-visible: `DeviceAllocator::new` turns the setting off otherwise). Errors: a size
    /// the free sets cannot hold or that best fit would never split (`max_split_size` or more),
    /// a size over the memory-fraction limit, the backend's refusal.
    pub(crate) fn make_reserve(&self) -> Result<()> {
        let asked = self.rounding.pinned_reserve_segment_size;
        if asked == 0 {
            return Ok(());
        }
        // `Config`'s fields are public: a size made without the builder is checked here too.
        let Some(size) = asked.checked_next_multiple_of(MIN_BLOCK_SIZE).filter(|&s| s <= MAX_BLOCK) else {
            return Err(Error::Config(format!(
                "pinned_reserve_segment_size: {asked} bytes is more than the largest segment ({MAX_BLOCK} bytes)"
            )));
        };
        if size >= self.rounding.max_split_size {
            return Err(Error::Config(format!(
                "pinned_reserve_segment_size: {size} bytes must be below max_split_size ({} bytes): a block that large is never split",
                self.rounding.max_split_size
            )));
        }
        if !self.lock().within_limit(size) {
            return Err(Error::Config(format!(
                "pinned_reserve_segment_size: {size} bytes do not fit under the allocator's memory fraction ({})",
                self.rounding.memory_fraction
            )));
        }
        let be = &*self.backend;
        // Outside the lock, as every segment is made; the default stream never dies.
        let addr = contain(WHAT, || be.alloc_segment(size, StreamId(0))).map_err(|e| e.into_error(WHAT))?;
        let too_high = addr.checked_add(size as u64).is_none_or(|end| end > 1 << 56);
        if addr == 0 || addr % MIN_BLOCK_SIZE as u64 != 0 || too_high {
            if addr != 0 {
                // SAFETY: exactly the segment `alloc_segment` just returned, unused, freed once.
                let _ = contain(WHAT, || unsafe { be.free_segment(addr, size) });
            }
            return Err(Error::backend(WHAT, format!("the backend returned an unusable address {addr:#x}")));
        }
        let mut st = self.lock();
        let key = (Slot::DEFAULT, StreamKey::DEFAULT, true);
        let block = st.insert_segment(addr, size, key, StreamRef::DEFAULT, None, true);
        st.insert_free(block);
        st.kept_segment = Some(st.block(block).seg);
        // `SegmentAlloc` reaches the hooks before the allocator is handed out.
        self.unlock(st, true);
        Ok(())
    }
}
