/* A CUDA "application" for the interposer's ABI tests: linked against libcuda.so.1 (the fake),
 * run with LD_PRELOAD=libvgpu_cuda.so. Runs its arguments as a small script, one command after
 * another, and prints one line per command ("<command> <CUresult> [details]"), flushed.
 *
 *   ctx D            make device D's context current (the process starts on device 0)
 *   alloc S          cuMemAlloc_v2, called directly (S like 6G, 512M, 4096)
 *   free             cuMemFree_v2 of the newest pointer
 *   dl_alloc S       cuMemAlloc_v2 found by dlsym(dlopen("libcuda.so.1"), ...)
 *   gpa_alloc S      "cuMemAlloc" from cuGetProcAddress_v2 (version 13000), itself from dlsym
 *   gpa_chain S      "cuGetProcAddress" from cuGetProcAddress_v2, then "cuMemAlloc" through it
 *   gpa_ptsz S       "cuMemAllocAsync" with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
 *   managed S | async S | pool S       cuMemAllocManaged / cuMemAllocAsync / ...FromPoolAsync
 *   free_async       cuMemFreeAsync of the newest pointer
 *   pitch W H        cuMemAllocPitch_v2 (prints the pitch)
 *   create S | release              cuMemCreate on the current device / cuMemRelease newest
 *   array W H | array3d W H D | destroy     CUDA arrays (FLOAT, 4 channels)
 *   ipc              cuIpcGetMemHandle of the newest pointer
 *   fill N | check N     writes bytes seeded by N over the newest pointer's whole allocation with
 *                    cuMemcpyHtoD_v2 / reads them back with cuMemcpyDtoH_v2: "check <rc> ok|bad"
 *                    (needs the fake's FAKE_CUDA_REAL_BYTES=1 and VMM-backed memory)
 *   addr             prints "addr <newest pointer>"
 *   kcheck N         a kernel (cuLaunchKernel on the user stream) that reads the newest pointer's
 *                    bytes: "kcheck <rc> ok|bad" (the fake sums them; FAKE_CUDA_REAL_BYTES=1)
 *   acheck N         the same bytes through cuMemcpyDtoHAsync_v2 and cuStreamSynchronize
 *   busy_unmaps      "busy_unmaps <n>": unmaps the fake saw while this process's kernels ran
 *   host_allocs      "host_allocs 0 <cuMemHostAlloc calls> <cuMemFreeHost calls>" (the fake's
 *                    counts: the swap's pinned staging)
 *   launches N       N launches of 0 us through cuLaunchKernel on the user stream, timed:
 *                    "launches <rc> ns=<mean ns per launch>" (the hooks' cost per launch, with
 *                    and without the interposer: overhead.rs)
 *   launches_of N US the same with kernels of US us, then cuCtxSynchronize: whether the gate
 *                    leaves the (fake) GPU idle between kernels ("launches_of <rc> ns=...")
 *   until_host_allocs N   waits (up to 20 s) until the fake counted N pins (cuMemHostAlloc or
 *                    cuMemHostRegister, from any thread): "until_host_allocs 0", -1 if not
 *   touch PATH | until_file PATH   creates PATH / waits (up to 20 s) until PATH exists
 *   spin_info PATH   calls cuMemGetInfo_v2 every millisecond until PATH exists (up to 20 s): a
 *                    process that keeps calling into the driver
 *   info             cuMemGetInfo_v2: "info 0 <free> <total>"
 *   total D          cuDeviceTotalMem_v2
 *   parent           prints getppid() (wrapped by a preloaded test library through RTLD_NEXT)
 *   hold             prints "holding" and sleeps until killed
 *   clock            prints CLOCK_MONOTONIC in ns
 *   launch API US    one simulated kernel of US microseconds through API (below): "launch <rc> lib="
 *   spin API US      kernels of US microseconds back to back through API until PROBE_UNTIL_NS
 *                    (CLOCK_MONOTONIC); prints "spinning" after the first, and at the end
 *                    "spin <rc> used=<ns of GPU time in FAKE_CUDA_WINDOW> launches=<n>
 *                    max_wait_us=<longest launch call>"
 *   sync             cuCtxSynchronize
 *   stream_sync      cuStreamSynchronize of the user stream
 *   copy US          cuMemcpyDtoDAsync_v2 on the user stream, which the fake runs for US us
 *   stream_poll      cuStreamQuery of the user stream until it says CUDA_SUCCESS
 *   step API US N    N latency "steps": one kernel of US microseconds through API, then
 *                    cuStreamSynchronize; prints "step <rc> max_us=<the longest step>"
 *   capture MODE API N   captures N kernels of 10 us through API into a graph on the user stream
 *                    (MODE: global or relaxed): "capture <rc> graph=<the graph's us>"; then
 *                    `launch graph US` / `spin graph US` launch graphs as usual
 *   trace            prints "trace <the fake driver's trace>" (which stream each kernel ran on)
 *   vmm              prints "vmm 0 reserved=<bytes> mapped=<bytes>": the fake's VMM address ranges
 *   sleep_ms N       sleeps N milliseconds
 *   retain D         cuDevicePrimaryCtxRetain(D) and, if it succeeds, makes it current
 *   nvml_dl I | nvml2_dl I    NVML device I's memory through dlsym(dlopen("libnvidia-ml.so.1"))
 *                    (nvmlDeviceGetMemoryInfo / _v2): "nvml_dl <rc> <total> <free> <used> lib=",
 *                    "nvml2_dl <rc> <total> <reserved> <free> <used> lib=" (rc -1: no library)
 *   nvml_default     nvmlDeviceGetMemoryInfo from dlsym(RTLD_DEFAULT), on a null device: "<rc> lib="
 *   pid              prints "pid <getpid()>"
 *   procs_dl KIND I N    NVML device I's process list through dlsym(dlopen("libnvidia-ml.so.1")),
 *                    KIND: compute, compute_v2, compute_v3, graphics[_v2|_v3], mps[_v2|_v3] (the
 *                    unversioned symbols with nvmlProcessInfo_v1_t, the others with _v2_t), with
 *                    room for N entries (N "null": infos NULL and *infoCount 0; I "null": a null
 *                    device): "procs_dl <rc> <*infoCount> [<pid>:<bytes>[:<gi>:<ci>] for each
 *                    entry on success] [overwritten: an entry past *infoCount changed] lib="
 * Built with -DPROBE_NVML_LINKED (and linked against libnvidia-ml.so.1), also:
 *   nvml I | nvml2 I NVML device I's memory, called directly (as nvml_dl / nvml2_dl)
 *   nvml2_version I V   nvmlDeviceGetMemoryInfo_v2 with the struct version V: "<rc> <total>"
 *   procs KIND I N   as procs_dl, called directly (without "lib=")
 *   hinter MODE      a hint helper (elastic memory): registers through
 *                    dlsym(RTLD_DEFAULT, "vgpu_memory_hint_register") ("hinter <rc>") and starts
 *                    a thread that polls vgpu_memory_want every millisecond (up to 20 s); MODE
 *                    free: at the first want it frees the newest pointer (taken off the list
 *                    now) with cuMemFree_v2 and calls vgpu_memory_hint_done; MODE release: the
 *                    same with the newest cuMemCreate handle and cuMemRelease (an engine's sleep
 *                    that releases its own VMM memory, as vLLM's sleep mode does); MODE idle: it
 *                    only records the largest want it saw
 *   hint_join        stops and joins the helper: "hint_join <largest want> <free rc or -1>"
 *   cold N           marks the newest pointer's allocation cold (N 1) or not (N 0) through
 *                    dlsym(RTLD_DEFAULT, "vgpu_memory_cold"): "cold <rc> <bytes marked>"
 *   progress N       vgpu_progress(N) through dlsym(RTLD_DEFAULT, "vgpu_progress"): "progress <rc>"
 *                    (-100: the symbol is missing)
 * PROBE_NO_CUDA=1: the process starts without a CUDA context (no cuInit, no primary context).
 * APIs: kernel, kernel_ptsz, ex, ex_ptsz, coop, coop_ptsz, multi (cooperative multi-device),
 * ex_coop (cuLaunchKernelEx with the cooperative attribute), graph, graph_ptsz, gpa / gpa_ptsz
 * (cuLaunchKernel from cuGetProcAddress_v2), dl (cuLaunchKernel from
 * dlsym(dlopen("libcuda.so.1")), dtod (cuMemcpyDtoDAsync_v2: a copy within the GPU, which runs on
 * its SMs like a kernel), unified_dtod / unified_htod (cuMemcpyAsync between two device addresses,
 * or from host memory), memset (cuMemsetD32Async, which the driver runs as a kernel).
 * "lib=<file>" says which library a function pointer lives in.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct {
  int type, id;
} CUmemLocation;
typedef struct {
  int type, requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  unsigned char allocFlags[8];
} CUmemAllocationProp;
typedef struct {
  size_t Width, Height;
  int Format;
  unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;
typedef struct {
  size_t Width, Height, Depth;
  int Format;
  unsigned int NumChannels, Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

CUresult cuInit(unsigned int);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuCtxGetDevice(int *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned int);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, void *);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, void *, void *);
CUresult cuMemFreeAsync(CUdeviceptr, void *);
CUresult cuMemCreate(unsigned long long *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(unsigned long long);
CUresult cuArrayCreate_v2(void **, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArray3DCreate_v2(void **, const CUDA_ARRAY3D_DESCRIPTOR *);
CUresult cuArrayDestroy(void *);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
typedef struct {
  char reserved[64];
} CUipcMemHandle;
CUresult cuIpcGetMemHandle(CUipcMemHandle *, CUdeviceptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuDeviceTotalMem_v2(size_t *, int);

typedef struct {
  unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  void *hStream;
  void *attrs;
  unsigned int numAttrs;
} CUlaunchConfig;
typedef CUresult (*launch_fn)(void *, unsigned int, unsigned int, unsigned int, unsigned int,
                              unsigned int, unsigned int, unsigned int, void *, void **, void **);
CUresult cuLaunchKernel(void *, unsigned int, unsigned int, unsigned int, unsigned int,
                        unsigned int, unsigned int, unsigned int, void *, void **, void **);
CUresult cuLaunchKernel_ptsz(void *, unsigned int, unsigned int, unsigned int, unsigned int,
                             unsigned int, unsigned int, unsigned int, void *, void **, void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, void *, void **, void **);
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *, void *, void **, void **);
CUresult cuLaunchCooperativeKernel(void *, unsigned int, unsigned int, unsigned int, unsigned int,
                                   unsigned int, unsigned int, unsigned int, void *, void **);
CUresult cuLaunchCooperativeKernel_ptsz(void *, unsigned int, unsigned int, unsigned int,
                                        unsigned int, unsigned int, unsigned int, unsigned int,
                                        void *, void **);
CUresult cuLaunchCooperativeKernelMultiDevice(void *, unsigned int, unsigned int);
CUresult cuGraphLaunch(void *, void *);
CUresult cuGraphLaunch_ptsz(void *, void *);
CUresult cuCtxSynchronize(void);
CUresult cuStreamSynchronize(void *);
CUresult cuStreamQuery(void *);
CUresult cuMemcpyDtoDAsync_v2(unsigned long long, unsigned long long, size_t, void *);
CUresult cuMemcpyAsync(unsigned long long, unsigned long long, size_t, void *);
CUresult cuMemsetD32Async(unsigned long long, unsigned int, size_t, void *);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, void *);
unsigned long long fakeKernelSum(void);
unsigned long long fakeBusyUnmaps(void);
unsigned long long fakeHostAllocs(void);
unsigned long long fakeHostFrees(void);
CUresult cuStreamBeginCapture_v2(void *, int);
CUresult cuStreamEndCapture(void *, void **);
unsigned long long fakeGpuUsedNs(void);
unsigned long long fakeVmmReservedBytes(void);
unsigned long long fakeVmmMappedBytes(void);
unsigned long long fakeLaunches(void);
const char *fakeTrace(void);

#include "nvml_layouts.h"
typedef nvmlReturn_t (*nvml_init_fn)(void);
typedef nvmlReturn_t (*nvml_handle_fn)(unsigned int, void **);
typedef nvmlReturn_t (*nvml_mem_fn)(void *, nvmlMemory_t *);
typedef nvmlReturn_t (*nvml_mem2_fn)(void *, nvmlMemory_v2_t *);
#ifdef PROBE_NVML_LINKED
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int, void **);
nvmlReturn_t nvmlDeviceGetMemoryInfo(void *, nvmlMemory_t *);
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *, nvmlMemory_v2_t *);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(void *, unsigned int *, nvmlProcessInfo_v1_t *);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(void *, unsigned int *, nvmlProcessInfo_v2_t *);
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *, unsigned int *, nvmlProcessInfo_v2_t *);
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(void *, unsigned int *, nvmlProcessInfo_v1_t *);
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(void *, unsigned int *, nvmlProcessInfo_v2_t *);
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(void *, unsigned int *, nvmlProcessInfo_v2_t *);
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(void *, unsigned int *, nvmlProcessInfo_v1_t *);
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(void *, unsigned int *,
                                                        nvmlProcessInfo_v2_t *);
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(void *, unsigned int *,
                                                        nvmlProcessInfo_v2_t *);
#define LINKED(f) ((void *)(f))
#else
#define LINKED(f) NULL
#endif
typedef nvmlReturn_t (*nvml_processes_fn)(void *, unsigned int *, void *);

/* The process-list queries by the probe's names for them. */
static const struct {
  const char *kind, *symbol;
  int v2;
  void *linked;
} process_queries[] = {
    {"compute", "nvmlDeviceGetComputeRunningProcesses", 0,
     LINKED(nvmlDeviceGetComputeRunningProcesses)},
    {"compute_v2", "nvmlDeviceGetComputeRunningProcesses_v2", 1,
     LINKED(nvmlDeviceGetComputeRunningProcesses_v2)},
    {"compute_v3", "nvmlDeviceGetComputeRunningProcesses_v3", 1,
     LINKED(nvmlDeviceGetComputeRunningProcesses_v3)},
    {"graphics", "nvmlDeviceGetGraphicsRunningProcesses", 0,
     LINKED(nvmlDeviceGetGraphicsRunningProcesses)},
    {"graphics_v2", "nvmlDeviceGetGraphicsRunningProcesses_v2", 1,
     LINKED(nvmlDeviceGetGraphicsRunningProcesses_v2)},
    {"graphics_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3", 1,
     LINKED(nvmlDeviceGetGraphicsRunningProcesses_v3)},
    {"mps", "nvmlDeviceGetMPSComputeRunningProcesses", 0,
     LINKED(nvmlDeviceGetMPSComputeRunningProcesses)},
    {"mps_v2", "nvmlDeviceGetMPSComputeRunningProcesses_v2", 1,
     LINKED(nvmlDeviceGetMPSComputeRunningProcesses_v2)},
    {"mps_v3", "nvmlDeviceGetMPSComputeRunningProcesses_v3", 1,
     LINKED(nvmlDeviceGetMPSComputeRunningProcesses_v3)},
};

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, void *);
typedef CUresult (*gpa_v2_fn)(const char *, void **, int, unsigned long long, int *);

