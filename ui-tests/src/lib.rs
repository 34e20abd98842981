//! Compile-fail and compile-pass tests for mempool's macros live in `tests/ui/`; see `tests/ui.rs`.
