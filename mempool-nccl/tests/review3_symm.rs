//! Third hostile review: symmetric memory after commit f760b91 (the one-shot of data up to
//! `PUSH_MAX` pushes into receive slots, with no barrier). Its two high findings came from the
//! slot set being chosen by a host-side count of calls: a one-shot captured in a CUDA graph kept
//! the set of its capture at every replay, and two threads of one rank could launch with the
//! same set. The set now comes from a count of calls per block that the kernel keeps in the
//! rank's own pad; these tests check that graph replays (beside eager calls, and on every rank
//! under time slicing) and two threads of one rank on one stream stay in step.
//!
//! Two kinds of tests:
//! - `cpu_*` and `model_*` run on any machine. `model_*` check the slot protocol itself (the
//!   argument above `KERNELS_PTX` for why two sets suffice) on a small exhaustive model of it:
//!   every interleaving of two ranks' pushes, takes and emptying stores. They show the protocol
//!   is sound when each rank's calls alternate the sets in the order they run, and which
//!   interleavings lose when they do not (why the count of calls lives on the device).
//! - everything else needs two CUDA GPUs with NCCL (`#[ignore]`; run with
//!   `cargo test -p mempool-nccl --test review3_symm -- --ignored --test-threads=1`).
//!
//! As in the earlier reviews, `finding_*` tests assert what a user relies on (they failed while
//! the bug was there); `held_*` ones check what should hold. Bodies that may leave a kernel
//! spinning forever run in a child process of this binary (`child_*`, which does nothing
//! unless `MEMPOOL_NCCL_PROBE_CHILD` is set, by `common::in_child`) that the parent kills at its
//! deadline. Multicast is never created here; NCCL_NVLS_ENABLE is left alone.
//!
//! (The review's finding 3, an `out` whose `DeviceSlice::len` overstates its memory, is the
//! contract of cudarc's traits, which this crate trusts as cudarc's own copies do: documented on
//! `one_shot_all_reduce`, not tested.)

mod common;
use common::{all_ok, child_passes, fill, in_child, is_child, on_two_gpus, receive_slot_bytes_in_use, two_gpus};

use std::collections::HashSet;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaStream};
use mempool_nccl::symm::{symm_empty, SymmMemory, PUSH_MAX};
use mempool_nccl::Error;

// =============================================================================================
// CPU: what makes the GPU findings reachable from safe code
// =============================================================================================

/// The threshold is a multiple of the 128-byte rounding of `data_bytes`, so "at most PUSH_MAX
/// bytes asked for" and "at most PUSH_MAX bytes rounded" are the same test (`receive_bytes`
/// compares the rounded size).
#[test]
fn cpu_push_max_is_a_multiple_of_the_data_rounding() {
    assert_eq!(PUSH_MAX % 128, 0);
    assert_eq!(PUSH_MAX % 16, 0);
}

// =============================================================================================
// CPU: an exhaustive model of the slot protocol (two ranks, one 16-byte vector each)
// =============================================================================================

/// One rank's kernel for a call, as the PTX does it for one vector: push (one store into slot
/// `rank` of the peer's set), take (a load that waits until the slot is full), empty (a store
/// of the mark). The three are separate steps; the peer's push may land between any two.
mod model {
    use super::HashSet;

    #[derive(Clone, PartialEq, Eq, Hash, Debug)]
    pub(super) struct State {
        /// Per rank: (call, phase) — phase 0 push, 1 take, 2 empty.
        pc: [(usize, u8); 2],
        /// Per rank, per set: the call whose data the peer left in this rank's slot, if any.
        slots: [[Option<usize>; 2]; 2],
        /// Per rank: the peer's call whose data each call took.
        got: [Vec<usize>; 2],
    }

    pub(super) enum End {
        /// Every call finished and summed its peer's data of the same call.
        Right,
        /// Every call finished, some with another call's data (the sums of the wrong inputs).
        Wrong(Vec<String>),
        /// No step can run: every rank left waits for data that will never come.
        Deadlock(Vec<String>),
    }

