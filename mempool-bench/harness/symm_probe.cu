// Where a small one-shot all-reduce's time goes on 2 GPUs: kernel variants side by side in one
// run, one host thread per GPU, peer access over NVLink (no multicast anywhere).
//   nvcc -O3 -std=c++20 -arch=sm_90 mempool-bench/harness/symm_probe.cu -o /tmp/symm_probe && /tmp/symm_probe
// Variants (all sum float32 in rank order, 512 threads a block, at most 64 blocks):
//   empty     an empty kernel: the launch floor
//   mem       mempool's one-shot as it was: peer and pad addresses loaded from device arrays,
//             counted barriers whose "taken" counts live in memory, barrier/read/barrier
//   param     the same with every address a kernel parameter and the count expected given by
//             the host (no dependent loads before the signals)
//   lamport   no barriers: each rank pushes its input into every peer's receive slot (one of
//             two, alternating per call), the reader polls its own memory until no element is
//             the sentinel (a NaN bit pattern no input keeps), sums, and puts the sentinel back
#include <cuda_runtime.h>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#define CK(x)                                                                           \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

constexpr int MAXW = 8;
constexpr int THREADS = 512;
constexpr int MAXB = 64;
constexpr unsigned SENT = 0xFFFFFFFFu;

struct Peers {
  float4* data[MAXW];
  unsigned* pads[MAXW];
};

__device__ __forceinline__ void red_sys(unsigned* p) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}
__device__ __forceinline__ unsigned ld_acq(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float4 ld_cg(const float4* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ld_vol(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_vol(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__global__ void k_empty() {}

// Pad words: signal from rank r for slot s at [s*MAXW + r]; taken counts at [TAKEN + s*MAXW + r].
constexpr int TAKEN = 2 * MAXB * MAXW;

__device__ void barrier_mem(unsigned* const* pads, int world, int rank, int slot) {
  int t = threadIdx.x;
  if (t < world && t != rank) {
    red_sys(pads[t] + slot * MAXW + rank);
    unsigned* mine = pads[rank];
    unsigned taken = mine[TAKEN + slot * MAXW + t];
    while (ld_acq(mine + slot * MAXW + t) == taken) {
    }
    mine[TAKEN + slot * MAXW + t] = taken + 1;
  }
  __syncthreads();
}

__global__ void k_mem(float4* const* data, unsigned* const* pads, int world, int rank, float4* out, long n4) {
  barrier_mem(pads, world, rank, blockIdx.x * 2);
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n4; i += (long)gridDim.x * blockDim.x) {
    float4 s = make_float4(0, 0, 0, 0);
    for (int r = 0; r < world; r++) {
      float4 v = ld_cg(data[r] + i);
      s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
    out[i] = s;
  }
  __syncthreads();
  barrier_mem(pads, world, rank, blockIdx.x * 2 + 1);
}

__device__ void barrier_param(const Peers& p, int world, int rank, int slot, unsigned expect) {
  int t = threadIdx.x;
  if (t < world && t != rank) {
    red_sys(p.pads[t] + slot * MAXW + rank);
    const unsigned* w = p.pads[rank] + slot * MAXW + t;
    while ((int)(ld_acq(w) - expect) < 0) {
    }
  }
  __syncthreads();
}

__global__ void k_param(Peers p, int world, int rank, float4* out, long n4, int base, unsigned expect) {
  barrier_param(p, world, rank, base + blockIdx.x * 2, expect);
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n4; i += (long)gridDim.x * blockDim.x) {
    float4 s = make_float4(0, 0, 0, 0);
    for (int r = 0; r < world; r++) {
      float4 v = ld_cg(p.data[r] + i);
      s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
    }
    out[i] = s;
  }
  __syncthreads();
  barrier_param(p, world, rank, base + blockIdx.x * 2 + 1, expect);
}

__device__ __forceinline__ unsigned canon(unsigned x) { return x == SENT ? 0x7FC00000u : x; }

// scratch of rank q: [2][world][n4] uint4; rank r's values for call parity `buf` at [(buf*world + r)*n4 + i].
__global__ void k_lamport(Peers p, const uint4* in, int world, int rank, float4* out, long n4, int buf) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n4; i += (long)gridDim.x * blockDim.x) {
    uint4 v = in[i];
    v.x = canon(v.x), v.y = canon(v.y), v.z = canon(v.z), v.w = canon(v.w);
    for (int r = 0; r < world; r++)
      if (r != rank) st_vol((uint4*)p.data[r] + ((long)buf * world + rank) * n4 + i, v);
    float4 s = make_float4(0, 0, 0, 0);
    for (int r = 0; r < world; r++) {
      uint4 u;
      if (r == rank) {
        u = v;
      } else {
        uint4* slot = (uint4*)p.data[rank] + ((long)buf * world + r) * n4 + i;
        do {
          u = ld_vol(slot);
        } while (u.x == SENT || u.y == SENT || u.z == SENT || u.w == SENT);
        st_vol(slot, make_uint4(SENT, SENT, SENT, SENT));
      }
      s.x += __uint_as_float(u.x), s.y += __uint_as_float(u.y), s.z += __uint_as_float(u.z), s.w += __uint_as_float(u.w);
    }
    out[i] = s;
  }
}

__global__ void k_fill(float4* in, long n4, int rank, int iter) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n4; i += (long)gridDim.x * blockDim.x) {
    float b = (float)((i * 4) % 97 + rank + iter);
    in[i] = make_float4(b, b + 1, b + 2, b + 3);
  }
}

