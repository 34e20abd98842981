//! Pool scopes: "allocations of this thread on this stream go to that pool", for a region.
//!
//! * [`MemPool::scope`] / [`MemPool::scope_on`]: a guard for the rest of a block. It is `!Send`
//!   and borrows the pool, so the pool cannot be dropped inside its own scope. Nested scopes:
//!   the innermost wins. Guards dropped out of order end exactly their own scope. Other threads,
//!   even on the same stream, are not routed.
//! * [`MemPool::scoped`]: wraps a future so that the scope is active only while it is polled
//!   (other tasks on the same thread are never routed).
//! * [`MemPool::scope_handle`]: a `Send` handle that a worker thread enters explicitly.
//!
//! ```
//! use mempool::{Allocator, MemPool, PoolOptions, sim::SimDevice};
//! let alloc = Allocator::sim(SimDevice::new(256 << 20));
//! let (a, b) = (MemPool::on(&alloc, PoolOptions::new())?, MemPool::on(&alloc, PoolOptions::new())?);
//! let _outer = a.scope();
//! {
//!     let _inner = b.scope();
//!     let x = alloc.alloc::<u8>(10)?;          // innermost: b
//!     assert_eq!(b.memory_stats().allocation.current, 1);
//! }
//! let y = alloc.alloc::<u8>(10)?;              // a again
//! assert_eq!(a.memory_stats().allocation.current, 1);
//! # Ok::<(), mempool::Error>(())
//! ```

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::error::{Error, Result};
use crate::id::StreamKey;
use crate::kind::Kind;
use crate::pool::MemPool;
use crate::stream;

/// While it lives, this thread's allocations on one stream of the pool's device go to the pool.
/// Made by [`MemPool::scope`], [`MemPool::scope_on`] and [`ScopeHandle::enter`].
#[must_use = "the scope ends when the guard is dropped; bind it: `let _scope = pool.scope();`"]
pub struct PoolScope<'a> {
    id: u64,
    _pool: PhantomData<&'a ()>,
    // Routing is per thread: the guard must end on the thread that began it.
    _not_send: PhantomData<*const ()>,
}

impl PoolScope<'_> {
    /// `id` 0: a thread exiting, with no context to route in (the scope routes nothing).
    fn begin<K: Kind>(pool: &MemPool<K>, stream: StreamKey) -> Self {
        let id = stream::begin_route(pool.inner.alloc.shared.key, stream, pool.pool_ref()).unwrap_or(0);
        PoolScope { id, _pool: PhantomData, _not_send: PhantomData }
    }
}

impl Drop for PoolScope<'_> {
    fn drop(&mut self) {
        stream::end_route(self.id);
    }
}

impl std::fmt::Debug for PoolScope<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolScope").field("id", &self.id).finish()
    }
}

impl<K: Kind> MemPool<K> {
    /// Routes this thread's allocations on the current stream of the pool's device to this pool
    /// until the guard is dropped (PyTorch's `use_mem_pool`). On a thread whose thread-locals
    /// are being destroyed (code in a thread-local's `Drop`) there is no routing context left:
    /// the scope routes nothing there; [`scope_on`](Self::scope_on) says so with an error.
    pub fn scope(&self) -> PoolScope<'_> {
        PoolScope::begin(self, self.current_stream_key())
    }

    /// Like [`scope`](Self::scope), for allocations on `stream`. A stream of another device than
    /// the pool's is an error naming both devices.
    pub fn scope_on(&self, stream: &K::Stream) -> Result<PoolScope<'_>> {
        crate::kind::check_stream::<K>(stream, self.device(), "MemPool::scope_on")?;
        let scope = PoolScope::begin(self, K::stream_ref(stream).key);
        if scope.id == 0 {
            return Err(Error::ThreadExiting { what: "MemPool::scope_on" });
        }
        Ok(scope)
    }

    /// A `Send` handle routing to this pool, on the current stream of this thread (as it is now),
    /// for another thread to [`enter`](ScopeHandle::enter).
    pub fn scope_handle(&self) -> ScopeHandle<K> {
        ScopeHandle { pool: self.clone(), stream: self.current_stream_key() }
    }

    /// Wraps `fut` so that, each time it is polled, this thread's allocations on the current
    /// stream (as it is now) go to this pool, and only then.
    pub fn scoped<F: Future>(&self, fut: F) -> Scoped<K, F> {
        Scoped { pool: self.clone(), stream: self.current_stream_key(), fut: Box::pin(fut) }
    }

    /// Like [`scoped`](Self::scoped), for allocations on `stream` (an error if it belongs to
    /// another device).
    pub fn scoped_on<F: Future>(&self, stream: &K::Stream, fut: F) -> Result<Scoped<K, F>> {
        crate::kind::check_stream::<K>(stream, self.device(), "MemPool::scoped_on")?;
        Ok(Scoped { pool: self.clone(), stream: K::stream_ref(stream).key, fut: Box::pin(fut) })
    }

    fn current_stream_key(&self) -> StreamKey {
        crate::stream::current(self.inner.alloc.shared.key).key
    }
}

/// A `Send` handle that routes to a pool from whatever thread enters it. Made by
/// [`MemPool::scope_handle`]; it keeps the pool alive.
#[derive(Clone)]
pub struct ScopeHandle<K: Kind> {
    pool: MemPool<K>,
    stream: StreamKey,
}

impl<K: Kind> ScopeHandle<K> {
    /// Routes this thread's allocations on the handle's stream to the pool until the guard drops.
    pub fn enter(&self) -> PoolScope<'_> {
        PoolScope::begin(&self.pool, self.stream)
    }

    /// The pool.
    pub fn pool(&self) -> &MemPool<K> {
        &self.pool
    }
}

impl<K: Kind> std::fmt::Debug for ScopeHandle<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopeHandle").field("pool", &self.pool).field("stream", &self.stream).finish()
    }
}

/// A future whose polls run inside a pool scope. Made by [`MemPool::scoped`].
#[must_use = "futures do nothing unless polled"]
pub struct Scoped<K: Kind, F> {
    pool: MemPool<K>,
    stream: StreamKey,
    fut: Pin<Box<F>>,
}

impl<K: Kind, F> std::fmt::Debug for Scoped<K, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scoped").field("pool", &self.pool).field("stream", &self.stream).finish_non_exhaustive()
    }
}

impl<K: Kind, F: Future> Future for Scoped<K, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let _scope = PoolScope::begin(&this.pool, this.stream);
        this.fut.as_mut().poll(cx)
    }
}