static CUdeviceptr pointers[4096];
static unsigned long long sizes[4096];
static int n_pointers;
static unsigned long long handles[4096], handle_sizes[4096];
static int n_handles;
static void *arrays[4096];
static int n_arrays;

static unsigned long long size_arg(const char *s) {
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  switch (*end) {
    case 'G': return v << 30;
    case 'M': return v << 20;
    case 'K': return v << 10;
    default: return v;
  }
}

static const char *lib_of(void *f) {
  Dl_info info;
  if (f == NULL) return "null";
  if (!dladdr(f, &info) || info.dli_fname == NULL) return "unknown";
  const char *slash = strrchr(info.dli_fname, '/');
  return slash ? slash + 1 : info.dli_fname;
}

static unsigned long long last_size;
static void keep(CUresult rc, CUdeviceptr p) {
  if (rc == 0) {
    sizes[n_pointers] = last_size;
    pointers[n_pointers++] = p;
  }
}

/* Polls every millisecond until `path` exists (calling cuMemGetInfo_v2 each time if `info`), for
 * at most 20 s: 0 when it appeared, -1 when not. */
static int until_file(const char *path, int info) {
  for (int i = 0; i < 20000; i++) {
    if (access(path, F_OK) == 0) return 0;
    if (info) {
      size_t f, t;
      cuMemGetInfo_v2(&f, &t);
    }
    struct timespec ms = {0, 1000000L};
    nanosleep(&ms, NULL);
  }
  return -1;
}

