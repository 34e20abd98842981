#!/usr/bin/env bash
# Session 14, call 2 (code of 2891476: expandable memory a request mapped and did not take goes
# back): the GPU tests.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/logs; OUT=/tmp/logs bash .gpu/run.sh | grep -v "^ok "
} 2>&1 | tee $OUT/m.txt