    /// Every end state reachable from the start, each with one trace that reaches it.
    pub(super) fn explore(parities: [&[u8]; 2]) -> Vec<End> {
        let start = State { pc: [(0, 0), (0, 0)], slots: [[None; 2]; 2], got: [Vec::new(), Vec::new()] };
        let mut seen = HashSet::new();
        let mut ends = Vec::new();
        let mut trace = Vec::new();
        walk(&start, parities, &mut seen, &mut ends, &mut trace);
        ends
    }

    fn walk(s: &State, par: [&[u8]; 2], seen: &mut HashSet<State>, ends: &mut Vec<End>, trace: &mut Vec<String>) {
        if !seen.insert(s.clone()) {
            return;
        }
        let mut moved = false;
        for r in 0..2 {
            let (call, phase) = s.pc[r];
            if call == par[r].len() {
                continue;
            }
            let set = par[r][call] as usize;
            let peer = 1 - r;
            let mut n = s.clone();
            let what = match phase {
                0 => {
                    n.slots[peer][set] = Some(call);
                    n.pc[r].1 = 1;
                    format!("rank {r} call {call}: pushes into rank {peer}'s set {set}")
                }
                1 => match s.slots[r][set] {
                    None => continue,
                    Some(c) => {
                        n.got[r].push(c);
                        n.pc[r].1 = 2;
                        format!("rank {r} call {call}: takes rank {peer}'s call {c} from its set {set}")
                    }
                },
                _ => {
                    n.slots[r][set] = None;
                    n.pc[r] = (call + 1, 0);
                    format!("rank {r} call {call}: empties its set {set}")
                }
            };
            moved = true;
            trace.push(what);
            walk(&n, par, seen, ends, trace);
            trace.pop();
        }
        if !moved {
            let done = (0..2).all(|r| s.pc[r].0 == par[r].len());
            ends.push(if !done {
                End::Deadlock(trace.clone())
            } else if (0..2).all(|r| s.got[r].iter().enumerate().all(|(k, &c)| c == k)) {
                End::Right
            } else {
                End::Wrong(trace.clone())
            });
        }
    }
}

/// Held (the commit's argument): when each rank's calls alternate the two sets in stream order
/// (one call after the other), every interleaving of pushes, takes and emptying stores ends with
/// every call done and every call summing the peer's data of the same call.
#[test]
fn model_alternating_sets_are_right_in_every_interleaving() {
    let p: &[u8] = &[0, 1, 0, 1, 0, 1];
    let ends = model::explore([p, p]);
    assert!(!ends.is_empty());
    for e in &ends {
        match e {
            model::End::Right => {}
            model::End::Wrong(t) => panic!("wrong data:\n{}", t.join("\n")),
            model::End::Deadlock(t) => panic!("deadlock:\n{}", t.join("\n")),
        }
    }
}

/// Why finding 1 (a graph replayed) breaks: two consecutive calls of one rank on the same set
/// (what every replay of a captured call is: its set is a kernel parameter fixed at capture).
/// Some interleavings end right, but some have the peer's next push land between this rank's
/// take and its emptying store (the store then erases it, and the last call waits forever) or
/// before the take (this rank sums the peer's next call's data). The schedule is printed.
#[test]
fn model_one_set_twice_in_a_row_loses_in_some_interleaving() {
    let p: &[u8] = &[0, 0, 0];
    let ends = model::explore([p, p]);
    let right = ends.iter().filter(|e| matches!(e, model::End::Right)).count();
    let bad: Vec<&Vec<String>> = ends
        .iter()
        .filter_map(|e| match e {
            model::End::Wrong(t) | model::End::Deadlock(t) => Some(t),
            model::End::Right => None,
        })
        .collect();
    assert!(right > 0, "some interleavings are right (why it passes most runs)");
    assert!(!bad.is_empty(), "expected a losing interleaving");
    eprintln!("{} right, {} losing end states; one losing schedule:\n{}", right, bad.len(), bad[0].join("\n"));
}

