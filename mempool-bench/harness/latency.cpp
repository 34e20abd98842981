// latency [pair|mixed]... [--system torch|cuda_async|cuda_malloc]...
//
// The `latency` workload of mempool-bench (mempool-bench/src/main.rs), run through the allocators a
// user would pick instead, on device 0:
//   torch        PyTorch's CUDACachingAllocator: c10::cuda::CUDACachingAllocator::raw_alloc /
//                raw_delete on the current stream (the default stream, as mempool-bench's);
//   cuda_async   CUDA's stream-ordered pool: cudaMallocAsync / cudaFreeAsync on one non-blocking
//                stream, the device's default pool with its release threshold at UINT64_MAX (it
//                keeps what is freed, as a caching allocator does);
//   cuda_malloc  plain cudaMalloc / cudaFree (no cache: ~100 us a pair, so fewer iterations; the
//                counts are printed on a `#` line).
//
// Workloads (as mempool-bench runs them, in this order, for each system):
//   pair <bytes>  alloc + immediate free of 512 B, 4 KiB, 1 MiB, 8 MiB, 64 MiB: 1,000 untimed pairs,
//                 then 200,000 timed; ns per pair.
//   mixed <live>  16, then 256 live allocations; xorshift64 (state 42, reset for each `live`):
//                 the initial fill is untimed, then 200,000 timed steps, each freeing the slot
//                 `next() % live` and allocating a new size there; ns per step.
//                 Size: lo = 1 << (9 + next() % 18); size = lo + next() % lo.
// `MEMPOOL_BENCH_ITERS` overrides the 200,000, as it does for mempool-bench.
//
// Output, one line a row: `<system> pair <bytes> <ns>` or `<system> mixed <live> <ns>`, after `#`
// lines that say what ran. With no kind or system named, all of them run.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kPairSizes[] = {512, 4096, size_t(1) << 20, size_t(8) << 20, size_t(64) << 20};
constexpr size_t kMixedLive[] = {16, 256};
constexpr size_t kWarmup = 1000;
// cudaMalloc + cudaFree: ~100 us to ~300 us a pair.
constexpr size_t kMallocWarmup = 100;
constexpr size_t kMallocTimed = 2000;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "latency: %s\n", what.c_str());
  std::exit(1);
}

void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) fail(std::string(call) + ": " + cudaGetErrorString(e));
}

size_t timed_iters() {
  const char* v = std::getenv("MEMPOOL_BENCH_ITERS");
  if (!v || !*v) return 200000;
  char* end = nullptr;
  unsigned long long n = std::strtoull(v, &end, 10);
  if (*end || n == 0) fail(std::string("MEMPOOL_BENCH_ITERS=") + v + " is not a positive number");
  return n;
}

struct Rng {
  uint64_t x;
  uint64_t next() {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  }
  size_t size() {
    size_t lo = size_t(1) << (9 + next() % 18);
    return lo + next() % lo;
  }
};

double ns_since(Clock::time_point t0, size_t n) {
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / double(n);
}

struct Torch {
  static constexpr const char* name = "torch";
  void* alloc(size_t n) { return c10::cuda::CUDACachingAllocator::raw_alloc(n); }
  void free(void* p) { c10::cuda::CUDACachingAllocator::raw_delete(p); }
};

struct CudaAsync {
  static constexpr const char* name = "cuda_async";
  cudaStream_t stream;
  void* alloc(size_t n) {
    void* p = nullptr;
    check(cudaMallocAsync(&p, n, stream), "cudaMallocAsync");
    return p;
  }
  void free(void* p) { check(cudaFreeAsync(p, stream), "cudaFreeAsync"); }
};

struct CudaMalloc {
  static constexpr const char* name = "cuda_malloc";
  void* alloc(size_t n) {
    void* p = nullptr;
    check(cudaMalloc(&p, n), "cudaMalloc");
    return p;
  }
  void free(void* p) { check(cudaFree(p), "cudaFree"); }
};

