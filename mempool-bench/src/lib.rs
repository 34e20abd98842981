//! # mempool-bench
//!
//! The workloads that measure mempool against PyTorch's caching allocator (defined in
//! `shared/anchors/README.md`), run by the `mempool-bench` binary; the reader of the anchors' plain
//! allocation-trace format in [`trace`], and its replay, one stream of the backend per stream of the
//! trace, in [`playback`].

pub mod playback;
pub mod trace;