/* Polls every millisecond until the fake counted `n` pins, for at most 20 s: 0, or -1. */
static int until_host_allocs(unsigned long long n) {
  for (int i = 0; i < 20000; i++) {
    if (fakeHostAllocs() >= n) return 0;
    struct timespec ms = {0, 1000000L};
    nanosleep(&ms, NULL);
  }
  return -1;
}

#define USER_STREAM ((void *)0x5000)

/* The bytes `fill N` writes over `n` bytes. */
static unsigned char *pattern_bytes(int seed, size_t n) {
  unsigned char *want = malloc(n);
  for (size_t b = 0; b < n; b++) want[b] = (unsigned char)(seed * 31 + b * 7 + b / 4096);
  return want;
}

/* kcheck / acheck: reads the newest pointer's bytes through a kernel or an asynchronous copy;
 * the driver's result, and in `*same` whether they are the pattern seeded by `seed`. */
static CUresult read_back(int seed, int kernel, int *same) {
  if (n_pointers == 0) return -1;
  CUdeviceptr address = pointers[n_pointers - 1];
  size_t n = (size_t)sizes[n_pointers - 1];
  unsigned char *want = pattern_bytes(seed, n), *got = malloc(n);
  unsigned long long expected = 0;
  for (size_t b = 0; b < n; b++) expected += want[b];
  CUresult rc;
  if (kernel) {
    void *params[2] = {&address, &n};
    rc = cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, USER_STREAM, params, NULL);
    *same = rc == 0 && fakeKernelSum() == expected;
  } else {
    rc = cuMemcpyDtoHAsync_v2(got, address, n, USER_STREAM);
    if (rc == 0) rc = cuStreamSynchronize(USER_STREAM);
    *same = rc == 0 && memcmp(want, got, n) == 0;
  }
  free(want);
  free(got);
  return rc;
}

