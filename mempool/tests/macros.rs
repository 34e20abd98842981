//! What the macros' expansions do at run time, on the simulated device: the scope is active
//! exactly inside the body, on every way out of it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use mempool::sim::{SimDevice, SimStream};
use mempool::{begin_pool, end_pool, pool_scope, pool_scopes, with_pool, Allocator, Error, MemPool, PoolOptions, Sim};

type A = Allocator<Sim>;
type P = MemPool<Sim>;

fn setup() -> (std::sync::Arc<SimDevice>, A, P, P) {
    let sim = SimDevice::new(1 << 30);
    let a = Allocator::sim(sim.clone());
    let p = MemPool::on(&a, PoolOptions::new()).unwrap();
    let q = MemPool::on(&a, PoolOptions::new()).unwrap();
    (sim, a, p, q)
}

/// Allocates one byte and says whether it went to `pool`.
fn lands_in(a: &A, pool: &P) -> bool {
    let before = pool.memory_stats().allocation.allocated;
    drop(a.alloc::<u8>(1).unwrap());
    pool.memory_stats().allocation.allocated > before
}

#[with_pool(pool)]
fn inside(a: &A, pool: &P) -> bool {
    lands_in(a, pool)
}

#[with_pool(pool)]
fn early_return(a: &A, pool: &P, leave: bool) -> Option<bool> {
    if leave {
        return None;
    }
    Some(lands_in(a, pool))
}

#[with_pool(pool)]
fn question_mark(a: &A, pool: &P, fail: bool) -> Result<bool, Error> {
    if fail {
        Err(Error::Reentrant)?;
    }
    Ok(lands_in(a, pool))
}

#[with_pool(pool)]
fn panics(_a: &A, pool: &P) {
    let _ = pool;
    panic!("inside the scope");
}

#[test]
fn with_pool_scope_is_active_exactly_inside_the_body() {
    let (_sim, a, p, _q) = setup();
    assert!(!lands_in(&a, &p));
    assert!(inside(&a, &p));
    assert!(!lands_in(&a, &p), "the scope outlived the function");
    assert_eq!(early_return(&a, &p, false), Some(true));
    assert_eq!(early_return(&a, &p, true), None);
    assert!(!lands_in(&a, &p), "the scope outlived an early return");
    assert!(question_mark(&a, &p, false).unwrap());
    assert!(question_mark(&a, &p, true).is_err());
    assert!(!lands_in(&a, &p), "the scope outlived `?`");
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| panics(&a, &p)));
    assert!(caught.is_err());
    assert!(!lands_in(&a, &p), "the scope outlived a panic");
}

struct Holder {
    pool: P,
    alloc: A,
}

impl Holder {
    #[with_pool(self.pool)]
    fn method(&self) -> bool {
        lands_in(&self.alloc, &self.pool)
    }

    #[with_pool(self.pool)]
    async fn method_async(&self) -> bool {
        lands_in(&self.alloc, &self.pool)
    }
}

#[test]
fn with_pool_on_methods() {
    let (_sim, a, p, _q) = setup();
    let h = Holder { pool: p, alloc: a };
    assert!(h.method());
    assert!(!lands_in(&h.alloc, &h.pool));
    let mut f = Box::pin(h.method_async());
    assert_eq!(poll(&mut f), Poll::Ready(true));
}

#[with_pool(outer)]
fn outer_fn(a: &A, outer: &P, inner: &P) -> (bool, bool, bool) {
    let nested = inner_fn(a, inner);
    (nested, lands_in(a, outer), lands_in(a, inner))
}

#[with_pool(inner)]
fn inner_fn(a: &A, inner: &P) -> bool {
    lands_in(a, inner)
}

#[test]
fn nested_with_pool_functions_innermost_wins() {
    let (_sim, a, p, q) = setup();
    assert_eq!(outer_fn(&a, &p, &q), (true, true, false));
}

#[with_pool(pool, stream = stream)]
fn on_stream(a: &A, pool: &P, stream: &SimStream) -> (bool, bool) {
    let on_current = lands_in(a, pool);
    let _g = a.set_stream(stream).unwrap();
    (on_current, lands_in(a, pool))
}

#[test]
fn stream_argument_routes_that_stream() {
    let (sim, a, p, _q) = setup();
    let s = sim.new_stream();
    assert_eq!(on_stream(&a, &p, &s), (false, true));
}

