"""mempool as PyTorch's CUDA allocator: one file, no build step beyond the library.

    import mempool_torch
    mempool_torch.use_mempool()     # before the first CUDA tensor: every tensor comes from mempool

or, for one region only (PyTorch's caching allocator carves segments that mempool supplies):

    pool = mempool_torch.pool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(1 << 20, device="cuda")

The library is found at $MEMPOOL_TORCH_LIB, else next to this file, else in the workspace's
target/release (`cargo build --release -p mempool-torch`). mempool reads MEMPOOL_ALLOC_CONF
(expandable_segments:True, ...), as PyTorch reads PYTORCH_CUDA_ALLOC_CONF.

PyTorch does not pass Tensor.record_stream through this interface: synchronize other streams
that used a tensor before dropping it (see the crate docs of mempool-torch).
"""

import ctypes
import json
import os

import torch

_lib = None
_allocator = None
_raising = None


_path = None


def library_path():
    """The absolute path of libmempool_torch.so, worked out once (one copy of the library per
    process: the allocator and the statistics must be the same one's)."""
    global _path
    if _path is None:
        _path = _find_library()
    return _path


def _find_library():
    env = os.environ.get("MEMPOOL_TORCH_LIB")
    if env:
        return os.path.abspath(env)
    here = os.path.dirname(os.path.abspath(__file__))
    for p in (
        os.path.join(here, "libmempool_torch.so"),
        os.path.join(here, "..", "..", "target", "release", "libmempool_torch.so"),
    ):
        if os.path.exists(p):
            return os.path.abspath(p)
    raise FileNotFoundError(
        "libmempool_torch.so not found: set MEMPOOL_TORCH_LIB, or run cargo build --release -p mempool-torch"
    )


def _load():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(library_path())
        lib.mempool_empty_cache.restype = ctypes.c_int
        lib.mempool_memory_stats_json.restype = ctypes.c_ssize_t
        lib.mempool_memory_stats_json.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        lib.mempool_reset_peak_stats.restype = ctypes.c_int
        lib.mempool_reset_peak_stats.argtypes = [ctypes.c_int]
        lib.mempool_snapshot.restype = ctypes.c_int
        lib.mempool_snapshot.argtypes = [ctypes.c_int, ctypes.c_char_p]
        lib.mempool_forget_stream.restype = None
        lib.mempool_forget_stream.argtypes = [ctypes.c_int, ctypes.c_void_p]
        _lib = lib
    return _lib


def allocator():
    """The torch.cuda.memory.CUDAPluggableAllocator over mempool (made once)."""
    global _allocator
    if _allocator is None:
        _load()
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "mempool_malloc", "mempool_free")
    return _allocator


def use_mempool():
    """Makes mempool PyTorch's CUDA allocator for the rest of the process. Call it before the first
    CUDA tensor is made (PyTorch refuses to swap an allocator that has been used). Out of memory
    raises RuntimeError("CUDA out of memory (mempool): ...") with mempool's report."""
    global _raising
    if _raising is None:
        _load()
        # PyTorch does not check a null from this path: this entry point raises instead.
        _raising = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "mempool_malloc_or_raise", "mempool_free")
    torch.cuda.memory.change_current_allocator(_raising)


def pool():
    """A torch.cuda.MemPool whose segments come from mempool (use it with torch.cuda.use_mem_pool,
    or register it with a process group's backend, as torch.distributed's register_mem_pool)."""
    return torch.cuda.MemPool(allocator().allocator())


def _device(device):
    """A device index from None (the current device), an int, "cuda:1" or torch.device."""
    return torch.cuda._utils._get_device_index(device, optional=True)


def forget_stream(stream):
    """Before destroying a stream of your own (torch.cuda.Stream()): synchronize it, then call
    this, so a new stream that the driver gives the same handle gets blocks of its own."""
    _load().mempool_forget_stream(stream.device.index, ctypes.c_void_p(stream.cuda_stream))


def memory_stats(device=None):
    """mempool's statistics of `device` (default: the current one) with torch.cuda.memory_stats()'s
    keys: allocated_bytes.all.current, reserved_bytes.all.peak, num_alloc_retries, ..."""
    lib = _load()
    d = _device(device)
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lib.mempool_memory_stats_json(d, buf, size)
        if n < 0:
            raise RuntimeError(f"mempool: no statistics for device {d} (see stderr)")
        if n < size:
            return json.loads(buf.value.decode())
        size = n + 256  # the numbers grew meanwhile, or the first guess was short: again


def reset_peak_memory_stats(device=None):
    """Resets mempool's peaks of `device` (default: the current one)."""
    d = _device(device)
    if _load().mempool_reset_peak_stats(d) != 0:
        raise RuntimeError(f"mempool: reset_peak_stats on device {d} failed (see stderr)")


def snapshot(path, device=None):
    """Writes mempool's snapshot of `device` to `path` as PyTorch's pickle (pytorch.org/memory_viz
    reads it, as it reads torch.cuda.memory._dump_snapshot's)."""
    d = _device(device)
    if _load().mempool_snapshot(d, os.fsencode(path)) != 0:
        raise RuntimeError(f"mempool: snapshot of device {d} to {path} failed (see stderr)")


def empty_cache():
    """Gives mempool's wholly free cached segments back to the driver (torch.cuda.empty_cache())."""
    if _load().mempool_empty_cache() != 0:
        raise RuntimeError("mempool: empty_cache failed (see stderr)")
