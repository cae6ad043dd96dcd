// Cooperative kernels under the interposer (tests/gpu/coverage.sh). Built on the GPU machine:
//   nvcc -O2 -arch=sm_90 tests/gpu/coop.cu -o coop -lcuda   (or -L<cuda>/lib64/stubs -lcuda)
//
//   coop check                  a grid-synchronized kernel launched 20 times through the runtime
//                               (cudaLaunchCooperativeKernel) and 20 times through the driver
//                               (cuLaunchCooperativeKernel, linked directly, so the preloaded hook
//                               is what is called), every result checked on the host; then
//                               cudaMemGetInfo and 256 MiB cudaMallocs until the first failure
//                               (the tenant's limit), and the checked kernel once more
//   coop spin START WINDOW [ITERS [CHUNK]]
//                               grid-synchronized busy kernels (ITERS = 50000: about 1.3 ms on
//                               an H100) back to back through cuLaunchCooperativeKernel, CHUNK
//                               (4) launches per cudaDeviceSynchronize; counts those completed
//                               inside [START, START + WINDOW] (CLOCK_MONOTONIC seconds, as
//                               Python's time.monotonic())
// Prints `RESULT {json}` last.
#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

namespace cg = cooperative_groups;

// Phase 1 writes x, the grid synchronizes, phase 2 reads x at a distance (written by another
// block): without a working grid barrier (all blocks co-resident) y comes out wrong.
__global__ void ring(int* x, int* y, int n, int salt) {
  cg::grid_group grid = cg::this_grid();
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = first; i < n; i += stride) x[i] = (int)(i * 3) + salt;
  grid.sync();
  for (long long i = first; i < n; i += stride) {
    long long j = (i + n / 2 + 17) % n;
    y[i] = x[j] - x[i];
  }
}

__global__ void spin(float* out, int iters) {
  cg::grid_group grid = cg::this_grid();
  float v = threadIdx.x * 1e-3f;
  for (int k = 0; k < iters; k++) v = fmaf(v, 0.999999f, 1e-6f);
  grid.sync();
  for (int k = 0; k < iters; k++) v = fmaf(v, 0.999999f, 1e-6f);
  if (v == 12345.0f) out[0] = v;  // keeps the loops
}

static double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

#define RT(call)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      printf("RESULT {\"ok\": false, \"error\": \"%s: %s\"}\n", #call, cudaGetErrorString(e_)); \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

static int blocks_for(const void* kernel, int threads) {
  int dev = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0);
  return sms * (per_sm > 0 ? per_sm : 1);
}

