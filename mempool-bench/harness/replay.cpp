// replay [--system torch|cuda_async]... [--torch-name NAME] TRACE...
//
// The `replay` workload of mempool-bench (mempool-bench/src/main.rs, src/playback.rs), run through
// the allocators a user would pick instead, on device 0:
//   torch       PyTorch's CUDACachingAllocator: c10::cuda::CUDACachingAllocator::
//               raw_alloc_with_stream / raw_delete, each allocation on its recorded stream:
//               stream value 0 is the default stream, each other distinct value a CUDA stream of
//               its own (cudaStreamCreateWithFlags); peaks from getDeviceStats(0), reset by
//               resetPeakStats(0) before each rep. (No c10 stream objects or guards: they need
//               hooks that libtorch_cuda registers, which a program linking c10 alone lacks.)
//               `--torch-name` renames the rows (compare.sh names the run with
//               PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True `torch_expand`).
//   cuda_async  CUDA's stream-ordered pool: cudaMallocAsync on the allocation's stream and
//               cudaFreeAsync on that same stream, the device's default pool with its release
//               threshold at UINT64_MAX; each stream value the same CUDA stream torch used for it. Peaks
//               from the pool's cudaMemPoolAttrUsedMemHigh / cudaMemPoolAttrReservedMemHigh, reset
//               before each rep.
//
// Traces are read as strictly as mempool-bench reads them (trace.hpp), all of them before anything
// runs. For each trace and system: rep 0 starts from an empty cache (torch: emptyCache; cuda_async:
// the pool trimmed to 0), reps 1 and 2 run on what earlier reps left cached. A rep times the loop
// over the events, reads the peaks, then frees what the trace left live. Before the first cold rep
// the process makes the CUDA context, the streams and one untimed allocation of each system, so
// that a cold rep times the allocator, not the process's first CUDA calls.
//
// Output, one line a rep:
//   <system> <trace-file-name> rep=<r> <cold|warm> events=<n> ns_per_event=<x> peak_allocated=<b> peak_reserved=<b>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "trace.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace alloc = c10::cuda::CUDACachingAllocator;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "replay: %s\n", what.c_str());
  std::exit(1);
}

void check(cudaError_t e, const std::string& call) {
  if (e != cudaSuccess) fail(call + ": " + cudaGetErrorString(e));
}

struct Rep {
  size_t events;
  double ns_per_event;
  long long peak_allocated;
  long long peak_reserved;
};

void print(const std::string& system, const std::string& trace, int rep, const Rep& r) {
  std::printf("%s %s rep=%d %s events=%zu ns_per_event=%.1f peak_allocated=%lld peak_reserved=%lld\n",
              system.c_str(), trace.c_str(), rep, rep == 0 ? "cold" : "warm", r.events, r.ns_per_event,
              r.peak_allocated, r.peak_reserved);
  std::fflush(stdout);
}

double ns_per_event(Clock::time_point t0, size_t events) {
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / double(std::max<size_t>(events, 1));
}

// The streams of a replay, index k standing for a trace's k-th distinct stream value (index 0:
// value 0, the default stream). Grown as traces need more; a later trace's k-th value gets the
// same stream. Plain CUDA streams, passed to each allocator explicitly: c10's stream objects and
// guards need the hooks libtorch_cuda registers, which a program linking c10 alone lacks.
struct Streams {
  std::vector<cudaStream_t> all{nullptr};

