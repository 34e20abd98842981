#!/usr/bin/env bash
# Session 13, call 5 (code 1b31dc2, the filing under the members' lock): the GPU tests,
# review12 twenty times more, then pinned pairs interleaved on one core with the release-lto
# build and the release build (8 runs each side). Run from the repository root.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/logs; OUT=/tmp/logs bash .gpu/run.sh | grep -v "^ok "
echo "== review12, 20 more runs"
f=0; for i in $(seq 1 20); do .gpu/tests/review12-test --test-threads=1 > /tmp/r12.log 2>&1 || { f=$((f+1)); grep -A3 panicked /tmp/r12.log | head -4; }; done; echo "review12: $f of 20 runs failed"
for b in mempool-bench-lto mempool-bench; do
  echo "== core_rounds.sh interleave-pinned 8, $b"
  MEMPOOL_BENCH=$PWD/.gpu/bin/$b bash .gpu/harness/core_rounds.sh interleave-pinned 8 2>&1 | grep -v "^$" | tail -10
done
} 2>&1 | tee $OUT/m.txt