/// Why findings 1 and 2 hang for sure: once one rank's sets are one call off from the peer's
/// (its count read twice alike by two threads; a replayed graph beside eager calls), no
/// interleaving finishes.
#[test]
fn model_sets_off_by_one_deadlock_in_every_interleaving() {
    // Finding 2: rank 0's two threads both read count 0; rank 1 alternates.
    let ends = model::explore([&[0, 0], &[0, 1]]);
    assert!(ends.iter().all(|e| matches!(e, model::End::Deadlock(_))));
    // Finding 1: rank 0 replays a graph captured at count 1; rank 1 calls eagerly from count 1.
    let ends = model::explore([&[1, 1, 1, 1], &[1, 0, 1, 0]]);
    assert!(ends.iter().all(|e| matches!(e, model::End::Deadlock(_))));
}

// =============================================================================================
// GPU, finding 2: the host's count of calls races between threads of one rank
// =============================================================================================

/// FINDING 2 (high, hang of every rank): `launch_push` (symm.rs) takes the slot set from
/// `pushes.load(Relaxed) & 1`, launches, then `pushes.fetch_add(1)`. `SymmMemory` is `Sync` and
/// the one-shot takes `&self`: two threads of rank 0 call it at once on the same stream (the
/// kernels run one after the other, which the barrier one-shot before this commit served right:
/// it kept no host state). When both read the count before either adds, both kernels use set 0,
/// while rank 1, calling twice from one thread, uses sets 0 then 1: rank 0's second kernel waits
/// in set 0 for data rank 1 put in set 1, rank 1's waits in set 1 for data rank 0 put in set 0.
/// Nothing recovers it: the count is now off by one for every later call. Expected: every
/// round completes.
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn finding_two_threads_of_one_rank_keep_the_sets_in_step() {
    child_passes(
        "child_two_threads_of_one_rank",
        Duration::from_secs(60),
        "the ranks hung: two concurrent one-shots of rank 0 used one slot set",
    );
}

#[test]
#[ignore = "needs CUDA GPUs with NCCL (a child of another test)"]
fn child_two_threads_of_one_rank() {
    if !is_child() {
        return;
    }
    const N: usize = 1024;
    const ROUNDS: usize = 2000;
    let got = on_two_gpus(|comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, N, &stream).unwrap();
        fill(&symm, &stream, |i| (i + rank) as f32);
        let want: Vec<f32> = (0..N).map(|i| (2 * i + 1) as f32).collect();
        if rank == 0 {
            let gate = Barrier::new(2);
            std::thread::scope(|s| {
                for _ in 0..2 {
                    let (symm, stream, gate, want) = (&symm, &stream, &gate, &want);
                    s.spawn(move || {
                        let mut out = stream.alloc_zeros::<f32>(N).unwrap();
                        for _ in 0..ROUNDS {
                            gate.wait();
                            symm.one_shot_all_reduce(&mut out, stream).unwrap();
                        }
                        stream.synchronize().unwrap();
                        assert_eq!(&stream.clone_dtoh(&out).unwrap(), want, "rank 0's sums");
                    });
                }
            });
        } else {
            let mut out = stream.alloc_zeros::<f32>(N).unwrap();
            for _ in 0..2 * ROUNDS {
                symm.one_shot_all_reduce(&mut out, &stream).unwrap();
            }
            stream.synchronize().unwrap();
            assert_eq!(stream.clone_dtoh(&out).unwrap(), want, "rank 1's sums");
        }
    });
    all_ok(&got);
}

// =============================================================================================
// GPU, finding 1: a captured one-shot keeps the slot set of its capture
// =============================================================================================

/// Runs the one-shot of `symm` into `sink`'s own data (another allocation: a `PeerSlice` on the
/// same stream, so no cudarc events are recorded or waited for, which a capture would refuse).
fn one_shot_into(symm: &SymmMemory<f32>, sink: &SymmMemory<f32>, stream: &Arc<CudaStream>) {
    let mut out = sink.peer(sink.rank(), stream).unwrap();
    symm.one_shot_all_reduce(&mut out, stream).unwrap();
}

