#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
B=.gpu/bin/mempool-bench
{
echo "== threads --shared-stream (mempool)"
CUDA_VISIBLE_DEVICES=0 $B threads --shared-stream 2>&1 | tail -6
echo "== core_rounds.sh pinned 2"
bash .gpu/harness/core_rounds.sh pinned 2 2>&1 | grep -v "^$" | tail -60
} 2>&1 | tee $OUT/r2.txt
