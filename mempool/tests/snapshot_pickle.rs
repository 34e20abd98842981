//! Snapshots in PyTorch's pickle layout, checked by Python's own `pickle` module, and the
//! snapshot written on out-of-memory. One test: history recording and the environment are
//! process-wide.

use std::process::Command;

use mempool::sim::SimDevice;
use mempool::{Allocator, MemPool, PoolOptions};

const CHECK: &str = r#"
import pickle, sys
d = pickle.load(open(sys.argv[1], 'rb'))
assert set(d) >= {'segments', 'device_traces'}, d.keys()
segs = d['segments']
assert len(segs) == int(sys.argv[2]), len(segs)
pools = set()
for s in segs:
    for k in ('device', 'address', 'total_size', 'allocated_size', 'active_size', 'requested_size',
              'stream', 'segment_type', 'segment_pool_id', 'blocks', 'frames'):
        assert k in s, (k, s.keys())
    assert s['segment_type'] in ('small', 'large')
    pools.add(s['segment_pool_id'])
    assert sum(b['size'] for b in s['blocks']) == s['total_size']
    addr = s['address']
    for b in s['blocks']:
        assert b['address'] == addr and b['state'] in ('active_allocated', 'active_pending_free', 'inactive'), b
        assert 'frames' in b and b['requested_size'] <= b['size']
        addr += b['size']
    allocated = sum(b['size'] for b in s['blocks'] if b['state'] == 'active_allocated')
    assert s['allocated_size'] == allocated
    # what torch.cuda._memory_viz's segsum asserts:
    internal = sum(b['size'] - b['requested_size'] for b in s['blocks'] if b['state'] == 'active_allocated')
    external = sum(b['size'] for b in s['blocks'] if b['state'] != 'active_allocated')
    used = sum(b['requested_size'] for b in s['blocks'] if b['state'] == 'active_allocated')
    assert internal + external + used == s['total_size']
assert len(pools) == 2, pools
trace = d['device_traces'][0]
actions = [e['action'] for e in trace]
for a in ('alloc', 'free_requested', 'free_completed', 'segment_alloc', 'segment_free', 'oom'):
    assert a in actions, (a, set(actions))
for e in trace:
    for k in ('action', 'addr', 'size', 'stream', 'time_us', 'frames'):
        assert k in e, (k, e)
assert [e for e in trace if e['action'] == 'oom'][0]['size'] == 64 << 20
print('ok', len(segs), 'segments', len(trace), 'events')
"#;

#[test]
fn pickle_loads_in_python_with_pytorchs_layout_and_oom_writes_one() {
    let dir = std::env::temp_dir().join(format!("mempool-snapshot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let oom_path = dir.join("oom.pickle");
    // Read when the first allocator of this process is made.
    std::env::set_var("MEMPOOL_SNAPSHOT_ON_OOM", &oom_path);
    std::env::set_var("MEMPOOL_RECORD_HISTORY", "100000");
    let sim = SimDevice::new(48 << 20);
    let a = Allocator::sim(sim);
    let pool = MemPool::on(&a, PoolOptions::new()).unwrap();
    let keep = a.alloc::<u8>(3000).unwrap();
    let big = a.alloc::<u8>(5 << 20).unwrap();
    let mine = pool.alloc::<u8>(100_000).unwrap();
    drop(big);
    drop(a.alloc::<u8>(10).unwrap());
    a.empty_cache().unwrap(); // the 20 MiB segment goes: segment_free
    assert!(a.alloc::<u8>(64 << 20).is_err()); // oom, and a snapshot on the way out
    let path = dir.join("snapshot.pickle");
    let snap = a.snapshot();
    assert!(snap.trace.len() >= 8, "history not recorded: {}", snap.trace.len());
    snap.write_pickle(&path).unwrap();
    for (p, segs) in [(&path, snap.segments.len()), (&oom_path, snap.segments.len())] {
        let out = Command::new("python3").arg("-c").arg(CHECK).arg(p).arg(segs.to_string()).output().expect("python3");
        assert!(out.status.success(), "python rejected {}: {}", p.display(), String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok"));
    }
    // A pool's snapshot holds only its own segments and events.
    let ps = pool.snapshot();
    assert_eq!(ps.segments.len(), 1);
    assert!(ps.trace.iter().all(|e| e.pool == pool.id()));
    drop((keep, mine));
    std::fs::remove_dir_all(&dir).ok();
}
