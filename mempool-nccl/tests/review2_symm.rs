//! Second hostile review: symmetric memory after commits 69387b3 and 19fd294 (counted signals,
//! the out device check). Every test needs two CUDA GPUs with NCCL (`#[ignore]`; run with
//! `cargo test -p mempool-nccl --test review2_symm -- --ignored --test-threads=1`). Each asserts
//! what a user relies on, so `finding_*` tests FAIL while the bug is there; `held_*` ones
//! check what should hold.
//!
//! Every body runs in a child process of this test binary (`child_*`, which does nothing unless
//! `MEMPOOL_NCCL_PROBE_CHILD` is set, by `common::in_child`) that the parent kills at its deadline (at most 45 s): no test
//! hangs. Multicast is never created here; NCCL_NVLS_ENABLE is left alone.

mod common;
use common::{all_ok, child_passes, fill, in_child, is_child, on_two_gpus, two_gpus};

use std::time::Duration;

use mempool_nccl::symm::symm_empty;
use mempool_nccl::Error;

// ---------------------------------------------------------------------------------------------
// Counted signals: the "taken" count is a plain load and store
// ---------------------------------------------------------------------------------------------

/// Was a finding (medium, silent loss of synchronisation; fixed: a wait takes its signal with a compare-and-swap): `signal_sync` (and the kernels' barriers)
/// load this rank's "taken" count once, before spinning (`ld.global.u32 %r13, [%rd13]`),
/// and store `taken + 1` when the signal word differs (`st.global.u32`): a plain
/// read-modify-write. Two waits of one rank on the same (peer, channel) in flight at once (two
/// streams of the rank, `&SymmMemory` is `Sync`) both read the same count, both see the one
/// signal the peer sent, both pass, and both store the same `taken + 1`: one signal satisfies
/// two waits ("no signal is lost or merged, however many come" does not hold), and the counts
/// are then balanced while one wait went through without its signal. Expected: of two
/// concurrent waits for one signal, exactly one passes (the other times out).
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn finding_one_signal_satisfies_only_one_of_two_concurrent_waits() {
    if !two_gpus() {
        return;
    }
    let (passed, timed_out) = in_child("child_two_concurrent_waits", Duration::from_secs(45));
    assert!(passed && !timed_out, "see the child's output (timed out: {timed_out})");
}

#[test]
#[ignore = "needs two CUDA GPUs with NCCL (a child of another test)"]
fn child_two_concurrent_waits() {
    if !is_child() {
        return;
    }
    let got = on_two_gpus(|comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, 1024, &stream).unwrap();
        if rank == 1 {
            // Both of rank 0's waits are in flight before the one signal comes.
            std::thread::sleep(Duration::from_millis(500));
            symm.put_signal(0, 3, &stream).unwrap();
            stream.synchronize().unwrap();
            // Rank 0's timed-out wait (if one timed out) is over before anyone goes.
            std::thread::sleep(Duration::from_secs(4));
            return;
        }
        let a = comm.context().new_stream().unwrap();
        let b = comm.context().new_stream().unwrap();
        let results: Vec<bool> = std::thread::scope(|sc| {
            let ha = sc.spawn(|| symm.wait_signal_timeout(1, 3, Duration::from_secs(2), &a).is_ok());
            let hb = sc.spawn(|| symm.wait_signal_timeout(1, 3, Duration::from_secs(2), &b).is_ok());
            vec![ha.join().unwrap(), hb.join().unwrap()]
        });
        let passed = results.iter().filter(|&&p| p).count();
        assert_eq!(passed, 1, "one signal sent, two concurrent waits: {passed} of them passed ({results:?})");
    });
    all_ok(&got);
}

// ---------------------------------------------------------------------------------------------
// A timed-out barrier, retried
// ---------------------------------------------------------------------------------------------

