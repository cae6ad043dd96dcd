/* Spatial-partitioning probe for vgpu (issue 3, "Guarantee"): answers, on the GPU, the questions
 * that decide whether the interposer can move a process's kernels onto fewer SMs at run time.
 *
 *   probe [green_sms]        the main questions (run it with and without an MPS daemon)
 *   probe xctx               cross-context memory in an SM-count (execution affinity) context;
 *                            may end in an illegal-address fault, so run it last and alone
 *
 * Every answer is one line `Q <name>: <answer> (<detail>)`; the last line is `RESULT {json}`.
 * Built on the GPU machine (needs cuda.h from the CUDA 13 toolkit):
 *   cc -O2 -I/usr/local/cuda/include probe.c -o probe -L/usr/local/nvidia/lib64 -l:libcuda.so.1
 * The kernels are PTX in this file, JIT-compiled by the driver, so no nvcc step is needed. */
#include <cuda.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char ptx[] =
    ".version 7.0\n"
    ".target sm_80\n"
    ".address_size 64\n"
    /* smid(out, spin): block b writes the SM it ran on to out[b], then spins `spin` cycles. */
    ".visible .entry smid(.param .u64 out, .param .u64 spin)\n"
    "{\n"
    " .reg .u32 %r<4>;\n .reg .u64 %rd<8>;\n .reg .pred %p;\n"
    " ld.param.u64 %rd1, [out];\n ld.param.u64 %rd2, [spin];\n"
    " cvta.to.global.u64 %rd1, %rd1;\n"
    " mov.u32 %r1, %smid;\n mov.u32 %r2, %ctaid.x;\n"
    " mul.wide.u32 %rd3, %r2, 4;\n add.u64 %rd4, %rd1, %rd3;\n"
    " st.global.u32 [%rd4], %r1;\n"
    " mov.u64 %rd5, %clock64;\n"
    "SPIN1:\n mov.u64 %rd6, %clock64;\n sub.u64 %rd7, %rd6, %rd5;\n"
    " setp.lt.u64 %p, %rd7, %rd2;\n @%p bra SPIN1;\n"
    " ret;\n"
    "}\n"
    /* addone(src, dst, spin): spins, then *dst = *src + 1 (ordering checks). */
    ".visible .entry addone(.param .u64 src, .param .u64 dst, .param .u64 spin)\n"
    "{\n"
    " .reg .u32 %r<4>;\n .reg .u64 %rd<8>;\n .reg .pred %p;\n"
    " ld.param.u64 %rd1, [src];\n ld.param.u64 %rd2, [dst];\n ld.param.u64 %rd3, [spin];\n"
    " cvta.to.global.u64 %rd1, %rd1;\n cvta.to.global.u64 %rd2, %rd2;\n"
    " mov.u64 %rd4, %clock64;\n"
    "SPIN2:\n mov.u64 %rd5, %clock64;\n sub.u64 %rd6, %rd5, %rd4;\n"
    " setp.lt.u64 %p, %rd6, %rd3;\n @%p bra SPIN2;\n"
    " ld.global.u32 %r1, [%rd1];\n add.u32 %r2, %r1, 1;\n st.global.u32 [%rd2], %r2;\n"
    " ret;\n"
    "}\n";

#define SMID_BLOCKS 4096
#define MAX_SM 1024

static char json[8192];
static size_t json_len;

