"""ranks.py: what the harnesses' multi-GPU scripts (torch_allreduce.py, torch_symm.py) share: how
they start their ranks: one process per visible CUDA GPU (torch.multiprocessing), NCCL's rendezvous on a free port of
this machine. The scripts set the multicast-off variables before anything imports torch; the rank
processes inherit them. Also their option type, rank-0 printing, NCCL version and the
registered-pool API they look for."""
import argparse
import os
import socket
import sys

# What a registered-pool NCCL column needs (PyTorch 2.11): (where, attribute).
POOL_API = (("torch.cuda", "MemPool"), ("torch.cuda", "use_mem_pool"), ("backend", "mem_allocator"),
            ("backend", "register_mem_pool"), ("backend", "deregister_mem_pool"))


def positive(text):
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError("%r is not a positive whole number" % text)
    return v


def say(rank, text):
    if rank == 0:
        print(text, flush=True)


def nccl_version(torch):
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def spawn_ranks(name, rank_main, o):
    """Runs rank_main(rank, world, o) in one process per visible GPU. Returns the exit status: 0
    (a note says so when fewer than 2 GPUs are visible), 1 when torch or its NCCL backend is
    missing or a rank failed (a wrong result among them)."""
    try:
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp
    except ImportError as e:
        print("%s: cannot import torch: %s" % (name, e), file=sys.stderr)
        return 1
    if not (dist.is_available() and dist.is_nccl_available()):
        print("%s: this PyTorch (%s) has no NCCL backend for torch.distributed" % (name, torch.__version__),
              file=sys.stderr)
        return 1
    world = torch.cuda.device_count()
    if world < 2:
        print("# %s: skipped: %d CUDA GPU(s) visible (CUDA_VISIBLE_DEVICES=%s); an all-reduce "
              "comparison needs 2 or more" % (name, world, os.environ.get("CUDA_VISIBLE_DEVICES", "unset")),
              flush=True)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        mp.spawn(rank_main, args=(world, o), nprocs=world, join=True)
    except Exception as e:  # a rank raised (a wrong result among them) or died: the others are ended
        print("%s: FAILED: %s" % (name, e), file=sys.stderr)
        return 1
    return 0
