#!/usr/bin/env bash
# Latency comparisons on one core, the least contended one at the time, both systems on it.
#
# The GPU hosts are virtual machines whose cores are not equally fast from one minute to the next:
# on `nvidia-h100-x1` (2026-11-26) the simulated device's 4 KiB pair took 31-36 ns on some cores
# and 45-81 ns on others at the same moment, and which cores were slow changed within a minute,
# with no steal time seen by the guest (the slow cores run, more slowly, as a core whose sibling
# on the physical host is busy does). A run of `compare.sh latency` left to the scheduler
# measures whichever cores its threads land on, so two runs a minute apart disagree by 1.5x.
# Each round here probes every core this process may use with that pair (0.1 s each; the number
# is mempool's own, but only says how fast the core is now), then runs the comparison pinned to
# the fastest core (`taskset`: PyTorch's harness and mempool-bench on the same core, one after
# the other, as `compare.sh` runs them), then probes that core again, and prints the steal
# ticks each core had during the round. Every round is printed: none is dropped.
#
#   bash mempool-bench/harness/core_rounds.sh latency [rounds]   # .gpu/anchors/compare.sh latency
#   bash mempool-bench/harness/core_rounds.sh pinned [rounds]    # pinned.sh (pinned host memory)
#   bash mempool-bench/harness/core_rounds.sh interleave [runs]  # see below
#   bash mempool-bench/harness/core_rounds.sh interleave-pinned [runs]  # the same, pinned.sh's pair
#
# `interleave` runs the anchors' PyTorch latency harness and `mempool-bench latency` one after the
# other `runs` times (4 by default) on the core the probe picks, and prints every run ("-" where a
# run gave no figure for a row) and, per row, the least time of each side and their ratio: the
# time with the least interference, as latency benchmarks usually report it (noise only adds).
# It builds the harness through one `compare.sh latency` run first (whose table it prints too).
# `interleave-pinned` does the same with pinned host memory: PyTorch's caching host allocator
# (pinned_anchor.cpp, built here as pinned.sh builds it) and `mempool-bench latency pair mixed
# --backend pinned`.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${MEMPOOL_BENCH:-$root/.gpu/bin/mempool-bench}
[[ -x $bin ]] || { echo "no mempool-bench at $bin (gpu-bundle, then bundle.sh)"; exit 2; }
what=${1:-latency}
case $what in
latency | pinned) rounds=${2:-2} ;;
interleave | interleave-pinned) rounds=${2:-4} ;;
*) echo "usage: core_rounds.sh latency|pinned|interleave|interleave-pinned [rounds]"; exit 2 ;;
esac
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The workloads as the anchors define them, whatever the caller's environment says.
unset MEMPOOL_BENCH_ITERS MEMPOOL_BENCH_SIZES
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The cores this process may run on (its affinity list, e.g. "0-3,8,10-11"), one per line.
allowed_cores() {
  taskset -pc $$ | sed 's/.*: *//' | tr ',' '\n' | awk -F- '{ if (NF == 2) for (c = $1; c <= $2; c++) print c; else print $1 }'
}
# ns per 4 KiB alloc+free pair on the simulated device, pinned to core $1 (empty if it failed).
probe_core() {
  MEMPOOL_BENCH_SIZES=4096 MEMPOOL_BENCH_ITERS=100000 taskset -c "$1" "$bin" latency pair --backend sim 2>/dev/null |
    awk '$3 ~ /^[0-9.]+$/ {print $3}'
}
# Probes every allowed core: sets `best` and `best_ns`, and `probes` ("core:ns ...").
pick_core() {
  probes=""
  best=""
  best_ns=""
  local c ns
  for c in $(allowed_cores); do
    ns=$(probe_core "$c")
    probes+="$c:${ns:-failed} "
    [[ -n $ns ]] || continue
    if [[ -z $best ]] || awk -v a="$ns" -v b="$best_ns" 'BEGIN {exit !(a + 0 < b + 0)}'; then
      best=$c
      best_ns=$ns
    fi
  done
  [[ -n $best ]] || { echo "no core gave a probe figure: $probes"; exit 1; }
}
# Steal time (clock ticks) per core, from /proc/stat: "cpuN ticks" lines.
steal() { awk '/^cpu[0-9]/ {print $1, $9}' /proc/stat; }