  void grow(size_t n) {
    while (all.size() < n) {
      cudaStream_t own;
      check(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      all.push_back(own);
    }
  }
};

Rep replay_torch(const trace::Plan& p, const Streams& streams) {
  std::vector<void*> live(p.slots, nullptr);
  alloc::resetPeakStats(0);
  auto t0 = Clock::now();
  for (const auto& s : p.steps) {
    if (s.alloc) {
      live[s.slot] = alloc::raw_alloc_with_stream(s.bytes, streams.all[s.stream]);
    } else {
      alloc::raw_delete(live[s.slot]);
      live[s.slot] = nullptr;
    }
  }
  Rep r{p.steps.size(), ns_per_event(t0, p.steps.size()), 0, 0};
  auto stats = alloc::getDeviceStats(0);
  // Index 0 of a StatArray: StatType::AGGREGATE, all pools together.
  r.peak_allocated = stats.allocated_bytes[0].peak;
  r.peak_reserved = stats.reserved_bytes[0].peak;
  for (void* ptr : live)
    if (ptr) alloc::raw_delete(ptr);
  return r;
}

Rep replay_async(const trace::Plan& p, const Streams& streams, cudaMemPool_t pool) {
  std::vector<void*> live(p.slots, nullptr);
  std::vector<uint32_t> on(p.slots, 0);  // the stream each live allocation was made on
  uint64_t zero = 0;
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero), "resetting cudaMemPoolAttrUsedMemHigh");
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero), "resetting cudaMemPoolAttrReservedMemHigh");
  auto t0 = Clock::now();
  for (size_t i = 0; i < p.steps.size(); i++) {
    const auto& s = p.steps[i];
    if (s.alloc) {
      cudaError_t e = cudaMallocAsync(&live[s.slot], s.bytes, streams.all[s.stream]);
      if (e != cudaSuccess) check(e, "event " + std::to_string(i + 1) + ": cudaMallocAsync(" + std::to_string(s.bytes) + ")");
      on[s.slot] = s.stream;
    } else {
      cudaError_t e = cudaFreeAsync(live[s.slot], streams.all[on[s.slot]]);
      if (e != cudaSuccess) check(e, "event " + std::to_string(i + 1) + ": cudaFreeAsync");
      live[s.slot] = nullptr;
    }
  }
  Rep r{p.steps.size(), ns_per_event(t0, p.steps.size()), 0, 0};
  uint64_t used = 0, reserved = 0;
  check(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used), "cudaMemPoolGetAttribute");
  check(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &reserved), "cudaMemPoolGetAttribute");
  r.peak_allocated = static_cast<long long>(used);
  r.peak_reserved = static_cast<long long>(reserved);
  for (size_t k = 0; k < live.size(); k++)
    if (live[k]) check(cudaFreeAsync(live[k], streams.all[on[k]]), "cudaFreeAsync");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> systems, paths;
  std::string torch_name = "torch";
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--system" && i + 1 < argc) systems.push_back(argv[++i]);
    else if (a == "--torch-name" && i + 1 < argc) torch_name = argv[++i];
    else if (a.rfind("--", 0) == 0) fail("unknown option `" + a + "`");
    else paths.push_back(a);
  }
  if (paths.empty()) fail("usage: replay [--system torch|cuda_async]... [--torch-name NAME] TRACE...");
  for (auto& s : systems)
    if (s != "torch" && s != "cuda_async") fail("unknown system `" + s + "`; valid: torch, cuda_async");
  auto want = [&](const char* x) { return systems.empty() || std::find(systems.begin(), systems.end(), x) != systems.end(); };

  // Every trace is read before the GPU does anything: a bad one stops the run at once.
  std::vector<trace::Plan> plans;
  for (const auto& path : paths) {
    try {
      plans.push_back(trace::plan(trace::parse(trace::read_file(path))));
    } catch (const trace::Error& e) {
      fail(path + ": " + e.what());
    }
  }

  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaFree(nullptr), "cudaFree(nullptr) (creating the context)");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  std::printf("# replay on device 0: %s; PYTORCH_CUDA_ALLOC_CONF=%s\n", prop.name, conf ? conf : "");
  std::fflush(stdout);

  cudaMemPool_t pool;
  check(cudaDeviceGetDefaultMemPool(&pool, 0), "cudaDeviceGetDefaultMemPool");
  uint64_t keep = UINT64_MAX;
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
  try {
    alloc::init(c10::cuda::device_count());
    Streams streams;
    // One untimed allocation of each system: their one-time set-up stays out of the cold reps.
    if (want("torch")) alloc::raw_delete(alloc::raw_alloc(1));
    if (want("cuda_async")) {
      void* p = nullptr;
      check(cudaMallocAsync(&p, 1, streams.all[0]), "cudaMallocAsync");
      check(cudaFreeAsync(p, streams.all[0]), "cudaFreeAsync");
    }
    for (size_t t = 0; t < plans.size(); t++) {
      const trace::Plan& p = plans[t];
      std::string name = trace::base_name(paths[t]);
      streams.grow(p.values.size());
      if (want("torch")) {
        alloc::emptyCache();
        for (int rep = 0; rep < 3; rep++) print(torch_name, name, rep, replay_torch(p, streams));
        alloc::emptyCache();
      }
      if (want("cuda_async")) {
        check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        check(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
        for (int rep = 0; rep < 3; rep++) print("cuda_async", name, rep, replay_async(p, streams, pool));
        check(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
      }
    }
  } catch (const std::exception& e) {
    fail(std::string("torch: ") + e.what());
  }
  return 0;
}