#[test]
#[should_panic(expected = "belongs to device 1, but the allocator is on device 0")]
fn stream_of_another_device_panics_with_the_error() {
    let (_sim, a, p, _q) = setup();
    let other = SimDevice::with_index(1, 1 << 20).new_stream();
    on_stream(&a, &p, &other);
}

mod renamed {
    pub(crate) use mempool as mp;
}

#[renamed::mp::with_pool(pool, crate = renamed::mp)]
fn renamed_crate(a: &A, pool: &P) -> bool {
    lands_in(a, pool)
}

#[test]
fn crate_argument_for_a_renamed_crate() {
    let (_sim, a, p, _q) = setup();
    assert!(renamed_crate(&a, &p));
}

fn poll<F: Future + ?Sized>(f: &mut Pin<Box<F>>) -> Poll<F::Output> {
    f.as_mut().poll(&mut Context::from_waker(Waker::noop()))
}

struct YieldOnce(bool);

impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        if std::mem::replace(&mut self.0, true) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

#[with_pool(pool)]
async fn task(a: &A, pool: &P) -> Result<(bool, bool), Error> {
    let first = lands_in(a, pool);
    YieldOnce(false).await;
    let second = lands_in(a, pool);
    Ok::<_, Error>(())?;
    Ok((first, second))
}

#[test]
fn async_fn_is_routed_only_while_polled() {
    let (_sim, a, p, _q) = setup();
    let mut t = Box::pin(task(&a, &p));
    assert!(poll(&mut t).is_pending());
    // A second task on the same thread, polled between the first one's polls: not routed.
    let mut other = Box::pin(async { lands_in(&a, &p) });
    assert_eq!(poll(&mut other), Poll::Ready(false));
    assert_eq!(poll(&mut t), Poll::Ready(Ok((true, true))));
    assert!(!lands_in(&a, &p));
}

fn first_routed(a: &A, p: &P, n: usize) -> Result<Option<usize>, Error> {
    for i in 0..n {
        let hit = pool_scope!(p => {
            if i == 0 {
                continue;
            }
            if i == 3 {
                return Ok(Some(i));
            }
            let b = a.alloc::<u8>(1)?;
            drop(b);
            if i == 5 {
                break;
            }
            lands_in(a, p)
        });
        assert!(hit);
        assert!(!lands_in(a, p), "the scope outlived the block");
    }
    Ok(None)
}

#[test]
fn pool_scope_value_and_control_flow() {
    let (_sim, a, p, _q) = setup();
    let v = pool_scope!(p => { lands_in(&a, &p) });
    assert!(v);
    assert!(!lands_in(&a, &p));
    assert_eq!(first_routed(&a, &p, 10).unwrap(), Some(3));
    assert!(!lands_in(&a, &p), "the scope outlived `return`");
    assert_eq!(first_routed(&a, &p, 3).unwrap(), None);
    let r: Result<(), Error> = (|| {
        pool_scope!(p => { Err(Error::Reentrant)? });
        Ok(())
    })();
    assert!(r.is_err());
    assert!(!lands_in(&a, &p), "the scope outlived `?`");
    let nested = pool_scope!(p => { pool_scope!(&_q => { lands_in(&a, &_q) }) });
    assert!(nested);
}

#[pool_scopes]
fn begin_end(a: &A, p: &P, q: &P, leave_early: bool) -> Result<Vec<bool>, Error> {
    let mut seen = vec![lands_in(a, p)];
    begin_pool!(p);
    seen.push(lands_in(a, p));
    begin_pool!(q);
    seen.push(lands_in(a, q));
    if leave_early {
        return Ok(seen);
    }
    end_pool!(q);
    seen.push(lands_in(a, p));
    for _ in 0..2 {
        mempool::begin_pool!(q);
        seen.push(lands_in(a, q));
        mempool::end_pool!(q);
    }
    end_pool!(p);
    seen.push(lands_in(a, p));
    Ok(seen)
}

#[test]
fn begin_end_pairs_are_guards() {
    let (_sim, a, p, q) = setup();
    assert_eq!(begin_end(&a, &p, &q, false).unwrap(), vec![false, true, true, true, true, true, false]);
    assert_eq!(begin_end(&a, &p, &q, true).unwrap(), vec![false, true, true]);
    assert!(!lands_in(&a, &p) && !lands_in(&a, &q), "an early return left a scope open");
}