/// FINDING 1 (high, hang; also silent wrong sums, see the next test): the slot set is a kernel
/// parameter (`p_recv`, from `pushes & 1` on the host), so a one-shot captured in a CUDA graph
/// (cudarc's safe `begin_capture` / `end_capture` / `CudaGraph::launch`; this workspace supports
/// captures, `mempool::Allocator::begin_capture`) uses the set of its capture at every replay,
/// while the host's count moved once, at the capture, when nothing ran. Rank 0 replays a graph
/// of one call; rank 1 makes the same calls eagerly (a collective does not require every rank
/// to capture; the barrier one-shot before this commit served it, having no host state): both
/// used set 0 for a warm-up call, the capture took set 1, rank 1's calls alternate 1, 0, 1, 0 and
/// rank 0's replays are 1, 1, 1, 1. The second pair waits forever. Expected: it completes.
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn finding_a_replayed_graph_beside_eager_calls_completes() {
    child_passes(
        "child_replayed_graph_beside_eager_calls",
        Duration::from_secs(45),
        "the ranks hung: the graph's replays kept the slot set of the capture",
    );
}

#[test]
#[ignore = "needs CUDA GPUs with NCCL (a child of another test)"]
fn child_replayed_graph_beside_eager_calls() {
    if !is_child() {
        return;
    }
    const N: usize = 4096;
    const CALLS: usize = 4;
    let got = on_two_gpus(|comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, N, &stream).unwrap();
        let sink = symm_empty::<f32>(&comm, N, &stream).unwrap();
        fill(&symm, &stream, |i| (i + rank) as f32);
        // Warm-up outside any capture: the kernels loaded, one call (set 0) on every rank.
        one_shot_into(&symm, &sink, &stream);
        stream.synchronize().unwrap();
        if rank == 0 {
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
            one_shot_into(&symm, &sink, &stream);
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
            for _ in 0..CALLS {
                graph.launch().unwrap();
            }
            stream.synchronize().unwrap();
        } else {
            for _ in 0..CALLS {
                one_shot_into(&symm, &sink, &stream);
            }
            stream.synchronize().unwrap();
        }
        let mut sums = vec![0f32; N];
        stream.memcpy_dtoh(&sink.peer(rank, &stream).unwrap(), &mut sums).unwrap();
        let bad = (0..N).find(|&i| sums[i] != (2 * i + 1) as f32);
        assert_eq!(bad, None, "rank {rank}: wrong sums");
    });
    all_ok(&got);
}

/// FINDING 1, second form (high: a data race of the protocol; hang or wrong sums): every rank
/// replays a graph of one captured call, so every rank's consecutive calls use the same set,
/// which the argument above `KERNELS_PTX` excludes ("a peer writes into this rank's set of call
/// `c` again only in its own call `c + 2`"): the peer's replay `k + 1` may write this rank's slot
/// as soon as the peer's replay `k` ended, which needs only this rank's *push* of `k`, not its
/// take and emptying store. If this rank's kernel is held between its push and its emptying
/// store (here: rank 1's GPU is time-sliced with another process's spinning kernel, so its
/// kernel is preempted mid-way; also a debugger, MPS or any other context on the GPU), the
/// peer's next data is summed as this call's or erased by the emptying store; with every input
/// the same each call, the loss shows as the last replay waiting forever. The model
/// (`model_one_set_twice_in_a_row_loses_in_some_interleaving`) shows the schedules. Probabilistic:
/// a pass does not clear it, a hang or wrong sum confirms it. Compare
/// `held_eager_calls_survive_time_slicing`, the same with eager calls (alternating sets).
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn finding_graph_replays_on_every_rank_survive_time_slicing() {
    child_passes(
        "child_graph_replays_under_time_slicing",
        Duration::from_secs(150),
        "a rank hung: a replay's data was overwritten or erased before it was taken",
    );
}

/// Held (the control of the previous test): eager calls, which alternate the sets in stream
/// order, under the same time slicing.
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn held_eager_calls_survive_time_slicing() {
    child_passes("child_eager_calls_under_time_slicing", Duration::from_secs(150), "a rank hung");
}

const REPLAYS: usize = 20_000;

#[test]
#[ignore = "needs CUDA GPUs with NCCL (a child of another test)"]
fn child_graph_replays_under_time_slicing() {
    if !is_child() {
        return;
    }
    replays_under_time_slicing(true);
}

#[test]
#[ignore = "needs CUDA GPUs with NCCL (a child of another test)"]
fn child_eager_calls_under_time_slicing() {
    if !is_child() {
        return;
    }
    replays_under_time_slicing(false);
}

