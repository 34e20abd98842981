"""Real PyTorch workloads under mempool and under PyTorch's own allocator, for issue 15's evidence.

    python3 workloads.py run gpt native      # one workload, one allocator; prints one JSON line
    python3 workloads.py compare              # every workload under native, native_expand and
                                              # mempool, each in its own process, then the table

Allocators: `native` (PyTorch's caching allocator), `native_expand` (the same with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), `mempool` (mempool_torch.use_mempool()),
`mempool_expand` (the same with MEMPOOL_ALLOC_CONF=expandable_segments:True).
Workloads: `gpt` (a GPT-2-like transformer trained with AdamW), `resnet` (a ResNet-like
convolutional net trained with SGD), `generate` (greedy autoregressive generation with the GPT,
a growing sequence every step), `streams` (backward on autograd's threads plus a side stream with
explicit synchronization). Same seed, deterministic algorithms: the losses and tokens must be
bitwise equal between allocators.
"""

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def setup(alloc):
    if alloc == "native_expand":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if alloc == "mempool_expand":
        os.environ["MEMPOOL_ALLOC_CONF"] = "expandable_segments:True"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    if alloc.startswith("mempool"):
        sys.path.insert(0, HERE)
        import mempool_torch

        mempool_torch.use_mempool()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def peaks(torch, alloc):
    if alloc.startswith("mempool"):
        import mempool_torch

        s = mempool_torch.memory_stats()
        return s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"]
    return torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()


def gpt_model(torch, vocab=8192, d=768, layers=8, heads=12, seq=256):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            mask = torch.ones(t, t, device=x.device, dtype=torch.bool).tril()
            att = (q @ k.transpose(-2, -1)) / (d // heads) ** 0.5
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln(x))

    return GPT()


