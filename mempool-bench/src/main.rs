//! `mempool-bench`: the allocator workloads of `shared/anchors/README.md`, so that mempool and
//! PyTorch's allocator are measured on the same work in the same run.
//!
//! ```text
//! mempool-bench latency [pair|mixed|pair-raw|mixed-raw]... [--backend sim|host|cuda]
//! mempool-bench replay <trace>... [--backend sim|host|cuda]
//! mempool-bench scope [--backend sim|host|cuda]
//! mempool-bench threads [--shared-stream] [--backend sim|host|cuda]
//! mempool-bench graph <trace>... [--backend sim|cuda]
//! mempool-bench graph-launch
//! ```
//! `latency` prints `pair <bytes> <ns>` and `mixed <live> <ns>` lines (through `Buffer`), then the
//! same through the raw byte API as `pair-raw` / `mixed-raw`. `replay` prints one line per rep:
//! `mempool <trace> rep=<r> <cold|warm> events=<n> ns_per_event=<x> peak_allocated=<b> peak_reserved=<b>`;
//! each allocation is made with its recorded stream current (value 0: the default stream; each other
//! value: a stream of its own, see `mempool_bench::playback`). Three reps (rep 0 cold, then warm);
//! `MEMPOOL_BENCH_REPS` sets another count (a profiler's long run of warm reps).
//! `scope` prints `scope enter_exit <ns>`, then `scope pair_default <bytes> <ns>` and
//! `scope pair_in_scope <bytes> <ns>` measured one after the other in the same run, then a scope
//! around every pair: by hand in a block and through `pool_scope!`, by hand in a function and
//! through a `#[with_pool]` function.
//! `threads` runs the `threads` workload: for N = 1, 2, 4, 8, 16 threads, each makes a stream of
//! its own current (with `--shared-stream`: all of them one stream), does 2,000 untimed pairs,
//! waits on a barrier, then 200,000 timed alloc + free pairs cycling 512 B, 4 KiB, 64 KiB, 1 MiB;
//! one line each: `mempool threads <N> pairs_per_s <rate> scaling <rate / rate at N=1>` (with
//! `--shared-stream`, `mempool threads_shared ...`), the rate being N × pairs / the slowest thread's
//! time.
//! `graph <trace>...` captures each trace's allocations and frees (all on one new stream, the
//! trace's stream column set aside) into a CUDA graph with a pool of its own, and prints
//! `mempool graph <trace> events=<n> pool_reserved=<bytes> pool_peak_reserved=<bytes> live=<n>`
//! (the pool's reserved bytes after the capture, with the trace's last live buffers kept), then
//! the same with an expandable pool (`mempool_expand graph ...`, where the backend has virtual memory):
//! PyTorch's private pool for the same capture is `harness/graph_anchor.py`. `graph-launch`
//! (CUDA) captures 64 zero-filled 4 KiB buffers, half freed, and prints
//! `mempool graph_launch replay_ns=<x> cudarc_launch_ns=<y>`: 10,000 launches through
//! `Graph::replay` and through cudarc's `CudaGraph::launch` of the same graph, twice in turn.
//! The backend is CUDA device 0 when a GPU is present, else host memory (said on stderr).

use std::process::ExitCode;
use std::time::Instant;

use mempool::sim::SimDevice;
use mempool::{pool_scope, with_pool, Allocator, Buffer, Kind, MemPool, PoolOptions, StreamId};
use mempool_bench::playback::Playback;
use mempool_bench::trace::parse_trace;

/// `println!` that ends the program quietly when stdout is closed (`mempool-bench ... | head`).
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout(), $($t)*).is_err() {
            std::process::exit(0);
        }
    }};
}

const PAIR_SIZES: [usize; 5] = [512, 4096, 1 << 20, 8 << 20, 64 << 20];
const WARMUP: usize = 1_000;
const MIXED_LIVE: [usize; 2] = [16, 256];