fn replays_under_time_slicing(graph: bool) {
    let mut hog = spawn_hog(1, 100);
    std::thread::sleep(Duration::from_millis(500));
    let got = on_two_gpus(move |comm| {
        const N: usize = 4096;
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, N, &stream).unwrap();
        let sink = symm_empty::<f32>(&comm, N, &stream).unwrap();
        fill(&symm, &stream, |i| (i + rank) as f32);
        one_shot_into(&symm, &sink, &stream);
        stream.synchronize().unwrap();
        let started = std::time::Instant::now();
        if graph {
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
            one_shot_into(&symm, &sink, &stream);
            let g = stream.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a graph");
            for k in 0..REPLAYS {
                g.launch().unwrap();
                if k % 512 == 511 {
                    stream.synchronize().unwrap();
                }
            }
        } else {
            for k in 0..REPLAYS {
                one_shot_into(&symm, &sink, &stream);
                if k % 512 == 511 {
                    stream.synchronize().unwrap();
                }
            }
        }
        stream.synchronize().unwrap();
        eprintln!("rank {rank}: {REPLAYS} calls (graph: {graph}) in {:?}", started.elapsed());
        let mut sums = vec![0f32; N];
        stream.memcpy_dtoh(&sink.peer(rank, &stream).unwrap(), &mut sums).unwrap();
        let bad = (0..N).find(|&i| sums[i] != (2 * i + 1) as f32);
        assert_eq!(bad, None, "rank {rank}: wrong sums");
    });
    if let Some(h) = hog.as_mut() {
        let _ = h.kill();
        let _ = h.wait();
    }
    all_ok(&got);
}

/// Another process (this binary, `child_hog_gpu`) that keeps a spinning kernel queued on `gpu`
/// for `secs`, so the GPU time-slices between it and the ranks' context (no MPS). `None` if it
/// could not start (it then says why; the probe runs without it).
fn spawn_hog(gpu: usize, secs: u64) -> Option<std::process::Child> {
    let exe = std::env::current_exe().unwrap();
    std::process::Command::new(exe)
        .args(["child_hog_gpu", "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env("MEMPOOL_NCCL_PROBE_CHILD", "1")
        .env("REVIEW3_HOG_GPU", gpu.to_string())
        .env("REVIEW3_HOG_SECS", secs.to_string())
        .spawn()
        .map_err(|e| eprintln!("no time-slicing hog: {e}"))
        .ok()
}

const SPIN_PTX: &str = "
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 p_ns)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [p_ns];
    mov.u64 %rd2, %globaltimer;
    add.u64 %rd3, %rd2, %rd1;
SPIN:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p1, %rd4, %rd3;
    @%p1 bra SPIN;
    ret;
}
\0";

