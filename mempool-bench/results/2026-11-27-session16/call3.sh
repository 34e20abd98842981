#!/usr/bin/env bash
# Session 16, call 3 (two GPUs): the multi-GPU tests (NCCL, symmetric memory, IPC, expandable
# peer access), then every example on the session's code: tour, pools, host_memory, ipc,
# allreduce (threads, then one process per GPU), symm_allreduce.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/logs; OUT=/tmp/logs bash .gpu/run.sh | grep -v "^ok "
cd /tmp
B=$OLDPWD/.gpu/bin
ex() { local n=$1 t=$2; shift 2; echo "== $*"; timeout "$t" "$B/$@" > /tmp/ex.log 2>&1; local rc=$?; tail -n "$n" /tmp/ex.log; echo "rc=$rc"; }
ex 12 120 tour; ex 12 120 pools; ex 12 120 host_memory; ex 12 120 ipc
ex 24 240 allreduce --max-mb 1024 --iters 20
ex 24 240 allreduce --procs --max-mb 1024 --iters 20
ex 16 120 symm_allreduce --iters 500
} 2>&1 | tee $OUT/call3-output.txt