/// xorshift64 with the anchors' seed and sizes.
/// Timed iterations: 200,000 as the anchors define; `MEMPOOL_BENCH_ITERS` overrides it for
/// quick profiling runs (figures from such runs do not compare with the anchors').
fn timed() -> usize {
    std::env::var("MEMPOOL_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000)
}

/// The `pair` sizes: the anchors' five, or the comma-separated list in `MEMPOOL_BENCH_SIZES`
/// (for profiling one size at a time).
fn pair_sizes() -> Vec<usize> {
    match std::env::var("MEMPOOL_BENCH_SIZES") {
        Ok(v) => v.split(',').filter_map(|s| s.trim().parse().ok()).collect(),
        Err(_) => PAIR_SIZES.to_vec(),
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn size(&mut self) -> usize {
        let lo = 1usize << (9 + self.next() % 18);
        lo + (self.next() % lo as u64) as usize
    }
}

fn pair<K: Kind>(a: &Allocator<K>, size: usize) -> f64 {
    for _ in 0..WARMUP {
        drop(a.alloc::<u8>(size).expect("alloc"));
    }
    let t = Instant::now();
    for _ in 0..timed() {
        drop(a.alloc::<u8>(size).expect("alloc"));
    }
    t.elapsed().as_nanos() as f64 / timed() as f64
}

fn pair_raw<K: Kind>(a: &Allocator<K>, size: usize) -> f64 {
    for _ in 0..WARMUP {
        a.free_bytes(a.alloc_bytes(size).expect("alloc")).expect("free");
    }
    let t = Instant::now();
    for _ in 0..timed() {
        a.free_bytes(a.alloc_bytes(size).expect("alloc")).expect("free");
    }
    t.elapsed().as_nanos() as f64 / timed() as f64
}

fn mixed<K: Kind>(a: &Allocator<K>, live: usize) -> f64 {
    let mut rng = Rng(42);
    let mut v: Vec<Option<Buffer<u8, K>>> = (0..live).map(|_| Some(a.alloc(rng.size()).expect("alloc"))).collect();
    let t = Instant::now();
    for _ in 0..timed() {
        let k = (rng.next() % live as u64) as usize;
        v[k] = None; // free first, as the anchor does
        v[k] = Some(a.alloc(rng.size()).expect("alloc"));
    }
    t.elapsed().as_nanos() as f64 / timed() as f64
}

fn mixed_raw<K: Kind>(a: &Allocator<K>, live: usize) -> f64 {
    let mut rng = Rng(42);
    let mut v: Vec<u64> = (0..live).map(|_| a.alloc_bytes(rng.size()).expect("alloc")).collect();
    let t = Instant::now();
    for _ in 0..timed() {
        let k = (rng.next() % live as u64) as usize;
        a.free_bytes(v[k]).expect("free");
        v[k] = a.alloc_bytes(rng.size()).expect("alloc");
    }
    let ns = t.elapsed().as_nanos() as f64 / timed() as f64;
    for p in v {
        a.free_bytes(p).expect("free");
    }
    ns
}

/// `pair` and `mixed` through an allocation function (a pool's `alloc`, say).
fn pair_with<K: Kind>(alloc: &dyn Fn(usize) -> Buffer<u8, K>, size: usize) -> f64 {
    for _ in 0..WARMUP {
        drop(alloc(size));
    }
    let t = Instant::now();
    for _ in 0..timed() {
        drop(alloc(size));
    }
    t.elapsed().as_nanos() as f64 / timed() as f64
}

fn mixed_with<K: Kind>(alloc: &dyn Fn(usize) -> Buffer<u8, K>, live: usize) -> f64 {
    let mut rng = Rng(42);
    let mut v: Vec<Option<Buffer<u8, K>>> = (0..live).map(|_| Some(alloc(rng.size()))).collect();
    let t = Instant::now();
    for _ in 0..timed() {
        let k = (rng.next() % live as u64) as usize;
        v[k] = None;
        v[k] = Some(alloc(rng.size()));
    }
    t.elapsed().as_nanos() as f64 / timed() as f64
}

/// Cache hits over segment sources, in one run: the default pools, a pool of `cuMemAlloc`
/// segments (no source of its own), a pool over a stream-ordered driver pool
/// (`StreamOrderedAllocator`), and that source with no caching layer (`no_cache`: every buffer
/// straight from the driver pool, PyTorch's `backend:cudaMallocAsync`). Then `trim_to(0)`.
fn sources(a: &Allocator<mempool::Cuda>) -> Result<(), String> {
    use mempool::backend::stream_ordered::{StreamOrderedAllocator, StreamOrderedOptions};
    let err = |e: mempool::Error| e.to_string();
    let plain = MemPool::on(a, PoolOptions::new()).map_err(err)?;
    let so = std::sync::Arc::new(StreamOrderedAllocator::new(0, StreamOrderedOptions::default()).map_err(err)?);
    let cached = MemPool::on(a, PoolOptions::new().shared_allocator(so.clone())).map_err(err)?;
    let direct = MemPool::on(a, PoolOptions::new().shared_allocator(so.clone()).no_cache(true)).map_err(err)?;
    let default = |s: usize| a.alloc::<u8>(s).expect("alloc");
    let in_plain = |s: usize| plain.alloc::<u8>(s).expect("alloc");
    let in_so = |s: usize| cached.alloc::<u8>(s).expect("alloc");
    let in_direct = |s: usize| direct.alloc::<u8>(s).expect("alloc");
    let row = |what: String, d: f64, p: f64, s: f64, n: f64| {
        out!(
            "sources {what} default {d:.1} pool {p:.1} ({:+.1}% of the default's) stream_ordered {s:.1} ({:+.1}% of the default's) no_cache {n:.1}",
            (p / d - 1.0) * 100.0,
            (s / d - 1.0) * 100.0
        );
    };
    // Pairs: the best of three rounds per column, the columns taking turns in each round (a
    // shared machine's noise moves single runs by several percent, more than the differences
    // measured here).
    for size in pair_sizes() {
        let mut best = [f64::MAX; 4];
        for _ in 0..3 {
            let round = [
                pair_with(&default, size),
                pair_with(&in_plain, size),
                pair_with(&in_so, size),
                pair_with(&in_direct, size),
            ];
            for (b, r) in best.iter_mut().zip(round) {
                *b = b.min(r);
            }
        }
        let [d, p, s, n] = best;
        row(format!("pair {size}"), d, p, s, n);
    }
    for live in MIXED_LIVE {
        let (d, p, s, n) = (
            mixed_with(&default, live),
            mixed_with(&in_plain, live),
            mixed_with(&in_so, live),
            mixed_with(&in_direct, live),
        );
        row(format!("mixed {live}"), d, p, s, n);
    }
    cached.empty_cache().map_err(err)?;
    direct.empty_cache().map_err(err)?;
    // The frees went to the driver on the segments' stream (`cuMemFreeAsync`): done once it ran.
    a.current_stream().synchronize().map_err(|e| e.to_string())?;
    let (before, used) = (so.reserved().map_err(err)?, so.used().map_err(err)?);
    so.trim_to(0).map_err(err)?;
    out!(
        "sources trim_to(0) with nothing live: driver used {used}, reserved {before} -> {} bytes",
        so.reserved().map_err(err)?
    );
    Ok(())
}

/// Runs the rows whose kind (`pair`, `mixed`, `pair-raw`, `mixed-raw`) is in `only` (all if empty).
fn latency<K: Kind>(a: &Allocator<K>, only: &[String]) {
    let want = |k: &str| only.is_empty() || only.iter().any(|o| o == k);
    for s in pair_sizes().into_iter().filter(|_| want("pair")) {
        out!("pair {s} {:.1}", pair(a, s));
    }
    for l in MIXED_LIVE.into_iter().filter(|_| want("mixed")) {
        let before = a.memory_stats().num_device_alloc;
        a.reset_peak_stats();
        let ns = mixed(a, l);
        out!("mixed {l} {ns:.1}");
        let st = a.memory_stats();
        eprintln!(
            "mixed {l}: {} segment allocations, peak reserved {} bytes, peak allocated {} bytes",
            st.num_device_alloc - before,
            st.reserved_bytes.all.peak,
            st.allocated_bytes.all.peak
        );
    }
    for s in pair_sizes().into_iter().filter(|_| want("pair-raw")) {
        out!("pair-raw {s} {:.1}", pair_raw(a, s));
    }
    for l in MIXED_LIVE.into_iter().filter(|_| want("mixed-raw")) {
        out!("mixed-raw {l} {:.1}", mixed_raw(a, l));
    }
}

/// Scope enter+exit, and pair latency inside a pool scope next to the default pools'.
fn scope<K: Kind>(a: &Allocator<K>) {
    let pool = MemPool::on(a, PoolOptions::new()).expect("a pool with the default options");
    for _ in 0..WARMUP {
        drop(std::hint::black_box(pool.scope()));
    }
    let n = timed() * 5;
    let t = Instant::now();
    for _ in 0..n {
        drop(std::hint::black_box(pool.scope()));
    }
    out!("scope enter_exit {:.1}", t.elapsed().as_nanos() as f64 / n as f64);
    for s in [512, 1 << 20] {
        let default = pair(a, s);
        let inside = {
            let _scope = pool.scope();
            pair(a, s)
        };
        // Straight into the pool (`MemPool::alloc`, no scope lookup): a pool's cache hit
        // against the default pools'.
        let direct = pair_with(&|n| pool.alloc::<u8>(n).expect("alloc"), s);
        out!("scope pair_default {s} {default:.1}");
        out!("scope pair_in_scope {s} {inside:.1} ({:+.1}%)", (inside / default - 1.0) * 100.0);
        out!("scope pair_pool_alloc {s} {direct:.1} ({:+.1}%)", (direct / default - 1.0) * 100.0);
    }
    // A scope entered and left around every pair: by hand, through `pool_scope!`, and through a
    // `#[with_pool]` function. The macros should cost what the guard costs.
    let per_pair = |f: &dyn Fn()| {
        for _ in 0..WARMUP {
            f();
        }
        let t = Instant::now();
        for _ in 0..timed() {
            f();
        }
        t.elapsed().as_nanos() as f64 / timed() as f64
    };
    // Each form against its hand-written twin: a block with a guard, a function with a guard.
    let guard = per_pair(&|| {
        let _scope = pool.scope();
        drop(a.alloc::<u8>(512).expect("alloc"));
    });
    let with_macro = per_pair(&|| pool_scope!(pool => { drop(a.alloc::<u8>(512).expect("alloc")) }));
    let guard_fn = per_pair(&|| guarded_pair(a, &pool));
    let attr = per_pair(&|| scoped_pair(a, &pool));
    out!("scope pair_with_guard 512 {guard:.1}");
    out!("scope pair_with_pool_scope_macro 512 {with_macro:.1} ({:+.1}%)", (with_macro / guard - 1.0) * 100.0);
    out!("scope pair_in_fn_with_guard 512 {guard_fn:.1}");
    out!("scope pair_in_fn_with_pool_attribute 512 {attr:.1} ({:+.1}%)", (attr / guard_fn - 1.0) * 100.0);
}

#[inline(never)]
fn guarded_pair<K: Kind>(a: &Allocator<K>, pool: &MemPool<K>) {
    let _scope = pool.scope();
    drop(a.alloc::<u8>(512).expect("alloc"));
}

#[inline(never)]
#[with_pool(pool)]
fn scoped_pair<K: Kind>(a: &Allocator<K>, pool: &MemPool<K>) {
    drop(a.alloc::<u8>(512).expect("alloc"));
}

/// Where `replay` gets the backend's streams for a trace's stream column: the default stream for
/// value 0, a new stream for each other value.
struct Streams<'a, K: Kind> {
    default: K::Stream,
    new: &'a mut dyn FnMut() -> Result<K::Stream, String>,
}

fn replay<K: Kind>(a: &Allocator<K>, path: &str, streams: &mut Streams<'_, K>) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let ops = parse_trace(&text).map_err(|e| format!("{path}: {e}"))?;
    let name = path.rsplit('/').next().unwrap_or(path);
    let play = Playback::new(&ops, streams.default.clone(), &mut *streams.new).map_err(|e| format!("{path}: {e}"))?;
    a.empty_cache().map_err(|e| e.to_string())?;
    let reps = std::env::var("MEMPOOL_BENCH_REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    for rep in 0..reps {
        let r = play.run(a).map_err(|e| format!("{path}: {e}"))?;
        out!(
            "mempool {name} rep={rep} {} events={} ns_per_event={:.1} peak_allocated={} peak_reserved={}",
            if rep == 0 { "cold" } else { "warm" },
            r.events,
            r.ns_per_event,
            r.peak_allocated,
            r.peak_reserved
        );
    }
    Ok(())
}

/// Captures a trace's allocations into a graph with a pool of its own (see the module docs).
fn graph<K: Kind>(a: &Allocator<K>, path: &str, streams: &mut Streams<'_, K>) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let ops = parse_trace(&text).map_err(|e| format!("{path}: {e}"))?;
    let name = path.rsplit('/').next().unwrap_or(path);
    for expandable in [false, true] {
        // A backend without virtual memory has no expandable pools: that row is left out.
        let Ok(pool) = MemPool::on(a, PoolOptions::new().expandable(expandable)) else { continue };
        graph_into(a, name, path, &ops, pool, expandable, streams)?;
    }
    Ok(())
}

fn graph_into<K: Kind>(
    a: &Allocator<K>,
    name: &str,
    path: &str,
    ops: &[mempool_bench::trace::TraceOp],
    pool: MemPool<K>,
    expandable: bool,
    streams: &mut Streams<'_, K>,
) -> Result<(), String> {
    let s = (streams.new)()?;
    let _on = a.set_stream(&s).map_err(|e| e.to_string())?;
    let capture = a.begin_capture(&s, &pool, mempool::CaptureMode::Global).map_err(|e| e.to_string())?;
    let mut live = std::collections::HashMap::new();
    for op in ops {
        match *op {
            mempool_bench::trace::TraceOp::Alloc { id, bytes, .. } => {
                live.insert(id, a.alloc::<u8>(bytes).map_err(|e| format!("{path}: {e}"))?);
            }
            mempool_bench::trace::TraceOp::Free { id } => drop(live.remove(&id)),
        }
    }
    let stats = pool.memory_stats();
    // An empty capture has no graph: that is all right here (only the pool is measured).
    let graph = capture.end().ok();
    out!(
        "{} graph {name} events={} pool_reserved={} pool_peak_reserved={} live={}",
        if expandable { "mempool_expand" } else { "mempool" },
        ops.len(),
        stats.reserved_bytes.current,
        stats.reserved_bytes.peak,
        live.len()
    );
    drop((live, graph, pool));
    Ok(())
}

/// `graph-launch`: the cost of a replay through mempool's `Graph` and through cudarc.
fn graph_launch(a: &Allocator<mempool::Cuda>) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let s = a.context().new_stream().map_err(|x| e(&x))?;
    let _on = a.set_stream(&s).map_err(|x| e(&x))?;
    let pool = MemPool::on(a, PoolOptions::new()).map_err(|x| e(&x))?;
    let capture = a.begin_capture(&s, &pool, mempool::CaptureMode::Global).map_err(|x| e(&x))?;
    let mut kept = Vec::new();
    for i in 0..64 {
        let b = a.alloc_zeros::<u8>(4096).map_err(|x| e(&x))?;
        if i % 2 == 0 {
            kept.push(b);
        }
    }
    let graph = capture.end().map_err(|x| e(&x))?;
    let inner = graph.inner().ok_or("no graph")?;
    const N: u32 = 10_000;
    for _ in 0..2 {
        let t = Instant::now();
        for _ in 0..N {
            // SAFETY: the graph only zero-fills buffers of its own pool (`kept` and its
            // temporaries); nothing else uses them.
            unsafe { graph.replay() }.map_err(|x| e(&x))?;
        }
        s.synchronize().map_err(|x| e(&x))?;
        let ours = t.elapsed().as_nanos() as f64 / f64::from(N);
        let t = Instant::now();
        for _ in 0..N {
            inner.launch().map_err(|x| e(&x))?;
        }
        s.synchronize().map_err(|x| e(&x))?;
        let theirs = t.elapsed().as_nanos() as f64 / f64::from(N);
        out!("mempool graph_launch replay_ns={ours:.1} cudarc_launch_ns={theirs:.1}");
    }
    drop((kept, graph, pool));
    Ok(())
}

