//! The crate's one error type.

use std::fmt;
use std::sync::Arc;

use crate::format::bytes;

/// Everything that can go wrong in mempool. Messages say what happened and what to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The device could not supply the memory, even after the cache was emptied.
    OutOfMemory(Box<OomReport>),
    /// A pointer handed to [`free_bytes`](crate::Allocator::free_bytes) that this allocator did
    /// not hand out through `alloc_bytes`, or that was already freed. Nothing was changed.
    InvalidFree {
        /// The pointer that was passed.
        ptr: u64,
        /// The allocator's device.
        device: usize,
    },
    /// `len * size_of::<T>()` does not fit in `usize`.
    SizeOverflow {
        /// Elements requested.
        len: usize,
        /// Size of one element.
        elem_size: usize,
    },
    /// A device index that does not exist.
    InvalidDevice {
        /// The index that was asked for.
        device: usize,
        /// How many devices there are.
        count: usize,
    },
    /// No CUDA driver could be loaded on this machine.
    NoCudaDriver,
    /// A stream that belongs to another device than the allocator's.
    WrongDevice {
        /// What was being done.
        what: &'static str,
        /// The allocator's device.
        expected: usize,
        /// The stream's device.
        found: usize,
    },
    /// A stream the allocator cannot tell apart from others: cudarc's per-thread default stream
    /// (one handle that means another stream on every thread).
    UnsupportedStream {
        /// What was being done.
        what: &'static str,
    },
    /// Called on a thread whose thread-locals are being destroyed (from a thread-local's `Drop`):
    /// there is no current-stream or routing context left to change.
    ThreadExiting {
        /// What was being done.
        what: &'static str,
    },
    /// A bad `MEMPOOL_ALLOC_CONF` entry or builder value.
    Config(String),
    /// An allocation from inside a trace callback (it would feed the callback its own events);
    /// nothing was done.
    Reentrant,
    /// A pool's own allocator failed in a way other than running out of memory.
    PoolAllocator {
        /// The pool.
        pool: u64,
        /// The allocator's name.
        allocator: String,
        /// What it said.
        message: String,
    },
    /// A CUDA-graph capture was misused, or refused an operation that gives memory back while
    /// it is under way.
    Capture {
        /// What was being done.
        what: &'static str,
        /// What went wrong, and what to do.
        message: String,
    },
    /// The driver (or a backend) reported an error.
    Backend {
        /// What mempool was doing.
        op: &'static str,
        /// The backend's own message.
        message: String,
        /// The underlying error, where there is one (a `cudarc::driver::DriverError`, an
        /// `std::io::Error`, ...): also [`source`](std::error::Error::source).
        cause: Option<Cause>,
    },
}

/// The underlying error behind an [`Error`], shared so that errors stay `Clone`: a driver error
/// (downcast to `cudarc::driver::DriverError` for its `CUresult`), an I/O error, another
/// library's error. Two causes are equal when they are the same error, the same driver result,
/// or print the same. Printing a cause never calls into the driver: a driver error shows the
/// driver's description taken when it happened (its result's name when there was no driver).
#[derive(Clone)]
pub struct Cause {
    error: Arc<dyn std::error::Error + Send + Sync + 'static>,
    words: Option<Arc<str>>,
}

impl Cause {
    /// Wraps an error.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Cause {
        Cause { error: Arc::new(e), words: None }
    }

    /// Wraps an error, shown with these words.
    pub(crate) fn with_words(e: impl std::error::Error + Send + Sync + 'static, words: Option<String>) -> Cause {
        Cause { error: Arc::new(e), words: words.map(Arc::from) }
    }

    /// The error itself (`.downcast_ref::<cudarc::driver::DriverError>()` and the like).
    pub fn get(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.error
    }

    fn driver(&self) -> Option<&cudarc::driver::DriverError> {
        self.error.downcast_ref::<cudarc::driver::DriverError>()
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // cudarc's `Debug` of a driver error asks the driver for its words: not here.
        match self.driver() {
            Some(d) => f.debug_tuple("DriverError").field(&d.0).finish(),
            None => fmt::Debug::fmt(&self.error, f),
        }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.words, self.driver()) {
            (Some(w), _) => f.write_str(w),
            (None, Some(d)) => write!(f, "{:?}", d.0),
            (None, None) => fmt::Display::fmt(&self.error, f),
        }
    }
}

impl PartialEq for Cause {
    fn eq(&self, other: &Cause) -> bool {
        if Arc::ptr_eq(&self.error, &other.error) {
            return true;
        }
        match (self.driver(), other.driver()) {
            (Some(a), Some(b)) => a == b,
            (None, None) => self.to_string() == other.to_string() && format!("{self:?}") == format!("{other:?}"),
            _ => false,
        }
    }
}

impl Eq for Cause {}

impl Error {
    /// [`Error::Backend`] with a message and no underlying error.
    pub fn backend(op: &'static str, message: impl Into<String>) -> Error {
        Error::Backend { op, message: message.into(), cause: None }
    }

    /// [`Error::Backend`] from an underlying error, which is its
    /// [`source`](std::error::Error::source) (and is not repeated in its message, as error
    /// reporters print the chain; a driver error's result name is the message).
    pub fn caused_by(op: &'static str, cause: impl std::error::Error + Send + Sync + 'static) -> Error {
        let any: &dyn std::any::Any = &cause;
        let message =
            any.downcast_ref::<cudarc::driver::DriverError>().map_or_else(String::new, |d| format!("{:?}", d.0));
        Error::Backend { op, message, cause: Some(Cause::new(cause)) }
    }

