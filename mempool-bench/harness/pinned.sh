#!/usr/bin/env bash
# Pinned host memory: mempool's `Allocator::pinned` against PyTorch's caching host allocator in
# the same run (alloc+free pairs, the mixed workload and its peak reserved bytes).
#   bash mempool-bench/harness/pinned.sh   (GPU machine; .gpu/bin/mempool-bench from the bundle)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${MEMPOOL_BENCH:-$here/../../.gpu/bin/mempool-bench}
[[ -x $bin ]] || bin=.gpu/bin/mempool-bench
TORCH=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')
CUDA=${CUDA_HOME:-/usr/local/cuda}
g++ -O2 -std=c++17 -Wno-interference-size "$here/pinned_anchor.cpp" -o /tmp/pinned_anchor -I"$TORCH/include" -I"$CUDA/include" \
  -L"$TORCH/lib" -Wl,--no-as-needed -ltorch_cuda -ltorch_cpu -lc10_cuda -lc10 -L"$CUDA/lib64" -lcudart -Wl,-rpath,"$TORCH/lib:$CUDA/lib64"
for round in 1 2; do
  CUDA_VISIBLE_DEVICES=0 /tmp/pinned_anchor
  CUDA_VISIBLE_DEVICES=0 "$bin" latency pair mixed --backend pinned
  # PyTorch's host allocator rounds every size up to a power of two; the same rounding here
  # (`pinned_round_power2:True`) shows what it costs in reserved bytes on the mixed workload.
  echo "== power-of-two rounding (MEMPOOL_ALLOC_CONF=pinned_round_power2:True)"
  CUDA_VISIBLE_DEVICES=0 MEMPOOL_ALLOC_CONF=pinned_round_power2:True "$bin" latency mixed --backend pinned
  # PyTorch's two other host-allocator options: a reserve segment the small requests are carved
  # from, and a thread that files the blocks whose events completed.
  echo "== reserve segment and background thread (pinned_reserve_segment_size_mb:64,pinned_use_background_threads:True)"
  CUDA_VISIBLE_DEVICES=0 MEMPOOL_ALLOC_CONF=pinned_reserve_segment_size_mb:64,pinned_use_background_threads:True \
    "$bin" latency pair mixed --backend pinned
done
