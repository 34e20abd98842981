#!/usr/bin/env bash
# Session 13, call 2: latency, replay (both expandable, then ours on the simulated device on the
# same host), pinned pairs interleaved on one core (8 runs each side).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# run from the repository root (the device tool starts there)
B=.gpu/bin/mempool-bench
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | egrep "Model name|^CPU\(s\)"
echo "== compare.sh latency (unpinned)"
bash .gpu/anchors/compare.sh latency 2>&1 | tail -9
echo "== compare.sh replay, both expandable"
MEMPOOL_ALLOC_CONF=expandable_segments:True bash .gpu/anchors/compare.sh replay .gpu/traces/*.trace 2>&1 | tail -14
echo "== ours, simulated device, same host, expandable"
MEMPOOL_ALLOC_CONF=expandable_segments:True $B replay .gpu/traces/*.trace --backend sim 2>&1 | grep warm
echo "== core_rounds.sh interleave-pinned 8"
bash .gpu/harness/core_rounds.sh interleave-pinned 8 2>&1 | grep -v "^$" | tail -16
} 2>&1 | tee $OUT/m.txt