/* fill / check: the newest pointer's bytes, seeded by `seed`; returns the driver's result, and
 * in `*same` whether what was read equals the pattern. */
static CUresult pattern(int seed, int write, int *same) {
  if (n_pointers == 0) return -1;
  size_t n = (size_t)sizes[n_pointers - 1];
  unsigned char *want = malloc(n), *got = malloc(n);
  for (size_t b = 0; b < n; b++) want[b] = (unsigned char)(seed * 31 + b * 7 + b / 4096);
  CUresult rc = write ? cuMemcpyHtoD_v2(pointers[n_pointers - 1], want, n)
                      : cuMemcpyDtoH_v2(got, pointers[n_pointers - 1], n);
  *same = !write && rc == 0 && memcmp(want, got, n) == 0;
  free(want);
  free(got);
  return rc;
}

/* free_later: another thread frees the newest pointer after a delay (a process whose other
   thread frees memory while one waits for room). */
static CUdeviceptr later_pointer;
static long later_ms;
static pthread_t later_thread;
static int later_started;
static void *free_later(void *unused) {
  (void)unused;
  struct timespec delay = {later_ms / 1000, (later_ms % 1000) * 1000000L};
  nanosleep(&delay, NULL);
  cuMemFree_v2(later_pointer);
  return NULL;
}

/* The hint helper of `hinter`: what it frees, what it saw. */
typedef int (*hint_register_fn)(void);
typedef int (*hint_want_fn)(unsigned long long *);
typedef int (*hint_done_fn)(unsigned long long);
static pthread_t hint_thread;
static int hint_started, hint_free_mode, hint_release_mode;
static CUdeviceptr hint_pointer;
static unsigned long long hint_handle;
static unsigned long long hint_pointer_size, hint_seen;
static int hint_free_rc = -1;
static volatile int hint_stop;

static void *hint_helper(void *unused) {
  (void)unused;
  hint_want_fn want = (hint_want_fn)dlsym(RTLD_DEFAULT, "vgpu_memory_want");
  hint_done_fn done = (hint_done_fn)dlsym(RTLD_DEFAULT, "vgpu_memory_hint_done");
  for (int i = 0; i < 20000 && !hint_stop && want && done; i++) {
    unsigned long long bytes = 0;
    if (want(&bytes) == 0 && bytes > 0) {
      if (bytes > hint_seen) hint_seen = bytes;
      if ((hint_free_mode || hint_release_mode) && hint_free_rc == -1) {
        hint_free_rc = hint_free_mode ? cuMemFree_v2(hint_pointer) : cuMemRelease(hint_handle);
        done(hint_pointer_size);
        return NULL;
      }
    }
    struct timespec ms = {0, 1000000L};
    nanosleep(&ms, NULL);
  }
  return NULL;
}

static gpa_v2_fn gpa_from_dlsym(void) {
  void *libcuda = dlopen("libcuda.so.1", RTLD_NOW);
  return libcuda ? (gpa_v2_fn)dlsym(libcuda, "cuGetProcAddress_v2") : NULL;
}

static unsigned long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (unsigned long long)t.tv_sec * 1000000000ULL + (unsigned long long)t.tv_nsec;
}


