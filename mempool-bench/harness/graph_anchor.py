"""PyTorch's side of `mempool-bench graph`: each trace's allocations and frees (all on one side
stream, the trace's stream column set aside, as mempool-bench does) captured into a CUDA graph
with `torch.cuda.graph`, whose private pool holds them; prints
`torch graph <trace> events=<n> pool_reserved=<bytes> live=<n>`: the bytes the capture added to
reserved memory (the private pool), with the trace's last live tensors kept.
Usage: python3 graph_anchor.py <trace>...   (PYTORCH_CUDA_ALLOC_CONF as the caller sets it)."""
import os, sys, warnings
import torch

def parse(path):
    ops = []
    with open(path) as f:
        for line in f:
            w = line.split()
            if not w or w[0].startswith("#"):
                continue
            if w[0] == "a":
                ops.append(("a", int(w[1]), int(w[2])))
            elif w[0] == "f":
                ops.append(("f", int(w[1]), 0))
    return ops

def main():
    name = "torch_expand" if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") else "torch"
    warnings.filterwarnings("ignore", message=".*empty.*")  # a capture of allocations only
    for path in sys.argv[1:]:
        ops = parse(path)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_stats().get("reserved_bytes.all.current", 0)
        g = torch.cuda.CUDAGraph()
        live = {}
        with torch.cuda.graph(g):
            for kind, i, n in ops:
                if kind == "a":
                    live[i] = torch.empty(n, dtype=torch.uint8, device="cuda")
                else:
                    live.pop(i, None)
        after = torch.cuda.memory_stats().get("reserved_bytes.all.current", 0)
        print(f"{name} graph {os.path.basename(path)} events={len(ops)} pool_reserved={after - before} live={len(live)}", flush=True)
        del g, live
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
