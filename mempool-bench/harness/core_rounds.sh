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
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${MEMPOOL_BENCH:-$root/.gpu/bin/mempool-bench}
[[ -x $bin ]] || { echo "no mempool-bench at $bin (gpu-bundle, then bundle.sh)"; exit 2; }
what=${1:-latency}
rounds=${2:-2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# ns per 4 KiB alloc+free pair on the simulated device, pinned to core $1.
probe_core() {
  MEMPOOL_BENCH_SIZES=4096 MEMPOOL_BENCH_ITERS=100000 taskset -c "$1" "$bin" latency pair --backend sim 2>/dev/null |
    awk '{print $3}'
}
# Steal time (clock ticks) per core, from /proc/stat.
steal() { awk '/^cpu[0-9]/ {print $9}' /proc/stat; }

cores=$(nproc)
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
  *) echo "usage: core_rounds.sh latency|pinned [rounds]"; exit 2 ;;
  esac
  after=$(steal)
  echo "== round $r: core $best probed again: $(probe_core "$best") ns"
  echo "== round $r: steal ticks per core during the round: $(paste -d' ' <(echo "$before") <(echo "$after") | awk '{printf "%d:%d ", NR-1, $2-$1}')"
done