/* One kernel of `us` microseconds through `api`; `*lib` names the library of the function. */
static CUresult launch_via(const char *api, unsigned int us, const char **lib) {
  static launch_fn resolved[3];
  *lib = "libcuda.so.1";
  if (!strcmp(api, "kernel")) return cuLaunchKernel(NULL, us, 1, 1, 1, 1, 1, 0, USER_STREAM, NULL, NULL);
  /* A device-to-device copy runs on the SMs like a kernel (the fake runs it for `us` us). */
  if (!strcmp(api, "dtod")) return cuMemcpyDtoDAsync_v2(0, 0, (size_t)us * 1000, USER_STREAM);
  /* A memset of 4 bytes a word: the fake runs it for (bytes / 1000) us, like the copy. */
  if (!strcmp(api, "memset")) return cuMemsetD32Async(0, 0, (size_t)us * 250, USER_STREAM);
  /* cuMemcpyAsync, whose direction the driver reads from the pointers: between two device
   * addresses, or from host memory into the GPU. */
  if (!strcmp(api, "unified_dtod") || !strcmp(api, "unified_htod")) {
    static unsigned long long device_buffer;
    static unsigned char host_buffer[16];
    if (device_buffer == 0 && cuMemAlloc_v2(&device_buffer, 1 << 20) != 0) return -1;
    unsigned long long src = !strcmp(api, "unified_dtod")
                                 ? device_buffer
                                 : (unsigned long long)(uintptr_t)host_buffer;
    return cuMemcpyAsync(device_buffer, src, (size_t)us * 1000, USER_STREAM);
  }
  if (!strcmp(api, "kernel_ptsz"))
    return cuLaunchKernel_ptsz(NULL, us, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
  if (!strcmp(api, "ex") || !strcmp(api, "ex_ptsz") || !strcmp(api, "ex_coop")) {
    CUlaunchConfig config;
    struct {
      unsigned int id;
      char pad[4];
      int value[16];
    } coop = {2, {0}, {1}}; /* CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 1 */
    memset(&config, 0, sizeof config);
    config.gridDimX = us;
    config.hStream = USER_STREAM;
    if (!strcmp(api, "ex_coop")) {
      config.attrs = &coop;
      config.numAttrs = 1;
      return cuLaunchKernelEx(&config, NULL, NULL, NULL);
    }
    return !strcmp(api, "ex") ? cuLaunchKernelEx(&config, NULL, NULL, NULL)
                              : cuLaunchKernelEx_ptsz(&config, NULL, NULL, NULL);
  }
  if (!strcmp(api, "coop"))
    return cuLaunchCooperativeKernel(NULL, us, 1, 1, 1, 1, 1, 0, USER_STREAM, NULL);
  if (!strcmp(api, "coop_ptsz"))
    return cuLaunchCooperativeKernel_ptsz(NULL, us, 1, 1, 1, 1, 1, 0, NULL, NULL);
  if (!strcmp(api, "multi")) return cuLaunchCooperativeKernelMultiDevice(NULL, 1, 0);
  if (!strcmp(api, "graph")) return cuGraphLaunch((void *)(uintptr_t)us, USER_STREAM);
  if (!strcmp(api, "graph_ptsz")) return cuGraphLaunch_ptsz((void *)(uintptr_t)us, NULL);
  int slot = !strcmp(api, "gpa") ? 0 : !strcmp(api, "gpa_ptsz") ? 1 : !strcmp(api, "dl") ? 2 : -1;
  if (slot < 0) return -1;
  if (resolved[slot] == NULL) {
    void *f = NULL;
    int status = -1;
    if (slot == 2) {
      f = dlsym(dlopen("libcuda.so.1", RTLD_NOW), "cuLaunchKernel");
    } else {
      gpa_v2_fn gpa = gpa_from_dlsym();
      if (gpa) gpa("cuLaunchKernel", &f, 13000, slot == 1 ? 2 : 0, &status);
    }
    resolved[slot] = (launch_fn)f;
  }
  *lib = lib_of((void *)resolved[slot]);
  if (resolved[slot] == NULL) return -1;
  return resolved[slot](NULL, us, 1, 1, 1, 1, 1, 0, slot == 1 ? NULL : USER_STREAM, NULL, NULL);
}

/* NVML device `index` through dlopen + dlsym: one "nvml_dl" or "nvml2_dl" line. */
static void nvml_via_dlsym(int v2, unsigned int index) {
  void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  const char *name = v2 ? "nvml2_dl" : "nvml_dl";
  if (lib == NULL) {
    printf("%s -1 lib=none\n", name);
    return;
  }
  nvml_init_fn init = (nvml_init_fn)dlsym(lib, "nvmlInit_v2");
  nvml_handle_fn handle = (nvml_handle_fn)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
  void *f = dlsym(lib, v2 ? "nvmlDeviceGetMemoryInfo_v2" : "nvmlDeviceGetMemoryInfo");
  void *device = NULL;
  nvmlReturn_t rc = init && handle && f ? init() : -1;
  if (rc == 0) rc = handle(index, &device);
  if (v2) {
    nvmlMemory_v2_t m = {NVML_MEMORY_V2, 0, 0, 0, 0};
    if (rc == 0) rc = ((nvml_mem2_fn)f)(device, &m);
    printf("%s %d %llu %llu %llu %llu lib=%s\n", name, rc, m.total, m.reserved, m.free, m.used,
           lib_of(f));
  } else {
    nvmlMemory_t m = {0, 0, 0};
    if (rc == 0) rc = ((nvml_mem_fn)f)(device, &m);
    printf("%s %d %llu %llu %llu lib=%s\n", name, rc, m.total, m.free, m.used, lib_of(f));
  }
}

/* One "procs" or "procs_dl" line: the process list `kind` of NVML device `index` (or a null
 * device), with room for `room` entries (or a NULL buffer). */
static void process_list(const char *command, const char *kind, const char *index,
                         const char *room_arg, int via_dlsym) {
  void *f = NULL;
  int v2 = 0;
  nvml_init_fn init = NULL;
  nvml_handle_fn handle = NULL;
  if (via_dlsym) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (lib == NULL) {
      printf("%s -1 0 lib=none\n", command);
      return;
    }
    init = (nvml_init_fn)dlsym(lib, "nvmlInit_v2");
    handle = (nvml_handle_fn)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
  }
#ifdef PROBE_NVML_LINKED
  if (!via_dlsym) {
    init = nvmlInit_v2;
    handle = nvmlDeviceGetHandleByIndex_v2;
  }
#endif
  for (size_t q = 0; q < sizeof process_queries / sizeof process_queries[0]; q++) {
    if (strcmp(process_queries[q].kind, kind) != 0) continue;
    v2 = process_queries[q].v2;
    f = via_dlsym ? dlsym(dlopen("libnvidia-ml.so.1", RTLD_NOW), process_queries[q].symbol)
                  : process_queries[q].linked;
  }
  size_t entry = v2 ? sizeof(nvmlProcessInfo_v2_t) : sizeof(nvmlProcessInfo_v1_t);
  int null_infos = !strcmp(room_arg, "null");
  unsigned int room = null_infos ? 0 : (unsigned int)strtoul(room_arg, NULL, 10);
  unsigned char *infos = malloc((room + 1) * entry);
  memset(infos, 0xab, (room + 1) * entry);
  unsigned int count = room;
  void *device = NULL;
  nvmlReturn_t rc = init && handle && f ? init() : -1;
  if (rc == 0 && strcmp(index, "null") != 0) rc = handle((unsigned int)atoi(index), &device);
  if (rc == 0) rc = ((nvml_processes_fn)f)(device, &count, null_infos ? NULL : infos);
  printf("%s %d %u", command, rc, count);
  for (unsigned int k = 0; rc == 0 && k < count && k < room; k++) {
    if (v2) {
      nvmlProcessInfo_v2_t *e = (nvmlProcessInfo_v2_t *)infos + k;
      printf(" %u:%llu:%u:%u", e->pid, e->usedGpuMemory, e->gpuInstanceId, e->computeInstanceId);
    } else {
      nvmlProcessInfo_v1_t *e = (nvmlProcessInfo_v1_t *)infos + k;
      printf(" %u:%llu", e->pid, e->usedGpuMemory);
    }
  }
  size_t written = rc == 0 && count <= room ? count * entry : 0;
  for (size_t b = written; b < (room + 1) * entry; b++) {
    if (infos[b] != 0xab) {
      printf(" overwritten");
      break;
    }
  }
  if (via_dlsym) printf(" lib=%s", lib_of(f));
  printf("\n");
  free(infos);
}