static void emit(const char *key, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void emit(const char *key, const char *fmt, ...) {
  char value[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(value, sizeof value, fmt, ap);
  va_end(ap);
  json_len += snprintf(json + json_len, sizeof json - json_len, "%s\"%s\": \"%s\"",
                       json_len ? ", " : "", key, value);
}

static const char *err(CUresult r) {
  const char *s = NULL;
  cuGetErrorName(r, &s);
  return s ? s : "?";
}

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* Answer line plus the same answer in the RESULT json. */
static void answer(const char *name, CUresult r, const char *detail) {
  printf("Q %s: %s (%s%s%s)\n", name, r == CUDA_SUCCESS ? "yes" : "no", err(r),
         detail && *detail ? ", " : "", detail ? detail : "");
  emit(name, "%s%s%s", r == CUDA_SUCCESS ? "yes" : err(r), detail && *detail ? " " : "",
       detail ? detail : "");
  fflush(stdout);
}

/* Launches smid on `stream` with function `f` and counts the distinct SMs the blocks ran on. */
static CUresult count_sms(CUfunction f, CUstream stream, CUdeviceptr out, int *distinct) {
  unsigned long long spin = 20000; /* about 10 us per block */
  void *args[] = {&out, &spin};
  CUresult r = cuLaunchKernel(f, SMID_BLOCKS, 1, 1, 1, 1, 1, 0, stream, args, NULL);
  if (r) return r;
  if ((r = cuStreamSynchronize(stream))) return r;
  static unsigned host[SMID_BLOCKS];
  if ((r = cuMemcpyDtoH(host, out, sizeof host))) return r;
  static char seen[MAX_SM];
  memset(seen, 0, sizeof seen);
  *distinct = 0;
  for (int i = 0; i < SMID_BLOCKS; i++) {
    if (host[i] < MAX_SM && !seen[host[i]]) {
      seen[host[i]] = 1;
      (*distinct)++;
    }
  }
  return CUDA_SUCCESS;
}

/* a -> b on `first` (long spin), b -> c on `second`, c -> d on `first`, joined by events;
 * the result is correct (3) only if the events order the three kernels. */
static CUresult ordered_chain(CUfunction f_first, CUfunction f_second, CUstream first,
                              CUstream second, CUdeviceptr buf, unsigned *result) {
  CUresult r;
  unsigned zero[4] = {0, 0, 0, 0};
  if ((r = cuMemcpyHtoD(buf, zero, sizeof zero))) return r;
  CUevent e1, e2;
  if ((r = cuEventCreate(&e1, CU_EVENT_DISABLE_TIMING))) return r;
  if ((r = cuEventCreate(&e2, CU_EVENT_DISABLE_TIMING))) return r;
  CUdeviceptr a = buf, b = buf + 4, c = buf + 8, d = buf + 12;
  unsigned long long long_spin = 100000000ULL, short_spin = 1000;
  void *args1[] = {&a, &b, &long_spin};
  void *args2[] = {&b, &c, &short_spin};
  void *args3[] = {&c, &d, &short_spin};
  if ((r = cuLaunchKernel(f_first, 1, 1, 1, 1, 1, 1, 0, first, args1, NULL))) return r;
  if ((r = cuEventRecord(e1, first))) return r;
  if ((r = cuStreamWaitEvent(second, e1, 0))) return r;
  if ((r = cuLaunchKernel(f_second, 1, 1, 1, 1, 1, 1, 0, second, args2, NULL))) return r;
  if ((r = cuEventRecord(e2, second))) return r;
  if ((r = cuStreamWaitEvent(first, e2, 0))) return r;
  if ((r = cuLaunchKernel(f_first, 1, 1, 1, 1, 1, 1, 0, first, args3, NULL))) return r;
  if ((r = cuStreamSynchronize(first))) return r;
  unsigned host[4];
  if ((r = cuMemcpyDtoH(host, buf, sizeof host))) return r;
  *result = host[3];
  cuEventDestroy(e1);
  cuEventDestroy(e2);
  return CUDA_SUCCESS;
}

static int xctx(CUdevice dev, CUcontext primary, int sms) {
  /* An SM-count execution-affinity context (Volta+ MPS only) and memory of the primary context. */
  CUdeviceptr prim_buf;
  CUresult r = cuMemAlloc(&prim_buf, 16);
  if (r) return answer("xctx_alloc_primary", r, ""), 1;
  cuMemsetD32(prim_buf, 41, 4);
  CUexecAffinityParam aff;
  memset(&aff, 0, sizeof aff);
  aff.type = CU_EXEC_AFFINITY_TYPE_SM_COUNT;
  aff.param.smCount.val = (unsigned)sms;
  CUctxCreateParams params;
  memset(&params, 0, sizeof params);
  params.execAffinityParams = &aff;
  params.numExecAffinityParams = 1;
  CUcontext actx;
  r = cuCtxCreate_v4(&actx, &params, 0, dev);
  answer("affinity_ctx_create", r, "");
  if (r) return 1;
  CUexecAffinityParam got;
  r = cuCtxGetExecAffinity(&got, CU_EXEC_AFFINITY_TYPE_SM_COUNT);
  char detail[64];
  snprintf(detail, sizeof detail, "sms=%u", r ? 0 : got.param.smCount.val);
  answer("affinity_ctx_sm_count", r, detail);
  CUmodule mod;
  CUfunction f_add;
  if ((r = cuModuleLoadData(&mod, ptx)) || (r = cuModuleGetFunction(&f_add, mod, "addone")))
    return answer("affinity_ctx_module", r, ""), 1;
  CUstream s;
  cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  unsigned long long spin = 1000;
  CUdeviceptr src = prim_buf, dst = prim_buf + 4;
  void *args[] = {&src, &dst, &spin};
  r = cuLaunchKernel(f_add, 1, 1, 1, 1, 1, 1, 0, s, args, NULL);
  if (!r) r = cuStreamSynchronize(s);
  unsigned host[4] = {0};
  if (!r) r = cuMemcpyDtoH(host, prim_buf, sizeof host);
  snprintf(detail, sizeof detail, "dst=%u want 42", host[1]);
  answer("affinity_ctx_kernel_on_primary_memory", r == CUDA_SUCCESS && host[1] == 42 ? r : (r ? r : CUDA_ERROR_UNKNOWN), detail);
  (void)primary;
  return 0;
}

int main(int argc, char **argv) {
  int green_sms = 66;
  int mode_xctx = argc > 1 && strcmp(argv[1], "xctx") == 0;
  if (argc > 1 && !mode_xctx) green_sms = atoi(argv[1]);
  if (argc > 2) green_sms = atoi(argv[2]);
  CUresult r;
  if ((r = cuInit(0))) return printf("cuInit: %s\n", err(r)), 1;
  int ver = 0;
  cuDriverGetVersion(&ver);
  CUdevice dev;
  cuDeviceGet(&dev, 0);
  int total_sms = 0;
  cuDeviceGetAttribute(&total_sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
  CUcontext primary;
  if ((r = cuDevicePrimaryCtxRetain(&primary, dev)) || (r = cuCtxSetCurrent(primary)))
    return printf("primary context: %s\n", err(r)), 1;
  printf("driver %d, %d SMs\n", ver, total_sms);
  emit("driver", "%d", ver);
  emit("device_sms", "%d", total_sms);
  if (mode_xctx) {
    int rc = xctx(dev, primary, green_sms);
    printf("RESULT {%s}\n", json);
    return rc;
  }

  /* Kernels: a context-bound module (CUfunction of the primary context) and a
   * context-independent library (CUkernel). */
  CUmodule mod;
  CUfunction f_smid, f_add;
  if ((r = cuModuleLoadData(&mod, ptx)) || (r = cuModuleGetFunction(&f_smid, mod, "smid")) ||
      (r = cuModuleGetFunction(&f_add, mod, "addone")))
    return printf("module: %s\n", err(r)), 1;
  CUlibrary lib;
  CUkernel k_smid = NULL, k_add = NULL;
  r = cuLibraryLoadData(&lib, ptx, NULL, NULL, 0, NULL, NULL, 0);
  if (!r) r = cuLibraryGetKernel(&k_smid, lib, "smid");
  if (!r) r = cuLibraryGetKernel(&k_add, lib, "addone");
  answer("library_load", r, "");

  CUdeviceptr out, buf;
  if ((r = cuMemAlloc(&out, SMID_BLOCKS * 4)) || (r = cuMemAlloc(&buf, 16)))
    return printf("alloc: %s\n", err(r)), 1;
  CUstream s_prim;
  cuStreamCreate(&s_prim, CU_STREAM_NON_BLOCKING);
  int n = 0;
  char detail[128];
  r = count_sms(f_smid, s_prim, out, &n);
  snprintf(detail, sizeof detail, "%d SMs used", n);
  answer("primary_stream_sms", r, detail);
  emit("primary_sms_used", "%d", n);

  /* Green context: step 1-4 of the driver docs. */
  CUdevResource all, part, rest;
  memset(&part, 0, sizeof part);
  r = cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM);
  snprintf(detail, sizeof detail, "smCount=%u minPartition=%u alignment=%u", all.sm.smCount,
           all.sm.minSmPartitionSize, all.sm.smCoscheduledAlignment);
  answer("device_sm_resource", r, detail);
  unsigned groups = 1;
  if (!r) r = cuDevSmResourceSplitByCount(&part, &groups, &all, &rest, 0, (unsigned)green_sms);
  snprintf(detail, sizeof detail, "asked %d got %u in %u group(s)", green_sms, part.sm.smCount,
           groups);
  answer("sm_split", r, detail);
  CUdevResourceDesc desc;
  if (!r) r = cuDevResourceGenerateDesc(&desc, &part, 1);
  CUgreenCtx green = NULL;
  double t0 = now_us();
  if (!r) r = cuGreenCtxCreate(&green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM);
  snprintf(detail, sizeof detail, "%.0f us", now_us() - t0);
  answer("green_ctx_create", r, detail);
  if (r) {
    printf("RESULT {%s}\n", json);
    return 0;
  }
  CUstream s_green;
  t0 = now_us();
  r = cuGreenCtxStreamCreate(&s_green, green, CU_STREAM_NON_BLOCKING, 0);
  snprintf(detail, sizeof detail, "%.0f us", now_us() - t0);
  answer("green_stream_create", r, detail);
  CUcontext green_as_ctx = NULL;
  r = cuCtxFromGreenCtx(&green_as_ctx, green);
  answer("ctx_from_green_ctx", r, "");

  /* The key question for a transparent interposer: the application's kernels (CUfunction of the
   * primary context, as cuModuleGetFunction / the runtime hand them out) and its memory,
   * launched on a green stream while the primary context stays current. */
  r = count_sms(f_smid, s_green, out, &n);
  snprintf(detail, sizeof detail, "%d SMs used", n);
  answer("green_stream_primary_cufunction", r, detail);
  emit("green_sms_used_cufunction", "%d", n);
  if (k_smid) {
    r = count_sms((CUfunction)k_smid, s_green, out, &n);
    snprintf(detail, sizeof detail, "%d SMs used", n);
    answer("green_stream_cukernel", r, detail);
  }
  /* Same with the green context current (as an application using green contexts would). */
  cuCtxSetCurrent(green_as_ctx);
  r = count_sms(f_smid, s_green, out, &n);
  snprintf(detail, sizeof detail, "%d SMs used", n);
  answer("green_current_primary_cufunction", r, detail);
  cuCtxSetCurrent(primary);
  /* Primary stream after all that: still all SMs? */
  r = count_sms(f_smid, s_prim, out, &n);
  snprintf(detail, sizeof detail, "%d SMs used", n);
  answer("primary_stream_sms_after", r, detail);

  /* Ordering across the primary and the green stream with events (the interposer's redirect). */
  unsigned result = 0;
  r = ordered_chain(f_add, f_add, s_prim, s_green, buf, &result);
  snprintf(detail, sizeof detail, "result %u want 3", result);
  answer("event_ordering_primary_green", r == CUDA_SUCCESS && result == 3 ? r : (r ? r : CUDA_ERROR_UNKNOWN), detail);

  /* Cost of a redirected launch: record on the app stream, wait on green, launch, record on
   * green, wait on the app stream; against a plain launch. */
  CUevent ea, eg;
  cuEventCreate(&ea, CU_EVENT_DISABLE_TIMING);
  cuEventCreate(&eg, CU_EVENT_DISABLE_TIMING);
  unsigned long long tiny = 0;
  CUdeviceptr a = buf, b = buf + 4;
  void *args[] = {&a, &b, &tiny};
  const int iters = 2000;
  double best_plain = 1e9, best_redirect = 1e9;
  for (int round = 0; round < 3; round++) {
    cuStreamSynchronize(s_prim);
    t0 = now_us();
    for (int i = 0; i < iters; i++) cuLaunchKernel(f_add, 1, 1, 1, 1, 1, 1, 0, s_prim, args, NULL);
    double plain = (now_us() - t0) / iters;
    cuStreamSynchronize(s_prim);
    t0 = now_us();
    for (int i = 0; i < iters; i++) {
      cuEventRecord(ea, s_prim);
      cuStreamWaitEvent(s_green, ea, 0);
      cuLaunchKernel(f_add, 1, 1, 1, 1, 1, 1, 0, s_green, args, NULL);
      cuEventRecord(eg, s_green);
      cuStreamWaitEvent(s_prim, eg, 0);
    }
    double redirect = (now_us() - t0) / iters;
    cuStreamSynchronize(s_prim);
    if (plain < best_plain) best_plain = plain;
    if (redirect < best_redirect) best_redirect = redirect;
  }
  snprintf(detail, sizeof detail, "plain %.2f us, redirected %.2f us per launch", best_plain,
           best_redirect);
  answer("redirect_cost", CUDA_SUCCESS, detail);
  emit("launch_us_plain", "%.2f", best_plain);
  emit("launch_us_redirected", "%.2f", best_redirect);

  /* Memory made in the green context is usable from the primary one (shared address space). */
  cuCtxSetCurrent(green_as_ctx);
  CUdeviceptr gbuf;
  r = cuMemAlloc(&gbuf, 16);
  cuCtxSetCurrent(primary);
  if (!r) {
    cuMemsetD32(gbuf, 7, 4);
    CUdeviceptr src = gbuf, dst = gbuf + 4;
    void *a2[] = {&src, &dst, &tiny};
    r = cuLaunchKernel(f_add, 1, 1, 1, 1, 1, 1, 0, s_prim, a2, NULL);
    if (!r) r = cuStreamSynchronize(s_prim);
    unsigned host[4] = {0};
    if (!r) r = cuMemcpyDtoH(host, gbuf, sizeof host);
    snprintf(detail, sizeof detail, "dst=%u want 8", host[1]);
    if (!r && host[1] != 8) r = CUDA_ERROR_UNKNOWN;
  }
  answer("green_alloc_used_by_primary_kernel", r, detail);

  /* Can the green stream stay alive while the primary context keeps running (the interposer
   * keeps one per app stream)? Destroy order check. */
  r = cuStreamDestroy(s_green);
  if (!r) r = cuGreenCtxDestroy(green);
  answer("green_destroy", r, "");
  r = cuCtxSynchronize();
  answer("primary_alive_after", r, "");
  printf("RESULT {%s}\n", json);
  return 0;
}