/// The sizes the `threads` workload cycles through.
const THREAD_SIZES: [usize; 4] = [512, 4096, 64 << 10, 1 << 20];

fn threads<K: Kind>(a: &Allocator<K>, args: &[String], streams: &mut Streams<'_, K>) -> Result<(), String> {
    let shared = match args {
        [] => false,
        [x] if x == "--shared-stream" => true,
        _ => return Err(usage()),
    };
    let iters = timed();
    let one = (streams.new)()?;
    let mut base = 0.0;
    for n in [1usize, 2, 4, 8, 16] {
        let mine: Vec<K::Stream> =
            (0..n).map(|_| if shared { Ok(one.clone()) } else { (streams.new)() }).collect::<Result<_, _>>()?;
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(n));
        let workers: Vec<_> = mine
            .into_iter()
            .map(|s| {
                let (a, barrier) = (a.clone(), barrier.clone());
                std::thread::spawn(move || -> Result<f64, String> {
                    let _on = a.set_stream(&s).map_err(|e| e.to_string())?;
                    for i in 0..2_000 {
                        drop(a.alloc::<u8>(THREAD_SIZES[i % 4]).map_err(|e| e.to_string())?);
                    }
                    barrier.wait();
                    let t = Instant::now();
                    for i in 0..iters {
                        drop(std::hint::black_box(a.alloc::<u8>(THREAD_SIZES[i % 4]).map_err(|e| e.to_string())?));
                    }
                    Ok(t.elapsed().as_secs_f64())
                })
            })
            .collect();
        let mut slowest: f64 = 0.0;
        for w in workers {
            slowest = slowest.max(w.join().map_err(|_| "a worker thread panicked".to_string())??);
        }
        let rate = (n * iters) as f64 / slowest;
        if n == 1 {
            base = rate;
        }
        let name = if shared { "threads_shared" } else { "threads" };
        out!("mempool {name} {n} pairs_per_s {rate:.0} scaling {:.2}", rate / base);
    }
    Ok(())
}

