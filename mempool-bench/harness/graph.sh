#!/usr/bin/env bash
# graph.sh: CUDA-graph capture with pools, mempool against PyTorch, in one run on one GPU machine.
#   bash graph.sh TRACE...
# Each trace's allocations captured into a graph: the bytes the graph's pool reserves (mempool's
# `mempool-bench graph`, PyTorch's private pool from graph_anchor.py, with and without
# expandable_segments), then `mempool-bench graph-launch`: a replay through mempool's `Graph`
# against cudarc's launch of the same graph. MEMPOOL_BENCH: the binary (default .gpu/bin/mempool-bench,
# then target/release/mempool-bench); OUT: where the raw outputs go (default a new /tmp folder).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
bench=${MEMPOOL_BENCH:-}
[[ -z $bench && -x $root/.gpu/bin/mempool-bench ]] && bench=$root/.gpu/bin/mempool-bench
[[ -z $bench ]] && bench=$root/target/release/mempool-bench
out=${OUT:-$(mktemp -d /tmp/mempool-graph.XXXXXX)}
[[ $# -ge 1 ]] || { echo "usage: bash graph.sh TRACE..." >&2; exit 2; }
"$bench" graph "$@" --backend cuda > "$out/mempool_graph.txt" || exit 1
"$PY" "$here/graph_anchor.py" "$@" > "$out/torch_graph.txt" || exit 1
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$PY" "$here/graph_anchor.py" "$@" > "$out/torch_expand_graph.txt" || exit 1
"$bench" graph-launch > "$out/graph_launch.txt" || exit 1
cat "$out"/mempool_graph.txt "$out"/torch_graph.txt "$out"/torch_expand_graph.txt "$out"/graph_launch.txt
"$PY" - "$out" <<'PYEOF'
import sys, os
d = sys.argv[1]
rows = {}
for f in ["mempool_graph.txt", "torch_graph.txt", "torch_expand_graph.txt"]:
    for line in open(os.path.join(d, f)):
        w = line.split()
        kv = dict(x.split("=", 1) for x in w[3:])
        rows.setdefault(w[2], {})[w[0]] = int(kv["pool_reserved"])
print("\ngraph pool reserved after capture (bytes); ratio = PyTorch / mempool (expandable against expandable)")
print(f"{'trace':26} {'mempool':>14} {'torch':>14} {'ratio':>7} {'mempool_expand':>14} {'torch_expand':>14} {'ratio':>7}")
for t, r in rows.items():
    def pair(m, k):
        a, b = r.get(m), r.get(k)
        ratio = f"{b / a:>7.3f}" if a and b else f"{'-':>7}"
        return f"{a if a is not None else '-':>14} {b if b is not None else '-':>14} {ratio}"
    print(f"{t:26} {pair('mempool', 'torch')} {pair('mempool_expand', 'torch_expand')}")
PYEOF