#[test]
#[ignore = "needs CUDA GPUs (a child of another test)"]
fn child_hog_gpu() {
    let (Ok(gpu), Ok(secs)) = (std::env::var("REVIEW3_HOG_GPU"), std::env::var("REVIEW3_HOG_SECS")) else {
        return;
    };
    let (gpu, secs): (usize, u64) = (gpu.parse().unwrap(), secs.parse().unwrap());
    let ctx = CudaContext::new(gpu).unwrap();
    let stream = ctx.new_stream().unwrap();
    ctx.bind_to_thread().unwrap();
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: out-parameter; a NUL-terminated PTX text.
    let r = unsafe { sys::cuModuleLoadData(&mut module, SPIN_PTX.as_ptr().cast()) };
    assert_eq!(r, CUresult::CUDA_SUCCESS, "the spin kernel's module");
    let mut func: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: out-parameter, the module just loaded, a NUL-terminated name.
    let r = unsafe { sys::cuModuleGetFunction(&mut func, module, c"spin".as_ptr()) };
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        for _ in 0..4 {
            let mut ns: u64 = 20_000_000;
            let mut params: [*mut std::ffi::c_void; 1] = [(&mut ns as *mut u64).cast()];
            // SAFETY: `spin(u64 ns)` takes one u64, given; it touches no memory.
            let r = unsafe {
                sys::cuLaunchKernel(
                    func,
                    1,
                    1,
                    1,
                    32,
                    1,
                    1,
                    0,
                    stream.cu_stream(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            assert_eq!(r, CUresult::CUDA_SUCCESS);
        }
        stream.synchronize().unwrap();
    }
}

// =============================================================================================
// GPU, finding 4: the receive slots hold data while no one-shot of this rank runs
// =============================================================================================

/// FINDING 4 (low, documentation a test relies on): `receive_slots` says "every byte of them is
/// 0xff whenever no one-shot is running". The peer may be one call ahead: its next call pushes
/// into this rank's other set as soon as it starts, while this rank runs nothing. Rank 1 calls
/// once and waits for its stream; rank 0 calls twice (its second call waits for rank 1's
/// second); rank 1's slots then hold rank 0's data. (`one_shot_pushes_back_to_back` checks them
/// only after every rank is done, which holds.)
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn finding_receive_slots_are_empty_when_every_ranks_calls_are_done() {
    child_passes("child_peer_one_call_ahead", Duration::from_secs(45), "hung");
}

#[test]
#[ignore = "needs CUDA GPUs with NCCL (a child of another test)"]
fn child_peer_one_call_ahead() {
    if !is_child() {
        return;
    }
    const N: usize = 1024;
    let gate = Arc::new(Barrier::new(2));
    let got = on_two_gpus(move |comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, N, &stream).unwrap();
        fill(&symm, &stream, |i| i as f32);
        let mut out = stream.alloc_zeros::<f32>(N).unwrap();
        if rank == 0 {
            symm.one_shot_all_reduce(&mut out, &stream).unwrap();
            symm.one_shot_all_reduce(&mut out, &stream).unwrap();
            gate.wait();
        } else {
            symm.one_shot_all_reduce(&mut out, &stream).unwrap();
            stream.synchronize().unwrap();
            gate.wait();
            std::thread::sleep(Duration::from_millis(300));
            // No one-shot of this rank runs, but rank 0 is one call ahead: its data may wait
            // here (the documented state), and is taken by this rank's next call.
            symm.one_shot_all_reduce(&mut out, &stream).unwrap();
        }
        stream.synchronize().unwrap();
        let want: Vec<f32> = (0..N).map(|i| 2.0 * i as f32).collect();
        assert!(stream.clone_dtoh(&out).unwrap() == want, "rank {rank}: the second call's sums");
        gate.wait();
        // Every rank's calls are done: the slots are empty.
        let full = receive_slot_bytes_in_use(&symm, comm.context());
        assert_eq!(full, 0, "rank {rank}: {full} bytes of the receive slots hold data after every call");
    });
    all_ok(&got);
}

// =============================================================================================
// GPU, finding 5: receive slots for allocations that can never push
// =============================================================================================

/// FINDING 5 (low, memory): `symm_empty_with` gives every allocation of at most `PUSH_MAX`
/// bytes `2 world` slots of its size (`receive_bytes`), whatever `T`; only `SymmMemory<f32>` has
/// a one-shot. A `SymmMemory<u8>` / `<f64>` / `<[f32; 4]>` of 256 KiB among 8 ranks maps 4 MiB
/// of slots it can never use (and registers them in an NCCL window). Each rank's own slot of
/// each set is never used either (`world` of the `2 world` slots). Expected: no slots for types
/// without a one-shot.
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn finding_allocations_without_a_one_shot_get_no_receive_slots() {
    if !two_gpus() {
        return;
    }
    let got = on_two_gpus(|comm| {
        let stream = comm.context().new_stream().unwrap();
        let bytes = symm_empty::<u8>(&comm, PUSH_MAX, &stream).unwrap().receive_slots().1;
        let f64s = symm_empty::<f64>(&comm, PUSH_MAX / 8, &stream).unwrap().receive_slots().1;
        (bytes, f64s)
    });
    for (r, g) in got.iter().enumerate() {
        let (u8s, f64s) = g.as_ref().expect("no panic");
        assert_eq!((*u8s, *f64s), (0, 0), "rank {r}: receive slots of u8 and f64 allocations");
    }
}

// =============================================================================================
// GPU, held: sizes, alignment, guards, NaN, interleaving, refusals
// =============================================================================================

