//! Hostile inputs for mempool-viz: pickles built by hand against the reader (`pickle.rs`), the
//! view's figures (`lib.rs`), the CLI and the offline page (`html.rs`, `page.js`).
//!
//! Probes marked `Found by review` failed before their fixes: each names what went wrong and where.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mempool_viz::{Action, Block, Event, Frame, Segment, SnapshotView, Timeline};

// ---------------------------------------------------------------------------------------------
// Memory accounting: bytes allocated by *this thread* (tests run on their own threads).

struct Counting;

thread_local! {
    static CUR: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn add(n: isize) {
    let _ = CUR.try_with(|c| {
        let v = c.get() + n;
        c.set(v);
        let _ = PEAK.try_with(|p| {
            if v > p.get() {
                p.set(v)
            }
        });
    });
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        add(l.size() as isize);
        // SAFETY: the caller's layout, as given.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        add(l.size() as isize);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        add(-(l.size() as isize));
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        add(n as isize - l.size() as isize);
        // SAFETY: as above.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Peak bytes this thread held above its level on entry while running `f`.
fn peak_of<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = CUR.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    let peak = PEAK.with(Cell::get) - base;
    (r, peak.max(0) as usize)
}

/// Runs `f` on a thread; `None` if it has not finished within `secs` (the thread is left behind:
/// the test binary exits after its tests).
fn within<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> Option<R> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).ok()
}