if [[ $what == interleave* ]]; then
  if [[ $what == interleave ]]; then
    rm -f /tmp/torch_allocbench
    bash "$root/.gpu/anchors/compare.sh" latency 2>&1 | tail -9
    [[ -x /tmp/torch_allocbench ]] || { echo "compare.sh did not build /tmp/torch_allocbench"; exit 1; }
    anchor=(/tmp/torch_allocbench)
    ours=("$bin" latency)
  else
    TORCH=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')
    CUDA=${CUDA_HOME:-/usr/local/cuda}
    g++ -O2 -std=c++17 -Wno-interference-size "$here/pinned_anchor.cpp" -o "$tmp/pinned_anchor" -I"$TORCH/include" \
      -I"$CUDA/include" -L"$TORCH/lib" -Wl,--no-as-needed -ltorch_cuda -ltorch_cpu -lc10_cuda -lc10 -L"$CUDA/lib64" \
      -lcudart -Wl,-rpath,"$TORCH/lib:$CUDA/lib64" || { echo "pinned_anchor.cpp did not build"; exit 1; }
    anchor=("$tmp/pinned_anchor")
    ours=("$bin" latency pair mixed --backend pinned)
  fi
  pick_core
  echo "== probe ns per pair, core:ns: $probes"
  echo "== interleaved on core $best ($best_ns ns probe), $rounds runs of each"
  for r in $(seq 1 "$rounds"); do
    CUDA_VISIBLE_DEVICES=0 taskset -c "$best" "${anchor[@]}" > "$tmp/t.$r" 2>&1 ||
      echo "run $r: PyTorch's harness failed: $(tail -1 "$tmp/t.$r")"
    CUDA_VISIBLE_DEVICES=0 taskset -c "$best" "${ours[@]}" > "$tmp/m.$r" 2> "$tmp/m.$r.err" ||
      echo "run $r: mempool-bench failed: $(tail -1 "$tmp/m.$r.err")"
  done
  echo "== core $best probed again: $(probe_core "$best") ns"
  python3 - "$tmp" "$rounds" <<'PY'
import sys
d, n = sys.argv[1], int(sys.argv[2])
rows = {}  # (kind, param) -> ([torch ns or None per run], [mempool ns or None per run])
def row(k):
    return rows.setdefault(k, ([None] * n, [None] * n))
for r in range(n):
    for l in open(f"{d}/t.{r + 1}"):
        w = l.split()
        if l.startswith("pair(") and len(w) > 3: row(("pair", w[2]))[0][r] = float(w[3])
        elif l.startswith("mixed ") and len(w) > 4: row(("mixed", w[3]))[0][r] = float(w[4])
        # pinned_anchor.cpp: "torch_pinned pair SIZE NS", "torch_pinned mixed LIVE NS reserved_peak ..."
        elif w[:1] == ["torch_pinned"] and len(w) > 3 and w[1] in ("pair", "mixed"): row((w[1], w[2]))[0][r] = float(w[3])
    for l in open(f"{d}/m.{r + 1}"):
        w = l.split()
        if len(w) == 3 and w[0] in ("pair", "mixed"): row((w[0], w[1]))[1][r] = float(w[2])
cell = lambda xs: " ".join("-" if x is None else "%.1f" % x for x in xs)
print("%-6s %10s  %-40s %-40s %s" % ("kind", "param", "torch ns, each run", "mempool ns, each run", "min/min"))
for (k, p), (a, b) in rows.items():
    sa, sb = [x for x in a if x is not None], [x for x in b if x is not None]
    ratio = "%6.2f" % (min(sa) / min(sb)) if sa and sb else "     -"
    print("%-6s %10s  %-40s %-40s %s" % (k, p, cell(a), cell(b), ratio))
PY
  exit 0
fi
for r in $(seq 1 "$rounds"); do
  pick_core
  echo "== round $r: probe ns per pair, core:ns: $probes"
  echo "== round $r: pinned to core $best ($best_ns ns)"
  before=$(steal)
  case $what in
  latency) taskset -c "$best" bash "$root/.gpu/anchors/compare.sh" latency 2>&1 | tail -9 ;;
  pinned) MEMPOOL_BENCH=$bin taskset -c "$best" bash "$here/pinned.sh" 2>&1 | grep -v "segment allocations" ;;
  esac
  after=$(steal)
  echo "== round $r: core $best probed again: $(probe_core "$best") ns"
  echo "== round $r: steal ticks per core during the round: $(paste -d' ' <(echo "$before") <(echo "$after") | awk '{printf "%s:%d ", substr($1, 4), $4 - $2}')"
done
