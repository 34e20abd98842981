#!/usr/bin/env bash
# Times mempool-viz on a 1,000,000-entry PyTorch-layout snapshot (read, summary and sites, SVG
# timeline, offline page), with its peak memory. No GPU.  bash mempool-viz/bench/large.sh [N]
set -euo pipefail
cd "$(dirname "$0")/../.."
n="${1:-1000000}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
cargo build --release -q -p mempool-viz
python3 mempool-viz/bench/large_snapshot.py "$dir/large.pickle" "$n"
ls -l "$dir/large.pickle" | awk '{print "pickle bytes:", $5}'
for view in "-o $dir/t.svg" "-o $dir/t.svg --html $dir/t.html" "-o $dir/w.svg --from 1000 --to 2000"; do
  /usr/bin/time -f "mempool-viz $view: %e s wall, %M KiB peak" \
    "${CARGO_TARGET_DIR:-target}/release/mempool-viz" "$dir/large.pickle" $view --sites 3 >/dev/null
done
