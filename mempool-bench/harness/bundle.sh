#!/usr/bin/env bash
# bundle.sh: run after ../shared/tools/gpu-bundle (which empties .gpu/ and bundles the workspace's
# binaries, mempool-bench among them, into .gpu/bin). Copies this folder into .gpu/harness and the
# recorded traces into .gpu/traces, so that the GPU machine, which receives .gpu/ only, can run
#   bash .gpu/harness/compare.sh latency replay .gpu/traces/*.trace
#   bash .gpu/harness/compare.sh allreduce        (2 or more GPUs; uses .gpu/bin/allreduce)
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
if [[ ! -x .gpu/bin/mempool-bench ]]; then
  echo "bundle.sh: no .gpu/bin/mempool-bench: run ../shared/tools/gpu-bundle first (it empties .gpu/, so this comes after it)" >&2
  exit 1
fi
rm -rf .gpu/harness .gpu/traces
cp -r mempool-bench/harness .gpu/harness
cp -r traces .gpu/traces
echo "bundle.sh: $(du -sh .gpu | cut -f1) in .gpu/ with harness/ and traces/ ($(ls .gpu/traces | wc -l) traces)"
echo 'next: device run with carry [".gpu"] and command: bash .gpu/harness/compare.sh latency replay .gpu/traces/*.trace'
if [[ -x .gpu/bin/allreduce ]]; then
  echo 'or, on 2 or more GPUs (nvidia-h200-x2): bash .gpu/harness/compare.sh allreduce'
else
  echo "bundle.sh: no .gpu/bin/allreduce: compare.sh allreduce will not find the example" >&2
fi
