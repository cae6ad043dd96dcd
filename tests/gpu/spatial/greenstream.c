/* A green-context stream for an already running CUDA process, loaded with ctypes by spatial.py:
 * it stands in for what the interposer would do (create a green context with fewer SMs next to
 * the application's primary context and run the application's kernels on its stream).
 * Built on the GPU machine:
 *   cc -O2 -shared -fPIC -I/usr/local/cuda/include greenstream.c -o greenstream.so \
 *      -L/usr/local/nvidia/lib64 -l:libcuda.so.1 */
#include <cuda.h>
#include <string.h>

/* Creates a green context of at least `sms` SMs on device `ordinal` and a non-blocking stream in
 * it; returns the CUresult, the stream in *stream_out and the SM count granted in *got_sms. */
int vgpu_green_stream(int ordinal, int sms, unsigned long long *stream_out, int *got_sms) {
  CUdevice dev;
  CUresult r = cuDeviceGet(&dev, ordinal);
  if (r) return r;
  CUdevResource all, part, rest;
  memset(&part, 0, sizeof part);
  if ((r = cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM))) return r;
  unsigned groups = 1;
  if ((r = cuDevSmResourceSplitByCount(&part, &groups, &all, &rest, 0, (unsigned)sms))) return r;
  CUdevResourceDesc desc;
  if ((r = cuDevResourceGenerateDesc(&desc, &part, 1))) return r;
  CUgreenCtx green;
  if ((r = cuGreenCtxCreate(&green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM))) return r;
  CUstream stream;
  if ((r = cuGreenCtxStreamCreate(&stream, green, CU_STREAM_NON_BLOCKING, 0))) return r;
  *stream_out = (unsigned long long)stream;
  *got_sms = (int)part.sm.smCount;
  return CUDA_SUCCESS;
}