/// Was a finding (low/medium; fixed: the next barrier on the channel finishes a timed-out one): `barrier_timeout` signals every peer before it waits; when the wait
/// times out, the signal stays sent ("a late rank's signal is counted when it comes"). The
/// natural recovery, retrying the barrier, sends a second signal: the late rank's barrier took
/// the first, and the second stays in its pad, so the late rank's *next* barrier passes at once,
/// without this rank (its work before the barrier not done, its writes not visible). Nothing
/// documents that a timed-out barrier must be resumed with `wait_signal` from each late rank
/// instead (and there is no call that waits without signalling again). Expected: after
/// rank 0's timed-out barrier and its retry, rank 1's next barrier still waits for rank 0
/// (here it must time out, since rank 0 comes 3 s later).
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn finding_a_retried_timed_out_barrier_keeps_the_next_barrier_waiting() {
    if !two_gpus() {
        return;
    }
    let (passed, timed_out) = in_child("child_retried_barrier", Duration::from_secs(45));
    assert!(passed && !timed_out, "see the child's output (timed out: {timed_out})");
}

#[test]
#[ignore = "needs two CUDA GPUs with NCCL (a child of another test)"]
fn child_retried_barrier() {
    if !is_child() {
        return;
    }
    let got = on_two_gpus(|comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, 1024, &stream).unwrap();
        let t = Duration::from_secs(1);
        if rank == 0 {
            let first = symm.barrier_timeout(5, Duration::from_millis(200), &stream);
            assert!(first.is_err(), "rank 1 is 1 s late: {first:?}");
            // Retry: pairs with rank 1's (late) barrier.
            symm.barrier_timeout(5, Duration::from_secs(10), &stream).unwrap();
            // Rank 0's next barrier comes 3 s later.
            std::thread::sleep(Duration::from_secs(3));
            let _ = symm.barrier_timeout(5, t, &stream);
        } else {
            std::thread::sleep(Duration::from_secs(1));
            symm.barrier_timeout(5, Duration::from_secs(10), &stream).unwrap();
            let next = symm.barrier_timeout(5, t, &stream);
            assert!(
                next.is_err(),
                "rank 1's next barrier passed though rank 0 reaches it 3 s later (rank 0's retried \
                 barrier left a signal in rank 1's pad)"
            );
            std::thread::sleep(Duration::from_secs(3));
        }
    });
    all_ok(&got);
}

// ---------------------------------------------------------------------------------------------
// one_shot_all_reduce's `out`
// ---------------------------------------------------------------------------------------------

/// Was a finding (medium, silently wrong sums on the other ranks; fixed: refused): `one_shot_all_reduce` accepts as
/// `out` this rank's own symmetric data (`symm.peer(symm.rank(), ..)`, the documented way to
/// reach it, on this device, so the `cuPointerGetAttribute` check passes). The kernel then
/// writes the sums into the data the peers are reading (its only barrier before the reads is
/// the first one), so a peer that reads later adds a sum instead of a value. The documentation
/// promises "no rank writes its data before everyone read it". Expected: refused (an `out`
/// overlapping this rank's symmetric data), or correct sums on every rank. Rank 1 passes a
/// 4-byte-aligned view, so it takes the one-at-a-time path and reads after rank 0 wrote.
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn finding_one_shot_into_its_own_symmetric_data_is_refused_or_correct() {
    if !two_gpus() {
        return;
    }
    let (passed, timed_out) = in_child("child_one_shot_into_own_data", Duration::from_secs(45));
    assert!(passed && !timed_out, "see the child's output (timed out: {timed_out})");
}

#[test]
#[ignore = "needs two CUDA GPUs with NCCL (a child of another test)"]
fn child_one_shot_into_own_data() {
    if !is_child() {
        return;
    }
    const N: usize = 1 << 24;
    let got = on_two_gpus(move |comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, N, &stream).unwrap();
        fill(&symm, &stream, |_| (rank + 1) as f32);
        symm.barrier(0, &stream).unwrap();
        stream.synchronize().unwrap();
        if rank == 0 {
            // Refused, and still part of the barriers: rank 1 gets its sums, rank 0 the error.
            let mut own = symm.peer(0, &stream).unwrap();
            let r = symm.one_shot_all_reduce(&mut own, &stream);
            assert!(r.as_ref().is_err_and(|e| e.to_string().contains("own symmetric memory")), "{r:?}");
            stream.synchronize().unwrap();
        } else {
            let mut out = stream.alloc_zeros::<f32>(N + 1).unwrap();
            let mut view = out.slice_mut(1..);
            symm.one_shot_all_reduce(&mut view, &stream).unwrap();
            stream.synchronize().unwrap();
            let host = stream.clone_dtoh(&out).unwrap();
            let wrong = host[1..].iter().filter(|&&v| v != 3.0).count();
            assert_eq!(wrong, 0, "rank 1: {wrong} of {N} sums are not 1 + 2 (rank 0 wrote its sums into its data)");
        }
    });
    all_ok(&got);
}

