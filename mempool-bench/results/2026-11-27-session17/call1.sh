#!/usr/bin/env bash
# Session 17, call 1 (code of c3620e7; the library as GPU-run in session 16's call 6): the two
# open bars against PyTorch and against PyTorch's placement rules alone, in one run.
# `compare.sh latency` and `compare.sh replay` (both sides expandable), then on cores 3 and 9,
# three rounds each: PyTorch's `torch_allocbench` (its `mixed` rows), `mempool-bench latency
# mixed`, `min_bestfit` mixed (the rules alone); per trace PyTorch expandable, mempool (both
# expandable) and `min_bestfit replay` (native rules alone). Then a `perf` (cpu-clock) profile
# of a warm transformer replay on core 3 (where the host spends mempool's time).
# Binaries: .gpu/bin/mempool-bench (release-lto), .gpu/bin/min_bestfit (rustc -O).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
date -u; cat .gpu/REV; nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | egrep "Model name|^CPU\(s\)"
echo "== compare.sh latency"
bash .gpu/anchors/compare.sh latency 2>&1 | tail -9
echo "== compare.sh replay, both expandable"
MEMPOOL_ALLOC_CONF=expandable_segments:True bash .gpu/anchors/compare.sh replay .gpu/traces/*.trace 2>&1 | tail -14
for core in 3 9; do
  for round in 1 2 3; do
    echo "== core $core round $round"
    CUDA_VISIBLE_DEVICES=0 taskset -c $core /tmp/torch_allocbench | grep "^mixed"
    CUDA_VISIBLE_DEVICES=0 taskset -c $core .gpu/bin/mempool-bench latency mixed
    taskset -c $core .gpu/bin/min_bestfit | grep binned
    for t in .gpu/traces/*.trace; do
      CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True taskset -c $core /tmp/torch_replay $t | grep "^torch " | grep -v "rep=0" | sed 's/^torch /torch_expand /'
      CUDA_VISIBLE_DEVICES=0 MEMPOOL_ALLOC_CONF=expandable_segments:True taskset -c $core .gpu/bin/mempool-bench replay $t | grep warm
      taskset -c $core .gpu/bin/min_bestfit replay $t | grep "warm.*binned"
    done
  done
done
if command -v perf >/dev/null; then
  echo "== perf, warm transformer replay, core 3 (mempool, expandable, 60 reps)"
  MEMPOOL_BENCH_REPS=60 MEMPOOL_ALLOC_CONF=expandable_segments:True CUDA_VISIBLE_DEVICES=0 taskset -c 3 \
    perf record -q -e cpu-clock -F 10000 -o /tmp/perf.data .gpu/bin/mempool-bench replay .gpu/traces/transformer_train.trace --backend sim | tail -1
  perf report -i /tmp/perf.data --stdio --no-children --sort symbol 2>/dev/null | grep "%" | head -30
fi
} 2>&1 | tee $OUT/call1-output.txt