template <class A>
double pair(A& a, size_t bytes, size_t warmup, size_t timed) {
  for (size_t i = 0; i < warmup; i++) a.free(a.alloc(bytes));
  auto t0 = Clock::now();
  for (size_t i = 0; i < timed; i++) a.free(a.alloc(bytes));
  return ns_since(t0, timed);
}

template <class A>
double mixed(A& a, size_t live, size_t timed) {
  Rng rng{42};
  std::vector<void*> v(live);
  for (auto& p : v) p = a.alloc(rng.size());
  auto t0 = Clock::now();
  for (size_t i = 0; i < timed; i++) {
    size_t k = rng.next() % live;
    a.free(v[k]);  // free first, then allocate in its place
    v[k] = a.alloc(rng.size());
  }
  double ns = ns_since(t0, timed);
  for (void* p : v) a.free(p);
  return ns;
}

template <class A>
void rows(A& a, bool pairs, bool mixes, size_t warmup, size_t timed) {
  if (pairs)
    for (size_t s : kPairSizes) {
      std::printf("%s pair %zu %.1f\n", A::name, s, pair(a, s, warmup, timed));
      std::fflush(stdout);
    }
  if (mixes)
    for (size_t l : kMixedLive) {
      std::printf("%s mixed %zu %.1f\n", A::name, l, mixed(a, l, timed));
      std::fflush(stdout);
    }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> kinds, systems;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--system" && i + 1 < argc) systems.push_back(argv[++i]);
    else if (a == "pair" || a == "mixed") kinds.push_back(a);
    else fail("unknown argument `" + a + "`; usage: latency [pair|mixed]... [--system torch|cuda_async|cuda_malloc]...");
  }
  for (auto& s : systems)
    if (s != "torch" && s != "cuda_async" && s != "cuda_malloc")
      fail("unknown system `" + s + "`; valid: torch, cuda_async, cuda_malloc");
  auto want = [](const std::vector<std::string>& v, const char* x) { return v.empty() || std::find(v.begin(), v.end(), x) != v.end(); };
  bool pairs = want(kinds, "pair"), mixes = want(kinds, "mixed");
  size_t timed = timed_iters();

  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaFree(nullptr), "cudaFree(nullptr) (creating the context)");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  std::printf("# latency on device 0: %s, CUDA runtime %d, driver %d\n", prop.name, runtime, driver);
  std::printf("# torch, cuda_async: %zu untimed + %zu timed pairs, %zu timed mixed steps\n", kWarmup, timed, timed);
  std::printf("# cuda_malloc: %zu untimed + %zu timed pairs, %zu timed mixed steps (the first of the same sequence)\n",
              kMallocWarmup, std::min(kMallocTimed, timed), std::min(kMallocTimed, timed));
  std::fflush(stdout);

  try {
    if (want(systems, "torch")) {
      c10::cuda::CUDACachingAllocator::init(c10::cuda::device_count());
      Torch t;
      rows(t, pairs, mixes, kWarmup, timed);
      c10::cuda::CUDACachingAllocator::emptyCache();
    }
  } catch (const std::exception& e) {
    fail(std::string("torch: ") + e.what());
  }
  if (want(systems, "cuda_async")) {
    CudaAsync a{};
    check(cudaStreamCreateWithFlags(&a.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    cudaMemPool_t pool;
    check(cudaDeviceGetDefaultMemPool(&pool, 0), "cudaDeviceGetDefaultMemPool");
    uint64_t keep = UINT64_MAX;
    check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
    rows(a, pairs, mixes, kWarmup, timed);
    check(cudaStreamSynchronize(a.stream), "cudaStreamSynchronize");
    check(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
    check(cudaStreamDestroy(a.stream), "cudaStreamDestroy");
  }
  if (want(systems, "cuda_malloc")) {
    CudaMalloc m;
    rows(m, pairs, mixes, kMallocWarmup, std::min(kMallocTimed, timed));
  }
  return 0;
}
