#!/usr/bin/env bash
# Latency comparisons on one core, the least contended one at the time, both systems on it.
#
# The GPU hosts are virtual machines whose cores are not equally fast from one minute to the next:
# on `nvidia-h100-x1` (2026-11-26) the simulated device's 4 KiB pair took 31-36 ns on some cores
# and 46-58 ns on others at the same moment, and which cores were slow changed within a minute
# (steal time: other guests on the same physical cores). A run of `compare.sh latency` left to
# the scheduler measures whichever cores its threads land on, so two runs a minute apart disagree
# by 1.5x. Each round here probes every core with that pair (0.1 s each; the number is
# mempool's own, but only says how fast the core is now), then runs the comparison pinned to
# the fastest core (`taskset`: PyTorch's harness and mempool-bench on the same core, one after
# the other, as `compare.sh` runs them), then probes that core again, and prints the steal time
# each core had during the round. Every round is printed: none is dropped.
#
#   bash mempool-bench/harness/core_rounds.sh latency [rounds]   # .gpu/anchors/compare.sh latency
#   bash mempool-bench/harness/core_rounds.sh pinned [rounds]    # pinned.sh (pinned host memory)
#   bash mempool-bench/harness/core_rounds.sh interleave [runs]  # see below
#
# `interleave` runs the anchors' PyTorch latency harness and `mempool-bench latency` one after the
# other `runs` times (4 by default) on the core the probe picks, and prints every run and, per
# row, the least time of each side and their ratio: the time with the least interference, as
# latency benchmarks usually report it (noise only adds). It builds the harness through one
# `compare.sh latency` run first (whose table it prints too).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${MEMPOOL_BENCH:-$root/.gpu/bin/mempool-bench}
[[ -x $bin ]] || { echo "no mempool-bench at $bin (gpu-bundle, then bundle.sh)"; exit 2; }
what=${1:-latency}
rounds=${2:-$([[ $what == interleave ]] && echo 4 || echo 2)}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# ns per 4 KiB alloc+free pair on the simulated device, pinned to core $1.
probe_core() {
  MEMPOOL_BENCH_SIZES=4096 MEMPOOL_BENCH_ITERS=100000 taskset -c "$1" "$bin" latency pair --backend sim 2>/dev/null |
    awk '{print $3}'
}
# Steal time (clock ticks) per core, from /proc/stat.
steal() { awk '/^cpu[0-9]/ {print $9}' /proc/stat; }

cores=$(nproc)
if [[ $what == interleave ]]; then
  bash "$root/.gpu/anchors/compare.sh" latency 2>&1 | tail -9
  [[ -x /tmp/torch_allocbench ]] || { echo "compare.sh did not build /tmp/torch_allocbench"; exit 1; }
  best=0
  best_ns=1000000
  for c in $(seq 0 $((cores - 1))); do
    ns=$(probe_core "$c")
    if awk -v a="$ns" -v b="$best_ns" 'BEGIN {exit !(a < b)}'; then best=$c; best_ns=$ns; fi
  done
  echo "== interleaved on core $best ($best_ns ns probe), $rounds runs of each"
  t=$(mktemp)
  m=$(mktemp)
  for r in $(seq 1 "$rounds"); do
    CUDA_VISIBLE_DEVICES=0 taskset -c "$best" /tmp/torch_allocbench > "$t.$r" 2>&1
    CUDA_VISIBLE_DEVICES=0 taskset -c "$best" "$bin" latency > "$m.$r" 2>/dev/null
  done
  echo "== core $best probed again: $(probe_core "$best") ns"
  python3 - "$t" "$m" "$rounds" <<'PY'
import sys
t, m, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = {}
for r in range(1, n + 1):
    for l in open(f"{t}.{r}"):
        w = l.split()
        if l.startswith("pair("): rows.setdefault(("pair", w[2]), ([], []))[0].append(float(w[3]))
        elif l.startswith("mixed "): rows.setdefault(("mixed", w[3]), ([], []))[0].append(float(w[4]))
    for l in open(f"{m}.{r}"):
        w = l.split()
        if len(w) == 3 and w[0] in ("pair", "mixed") and (w[0], w[1]) in rows:
            rows[(w[0], w[1])][1].append(float(w[2]))
print("%-6s %10s  %-40s %-40s %s" % ("kind", "param", "torch ns, each run", "mempool ns, each run", "min/min"))
for (k, p), (a, b) in rows.items():
    if a and b:
        print("%-6s %10s  %-40s %-40s %6.2f" % (k, p, " ".join("%.1f" % x for x in a), " ".join("%.1f" % x for x in b), min(a) / min(b)))
PY
  exit 0
fi
for r in $(seq 1 "$rounds"); do
  probes=""
  best=0
  best_ns=1000000
  for c in $(seq 0 $((cores - 1))); do
    ns=$(probe_core "$c")
    probes+="$c:$ns "
    if awk -v a="$ns" -v b="$best_ns" 'BEGIN {exit !(a < b)}'; then best=$c; best_ns=$ns; fi
  done
  echo "== round $r: probe ns per pair, core:ns: $probes"
  echo "== round $r: pinned to core $best ($best_ns ns)"
  before=$(steal)
  case $what in
  latency) taskset -c "$best" bash "$root/.gpu/anchors/compare.sh" latency 2>&1 | tail -9 ;;
  pinned) MEMPOOL_BENCH=$bin taskset -c "$best" bash "$here/pinned.sh" 2>&1 | grep -v "segment allocations" ;;
  *) echo "usage: core_rounds.sh latency|pinned|interleave [rounds]"; exit 2 ;;
  esac
  after=$(steal)
  echo "== round $r: core $best probed again: $(probe_core "$best") ns"
  echo "== round $r: steal ticks per core during the round: $(paste -d' ' <(echo "$before") <(echo "$after") | awk '{printf "%d:%d ", NR-1, $2-$1}')"
done
