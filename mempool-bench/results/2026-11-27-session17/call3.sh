#!/usr/bin/env bash
# Session 17, call 3 (code of `4dfc52e`, same warm machine as call 2): which run.sh lines call 2
# counted failed; `latency mixed` of the session's start code (`c3620e7`, mempool-bench-old) and
# of 4dfc52e in turns, three rounds (call 2's mixed row moved by 2x against earlier calls);
# compare.sh threads (16 threads on 16 streams, with PyTorch's and cudaMallocAsync's anchors),
# `mempool-bench threads --shared-stream` (all threads on one stream), then compare.sh replay a
# second time (both sides expandable), with the release-lto build.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== call 2's failed lines"
grep -h -E "FAILED|^not ok|fail" /tmp/logs/*.log 2>/dev/null | grep -v "0 failed" | head -10
cp .gpu/bin/mempool-bench-lto .gpu/bin/mempool-bench
for r in 1 2 3; do
  echo "== latency mixed round $r: c3620e7, then 4dfc52e"
  CUDA_VISIBLE_DEVICES=0 .gpu/bin/mempool-bench-old latency mixed 2>/dev/null
  CUDA_VISIBLE_DEVICES=0 .gpu/bin/mempool-bench latency mixed 2>/dev/null
done
echo "== compare.sh threads (release-lto)"
bash .gpu/anchors/compare.sh threads 2>&1 | tail -30
echo "== mempool-bench threads --shared-stream (release-lto)"
CUDA_VISIBLE_DEVICES=0 .gpu/bin/mempool-bench threads --shared-stream 2>&1 | tail -8
echo "== compare.sh replay, both expandable (release-lto)"
MEMPOOL_ALLOC_CONF=expandable_segments:True bash .gpu/anchors/compare.sh replay .gpu/traces/*.trace 2>&1 | tail -14
} 2>&1 | tee $OUT/call3-output.txt
