#!/usr/bin/env python3
"""torch_allreduce.py: PyTorch + NCCL all-reduce bus bandwidth on every local GPU, one process a GPU.

The PyTorch side of `compare.sh allreduce`: what mempool's `allreduce` example
(examples/examples/allreduce.rs) measures, through torch.distributed. float32 sum, in place
(`dist.all_reduce`), sizes MIN, 2*MIN, 4*MIN, ... up to MAX MiB, two columns:

  default  tensors from PyTorch's caching allocator, unregistered
  reg      tensors allocated inside torch.cuda.use_mem_pool(pool) with
           pool = torch.cuda.MemPool(backend.mem_allocator) (ncclMemAlloc memory), the pool
           registered with the communicator by backend.register_mem_pool(pool)

Per size and column: 5 warm-up calls, the first of them checked (rank r fills r+1, so every element
must then be n(n+1)/2), a barrier, then ITERS calls between two CUDA events on the current stream;
time per call = elapsed / ITERS. algbw = bytes / time, busbw = algbw * 2(n-1)/n, in GB/s (1e9 B/s).

Rank 0 prints `#` notes and one line a size:
    torch allreduce <MiB> default_us <x> default_busbw <y> reg_us <x> reg_busbw <y>
(reg_us and reg_busbw are `-` when this PyTorch lacks the registered-pool API; a note says so).

    python3 torch_allreduce.py [--min-mb N] [--max-mb N] [--iters N]     (1, 1024, 20)

Exit status 0 (with a message) when fewer than 2 GPUs are visible; 1 when a rank fails or a result
is wrong; 2 on a usage error. NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is set before torch,
and so NCCL, is loaded here or in any rank. Nothing here changes GPU clocks or modes.
"""
import os

# House rule on the shared GPU hosts: NVLink multicast stays off. Set before anything imports torch;
# the rank processes inherit it.
os.environ["NCCL_NVLS_ENABLE"] = "0"

import argparse  # noqa: E402
import sys  # noqa: E402

from ranks import POOL_API, nccl_version, positive, say, spawn_ranks  # noqa: E402

WARMUP = 5

def options(argv):
    p = argparse.ArgumentParser(prog="torch_allreduce.py",
                                description="PyTorch + NCCL all-reduce, default vs registered-pool tensors, one process a GPU")
    p.add_argument("--min-mb", type=positive, default=1, help="smallest size in MiB (1)")
    p.add_argument("--max-mb", type=positive, default=1024, help="largest size in MiB (1024); sizes double from --min-mb")
    p.add_argument("--iters", type=positive, default=20, help="timed calls per size and column (20)")
    o = p.parse_args(argv)
    if o.min_mb > o.max_mb:
        p.error("--min-mb %d is above --max-mb %d" % (o.min_mb, o.max_mb))
    return o


def sizes(o):
    mb = o.min_mb
    while mb <= o.max_mb:
        yield mb
        mb *= 2


def time_per_call(torch, dist, t, rank, world, iters, what):
    """Seconds per in-place all-reduce of `t`, after checking the first result."""
    want = float(world * (world + 1) // 2)
    dist.all_reduce(t)
    wrong = t != want
    if wrong.any().item():
        i = int(wrong.nonzero()[0].item())
        raise RuntimeError("rank %d: %s: after the first all-reduce element %d of %d is %r instead of %r"
                           % (rank, what, i, t.numel(), t[i].item(), want))
    for _ in range(WARMUP - 1):
        dist.all_reduce(t)
    dist.barrier(device_ids=[rank])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dist.all_reduce(t)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def figures(seconds, nbytes, factor):
    """(µs per call, busbw GB/s) as printed; `-` for a column not measured."""
    if seconds is None:
        return "-", "-"
    return "%.1f" % (seconds * 1e6), "%.1f" % (nbytes / seconds / 1e9 * factor)


def rank_main(rank, world, o):
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited already; never anything but 0
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    # device_id makes the communicator now: register_mem_pool needs one.
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world, device_id=dev)
    pg = dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cuda"))
    where = {"torch.cuda": torch.cuda, "backend": backend}
    missing = ["%s.%s" % (w, a) for w, a in POOL_API if not hasattr(where[w], a)]
    pool = None
    if missing:
        msg = ("torch_allreduce.py: this PyTorch (%s) has no %s: the registered-pool column (PyTorch 2.11's "
               "MemPool(backend.mem_allocator) + register_mem_pool) is not measured, its figures are `-`"
               % (torch.__version__, ", ".join(missing)))
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)
        say(rank, "# " + msg)
    else:
        pool = torch.cuda.MemPool(backend.mem_allocator)

    say(rank, "# torch allreduce: world %d, torch %s, NCCL %s, one process per GPU (torch.multiprocessing spawn)"
        % (world, torch.__version__, nccl_version(torch)))
    say(rank, "# float32 sum, in place (dist.all_reduce); time per call: CUDA events around %d calls on the current "
        "stream after a barrier, after %d warm-up calls (the first checked); busbw = algbw * 2(n-1)/n, GB/s"
        % (o.iters, WARMUP))
    say(rank, "# default: caching-allocator tensors; reg: tensors from torch.cuda.MemPool(backend.mem_allocator) "
        "(ncclMemAlloc), the pool registered with backend.register_mem_pool")
    factor = 2.0 * (world - 1) / world
    for mb in sizes(o):
        n = mb << 18  # MiB of float32
        nbytes = n * 4
        t = torch.full((n,), float(rank + 1), dtype=torch.float32, device=dev)
        default = time_per_call(torch, dist, t, rank, world, o.iters, "default tensor, %d MiB" % mb)
        del t
        if pool is None:
            reg = None
        else:
            with torch.cuda.use_mem_pool(pool):
                t = torch.full((n,), float(rank + 1), dtype=torch.float32, device=dev)
            # Registers every segment the pool holds now (those registered before are skipped).
            backend.register_mem_pool(pool)
            reg = time_per_call(torch, dist, t, rank, world, o.iters, "registered-pool tensor, %d MiB" % mb)
            del t
        du, db = figures(default, nbytes, factor)
        ru, rb = figures(reg, nbytes, factor)
        say(rank, "torch allreduce %d default_us %s default_busbw %s reg_us %s reg_busbw %s" % (mb, du, db, ru, rb))
    if pool is not None:
        backend.deregister_mem_pool(pool)
    torch.cuda.synchronize()
    say(rank, "# every result checked")
    dist.destroy_process_group()


def main(argv):
    return spawn_ranks("torch_allreduce.py", rank_main, options(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