fn run<K: Kind>(a: Allocator<K>, cmd: &str, args: &[String], mut streams: Streams<'_, K>) -> Result<(), String> {
    match cmd {
        "latency" => {
            latency(&a, args);
            Ok(())
        }
        "replay" if !args.is_empty() => args.iter().try_for_each(|t| replay(&a, t, &mut streams)),
        "scope" => {
            scope(&a);
            Ok(())
        }
        "threads" => threads(&a, args, &mut streams),
        "graph" if !args.is_empty() => args.iter().try_for_each(|t| graph(&a, t, &mut streams)),
        _ => Err(usage()),
    }
}

fn usage() -> String {
    "usage: mempool-bench latency [pair|mixed|pair-raw|mixed-raw]... [--backend sim|sim-pinned|host|cuda|pinned]\n       mempool-bench replay <trace>... [--backend sim|host|cuda]\n       mempool-bench scope [--backend sim|host|cuda]\n       mempool-bench threads [--shared-stream] [--backend sim|host|cuda]\n       mempool-bench graph <trace>... [--backend sim|cuda]\n       mempool-bench graph-launch\n       mempool-bench sources   (CUDA: cache hits over segment sources)".into()
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut backend = None;
    if let Some(i) = args.iter().position(|a| a == "--backend") {
        if i + 1 >= args.len() {
            eprintln!("{}", usage());
            return ExitCode::from(2);
        }
        backend = Some(args.remove(i + 1));
        args.remove(i);
    }
    let Some(cmd) = args.first().cloned() else {
        eprintln!("{}", usage());
        return ExitCode::from(2);
    };
    let rest = &args[1..];
    let backend = backend.unwrap_or_else(|| match mempool::device_count() {
        Ok(n) if n > 0 => "cuda".into(),
        _ => {
            eprintln!("mempool-bench: no CUDA GPU here; using the host backend");
            "host".into()
        }
    });
    // `MEMPOOL_ALLOC_CONF` on every backend (the CUDA allocator reads it itself).
    let config = match mempool::Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mempool-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let r = match backend.as_str() {
        "cuda" if cmd == "graph-launch" => Allocator::cuda(0).map_err(|e| e.to_string()).and_then(|a| graph_launch(&a)),
        "cuda" if cmd == "sources" => Allocator::cuda(0).map_err(|e| e.to_string()).and_then(|a| sources(&a)),
        "cuda" => Allocator::cuda(0).map_err(|e| e.to_string()).and_then(|a| {
            let ctx = a.context().clone();
            let default = ctx.default_stream();
            run(a, &cmd, rest, Streams { default, new: &mut || ctx.new_stream().map_err(|e| e.to_string()) })
        }),
        // Pinned host memory (`Allocator::pinned`), on CUDA streams.
        "pinned" => Allocator::pinned(0).map_err(|e| e.to_string()).and_then(|a| {
            let ctx = a.context().clone();
            let default = ctx.default_stream();
            run(a, &cmd, rest, Streams { default, new: &mut || ctx.new_stream().map_err(|e| e.to_string()) })
        }),
        "host" => {
            // Host streams are notional ids: 0 is the default, 1, 2, ... the trace's others.
            let mut next = 0;
            let new = &mut || {
                next += 1;
                Ok(StreamId(next))
            };
            let a = Allocator::host_with(mempool::backend::host::HostBackend::new(), config);
            run(a, &cmd, rest, Streams { default: StreamId(0), new })
        }
        "sim" => {
            let sim = SimDevice::new(usize::MAX / 2);
            let streams = Streams { default: sim.default_stream(), new: &mut || Ok(sim.new_stream()) };
            // Leaked, so its handles are references as the process-wide CUDA allocator's are.
            run(Allocator::sim_with(sim.clone(), config).leak(), &cmd, rest, streams)
        }
        // A simulated device whose memory counts as pinned (`SimDevice::pinned`): the pinned
        // allocators' rules and `pinned_*` settings on a machine without a GPU.
        "sim-pinned" => {
            let sim = SimDevice::pinned(usize::MAX / 2);
            let streams = Streams { default: sim.default_stream(), new: &mut || Ok(sim.new_stream()) };
            run(Allocator::sim_with(sim.clone(), config).leak(), &cmd, rest, streams)
        }
        other => Err(format!("unknown backend `{other}`; valid: sim, sim-pinned, host, cuda, pinned")),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mempool-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
