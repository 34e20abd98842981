//! Hostile-review probes (issue 18 review) of symmetric memory (`mempool_nccl::symm`). Every test
//! needs two CUDA GPUs with NCCL (`#[ignore]`; run with
//! `cargo test -p mempool-nccl --test symm_attacks -- --ignored --test-threads=1`). Each asserts
//! what a user relies on, so `finding_*` tests FAIL while the bug is there; `held_*` ones
//! checked what held.
//!
//! Probes that may leave a kernel spinning forever (a barrier some rank never reaches) run
//! their body in a child process of this test binary (`child_*`, which does nothing unless
//! `MEMPOOL_NCCL_PROBE_CHILD` is set, by `common::in_child`) that the parent kills at a deadline: no test hangs, each ends
//! within about a minute. Multicast is never created here; NCCL_NVLS_ENABLE is left alone.

mod common;
use common::{child_passes, fill, in_child, is_child, on_two_gpus, two_gpus};

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use mempool_nccl::symm::{symm_empty, symm_empty_with, SymmOptions};
use mempool_nccl::{Communicator, Error, Id};

/// Runs `f(comm)` on one thread per rank of a communicator made from an id (the rendezvous
/// between processes, over abstract sockets), ranks 0 and 1 on GPUs 0 and 1.
fn on_two_id_ranks<T: Send + 'static>(
    f: impl Fn(Communicator) -> T + Send + Sync + 'static,
) -> Vec<std::result::Result<T, String>> {
    let id = Id::new().unwrap();
    let f = Arc::new(f);
    let threads: Vec<_> = (0..2)
        .map(|r| {
            let f = f.clone();
            std::thread::spawn(move || f(Communicator::new(&id, r, 2, r).expect("communicator")))
        })
        .collect();
    threads.into_iter().map(|t| t.join().map_err(|_| "rank thread panicked".to_string())).collect()
}

// ---------------------------------------------------------------------------------------------
// Sizes
// ---------------------------------------------------------------------------------------------

/// FINDING (high): ranks asking for different sizes are documented to fail on every rank
/// ("Errors, on every rank alike: ranks asking for different sizes"), but both rendezvous
/// compare `bytes`, the size rounded up to the allocation granularity (2 MiB) with the pad
/// added (symm.rs, `rendezvous_in_process`: `field(r, 1) != bytes`; `rendezvous_across_processes`:
/// `sizes`), not `len` or `data_bytes`. 1,024 and 2,048 floats both round to one granule, so
/// both ranks get `Ok` — with different `data_bytes`, so each rank places the *signal pads* at
/// a different offset: rank 0 signals into what rank 1 thinks is its data (4096..8192) and
/// waits on words rank 1 never writes. Every `barrier`/`put_signal`/`wait_signal`/all-reduce on
/// it then hangs or corrupts data; and the kernels' `len`, blocks and chunking differ between
/// ranks.
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn finding_sizes_within_one_granule_are_refused_all_local() {
    if !two_gpus() {
        return;
    }
    let got = on_two_gpus(|comm| {
        let stream = comm.context().new_stream().unwrap();
        let len = 1024 * (comm.rank() + 1);
        symm_empty::<f32>(&comm, len, &stream).map(|_| ()).map_err(|e| e.to_string())
    });
    for (r, g) in got.iter().enumerate() {
        let g = g.as_ref().expect("no panic");
        assert!(g.as_ref().is_err_and(|e| e.contains("same size")), "rank {r}: {g:?}");
    }
}

/// FINDING (high): the same between processes (communicators from an id; threads here).
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn finding_sizes_within_one_granule_are_refused_id_comms() {
    if !two_gpus() {
        return;
    }
    let got = on_two_id_ranks(|comm| {
        let stream = comm.context().new_stream().unwrap();
        let len = 1024 * (comm.rank() + 1);
        let opts = SymmOptions::new().timeout(Duration::from_secs(20));
        symm_empty_with::<f32>(&comm, len, &stream, &opts).map(|_| ()).map_err(|e| e.to_string())
    });
    for (r, g) in got.iter().enumerate() {
        let g = g.as_ref().expect("no panic");
        assert!(g.as_ref().is_err_and(|e| e.contains("same size")), "rank {r}: {g:?}");
    }
}

/// FINDING (high): `symm_empty_with` checks `len * size_of::<T>()` and its rounding to 128 for
/// overflow, but then adds the pad and rounds to the granularity unchecked
/// (`(data_bytes + pad).next_multiple_of(gran)`). `usize::MAX - 127` bytes: a debug build
/// panics ("attempt to add with overflow"); a release build wraps to a few hundred bytes,
/// allocates one granule, and hands back a `SymmMemory` whose `len` is 2^64 − 128: `peer()` is
/// then a safe slice of 16 EiB over 2 MiB (out-of-bounds device accesses from safe code).
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn finding_an_overflowing_size_is_an_error_not_a_panic_or_a_tiny_allocation() {
    if !two_gpus() {
        return;
    }
    let got = on_two_gpus(|comm| {
        let stream = comm.context().new_stream().unwrap();
        symm_empty::<u8>(&comm, usize::MAX - 127, &stream).map(|s| s.len()).map_err(|e| e.to_string())
    });
    for (r, g) in got.iter().enumerate() {
        match g {
            Err(panic) => panic!("rank {r} panicked: {panic}"),
            Ok(Ok(len)) => panic!("rank {r}: a symmetric allocation of {len} bytes was made"),
            Ok(Err(_)) => {}
        }
    }
}

