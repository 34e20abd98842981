"""torch.distributed all-reduce (NCCL, one process per GPU) on tensors from a MemPool over
mempool registered with register_mem_pool, next to PyTorch's own registered pool
(MemPool(backend.mem_allocator)) and default tensors, in turns; results checked."""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, torch.distributed as dist, torch.multiprocessing as mp
os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on the shared hosts

ITERS = int(os.environ.get("ITERS", "20"))  # timed all-reduces per measurement
ROUNDS = int(os.environ.get("ROUNDS", "2"))  # measurements per pool, alternating; the best counts

def bench(t, iters=ITERS):
    for _ in range(5): dist.all_reduce(t)
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(iters): dist.all_reduce(t)
    torch.cuda.synchronize(); return (time.perf_counter() - s) / iters

def run(rank, world):
    import mempool_torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    torch.cuda.set_device(rank); dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    be = dist.distributed_c10d._get_default_group()._get_backend(dev)
    ours, theirs = mempool_torch.pool(), torch.cuda.MemPool(be.mem_allocator)
    rows = []
    for mb in [1, 16, 128, 1024]:
        n = mb * 2**20 // 4
        res = {}
        for name, pool in [("torch_reg", theirs), ("mempool_reg", ours)] * ROUNDS:
            with torch.cuda.use_mem_pool(pool):
                t = torch.full((n,), float(rank + 1), device=dev)
            be.register_mem_pool(pool)
            dist.all_reduce(t)
            want = world * (world + 1) / 2
            assert torch.all(t == want).item(), f"rank {rank}: wrong all-reduce result on {name}"
            res[name] = min(res.get(name, 1e9), bench(t))
            be.deregister_mem_pool(pool)
            del t
        bus = lambda s: 2 * (world - 1) / world * n * 4 / s / 1e9
        rows.append((mb, bus(res["torch_reg"]), bus(res["mempool_reg"]), res["torch_reg"] / res["mempool_reg"]))
    if rank == 0:
        print(f"world={world} torch={torch.__version__} nccl={torch.cuda.nccl.version()} iters={ITERS} rounds={ROUNDS}; every result checked")
        print("MiB  torch_reg_busbw_GBs  mempool_reg_busbw_GBs  mempool/torch")
        for r in rows: print("%5d %18.1f %20.1f %14.3f" % r)
    dist.destroy_process_group()

if __name__ == "__main__":
    w = torch.cuda.device_count(); mp.spawn(run, args=(w,), nprocs=w)
