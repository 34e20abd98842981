#!/usr/bin/env bash
# Session 17, call 2 (code of `4dfc52e`: the cheap solo census, the retired counters committed at the end of each section that wrote them): the
# GPU tests, then compare.sh latency and compare.sh replay (both sides expandable) with the
# release-lto build of mempool-bench in place of the release one.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# run from the repository root (the device tool starts there)
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | egrep "Model name|^CPU\(s\)"
mkdir -p /tmp/logs; OUT=/tmp/logs bash .gpu/run.sh | grep -v "^ok "
grep -h "test result" /tmp/logs/oom_races-test.log 2>/dev/null
cp .gpu/bin/mempool-bench-lto .gpu/bin/mempool-bench
echo "== compare.sh latency (release-lto)"
bash .gpu/anchors/compare.sh latency 2>&1 | tail -9
echo "== compare.sh replay, both expandable (release-lto)"
MEMPOOL_ALLOC_CONF=expandable_segments:True bash .gpu/anchors/compare.sh replay .gpu/traces/*.trace 2>&1 | tail -14
} 2>&1 | tee $OUT/call2-output.txt