/// FINDING (high, hang): one rank asks for a size whose byte count overflows (a local error,
/// returned before the rendezvous), the other for 1,024 floats. The documentation promises an
/// error on every rank; the second rank instead waits forever in the communicator's
/// all-gather (`rendezvous_in_process` has no timeout, and the first rank never joins it).
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn finding_one_rank_with_an_overflowing_size_does_not_hang_the_other() {
    child_passes(
        "child_one_rank_with_an_overflowing_size",
        Duration::from_secs(45),
        "a rank waited forever for a rank whose size overflowed",
    );
}

#[test]
#[ignore = "needs two CUDA GPUs with NCCL (a child of another test)"]
fn child_one_rank_with_an_overflowing_size() {
    if !is_child() {
        return;
    }
    let got = on_two_gpus(|comm| {
        let stream = comm.context().new_stream().unwrap();
        let len = if comm.rank() == 0 { usize::MAX } else { 1024 };
        symm_empty::<f32>(&comm, len, &stream).map(|_| ()).map_err(|e| e.to_string())
    });
    for (r, g) in got.iter().enumerate() {
        assert!(g.as_ref().expect("no panic").is_err(), "rank {r}: {g:?}");
    }
}

/// FINDING (medium): between processes, each rendezvous's socket names take the next number of
/// a per-communicator counter (`Communicator::next_rendezvous`), taken only after the size
/// checks. A rank whose call fails before it (an overflowing size) does not take a number;
/// the peer's failed call (it times out) did. From then on the ranks look for each other
/// under different names: every later `symm_empty` on that communicator times out, though every
/// rank asks for the same size. (The existing two-process test's "still usable after a failed
/// one" holds only when every rank reached the rendezvous.)
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn finding_a_local_error_does_not_break_later_rendezvous() {
    if !two_gpus() {
        return;
    }
    let got = on_two_id_ranks(|comm| {
        let stream = comm.context().new_stream().unwrap();
        let short = SymmOptions::new().timeout(Duration::from_secs(3));
        let len = if comm.rank() == 0 { usize::MAX } else { 1024 };
        let first = symm_empty_with::<f32>(&comm, len, &stream, &short);
        assert!(first.is_err(), "rank {}: the mismatched call failed", comm.rank());
        let opts = SymmOptions::new().timeout(Duration::from_secs(15));
        symm_empty_with::<f32>(&comm, 4096, &stream, &opts).map(|_| ()).map_err(|e| e.to_string())
    });
    for (r, g) in got.iter().enumerate() {
        let g = g.as_ref().expect("no panic");
        assert!(g.is_ok(), "rank {r}: a matching call after a failed one: {g:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// The one-shot kernel's launch
// ---------------------------------------------------------------------------------------------

/// FINDING (high, hang): `one_shot_all_reduce` picks the vector path only when `out` is
/// 16-byte aligned (`n4 = if out_ptr % 16 == 0 { len / 4 } else { 0 }`), and sizes the grid
/// from it (`work = max(n4, len - 4 n4)`, `blocks = ceil(work / threads)`). The in-kernel
/// barriers pair block `b` of every rank, so every rank must launch the same number of blocks.
/// One rank passing an `out` that is a 4-byte-aligned view (`slice_mut(1..)`, safe code) and
/// the other an aligned buffer: 4,096 floats give 8 blocks on one rank and 2 on the other;
/// blocks 2..7 wait forever for signals no block of the peer sends (and their signals stay
/// set in the peer's pad, for the next call's blocks 2..7 to pass early).
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn finding_one_shot_with_out_aligned_on_one_rank_only_completes() {
    child_passes(
        "child_one_shot_with_mixed_out_alignment",
        Duration::from_secs(45),
        "the one-shot all-reduce hung (ranks launched different grids)",
    );
}

#[test]
#[ignore = "needs two CUDA GPUs with NCCL (a child of another test)"]
fn child_one_shot_with_mixed_out_alignment() {
    if !is_child() {
        return;
    }
    const N: usize = 4096;
    let got = on_two_gpus(|comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, N, &stream).unwrap();
        fill(&symm, &stream, |i| (i + rank) as f32);
        let mut out = stream.alloc_zeros::<f32>(N + 1).unwrap();
        if rank == 0 {
            let mut view = out.slice_mut(..N);
            symm.one_shot_all_reduce(&mut view, &stream).unwrap();
        } else {
            let mut view = out.slice_mut(1..);
            symm.one_shot_all_reduce(&mut view, &stream).unwrap();
        }
        stream.synchronize().unwrap();
        let host = stream.clone_dtoh(&out).unwrap();
        let got = if rank == 0 { &host[..N] } else { &host[1..] };
        let bad = (0..N).find(|&i| got[i] != (2 * i + 1) as f32);
        assert_eq!(bad, None, "rank {rank}: wrong sums");
    });
    for (r, g) in got.iter().enumerate() {
        assert!(g.is_ok(), "rank {r}: {g:?}");
    }
}

/// FINDING (medium): `one_shot_all_reduce` says `out` must be "on this rank's device" but never
/// checks it (only the stream is checked): a safe call with `out` allocated on the peer's GPU
/// is launched, and the kernel stores through another device's address (an illegal address
/// that kills this rank's context, or, with peer access enabled, a silent write into the other
/// GPU's memory). Expected: `Error::WrongDevice`, before any launch. If the call is accepted
/// the other rank joins it (so the kernel's barrier can complete) and the test fails.
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn finding_one_shot_out_on_another_device_is_refused() {
    if !two_gpus() {
        return;
    }
    let (passed, timed_out) = in_child("child_one_shot_out_on_another_device", Duration::from_secs(45));
    assert!(passed && !timed_out, "an `out` of another device was accepted (timed out: {timed_out})");
}

#[test]
#[ignore = "needs two CUDA GPUs with NCCL (a child of another test)"]
fn child_one_shot_out_on_another_device() {
    if !is_child() {
        return;
    }
    const N: usize = 1024;
    let got = on_two_gpus(move |comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        let symm = symm_empty::<f32>(&comm, N, &stream).unwrap();
        fill(&symm, &stream, |_| 1.0);
        if rank == 0 {
            let other = CudaContext::new(1).unwrap();
            let other_stream = other.new_stream().unwrap();
            let mut out = other_stream.alloc_zeros::<f32>(N).unwrap();
            let r = symm.one_shot_all_reduce(&mut out, &stream);
            // Refused, and still part of the kernel's barriers: the stream completes.
            stream.synchronize().unwrap();
            assert!(
                matches!(r, Err(Error::WrongDevice { .. })),
                "rank 0: an `out` on GPU 1 for rank 0's all-reduce: {r:?}"
            );
        } else {
            let mut out = stream.alloc_zeros::<f32>(N).unwrap();
            symm.one_shot_all_reduce(&mut out, &stream).unwrap();
            stream.synchronize().unwrap();
            assert!(stream.clone_dtoh(&out).unwrap().iter().all(|&v| v == 2.0), "rank 1's sums");
        }
    });
    for (r, g) in got.iter().enumerate() {
        assert!(g.is_ok(), "rank {r}: {g:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Edge sizes
// ---------------------------------------------------------------------------------------------

/// Held? Zero, one and a few elements (no vector, a tail only): both all-reduces complete and
/// sum, and the pads are zero again afterwards (a second call on the same allocation works).
#[test]
#[ignore = "needs two CUDA GPUs with NCCL"]
fn held_tiny_sizes_reduce_and_leave_the_pads_clean() {
    if !two_gpus() {
        return;
    }
    let (passed, timed_out) = in_child("child_tiny_sizes", Duration::from_secs(45));
    assert!(passed && !timed_out, "timed out: {timed_out}");
}

#[test]
#[ignore = "needs two CUDA GPUs with NCCL (a child of another test)"]
fn child_tiny_sizes() {
    if !is_child() {
        return;
    }
    let got = on_two_gpus(|comm| {
        let rank = comm.rank();
        let stream = comm.context().new_stream().unwrap();
        for n in [0usize, 1, 3, 5] {
            let symm = symm_empty::<f32>(&comm, n, &stream).unwrap();
            for round in 0..2 {
                fill(&symm, &stream, |i| (i + rank + round) as f32);
                let mut out = stream.alloc_zeros::<f32>(n.max(1)).unwrap();
                symm.one_shot_all_reduce(&mut out, &stream).unwrap();
                symm.two_shot_all_reduce_in_place(&stream).unwrap();
                stream.synchronize().unwrap();
                let want: Vec<f32> = (0..n).map(|i| (2 * (i + round) + 1) as f32).collect();
                let one = stream.clone_dtoh(&out).unwrap();
                assert_eq!(&one[..n], &want[..], "one-shot, n = {n}, rank {rank}");
                let mut two = vec![0f32; n];
                if n > 0 {
                    stream.memcpy_dtoh(&symm.peer(rank, &stream).unwrap(), &mut two).unwrap();
                }
                assert_eq!(two, want, "two-shot, n = {n}, rank {rank}");
                symm.barrier(0, &stream).unwrap();
            }
            stream.synchronize().unwrap();
        }
    });
    for (r, g) in got.iter().enumerate() {
        assert!(g.is_ok(), "rank {r}: {g:?}");
    }
}