struct Shared {
  int world;
  std::barrier<> bar;
  float4* data[MAXW];
  unsigned* pads[MAXW];
  float4* scratch[MAXW];
  double us[8][8][MAXW];
  double graph_us[8][8][MAXW];
  explicit Shared(int w) : world(w), bar(w) {}
};

const long SIZES[] = {4096, 16384, 65536, 262144, 1048576};
const char* NAMES[] = {"empty", "mem", "param", "lamport"};

void rank_main(Shared* sh, int rank, int iters) {
  int world = sh->world;
  CK(cudaSetDevice(rank));
  for (int q = 0; q < world; q++)
    if (q != rank) CK(cudaDeviceEnablePeerAccess(q, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  long maxn4 = SIZES[4] / 16;
  float4 *data, *out, *scratch, *in;
  unsigned* pads;
  CK(cudaMalloc(&data, maxn4 * 16));
  CK(cudaMalloc(&in, maxn4 * 16));
  CK(cudaMalloc(&out, maxn4 * 16));
  CK(cudaMalloc(&scratch, 2 * world * maxn4 * 16));
  CK(cudaMemset(scratch, 0xFF, 2 * world * maxn4 * 16));
  // k_mem: signals then taken counts in words [0, 4*MAXB*MAXW); k_param: a region per size.
  size_t pad_words = 4 * MAXB * MAXW + 5 * 2 * MAXB * MAXW;
  CK(cudaMalloc(&pads, pad_words * 4));
  CK(cudaMemset(pads, 0, pad_words * 4));
  CK(cudaDeviceSynchronize());
  sh->data[rank] = data;
  sh->pads[rank] = pads;
  sh->scratch[rank] = scratch;
  sh->bar.arrive_and_wait();
  Peers pd{}, ps{};
  for (int q = 0; q < world; q++) pd.data[q] = sh->data[q], pd.pads[q] = sh->pads[q], ps.data[q] = sh->scratch[q], ps.pads[q] = sh->pads[q];
  float4** g_data;
  unsigned** g_pads;
  CK(cudaMalloc(&g_data, sizeof(void*) * MAXW));
  CK(cudaMalloc(&g_pads, sizeof(void*) * MAXW));
  CK(cudaMemcpy(g_data, pd.data, sizeof(void*) * MAXW, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g_pads, pd.pads, sizeof(void*) * MAXW, cudaMemcpyHostToDevice));
  int calls_lamport = 0;
  std::vector<float> host(maxn4 * 4);
  for (int si = 0; si < 5; si++) {
    long n4 = SIZES[si] / 16;
    int blocks = (int)std::min<long>(MAXB, (n4 + THREADS - 1) / THREADS);
    unsigned expect = 0;  // calls of k_param at this size so far (every block counts each)
    int base = 4 * MAXB + si * 2 * MAXB;
    auto launch = [&](int v, int iter) {
      switch (v) {
        case 0: k_empty<<<1, 32, 0, s>>>(); break;
        case 1: k_mem<<<blocks, THREADS, 0, s>>>(g_data, g_pads, world, rank, out, n4); break;
        case 2: k_param<<<blocks, THREADS, 0, s>>>(pd, world, rank, out, n4, base, ++expect); break;
        case 3: k_lamport<<<blocks, THREADS, 0, s>>>(ps, (const uint4*)in, world, rank, out, n4, calls_lamport++ & 1); break;
      }
      (void)iter;
    };
    // Check each variant's sums on 20 calls with inputs that change every call.
    for (int v = 1; v < 4; v++) {
      for (int it = 0; it < 20; it++) {
        k_fill<<<blocks, THREADS, 0, s>>>(v == 3 ? in : data, n4, rank, it);
        CK(cudaStreamSynchronize(s));
        sh->bar.arrive_and_wait();
        launch(v, it);
        CK(cudaMemcpyAsync(host.data(), out, n4 * 16, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        for (long e = 0; e < n4 * 4; e++) {
          float want = 0;
          for (int q = 0; q < world; q++) want += (float)(((e / 4) * 4) % 97 + q + it) + (float)(e % 4);
          if (host[e] != want) {
            fprintf(stderr, "rank %d %s bytes %ld call %d element %ld: %f, want %f\n", rank, NAMES[v], SIZES[si], it, e, host[e], want);
            exit(1);
          }
        }
        sh->bar.arrive_and_wait();
      }
    }
    for (int v = 0; v < 4; v++) {
      for (int it = 0; it < 100; it++) launch(v, it);
      CK(cudaStreamSynchronize(s));
      sh->bar.arrive_and_wait();
      auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < iters; it++) launch(v, it);
      CK(cudaStreamSynchronize(s));
      auto t1 = std::chrono::steady_clock::now();
      sh->us[si][v][rank] = std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
      sh->bar.arrive_and_wait();
      // The same calls from a CUDA graph of 50 launches: the GPU's time alone, without the
      // host's launch cost (k_param's expected counts cannot be replayed, so it is left out).
      if (v == 2) continue;
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (int it = 0; it < 50; it++) launch(v, it);
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      for (int w = 0; w < 3; w++) CK(cudaGraphLaunch(ge, s));
      CK(cudaStreamSynchronize(s));
      sh->bar.arrive_and_wait();
      auto g0 = std::chrono::steady_clock::now();
      for (int it = 0; it < iters / 50; it++) CK(cudaGraphLaunch(ge, s));
      CK(cudaStreamSynchronize(s));
      auto g1 = std::chrono::steady_clock::now();
      sh->graph_us[si][v][rank] = std::chrono::duration<double, std::micro>(g1 - g0).count() / (iters / 50 * 50);
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
      sh->bar.arrive_and_wait();
    }
  }
  CK(cudaGetLastError());
}

int main(int argc, char** argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 2000;
  int world = 0;
  CK(cudaGetDeviceCount(&world));
  if (world < 2) {
    printf("symm_probe needs 2 GPUs\n");
    return 0;
  }
  world = std::min(world, MAXW);
  Shared sh(world);
  std::vector<std::thread> ts;
  for (int r = 0; r < world; r++) ts.emplace_back(rank_main, &sh, r, iters);
  for (auto& t : ts) t.join();
  // One table: per size, each variant's slowest rank.
  auto table = [&](const char* title, double (*us)[8][MAXW]) {
    printf("%s\n%10s", title, "bytes");
    for (auto n : NAMES) printf(" %10s", n);
    printf("\n");
    for (int si = 0; si < 5; si++) {
      printf("%10ld", SIZES[si]);
      for (int v = 0; v < 4; v++) {
        double m = 0;
        for (int r = 0; r < world; r++) m = std::max(m, us[si][v][r]);
        printf(" %10.2f", m);
      }
      printf("\n");
    }
  };
  printf("# %d GPUs, %d calls, slowest rank's us per call\n", world, iters);
  table("# from a host loop of launches", sh.us);
  table("# the same from CUDA graphs of 50 calls (GPU time alone)", sh.graph_us);
}
