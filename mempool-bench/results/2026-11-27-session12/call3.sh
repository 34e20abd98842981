#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== core_rounds.sh pinned 3"
bash .gpu/harness/core_rounds.sh pinned 3 2>&1 | grep -v "^$"
echo "== core_rounds.sh interleave 4"
bash .gpu/harness/core_rounds.sh interleave 4 2>&1 | grep -v "^$" | tail -30
} 2>&1 | tee $OUT/p.txt
