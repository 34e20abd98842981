#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
B=$PWD/.gpu/bin; cd /tmp
for r in 1 2; do
echo "== allreduce --max-mb 1024 (threads), run $r"; timeout 200 $B/allreduce --max-mb 1024 2>&1 | tail -16
echo "== allreduce --procs --max-mb 1024, run $r"; timeout 200 $B/allreduce --procs --max-mb 1024 2>&1 | tail -16
done
} 2>&1 | tee $OUT/call4-output.txt
