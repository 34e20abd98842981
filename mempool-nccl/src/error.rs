//! The crate's one error type.

use std::fmt;

/// What can go wrong with NCCL, communicators and registrations.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// `libnccl.so.2` could not be loaded.
    NoNccl,
    /// NCCL returned an error.
    Nccl {
        /// The NCCL call.
        op: &'static str,
        /// NCCL's result code (also the [`source`](std::error::Error::source)).
        code: NcclCode,
    },
    /// A rank outside `0..world_size`.
    InvalidRank {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// The launcher's variables disagree (or are missing).
    Environment(String),
    /// A buffer on another device than the communicator's.
    WrongDevice {
        /// What was being done.
        what: &'static str,
        /// The communicator's device.
        expected: usize,
        /// The buffer's device.
        found: usize,
    },
    /// A buffer shorter than the element count of the call.
    BufferTooShort {
        /// What was being done.
        what: &'static str,
        /// Elements the call needs.
        needed: usize,
        /// Elements the buffer has.
        len: usize,
    },
    /// NCCL refused to register a segment; the pool keeps working without it.
    Registration {
        /// The segment's address.
        segment: u64,
        /// Its size.
        size: usize,
        /// NCCL's words.
        message: String,
    },
    /// A window registration's rules were not met (checked before NCCL is called).
    Window(String),
    /// Symmetric memory could not be set up or used (the reason; every rank of a failed
    /// rendezvous gets one).
    Symmetric(String),
    /// The communicator was destroyed or aborted.
    Closed,
    /// From mempool.
    Mempool(mempool::Error),
    /// From the CUDA driver: the `cudarc::driver::DriverError` (also the
    /// [`source`](std::error::Error::source)), shown without calling into the driver.
    Cuda(mempool::Cause),
}

/// An NCCL result code other than success, as an error of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclCode(pub cudarc::nccl::sys::ncclResult_t);

impl fmt::Display for NcclCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use cudarc::nccl::sys::ncclResult_t as R;
        let what = match self.0 {
            R::ncclSuccess => "no error",
            R::ncclUnhandledCudaError => "a call to CUDA failed",
            R::ncclSystemError => "a call to the system failed",
            R::ncclInternalError => "an internal check failed (a bug in NCCL or memory corruption)",
            R::ncclInvalidArgument => "an invalid value was passed",
            R::ncclInvalidUsage => "NCCL was used the wrong way",
            R::ncclRemoteError => "a remote peer failed or went away",
            R::ncclInProgress => "the operation is still in progress",
            _ => "an error NCCL did not name",
        };
        f.write_str(what)
    }
}

impl std::error::Error for NcclCode {}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoNccl => write!(
                f,
                "NCCL is not available: libnccl.so.2 could not be loaded; install NCCL (e.g. the nvidia-nccl-cu12/cu13 \
                 wheel or the libnccl2 package) and make sure the dynamic loader finds it (LD_LIBRARY_PATH)"
            ),
            Error::Nccl { op, code } => write!(f, "{op} failed: {:?}", code.0),
            Error::InvalidRank { rank, world_size } => {
                write!(f, "rank {rank} is out of range for a world of {world_size} rank(s) (valid: 0..{world_size})")
            }
            Error::Environment(m) => write!(f, "launcher environment: {m}"),
            Error::WrongDevice { what, expected, found } => {
                write!(f, "{what}: the buffer is on device {found}, but the communicator is on device {expected}")
            }
            Error::BufferTooShort { what, needed, len } => {
                write!(f, "{what}: the call needs {needed} elements, but the buffer holds {len}")
            }
            Error::Registration { segment, size, message } => write!(
                f,
                "NCCL refused to register segment {segment:#x} ({size} bytes): {message}; the pool keeps working, \
                 collectives on it are not zero-copy"
            ),
            Error::Window(m) => write!(f, "window registration: {m}"),
            Error::Symmetric(m) => write!(f, "symmetric memory: {m}"),
            Error::Closed => write!(f, "the communicator was destroyed or aborted"),
            Error::Mempool(e) => e.fmt(f),
            Error::Cuda(c) => match c.get().downcast_ref::<cudarc::driver::DriverError>() {
                Some(d) => write!(f, "a CUDA call failed: {:?}", d.0),
                None => write!(f, "a CUDA call failed"),
            },
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Nccl { code, .. } => Some(code),
            Error::Cuda(c) => Some(c.get()),
            // Displayed as itself, so its source is this error's source.
            Error::Mempool(e) => std::error::Error::source(e),
            _ => None,
        }
    }
}

impl Error {
    /// [`Error::Cuda`] of a driver error.
    pub fn cuda(e: cudarc::driver::DriverError) -> Error {
        Error::Cuda(mempool::backend::cuda::driver_cause(e))
    }
}

impl From<mempool::Error> for Error {
    fn from(e: mempool::Error) -> Self {
        Error::Mempool(e)
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn nccl(op: &'static str, e: cudarc::nccl::result::NcclError) -> Error {
    Error::Nccl { op, code: NcclCode(e.0) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::nccl::{result::NcclError, sys::ncclResult_t};

    fn is_shareable<T: std::error::Error + Send + Sync + 'static>() {}

    #[test]
    fn errors_are_send_sync_static_and_keep_their_causes() {
        is_shareable::<Error>();
        is_shareable::<NcclCode>();
        let e = nccl("ncclCommRegister", NcclError(ncclResult_t::ncclInvalidArgument));
        assert_eq!(e.to_string(), "ncclCommRegister failed: ncclInvalidArgument");
        let chain = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert_eq!(chain, "ncclCommRegister failed: ncclInvalidArgument: an invalid value was passed");
        let src = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<NcclCode>());
        assert_eq!(src, Some(&NcclCode(ncclResult_t::ncclInvalidArgument)));
        let d = cudarc::driver::DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_CONTEXT);
        // No driver here: printing it must not ask one (cudarc's own formatting would).
        let e = Error::Cuda(mempool::backend::cuda::driver_cause(d));
        assert!(std::error::Error::source(&e).and_then(|s| s.downcast_ref()) == Some(&d));
        assert_eq!(e.to_string(), "a CUDA call failed: CUDA_ERROR_INVALID_CONTEXT");
        assert!(format!("{e:?}").contains("CUDA_ERROR_INVALID_CONTEXT"));
        // A mempool error is shown as itself: its source is the inner error's source.
        let e = Error::from(mempool::Error::with_cause("segment allocation", "words", d));
        assert!(std::error::Error::source(&e).and_then(|s| s.downcast_ref()) == Some(&d));
    }
}
