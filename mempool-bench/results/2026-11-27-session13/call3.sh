#!/usr/bin/env bash
# Session 13, call 3 (code 2f2d7c7): the GPU tests, then threads, latency and pinned pairs
# interleaved on one core (8 runs each side). Run from the repository root.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/logs; OUT=/tmp/logs bash .gpu/run.sh | grep -v "^ok "
echo "== compare.sh threads"
bash .gpu/anchors/compare.sh threads 2>&1 | tail -14
echo "== compare.sh latency (unpinned)"
bash .gpu/anchors/compare.sh latency 2>&1 | tail -9
echo "== core_rounds.sh interleave-pinned 8"
bash .gpu/harness/core_rounds.sh interleave-pinned 8 2>&1 | grep -v "^$" | tail -16
} 2>&1 | tee $OUT/m.txt
