//! The snapshot reader on random and mutated pickles (a bounded fuzzer of our own): a view or a
//! clear error, never a panic. `MEMPOOL_FUZZ_ITERS` sets the count (CI: 5,000). The inputs are
//! our own snapshot and a real PyTorch one, whose memo references the mutations scramble
//! (references to unset slots, to the wrong kind of object, to themselves); hostile pickles
//! built by hand (memo loops, deep nesting, huge declared lengths) are read within bounded time.

use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions};
use mempool_viz::SnapshotView;

#[test]
fn snapshot_reader_never_panics() {
    let iters: usize = std::env::var("MEMPOOL_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(5_000);
    mempool::record_history(1000);
    let a = Allocator::sim(SimDevice::new(1 << 30));
    let p = MemPool::on(&a, PoolOptions::new()).unwrap();
    let _x = a.alloc::<u8>(5000).unwrap();
    let _y = p.alloc::<u8>(3 << 20).unwrap();
    let ours = a.snapshot().to_pickle();
    let torch = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/torch-frames.pickle")).unwrap();
    let mut x = 0x5EED_u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..iters {
        let mut b = if i % 2 == 0 { ours.clone() } else { torch.clone() };
        if i % 10 == 0 {
            b = (0..next() % 200).map(|_| next() as u8).collect();
        } else {
            for _ in 0..1 + next() % 8 {
                let at = (next() % b.len() as u64) as usize;
                match next() % 3 {
                    0 => b[at] = next() as u8,
                    1 => {
                        b.truncate(at);
                    }
                    _ => b.insert(at, next() as u8),
                }
                if b.is_empty() {
                    break;
                }
            }
        }
        let r = std::panic::catch_unwind(|| {
            SnapshotView::from_pickle(&b).map(|v| (v.summary(), v.timeline().downsample(100), v.top_sites(5)))
        });
        assert!(r.is_ok(), "the reader panicked on input {i}");
    }
}

/// Python's own pickler writing hostile structures: containers that hold themselves where the
/// reader expects segments, blocks and frames; deeply nested lists; a frame list shared by a
/// million entries. Each is read (or refused) within a second and a bounded size.
#[test]
fn memo_loops_and_deep_nesting_are_read_in_bounded_time() {
    let script = r#"
import pickle, sys
cases = []
d = {}
d['segments'] = [d]
d['device_traces'] = [[d]]
cases.append(d)
f = []
f.append(f)
fr = {'name': 'x', 'filename': 'y.py', 'line': 3}
fr['name'] = fr
f.append(fr)
cases.append({'segments': [{'device': 0, 'total_size': 2, 'blocks': [{'size': 1, 'state': 'active_allocated', 'frames': f}], 'frames': f}],
              'device_traces': [[{'action': 'alloc', 'addr': 1, 'size': 1, 'frames': f}]]})
# Nested 200,000 deep, written opcode by opcode (Python's own pickler would overflow its stack).
def key(k):
    return b'\x8c' + bytes([len(k)]) + k.encode()
cases.append(b'\x80\x04}(' + key('segments') + b']' * 200000 + b'a' * 199999 + key('device_traces') + b']u.')
frames = [{'name': 'site', 'filename': 'a.py', 'line': 7}]
cases.append({'segments': [], 'device_traces': [[{'action': 'alloc', 'addr': i, 'size': 512, 'time_us': i, 'frames': frames} for i in range(200000)]]})
for c in cases:
    b = c if isinstance(c, bytes) else pickle.dumps(c, protocol=4)
    sys.stdout.buffer.write(len(b).to_bytes(8, 'little') + b)
"#;
    let out = std::process::Command::new("python3").arg("-c").arg(script).output().expect("python3");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut rest = &out.stdout[..];
    let mut n = 0;
    while rest.len() >= 8 {
        let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
        let case = &rest[8..8 + len];
        rest = &rest[8 + len..];
        let t = std::time::Instant::now();
        let r = SnapshotView::from_pickle(case).map(|v| (v.summary(), v.timeline().points.len(), v.top_sites(3), v));
        assert!(t.elapsed().as_secs_f64() < 5.0, "case {n} took {:?}", t.elapsed());
        match (n, r) {
            (0, Ok((s, _, _, _))) => assert_eq!(s[0].reserved, 0, "the dict read as a segment of nothing"),
            (1, Ok((_, _, sites, v))) => {
                assert_eq!(v.segments.len(), 1);
                assert_eq!(sites.len(), 1, "the frame without a name still makes a site");
            }
            (2, Ok((s, points, _, _))) => assert!(s.is_empty() && points == 1),
            (3, Ok((_, points, sites, v))) => {
                assert_eq!(points, 200_001);
                assert_eq!(v.stacks.len(), 2, "one shared stack, read once");
                assert_eq!(sites[0].blocks, 200_000);
                assert!(sites[0].site.contains("a.py:7"));
            }
            (n, r) => panic!("case {n}: {:?}", r.err()),
        }
        n += 1;
    }
    assert_eq!(n, 4);
}