fn no_panic<R>(what: &str, f: impl FnOnce() -> R + std::panic::UnwindSafe) -> R {
    match std::panic::catch_unwind(f) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("{what}: panicked: {msg}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A tiny pickle writer (protocol 4 opcodes).

#[derive(Default)]
struct P(Vec<u8>);

impl P {
    fn new() -> P {
        P(b"\x80\x04".to_vec())
    }
    fn raw(&mut self, b: &[u8]) -> &mut P {
        self.0.extend_from_slice(b);
        self
    }
    fn s(&mut self, s: &str) -> &mut P {
        if s.len() < 256 {
            self.0.push(0x8c);
            self.0.push(s.len() as u8);
        } else {
            self.0.push(b'X');
            self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        }
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    /// A u64 as BININT or LONG1 (8 bytes below 2^63, else 9 with the sign byte, as Python).
    fn u(&mut self, v: u64) -> &mut P {
        if v < 1 << 31 {
            self.0.push(b'J');
            self.0.extend_from_slice(&(v as i32).to_le_bytes());
        } else if v < 1 << 63 {
            self.0.push(0x8a);
            self.0.push(8);
            self.0.extend_from_slice(&v.to_le_bytes());
        } else {
            self.0.push(0x8a);
            self.0.push(9);
            self.0.extend_from_slice(&v.to_le_bytes());
            self.0.push(0);
        }
        self
    }
    /// A float (BINFLOAT): the reader turns a finite non-negative one into a u64, saturating.
    fn f(&mut self, v: f64) -> &mut P {
        self.0.push(b'G');
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn mark(&mut self) -> &mut P {
        self.raw(b"(")
    }
    fn put(&mut self, i: u32) -> &mut P {
        self.0.push(b'r');
        self.0.extend_from_slice(&i.to_le_bytes());
        self
    }
    fn get(&mut self, i: u32) -> &mut P {
        self.0.push(b'j');
        self.0.extend_from_slice(&i.to_le_bytes());
        self
    }
    fn stop(&mut self) -> Vec<u8> {
        self.0.push(b'.');
        std::mem::take(&mut self.0)
    }
}

/// `{"segments": <segs>, "device_traces": [<traces>...], ...}` around caller-written parts.
fn snapshot_pickle(segs: impl FnOnce(&mut P), traces: impl FnOnce(&mut P), ours: bool) -> Vec<u8> {
    let mut p = P::new();
    p.raw(b"}").mark();
    p.s("segments").raw(b"]").mark();
    segs(&mut p);
    p.raw(b"e");
    p.s("device_traces").raw(b"]").mark();
    traces(&mut p);
    p.raw(b"e");
    if ours {
        p.s("allocator_settings").raw(b"}").mark().s("allocator").s("mempool").raw(b"u");
    }
    p.raw(b"u");
    p.stop()
}

fn parse(b: &[u8]) -> Result<SnapshotView, mempool_viz::Error> {
    SnapshotView::from_pickle(b)
}

fn err_of(b: &[u8]) -> String {
    match parse(b) {
        Ok(_) => panic!("accepted: {b:?}"),
        Err(e) => e.to_string(),
    }
}

// =============================================================================================
// 1. The pickle reader.

// Found by review (fixed): protocol 0's STRING opcode (`S'...'`) slices `s[1..s.len() - 1]` by bytes: a quoted
// string whose last character before the closing quote is missing and whose tail is multi-byte
// (`S'é\n`) slices inside a UTF-8 character and panics (pickle.rs, the `b'S'` arm).
#[test]
fn string_opcode_with_a_multibyte_tail_does_not_panic() {
    for input in [&b"S'\xc3\xa9\n."[..], b"S\"\xe2\x82\xac\n.", b"(S'\xf0\x9f\x98\x80\n."] {
        let r = no_panic(&format!("S opcode on {input:?}"), || parse(input).map(|_| ()));
        assert!(r.is_err());
    }
}

#[test]
fn huge_declared_lengths_and_memo_indices_are_errors() {
    let cases: &[(&[u8], &str)] = &[
        (b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xff.", "declares"),
        (b"\x80\x04\x96\xff\xff\xff\xff\xff\xff\xff\xff.", "declares"),
        (b"\x80\x04X\xff\xff\xff\xff.", "declares"),
        (b"\x80\x04B\xff\xff\xff\xff.", "declares"),
        (b"\x80\x04\x8b\xff\xff\xff\x7f.", "declares"),
        (b"\x80\x04h\x00.", "memo slot 0"),
        (b"\x80\x04j\xff\xff\xff\xff.", "memo slot 4294967295"),
        (b"\x80\x04g18446744073709551615\n.", "memo slot"),
        (b"\x80\x04g99999999999999999999999\n.", "bad GET"),
        (b"\x80\x04.", "stack is empty"),
        (b"\x80\x04(.", "mark"),
        (b"\x80\x04N", "without its STOP"),
        (b"", "without its STOP"),
        (b"\x80\x06N.", "protocol 6"),
        (b"\x80\x04Ne.", "no mark"),
        (b"\x80\x04N(Ne.", "not a list"),
        (b"\x80\x04)(Ne.", "not a list"),
        (b"\x80\x04K\x01(K\x02K\x03u.", "not a dictionary"),
        (b"\x80\x04}(K\x02u.", "odd number"),
        (b"\x80\x04]NNs.", "not a dictionary"),
        (b"\x80\x04NNa.", "not a list"),
        (b"\x80\x04I12x\n.", "bad INT"),
        (b"\x80\x04Fnope\n.", "bad FLOAT"),
        (b"\x80\x04L12a\n.", "bad LONG"),
        (b"\x80\x04Sabc\n.", "without its quotes"),
        (b"\x80\x04V", "end of line"),
        (b"\x80\x04\xff.", "does not know"),
    ];
    for (b, want) in cases {
        let e = no_panic(&format!("{b:?}"), || err_of(b));
        assert!(e.contains(want), "{b:?}: {e} (wanted {want:?})");
    }
    // PUT of huge indices, then a GET of them: kept sparsely, read back.
    let b = P::new().raw(b"}").put(u32::MAX).raw(b"0").get(u32::MAX).stop();
    assert!(err_of(&b).contains("segments"), "{}", err_of(&b));
    // A memo slot set by text PUT at u64::MAX, then read by text GET.
    let b = P::new().raw(b"}p18446744073709551615\n0g18446744073709551615\n").stop();
    assert!(err_of(&b).contains("segments"), "{}", err_of(&b));
}

// Found by review (fixed): memo PUTs are dense while the index is below `memo.len() + 65536`; each PUT may move
// that bound by 65,536 more, so 64 PUTs of 5 bytes each (`r` + index, indices 65535 apart) grow
// the dense memo to 4 M slots (~64 MiB for a ~330-byte input); 65,536 PUTs (330 KB) reach
// u32::MAX slots (64 GiB). (pickle.rs `memo_put`: MEMO_DENSE_SLACK is relative to the dense
// length, not bounded by the input's size.)
#[test]
fn memo_puts_stepping_by_the_slack_do_not_explode_memory() {
    let mut p = P::new();
    p.raw(b"N");
    for k in 1..=64u32 {
        p.put(k * 65_535);
    }
    let b = p.stop();
    let (r, peak) = peak_of(|| parse(&b).map(|_| ()));
    assert!(r.is_err(), "not a dictionary");
    assert!(peak < 50 * b.len() + (1 << 20), "{} input bytes took {} MiB", b.len(), peak >> 20);
}

// Found by review (fixed): BUILD (`b`) with a dict target and a dict state copies the state's entries into the
// target; with the same dict as both (`h\x00 h\x00 b`, or just `h\x00 b` with it on the stack)
// every 3 bytes double it: 22 rounds (~75 input bytes) make 4 M entries (>128 MiB); 40 rounds
// would need terabytes. Memory is not linear in the input, contrary to pickle.rs's header
// (pickle.rs, the `b'b'` arm).
#[test]
fn build_of_a_dict_into_itself_does_not_double_memory() {
    let mut p = P::new();
    p.raw(b"}q\x00(K\x01K\x01u");
    for _ in 0..22 {
        p.raw(b"h\x00b");
    }
    let b = p.stop();
    let (r, peak) = peak_of(|| parse(&b).map(|v| v.segments.len()));
    assert!(r.is_err(), "no segments key");
    assert!(peak < 50 * b.len() + (1 << 20), "{} input bytes took {} MiB", b.len(), peak >> 20);
}

#[test]
fn marks_dups_and_memo_gets_stay_linear() {
    // 4 M marks then a list: the scan for the topmost mark is short each time.
    let mut b = b"\x80\x04".to_vec();
    b.extend(std::iter::repeat_n(b'(', 4_000_000));
    b.extend(std::iter::repeat_n(&b"Nl"[..], 1_000_000).flatten());
    b.push(b'.');
    let t = Instant::now();
    let (r, peak) = peak_of(|| parse(&b).map(|_| ()));
    assert!(r.is_err());
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(peak < 50 * b.len(), "marks: {} MiB for {} MiB", peak >> 20, b.len() >> 20);

    // Alternating marks and values then one giant tuple: 'pop_mark' rposition is O(distance).
    let mut b = b"\x80\x04".to_vec();
    for _ in 0..1_000_000 {
        b.extend_from_slice(b"(N1");
    }
    b.extend_from_slice(b"N.");
    let t = Instant::now();
    let r = parse(&b);
    assert!(r.is_err());
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());

    // A DUP bomb: 8 MB of `2`.
    let mut b = b"\x80\x04N".to_vec();
    b.extend(std::iter::repeat_n(b'2', 8_000_000));
    b.push(b'.');
    let t = Instant::now();
    let (r, peak) = peak_of(|| parse(&b).map(|_| ()));
    assert!(r.is_err());
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(peak < 50 * b.len(), "dups: {} MiB for {} MiB", peak >> 20, b.len() >> 20);

    // DUPs into a tuple, then memo GETs of a big list: values are indices, not copies.
    let mut b = b"\x80\x04(".to_vec();
    b.extend(std::iter::repeat_n(b'N', 1_000_000));
    b.extend_from_slice(b"lq\x00");
    for _ in 0..1_000_000 {
        b.extend_from_slice(b"h\x00");
    }
    b.extend_from_slice(b".");
    let (r, peak) = peak_of(|| parse(&b).map(|_| ()));
    assert!(r.is_err());
    assert!(peak < 50 * b.len(), "gets: {} MiB for {} MiB", peak >> 20, b.len() >> 20);
}

#[test]
fn text_opcodes_longs_and_floats() {
    // Protocol 0: a dict built with text opcodes, NaN/inf floats and huge LONGs as figures.
    let b = b"(dp0\nVsegments\np1\n(lp2\n(dp3\nVtotal_size\np4\nFnan\nsVdevice\np5\nL123456789012345678901234567890L\nsVaddress\nFinf\nsVstream\nI-5\nsVblocks\n(lsas.";
    let v = no_panic("protocol 0", || parse(b)).unwrap();
    assert_eq!(v.segments.len(), 1);
    let s = &v.segments[0];
    assert_eq!((s.total_size, s.device, s.address, s.stream), (0, 0, 0, 0));
    // BINFLOAT NaN / -inf / negative as sizes and times: read as 0.
    let nan = f64::NAN.to_be_bytes();
    let mut p = P::new();
    p.raw(b"}").mark().s("segments").raw(b"]").s("device_traces").raw(b"]").mark().raw(b"]").mark();
    p.raw(b"}").mark().s("action").s("alloc").s("size").raw(b"G").raw(&nan).s("time_us").raw(b"G");
    p.raw(&(-1.0f64).to_be_bytes()).s("addr").raw(b"G").raw(&f64::NEG_INFINITY.to_be_bytes()).raw(b"u");
    p.raw(b"e").raw(b"e").raw(b"u");
    let b = p.stop();
    let v = parse(&b).unwrap();
    assert_eq!(v.events.len(), 1);
    assert_eq!((v.events[0].size, v.events[0].time_us, v.events[0].addr), (0, 0, 0));
    // LONG1 of 0 bytes is 0; LONG4 beyond 64 bits is opaque.
    let v = parse(b"\x80\x04}(\x8c\x08segments](}(\x8c\x0atotal_size\x8a\x00\x8c\x06device\x8b\x10\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7fueu.").unwrap();
    assert_eq!((v.segments[0].total_size, v.segments[0].device), (0, 0));
}

#[test]
fn every_prefix_and_byte_flip_of_a_real_snapshot_is_an_error_or_a_view() {
    mempool::record_history(1000);
    let a = mempool::Allocator::sim(mempool::sim::SimDevice::new(1 << 30));
    let x = a.alloc::<u8>(1 << 20).unwrap();
    let y = a.alloc::<u8>(4096).unwrap();
    drop(y);
    let b = a.snapshot().to_pickle();
    drop(x);
    let t = Instant::now();
    for n in 0..b.len() {
        let _ = no_panic(&format!("prefix {n}"), || parse(&b[..n]).map(|_| ()));
    }
    let mut c = b.clone();
    for i in 0..b.len() {
        for v in [0x00u8, 0xff, 0x80, b'(', b'.', b'S', b'b', b'2'] {
            c[i] = v;
            let _ = no_panic(&format!("byte {i} = {v:#x}"), || parse(&c).map(|v| (v.summary(), v.timeline())));
        }
        c[i] = b[i];
    }
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
}

// =============================================================================================
// 2. The view: figures, hostile numbers, cost.

fn seg(device: u64, address: u64, total: u64, pool: u64, blocks: Vec<Block>) -> Segment {
    Segment { device, address, stream: 0, pool, total_size: total, is_expandable: false, blocks }
}

fn blk(address: u64, size: u64, state: &str) -> Block {
    Block { address, size, requested_size: size, state: state.into(), stack: 0 }
}

fn ev(device: u64, action: Action, addr: u64, size: u64, time_us: u64) -> Event {
    Event { device, action, addr, size, stream: 0, pool: 0, time_us, stack: 0 }
}

// Found by review (fixed): segment sizes from the file are summed with `+=` on u64 (`summary`: reserved, free,
// allocated; `top_sites`: bytes): three segments of 2^63-1 bytes overflow, a panic in debug builds
// and a wrong (wrapped) total in release. lib.rs `summary`.
#[test]
fn summary_of_huge_sizes_does_not_overflow() {
    let b = snapshot_pickle(
        |p| {
            for i in 0..3u64 {
                p.raw(b"}")
                    .mark()
                    .s("address")
                    .u(i << 20)
                    .s("total_size")
                    .u(i64::MAX as u64)
                    .s("blocks")
                    .raw(b"]")
                    .mark();
                p.raw(b"}").mark().s("size").u(i64::MAX as u64).s("state").s("active_allocated").raw(b"u");
                p.raw(b"e").raw(b"u");
            }
        },
        |_| {},
        true,
    );
    let v = parse(&b).unwrap();
    let s = no_panic("summary", || v.summary());
    assert!(s[0].reserved >= i64::MAX as u64, "reserved wrapped to {}", s[0].reserved);
}

// Found by review (fixed): `attribute_pools` (PyTorch snapshots) computes `s.address + s.total_size` unchecked: a
// segment near the top of the address space (figures may be floats: `uint` saturates them to
// u64) panics `from_pickle` in debug builds (and wraps to
// an empty range in release). lib.rs `attribute_pools`.
#[test]
fn attribute_pools_with_a_segment_at_the_top_of_the_address_space() {
    let b = snapshot_pickle(
        |p| {
            p.raw(b"}").mark().s("address").f(1.8e19).s("total_size").f(1e18);
            p.s("segment_pool_id").raw(b"K\x00K\x07\x86").s("blocks").raw(b"]").raw(b"u");
        },
        |p| {
            p.raw(b"]").mark();
            p.raw(b"}").mark().s("action").s("alloc").s("addr").f(1.81e19).s("size").u(1).raw(b"u");
            p.raw(b"e");
        },
        false,
    );
    let v = no_panic("from_pickle", || parse(&b)).unwrap();
    assert_eq!(v.events[0].pool, 7, "the event lies inside pool 7's segment");
}

// Found by review (fixed): `Pickle::get` scans a dictionary's entries linearly; PyTorch-style sharing lets 100,000
// trace entries all be the *same* dictionary (one memo GET each, 2 bytes) holding 100,000 junk
// entries (2 bytes each): `from_pickle` then does ~9 scans of 100,000 entries per event,
// ~10^11 steps, for a 400 KB file (measured: 10,000 entries, a 40 KB file, take 8.5 s in a
// debug build; `SHARED_N` sets the count). lib.rs `from_pickle` / pickle.rs `get` (no per-object cache
// of the keys it needs, no bound on the work per shared object).
#[test]
fn a_shared_dictionary_with_many_entries_is_read_in_linear_time() {
    let n: usize = std::env::var("SHARED_N").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let b = snapshot_pickle(
        |_| {},
        |p| {
            p.raw(b"]").mark();
            p.raw(b"}").mark().s("action").s("alloc");
            for _ in 0..n {
                p.raw(b"NN");
            }
            p.raw(b"u").put(0);
            for _ in 1..n {
                p.get(0);
            }
            p.raw(b"e");
        },
        true,
    );
    assert!(b.len() < 1 << 20);
    let r = within(10, move || parse(&b).map(|v| v.events.len()));
    assert_eq!(r.map(|r| r.unwrap()), Some(n), "not read within 10 s");
}

// Found by review (fixed): the timeline keeps one `Vec<u64>` of *all* pools per point and finds a pool by a linear
// `position`: a trace whose events name distinct pools (mempool's `pool_id`) costs
// events × pools in time and memory: 5,000 events (~130 KB) take ~200 MiB, 50,000 (~1.3 MB)
// would take 20 GB. lib.rs `timeline` (and `html::page`, whose `a` array is pools × points).
#[test]
fn timeline_of_many_pools_is_not_quadratic_in_memory() {
    let n = 5_000u32;
    let b = snapshot_pickle(
        |_| {},
        |p| {
            p.raw(b"]").mark();
            p.s("alloc").put(0).raw(b"0").s("pool_id").put(1).raw(b"0").s("size").put(2).raw(b"0");
            for i in 0..n {
                p.raw(b"}").mark().s("action").get(0).get(1).u(i as u64 + 1).get(2).raw(b"K\x01u");
            }
            p.raw(b"e");
        },
        true,
    );
    let v = parse(&b).unwrap();
    assert_eq!(v.events.len(), n as usize);
    let (tl, peak) = peak_of(|| v.timeline());
    // At most 16 bands: the 15 heaviest pools, and the rest as one.
    assert_eq!(tl.pools.len(), mempool_viz::MAX_POOLS);
    assert_eq!(tl.pools.last(), Some(&mempool_viz::OTHER_POOLS));
    assert!(peak < 50 * b.len() + (8 << 20), "{} KB input: timeline took {} MiB", b.len() >> 10, peak >> 20);
}

#[test]
fn window_starts_with_the_value_in_use_and_handles_odd_ranges() {
    let tl = Timeline {
        pools: vec![0],
        points: vec![
            (0.0, vec![10], 100),
            (1.0, vec![20], 100),
            (1.0, vec![25], 200), // equal timestamps: the later one is in use after 1.0
            (2.0, vec![30], 200),
            (4.0, vec![5], 50),
        ],
    };
    let w = tl.window(Some(1.5), Some(3.0));
    assert_eq!(w.points[0], (1.5, vec![25], 200));
    assert_eq!(w.points[1], (2.0, vec![30], 200));
    let w = tl.window(Some(1.0), None);
    assert_eq!(w.points[0].0, 1.0);
    assert_eq!(w.points.iter().rfind(|p| p.0 == 1.0).unwrap().1, vec![25]);
    // Beyond the end: the last value, at `from`.
    let w = tl.window(Some(10.0), None);
    assert_eq!(w.points, vec![(10.0, vec![5], 50)]);
    // Before the start: nothing to carry.
    let w = tl.window(None, Some(-1.0));
    assert!(w.points.is_empty());
    // NaN / inf / reversed: no panic.
    for (f, t) in [(Some(f64::NAN), None), (None, Some(f64::NAN)), (Some(f64::INFINITY), None), (Some(3.0), Some(1.0))]
    {
        let _ = no_panic("window", || tl.window(f, t).downsample(2));
    }
}

// Found by review (fixed; minor): the window ends at the last point at or before `to`, not at `to`: with events at
// 0 and 100 ms, `--from 10 --to 50` yields one point at 10 ms, so the chart's range is 10 to
// 10.001 ms instead of 10 to 50 (and the page's zoom range likewise): the state known to hold
// until 50 ms is not drawn. lib.rs `Timeline::window` (no closing point at `to`).
#[test]
fn window_reaches_its_to() {
    let tl = Timeline { pools: vec![0], points: vec![(0.0, vec![10], 100), (100.0, vec![20], 100)] };
    let w = tl.window(Some(10.0), Some(50.0));
    assert_eq!(w.points.last().map(|p| p.0), Some(50.0), "{:?}", w.points);
}

#[test]
fn downsample_keeps_the_peaks_of_the_total_and_reserved() {
    let mut points = Vec::new();
    let mut x = 1u64;
    for i in 0..100_000u64 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let a = (x >> 40) % 1000;
        let r = (x >> 20) % 1000;
        points.push((i as f64 * 0.001, vec![a, 1000 - a / 2], r));
    }
    points[77_777].1 = vec![5000, 5000];
    points[33_333].2 = 9999;
    let tl = Timeline { pools: vec![0, 1], points };
    let d = tl.downsample(100);
    assert!(d.points.len() <= (4 + 2) * 100, "{}", d.points.len());
    let max_total = |t: &Timeline| t.points.iter().map(|p| p.1.iter().sum::<u64>()).max().unwrap();
    assert_eq!(max_total(&d), max_total(&tl));
    assert_eq!(d.points.iter().map(|p| p.2).max(), Some(9999));
    assert!(d.points.windows(2).all(|w| w[0].0 <= w[1].0), "time order");
    assert_eq!(d.points.first(), tl.points.first());
    assert_eq!(d.points.last(), tl.points.last());
    // All points at one time, and NaN times: no hang.
    let flat = Timeline { pools: vec![0], points: (0..1000).map(|i| (1.0, vec![i], i)).collect() };
    assert_eq!(flat.downsample(10).points.iter().map(|p| p.2).max(), Some(999));
    let nan = Timeline { pools: vec![0], points: (0..1000).map(|i| (f64::NAN, vec![i], i)).collect() };
    assert!(within(5, move || nan.downsample(10).points.len()).is_some());
    let _ = no_panic("downsample(0)", || flat_of(1000).downsample(0));
}

fn flat_of(n: u64) -> Timeline {
    Timeline { pools: vec![0], points: (0..n).map(|i| (i as f64, vec![i], i)).collect() }
}

// Found by review (fixed; minor): `downsample` keeps per bucket the point of most *total* allocated, so a pool's
// own peak is dropped when another pool is higher at another point of the bucket: the stacked
// chart and the page's hover then never show that pool's peak (pool 0 reached 900 here; the
// downsampled timeline never shows more than 1). lib.rs `Timeline::downsample`.
#[test]
fn downsample_keeps_each_pools_peak() {
    let mut points: Vec<(f64, Vec<u64>, u64)> = (0..1000).map(|i| (i as f64, vec![1, 1], 10)).collect();
    points[501] = (501.0, vec![900, 0], 10); // pool 0's peak (total 900)
    points[502] = (502.0, vec![0, 1000], 10); // the total's peak
    let tl = Timeline { pools: vec![0, 1], points };
    let d = tl.downsample(10);
    let peak0 = d.points.iter().map(|p| p.1[0]).max().unwrap();
    assert_eq!(peak0, 900, "pool 0's peak lost");
}

// Found by review (fixed; minor): `downsample(usize::MAX)` computes `4 * buckets` unchecked: overflow panic in debug.
#[test]
fn downsample_with_a_huge_bucket_count() {
    let _ = no_panic("downsample(usize::MAX)", || flat_of(10).downsample(usize::MAX));
}

#[test]
fn timeline_merges_unsorted_devices_and_ends_at_the_snapshot() {
    let mut v = SnapshotView {
        segments: vec![seg(
            0,
            0x1000,
            1000,
            0,
            vec![blk(0x1000, 300, "active_allocated"), blk(0x112c, 700, "inactive")],
        )],
        ..SnapshotView::default()
    };
    v.segments.push(seg(1, 0x1000, 500, 0, vec![blk(0x1000, 500, "inactive")]));
    // Device 0's trace then device 1's, interleaved in time; equal timestamps keep their order.
    v.events = vec![
        ev(0, Action::SegmentAlloc, 0x1000, 1000, 100),
        ev(0, Action::Alloc, 0x1000, 300, 300),
        ev(0, Action::Alloc, 0x2000, 50, 300),
        ev(0, Action::FreeCompleted, 0x2000, 50, 300),
        ev(1, Action::SegmentAlloc, 0x1000, 500, 50),
        ev(1, Action::Alloc, 0x1000, 200, 200),
        ev(1, Action::FreeCompleted, 0x1000, 200, 400),
    ];
    let tl = v.timeline();
    assert!(tl.points.windows(2).all(|w| w[0].0 <= w[1].0));
    let last = tl.points.last().unwrap();
    assert_eq!((last.1.iter().sum::<u64>(), last.2), (300, 1500));
    let first = &tl.points[0];
    assert_eq!((first.1[0], first.2), (0, 0));
    let max_alloc = tl.points.iter().map(|p| p.1[0]).max().unwrap();
    assert_eq!(max_alloc, 550, "200 on device 1, then 300 + 50 on device 0");
    // Per device.
    assert_eq!(v.on_device(1).timeline().points.last().unwrap().2, 500);
    assert_eq!(v.devices(), vec![0, 1]);
    // Empty view: one point, nothing breaks.
    let e = SnapshotView::default();
    assert_eq!(e.timeline().points.len(), 1);
    assert!(e.summary().is_empty() && e.top_sites(5).is_empty());
    assert!(e.site(0).is_none() && e.site(u32::MAX).is_none());
    let dir = std::env::temp_dir().join(format!("viz-attacks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    mempool_viz::render_timeline(&e, dir.join("e.svg")).unwrap();
    mempool_viz::render_timeline_of(&e, &e.timeline().window(Some(5.0), Some(1.0)), dir.join("w.svg")).unwrap();
    mempool_viz::render_timeline_of(&e, &Timeline::default(), dir.join("d.svg")).unwrap();
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn top_sites_and_site() {
    let mut v = SnapshotView {
        frames: vec![
            Frame { name: "std::alloc".into(), filename: "/rustc/x/alloc.rs".into(), line: 5 },
            Frame { name: "user".into(), filename: "/src/main.rs".into(), line: 9 },
            Frame { name: "other".into(), filename: "??".into(), line: 0 },
        ],
        ..SnapshotView::default()
    };
    v.stacks.push(vec![0, 1]);
    v.stacks.push(vec![2]);
    v.stacks.push(vec![99]); // a frame index out of range
    assert_eq!(v.site(1).unwrap().name, "user");
    assert_eq!(v.site(2).unwrap().name, "other");
    assert!(v.site(3).is_none());
    v.segments = vec![seg(
        0,
        0,
        100,
        3,
        vec![
            Block { stack: 1, ..blk(0, 10, "active_allocated") },
            Block { stack: 1, ..blk(10, 20, "active_allocated") },
            Block { stack: 2, ..blk(30, 40, "active_allocated") },
            Block { stack: 3, ..blk(70, 5, "active_allocated") },
            Block { stack: 1, ..blk(75, 25, "inactive") },
        ],
    )];
    let s = v.top_sites(10);
    assert_eq!(s.len(), 3);
    assert_eq!((s[0].bytes, s[0].blocks), (40, 1));
    assert_eq!((s[1].bytes, s[1].blocks, s[1].site.as_str()), (30, 2, "user (/src/main.rs:9)"));
    assert_eq!(s[2].site, "(no frames)");
    assert_eq!(v.top_sites(1).len(), 1);
    assert!(v.top_sites(0).is_empty());
    // From the trace when blocks have no stacks: freed ones gone, per device.
    for b in &mut v.segments[0].blocks {
        b.stack = 0;
    }
    v.events = vec![
        Event { stack: 1, ..ev(0, Action::Alloc, 0x10, 100, 1) },
        Event { stack: 1, ..ev(1, Action::Alloc, 0x10, 50, 2) },
        Event { stack: 2, ..ev(0, Action::Alloc, 0x20, 7, 3) },
        ev(0, Action::FreeCompleted, 0x20, 7, 4),
    ];
    let s = v.top_sites(10);
    assert_eq!(s.len(), 1);
    assert_eq!((s[0].bytes, s[0].blocks), (150, 2));
}

// =============================================================================================
// 3. The CLI.

fn cli(args: &[&str], secs: u64) -> Option<std::process::Output> {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mempool-viz"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        if c.try_wait().unwrap().is_some() {
            return Some(c.wait_with_output().unwrap());
        }
        if t.elapsed() > Duration::from_secs(secs) {
            c.kill().ok();
            c.wait().ok();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("viz-attacks-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn cli_arguments() {
    let snap = tmp("s.pickle");
    let b = snapshot_pickle(
        |p| {
            p.raw(b"}").mark().s("address").u(0x1000).s("total_size").u(1000).s("blocks").raw(b"]").raw(b"u");
        },
        |p| {
            p.raw(b"]").mark();
            p.raw(b"}").mark().s("action").s("segment_alloc").s("addr").u(0x1000).s("size").u(1000);
            p.s("time_us").u(1000).raw(b"u");
            p.raw(b"e");
        },
        true,
    );
    std::fs::write(&snap, &b).unwrap();
    let svg = tmp("o.svg");
    let html = tmp("o.html");
    let s = snap.to_str().unwrap();
    let (o, h) = (svg.to_str().unwrap(), html.to_str().unwrap());
    for bad in [
        vec![s, "--from", "NaN"],
        vec![s, "--from", "inf"],
        vec![s, "--to", "-1"],
        vec![s, "--from", "5", "--to", "1"],
        vec![s, "--sites", "-1"],
        vec![s, "--sites"],
        vec![s, "-o"],
        vec![s, "--html"],
        vec![s, s],
        vec![],
        vec!["--from", "1"],
        vec![s, "--frm", "1"],
    ] {
        let out = cli(&bad, 20).expect("exits");
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("usage"), "{bad:?}");
    }
    // Out-of-range times, equal from/to, huge --sites: accepted, files written.
    for good in [
        vec![s, "-o", o, "--html", h, "--from", "1e300", "--to", "1e301"],
        vec![s, "-o", o, "--html", h, "--from", "0", "--to", "0"],
        vec![s, "-o", o, "--sites", "18446744073709551615"],
        vec![s, "-o", o, "--from", "-0"],
    ] {
        let out = cli(&good, 60).expect("exits");
        assert!(out.status.success(), "{good:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(std::fs::metadata(&svg).unwrap().len() > 1000);
    }
    // Not a snapshot / missing / a directory: a failure, not a panic.
    let junk = tmp("junk");
    std::fs::write(&junk, b"\x80\x04junk").unwrap();
    for bad in [junk.to_str().unwrap(), "/nonexistent/x.pickle", "/tmp"] {
        let out = cli(&[bad, "-o", o], 20).expect("exits");
        assert_eq!(out.status.code(), Some(1), "{bad}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"), "{bad}");
    }
    // Unwritable outputs: a failure naming the file.
    let out = cli(&[s, "-o", "/nonexistent/dir/x.svg"], 20).unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let out = cli(&[s, "--html", "/nonexistent/dir/x.html"], 20).unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
}

// Found by review (fixed): the `S` opcode panic (see `string_opcode_with_a_multibyte_tail_does_not_panic`) reaches
// the CLI: a 9-byte file makes `mempool-viz` panic (exit 101) instead of reporting it.
#[test]
fn cli_on_a_hostile_pickle_reports_an_error() {
    let junk = tmp("junk-s.pickle");
    std::fs::write(&junk, b"\x80\x04S'\xc3\xa9\n.").unwrap();
    let out = cli(&[junk.to_str().unwrap(), "-o", tmp("junk.svg").to_str().unwrap()], 20).expect("exits");
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
}

// Found by review (fixed): the CLI prints a summary per device via `on_device(d)`, each of which filters every
// segment and event and clones all frames and stacks: devices × (events + segments + frames).
// `device_traces` of 50,000 one-entry lists (4 bytes each via the memo) make 50,000 devices:
// ~2.5·10^9 steps for a 300 KB file. src/bin/mempool-viz.rs (`for d in &devices`) and
// lib.rs `on_device`.
#[test]
fn cli_with_many_devices_finishes() {
    let n = 50_000u32;
    let b = snapshot_pickle(
        |_| {},
        |p| {
            p.raw(b"}").mark().s("action").s("alloc").s("size").u(1).raw(b"u").put(0).raw(b"0");
            for _ in 0..n {
                p.mark().get(0).raw(b"l");
            }
        },
        true,
    );
    let snap = tmp("many-devices.pickle");
    std::fs::write(&snap, &b).unwrap();
    let v = parse(&b).unwrap();
    assert_eq!(v.devices().len(), n as usize);
    let svg = tmp("many-devices.svg");
    let t = Instant::now();
    let out = cli(&[snap.to_str().unwrap(), "-o", svg.to_str().unwrap(), "--sites", "0"], 20);
    assert!(out.is_some(), "{} KB snapshot: not done after {:?}", b.len() >> 10, t.elapsed());
}

// =============================================================================================
// 4. The page.

const HOSTILE: &[&str] = &[
    "</script><script>window.__pwned=1</script>",
    "</SCRIPT ><img src=x onerror=window.__pwned=2>",
    "<!--<script>",
    "line\u{2028}sep\u{2029}para",
    "quote\" back\\slash \\u003c \\\" '",
    "ctl \u{0} \u{1} \u{1b}[31m \u{7f} \u{85} \u{feff}",
    "]]></script><![CDATA[",
    "😀 \u{10ffff}",
    "${alert(1)}`",
];

fn hostile_view() -> SnapshotView {
    let mut v = SnapshotView::default();
    let mut blocks = Vec::new();
    for (i, s) in HOSTILE.iter().enumerate() {
        v.frames.push(Frame { name: s.to_string(), filename: format!("/src/{s}.rs"), line: i as u64 + 1 });
        v.stacks.push(vec![i as u32]);
        blocks.push(Block { stack: i as u32 + 1, ..blk(0x10000 + i as u64 * 0x100, 0x100, "active_allocated") });
    }
    v.segments.push(seg(0, 0x10000, 0x1000, 0, blocks));
    v.events = (0..HOSTILE.len() as u64)
        .map(|i| Event { stack: i as u32 + 1, ..ev(0, Action::Alloc, 0x10000 + i * 0x100, 0x100, i) })
        .collect();
    v
}

#[test]
fn hostile_strings_stay_inside_the_json() {
    let v = hostile_view();
    let html = mempool_viz::html::page(&v, None, None);
    let start = html.find("id=\"snapshot-data\">").unwrap() + "id=\"snapshot-data\">".len();
    let end = start + html[start..].find("</script>").unwrap();
    let data = &html[start..end];
    let lower = data.to_ascii_lowercase();
    assert!(!lower.contains("</script") && !lower.contains("<!--") && !lower.contains("<script"));
    assert!(!data.contains('\u{2028}') && !data.contains('\u{2029}'));
    assert!(!data.chars().any(|c| (c as u32) < 0x20), "raw control characters in the JSON");
    assert_eq!(html.to_ascii_lowercase().matches("</script").count(), 2);
    // The page loads nothing (outside the escaped data).
    let html = format!("{}{}", &html[..start], &html[end..]);
    for needle in ["src=", "href=", "https://", "@import", "url(", "fetch(", "XMLHttpRequest", "import("] {
        assert!(!html.contains(needle), "{needle}");
    }
    // Also with odd windows.
    for (f, t) in [(Some(f64::NAN), None), (Some(1e300), Some(f64::INFINITY)), (Some(5.0), Some(1.0))] {
        let h = no_panic("page", || mempool_viz::html::page(&v, f, t));
        assert!(h.contains("\"t\":["));
    }
}

/// Loads the page in headless Chromium; returns what the script reports (JSON line), or None
/// when the browser part is not installed.
fn in_browser(page: &std::path::Path, script: &str) -> Option<String> {
    let dir = env!("CARGO_MANIFEST_DIR");
    let driver = format!("{dir}/tests/browser/node_modules");
    if !std::path::Path::new("/usr/bin/chromium").exists() || !std::path::Path::new(&driver).exists() {
        eprintln!("skipped: no chromium or playwright");
        return None;
    }
    let js = format!(
        r#"const {{ chromium }} = require("playwright-core");
(async () => {{
  const browser = await chromium.launch({{ executablePath: "/usr/bin/chromium", args: ["--no-sandbox", "--disable-gpu"] }});
  const page = await browser.newPage();
  const requests = [], errors = [];
  page.on("request", (r) => {{ if (!r.url().startsWith("file://")) requests.push(r.url()); }});
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto("file://{}");
  await page.waitForSelector("body[data-ready='1']", {{ timeout: 20000 }});
  const out = await page.evaluate(() => {{ {script} }});
  await browser.close();
  console.log(JSON.stringify({{ requests, errors, out }}));
}})().catch((e) => {{ console.error(String(e)); process.exit(1); }});"#,
        page.display()
    );
    let out = Command::new("node").arg("-e").arg(js).env("NODE_PATH", &driver).output().expect("node");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn hostile_strings_in_headless_chromium() {
    let v = hostile_view();
    let page = tmp("hostile.html");
    mempool_viz::html::write_page(&v, None, None, &page).unwrap();
    let script = r##"
      const D = JSON.parse(document.getElementById("snapshot-data").textContent);
      const rects = Array.from(document.querySelectorAll("#segment-view rect.block"));
      const tips = rects.map((r) => { r.dispatchEvent(new MouseEvent("mousemove", { clientX: 5, clientY: 5, bubbles: true }));
                                        return document.getElementById("tooltip").textContent; });
      return { pwned: window.__pwned || 0, names: D.frames.map((f) => f[0]), files: D.frames.map((f) => f[1]),
               scripts: document.scripts.length, imgs: document.images.length, tips,
               sites: Array.from(document.querySelectorAll("#sites td")).map((t) => t.textContent) };
    "##;
    let Some(out) = in_browser(&page, script) else { return };
    assert!(out.contains("\"requests\":[]") && out.contains("\"errors\":[]"), "{out}");
    assert!(out.contains("\"pwned\":0") && out.contains("\"scripts\":2") && out.contains("\"imgs\":0"), "{out}");
    // Each hostile name came through intact (as JSON from node's stringify).
    for s in HOSTILE {
        let mut want = String::new();
        for c in s.chars() {
            match c {
                '"' => want.push_str("\\\""),
                '\\' => want.push_str("\\\\"),
                c if (c as u32) < 0x20 => want.push_str(&format!("\\u{:04x}", c as u32)),
                c => want.push(c),
            }
        }
        assert!(out.contains(&want), "{s:?} not intact in {out}");
    }
}