/// Held? Sizes around every boundary (tails of 1-3 floats, the 128-byte rounding, PUSH_MAX
/// floats and one more, which reads instead of pushing), `out` 16-byte aligned and not, guard
/// floats around `out` untouched, this rank's data untouched, the two-shot, a barrier and
/// signals on the same allocation between one-shots, and the receive slots empty once every rank
/// is done (after a barrier).
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn held_push_sizes_alignment_guards_and_interleaving() {
    if !two_gpus() {
        return;
    }
    let (passed, timed_out) = in_child("child_push_sizes", Duration::from_secs(120));
    assert!(passed && !timed_out, "timed out: {timed_out}");
}

#[test]
#[ignore = "needs CUDA GPUs with NCCL (a child of another test)"]
fn child_push_sizes() {
    if !is_child() {
        return;
    }
    let got = on_two_gpus(|comm| {
        let (rank, world) = (comm.rank(), comm.world_size());
        let stream = comm.context().new_stream().unwrap();
        let sizes = [
            1usize,
            2,
            3,
            4,
            5,
            7,
            8,
            9,
            31,
            32,
            33,
            127,
            129,
            1023,
            4097,
            PUSH_MAX / 4 - 1,
            PUSH_MAX / 4,
            PUSH_MAX / 4 + 1,
        ];
        for n in sizes {
            let symm = symm_empty::<f32>(&comm, n, &stream).unwrap();
            assert_eq!(symm.receive_slots().1 > 0, 4 * n <= PUSH_MAX, "rank {rank}: slots for {n} floats");
            for round in 0..4usize {
                let value = |r: usize, i: usize| ((i * 7 + round * 13 + r * 3) % 997) as f32 * 0.5 - 100.0;
                let mine: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
                stream.memcpy_htod(&mine, &mut symm.peer(rank, &stream).unwrap()).unwrap();
                const GUARD: usize = 8;
                const SENT: f32 = -12345.0;
                let mut buf = stream.clone_htod(&vec![SENT; n + 2 * GUARD]).unwrap();
                // Offset 8 floats: 16-byte aligned; 9: 4 bytes past.
                let off = GUARD + round % 2;
                {
                    let mut view = buf.slice_mut(off..off + n);
                    symm.one_shot_all_reduce(&mut view, &stream).unwrap();
                }
                stream.synchronize().unwrap();
                let mut after = vec![0f32; n];
                stream.memcpy_dtoh(&symm.peer(rank, &stream).unwrap(), &mut after).unwrap();
                assert_eq!(after, mine, "rank {rank}: the one-shot changed this rank's data ({n})");
                match round {
                    1 => symm.two_shot_all_reduce_in_place(&stream).unwrap(),
                    2 => {
                        let peer = (rank + 1) % world;
                        symm.barrier(0, &stream).unwrap();
                        symm.put_signal(peer, 3, &stream).unwrap();
                        symm.wait_signal(peer, 3, &stream).unwrap();
                    }
                    _ => {}
                }
                stream.synchronize().unwrap();
                let got = stream.clone_dtoh(&buf).unwrap();
                for (i, &g) in got.iter().enumerate() {
                    if i < off || i >= off + n {
                        assert_eq!(g, SENT, "rank {rank}: guard {i} written ({n} floats, out at {off})");
                    } else {
                        let want = (0..world).fold(0f32, |s, r| s + value(r, i - off));
                        assert_eq!(g.to_bits(), want.to_bits(), "rank {rank}: {n} floats, element {}", i - off);
                    }
                }
            }
            symm.barrier(1, &stream).unwrap();
            stream.synchronize().unwrap();
            let full = receive_slot_bytes_in_use(&symm, comm.context());
            assert_eq!(full, 0, "rank {rank}: receive slots not empty after every rank's calls ({n})");
        }
    });
    all_ok(&got);
}

/// Held? NaN bit patterns, infinities and zeros: an input with every bit set (the empty mark)
/// and one a bit short of it sum to NaN, inf + -inf to NaN, -0 + -0 to the scalar loop's +0
/// (the sums start at +0, as the barrier one-shot's did; NCCL's would be -0); and the data's
/// padding after `len` (read and pushed with the last vector) holding the empty mark, as memory
/// a dropped allocation's receive slots left could, does not make anyone wait forever. Two
/// calls (both sets).
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn held_nan_patterns_and_marked_padding() {
    if !two_gpus() {
        return;
    }
    let (passed, timed_out) = in_child("child_nan_patterns", Duration::from_secs(45));
    assert!(passed && !timed_out, "timed out: {timed_out}");
}

