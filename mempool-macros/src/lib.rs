//! Pool scopes for [mempool](https://docs.rs/cuda-mempool), balanced by construction and checked by
//! the compiler. Use them through `mempool` (`mempool::with_pool`, `mempool::pool_scope`, ...),
//! which re-exports this crate.
//!
//! | macro | what it does |
//! | --- | --- |
//! | `#[with_pool(pool)]` | the whole function body runs inside a scope of `pool` (for `async fn`: only while polled) |
//! | `pool_scope!(pool => { ... })` | an expression: the block runs inside the scope; its value is the block's |
//! | `#[pool_scopes]` + `begin_pool!(p);` / `end_pool!(p);` | PyTorch-style begin/end pairs, checked per block at compile time |
//!
//! Every form takes `stream = <expr>` (route that stream instead of the current one) and
//! `crate = <path>` (for a renamed `mempool`). Expansions call only `::mempool::__private`.
#![forbid(unsafe_code)]

mod args;
mod check;
mod expand;

use proc_macro::TokenStream;

/// Runs the function's body inside a scope of the pool: this thread's allocations on the current
/// stream (or `stream = <expr>`) go to the pool until the function returns, by any path
/// (`return`, `?`, panic). The pool expression is evaluated once. On an `async fn` the scope is
/// active only while the future is polled.
///
/// ```
/// use mempool::{with_pool, Allocator, MemPool, PoolOptions, sim::SimDevice};
///
/// #[with_pool(pool)]
/// fn fill(alloc: &Allocator<mempool::Sim>, pool: &MemPool<mempool::Sim>) -> mempool::Result<u64> {
///     let b = alloc.alloc::<f32>(256)?; // from `pool`
///     Ok(b.device_ptr_raw())
/// }
///
/// let alloc = Allocator::sim(SimDevice::new(64 << 20));
/// let pool = MemPool::on(&alloc, PoolOptions::new())?;
/// fill(&alloc, &pool)?;
/// assert_eq!(pool.memory_stats().allocation.allocated, 1);
/// # Ok::<(), mempool::Error>(())
/// ```
#[proc_macro_attribute]
pub fn with_pool(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::with_pool(attr.into(), item.into()).into()
}

/// An expression whose block runs inside a scope of the pool; its value is the block's, and
/// `?`, `return`, `break` and `continue` in it behave as they would without the macro.
///
/// ```
/// use mempool::{pool_scope, Allocator, MemPool, PoolOptions, sim::SimDevice};
/// let alloc = Allocator::sim(SimDevice::new(64 << 20));
/// let pool = MemPool::on(&alloc, PoolOptions::new())?;
/// let buf = pool_scope!(pool => { alloc.alloc::<u8>(1000)? });
/// assert_eq!(pool.memory_stats().allocation.current, 1);
/// # Ok::<(), mempool::Error>(())
/// ```
#[proc_macro]
pub fn pool_scope(input: TokenStream) -> TokenStream {
    expand::pool_scope(input.into()).into()
}

/// Checks, per block, the function's `begin_pool!(p);` ... `end_pool!(p);` pairs: every begin has
/// an end later in the same block, pairs nest, an end names the innermost open pool. Reports every
/// violation in one build and turns the pairs into guards (so `?`, early returns and panics still
/// end the scope).
///
/// ```
/// use mempool::{begin_pool, end_pool, pool_scopes, Allocator, MemPool, PoolOptions, sim::SimDevice};
///
/// #[pool_scopes]
/// fn step(alloc: &Allocator<mempool::Sim>, a: &MemPool<mempool::Sim>, b: &MemPool<mempool::Sim>) -> mempool::Result<()> {
///     begin_pool!(a);
///     let x = alloc.alloc::<u8>(10)?; // from a
///     begin_pool!(b);
///     let y = alloc.alloc::<u8>(10)?; // from b
///     end_pool!(b);
///     end_pool!(a);
///     Ok(())
/// }
///
/// let alloc = Allocator::sim(SimDevice::new(64 << 20));
/// let (a, b) = (MemPool::on(&alloc, PoolOptions::new())?, MemPool::on(&alloc, PoolOptions::new())?);
/// step(&alloc, &a, &b)?;
/// assert_eq!((a.memory_stats().allocation.allocated, b.memory_stats().allocation.allocated), (1, 1));
/// # Ok::<(), mempool::Error>(())
/// ```
#[proc_macro_attribute]
pub fn pool_scopes(attr: TokenStream, item: TokenStream) -> TokenStream {
    check::pool_scopes(attr.into(), item.into()).into()
}

/// Begins a pool scope; only inside a function marked `#[pool_scopes]` (see there).
#[proc_macro]
pub fn begin_pool(input: TokenStream) -> TokenStream {
    let input = input.into();
    if check::is_checked(&input) {
        return check::checked_begin(input).into();
    }
    expand::stray("begin_pool").into()
}

/// Ends the innermost pool scope; only inside a function marked `#[pool_scopes]` (see there).
#[proc_macro]
pub fn end_pool(input: TokenStream) -> TokenStream {
    let input = input.into();
    if check::is_checked(&input) {
        return check::checked_end(input).into();
    }
    expand::stray("end_pool").into()
}
