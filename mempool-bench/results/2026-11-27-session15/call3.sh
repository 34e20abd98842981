#!/usr/bin/env bash
# Session 15, call 3 (code of 4832a5a, the session's last library change; same as call 1): warm replays,
# both sides expandable, then three rounds on one core each of PyTorch expandable, mempool
# (release-lto) and PyTorch's placement rules alone (min_bestfit, `binned`), same traces.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | egrep "Model name|^CPU\(s\)"
echo "== compare.sh replay, both expandable"
MEMPOOL_ALLOC_CONF=expandable_segments:True bash .gpu/anchors/compare.sh replay .gpu/traces/*.trace 2>&1 | tail -14
for core in 3 9; do
  for round in 1 2 3; do
    echo "== core $core round $round"
    for t in .gpu/traces/*.trace; do
      CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True taskset -c $core /tmp/torch_replay $t | grep "^torch " | grep -v "rep=0" | sed 's/^torch /torch_expand /'
      CUDA_VISIBLE_DEVICES=0 MEMPOOL_ALLOC_CONF=expandable_segments:True taskset -c $core .gpu/bin/mempool-bench replay $t | grep warm
      taskset -c $core .gpu/bin/min_bestfit replay $t | grep "warm.*binned"
    done
    taskset -c $core .gpu/bin/min_bestfit | grep binned
  done
done
} 2>&1 | tee $OUT/call3-output.txt