/// Was a finding (low, hang; fixed: a refused out still takes part in the barriers): a collective whose arguments one rank refuses (here `out` too short:
/// `BufferTooShort`, returned before any launch) leaves the other ranks' kernels spinning in
/// their first barrier forever: their streams never complete, `synchronize` never returns,
/// and dropping their `SymmMemory` (which synchronises the context) hangs too. The previous
/// review's fix made `symm_empty`'s local errors join the exchange so that "every rank fails
/// together"; the all-reduces have no such path (their barriers have no timeout). Expected:
/// rank 0's stream completes (with an error) within 30 s.
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn finding_a_rank_refusing_its_out_does_not_hang_the_others() {
    child_passes(
        "child_one_rank_refuses_its_out",
        Duration::from_secs(40),
        "rank 0's one-shot never completed: rank 1 refused its own `out` locally",
    );
}

#[test]
#[ignore = "needs two CUDA GPUs with NCCL (a child of another test)"]
fn child_one_rank_refuses_its_out() {
    if !is_child() {
        return;
    }
    const N: usize = 4096;
    let got = on_two_gpus(|comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, N, &stream).unwrap();
        fill(&symm, &stream, |_| 1.0);
        let mut out = stream.alloc_zeros::<f32>(if rank == 1 { N - 1 } else { N }).unwrap();
        let r = symm.one_shot_all_reduce(&mut out, &stream);
        if rank == 1 {
            assert!(matches!(r, Err(Error::BufferTooShort { .. })), "{r:?}");
        }
        // Rank 0: its kernel waits for rank 1's, which never comes.
        let _ = stream.synchronize();
    });
    all_ok(&got);
}

/// Held? An `out` of pinned host memory (mempool's pinned allocator: mapped for the device,
/// its device address the host address) is either refused with an error or reduced into
/// correctly; never a fault or a hang; rank 1 gets its sums either way.
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn held_one_shot_into_pinned_host_memory_is_refused_or_correct() {
    if !two_gpus() {
        return;
    }
    let (passed, timed_out) = in_child("child_one_shot_into_pinned_host", Duration::from_secs(45));
    assert!(passed && !timed_out, "see the child's output (timed out: {timed_out})");
}

#[test]
#[ignore = "needs two CUDA GPUs with NCCL (a child of another test)"]
fn child_one_shot_into_pinned_host() {
    if !is_child() {
        return;
    }
    const N: usize = 4096;
    let got = on_two_gpus(move |comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, N, &stream).unwrap();
        fill(&symm, &stream, |_| (rank + 1) as f32);
        if rank == 0 {
            let pinned = mempool::Allocator::pinned(0).unwrap();
            let mut out = pinned.alloc_zeros::<f32>(N).unwrap();
            let r = symm.one_shot_all_reduce(&mut out, &stream);
            eprintln!("rank 0, out in pinned host memory: {r:?}");
            // Refused or not, the kernel ran its barriers: the stream completes.
            stream.synchronize().unwrap();
            if r.is_ok() {
                let host = out.host_slice().expect("host-visible");
                assert!(host.iter().all(|&v| v == 3.0), "wrong sums in pinned memory");
            }
        } else {
            let mut out = stream.alloc_zeros::<f32>(N).unwrap();
            symm.one_shot_all_reduce(&mut out, &stream).unwrap();
            stream.synchronize().unwrap();
            assert!(stream.clone_dtoh(&out).unwrap().iter().all(|&v| v == 3.0), "rank 1's sums");
        }
    });
    all_ok(&got);
}
