#!/usr/bin/env python3
"""torch_symm.py: PyTorch symmetric-memory one-shot all-reduce against NCCL, small sizes, one process a GPU.

The PyTorch anchor for issue 16: what mempool's `symm_allreduce` example
(examples/examples/symm_allreduce.rs) measures, through PyTorch 2.11's symmetric memory
(torch.distributed._symmetric_memory, its default backend) and torch.distributed + NCCL, on every
visible GPU. float32 sum, sizes 4 KiB, 8 KiB, 16 KiB, ... 1 MiB (powers of two, in bytes):

  nccl      dist.all_reduce in place on the first `bytes` of a 1 MiB tensor allocated inside
            torch.cuda.use_mem_pool(pool), pool = torch.cuda.MemPool(backend.mem_allocator)
            (ncclMemAlloc memory) registered by backend.register_mem_pool(pool), as
            torch_allreduce.py's `reg` column; default (caching-allocator) tensors where this PyTorch
            lacks that API (a note says which)
  symm      torch.ops.symm_mem.one_shot_all_reduce(t, "sum", group_name), out of place (a new output
            tensor a call), t the first `bytes` of one 1 MiB buffer from symm_mem.empty that every rank
            made and symm_mem.rendezvous'd once with the world group
  barrier   handle.barrier(channel=0) on that buffer's rendezvous handle, alone

Per size and column: 5 warm-up calls, the first checked (rank r fills r+1, so every element must
then be n(n+1)/2 on every rank), a barrier, then ITERS calls between two CUDA events on the current
stream; time per call = elapsed / ITERS, each rank's time all-reduced with MAX (the slowest rank).
busbw = bytes / time * 2(n-1)/n, in GB/s (1e9 B/s), as nccl-tests and `symm_allreduce` compute it.
Both columns include what a call spends on the host (Python, dispatch) when that is longer than the
transfer, which at these sizes it may be.

Rank 0 prints `#` notes and one line a size, the columns of `symm_allreduce`
(bytes nccl_us nccl_busbw symm_us symm_busbw) by name:
    torch_symm <bytes> nccl_us <x> nccl_busbw <y> symm_us <x> symm_busbw <y>
and after them
    torch_symm barrier_us <x>
(symm_us, symm_busbw and barrier_us are `-`, with a note, when this PyTorch lacks symmetric memory,
the one-shot op or the handle's barrier).

    python3 mempool-bench/harness/torch_symm.py [--iters N]     (1000)

Exit status 0 (with a message) when fewer than 2 GPUs are visible; 1 when a rank fails (a wrong
result among the reasons); 2 on a usage error. NVLink multicast stays off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set, over any value given, before
torch is imported here or in any rank. Nothing here changes GPU clocks or modes.
"""
import os

# House rule on the shared GPU hosts: NVLink multicast stays off, for NCCL (NVLS), for PyTorch's
# symmetric memory (no multicast object at rendezvous) and for NVSHMEM should a backend load it.
# Forced, whatever the caller set, before anything imports torch; the rank processes inherit them.
MULTICAST_OFF = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"))
for _name, _value in MULTICAST_OFF:
    os.environ[_name] = _value

import argparse  # noqa: E402
import sys  # noqa: E402

from ranks import POOL_API, nccl_version, positive, say, spawn_ranks  # noqa: E402

WARMUP = 5
SIZES = [4096 << k for k in range(9)]  # 4 KiB .. 1 MiB

def options(argv):
    p = argparse.ArgumentParser(prog="torch_symm.py",
                                description="PyTorch symmetric-memory one-shot all-reduce and barrier against NCCL's "
                                            "all-reduce, 4 KiB to 1 MiB, one process a GPU")
    p.add_argument("--iters", type=positive, default=1000, help="timed calls per size and column (1000)")
    return p.parse_args(argv)


def check(rank, out, want, what):
    """Fails the rank, naming element and value, unless every element of `out` is `want`."""
    wrong = out != want
    if wrong.any().item():
        i = int(wrong.nonzero()[0].item())
        raise RuntimeError("rank %d: %s: after the first call element %d of %d is %r instead of %r"
                           % (rank, what, i, out.numel(), out[i].item(), want))


