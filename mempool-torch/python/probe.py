"""Quick checks of mempool under PyTorch: statistics, snapshot, empty_cache, out of memory, bad
input. Prints one line per check and `probe: ok` at the end (exit 1 on a failed check)."""
import ctypes, os, pickle, sys, tempfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import mempool_torch

mempool_torch.use_mempool()
x = torch.ones(1 << 20, device="cuda")
s = mempool_torch.memory_stats()
assert s["allocated_bytes.all.current"] >= 4 << 20, s
print("stats: allocated", s["allocated_bytes.all.current"], "reserved", s["reserved_bytes.all.current"])
path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
mempool_torch.snapshot(path)
snap = pickle.load(open(path, "rb"))
assert any(seg["total_size"] >= 4 << 20 for seg in snap["segments"]), snap.keys()
print("snapshot: segments", len(snap["segments"]))
del x
mempool_torch.empty_cache()
s = mempool_torch.memory_stats()
print("after empty_cache: reserved", s["reserved_bytes.all.current"])
# Out of memory: PyTorch must raise, not hand out a null tensor.
try:
    y = torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    print("OOM: NO ERROR RAISED, data_ptr", y.data_ptr())
    sys.exit(1)
except Exception as e:
    print("OOM raised:", type(e).__name__, str(e).splitlines()[0][:200])
z = torch.ones(10, device="cuda")
assert z.sum().item() == 10
print("after OOM, still works")
lib = ctypes.CDLL(mempool_torch.library_path())
lib.mempool_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.mempool_free(ctypes.c_void_p(0x1234000), 64, 0, None)
lib.mempool_malloc.restype = ctypes.c_void_p
lib.mempool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
assert lib.mempool_malloc(1024, 77, None) is None
assert lib.mempool_malloc(-1, 0, None) is None
assert z.sum().item() == 10
print("bad input: messages above, nothing freed")
print("probe: ok")