// Launches ring once (runtime or driver API) and checks every element on the host.
static int ring_once(bool driver, CUfunction f, int* x, int* y, int n, int salt, int blocks,
                     int threads, std::vector<int>& host, long long* bad) {
  RT(cudaMemset(x, 0xff, sizeof(int) * n));
  RT(cudaMemset(y, 0xff, sizeof(int) * n));
  void* args[] = {&x, &y, &n, &salt};
  if (driver) {
    CUresult r = cuLaunchCooperativeKernel(f, blocks, 1, 1, threads, 1, 1, 0, 0, args);
    if (r != CUDA_SUCCESS) {
      printf("RESULT {\"ok\": false, \"error\": \"cuLaunchCooperativeKernel: %d\"}\n", (int)r);
      return 1;
    }
  } else {
    RT(cudaLaunchCooperativeKernel((const void*)ring, blocks, threads, args, 0, 0));
  }
  RT(cudaDeviceSynchronize());
  RT(cudaMemcpy(host.data(), y, sizeof(int) * n, cudaMemcpyDeviceToHost));
  for (long long i = 0; i < n; i++) {
    long long j = (i + n / 2 + 17) % n;
    if (host[i] != (int)(3 * (j - i))) ++*bad;
  }
  return 0;
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "check";
  const int threads = 256;
  RT(cudaSetDevice(0));
  RT(cudaFree(0));
  if (strcmp(mode, "check") == 0) {
    const int n = 1 << 22;
    int *x, *y;
    RT(cudaMalloc(&x, sizeof(int) * n));
    RT(cudaMalloc(&y, sizeof(int) * n));
    std::vector<int> host(n);
    CUfunction f;
    RT(cudaGetFuncBySymbol((cudaFunction_t*)&f, (const void*)ring));
    int blocks = blocks_for((const void*)ring, threads);
    long long bad_runtime = 0, bad_driver = 0, bad_after = 0;
    for (int k = 0; k < 20; k++) {
      if (ring_once(false, f, x, y, n, k, blocks, threads, host, &bad_runtime)) return 1;
      if (ring_once(true, f, x, y, n, 100 + k, blocks, threads, host, &bad_driver)) return 1;
    }
    size_t free_b = 0, total_b = 0;
    RT(cudaMemGetInfo(&free_b, &total_b));
    std::vector<void*> chunks;
    const size_t chunk = 256ull << 20;
    cudaError_t err = cudaSuccess;
    while (chunks.size() < 4096) {
      void* p = nullptr;
      err = cudaMalloc(&p, chunk);
      if (err != cudaSuccess) break;
      chunks.push_back(p);
    }
    cudaGetLastError();  // clears the allocation error (not sticky)
    size_t got = chunks.size() * chunk + 2 * sizeof(int) * (size_t)n;
    for (void* p : chunks) cudaFree(p);
    if (ring_once(true, f, x, y, n, 7, blocks, threads, host, &bad_after)) return 1;
    printf("RESULT {\"ok\": %s, \"blocks\": %d, \"launches\": 41, \"bad_runtime\": %lld, "
           "\"bad_driver\": %lld, \"bad_after_oom\": %lld, \"total\": %zu, \"free\": %zu, "
           "\"allocated\": %zu, \"alloc_error\": \"%s\"}\n",
           (bad_runtime + bad_driver + bad_after) == 0 ? "true" : "false", blocks, bad_runtime,
           bad_driver, bad_after, total_b, free_b, got, cudaGetErrorName(err));
    return 0;
  }
  // spin START WINDOW
  double start = argc > 2 ? atof(argv[2]) : now_s();
  double window = argc > 3 ? atof(argv[3]) : 5.0;
  int iters = argc > 4 ? atoi(argv[4]) : 50000;
  const int chunk = argc > 5 ? atoi(argv[5]) : 4;
  float* out;
  RT(cudaMalloc(&out, sizeof(float)));
  CUfunction f;
  RT(cudaGetFuncBySymbol((cudaFunction_t*)&f, (const void*)spin));
  int blocks = blocks_for((const void*)spin, threads);
  void* args[] = {&out, &iters};
  cudaEvent_t e0, e1;
  RT(cudaEventCreate(&e0));
  RT(cudaEventCreate(&e1));
  RT(cudaEventRecord(e0, 0));
  if (cuLaunchCooperativeKernel(f, blocks, 1, 1, threads, 1, 1, 0, 0, args) != CUDA_SUCCESS) {
    printf("RESULT {\"ok\": false, \"error\": \"first cuLaunchCooperativeKernel failed\"}\n");
    return 1;
  }
  RT(cudaEventRecord(e1, 0));
  RT(cudaEventSynchronize(e1));
  float kernel_ms = 0;
  RT(cudaEventElapsedTime(&kernel_ms, e0, e1));
  long long done = 0;
  const bool late = now_s() > start;
  int failed = 0;
  while (true) {
    for (int k = 0; k < chunk; k++)
      if (cuLaunchCooperativeKernel(f, blocks, 1, 1, threads, 1, 1, 0, 0, args) != CUDA_SUCCESS)
        failed++;
    RT(cudaDeviceSynchronize());
    double t = now_s();
    if (t >= start && t <= start + window) done += chunk;
    if (t > start + window || failed) break;
  }
  printf("RESULT {\"ok\": %s, \"blocks\": %d, \"kernel_ms\": %.3f, \"launches\": %lld, "
         "\"failed\": %d, \"late\": %s, \"iters\": %d, \"chunk\": %d}\n",
         failed ? "false" : "true", blocks, kernel_ms, done, failed, late ? "true" : "false", iters,
         chunk);
  return 0;
}
