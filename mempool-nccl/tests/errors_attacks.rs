//! Hostile-review probes (issue 19): mempool-nccl's and mempool-viz's error causes.
//! `cargo test -p mempool-nccl --test errors_attacks` on a machine without libcuda.

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::{sys::CUresult, DriverError};
use mempool_nccl::error::{Error, NcclCode};

fn no_driver() -> bool {
    matches!(mempool::device_count(), Err(mempool::Error::NoCudaDriver))
}

fn report(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s += ": ";
        s += &c.to_string();
        cur = c.source();
    }
    s
}

/// `Error::Cuda(DriverError)` is public and its Display prints the DriverError through cudarc
/// (cuGetErrorString): without libcuda, printing the error panics.
#[test]
fn probe_cuda_variant_display_without_driver() {
    if !no_driver() {
        return;
    }
    let e = Error::cuda(DriverError(CUresult::CUDA_ERROR_INVALID_CONTEXT));
    let shown = catch_unwind(AssertUnwindSafe(|| e.to_string()));
    let dbg = catch_unwind(AssertUnwindSafe(|| format!("{e:?}")));
    assert!(shown.is_ok() && dbg.is_ok(), "Display panicked: {}, Debug panicked: {}", shown.is_err(), dbg.is_err());
}

/// `Nccl { op, code }` prints the code in its Display and returns it as the source: a reporter
/// prints "ncclCommRegister failed: ncclInvalidArgument (...): ncclInvalidArgument (...)".
#[test]
fn probe_nccl_variant_report_duplicates_the_code() {
    let e =
        Error::Nccl { op: "ncclCommRegister", code: NcclCode(cudarc::nccl::sys::ncclResult_t::ncclInvalidArgument) };
    let r = report(&e);
    assert_eq!(r.matches("ncclInvalidArgument").count(), 1, "{r}");
}

/// Error::Mempool is transparent (Display = inner, source = inner's source): consistent.
#[test]
fn held_mempool_variant_is_transparent() {
    let inner = mempool::Error::with_cause("segment free", "refused", std::io::Error::other("io words"));
    let e = Error::from(inner);
    assert_eq!(report(&e), "segment free failed: refused: io words");
}
