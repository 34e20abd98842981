// The pool expression is not a pool.
#![allow(unused)]
use mempool::with_pool;

#[with_pool(42)]
fn work() {}

fn main() {
    work();
}
