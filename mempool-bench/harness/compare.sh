#!/usr/bin/env bash
# compare.sh: mempool against PyTorch's CUDACachingAllocator and CUDA's allocators, side by side, in
# one run on one GPU machine (only ratios within a run compare: the hosts' CPU speed moves between
# runs). Builds the harnesses of this folder against the torch and CUDA installed here, runs them and
# mempool-bench on the same workloads, and prints one table per workload; `allreduce` runs mempool's
# allreduce example and torch_allreduce.py (PyTorch + NCCL) on every GPU. See README.md.
#
#   bash compare.sh latency                       alloc/free latency (pair, mixed)
#   bash compare.sh replay TRACE...               trace replay (torch, torch_expand, cuda_async)
#   bash compare.sh latency replay TRACE...       both
#   bash compare.sh allreduce [--min-mb N] [--max-mb N] [--iters N]   all-reduce bus bandwidth on every
#                                                 GPU (2 or more), mempool against PyTorch + NCCL
#   bash compare.sh latency replay TRACE... allreduce   all three, one after the other
#   bash compare.sh --join latency MEMPOOL_FILE HARNESS_FILE   the latency table again from saved outputs
#   bash compare.sh --join replay FILE...                      the replay tables again
#   bash compare.sh --join allreduce MEMPOOL_FILE TORCH_FILE   the all-reduce table again
#   bash compare.sh --self-test                   no GPU, torch or CUDA needed: the joining on canned
#                                                 lines, and the trace reader against mempool-bench's
#
# Environment: MEMPOOL_BENCH   the mempool-bench binary (default: .gpu/bin/mempool-bench, then
#                              target/release/mempool-bench, from the repository root; `none`: the
#                              other systems only)
#              MEMPOOL_ALLREDUCE   the allreduce example (default: .gpu/bin/allreduce, then
#                              target/release/examples/allreduce; `none`: PyTorch's side only)
#              OUT             where the raw outputs are kept (default: a new /tmp/mempool-compare.*)
#              CXX (g++), CUDA_HOME (/usr/local/cuda), PYTHON (python3), MEMPOOL_BENCH_ITERS (both
#              sides' timed iterations, 200,000 unless set: only full runs compare with BENCHMARKS.md)
#
# Exit status: 0 when everything ran and joined; 1 when a build, a run or a join failed (the message
# says which); 2 on a usage error. Nothing here changes GPU clocks, modes or settings.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The repository root, from mempool-bench/harness or from its bundled copy .gpu/harness alike.
root=$(cd "$here/../.." && pwd)
# House rule on shared GPU hosts: NVLink multicast stays off (NCCL's, for `allreduce`, and torch's
# symmetric memory and NVSHMEM's, which nothing here uses).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
# A relative MEMPOOL_BENCH or MEMPOOL_ALLREDUCE names a file from here, wherever the script moves to later.
[[ -n ${MEMPOOL_BENCH:-} && $MEMPOOL_BENCH != none && $MEMPOOL_BENCH != /* ]] && MEMPOOL_BENCH=$PWD/$MEMPOOL_BENCH
[[ -n ${MEMPOOL_ALLREDUCE:-} && $MEMPOOL_ALLREDUCE != none && $MEMPOOL_ALLREDUCE != /* ]] && MEMPOOL_ALLREDUCE=$PWD/$MEMPOOL_ALLREDUCE

die() {
  echo "compare.sh: $*" >&2
  exit 1
}

usage() {
  echo "usage:" >&2
  sed -n '8,19s/^#  //p' "$here/compare.sh" >&2
  exit 2
}

# --- the binaries: mempool-bench, the allreduce example ------------------------------------------
# find_binary OUT ENVVAR CANDIDATE...: OUT is $ENVVAR when it is set (`none`, or an executable file),
# else the first executable candidate; fails when there is none.
find_binary() {
  local out=$1 env=$2
  shift 2
  local given=${!env:-}
  if [[ -n $given ]]; then
    [[ $given == none || -x $given ]] || die "$env=$given is not an executable file"
    printf -v "$out" '%s' "$given"
    return 0
  fi
  local c
  for c in "$@"; do
    if [[ -x $c ]]; then
      printf -v "$out" '%s' "$c"
      return 0
    fi
  done
  return 1
}

find_mempool_bench() {
  find_binary MB MEMPOOL_BENCH "$root/.gpu/bin/mempool-bench" "${CARGO_TARGET_DIR:-$root/target}/release/mempool-bench"
}

find_allreduce() {
  find_binary AR MEMPOOL_ALLREDUCE "$root/.gpu/bin/allreduce" "${CARGO_TARGET_DIR:-$root/target}/release/examples/allreduce"
}

# --- building ------------------------------------------------------------------------------------
setup_build() {
  command -v "$PY" > /dev/null || die "no $PY here (set PYTHON)"
  TORCH=$("$PY" -c 'import torch, os; print(os.path.dirname(torch.__file__))') ||
    die "$PY cannot import torch: the harnesses build against the installed PyTorch"
  ABI=$("$PY" -c 'import torch; print(int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))') ||
    die "$PY cannot tell torch's C++ ABI"
  CUDA=${CUDA_HOME:-/usr/local/cuda}
  [[ -f $CUDA/include/cuda_runtime.h ]] || die "no CUDA headers in $CUDA/include (set CUDA_HOME)"
  CXX=${CXX:-g++}
  command -v "$CXX" > /dev/null || die "no C++ compiler $CXX (set CXX)"
  tmp=$(mktemp -d /tmp/mempool-harness.XXXXXX) || die "mktemp failed"
  trap 'rm -rf "$tmp"' EXIT
}

# build NAME: NAME.cpp of this folder into $tmp/NAME, against torch's c10 and the CUDA runtime.
build() {
  local flags=(-O2 -std=c++17 -Wall -D_GLIBCXX_USE_CXX11_ABI="$ABI" -isystem "$TORCH/include" -isystem "$CUDA/include")
  [[ -d $CUDA/include/cccl ]] && flags+=(-isystem "$CUDA/include/cccl")
  local cmd=("$CXX" "${flags[@]}" "$here/$1.cpp" -o "$tmp/$1" -L"$TORCH/lib" -lc10_cuda -lc10
    -L"$CUDA/lib64" -lcudart -Wl,-rpath,"$TORCH/lib:$CUDA/lib64")
  echo "compare.sh: building $1: ${cmd[*]}" >&2
  "${cmd[@]}" || die "building $1.cpp failed (the compiler's messages are above; torch: $TORCH, CUDA: $CUDA)"
}

# --- running -------------------------------------------------------------------------------------
run_latency() {
  build latency
  local mine=$res/mempool_latency.txt theirs=$res/harness_latency.txt
  "$tmp/latency" | tee "$theirs"
  ((PIPESTATUS[0] == 0)) || die "the latency harness failed (its message is above)"
  if [[ $MB == none ]]; then
    : > "$mine"
  else
    "$MB" latency pair mixed --backend cuda | tee "$mine"
    ((PIPESTATUS[0] == 0)) || die "$MB latency failed"
  fi
  echo
  "$PY" "$here/join.py" latency "$mine" "$theirs"
  joined $? "$MB"
}

# joined RC BINARY: join.py's exit status counts against the run, except a missing mempool side
# (status 1) when BINARY is `none` (MEMPOOL_BENCH or MEMPOOL_ALLREDUCE asked for the other systems only).
joined() {
  (($1 == 0)) || [[ $1 == 1 && $2 == none ]] || status=1
}

replay_all() {
  local tr
  for tr in "${traces[@]}"; do
    "$tmp/replay" "$tr" || die "the replay harness failed on $tr"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$tmp/replay" --system torch --torch-name torch_expand "$tr" ||
      die "the replay harness failed on $tr with expandable_segments:True"
    if [[ $MB != none ]]; then
      "$MB" replay "$tr" --backend cuda || die "$MB replay $tr failed"
    fi
  done
}

# Every trace is read before anything runs, by the replay harness's reader, with no GPU: a bad one
# stops the run before anything is timed.
check_traces() {
  ((${#traces[@]})) || die "replay: no trace named (usage: compare.sh replay TRACE...)"
  "$CXX" -O2 -std=c++17 "$here/trace_check.cpp" -o "$tmp/trace_check" || die "building trace_check.cpp failed"
  "$tmp/trace_check" "${traces[@]}" || die "a trace is malformed (above); nothing ran"
}

run_replay() {
  build replay
  replay_all | tee "$res/replay.txt"
  ((PIPESTATUS[0] == 0)) || exit 1
  echo
  "$PY" "$here/join.py" replay "$res/replay.txt"
  joined $? "$MB"
}

# Every GPU this shell was given (not only device 0), PyTorch's side first, then mempool's; each
# with a 300 s limit (timeout ends its whole process group, the rank processes included).
run_allreduce() {
  local mine=$res/mempool_allreduce.txt theirs=$res/torch_allreduce.txt gpus rc
  gpus=$("${every_gpu[@]}" "$PY" -c 'import torch; print(torch.cuda.device_count())') ||
    die "allreduce: $PY cannot count the GPUs through torch"
  if ((gpus < 2)); then
    echo "compare.sh: allreduce: $gpus GPU(s) visible here; an all-reduce comparison needs 2 or more: not run" >&2
    status=1
    return
  fi
  "${every_gpu[@]}" timeout 300 "$PY" "$here/torch_allreduce.py" "${ar_opts[@]}" | tee "$theirs"
  rc=${PIPESTATUS[0]}
  ((rc == 124)) && die "torch_allreduce.py ran past 300 s and was stopped (what it printed is in $theirs)"
  ((rc == 0)) || die "torch_allreduce.py failed (exit status $rc; its message is above)"
  echo
  if [[ $AR == none ]]; then
    : > "$mine"
  else
    "${every_gpu[@]}" timeout 300 "$AR" --procs "${ar_opts[@]}" | tee "$mine"
    rc=${PIPESTATUS[0]}
    ((rc == 124)) && die "$AR --procs ran past 300 s and was stopped (what it printed is in $mine)"
    ((rc == 0)) || die "$AR --procs failed (exit status $rc; its message is above)"
  fi
  echo
  "$PY" "$here/join.py" allreduce "$mine" "$theirs"
  joined $? "$AR"
}

# --- self-test -----------------------------------------------------------------------------------
self_test() {
  local t=$here/selftest fails=0 checks=0 out rc
  tmp=$(mktemp -d /tmp/mempool-harness-test.XXXXXX) || die "mktemp failed"
  trap 'rm -rf "$tmp"' EXIT
  ok() {
    checks=$((checks + 1))
    echo "ok   $1"
  }
  bad() {
    checks=$((checks + 1))
    fails=$((fails + 1))
    echo "FAIL $1"
  }
  # expect_line NAME WANT_RC LINE CMD...: CMD's exit status, and LINE among its output lines.
  # ran NAME WANT CMD...: runs CMD into $out; false (reported) if its exit status is not WANT.
  ran() {
    local name=$1 want=$2 rc
    shift 2
    out=$("$@" 2>&1)
    rc=$?
    if ((rc != want)); then
      bad "$name: exit status $rc, expected $want"
      printf '%s\n' "$out" | sed 's/^/     /'
      return 1
    fi
  }
  expect_line() {
    local name=$1 want=$2 line=$3
    shift 3
    if ! ran "$name" "$want" "$@"; then
      :
    elif ! grep -qxF -- "$line" <<< "$out"; then
      bad "$name: no line \"$line\" in its output"
      printf '%s\n' "$out" | sed 's/^/     /'
    else
      ok "$name"
    fi
  }
  # allreduce_ratios: reg_x of the canned tables worked out here with awk (mempool's reg_busbw, the
  # 5th field of a table row, over torch's reg_busbw, the 11th of its line), against join.py's column.
  allreduce_ratios() {
    local want got
    want=$(awk '$2 == "|" && $1 ~ /^[0-9]+$/ { m[$1] = $5 }
      $1 == "torch" && $2 == "allreduce" { t[$3] = $11 }
      END { for (k in t) if (k in m) printf "%d %.2fx\n", k, m[k] / t[k] }' allreduce_mempool.txt allreduce_torch.txt | sort -n)
    got=$("$PY" "$here/join.py" allreduce allreduce_mempool.txt allreduce_torch.txt | awk '$1 ~ /^[0-9]+$/ { print $1, $NF }')
    if [[ -n $want && $want == "$got" ]]; then
      ok "join.py allreduce: reg_x = mempool reg busbw / torch reg busbw at every size ($(wc -l <<< "$want") sizes)"
    else
      bad "join.py allreduce: reg_x differs from mempool reg busbw / torch reg busbw"
      diff <(printf '%s\n' "$want") <(printf '%s\n' "$got") | sed 's/^/     /'
    fi
  }
  # expect NAME WANT_RC EXPECTED_FILE CMD...: CMD's exit status and output (stdout + stderr).
  expect() {
    local name=$1 want=$2 file=$3
    shift 3
    if ! ran "$name" "$want" "$@"; then
      :
    elif [[ -n $file ]] && ! diff -u "$file" <(printf '%s\n' "$out") > "$tmp/diff"; then
      bad "$name: output differs from $(basename "$file")"
      sed 's/^/     /' "$tmp/diff"
    else
      ok "$name"
    fi
  }

  for f in compare.sh bundle.sh; do
    expect "bash -n $f" 0 "" bash -n "$here/$f"
  done
  # From the canned files' folder, so that messages name them as the expected outputs do.
  cd "$t" || die "no $t"
  expect "join.py latency: canned lines, ratios as expected" 0 latency.expected \
    "$PY" "$here/join.py" latency latency_mempool.txt latency_harness.txt
  expect "join.py replay: canned lines, ratios as expected" 0 replay.expected \
    "$PY" "$here/join.py" replay replay.txt
  expect "join.py replay: systems that replayed different event counts are an error" 1 replay_mismatch.expected \
    "$PY" "$here/join.py" replay replay_mismatch.txt
  expect "join.py latency: a row seen twice is an error" 2 latency_twice.expected \
    "$PY" "$here/join.py" latency latency_mempool.txt latency_harness.txt latency_harness.txt
  expect "join.py latency: no mempool rows is an error" 1 "" \
    "$PY" "$here/join.py" latency /dev/null latency_harness.txt
  expect "join.py allreduce: canned tables, ratios as expected" 0 allreduce.expected \
    "$PY" "$here/join.py" allreduce allreduce_mempool.txt allreduce_torch.txt
  allreduce_ratios
  expect "join.py allreduce: a size one side lacks is an error" 1 allreduce_missing.expected \
    "$PY" "$here/join.py" allreduce allreduce_mempool_all.txt allreduce_torch.txt
  expect "join.py allreduce: no mempool rows is an error" 1 "" \
    "$PY" "$here/join.py" allreduce /dev/null allreduce_torch.txt
  expect "join.py allreduce: a size seen twice is an error" 2 "" \
    "$PY" "$here/join.py" allreduce allreduce_mempool.txt <(cat allreduce_torch.txt allreduce_torch.txt)
  sed 's/^torch allreduce 16 \(.*\) reg_us [^ ]* reg_busbw [^ ]*$/torch allreduce 16 \1 reg_us - reg_busbw -/' allreduce_torch.txt > "$tmp/ar_nopool.txt"
  expect_line "join.py allreduce: torch without its registered-pool figure is an error" 1 \
    "! no torch registered-pool figure at some sizes (torch_allreduce.py's note says why)" \
    "$PY" "$here/join.py" allreduce allreduce_mempool.txt "$tmp/ar_nopool.txt"
  sed 's/^# torch allreduce: world 2,/# torch allreduce: world 4,/' allreduce_torch.txt > "$tmp/ar_world4.txt"
  expect_line "join.py allreduce: sides on different numbers of GPUs is an error" 1 \
    "! the sides ran on different numbers of GPUs: mempool 2, torch 4" \
    "$PY" "$here/join.py" allreduce allreduce_mempool.txt "$tmp/ar_world4.txt"
  for f in join.py ranks.py torch_allreduce.py torch_symm.py; do
    expect "python compiles $f" 0 "" "$PY" -c 'import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True)' "$here/$f" "$tmp/$f.pyc"
  done
  expect "torch_allreduce.py: --min-mb above --max-mb is a usage error" 2 "" \
    "$PY" "$here/torch_allreduce.py" --min-mb 4 --max-mb 2

  local cxx=${CXX:-g++}
  if ! command -v "$cxx" > /dev/null; then
    bad "no C++ compiler $cxx: the trace reader is not checked"
  elif ! "$cxx" -O2 -std=c++17 -Wall -Wextra -pedantic -Werror "$here/trace_check.cpp" -o "$tmp/trace_check"; then
    bad "trace_check.cpp does not build with $cxx"
  else
    ok "trace_check.cpp builds with $cxx -Wall -Wextra -pedantic -Werror"
    cd traces || die "no $t/traces"
    expect "trace reader: every form accepted, every problem refused with its line and message" 1 ../traces.expected \
      "$tmp/trace_check" *.trace
    if find_mempool_bench && [[ $MB != none ]]; then
      trace_diff "canned traces refused" bad_*.trace
      "$PY" "$t/trace_fuzz.py" "$tmp" 1 "${FUZZ:-600}" && trace_diff "${FUZZ:-600} random traces" "$tmp"/f*.trace
    else
      echo "skip trace reader against mempool-bench's: no mempool-bench binary (set MEMPOOL_BENCH)"
    fi
  fi
  echo "self-test: $((checks - fails)) of $checks checks passed"
  ((fails == 0))
}

# trace_diff WHAT TRACE...: trace_check and `mempool-bench replay --backend sim` must accept the same
# traces (same event count) and refuse the others with the same message.
trace_diff() {
  local what=$1 f mine theirs differ=0 accepted=0
  shift
  for f in "$@"; do
    theirs=$("$tmp/trace_check" "$f")
    theirs=${theirs#"$f: "}
    theirs=${theirs%% streams=*}
    mine=$("$MB" replay "$f" --backend sim 2>&1 | head -n 1)
    if [[ $mine == "mempool "* ]]; then
      mine="ok events=$(sed 's/.* events=\([0-9]*\) .*/\1/' <<< "$mine")"
      accepted=$((accepted + 1))
    else
      mine=${mine#"mempool-bench: $f: "}
    fi
    if [[ $mine != "$theirs" ]]; then
      ((differ++ < 5)) && printf '     %s\n       mempool-bench: %s\n       trace_check:   %s\n' "$f" "$mine" "$theirs"
    fi
  done
  if ((differ)); then
    bad "trace reader against mempool-bench's, $what: $differ of $# differ"
  else
    ok "trace reader against mempool-bench's, $what: all $# the same ($accepted accepted)"
  fi
}

# --- main ----------------------------------------------------------------------------------------
(($#)) || usage
case $1 in
--self-test)
  self_test
  exit
  ;;
--join)
  shift
  exec "$PY" "$here/join.py" "$@"
  ;;
esac

do_latency=0 do_replay=0 do_allreduce=0 traces=() ar_opts=() ar_min=1 ar_max=1024
while (($#)); do
  a=$1
  shift
  case $a in
  latency) do_latency=1 ;;
  replay) do_replay=1 ;;
  allreduce) do_allreduce=1 ;;
  --min-mb | --max-mb | --iters)
    ((do_allreduce)) || usage
    [[ ${1:-} =~ ^[1-9][0-9]{0,6}$ ]] || {
      echo "compare.sh: allreduce: $a needs a positive whole number" >&2
      usage
    }
    [[ $a == --min-mb ]] && ar_min=$1
    [[ $a == --max-mb ]] && ar_max=$1
    ar_opts+=("$a" "$1")
    shift
    ;;
  -*) usage ;;
  *)
    ((do_replay)) || usage
    [[ -f $a ]] || die "replay: no trace file $a"
    traces+=("$a")
    ;;
  esac
