// The attribute on a struct.
#![allow(unused)]
use mempool::with_pool;

#[with_pool(pool)]
struct Model {
    layers: usize,
}

fn main() {}
