//! CUDA-graph capture with pools (PyTorch's `torch.cuda.graph(pool=...)`): while a stream is
//! captured, every allocation on it, and on streams forked into the capture, comes from the
//! capture's pool, whatever scope the thread is in, so that the graph's replays find their
//! memory where the capture left it and allocate nothing.
//!
//! ```no_run
//! # fn main() -> mempool::Result<()> {
//! use mempool::{Allocator, CaptureMode, MemPool};
//! let alloc = Allocator::cuda(0)?;
//! let stream = alloc.context().new_stream().map_err(|e| mempool::Error::caused_by("new_stream", e))?;
//! let _current = alloc.set_stream(&stream)?;
//! let pool = MemPool::new()?;
//! let capture = alloc.begin_capture(&stream, &pool, CaptureMode::Global)?;
//! let out = alloc.alloc_zeros::<f32>(1 << 20)?; // from `pool`, part of the graph
//! // ... kernels on `stream` writing `out` ...
//! let graph = capture.end()?;
//! for _ in 0..1000 {
//!     // SAFETY: `out` and the kernels' other arguments are alive; no other graph shares `pool`.
//!     unsafe { graph.replay() }?; // allocates nothing
//! }
//! // A second graph may share the pool: capture it with `graph.pool()`, and replay the two in
//! // the order they were captured.
//! # drop(out); Ok(()) }
//! ```
//!
//! During a capture the allocator makes no call CUDA forbids then: no event is recorded on,
//! queried or waited for (a buffer freed after use on another stream waits until no capture is
//! under way on the device), and no memory goes back ([`Allocator::empty_cache`] and
//! [`MemPool::empty_cache`] return [`Error::Capture`]; released pools, garbage collection and
//! the out-of-memory ladder keep their memory until the last capture ends). New segments are
//! made in relaxed capture mode.
//!
//! A pool serves one capture at a time. While a capture or a [`Graph`] holds the pool, none of
//! its memory goes back (the graph's temporaries, freed during the capture, are where every
//! replay writes); it is given back when the last graph and handle of it are gone, as its
//! buffers are dropped. A [`Capture`] forgotten (`mem::forget`) leaves the device in capture mode
//! for good: every allocation asks the driver, and no cached memory is given back.
//!
//! What the allocator cannot see: a capture begun on a stream with cudarc directly (not through
//! [`Allocator::begin_capture`]) allocates as any stream does; and using a [`Buffer`](crate::Buffer)
//! through cudarc's copies on a stream other than its own during a capture synchronises that
//! stream, which CUDA refuses during a capture (launch kernels with `record_stream` instead).

use std::fmt;
use std::marker::PhantomData;

use crate::allocator::Allocator;
use crate::error::{Error, Result};
use crate::kind::{check_stream, Kind};
use crate::pool::MemPool;

pub use crate::backend::CaptureMode;

/// A graph capture under way on one stream, begun by [`Allocator::begin_capture`]. [`end`]
/// (Capture::end) ends it and gives the [`Graph`]; dropping it instead ends the capture and
/// discards what was captured. Not `Send`: a capture ends on the thread that began it (CUDA's
/// thread-local capture mode depends on it).
///
/// [`end`]: Capture::end
pub struct Capture<K: Kind> {
    stream: K::Stream,
    pool: MemPool<K>,
    id: u64,
    ended: bool,
    _not_send: PhantomData<*const ()>,
}

/// A captured, instantiated graph and the pool its allocations came from.
pub struct Graph<K: Kind> {
    /// Always `Some` until the graph is dropped (it goes first: the pool's memory stays pinned
    /// until then).
    graph: Option<K::Graph>,
    pool: MemPool<K>,
}

impl<K: Kind> Allocator<K> {
    /// Begins capturing a graph on `stream`: until the returned [`Capture`] ends, allocations on
    /// `stream` (and on streams forked into the capture) come from `pool`. Errors
    /// ([`Error::Capture`]): `pool` belongs to another allocator or serves a capture under way;
    /// `stream` is already being captured; the device has no graphs (host memory). A stream of
    /// another device: [`Error::WrongDevice`].
    pub fn begin_capture(&self, stream: &K::Stream, pool: &MemPool<K>, mode: CaptureMode) -> Result<Capture<K>> {
        check_stream::<K>(stream, self.shared.device, "begin_capture")?;
        if pool.inner.alloc.shared.key != self.shared.key {
            return Err(Error::Capture {
                what: "begin_capture",
                message: format!(
                    "pool {} belongs to another allocator (device {}); a capture's pool must be one of this allocator's",
                    pool.id().0,
                    pool.device()
                ),
            });
        }
        let shared = &*self.shared;
        let id = shared
            .core
            .begin_capture(K::stream_ref(stream), pool.inner.pool, || K::begin_capture(shared, stream, mode))?;
        Ok(Capture { stream: stream.clone(), pool: pool.clone(), id, ended: false, _not_send: PhantomData })
    }