#[test]
#[ignore = "needs CUDA GPUs with NCCL (a child of another test)"]
fn child_nan_patterns() {
    if !is_child() {
        return;
    }
    let got = on_two_gpus(|comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        const N: usize = 6;
        let symm = symm_empty::<f32>(&comm, N, &stream).unwrap();
        let b = f32::from_bits;
        let mine: [f32; N] = if rank == 0 {
            [b(0xFFFF_FFFF), b(0xFFFF_FFFE), -0.0, f32::INFINITY, 1.0, b(0x7FC0_0000)]
        } else {
            [1.0, 1.0, -0.0, f32::NEG_INFINITY, b(0xFFFF_FFFF), 2.0]
        };
        stream.memcpy_htod(&mine, &mut symm.peer(rank, &stream).unwrap()).unwrap();
        // The padding after the data, up to its 128 bytes: every bit set.
        let base = symm.buffer_ptrs()[rank];
        comm.context().bind_to_thread().unwrap();
        stream.synchronize().unwrap();
        // SAFETY: this rank's own allocation, bytes 4N..128 of its data (data_bytes = 128),
        // inside its mapping; nothing else runs on it now (the stream's copy is done, no kernel
        // was launched yet, and this is a synchronous memset).
        let r = unsafe { sys::cuMemsetD32_v2(base + 4 * N as u64, 0xFFFF_FFFF, (128 - 4 * N) / 4) };
        assert_eq!(r, CUresult::CUDA_SUCCESS);
        // SAFETY: no arguments.
        assert_eq!(unsafe { sys::cuCtxSynchronize() }, CUresult::CUDA_SUCCESS);
        for call in 0..2 {
            let mut out = stream.alloc_zeros::<f32>(N).unwrap();
            symm.one_shot_all_reduce(&mut out, &stream).unwrap();
            stream.synchronize().unwrap();
            let got = stream.clone_dtoh(&out).unwrap();
            for i in [0, 1, 3, 4, 5] {
                assert!(
                    got[i].is_nan(),
                    "rank {rank}, call {call}: element {i} is {} ({:#x})",
                    got[i],
                    got[i].to_bits()
                );
            }
            assert_eq!(got[2].to_bits(), 0, "rank {rank}, call {call}: -0 + -0 from a +0 start");
        }
    });
    all_ok(&got);
}

/// Held? A call refused before its launch (a stream of another device: no kernel, no count) is
/// not a call: retried on the right stream it pairs with the peer's waiting call, and the sets
/// stay in step for the next one.
#[test]
#[ignore = "needs CUDA GPUs with NCCL"]
fn held_a_call_refused_before_the_launch_can_be_retried() {
    if !two_gpus() {
        return;
    }
    let (passed, timed_out) = in_child("child_refused_before_launch", Duration::from_secs(45));
    assert!(passed && !timed_out, "timed out: {timed_out}");
}

#[test]
#[ignore = "needs CUDA GPUs with NCCL (a child of another test)"]
fn child_refused_before_launch() {
    if !is_child() {
        return;
    }
    const N: usize = 1000;
    let got = on_two_gpus(|comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, N, &stream).unwrap();
        fill(&symm, &stream, |i| (i + rank) as f32);
        let mut out = stream.alloc_zeros::<f32>(N).unwrap();
        if rank == 0 {
            let other = CudaContext::new(1).unwrap().new_stream().unwrap();
            let r = symm.one_shot_all_reduce(&mut out, &other);
            assert!(matches!(r, Err(Error::WrongDevice { .. })), "rank 0: a stream of GPU 1: {r:?}");
        }
        for _ in 0..3 {
            symm.one_shot_all_reduce(&mut out, &stream).unwrap();
        }
        stream.synchronize().unwrap();
        let sums = stream.clone_dtoh(&out).unwrap();
        assert!((0..N).all(|i| sums[i] == (2 * i + 1) as f32), "rank {rank}: sums");
    });
    all_ok(&got);
}
