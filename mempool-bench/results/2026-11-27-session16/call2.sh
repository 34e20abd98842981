#!/usr/bin/env bash
# Session 16, call 2: compare.sh threads (16 streams, then one shared stream) with the release-lto
# build, and compare.sh replay a second time (both sides expandable).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
cp .gpu/bin/mempool-bench-lto .gpu/bin/mempool-bench
echo "== compare.sh threads (release-lto)"
bash .gpu/anchors/compare.sh threads 2>&1 | tail -30
echo "== compare.sh replay, both expandable (release-lto)"
MEMPOOL_ALLOC_CONF=expandable_segments:True bash .gpu/anchors/compare.sh replay .gpu/traces/*.trace 2>&1 | tail -14
} 2>&1 | tee $OUT/call2-output.txt
