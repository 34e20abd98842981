// No pool at all.
#![allow(unused)]
use mempool::with_pool;

#[with_pool]
fn work() {}

fn main() {}