done
((do_latency || do_replay || do_allreduce)) || usage
((ar_min <= ar_max)) || {
  echo "compare.sh: allreduce: --min-mb $ar_min is above --max-mb $ar_max" >&2
  usage
}

about=""
if ((do_latency || do_replay)); then
  if ! find_mempool_bench; then
    die "no mempool-bench binary: run ../shared/tools/gpu-bundle and bash mempool-bench/harness/bundle.sh where cargo is (it lands in .gpu/bin), or set MEMPOOL_BENCH (MEMPOOL_BENCH=none: the other systems only)"
  fi
  setup_build
  about+=", mempool-bench $MB"
else
  command -v "$PY" > /dev/null || die "no $PY here (set PYTHON)"
fi
if ((do_allreduce)); then
  if ! find_allreduce; then
    die "no allreduce example binary: run ../shared/tools/gpu-bundle where cargo is (it lands in .gpu/bin), or cargo build --release --example allreduce, or set MEMPOOL_ALLREDUCE (MEMPOOL_ALLREDUCE=none: PyTorch's side only)"
  fi
  "$PY" -c 'import torch.distributed' 2> /dev/null || die "$PY cannot import torch.distributed: the all-reduce comparison runs PyTorch + NCCL"
  about+=", allreduce $AR"
fi
res=${OUT:-$(mktemp -d /tmp/mempool-compare.XXXXXX)}
mkdir -p "$res" || die "cannot make $res"
# `allreduce` runs on every GPU this shell was given, as it was given them.
if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
  every_gpu=(env CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES")
else
  every_gpu=(env -u CUDA_VISIBLE_DEVICES)
fi
# latency and replay: one device, the same for every side. The allocators' defaults, whatever this
# shell had set (the torch hook would register every caching-allocator segment with NCCL, making
# torch's default all-reduce column a registered one).
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
for v in PYTORCH_CUDA_ALLOC_CONF MEMPOOL_ALLOC_CONF TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK; do
  [[ -n ${!v:-} ]] && echo "compare.sh: $v=${!v} unset: every side runs with its default settings" >&2
  unset "$v"
done
[[ -n ${MEMPOOL_BENCH_ITERS:-} ]] && ((do_latency || do_replay)) && echo "compare.sh: MEMPOOL_BENCH_ITERS=$MEMPOOL_BENCH_ITERS: a short run, not comparable with BENCHMARKS.md" >&2
echo "# compare.sh: torch $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')$about, outputs in $res"
((do_replay)) && check_traces
status=0
((do_latency)) && run_latency
((do_latency && do_replay)) && echo
((do_replay)) && run_replay
((do_allreduce && (do_latency || do_replay))) && echo
((do_allreduce)) && run_allreduce
exit $status
