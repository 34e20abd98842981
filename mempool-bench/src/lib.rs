//! # mempool-bench
//!
//! The workloads that measure mempool against PyTorch's caching allocator (defined in
//! `shared/anchors/README.md`), run by the `mempool-bench` binary, and the reader of the anchors'
//! plain allocation-trace format in [`trace`].

pub mod trace;