def timed(torch, dist, rank, iters, call):
    """Seconds per call of `call`: ITERS calls between two CUDA events, after a barrier."""
    dist.barrier(device_ids=[rank])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def slowest(torch, dist, dev, values):
    """Every rank's values (seconds; None: not measured, the same on every rank) → the largest of each."""
    x = torch.tensor([-1.0 if v is None else v for v in values], dtype=torch.float64, device=dev)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return [v if v > 0 else None for v in x.tolist()]


def us(seconds):
    return "-" if seconds is None else "%.2f" % (seconds * 1e6)


def busbw(seconds, nbytes, factor):
    return "-" if seconds is None else "%.2f" % (nbytes / seconds / 1e9 * factor)


def torch_release(torch):
    """(major, minor) of torch.__version__, (0, 0) when it does not parse."""
    try:
        return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return (0, 0)


def symm_setup(torch, dist, rank, dev, n):
    """(symm_mem module, one-shot op, group name, n-element buffer, rendezvous handle, notes).

    Returns None for the module, op or handle (and says why in the notes) where this PyTorch lacks
    the API: that is the same on every rank, so every rank skips the same calls. A failure past
    that (an allocation, the rendezvous) raises: the rank ends and the run fails, rather than
    leaving another rank waiting in a collective this one left."""
    notes = []
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return None, None, None, None, None, ["this PyTorch has no torch.distributed._symmetric_memory (%s)" % e]
    missing = [a for a in ("empty", "rendezvous") if not hasattr(symm_mem, a)]
    if missing:
        return None, None, None, None, None, ["torch.distributed._symmetric_memory has no %s" % ", ".join(missing)]
    group = dist.group.WORLD
    group_name = group.group_name
    # The op's schema (SymmetricMemory.cpp): one_shot_all_reduce(Tensor input, str reduce_op, str group_name) -> Tensor
    try:
        op = torch.ops.symm_mem.one_shot_all_reduce
    except (AttributeError, RuntimeError):  # an op PyTorch does not have is an AttributeError (RuntimeError in some)
        op = None
    if op is None:
        notes.append("this PyTorch has no torch.ops.symm_mem.one_shot_all_reduce: symm_us and symm_busbw are `-`")
    # Before 2.11 the group had to be enabled first; 2.11 deprecates that call ("no need to call this function
    # anymore": the store comes from the ProcessGroup in C++). It is not called there: in the main-branch source
    # read, a group registered that way (set_group_info) makes every C++ rendezvous, which the op does on each
    # call, check the ranks' allocation ids through the store, a host round trip a call.
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        if getattr(enable, "__deprecated__", None) is not None or torch_release(torch) >= (2, 11):
            notes.append("symm_mem.enable_symm_mem_for_group not called (deprecated in this PyTorch, not needed)")
        else:
            enable(group_name)
            notes.append("symm_mem.enable_symm_mem_for_group(%r) called (this PyTorch needs it)" % group_name)
    buf = symm_mem.empty(n, dtype=torch.float32, device=dev)
    buf.fill_(float(rank + 1))
    # rendezvous(tensor, group): PyTorch 2.11 takes a ProcessGroup or a group name; older releases take
    # (tensor, group_name=None) and refuse a ProcessGroup with a TypeError before any exchange.
    try:
        handle = symm_mem.rendezvous(buf, group)
        how = "symm_mem.rendezvous(buf, dist.group.WORLD)"
    except TypeError:
        handle = symm_mem.rendezvous(buf, group_name)
        how = "symm_mem.rendezvous(buf, %r)" % group_name
    if handle is None:
        raise RuntimeError("rank %d: %s returned None: the buffer from symm_mem.empty is not symmetric memory" % (rank, how))
    notes.append("symm: one buffer of %d bytes from symm_mem.empty, %s once; backend %s; sizes are its first `bytes`"
                 % (n * 4, how, backend_name(symm_mem, dev)))
    if not hasattr(handle, "barrier"):
        notes.append("the rendezvous handle has no barrier(): barrier_us is `-`")
    return symm_mem, op, group_name, buf, handle, notes


def backend_name(symm_mem, dev):
    get = getattr(symm_mem, "get_backend", None)
    if get is None:
        return "(not reported by this PyTorch)"
    try:
        return str(get(dev))
    except Exception as e:  # only a name for a note
        return "(get_backend: %s)" % e


