//! Cross-stream frees: a block another stream used goes back only after an event recorded on
//! that stream at free time has completed.

use super::state::{BlockIdx, State, Use};
use crate::backend::Backend;
use crate::error::Error;

impl State {
    /// Notes that `stream` uses an allocated block; returns whether the stream is new to it.
    pub(super) fn record_use(
        &mut self,
        block: BlockIdx,
        stream: crate::id::StreamRef,
        keep: Option<crate::backend::Keep>,
    ) -> bool {
        let b = self.block(block);
        if b.state != crate::snapshot::BlockState::Allocated || stream.key == self.seg(b.seg).stream.key {
            return false;
        }
        self.block_mut(block).has_uses = true;
        let uses = self.uses.entry(block).or_default();
        if uses.iter().any(|u| u.stream.key == stream.key) {
            return false;
        }
        uses.push(Use { stream, keep });
        true
    }

    /// Records an event on every stream that used `block` (now `AwaitingStreams`).
    pub(super) fn record_uses(&mut self, be: &dyn Backend, block: BlockIdx, uses: Vec<Use>) {
        for u in uses {
            // A stream being captured by someone else (another allocator's capture, or cudarc's
            // own `begin_capture`): an event recorded there would be a node of that graph, which
            // no query may ask about. The use waits in `foreign` until the capture is over.
            // SAFETY: `u.stream` is alive (as below).
            if matches!(unsafe { be.capture_id(u.stream.raw) }, Ok(Some(_))) {
                self.block_mut(block).pending += 1;
                self.foreign.push((block, u));
                self.kick |= self.background;
                continue;
            }
            // SAFETY: `u.stream` is a stream of this device that is alive: `u.keep` holds it
            // (CUDA), or the stream is the default stream or a host/sim stream, which never dies.
            match unsafe { be.record_event(u.stream.raw) } {
                Ok(ev) => {
                    self.pending.push((ev, block));
                    self.block_mut(block).pending += 1;
                    self.kick |= self.background;
                }
                Err(e) => {
                    // Without an event there is no telling when the other stream is done with the
                    // block: it stays out of circulation (a wait no event will ever end) rather
                    // than risk handing it out early.
                    self.block_mut(block).pending += 1;
                    let addr = self.block(block).addr;
                    self.error.get_or_insert(Error::backend(
                        "recording a cross-stream event",
                        format!("{e}; block {addr:#x} is held back"),
                    ));
                }
            }
            // The event holds no reference to the stream: the stream may go now.
            drop(u.keep);
        }
    }

    /// Frees the blocks whose cross-stream events have all completed.
    pub(super) fn process_events(&mut self, be: &dyn Backend) {
        // No event is queried while a graph is captured (CUDA refuses, and the capture breaks).
        if !self.captures.is_empty() {
            return;
        }
        self.retry_foreign(be);
        let mut i = 0;
        while i < self.pending.len() {
            let (ev, block) = self.pending[i];
            // SAFETY: `ev` came from `record_event` of this backend and is released only below,
            // when it leaves the pending list.
            match unsafe { be.query_event(ev) } {
                Ok(true) => {
                    self.pending.swap_remove(i);
                    self.event_done(be, ev, block);
                }
                Ok(false) => i += 1,
                Err(e) => {
                    self.error.get_or_insert(e.into_error("querying a cross-stream event"));
                    i += 1;
                }
            }
        }
    }

    /// Records the events of the uses that waited for a capture of their stream to end (see
    /// `record_uses`), for those whose capture is over.
    pub(super) fn retry_foreign(&mut self, be: &dyn Backend) {
        if self.foreign.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.foreign.len() {
            let stream = self.foreign[i].1.stream;
            // SAFETY: the use's `keep` holds its stream alive while it waits here.
            if matches!(unsafe { be.capture_id(stream.raw) }, Ok(Some(_))) {
                i += 1;
                continue;
            }
            let (block, u) = self.foreign.swap_remove(i);
            // Its place in `pending` goes to the event recorded now (or to the error's hold).
            self.block_mut(block).pending -= 1;
            self.record_uses(be, block, vec![u]);
        }
    }

    /// Waits for every pending cross-stream event and frees their blocks.
    pub(super) fn synchronize_events(&mut self, be: &dyn Backend) {
        if !self.captures.is_empty() {
            return;
        }
        self.retry_foreign(be);
        self.stats.num_sync_all_streams += 1;
        let mut i = 0;
        while i < self.pending.len() {
            let (ev, block) = self.pending[i];
            // SAFETY: as in `process_events`.
            match unsafe { be.synchronize_event(ev) } {
                Ok(()) => {
                    self.pending.swap_remove(i);
                    self.event_done(be, ev, block);
                }
                Err(e) => {
                    self.error.get_or_insert(e.into_error("waiting for a cross-stream event"));
                    i += 1;
                }
            }
        }
    }

    fn event_done(&mut self, be: &dyn Backend, ev: crate::id::EventId, block: BlockIdx) {
        // SAFETY: the event came from `record_event` and was just taken off the pending list, so
        // it is released once and never used again.
        unsafe { be.release_event(ev) };
        let b = self.block_mut(block);
        b.pending -= 1;
        if b.pending == 0 {
            self.free_block(block);
        }
    }
}