int main(int argc, char **argv) {
  void *ctx;
  CUdeviceptr p;
  CUresult rc;
  if (getenv("PROBE_NO_CUDA") == NULL) {
    cuInit(0);
    cuDevicePrimaryCtxRetain(&ctx, 0);
    cuCtxSetCurrent(ctx);
  }
  for (int i = 1; i < argc; i++) {
    const char *c = argv[i];
    const char *a = i + 1 < argc ? argv[i + 1] : "0";
    if (!strcmp(c, "ctx")) {
      cuDevicePrimaryCtxRetain(&ctx, atoi(a));
      printf("ctx %d\n", cuCtxSetCurrent(ctx));
      i++;
    } else if (!strcmp(c, "alloc")) {
      last_size = size_arg(a);
      rc = cuMemAlloc_v2(&p, size_arg(a));
      keep(rc, p);
      printf("alloc %d\n", rc);
      i++;
    } else if (!strcmp(c, "alloc_retry")) {
      /* As a caching allocator does: on out of memory, (free its cache and) try once more. */
      last_size = size_arg(a);
      rc = cuMemAlloc_v2(&p, size_arg(a));
      int tries = 1;
      if (rc == 2 /* CUDA_ERROR_OUT_OF_MEMORY */) {
        rc = cuMemAlloc_v2(&p, size_arg(a));
        tries = 2;
      }
      keep(rc, p);
      printf("alloc_retry %d tries=%d\n", rc, tries);
      i++;
    } else if (!strcmp(c, "free_later")) {
      later_ms = atol(a);
      later_pointer = n_pointers ? pointers[--n_pointers] : 0;
      later_started = pthread_create(&later_thread, NULL, free_later, NULL) == 0;
      printf("free_later %d\n", later_started ? 0 : -1);
      i++;
    } else if (!strcmp(c, "free")) {
      printf("free %d\n", n_pointers ? cuMemFree_v2(pointers[--n_pointers]) : -1);
    } else if (!strcmp(c, "dl_alloc")) {
      alloc_fn f = (alloc_fn)dlsym(dlopen("libcuda.so.1", RTLD_NOW), "cuMemAlloc_v2");
      rc = f ? f(&p, size_arg(a)) : -1;
      keep(rc, p);
      printf("dl_alloc %d lib=%s\n", rc, lib_of((void *)f));
      i++;
    } else if (!strcmp(c, "gpa_alloc") || !strcmp(c, "gpa_chain")) {
      gpa_v2_fn gpa = gpa_from_dlsym();
      void *f = NULL;
      int status = -1;
      if (!strcmp(c, "gpa_chain") && gpa) {
        void *next = NULL;
        gpa("cuGetProcAddress", &next, 13000, 0, &status);
        printf("gpa_self lib=%s\n", lib_of(next));
        gpa = (gpa_v2_fn)next;
      }
      rc = gpa ? gpa("cuMemAlloc", &f, 13000, 0, &status) : -1;
      if (rc == 0) rc = ((alloc_fn)f)(&p, size_arg(a));
      keep(rc, p);
      printf("%s %d lib=%s\n", c, rc, lib_of(f));
      i++;
    } else if (!strcmp(c, "gpa_ptsz")) {
      gpa_v2_fn gpa = gpa_from_dlsym();
      void *f = NULL;
      int status = -1;
      rc = gpa ? gpa("cuMemAllocAsync", &f, 13000, 2, &status) : -1;
      if (rc == 0) rc = ((alloc_async_fn)f)(&p, size_arg(a), NULL);
      keep(rc, p);
      printf("gpa_ptsz %d lib=%s\n", rc, lib_of(f));
      i++;
    } else if (!strcmp(c, "managed")) {
      rc = cuMemAllocManaged(&p, size_arg(a), 1);
      keep(rc, p);
      printf("managed %d\n", rc);
      i++;
    } else if (!strcmp(c, "async")) {
      rc = cuMemAllocAsync(&p, size_arg(a), NULL);
      keep(rc, p);
      printf("async %d\n", rc);
      i++;
    } else if (!strcmp(c, "pool")) {
      rc = cuMemAllocFromPoolAsync(&p, size_arg(a), NULL, NULL);
      keep(rc, p);
      printf("pool %d\n", rc);
      i++;
    } else if (!strcmp(c, "free_async")) {
      printf("free_async %d\n", n_pointers ? cuMemFreeAsync(pointers[--n_pointers], NULL) : -1);
    } else if (!strcmp(c, "pitch")) {
      size_t pitch = 0;
      rc = cuMemAllocPitch_v2(&p, &pitch, size_arg(a), size_arg(argv[i + 2]), 4);
      keep(rc, p);
      printf("pitch %d %zu\n", rc, pitch);
      i += 2;
    } else if (!strcmp(c, "create")) {
      CUmemAllocationProp prop;
      unsigned long long h = 0;
      int device = 0;
      memset(&prop, 0, sizeof prop);
      prop.type = 1;
      prop.location.type = 1;
      cuCtxGetDevice(&device);
      prop.location.id = device;
      rc = cuMemCreate(&h, size_arg(a), &prop, 0);
      if (rc == 0) {
        handle_sizes[n_handles] = size_arg(a);
        handles[n_handles++] = h;
      }
      printf("create %d\n", rc);
      i++;
    } else if (!strcmp(c, "release")) {
      printf("release %d\n", n_handles ? cuMemRelease(handles[--n_handles]) : -1);
    } else if (!strcmp(c, "array") || !strcmp(c, "array3d")) {
      void *h = NULL;
      if (!strcmp(c, "array")) {
        CUDA_ARRAY_DESCRIPTOR d = {size_arg(a), size_arg(argv[i + 2]), 0x20, 4};
        rc = cuArrayCreate_v2(&h, &d);
        i += 2;
      } else {
        CUDA_ARRAY3D_DESCRIPTOR d = {size_arg(a), size_arg(argv[i + 2]), size_arg(argv[i + 3]),
                                     0x20, 4, 0};
        rc = cuArray3DCreate_v2(&h, &d);
        i += 3;
      }
      if (rc == 0) arrays[n_arrays++] = h;
      printf("%s %d\n", c, rc);
    } else if (!strcmp(c, "destroy")) {
      printf("destroy %d\n", n_arrays ? cuArrayDestroy(arrays[--n_arrays]) : -1);
    } else if (!strcmp(c, "fill") || !strcmp(c, "check")) {
      int same = 0;
      rc = pattern(atoi(a), !strcmp(c, "fill"), &same);
      if (!strcmp(c, "fill"))
        printf("fill %d\n", rc);
      else
        printf("check %d %s\n", rc, same ? "ok" : "bad");
      i++;
    } else if (!strcmp(c, "kcheck") || !strcmp(c, "acheck")) {
      int same = 0;
      rc = read_back(atoi(a), !strcmp(c, "kcheck"), &same);
      printf("%s %d %s\n", c, rc, same ? "ok" : "bad");
      i++;
    } else if (!strcmp(c, "host_allocs")) {
      printf("host_allocs 0 %llu %llu\n", fakeHostAllocs(), fakeHostFrees());
    } else if (!strcmp(c, "busy_unmaps")) {
      printf("busy_unmaps %llu\n", fakeBusyUnmaps());
    } else if (!strcmp(c, "cold")) {
      typedef int (*cold_fn)(unsigned long long, unsigned long long, int, unsigned long long *);
      cold_fn f = (cold_fn)dlsym(RTLD_DEFAULT, "vgpu_memory_cold");
      unsigned long long marked = 0;
      int crc = -100;
      if (f && n_pointers) crc = f(pointers[n_pointers - 1], sizes[n_pointers - 1], atoi(a), &marked);
      printf("cold %d %llu\n", crc, marked);
      i++;
    } else if (!strcmp(c, "progress")) {
      typedef int (*progress_fn)(unsigned long long);
      progress_fn f = (progress_fn)dlsym(RTLD_DEFAULT, "vgpu_progress");
      printf("progress %d\n", f ? f(strtoull(a, NULL, 10)) : -100);
      i++;
    } else if (!strcmp(c, "addr")) {
      printf("addr %#llx\n", n_pointers ? pointers[n_pointers - 1] : 0ULL);
    } else if (!strcmp(c, "touch")) {
      FILE *f = fopen(a, "w");
      if (f) fclose(f);
      printf("touch %d\n", f ? 0 : -1);
      i++;
    } else if (!strcmp(c, "launches") || !strcmp(c, "launches_of")) {
      /* launches N: kernels of 0 us; launches_of N US: kernels of US us, then a device
       * synchronisation, so that the time per launch is the GPU's unless launching is slower. */
      unsigned long n = strtoul(a, NULL, 10);
      unsigned int us = 0;
      if (!strcmp(c, "launches_of")) us = (unsigned int)atoi(argv[++i + 1]);
      rc = 0;
      unsigned long long began = now_ns();
      for (unsigned long k = 0; k < n && rc == 0; k++)
        rc = cuLaunchKernel(NULL, us, 1, 1, 1, 1, 1, 0, USER_STREAM, NULL, NULL);
      if (us > 0 && rc == 0) rc = cuCtxSynchronize();
      unsigned long long took = now_ns() - began;
      printf("%s %d ns=%llu\n", c, rc, n ? took / n : 0);
      i++;
    } else if (!strcmp(c, "until_host_allocs")) {
      printf("until_host_allocs %d\n", until_host_allocs(strtoull(a, NULL, 10)));
      i++;
    } else if (!strcmp(c, "until_file") || !strcmp(c, "spin_info")) {
      printf("%s %d\n", c, until_file(a, !strcmp(c, "spin_info")));
      i++;
    } else if (!strcmp(c, "ipc")) {
      CUipcMemHandle h;
      printf("ipc %d\n", n_pointers ? cuIpcGetMemHandle(&h, pointers[n_pointers - 1]) : -1);
    } else if (!strcmp(c, "info")) {
      size_t f = 0, t = 0;
      rc = cuMemGetInfo_v2(&f, &t);
      printf("info %d %zu %zu\n", rc, f, t);
    } else if (!strcmp(c, "total")) {
      size_t t = 0;
      rc = cuDeviceTotalMem_v2(&t, atoi(a));
      printf("total %d %zu\n", rc, t);
      i++;
    } else if (!strcmp(c, "parent")) {
      printf("parent %d\n", (int)getppid());
    } else if (!strcmp(c, "clock")) {
      printf("clock %llu\n", now_ns());
    } else if (!strcmp(c, "launch")) {
      const char *lib = "";
      rc = launch_via(a, (unsigned int)atoi(argv[i + 2]), &lib);
      printf("launch %d lib=%s\n", rc, lib);
      i += 2;
    } else if (!strcmp(c, "spin")) {
      const char *until_env = getenv("PROBE_UNTIL_NS");
      unsigned long long until = until_env ? strtoull(until_env, NULL, 10) : now_ns() + 1000000000ULL;
      unsigned int us = (unsigned int)atoi(argv[i + 2]);
      unsigned long long max_wait = 0;
      const char *lib = "";
      rc = 0;
      int said = 0;
      while (rc == 0 && now_ns() < until) {
        unsigned long long before = now_ns();
        rc = launch_via(a, us, &lib);
        unsigned long long waited = now_ns() - before;
        if (waited > max_wait) max_wait = waited;
        if (!said) {
          printf("spinning\n");
          fflush(stdout);
          said = 1;
        }
      }
      cuCtxSynchronize();
      printf("spin %d used=%llu launches=%llu max_wait_us=%llu\n", rc, fakeGpuUsedNs(),
             fakeLaunches(), max_wait / 1000);
      i += 2;
    } else if (!strcmp(c, "copy")) {
      rc = cuMemcpyDtoDAsync_v2(0, 0, (size_t)atoi(a) * 1000, USER_STREAM);
      printf("copy %d\n", rc);
      i++;
    } else if (!strcmp(c, "stream_sync")) {
      rc = cuStreamSynchronize(USER_STREAM);
      printf("stream_sync %d\n", rc);
    } else if (!strcmp(c, "stream_poll")) {
      while ((rc = cuStreamQuery(USER_STREAM)) == 600) {
        struct timespec t = {0, 100000L};
        nanosleep(&t, NULL);
      }
      printf("stream_poll %d\n", rc);
    } else if (!strcmp(c, "step")) {
      const char *lib = "";
      unsigned long long longest = 0;
      rc = 0;
      for (int k = 0; rc == 0 && k < atoi(argv[i + 3]); k++) {
        unsigned long long before = now_ns();
        rc = launch_via(a, (unsigned int)atoi(argv[i + 2]), &lib);
        if (rc == 0) rc = cuStreamSynchronize(USER_STREAM);
        unsigned long long took = now_ns() - before;
        if (took > longest) longest = took;
      }
      printf("step %d max_us=%llu\n", rc, longest / 1000);
      i += 3;
    } else if (!strcmp(c, "vmm")) {
      printf("vmm 0 reserved=%llu mapped=%llu\n", fakeVmmReservedBytes(), fakeVmmMappedBytes());
    } else if (!strcmp(c, "trace")) {
      printf("trace %s\n", fakeTrace());
    } else if (!strcmp(c, "sleep_ms")) {
      struct timespec t = {atoi(a) / 1000, (long)(atoi(a) % 1000) * 1000000L};
      nanosleep(&t, NULL);
      i++;
    } else if (!strcmp(c, "capture")) {
      const char *lib = "";
      void *graph = NULL;
      rc = cuStreamBeginCapture_v2(USER_STREAM, !strcmp(a, "global") ? 0 : 2);
      for (int k = 0; rc == 0 && k < atoi(argv[i + 3]); k++) rc = launch_via(argv[i + 2], 10, &lib);
      CUresult end = cuStreamEndCapture(USER_STREAM, &graph);
      if (rc == 0) rc = end;
      printf("capture %d graph=%llu\n", rc, (unsigned long long)(uintptr_t)graph);
      i += 3;
    } else if (!strcmp(c, "retain")) {
      rc = cuDevicePrimaryCtxRetain(&ctx, atoi(a));
      if (rc == 0) cuCtxSetCurrent(ctx);
      printf("retain %d\n", rc);
      i++;
    } else if (!strcmp(c, "nvml_dl") || !strcmp(c, "nvml2_dl")) {
      nvml_via_dlsym(!strcmp(c, "nvml2_dl"), (unsigned int)atoi(a));
      i++;
    } else if (!strcmp(c, "pid")) {
      printf("pid %d\n", (int)getpid());
    } else if (!strcmp(c, "procs_dl") || !strcmp(c, "procs")) {
      process_list(c, a, argv[i + 2], argv[i + 3], !strcmp(c, "procs_dl"));
      i += 3;
    } else if (!strcmp(c, "nvml_default")) {
      void *f = dlsym(RTLD_DEFAULT, "nvmlDeviceGetMemoryInfo");
      nvmlMemory_t m = {0, 0, 0};
      printf("nvml_default %d lib=%s\n", f ? ((nvml_mem_fn)f)(NULL, &m) : -1, lib_of(f));
#ifdef PROBE_NVML_LINKED
    } else if (!strcmp(c, "nvml") || !strcmp(c, "nvml2") || !strcmp(c, "nvml2_version")) {
      void *device = NULL;
      nvmlReturn_t r = nvmlInit_v2();
      if (r == 0) r = nvmlDeviceGetHandleByIndex_v2((unsigned int)atoi(a), &device);
      if (!strcmp(c, "nvml")) {
        nvmlMemory_t m = {0, 0, 0};
        if (r == 0) r = nvmlDeviceGetMemoryInfo(device, &m);
        printf("nvml %d %llu %llu %llu\n", r, m.total, m.free, m.used);
      } else {
        nvmlMemory_v2_t m = {NVML_MEMORY_V2, 0, 0, 0, 0};
        if (!strcmp(c, "nvml2_version")) {
          m.version = (unsigned int)strtoul(argv[i + 2], NULL, 0);
          i++;
        }
        if (r == 0) r = nvmlDeviceGetMemoryInfo_v2(device, &m);
        if (!strcmp(c, "nvml2"))
          printf("nvml2 %d %llu %llu %llu %llu\n", r, m.total, m.reserved, m.free, m.used);
        else
          printf("nvml2_version %d %llu\n", r, m.total);
      }
      i++;
#endif
    } else if (!strcmp(c, "hinter")) {
      hint_register_fn reg = (hint_register_fn)dlsym(RTLD_DEFAULT, "vgpu_memory_hint_register");
      hint_free_mode = !strcmp(a, "free");
      hint_release_mode = !strcmp(a, "release");
      if (hint_free_mode && n_pointers > 0) {
        hint_pointer_size = sizes[n_pointers - 1];
        hint_pointer = pointers[--n_pointers];
      }
      if (hint_release_mode && n_handles > 0) {
        hint_pointer_size = handle_sizes[n_handles - 1];
        hint_handle = handles[--n_handles];
      }
      rc = reg ? (CUresult)reg() : (CUresult)-1;
      if (reg) hint_started = pthread_create(&hint_thread, NULL, hint_helper, NULL) == 0;
      printf("hinter %d\n", (int)rc);
      i++;
    } else if (!strcmp(c, "hint_join")) {
      hint_stop = 1;
      if (hint_started) pthread_join(hint_thread, NULL);
      hint_started = 0;
      printf("hint_join %llu %d\n", hint_seen, hint_free_rc);
    } else if (!strcmp(c, "sync")) {
      printf("sync %d\n", cuCtxSynchronize());
    } else if (!strcmp(c, "hold")) {
      printf("holding\n");
      fflush(stdout);
      for (;;) pause();
    } else {
      fprintf(stderr, "probe: unknown command %s\n", c);
      return 64;
    }
    fflush(stdout);
  }
  return 0;
}
