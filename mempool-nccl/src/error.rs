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
        /// NCCL's result code and its meaning.
        message: String,
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
    /// The communicator was destroyed or aborted.
    Closed,
    /// From mempool.
    Mempool(mempool::Error),
    /// From the CUDA driver.
    Cuda(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoNccl => write!(
                f,
                "NCCL is not available: libnccl.so.2 could not be loaded; install NCCL (e.g. the nvidia-nccl-cu12/cu13 \
                 wheel or the libnccl2 package) and make sure the dynamic loader finds it (LD_LIBRARY_PATH)"
            ),
            Error::Nccl { op, message } => write!(f, "{op} failed: {message}"),
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
            Error::Closed => write!(f, "the communicator was destroyed or aborted"),
            Error::Mempool(e) => e.fmt(f),
            Error::Cuda(m) => write!(f, "CUDA: {m}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<mempool::Error> for Error {
    fn from(e: mempool::Error) -> Self {
        Error::Mempool(e)
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn nccl(op: &'static str, e: cudarc::nccl::result::NcclError) -> Error {
    Error::Nccl { op, message: format!("{:?}", e.0) }
}
