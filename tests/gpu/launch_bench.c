/* Launch overhead for tests/gpu/compute_shares.sh: an empty kernel launched N times with
 * cuLaunchKernel (synchronising every 256 launches, outside the timed part); prints the mean
 * time of one cuLaunchKernel call in microseconds. Built on the GPU machine:
 *   cc -O2 launch_bench.c -o launch_bench -L/usr/local/nvidia/lib64 -l:libcuda.so.1
 * No cuda.h needed: the few driver functions are declared here (public ABI). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
CUresult cuInit(unsigned int);
CUresult cuDeviceGet(int *, int);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuModuleLoadData(void **, const void *);
CUresult cuModuleGetFunction(void **, void *, const char *);
CUresult cuLaunchKernel(void *, unsigned int, unsigned int, unsigned int, unsigned int,
                        unsigned int, unsigned int, unsigned int, void *, void **, void **);
CUresult cuCtxSynchronize(void);

static const char ptx[] =
    ".version 7.0\n.target sm_80\n.address_size 64\n.visible .entry empty()\n{\n ret;\n}\n";

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 200000, dev;
  void *ctx, *module, *f;
  if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) ||
      cuCtxSetCurrent(ctx) || cuModuleLoadData(&module, ptx) ||
      cuModuleGetFunction(&f, module, "empty")) {
    fprintf(stderr, "CUDA setup failed\n");
    return 1;
  }
  for (int i = 0; i < 2000; i++) cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
  cuCtxSynchronize();
  double timed = 0;
  for (int done = 0; done < n;) {
    double t0 = now_us();
    for (int i = 0; i < 256; i++, done++) {
      if (cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) {
        fprintf(stderr, "launch failed\n");
        return 1;
      }
    }
    timed += now_us() - t0;
    cuCtxSynchronize();
  }
  printf("RESULT {\"us_per_launch\": %.4f, \"launches\": %d}\n", timed / n, n);
  return 0;
}
