//! The only items the macros of `mempool-macros` expand to. Not part of the public API.

use std::future::Future;
use std::sync::Arc;

use crate::kind::Kind;
use crate::pool::MemPool;
use crate::scope::{PoolScope, Scoped};

/// What a pool expression of `#[with_pool]`, `pool_scope!` or `begin_pool!` must be.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a mempool pool",
    label = "expected a `MemPool` (or a reference, `Arc` or `Box` of one) here",
    note = "make one with `MemPool::on(&allocator, PoolOptions::new())?` or `MemPool::new()?`"
)]
pub trait AsPool {
    /// The pool's device kind.
    type Kind: Kind;
    /// The pool.
    fn as_pool(&self) -> &MemPool<Self::Kind>;
}

impl<K: Kind> AsPool for MemPool<K> {
    type Kind = K;
    #[inline(always)]
    fn as_pool(&self) -> &MemPool<K> {
        self
    }
}

impl<P: AsPool + ?Sized> AsPool for &P {
    type Kind = P::Kind;
    #[inline(always)]
    fn as_pool(&self) -> &MemPool<P::Kind> {
        (**self).as_pool()
    }
}

impl<P: AsPool + ?Sized> AsPool for Arc<P> {
    type Kind = P::Kind;
    #[inline(always)]
    fn as_pool(&self) -> &MemPool<P::Kind> {
        (**self).as_pool()
    }
}

impl<P: AsPool + ?Sized> AsPool for Box<P> {
    type Kind = P::Kind;
    #[inline(always)]
    fn as_pool(&self) -> &MemPool<P::Kind> {
        (**self).as_pool()
    }
}

/// The guard of a scope on the current stream.
#[inline(always)]
pub fn enter<P: AsPool + ?Sized>(pool: &P) -> PoolScope<'_> {
    pool.as_pool().scope()
}

/// The guard of a scope on `stream`. A stream of another device is a programming error the
/// macros cannot return: it panics with the error's message.
#[track_caller]
pub fn enter_on<'p, P: AsPool + ?Sized>(pool: &'p P, stream: &<P::Kind as Kind>::Stream) -> PoolScope<'p> {
    match pool.as_pool().scope_on(stream) {
        Ok(g) => g,
        Err(e) => panic!("{e}"),
    }
}

/// What an `async fn` under `#[with_pool]` wraps its body with.
pub struct Wrapper<K: Kind> {
    pool: MemPool<K>,
    stream: Option<K::Stream>,
}

impl<K: Kind> std::fmt::Debug for Wrapper<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wrapper").field("pool", &self.pool).field("on_stream", &self.stream.is_some()).finish()
    }
}

/// A wrapper routing the current stream (as it is when the function is called).
pub fn scoped_fn<P: AsPool + ?Sized>(pool: &P) -> Wrapper<P::Kind> {
    Wrapper { pool: pool.as_pool().clone(), stream: None }
}

/// A wrapper routing `stream`.
pub fn scoped_fn_on<P: AsPool + ?Sized>(pool: &P, stream: &<P::Kind as Kind>::Stream) -> Wrapper<P::Kind> {
    Wrapper { pool: pool.as_pool().clone(), stream: Some(stream.clone()) }
}

/// The body's future, routed only while polled. `T` is the function's output type, named by the
/// macro so that `?` in the body knows its error type.
#[track_caller]
pub fn wrap<T, F: Future<Output = T>>(w: Wrapper<impl Kind>, body: F) -> impl Future<Output = T> {
    wrap_kind(w, body)
}

#[track_caller]
fn wrap_kind<K: Kind, F: Future>(w: Wrapper<K>, body: F) -> Scoped<K, F> {
    match &w.stream {
        None => w.pool.scoped(body),
        Some(s) => match w.pool.scoped_on(s, body) {
            Ok(f) => f,
            Err(e) => panic!("{e}"),
        },
    }
}