def rank_main(rank, world, o):
    for name, value in MULTICAST_OFF:  # inherited already; never anything else
        os.environ[name] = value
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    # device_id makes the communicator now: register_mem_pool needs one.
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world, device_id=dev)
    pg = dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cuda"))
    top = SIZES[-1] // 4  # float32 elements in the largest size

    say(rank, "# torch_symm: world %d, torch %s, NCCL %s, one process per GPU (torch.multiprocessing spawn)"
        % (world, torch.__version__, nccl_version(torch)))
    say(rank, "# multicast off: %s" % " ".join("%s=%s" % nv for nv in MULTICAST_OFF))
    say(rank, "# float32 sum; time per call: CUDA events around %d calls on the current stream after a barrier, "
        "after %d warm-up calls (the first checked); the slowest rank's time; busbw = bytes/time * 2(n-1)/n, GB/s"
        % (o.iters, WARMUP))

    # NCCL: one tensor of the largest size, from the registered pool where this PyTorch has it.
    where = {"torch.cuda": torch.cuda, "backend": backend}
    missing = ["%s.%s" % (w, a) for w, a in POOL_API if not hasattr(where[w], a)]
    pool = None
    if missing:
        nbuf = torch.empty(top, dtype=torch.float32, device=dev)
        say(rank, "# nccl: dist.all_reduce in place on default (caching-allocator, unregistered) tensors: this "
            "PyTorch (%s) has no %s" % (torch.__version__, ", ".join(missing)))
    else:
        pool = torch.cuda.MemPool(backend.mem_allocator)
        with torch.cuda.use_mem_pool(pool):
            nbuf = torch.empty(top, dtype=torch.float32, device=dev)
        backend.register_mem_pool(pool)
        say(rank, "# nccl: dist.all_reduce in place on a tensor from torch.cuda.MemPool(backend.mem_allocator) "
            "(ncclMemAlloc), the pool registered with backend.register_mem_pool")

    symm_mem, op, group_name, sbuf, handle, notes = symm_setup(torch, dist, rank, dev, top)
    for note in notes:
        say(rank, "# " + note)
    if symm_mem is None:
        say(rank, "# no symmetric memory: symm_us, symm_busbw and barrier_us are `-`")
    elif op is not None:
        say(rank, "# symm: torch.ops.symm_mem.one_shot_all_reduce(t, \"sum\", %r), out of place" % group_name)
    torch.cuda.synchronize()

    want = float(world * (world + 1) // 2)
    factor = 2.0 * (world - 1) / world
    for nbytes in SIZES:
        n = nbytes // 4
        t = nbuf[:n]
        t.fill_(float(rank + 1))
        dist.all_reduce(t)
        check(rank, t, want, "NCCL all-reduce, %d bytes" % nbytes)
        for _ in range(WARMUP - 1):
            dist.all_reduce(t)
        nccl = timed(torch, dist, rank, o.iters, lambda: dist.all_reduce(t))
        symm = None
        if op is not None:
            s = sbuf[:n]  # every element rank + 1 since setup: the op only reads it
            out = op(s, "sum", group_name)
            check(rank, out, want, "one_shot_all_reduce, %d bytes" % nbytes)
            del out
            for _ in range(WARMUP - 1):
                op(s, "sum", group_name)
            symm = timed(torch, dist, rank, o.iters, lambda: op(s, "sum", group_name))
        nccl, symm = slowest(torch, dist, dev, [nccl, symm])
        say(rank, "torch_symm %d nccl_us %s nccl_busbw %s symm_us %s symm_busbw %s"
            % (nbytes, us(nccl), busbw(nccl, nbytes, factor), us(symm), busbw(symm, nbytes, factor)))

    barrier = None
    if handle is not None and hasattr(handle, "barrier"):
        for _ in range(WARMUP):
            handle.barrier(channel=0)
        torch.cuda.synchronize()
        barrier = timed(torch, dist, rank, o.iters, lambda: handle.barrier(channel=0))
    barrier, = slowest(torch, dist, dev, [barrier])
    say(rank, "torch_symm barrier_us %s" % us(barrier))

    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    if pool is not None:
        backend.deregister_mem_pool(pool)
    del handle, sbuf, nbuf
    say(rank, "# every result checked")
    dist.destroy_process_group()


def main(argv):
    return spawn_ranks("torch_symm.py", rank_main, options(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
