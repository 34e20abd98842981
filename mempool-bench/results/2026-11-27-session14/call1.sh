#!/usr/bin/env bash
# Session 14, call 1 (code of 7592385): the GPU tests, then warm replays with both sides
# expandable (compare.sh replay, release-lto build of mempool-bench in place of the release one)
# and compare.sh latency with the release-lto build.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# run from the repository root (the device tool starts there)
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | egrep "Model name|^CPU\(s\)"
mkdir -p /tmp/logs; OUT=/tmp/logs bash .gpu/run.sh | grep -v "^ok "
cp .gpu/bin/mempool-bench /tmp/mempool-bench-release
cp .gpu/bin/mempool-bench-lto .gpu/bin/mempool-bench
echo "== compare.sh replay, both expandable (release-lto)"
MEMPOOL_ALLOC_CONF=expandable_segments:True bash .gpu/anchors/compare.sh replay .gpu/traces/*.trace 2>&1 | tail -14
echo "== compare.sh latency (release-lto)"
bash .gpu/anchors/compare.sh latency 2>&1 | tail -9
} 2>&1 | tee $OUT/m.txt