    /// Captures what `f` does on `stream` into a graph, its allocations from `pool`: the scoped
    /// form of [`begin_capture`](Self::begin_capture), whose capture always ends (if `f`
    /// panics, the capture is discarded and the panic goes on). Returns the graph and `f`'s
    /// result.
    pub fn capture<R>(
        &self,
        stream: &K::Stream,
        pool: &MemPool<K>,
        mode: CaptureMode,
        f: impl FnOnce() -> R,
    ) -> Result<(Graph<K>, R)> {
        let capture = self.begin_capture(stream, pool, mode)?;
        let r = f();
        Ok((capture.end()?, r))
    }
}

impl<K: Kind> Capture<K> {
    /// The driver's id of this capture.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The pool the capture allocates from.
    pub fn pool(&self) -> &MemPool<K> {
        &self.pool
    }

    /// Ends the capture and instantiates its graph. Errors: the driver's (an invalidated capture,
    /// a graph that cannot be instantiated), and [`Error::Capture`] when nothing was captured;
    /// the capture is over in every case.
    pub fn end(mut self) -> Result<Graph<K>> {
        let pool = self.pool.clone();
        match self.finish(true)? {
            Some(graph) => Ok(Graph { graph: Some(graph), pool }),
            None => Err(Error::Capture { what: "Capture::end", message: "nothing was captured on the stream".into() }),
        }
    }

    /// Ends the capture; `keep`: the graph is wanted (it then holds the pool's memory).
    fn finish(&mut self, keep: bool) -> Result<Option<K::Graph>> {
        if self.ended {
            return Ok(None);
        }
        self.ended = true;
        let shared = &*self.pool.inner.alloc.shared;
        // The stream may no longer be in this capture: ended behind our back (cudarc's
        // `end_capture` on the raw stream), and perhaps a newer capture begun on it, which is not
        // ours to end.
        match shared.core.stream_capture_id(K::stream_ref(&self.stream)) {
            Ok(Some(id)) if id == self.id => {}
            other => {
                shared.core.end_capture(self.id, false);
                let now = match other {
                    Ok(Some(id)) => format!("capture {id}, another one,"),
                    Ok(None) => "no capture".to_string(),
                    Err(e) => return Err(e),
                };
                return Err(Error::Capture {
                    what: "Capture::end",
                    message: format!(
                        "capture {} was ended outside this guard (the stream is in {now} now): no graph",
                        self.id
                    ),
                });
            }
        }
        let r = K::end_capture(shared, &self.stream);
        let made = keep && matches!(r, Ok(Some(_)));
        shared.core.end_capture(self.id, made);
        r
    }
}

impl<K: Kind> Drop for Capture<K> {
    /// Ends the capture and drops what was captured; the pool keeps the buffers allocated during
    /// it (they are still the user's).
    fn drop(&mut self) {
        if let Ok(Some(g)) = self.finish(false) {
            drop(g);
        }
    }
}

impl<K: Kind> Drop for Graph<K> {
    /// The graph goes first (a launch still running finishes first, as CUDA promises), then the
    /// pool's memory may be given back again.
    fn drop(&mut self) {
        drop(self.graph.take());
        self.pool.inner.alloc.shared.core.unpin_pool(self.pool.inner.pool);
    }
}

impl<K: Kind> Graph<K> {
    /// Launches the graph on the stream it was captured on. Its allocations were made during the
    /// capture: a replay allocates nothing, and the memory its capture used (the buffers it
    /// freed included) stays the pool's as long as the graph lives: no `empty_cache` nor
    /// out-of-memory ladder gives it back.
    ///
    /// # Safety
    /// A replay runs again the work launched during the capture, whose `unsafe` launches
    /// promised their arguments valid at the time; the promise now extends to every replay:
    /// every buffer the captured work uses that is not the graph's own temporary memory (inputs
    /// and outputs allocated outside the capture, or during it and kept) is still alive and not
    /// used concurrently against the graph's writes; graphs sharing a pool are replayed in the
    /// order they were captured; and nothing allocated from the pool after the capture (through
    /// [`MemPool::alloc`] or another capture) is live while the graph's temporaries it may
    /// overlap are in use. PyTorch asks the same of `CUDAGraph.replay()`.
    pub unsafe fn replay(&self) -> Result<()> {
        match &self.graph {
            Some(g) => K::launch(g),
            None => Ok(()),
        }
    }

    /// The pool the graph's memory came from: pass it to the next capture to share it (replay
    /// the graphs in the order they were captured).
    pub fn pool(&self) -> &MemPool<K> {
        &self.pool
    }

    /// The kind's graph object (CUDA: cudarc's `CudaGraph`, e.g. for `upload`).
    pub fn inner(&self) -> Option<&K::Graph> {
        self.graph.as_ref()
    }
}

impl<K: Kind> fmt::Debug for Capture<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Capture").field("id", &self.id).field("pool", &self.pool).finish_non_exhaustive()
    }
}

impl<K: Kind> fmt::Debug for Graph<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph").field("pool", &self.pool).finish_non_exhaustive()
    }
}
