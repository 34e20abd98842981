#!/usr/bin/env bash
# Session 13, call 4 (code 9a832d2): the GPU tests, then pinned pairs interleaved on one core
# with the release build and the release-lto build of mempool-bench (8 runs each side), then
# compare.sh latency and replay with each. Run from the repository root; .gpu/bin holds both
# builds (mempool-bench, mempool-bench-lto: `cargo build --profile release-lto -p mempool-bench`).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/logs; OUT=/tmp/logs bash .gpu/run.sh | grep -v "^ok "
for b in mempool-bench-lto mempool-bench mempool-bench-lto; do
  echo "== core_rounds.sh interleave-pinned 8, $b"
  MEMPOOL_BENCH=$PWD/.gpu/bin/$b bash .gpu/harness/core_rounds.sh interleave-pinned 8 2>&1 | grep -v "^$" | tail -10
done
echo "== compare.sh latency, release-lto build"
cp .gpu/bin/mempool-bench /tmp/mempool-bench-plain; cp .gpu/bin/mempool-bench-lto .gpu/bin/mempool-bench
bash .gpu/anchors/compare.sh latency 2>&1 | tail -9
echo "== compare.sh replay, both expandable, release-lto build"
MEMPOOL_ALLOC_CONF=expandable_segments:True bash .gpu/anchors/compare.sh replay .gpu/traces/*.trace 2>&1 | grep -E "warm +(mempool|torch_expand)"
cp /tmp/mempool-bench-plain .gpu/bin/mempool-bench
} 2>&1 | tee $OUT/m.txt
