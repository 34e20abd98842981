//! The true requested bytes and allocation counts of a test's own buffers, to check
//! `memory_stats` against (current and peak, all / small / large).

use mempool::{Allocator, Sim};

/// Whether a request of `size` bytes is served from the small pool (rounded size ≤ 1 MiB).
pub(crate) fn rounded_small(size: usize) -> bool {
    size.next_multiple_of(512) <= 1 << 20
}

/// True requested-bytes and allocation counts: [all, small, large] current and peak.
#[derive(Default, Debug)]
pub(crate) struct Model {
    pub(crate) req: [i64; 3],
    pub(crate) req_peak: [i64; 3],
    pub(crate) n: [i64; 3],
    pub(crate) n_peak: [i64; 3],
}

impl Model {
    /// A buffer of `size` bytes allocated (`sign` 1) or freed (-1).
    pub(crate) fn add(&mut self, size: usize, sign: i64) {
        let k = if rounded_small(size) { 1 } else { 2 };
        for i in [0, k] {
            self.req[i] += sign * size as i64;
            self.n[i] += sign;
            self.req_peak[i] = self.req_peak[i].max(self.req[i]);
            self.n_peak[i] = self.n_peak[i].max(self.n[i]);
        }
    }

    /// `reset_peak_stats`: the peaks become the current values.
    pub(crate) fn reset(&mut self) {
        self.req_peak = self.req;
        self.n_peak = self.n;
    }

    /// The allocator's figures are exactly these.
    pub(crate) fn check(&self, a: &Allocator<Sim>, what: &str) {
        let s = a.memory_stats();
        let r = &s.requested_bytes;
        let n = &s.allocation;
        let got_req = [r.all, r.small_pool, r.large_pool].map(|x| (x.current, x.peak));
        let got_n = [n.all, n.small_pool, n.large_pool].map(|x| (x.current, x.peak));
        let want_req: [(i64, i64); 3] = std::array::from_fn(|i| (self.req[i], self.req_peak[i]));
        let want_n: [(i64, i64); 3] = std::array::from_fn(|i| (self.n[i], self.n_peak[i]));
        assert_eq!(got_req, want_req, "requested_bytes (current, peak) all/small/large, {what}");
        assert_eq!(got_n, want_n, "allocation (current, peak) all/small/large, {what}");
    }
}
