#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
bash .gpu/anchors/compare.sh latency 2>&1 | tail -3
for r in 1 2 3; do
  best=0; bn=1000000
  for c in $(seq 0 15); do ns=$(MEMPOOL_BENCH_SIZES=4096 MEMPOOL_BENCH_ITERS=100000 taskset -c $c .gpu/bin/mempool-bench latency pair --backend sim 2>/dev/null | awk '{print $3}'); if awk -v a="$ns" -v b="$bn" 'BEGIN{exit !(a<b)}'; then best=$c; bn=$ns; fi; done
  echo "== round $r core $best ($bn ns)"
  echo "torch: $(CUDA_VISIBLE_DEVICES=0 taskset -c $best /tmp/torch_allocbench | grep mixed | awk '{printf "mixed %s %s  ", $4, $5}')"
  echo "mempool cuda: $(CUDA_VISIBLE_DEVICES=0 taskset -c $best .gpu/bin/mempool-bench latency mixed 2>/dev/null | tr '\n' ' ')"
  echo "mempool sim: $(taskset -c $best .gpu/bin/mempool-bench latency mixed --backend sim 2>/dev/null | tr '\n' ' ')"
  echo "min_bestfit: $(taskset -c $best .gpu/bin/min_bestfit | tr '\n' ' ')"
  echo "probe after: $(MEMPOOL_BENCH_SIZES=4096 MEMPOOL_BENCH_ITERS=100000 taskset -c $best .gpu/bin/mempool-bench latency pair --backend sim 2>/dev/null)"
done