    /// [`Error::Backend`] with a message of its own (context, not the cause's words) and an
    /// underlying error.
    pub fn with_cause(
        op: &'static str,
        message: impl Into<String>,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Error {
        Error::Backend { op, message: message.into(), cause: Some(Cause::new(cause)) }
    }
}

/// The figures behind an out-of-memory error, in the manner of PyTorch's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomReport {
    /// The device index.
    pub device: usize,
    /// The backend kind (`cuda`, `host`, `sim`).
    pub backend: &'static str,
    /// The bytes the caller asked for.
    pub requested: usize,
    /// The device's total capacity, if the backend knows it.
    pub device_total: Option<usize>,
    /// The device's free memory at the time of the failure, if the backend knows it.
    pub device_free: Option<usize>,
    /// Bytes handed out by this allocator and not yet freed.
    pub allocated: usize,
    /// Bytes this allocator holds from the device (allocated or cached).
    pub reserved: usize,
    /// The configured memory-fraction limit, if one is set.
    pub limit: Option<usize>,
    /// For a user pool: its id and its allocator's name.
    pub pool: Option<(u64, String)>,
    /// A CUDA-graph capture was under way: cached memory was not given back to retry.
    pub during_capture: bool,
    /// While stacks are recorded ([`record_stacks`](crate::record_stacks)): the allocation
    /// sites holding the most memory of this allocator, largest first (at most five), with
    /// their live bytes.
    pub sites: Vec<(String, usize)>,
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} out of memory. Tried to allocate {}", self.backend, bytes(self.requested))?;
        match &self.pool {
            Some((id, name)) => write!(f, " in pool {id}, whose allocator `{name}` refused.")?,
            None => write!(f, ".")?,
        }
        match (self.device_total, self.device_free) {
            (Some(t), Some(fr)) => write!(
                f,
                " Device {} has a total capacity of {} of which {} is free.",
                self.device,
                bytes(t),
                bytes(fr)
            )?,
            (Some(t), None) => write!(f, " Device {} has a total capacity of {}.", self.device, bytes(t))?,
            _ => write!(f, " Device {}.", self.device)?,
        }
        if let Some(limit) = self.limit {
            write!(f, " This allocator is limited to {} (memory fraction).", bytes(limit))?;
        }
        let cached = self.reserved.saturating_sub(self.allocated);
        write!(
            f,
            " Of the memory in use, {} is allocated by mempool, and {} is reserved by mempool but unallocated.",
            bytes(self.allocated),
            bytes(cached)
        )?;
        if self.during_capture {
            write!(
                f,
                " A CUDA graph capture is under way on this device: cached memory is not given back during a capture (empty_cache before capturing, or capture a smaller graph)."
            )?;
        }
        if !self.sites.is_empty() {
            write!(f, " The largest live allocation sites:")?;
            for (i, (site, n)) in self.sites.iter().enumerate() {
                write!(f, "{} {} ({})", if i == 0 { "" } else { ";" }, site, bytes(*n))?;
            }
            write!(f, ".")?;
        }
        write!(f, " Free buffers you no longer need")?;
        if cached > self.requested / 4 && cached > 0 {
            write!(
                f,
                "; reserved but unallocated memory is large, so try MEMPOOL_ALLOC_CONF=max_split_size_mb:<n> to reduce fragmentation"
            )?;
        }
        write!(f, ", or use a smaller batch.")
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::OutOfMemory(r) => r.fmt(f),
            Error::InvalidFree { ptr, device } => write!(
                f,
                "invalid free of {ptr:#x} on device {device}: not a live allocation of this allocator's \
                 alloc_bytes (a foreign pointer, or one already freed); nothing was changed"
            ),
            Error::SizeOverflow { len, elem_size } => {
                write!(f, "allocation of {len} elements of {elem_size} bytes overflows usize")
            }
            Error::InvalidDevice { device, count } => {
                write!(f, "device {device} does not exist: this machine has {count} CUDA device(s) (valid: 0..{count})")
            }
            Error::NoCudaDriver => write!(
                f,
                "no CUDA driver: libcuda.so could not be loaded; install the NVIDIA driver, or use the host \
                 or sim backend (Allocator::host(), Allocator::sim(..))"
            ),
            Error::WrongDevice { what, expected, found } => {
                write!(f, "{what}: the stream belongs to device {found}, but the allocator is on device {expected}")
            }
            Error::UnsupportedStream { what } => write!(
                f,
                "{what}: the per-thread default stream (CU_STREAM_PER_THREAD) names another stream on each \
                 thread, so the allocator cannot order its blocks by it; use a stream of your own \
                 (`ctx.new_stream()`) or the context's default stream"
            ),
            Error::ThreadExiting { what } => write!(
                f,
                "{what}: this thread is exiting (its thread-locals are being destroyed), so it has no \
                 stream or pool-scope context left; allocations here use the default stream and pools"
            ),
            Error::Config(msg) => write!(f, "invalid allocator config: {msg}"),
            Error::Reentrant => write!(
                f,
                "an allocation was asked for from inside a trace callback, where it would feed the \
                 callback its own events; allocate after the callback returns (reading statistics, \
                 snapshots, freeing and recording streams do work in a callback)"
            ),
            Error::PoolAllocator { pool, allocator, message } => {
                write!(f, "the allocator `{allocator}` of pool {pool} failed: {message}")
            }
            Error::Capture { what, message } => write!(f, "{what}: {message}"),
            Error::Backend { op, message, .. } if message.is_empty() => write!(f, "{op} failed"),
            Error::Backend { op, message, .. } => write!(f, "{op} failed: {message}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Backend { cause: Some(c), .. } => Some(c.get()),
            _ => None,
        }
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
