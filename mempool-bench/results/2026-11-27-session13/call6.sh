#!/usr/bin/env bash
# Session 13, call 6 (code 7b9dd3d: settle_record through change's two halves): the GPU tests.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/logs; OUT=/tmp/logs bash .gpu/run.sh | grep -v "^ok "
} 2>&1 | tee $OUT/m.txt
