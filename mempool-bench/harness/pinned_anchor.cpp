// PyTorch's caching host allocator (pinned memory, `pin_memory=True`), driven from C++ with the
// workloads of `mempool-bench latency` (the same sizes, seed and steps): alloc+free pairs and the
// mixed log-uniform workload, and the mixed workload's peak reserved bytes.
//   bash mempool-bench/harness/pinned.sh   (on the GPU machine; builds this against its torch)
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CachingHostAllocator.h>
#include <c10/core/Allocator.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>
using clk = std::chrono::steady_clock;
static uint64_t rng = 42;
static uint64_t next() { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }
static size_t rand_size() { int sh = 9 + next() % 18; size_t lo = 1ull << sh; return lo + next() % lo; }

int main() {
  // Registered by libtorch_cuda's static initialisers (linked with --no-as-needed).
  at::HostAllocator* A = at::getHostAllocator(at::kCUDA);
  if (!A) { fprintf(stderr, "no CUDA host allocator registered\n"); return 1; }
  const int n = 200000;
  size_t sizes[] = {512, 4096, 1 << 20, 8 << 20, 64 << 20};
  for (size_t s : sizes) {
    for (int i = 0; i < 1000; i++) { auto p = A->allocate(s); }
    auto t0 = clk::now();
    for (int i = 0; i < n; i++) { auto p = A->allocate(s); }
    printf("torch_pinned pair %zu %.1f\n", s, std::chrono::duration<double, std::nano>(clk::now() - t0).count() / n);
  }
  for (int live : {16, 256}) {
    A->empty_cache();
    A->reset_peak_stats();
    rng = 42;
    std::vector<c10::DataPtr> v;
    for (int i = 0; i < live; i++) v.push_back(A->allocate(rand_size()));
    auto t0 = clk::now();
    for (int i = 0; i < n; i++) {
      size_t k = next() % live;
      v[k] = c10::DataPtr();  // free first, as mempool-bench does
      v[k] = A->allocate(rand_size());
    }
    double ns = std::chrono::duration<double, std::nano>(clk::now() - t0).count() / n;
    auto st = A->get_stats();
    printf("torch_pinned mixed %d %.1f reserved_peak %lld allocated_peak %lld\n", live, ns,
           // PyTorch's host stats: `allocated_bytes` counts free and in-use blocks (what it holds
           // from the driver: reserved), `active_bytes` the blocks in use.
           (long long)st.allocated_bytes.peak, (long long)st.active_bytes.peak);
    v.clear();
  }
  return 0;
}