def run_gpt(torch, steps):
    torch.manual_seed(0)
    m = gpt_model(torch).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses, times = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = torch.randint(0, 8192, (16, 257), device="cuda", generator=g)
        logits = m(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return {"losses": [v.hex() for v in losses], "times": times}


def run_resnet(torch, steps):
    nn = torch.nn
    torch.manual_seed(0)

    class Res(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.f = nn.Sequential(
                nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))

        def forward(self, x):
            return torch.relu(x + self.f(x))

    layers = [nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    for c_in, c in [(64, 64), (64, 128), (128, 256), (256, 512)]:
        if c != c_in:
            layers += [nn.Conv2d(c_in, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        layers += [Res(c), Res(c)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 100)]
    m = nn.Sequential(*layers).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(2)
    losses, times = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = torch.randn(128, 3, 32, 32, device="cuda", generator=g)
        y = torch.randint(0, 100, (128,), device="cuda", generator=g)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return {"losses": [v.hex() for v in losses], "times": times}


def run_generate(torch, steps):
    torch.manual_seed(0)
    m = gpt_model(torch).cuda().eval()
    g = torch.Generator(device="cuda").manual_seed(3)
    idx = torch.randint(0, 8192, (8, 16), device="cuda", generator=g)
    times = []
    with torch.no_grad():
        for _ in range(min(steps, 240)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            nxt = m(idx[:, -256:])[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
            times.append(time.perf_counter() - t0)
    return {"losses": [str(v) for v in idx[:, 16:].flatten().tolist()], "times": times}


def run_streams(torch, steps):
    """Backward runs on autograd's device threads; a side stream computes a regularizer, joined
    with wait_stream before its tensors are used or dropped."""
    torch.manual_seed(0)
    m = gpt_model(torch, d=256, layers=4, heads=4).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
    g = torch.Generator(device="cuda").manual_seed(4)
    side = torch.cuda.Stream()
    losses, times = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = torch.randint(0, 8192, (16, 129), device="cuda", generator=g)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            reg = sum((p.float() ** 2).sum() for p in m.parameters()) * 1e-6
        torch.cuda.current_stream().wait_stream(side)
        logits = m(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)) + reg
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return {"losses": [v.hex() for v in losses], "times": times}


WORKLOADS = {"gpt": run_gpt, "resnet": run_resnet, "generate": run_generate, "streams": run_streams}
ALLOCS = ["native", "native_expand", "mempool", "mempool_expand"]


def run(workload, alloc, steps):
    torch = setup(alloc)
    out = WORKLOADS[workload](torch, steps)
    torch.cuda.synchronize()
    reserved, allocated = peaks(torch, alloc)
    warm = out["times"][len(out["times"]) // 5:]
    print(json.dumps({
        "workload": workload, "alloc": alloc, "steps": len(out["times"]),
        "median_ms": statistics.median(warm) * 1e3, "mean_ms": statistics.mean(warm) * 1e3,
        "peak_reserved": reserved, "peak_allocated": allocated, "losses": out["losses"],
    }))


def compare(steps, workloads, allocs, rounds):
    rows = {}
    for r in range(rounds):
        for w in workloads:
            for a in allocs:
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "run", w, a, str(steps)],
                                   capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"# {w} {a} failed:\n{p.stderr[-3000:]}")
                    continue
                res = json.loads(p.stdout.strip().splitlines()[-1])
                rows.setdefault((w, a), []).append(res)
    print(f"# {rounds} round(s), allocators in turn; step time: median of the last 80% of steps; "
          "time ratio: best-of-rounds median / native's")
    print(f"{'workload':9} {'allocator':15} {'steps':>5} {'step_ms':>9} {'vs_native':>9} "
          f"{'peak_reserved_MiB':>17} {'peak_alloc_MiB':>14} {'bitwise_equal_to_native':>23}")
    for w in workloads:
        base = rows.get((w, "native"))
        for a in allocs:
            rs = rows.get((w, a))
            if not rs:
                continue
            ms = min(x["median_ms"] for x in rs)
            ratio = ms / min(x["median_ms"] for x in base) if base else float("nan")
            same = all(x["losses"] == base[0]["losses"] for x in rs) if base else False
            print(f"{w:9} {a:15} {rs[0]['steps']:>5} {ms:>9.3f} {ratio:>9.4f} "
                  f"{rs[0]['peak_reserved'] / 2**20:>17.1f} {rs[0]['peak_allocated'] / 2**20:>14.1f} {str(same):>23}")
    for (w, a), rs in rows.items():
        print(f"# {w} {a} step_ms by round: " + " ".join(f"{x['median_ms']:.3f}" for x in rs))


def micro(alloc, n=200_000):
    """Allocation + free pairs through PyTorch (torch.empty, then the tensor dropped), sizes
    cycling 512 B, 4 KiB, 64 KiB, 1 MiB: what the allocator interface costs per tensor."""
    torch = setup(alloc)
    sizes = [512, 4096, 65536, 1 << 20]
    for _ in range(2):
        t = time.perf_counter()
        for i in range(n):
            x = torch.empty(sizes[i & 3], dtype=torch.uint8, device="cuda")
            del x
        ns = (time.perf_counter() - t) / n * 1e9
    print(f"micro {alloc}: {ns:.0f} ns per torch.empty + del")


def capture(workload, path, steps):
    """Records `workload`'s allocations under PyTorch's allocator as a mempool-bench trace
    ("a <id> <bytes> <stream>" / "f <id>"), so `mempool-bench replay` can replay it anywhere."""
    torch = setup(os.environ.get("CAPTURE_ALLOC", "native"))
    torch.cuda.memory._record_memory_history(max_entries=5_000_000)
    WORKLOADS[workload](torch, steps)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    ids, nid, lines, addrs = {}, 0, [], []
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            ids[e["addr"]] = nid
            lines.append(f"a {nid} {e['size']} {e['stream']}")
            addrs.append(f"{nid} {e['addr']}")
            nid += 1
        elif e["action"] == "free_completed" and e["addr"] in ids:
            lines.append(f"f {ids.pop(e['addr'])}")
    open(path, "w").write("\n".join(lines) + "\n")
    # Where each allocation landed (id, address): to compare placement rules event by event.
    open(path + ".addr", "w").write("\n".join(addrs) + "\n")
    print(f"{workload}: events={len(lines)} peak_reserved={torch.cuda.max_memory_reserved()} "
          f"peak_allocated={torch.cuda.max_memory_allocated()}")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "micro":
        micro(sys.argv[2])
    elif len(sys.argv) >= 4 and sys.argv[1] == "capture":
        capture(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 20)
    elif len(sys.argv) >= 4 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 200)
    elif len(sys.argv) >= 2 and sys.argv[1] == "compare":
        steps = int(os.environ.get("STEPS", "200"))
        wl = os.environ.get("WORKLOADS", ",".join(WORKLOADS)).split(",")
        al = os.environ.get("ALLOCS", ",".join(ALLOCS)).split(",")
        compare(steps, wl, al, int(os.environ.get("ROUNDS", "2")))
    else:
        print(__doc__)
        sys.exit(2)
