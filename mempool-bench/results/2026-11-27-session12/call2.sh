#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
B=.gpu/bin/mempool-bench
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
lscpu | egrep "Model name|^CPU\(s\)|Thread|L2|L3" 
echo "== probe (sim 4 KiB pair per core, ns)"
for c in $(seq 0 15); do printf "%s:%s " $c $(MEMPOOL_BENCH_SIZES=4096 MEMPOOL_BENCH_ITERS=100000 taskset -c $c $B latency pair --backend sim 2>/dev/null | awk '{print $3}'); done; echo
echo "== compare.sh latency (unpinned)"
bash .gpu/anchors/compare.sh latency 2>&1 | tail -9
echo "== pinned (PyTorch host allocator anchor, then mempool pinned), two rounds"
TORCH=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))'); CUDA=${CUDA_HOME:-/usr/local/cuda}
g++ -O2 -std=c++17 -Wno-interference-size .gpu/harness/pinned_anchor.cpp -o /tmp/pinned_anchor -I"$TORCH/include" -I"$CUDA/include" \
  -L"$TORCH/lib" -Wl,--no-as-needed -ltorch_cuda -ltorch_cpu -lc10_cuda -lc10 -L"$CUDA/lib64" -lcudart -Wl,-rpath,"$TORCH/lib:$CUDA/lib64"
for r in 1 2; do CUDA_VISIBLE_DEVICES=0 /tmp/pinned_anchor | grep -i pair; CUDA_VISIBLE_DEVICES=0 $B latency pair --backend pinned; done
echo "== compare.sh threads"
bash .gpu/anchors/compare.sh threads 2>&1 | tail -14
echo "== compare.sh replay, both expandable"
MEMPOOL_ALLOC_CONF=expandable_segments:True bash .gpu/anchors/compare.sh replay .gpu/traces/*.trace 2>&1 | tail -12
echo "== compare.sh latency (unpinned), again"
bash .gpu/anchors/compare.sh latency 2>&1 | tail -9
} 2>&1 | tee $OUT/m.txt
