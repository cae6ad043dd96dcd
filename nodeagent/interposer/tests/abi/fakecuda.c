/* A fake CUDA driver (libcuda.so.1) for testing libvgpu_cuda.so without a GPU.
 *
 * It implements the handful of driver entry points the interposer wraps, with the real driver's
 * signatures, over FAKE_CUDA_DEVICES (default 2) devices of FAKE_CUDA_TOTAL_GIB (default 80) GiB
 * each. No memory is allocated: pointers are made up and only sizes are tracked, per process.
 * Built with -Wl,-Bsymbolic so that its own references (cuGetProcAddress answers) point at its
 * functions even while the interposer, preloaded, exports the same names.
 *
 * FAKE_CUDA_DRIVER_VERSION=<n> is what cuDriverGetVersion says (default 13000).
 *
 * Built with -DFAKE_UNHELD_COPY it also exports a copy entry point that the interposer does not
 * hold (cuMemcpyWithAttributesAsync, signature made up): a driver on which the swap stays off.
 *
 * FAKE_CUDA_EVENTS_NEVER=1: cuEventQuery always says CUDA_ERROR_NOT_READY, as for a kernel that
 * waits for another process (a collective whose peer has not launched yet).
 *
 * FAKE_CUDA_GPA_THUNKS=1 makes cuGetProcAddress answer "cuMemAlloc" with a thunk instead of the
 * exported cuMemAlloc_v2, to exercise the interposer's by-name fallback.
 *
 * FAKE_CUDA_UUID=GPU-<32 hex digits, dashes anywhere>: device 0's uuid (default: bytes a0..ae,
 * then the ordinal), to play the GPU of an agent that simulates its inventory.
 *
 * Without it, a synchronous copy to or from a mapped VMM range succeeds and moves nothing (the
 * swap then runs on simulated sizes: the dry runs).
 *
 * FAKE_CUDA_REAL_BYTES=1: cuMemCreate's physical memory is real host memory (keep sizes small),
 * so that VMM-mapped ranges hold bytes: cuMemcpyHtoD_v2 / cuMemcpyDtoH_v2 copy into and out of a
 * mapped range (CUDA_ERROR_ILLEGAL_ADDRESS, 700, on memory that is not mapped: what a kernel
 * touching an unmapped chunk would meet), and cuMemHostAlloc / cuMemFreeHost are malloc / free.
 * The interposer's swap is tested on it: contents must survive a trip to host memory and back.
 * With it, cuLaunchKernel whose params are {&address, &bytes} is a kernel that reads those bytes
 * at launch (700 if any is not mapped; fakeKernelSum() is their sum), cuMemcpyDtoHAsync_v2 copies
 * out of a mapped range (700 if not mapped), and cuMemUnmap while this process's kernels are
 * still running (an undrained queue) counts in fakeBusyUnmaps(): what the swap must never do.
 * Streams made by cuStreamCreate run their queued copies only when queried, synchronised or
 * destroyed (FAKE_CUDA_ASYNC_FAIL=N fails the first N; FAKE_CUDA_SWAP_HANG=1 never completes
 * them until the stream is destroyed; see cuStreamCreate below), and
 * fakeHostAllocs() / fakeHostFrees() count cuMemHostAlloc / cuMemFreeHost (and
 * cuMemHostRegister_v2 / cuMemHostUnregister: pins either way).
 *
 * FAKE_CUDA_SLOW_PIN=<n>:<file>: the process's n-th cuMemHostRegister_v2 is a slow pin that the
 * test ends: it waits until <file> exists (at most 60 s) before it registers. Until that pin has
 * begun, a query of a created stream (or of an event on it) with copies queued says
 * CUDA_ERROR_NOT_READY: the copies queued before the slow pin are still in flight when it begins,
 * and complete (at the next query) only while it runs.
 *
 * Kernels are simulated: a launch "runs" for a duration taken from its arguments (gridDimX
 * microseconds for kernel launches, the graph handle's value for graph launches) on a GPU that
 * runs one kernel at a time in launch order; a launch blocks while more than FAKE_CUDA_QUEUE_MS
 * (default 100) of work is queued ahead of it. With FAKE_CUDA_GPU=<file> that GPU's timeline (the
 * time it is busy until) lives in a shared file, so several processes share one simulated GPU.
 * Events complete when the last kernel of their stream (at record time) ends. The GPU time a
 * process's kernels spend inside FAKE_CUDA_WINDOW=<start_ns>,<end_ns> (CLOCK_MONOTONIC) is
 * reported by fakeGpuUsedNs().
 *
 * Green contexts (CUDA 12.4+), unless built with -DFAKE_NO_GREEN: a device of FAKE_CUDA_SMS
 * (default 132) SMs, minimum partition and alignment 8; FAKE_CUDA_GREEN_FAIL=1 makes
 * cuGreenCtxCreate fail, FAKE_CUDA_GREEN_LAUNCH_FAIL=1 makes launches on green streams fail.
 * Green streams are handles 0x9000, 0x9001, ... fakeTrace() returns what ran where, in order:
 * "K:<stream>" per kernel or graph launch, "R:<event>:<stream>" per event record,
 * "W:<stream>:<event>" per stream wait, "C:<sms>" per green context (events numbered from 1),
 * "G:<stream>" per launch captured into a graph.
 *
 * Stream capture, minimal: cuStreamBeginCapture[_v2][_ptsz] / cuStreamEndCapture[_ptsz] /
 * cuStreamIsCapturing. A launch into a capturing stream is recorded, not run; the graph that
 * cuStreamEndCapture returns is the sum of the captured kernels' microseconds (so cuGraphLaunch
 * of it runs that long). As in the real driver, cuEventRecord or cuEventQuery touching a
 * capturing stream, or cuEventQuery while a global-mode capture is in progress, fails and
 * invalidates the capture; cuStreamEndCapture then fails with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUstream;
typedef void *CUcontext;
typedef void *CUarray;
typedef void *CUmemoryPool;

typedef struct {
  int type;
  int id;
} CUmemLocation;
typedef struct {
  int type;
  int requestedHandleTypes;
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

#define OK 0
#define INVALID_VALUE 1
#define OUT_OF_MEMORY 2
#define INVALID_DEVICE 101
#define INVALID_CONTEXT 201
#define NOT_FOUND 500
#define NOT_READY 600
#define MAX_DEVICES 16
#define MAX_RECORDS 65536

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int current = -1;
static unsigned long long used[MAX_DEVICES];
static unsigned long long next_address = 0x100000000ULL;
static struct {
  unsigned long long key;
  int device;
  unsigned long long bytes;
  unsigned char *data; /* cuMemCreate's bytes under FAKE_CUDA_REAL_BYTES=1 */
} records[MAX_RECORDS];

static int real_bytes(void) {
  const char *v = getenv("FAKE_CUDA_REAL_BYTES");
  return v && !strcmp(v, "1");
}

static int devices(void) {
  const char *v = getenv("FAKE_CUDA_DEVICES");
  int n = v ? atoi(v) : 2;
  return n < 1 ? 1 : (n > MAX_DEVICES ? MAX_DEVICES : n);
}

static unsigned long long total_bytes(void) {
  const char *v = getenv("FAKE_CUDA_TOTAL_GIB");
  return (unsigned long long)(v ? atoi(v) : 80) << 30;
}

/* Records an allocation of `bytes` on `device`; returns its made-up address/handle, 0 if OOM. */
static unsigned long long take(int device, unsigned long long bytes) {
  unsigned long long key = 0;
  pthread_mutex_lock(&lock);
  if (used[device] + bytes <= total_bytes()) {
    for (int i = 0; i < MAX_RECORDS; i++) {
      if (records[i].key == 0) {
        key = next_address;
        next_address += (bytes + 0xfffff) & ~0xfffffULL;
        next_address += 0x100000;
        records[i].key = key;
        records[i].device = device;
        records[i].bytes = bytes;
        used[device] += bytes;
        break;
      }
    }
  }
  pthread_mutex_unlock(&lock);
  return key;
}

static CUresult give(unsigned long long key) {
  CUresult rc = INVALID_VALUE;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < MAX_RECORDS; i++) {
    if (key != 0 && records[i].key == key) {
      used[records[i].device] -= records[i].bytes;
      records[i].key = 0;
      free(records[i].data);
      records[i].data = NULL;
      rc = OK;
      break;
    }
  }
  pthread_mutex_unlock(&lock);
  return rc;
}

static CUresult alloc_on_current(unsigned long long *out, unsigned long long bytes) {
  if (out == NULL || bytes == 0) return INVALID_VALUE;
  if (current < 0) return INVALID_CONTEXT;
  unsigned long long key = take(current, bytes);
  if (key == 0) return OUT_OF_MEMORY;
  *out = key;
  return OK;
}

CUresult cuInit(unsigned int flags) { (void)flags; return OK; }
CUresult cuDriverGetVersion(int *version) {
  const char *v = getenv("FAKE_CUDA_DRIVER_VERSION");
  *version = v ? atoi(v) : 13000;
  return OK;
}
CUresult cuDeviceGetCount(int *count) { *count = devices(); return OK; }
CUresult cuDeviceGet(int *device, int ordinal) {
  if (ordinal < 0 || ordinal >= devices()) return INVALID_DEVICE;
  *device = ordinal;
  return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, int device) {
  if (device < 0 || device >= devices()) return INVALID_DEVICE;
  *ctx = (CUcontext)(uintptr_t)(device + 1);
  return OK;
}
CUresult cuCtxSetCurrent(CUcontext ctx) {
  current = (int)(uintptr_t)ctx - 1;
  return OK;
}
CUresult cuCtxGetDevice(int *device) {
  if (current < 0) return INVALID_CONTEXT;
  *device = current;
  return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) { return alloc_on_current(dptr, bytes); }
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
  (void)flags;
  return alloc_on_current(dptr, bytes);
}
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                            unsigned int element) {
  (void)element;
  if (pitch == NULL) return INVALID_VALUE;
  size_t p = (width + 511) / 512 * 512;
  CUresult rc = alloc_on_current(dptr, (unsigned long long)p * height);
  if (rc == OK) *pitch = p;
  return rc;
}
CUresult cuMemFree_v2(CUdeviceptr dptr) { return give(dptr); }
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream s) {
  (void)s;
  return alloc_on_current(dptr, bytes);
}
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream s) {
  return cuMemAllocAsync(dptr, bytes, s);
}
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s) {
  (void)pool;
  (void)s;
  return alloc_on_current(dptr, bytes);
}
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                      CUstream s) {
  return cuMemAllocFromPoolAsync(dptr, bytes, pool, s);
}
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) { (void)s; return give(dptr); }
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) { return cuMemFreeAsync(dptr, s); }

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags) {
  (void)flags;
  if (handle == NULL || prop == NULL || size == 0) return INVALID_VALUE;
  int device = prop->location.type == 1 ? prop->location.id : 0;
  if (device < 0 || device >= devices()) return INVALID_DEVICE;
  unsigned long long key = take(device, prop->location.type == 1 ? size : 0);
  if (key == 0) return OUT_OF_MEMORY;
  if (real_bytes()) {
    unsigned char *data = calloc(1, size);
    if (data == NULL) {
      give(key);
      return OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_RECORDS; i++)
      if (records[i].key == key) records[i].data = data;
    pthread_mutex_unlock(&lock);
  }
  *handle = key;
  return OK;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle handle) { return give(handle); }

/* Virtual memory management: address ranges come from their own region (0x7f... addresses), and
 * the fake counts what is reserved and mapped (fakeVmmReservedBytes, fakeVmmMappedBytes) so the
 * tests can see that an allocation went this way and was undone. Physical memory is cuMemCreate's
 * (counted as used, above). */
#define MAX_RANGES 4096
static struct { unsigned long long address, bytes, mapped, handle; } ranges[MAX_RANGES];
static unsigned long long next_range = 0x7f0000000000ULL, reserved_bytes, mapped_bytes;
#define VMM_GRANULARITY (2ULL << 20)

unsigned long long fakeVmmReservedBytes(void) { return reserved_bytes; }
unsigned long long fakeVmmMappedBytes(void) { return mapped_bytes; }

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       int option) {
  (void)option;
  if (granularity == NULL || prop == NULL) return INVALID_VALUE;
  *granularity = VMM_GRANULARITY;
  return OK;
}
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  (void)alignment; (void)addr; (void)flags;
  if (ptr == NULL || size == 0 || size % VMM_GRANULARITY) return INVALID_VALUE;
  CUresult rc = OUT_OF_MEMORY;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < MAX_RANGES; i++) {
    if (ranges[i].address == 0) {
      ranges[i].address = next_range;
      ranges[i].bytes = size;
      ranges[i].mapped = 0;
      next_range += size + VMM_GRANULARITY;
      reserved_bytes += size;
      *ptr = ranges[i].address;
      rc = OK;
      break;
    }
  }
  pthread_mutex_unlock(&lock);
  return rc;
}
static int range_at(CUdeviceptr address, size_t size) {
  for (int i = 0; i < MAX_RANGES; i++)
    if (ranges[i].address != 0 && ranges[i].address == address && ranges[i].bytes == size) return i;
  return -1;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  CUresult rc = INVALID_VALUE;
  pthread_mutex_lock(&lock);
  int i = range_at(ptr, size);
  if (i >= 0 && !ranges[i].mapped) {
    ranges[i].address = 0;
    reserved_bytes -= size;
    rc = OK;
  }
  pthread_mutex_unlock(&lock);
  return rc;
}
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  (void)flags;
  if (offset != 0 || handle == 0) return INVALID_VALUE;
  CUresult rc = INVALID_VALUE;
  pthread_mutex_lock(&lock);
  int i = range_at(ptr, size);
  if (i >= 0 && !ranges[i].mapped) {
    ranges[i].mapped = 1;
    ranges[i].handle = handle;
    mapped_bytes += size;
    rc = OK;
  }
  pthread_mutex_unlock(&lock);
  return rc;
}
static unsigned long long last_end, busy_unmaps;
static unsigned long long now_ns(void);
unsigned long long fakeBusyUnmaps(void) { return busy_unmaps; }
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  CUresult rc = INVALID_VALUE;
  pthread_mutex_lock(&lock);
  if (now_ns() < last_end) busy_unmaps++;
  int i = range_at(ptr, size);
  if (i >= 0 && ranges[i].mapped) {
    ranges[i].mapped = 0;
    ranges[i].handle = 0;
    mapped_bytes -= size;
    rc = OK;
  }
  pthread_mutex_unlock(&lock);
  return rc;
}
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count) {
  if (desc == NULL || count == 0) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  int i = range_at(ptr, size);
  CUresult rc = i >= 0 && ranges[i].mapped ? OK : INVALID_VALUE;
  pthread_mutex_unlock(&lock);
  return rc;
}

/* The bytes behind [address, address + n) of a mapped range, or NULL (the caller holds lock). */
static unsigned char *mapped_bytes_at(CUdeviceptr address, size_t n) {
  for (int i = 0; i < MAX_RANGES; i++) {
    if (ranges[i].address == 0 || !ranges[i].mapped || address < ranges[i].address ||
        address + n > ranges[i].address + ranges[i].bytes)
      continue;
    for (int r = 0; r < MAX_RECORDS; r++)
      if (records[r].key == ranges[i].handle && records[r].data != NULL)
        return records[r].data + (address - ranges[i].address);
    return NULL;
  }
  return NULL;
}
#define ILLEGAL_ADDRESS 700
/* Without FAKE_CUDA_REAL_BYTES a copy to or from a mapped VMM range moves nothing and succeeds
 * (so that the interposer's swap runs on simulated sizes, as in the dry runs), and 700 elsewhere. */
static int mapped_range(CUdeviceptr address, size_t n) {
  for (int i = 0; i < MAX_RANGES; i++)
    if (ranges[i].address != 0 && ranges[i].mapped && address >= ranges[i].address &&
        address + n <= ranges[i].address + ranges[i].bytes)
      return 1;
  return 0;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  if (src == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  unsigned char *to = mapped_bytes_at(dst, n);
  if (to != NULL) memcpy(to, src, n);
  int ok = to != NULL || (!real_bytes() && mapped_range(dst, n));
  pthread_mutex_unlock(&lock);
  return ok ? OK : ILLEGAL_ADDRESS;
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  if (dst == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  unsigned char *from = mapped_bytes_at(src, n);
  if (from != NULL) memcpy(dst, from, n);
  int ok = from != NULL || (!real_bytes() && mapped_range(src, n));
  pthread_mutex_unlock(&lock);
  return ok ? OK : ILLEGAL_ADDRESS;
}
static unsigned long long host_allocs, host_frees;
/* How many times cuMemHostAlloc / cuMemFreeHost were called (the swap's pinned staging). */
unsigned long long fakeHostAllocs(void) { return host_allocs; }
unsigned long long fakeHostFrees(void) { return host_frees; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags) {
  (void)flags;
  if (p == NULL || n == 0) return INVALID_VALUE;
  *p = malloc(n);
  if (*p != NULL) __atomic_add_fetch(&host_allocs, 1, __ATOMIC_SEQ_CST);
  return *p != NULL ? OK : OUT_OF_MEMORY;
}
CUresult cuMemFreeHost(void *p) {
  if (p != NULL) __atomic_add_fetch(&host_frees, 1, __ATOMIC_SEQ_CST);
  free(p);
  return OK;
}
/* cuMemHostRegister pins memory the caller mapped: counted with cuMemHostAlloc (a pin), its
 * unregistering with cuMemFreeHost. FAKE_CUDA_NO_REGISTER=1 refuses it (a driver that cannot).
 * The registered ranges are kept, as the driver keeps them: an asynchronous copy whose host range
 * starts in one and runs past its end is refused with CUDA_ERROR_INVALID_VALUE, as an H200's
 * driver refuses a copy across two registrations (tests/gpu/shared_staging.py). */
#define REGISTERED_MAX 4096
static struct { uintptr_t p; size_t n; } registered[REGISTERED_MAX];
static pthread_mutex_t registered_lock = PTHREAD_MUTEX_INITIALIZER;
/* FAKE_CUDA_SLOW_PIN (see the top): whether it is set, and whether its pin has begun. */
static int slow_pin_begun;
static int slow_pin_set(void) { return getenv("FAKE_CUDA_SLOW_PIN") != NULL; }
static void slow_pin(void) {
  static unsigned long long registers;
  const char *v = getenv("FAKE_CUDA_SLOW_PIN");
  if (v == NULL) return;
  char *rest = NULL;
  unsigned long long nth = strtoull(v, &rest, 10);
  if (__atomic_add_fetch(&registers, 1, __ATOMIC_SEQ_CST) != nth || rest == NULL || *rest != ':')
    return;
  __atomic_store_n(&slow_pin_begun, 1, __ATOMIC_SEQ_CST);
  struct timespec ms = {0, 1000000};
  for (int i = 0; i < 60000 && access(rest + 1, F_OK) != 0; i++) nanosleep(&ms, NULL);
}
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags) {
  (void)flags;
  if (p == NULL || n == 0) return INVALID_VALUE;
  const char *no = getenv("FAKE_CUDA_NO_REGISTER");
  if (no != NULL && no[0] == '1') return 801; /* CUDA_ERROR_NOT_SUPPORTED */
  slow_pin();
  pthread_mutex_lock(&registered_lock);
  for (int i = 0; i < REGISTERED_MAX; i++) {
    if (registered[i].n == 0) {
      registered[i].p = (uintptr_t)p;
      registered[i].n = n;
      break;
    }
  }
  pthread_mutex_unlock(&registered_lock);
  __atomic_add_fetch(&host_allocs, 1, __ATOMIC_SEQ_CST);
  return OK;
}
CUresult cuMemHostUnregister(void *p) {
  if (p == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&registered_lock);
  for (int i = 0; i < REGISTERED_MAX; i++) {
    if (registered[i].n != 0 && registered[i].p == (uintptr_t)p) {
      registered[i].n = 0;
      break;
    }
  }
  pthread_mutex_unlock(&registered_lock);
  __atomic_add_fetch(&host_frees, 1, __ATOMIC_SEQ_CST);
  return OK;
}
/* Whether host..host+n starts in a registered range and runs past its end. */
static int spans_registrations(const void *host, size_t n) {
  uintptr_t h = (uintptr_t)host;
  int spans = 0;
  pthread_mutex_lock(&registered_lock);
  for (int i = 0; i < REGISTERED_MAX; i++) {
    if (registered[i].n != 0 && h >= registered[i].p && h < registered[i].p + registered[i].n) {
      spans = h + n > registered[i].p + registered[i].n;
      break;
    }
  }
  pthread_mutex_unlock(&registered_lock);
  return spans;
}

/* Streams made by cuStreamCreate (handles 0xa000, 0xa001, ...): a copy between host and device
 * queued on one (cuMemcpyDtoHAsync_v2, cuMemcpyHtoDAsync_v2) does not happen when it is called
 * but when the stream is next queried, synchronised or destroyed, in order, as a copy engine
 * would run it later: a caller that unmaps a chunk before its copy out completed makes the copy
 * fail with 700, and one that reads a chunk back before its copy in completed sees old bytes.
 * Without FAKE_CUDA_REAL_BYTES a queued copy moves nothing and succeeds on a mapped range.
 * FAKE_CUDA_ASYNC_FAIL=N: the first N queued copies of the process fail with 700 when they run
 * (moving nothing), and the stream reports it, as a copy fault would. */
#define CREATED_STREAMS 64
#define QUEUED_COPIES 256
#define CREATED_BASE 0xa000
static struct {
  int used, error;
  int queued;
  struct { int to_host; void *host; CUdeviceptr device; size_t n; } copies[QUEUED_COPIES];
} created[CREATED_STREAMS];
static unsigned long long async_runs;
static int created_slot(CUstream s) {
  uintptr_t h = (uintptr_t)s;
  if (h < CREATED_BASE || h >= CREATED_BASE + CREATED_STREAMS) return -1;
  return created[h - CREATED_BASE].used ? (int)(h - CREATED_BASE) : -1;
}
CUresult cuStreamCreate(CUstream *stream, unsigned int flags) {
  (void)flags;
  if (stream == NULL) return INVALID_VALUE;
  if (current < 0) return INVALID_CONTEXT;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < CREATED_STREAMS; i++) {
    if (!created[i].used) {
      memset(&created[i], 0, sizeof created[i]);
      created[i].used = 1;
      *stream = (CUstream)(uintptr_t)(CREATED_BASE + i);
      pthread_mutex_unlock(&lock);
      return OK;
    }
  }
  pthread_mutex_unlock(&lock);
  return OUT_OF_MEMORY;
}
/* Runs the copies queued on created stream `i`; returns its error (sticky). Holds `lock`. */
static int run_queued(int i) {
  const char *fail = getenv("FAKE_CUDA_ASYNC_FAIL");
  unsigned long long failing = fail ? strtoull(fail, NULL, 10) : 0;
  for (int c = 0; c < created[i].queued; c++) {
    int to_host = created[i].copies[c].to_host;
    void *host = created[i].copies[c].host;
    CUdeviceptr device = created[i].copies[c].device;
    size_t n = created[i].copies[c].n;
    int ok;
    if (async_runs++ < failing) {
      ok = 0;
    } else if (real_bytes()) {
      unsigned char *bytes = mapped_bytes_at(device, n);
      if (bytes != NULL) {
        if (to_host) memcpy(host, bytes, n);
        else memcpy(bytes, host, n);
      }
      ok = bytes != NULL;
    } else {
      ok = mapped_range(device, n);
    }
    if (!ok && created[i].error == OK) created[i].error = ILLEGAL_ADDRESS;
  }
  created[i].queued = 0;
  return created[i].error;
}
static CUresult queue_copy(CUstream s, int to_host, void *host, CUdeviceptr device, size_t n) {
  if (spans_registrations(host, n)) return INVALID_VALUE;
  if (host == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  int i = created_slot(s);
  CUresult rc = INVALID_VALUE;
  if (i >= 0 && created[i].queued < QUEUED_COPIES) {
    int c = created[i].queued++;
    created[i].copies[c].to_host = to_host;
    created[i].copies[c].host = host;
    created[i].copies[c].device = device;
    created[i].copies[c].n = n;
    rc = OK;
  }
  pthread_mutex_unlock(&lock);
  return rc;
}
CUresult cuStreamDestroy_v2(CUstream s) {
  pthread_mutex_lock(&lock);
  int i = created_slot(s);
  if (i >= 0) {
    run_queued(i);
    created[i].used = 0;
  }
  pthread_mutex_unlock(&lock);
  return i >= 0 ? OK : INVALID_VALUE;
}

static unsigned long long element_bytes(int format) {
  switch (format) {
    case 0x01: case 0x08: return 1;
    case 0x02: case 0x09: case 0x10: return 2;
    default: return 4;
  }
}
CUresult cuArrayCreate_v2(CUarray *array, const CUDA_ARRAY_DESCRIPTOR *d) {
  if (array == NULL || d == NULL) return INVALID_VALUE;
  unsigned long long b = (unsigned long long)d->Width * (d->Height ? d->Height : 1) *
                         element_bytes(d->Format) * d->NumChannels;
  return alloc_on_current((unsigned long long *)array, b);
}
CUresult cuArray3DCreate_v2(CUarray *array, const CUDA_ARRAY3D_DESCRIPTOR *d) {
  if (array == NULL || d == NULL) return INVALID_VALUE;
  unsigned long long b = (unsigned long long)d->Width * (d->Height ? d->Height : 1) *
                         (d->Depth ? d->Depth : 1) * element_bytes(d->Format) * d->NumChannels;
  return alloc_on_current((unsigned long long *)array, b);
}
CUresult cuArrayDestroy(CUarray array) { return give((unsigned long long)(uintptr_t)array); }

/* Legacy IPC: any allocation of this process's; the handle's bytes carry the pointer. */
typedef struct {
  char reserved[64];
} CUipcMemHandle;
CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr) {
  if (handle == NULL || dptr == 0) return INVALID_VALUE;
  memset(handle, 0, sizeof *handle);
  memcpy(handle->reserved, &dptr, sizeof dptr);
  return OK;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
  if (free_bytes == NULL || total == NULL) return INVALID_VALUE;
  if (current < 0) return INVALID_CONTEXT;
  pthread_mutex_lock(&lock);
  *total = total_bytes();
  *free_bytes = total_bytes() - used[current];
  pthread_mutex_unlock(&lock);
  return OK;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, int device) {
  if (bytes == NULL) return INVALID_VALUE;
  if (device < 0 || device >= devices()) return INVALID_DEVICE;
  *bytes = total_bytes();
  return OK;
}

/* ---- simulated kernels, streams and events ---- */

typedef void *CUfunction;
typedef void *CUevent;
typedef void *CUgraphExec;
typedef struct {
  unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  CUstream hStream;
  void *attrs;
  unsigned int numAttrs;
} CUlaunchConfig;

#define MAX_STREAMS 1024
static unsigned long long local_busy_until;
static unsigned long long *busy_until;
static pthread_once_t gpu_once = PTHREAD_ONCE_INIT;
static struct {
  uintptr_t stream;
  unsigned long long end;
} streams[MAX_STREAMS];
static unsigned long long used_in_window, launches;
static unsigned long long window_start, window_end;

#define TRACE_BYTES 65536
static char trace[TRACE_BYTES];
static size_t trace_len;
static void trace_add(const char *fmt, unsigned long long a, unsigned long long b) {
  pthread_mutex_lock(&lock);
  if (trace_len + 64 < TRACE_BYTES) {
    int n = snprintf(trace + trace_len, 64, trace_len ? " " : "");
    trace_len += (size_t)n;
    n = snprintf(trace + trace_len, 64, fmt, a, b);
    trace_len += (size_t)n;
  }
  pthread_mutex_unlock(&lock);
}
const char *fakeTrace(void) { return trace; }

typedef struct {
  unsigned long long end, id;
  CUstream stream;
  int on_created;
} fake_event;

#define CAPTURES_MAX 16
#define CAPTURE_UNSUPPORTED 900
#define CAPTURE_INVALIDATED 901
static struct {
  CUstream stream;
  int active, invalidated, global;
  unsigned long long captured_us;
} captures[CAPTURES_MAX];

/* The capture of stream `s`, or -1; called with `lock` held. */
static int capture_of(CUstream s) {
  for (int i = 0; i < CAPTURES_MAX; i++)
    if (captures[i].active && captures[i].stream == s) return i;
  return -1;
}
static unsigned long long next_event_id;

static unsigned long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (unsigned long long)t.tv_sec * 1000000000ULL + (unsigned long long)t.tv_nsec;
}

static void open_gpu(void) {
  const char *path = getenv("FAKE_CUDA_GPU");
  const char *window = getenv("FAKE_CUDA_WINDOW");
  busy_until = &local_busy_until;
  if (window) sscanf(window, "%llu,%llu", &window_start, &window_end);
  if (path == NULL) return;
  int fd = open(path, O_RDWR | O_CREAT, 0600);
  if (fd < 0) return;
  if (ftruncate(fd, 4096) == 0) {
    void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) busy_until = (unsigned long long *)p;
  }
  close(fd);
}

/* The stream's slot (special handles 0/1/2 are streams like any other here). */
static int stream_slot(CUstream s) {
  for (int i = 0; i < MAX_STREAMS; i++) {
    if (streams[i].stream == (uintptr_t)s + 1) return i;
    if (streams[i].stream == 0) {
      streams[i].stream = (uintptr_t)s + 1;
      return i;
    }
  }
  return 0;
}

static int green_launch_fails(CUstream s) {
  const char *v = getenv("FAKE_CUDA_GREEN_LAUNCH_FAIL");
  return v && !strcmp(v, "1") && (uintptr_t)s >= 0x9000 && (uintptr_t)s < 0xa000;
}

static CUresult run_kernel(CUstream s, unsigned long long duration_us) {
  if (current < 0) return INVALID_CONTEXT;
  if (green_launch_fails(s)) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  int capture = capture_of(s);
  if (capture >= 0) captures[capture].captured_us += duration_us;
  pthread_mutex_unlock(&lock);
  if (capture >= 0) {
    trace_add("G:%llx%.0llu", (uintptr_t)s, 0);
    return OK;
  }
  trace_add("K:%llx%.0llu", (uintptr_t)s, 0);
  pthread_once(&gpu_once, open_gpu);
  unsigned long long d = duration_us * 1000ULL, now = now_ns(), start, end;
  unsigned long long seen = __atomic_load_n(busy_until, __ATOMIC_SEQ_CST);
  do {
    start = seen > now ? seen : now;
    end = start + d;
  } while (!__atomic_compare_exchange_n(busy_until, &seen, end, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST));
  /* Like the real driver's bounded command queue: a launch blocks while more than 100 ms of work
   * (FAKE_CUDA_QUEUE_MS) is queued ahead of it. */
  const char *queue_ms = getenv("FAKE_CUDA_QUEUE_MS");
  unsigned long long queue_ns = (queue_ms ? strtoull(queue_ms, NULL, 10) : 100ULL) * 1000000ULL;
  if (end > now + queue_ns) {
    unsigned long long ahead = end - now - queue_ns;
    struct timespec t = {(time_t)(ahead / 1000000000ULL), (long)(ahead % 1000000000ULL)};
    nanosleep(&t, NULL);
  }
  pthread_mutex_lock(&lock);
  streams[stream_slot(s)].end = end;
  if (end > last_end) last_end = end;
  launches++;
  unsigned long long a = start > window_start ? start : window_start;
  unsigned long long b = end < window_end ? end : window_end;
  if (b > a) used_in_window += b - a;
  pthread_mutex_unlock(&lock);
  return OK;
}

unsigned long long fakeGpuUsedNs(void) { return used_in_window; }
unsigned long long fakeLaunches(void) { return launches; }

static unsigned long long kernel_sum;
unsigned long long fakeKernelSum(void) { return kernel_sum; }
CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                        CUstream s, void **params, void **extra) {
  (void)f; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem; (void)extra;
  if (real_bytes() && params != NULL && params[0] != NULL && params[1] != NULL) {
    CUdeviceptr address = *(CUdeviceptr *)params[0];
    size_t n = *(size_t *)params[1];
    pthread_mutex_lock(&lock);
    unsigned char *bytes = mapped_bytes_at(address, n);
    unsigned long long sum = 0;
    for (size_t b = 0; bytes != NULL && b < n; b++) sum += bytes[b];
    if (bytes != NULL) kernel_sum = sum;
    pthread_mutex_unlock(&lock);
    if (bytes == NULL) return ILLEGAL_ADDRESS;
  }
  return run_kernel(s, gx);
}
/* In the _ptsz variants the null stream is the per-thread default stream, CU_STREAM_PER_THREAD. */
#define PER_THREAD(s) ((s) == NULL ? (CUstream)2 : (s))
CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                             unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                             CUstream s, void **params, void **extra) {
  return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, PER_THREAD(s), params, extra);
}
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {
  (void)f; (void)params; (void)extra;
  if (config == NULL) return INVALID_VALUE;
  return run_kernel(config->hStream, config->gridDimX);
}
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params,
                               void **extra) {
  if (config == NULL) return INVALID_VALUE;
  return run_kernel(PER_THREAD(config->hStream), config->gridDimX);
}
CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                   unsigned int bx, unsigned int by, unsigned int bz,
                                   unsigned int shmem, CUstream s, void **params) {
  return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, NULL);
}
CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                        unsigned int gz, unsigned int bx, unsigned int by,
                                        unsigned int bz, unsigned int shmem, CUstream s,
                                        void **params) {
  return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, PER_THREAD(s), params, NULL);
}
/* The parameter list is not read: one kernel of 1000 us on the legacy stream. */
CUresult cuLaunchCooperativeKernelMultiDevice(void *list, unsigned int n, unsigned int flags) {
  (void)list; (void)n; (void)flags;
  return run_kernel(NULL, 1000);
}
CUresult cuGraphLaunch(CUgraphExec exec, CUstream s) { return run_kernel(s, (uintptr_t)exec); }
/* A device-to-device copy runs like a kernel of bytes / 1000 microseconds on its stream. */
/* CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2) only: CU_MEMORYTYPE_DEVICE (2) for an address inside an
 * allocation or a reserved VMM range of the fake, else CUDA_ERROR_INVALID_VALUE (as the driver
 * answers for pageable host memory). */
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
  if (data == NULL || attribute != 2) return INVALID_VALUE;
  int device = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < MAX_RECORDS && !device; i++)
    if (records[i].key != 0 && ptr >= records[i].key && ptr < records[i].key + records[i].bytes)
      device = 1;
  for (int i = 0; i < MAX_RANGES && !device; i++)
    if (ranges[i].address != 0 && ptr >= ranges[i].address &&
        ptr < ranges[i].address + ranges[i].bytes)
      device = 1;
  pthread_mutex_unlock(&lock);
  if (!device) return INVALID_VALUE;
  *(unsigned int *)data = 2;
  return OK;
}
/* The unified copy: runs for bytes / 1000 us like the device-to-device one (nothing moves). */
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) {
  (void)dst; (void)src;
  return run_kernel(s, (unsigned int)(bytes / 1000));
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) {
  (void)dst; (void)src;
  return run_kernel(s, (unsigned int)(bytes / 1000));
}
/* A memset runs on the SMs like the device-to-device copy: (4 * count / 1000) us, nothing set. */
CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t count, CUstream s) {
  (void)dst; (void)value;
  return run_kernel(s, (unsigned int)(count * 4 / 1000));
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream s) {
  if (created_slot(s) >= 0) return queue_copy(s, 1, dst, src, bytes);
  if (!real_bytes()) return run_kernel(s, (unsigned int)(bytes / 1000));
  if (dst == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  unsigned char *from = mapped_bytes_at(src, bytes);
  if (from != NULL) memcpy(dst, from, bytes);
  pthread_mutex_unlock(&lock);
  return from != NULL ? OK : ILLEGAL_ADDRESS;
}
/* Only on created streams (the swap's): the tests' applications copy synchronously. */
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream s) {
  if (created_slot(s) < 0) return INVALID_VALUE;
  return queue_copy(s, 0, (void *)src, dst, bytes);
}
#ifdef FAKE_UNHELD_COPY
/* A copy entry point the interposer does not hold: with it, the swap must stay off. */
CUresult cuMemcpyWithAttributesAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, void *attr,
                                     CUstream s) {
  (void)dst; (void)src; (void)attr;
  return run_kernel(s, (unsigned int)(bytes / 1000));
}
#endif
CUresult cuGraphLaunch_ptsz(CUgraphExec exec, CUstream s) {
  return cuGraphLaunch(exec, PER_THREAD(s));
}

CUresult cuEventCreate(CUevent *event, unsigned int flags) {
  (void)flags;
  if (event == NULL) return INVALID_VALUE;
  fake_event *e = calloc(1, sizeof(fake_event));
  if (e == NULL) return OUT_OF_MEMORY;
  e->id = __atomic_add_fetch(&next_event_id, 1, __ATOMIC_SEQ_CST);
  *event = e;
  return OK;
}
static int created_done(CUstream s, int query);
CUresult cuEventRecord(CUevent event, CUstream s) {
  if (event == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  if (created_slot(s) >= 0) {
    /* On a swap's stream: the event completes when the copies queued before it have run, which
     * a query does (cuEventQuery below), as it does for the stream. */
    ((fake_event *)event)->on_created = 1;
    ((fake_event *)event)->stream = s;
    pthread_mutex_unlock(&lock);
    return OK;
  }
  ((fake_event *)event)->on_created = 0;
  int capture = capture_of(s);
  if (capture >= 0) {
    captures[capture].invalidated = 1;
    pthread_mutex_unlock(&lock);
    return CAPTURE_UNSUPPORTED;
  }
  ((fake_event *)event)->end = streams[stream_slot(s)].end;
  ((fake_event *)event)->stream = s;
  pthread_mutex_unlock(&lock);
  trace_add("R:%llu:%llx", ((fake_event *)event)->id, (uintptr_t)s);
  return OK;
}
CUresult cuEventQuery(CUevent event) {
  if (event == NULL) return INVALID_VALUE;
  int illegal = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < CAPTURES_MAX; i++) {
    if (captures[i].active &&
        (captures[i].global || captures[i].stream == ((fake_event *)event)->stream)) {
      captures[i].invalidated = 1;
      illegal = 1;
    }
  }
  pthread_mutex_unlock(&lock);
  if (illegal) return CAPTURE_UNSUPPORTED;
  if (((fake_event *)event)->on_created) {
    int rc = created_done(((fake_event *)event)->stream, 1);
    return rc >= 0 ? (CUresult)rc : 400; /* CUDA_ERROR_INVALID_HANDLE: its stream is gone */
  }
  static int never = -1;
  if (never < 0) never = getenv("FAKE_CUDA_EVENTS_NEVER") != NULL;
  if (never) return NOT_READY;
  return now_ns() >= ((fake_event *)event)->end ? OK : NOT_READY;
}
CUresult cuEventDestroy_v2(CUevent event) {
  free(event);
  return OK;
}
/* mode: CU_STREAM_CAPTURE_MODE_GLOBAL (0), _THREAD_LOCAL (1), _RELAXED (2). */
CUresult cuStreamBeginCapture_v2(CUstream s, int mode) {
  CUresult rc = OUT_OF_MEMORY;
  pthread_mutex_lock(&lock);
  if (capture_of(s) >= 0) {
    rc = INVALID_VALUE;
  } else {
    for (int i = 0; i < CAPTURES_MAX; i++) {
      if (!captures[i].active) {
        captures[i].stream = s;
        captures[i].active = 1;
        captures[i].invalidated = 0;
        captures[i].global = mode == 0;
        captures[i].captured_us = 0;
        rc = OK;
        break;
      }
    }
  }
  pthread_mutex_unlock(&lock);
  return rc;
}
CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, int mode) {
  return cuStreamBeginCapture_v2(PER_THREAD(s), mode);
}
CUresult cuStreamBeginCapture(CUstream s) { return cuStreamBeginCapture_v2(s, 0); }
CUresult cuStreamBeginCapture_ptsz(CUstream s) { return cuStreamBeginCapture_v2(PER_THREAD(s), 0); }
CUresult cuStreamEndCapture(CUstream s, void **graph) {
  if (graph == NULL) return INVALID_VALUE;
  CUresult rc;
  pthread_mutex_lock(&lock);
  int capture = capture_of(s);
  if (capture < 0) {
    rc = INVALID_VALUE;
  } else {
    captures[capture].active = 0;
    rc = captures[capture].invalidated ? CAPTURE_INVALIDATED : OK;
    unsigned long long us = captures[capture].captured_us;
    *graph = rc == OK ? (void *)(uintptr_t)(us ? us : 1) : NULL;
  }
  pthread_mutex_unlock(&lock);
  return rc;
}
CUresult cuStreamEndCapture_ptsz(CUstream s, void **graph) {
  return cuStreamEndCapture(PER_THREAD(s), graph);
}
/* status: CU_STREAM_CAPTURE_STATUS_NONE (0), _ACTIVE (1), _INVALIDATED (2). */
CUresult cuStreamIsCapturing(CUstream s, int *status) {
  if (status == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  int capture = capture_of(s);
  *status = capture < 0 ? 0 : captures[capture].invalidated ? 2 : 1;
  pthread_mutex_unlock(&lock);
  return OK;
}

/* Waits until `until` (CLOCK_MONOTONIC ns) has passed. */
static void sleep_until(unsigned long long until) {
  unsigned long long now = now_ns();
  if (until > now) {
    struct timespec t = {(time_t)((until - now) / 1000000000ULL), (long)((until - now) % 1000000000ULL)};
    nanosleep(&t, NULL);
  }
}
static unsigned long long stream_end(CUstream s) {
  pthread_mutex_lock(&lock);
  unsigned long long end = streams[stream_slot(s)].end;
  pthread_mutex_unlock(&lock);
  return end;
}
/* A created stream's queued copies run now; its error, if one failed (-1: not a created one).
 * `query`: a look (cuStreamQuery, cuEventQuery), not a synchronisation. */
static int created_done(CUstream s, int query) {
  pthread_mutex_lock(&lock);
  int i = created_slot(s);
  if (i >= 0 && query && created[i].queued > 0 && slow_pin_set() &&
      !__atomic_load_n(&slow_pin_begun, __ATOMIC_SEQ_CST)) {
    pthread_mutex_unlock(&lock);
    return NOT_READY;
  }
  /* FAKE_CUDA_SWAP_HANG=1: a query (of the stream or of an event on it) never sees the swap's
   * copies complete, as with a hung copy engine; they run when the stream is destroyed. */
  if (i >= 0 && getenv("FAKE_CUDA_SWAP_HANG") != NULL && created[i].queued > 0) {
    pthread_mutex_unlock(&lock);
    return NOT_READY;
  }
  int rc = i >= 0 ? run_queued(i) : -1;
  pthread_mutex_unlock(&lock);
  return rc;
}
CUresult cuStreamSynchronize(CUstream s) {
  int created_rc = created_done(s, 0);
  if (created_rc >= 0) return created_rc;
  sleep_until(stream_end(s));
  /* FAKE_CUDA_SYNC_RESULT: what every stream synchronisation returns (a lost context) */
  const char *result = getenv("FAKE_CUDA_SYNC_RESULT");
  return result ? (CUresult)atoi(result) : OK;
}
CUresult cuStreamSynchronize_ptsz(CUstream s) { return cuStreamSynchronize(PER_THREAD(s)); }
CUresult cuStreamQuery(CUstream s) {
  int created_rc = created_done(s, 1);
  if (created_rc >= 0) return created_rc;
  return now_ns() >= stream_end(s) ? OK : NOT_READY;
}
CUresult cuStreamQuery_ptsz(CUstream s) { return cuStreamQuery(PER_THREAD(s)); }
CUresult cuEventSynchronize(CUevent event) {
  if (event == NULL) return INVALID_VALUE;
  sleep_until(((fake_event *)event)->end);
  return OK;
}

CUresult cuCtxSynchronize(void) {
  unsigned long long until = last_end, now = now_ns();
  if (until > now) {
    struct timespec t = {(time_t)((until - now) / 1000000000ULL), (long)((until - now) % 1000000000ULL)};
    nanosleep(&t, NULL);
  }
  return OK;
}
CUresult cuCtxGetCurrent(CUcontext *ctx) {
  if (ctx == NULL) return INVALID_VALUE;
  *ctx = current < 0 ? NULL : (CUcontext)(uintptr_t)(current + 1);
  return OK;
}
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, int device) {
  if (uuid == NULL) return INVALID_VALUE;
  if (device < 0 || device >= devices()) return INVALID_DEVICE;
  for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xa0 + i);
  uuid[15] = (unsigned char)device;
  /* FAKE_CUDA_UUID=GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx: device 0's uuid (to play a GPU an
   * agent simulates). */
  const char *text = getenv("FAKE_CUDA_UUID");
  if (device == 0 && text != NULL && !strncmp(text, "GPU-", 4)) {
    int n = 0;
    for (const char *c = text + 4; *c && n < 32; c++) {
      int v = *c >= '0' && *c <= '9' ? *c - '0' : *c >= 'a' && *c <= 'f' ? *c - 'a' + 10 : -1;
      if (v < 0) continue;
      uuid[n / 2] = (unsigned char)(n % 2 ? (uuid[n / 2] & 0xf0) | v : v << 4);
      n++;
    }
  }
  return OK;
}
CUresult cuDeviceGetUuid(unsigned char *uuid, int device) { return cuDeviceGetUuid_v2(uuid, device); }

#ifndef FAKE_NO_GREEN
/* CUdevResource: type at 0, SM fields at 96 (smCount, minSmPartitionSize, smCoscheduledAlignment);
 * the driver's struct is 144 bytes in CUDA 12.4, and this fake writes no further. */
typedef struct {
  int type;
  unsigned char pad[92];
  unsigned int sm_count, min_partition, alignment, flags;
  unsigned char rest[32];
} fake_resource;
static unsigned int device_sms(void) {
  const char *v = getenv("FAKE_CUDA_SMS");
  return v ? (unsigned int)atoi(v) : 132;
}
CUresult cuDeviceGetDevResource(int device, fake_resource *resource, int type) {
  if (resource == NULL || type != 1) return INVALID_VALUE;
  if (device < 0 || device >= devices()) return INVALID_DEVICE;
  memset(resource, 0, sizeof *resource);
  resource->type = 1;
  resource->sm_count = device_sms();
  resource->min_partition = 8;
  resource->alignment = 8;
  return OK;
}
CUresult cuDevSmResourceSplitByCount(fake_resource *result, unsigned int *groups,
                                     const fake_resource *input, fake_resource *remaining,
                                     unsigned int flags, unsigned int min_count) {
  (void)flags;
  if (result == NULL || groups == NULL || *groups != 1 || input == NULL) return INVALID_VALUE;
  unsigned int sms = (min_count + 7) / 8 * 8;
  if (sms > input->sm_count) return 914; /* CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION */
  *result = *input;
  result->sm_count = sms;
  if (remaining) {
    *remaining = *input;
    remaining->sm_count = input->sm_count - sms;
  }
  return OK;
}
CUresult cuDevResourceGenerateDesc(void **desc, fake_resource *resources, unsigned int n) {
  if (desc == NULL || resources == NULL || n != 1) return INVALID_VALUE;
  *desc = (void *)(uintptr_t)resources->sm_count;
  return OK;
}
CUresult cuGreenCtxCreate(void **green, void *desc, int device, unsigned int flags) {
  const char *fail = getenv("FAKE_CUDA_GREEN_FAIL");
  if (fail && !strcmp(fail, "1")) return 801; /* CUDA_ERROR_NOT_SUPPORTED */
  if (green == NULL || flags != 1) return INVALID_VALUE;
  if (device < 0 || device >= devices()) return INVALID_DEVICE;
  *green = (void *)(0x7000 + (uintptr_t)desc);
  trace_add("C:%llu%.0llu", (uintptr_t)desc, 0);
  return OK;
}
static unsigned long long next_green_stream = 0x9000;
CUresult cuGreenCtxStreamCreate(CUstream *stream, void *green, unsigned int flags, int priority) {
  (void)priority;
  if (stream == NULL || green == NULL || flags != 1) return INVALID_VALUE;
  *stream = (CUstream)(uintptr_t)__atomic_fetch_add(&next_green_stream, 1, __ATOMIC_SEQ_CST);
  return OK;
}
#endif
CUresult cuStreamWaitEvent(CUstream s, CUevent event, unsigned int flags) {
  (void)flags;
  if (event == NULL) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  int slot = stream_slot(s);
  if (((fake_event *)event)->end > streams[slot].end) streams[slot].end = ((fake_event *)event)->end;
  pthread_mutex_unlock(&lock);
  trace_add("W:%llx:%llu", (uintptr_t)s, ((fake_event *)event)->id);
  return OK;
}

static CUresult thunk_cuMemAlloc(CUdeviceptr *dptr, size_t bytes) {
  return cuMemAlloc_v2(dptr, bytes);
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                             int *status);

static void *lookup(const char *s, int version, unsigned long long flags) {
  int ptsz = (flags & 2) != 0;
  if (!strcmp(s, "cuMemAlloc")) {
    const char *thunks = getenv("FAKE_CUDA_GPA_THUNKS");
    if (thunks && !strcmp(thunks, "1")) return (void *)thunk_cuMemAlloc;
    return (void *)cuMemAlloc_v2;
  }
  if (!strcmp(s, "cuMemAllocPitch")) return (void *)cuMemAllocPitch_v2;
  if (!strcmp(s, "cuMemAllocManaged")) return (void *)cuMemAllocManaged;
  if (!strcmp(s, "cuMemFree")) return (void *)cuMemFree_v2;
  if (!strcmp(s, "cuMemCreate")) return (void *)cuMemCreate;
  if (!strcmp(s, "cuMemRelease")) return (void *)cuMemRelease;
  if (!strcmp(s, "cuMemAllocAsync"))
    return ptsz ? (void *)cuMemAllocAsync_ptsz : (void *)cuMemAllocAsync;
  if (!strcmp(s, "cuMemAllocFromPoolAsync"))
    return ptsz ? (void *)cuMemAllocFromPoolAsync_ptsz : (void *)cuMemAllocFromPoolAsync;
  if (!strcmp(s, "cuMemFreeAsync"))
    return ptsz ? (void *)cuMemFreeAsync_ptsz : (void *)cuMemFreeAsync;
  if (!strcmp(s, "cuArrayCreate")) return (void *)cuArrayCreate_v2;
  if (!strcmp(s, "cuArray3DCreate")) return (void *)cuArray3DCreate_v2;
  if (!strcmp(s, "cuArrayDestroy")) return (void *)cuArrayDestroy;
  if (!strcmp(s, "cuMemGetInfo")) return (void *)cuMemGetInfo_v2;
  if (!strcmp(s, "cuDeviceTotalMem")) return (void *)cuDeviceTotalMem_v2;
  if (!strcmp(s, "cuCtxGetDevice")) return (void *)cuCtxGetDevice;
  if (!strcmp(s, "cuInit")) return (void *)cuInit;
  if (!strcmp(s, "cuLaunchKernel"))
    return ptsz ? (void *)cuLaunchKernel_ptsz : (void *)cuLaunchKernel;
  if (!strcmp(s, "cuLaunchKernelEx"))
    return ptsz ? (void *)cuLaunchKernelEx_ptsz : (void *)cuLaunchKernelEx;
  if (!strcmp(s, "cuStreamBeginCapture"))
    return ptsz ? (void *)cuStreamBeginCapture_v2_ptsz : (void *)cuStreamBeginCapture_v2;
  if (!strcmp(s, "cuStreamEndCapture"))
    return ptsz ? (void *)cuStreamEndCapture_ptsz : (void *)cuStreamEndCapture;
  if (!strcmp(s, "cuStreamIsCapturing")) return (void *)cuStreamIsCapturing;
  if (!strcmp(s, "cuGraphLaunch")) return ptsz ? (void *)cuGraphLaunch_ptsz : (void *)cuGraphLaunch;
  if (!strcmp(s, "cuGetProcAddress"))
    return version >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
  return NULL;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                             int *status) {
  if (symbol == NULL || pfn == NULL) return INVALID_VALUE;
  *pfn = lookup(symbol, version, flags);
  if (status) *status = *pfn ? 0 : 1; /* CU_GET_PROC_ADDRESS_SUCCESS / _SYMBOL_NOT_FOUND */
  return *pfn ? OK : NOT_FOUND;
}
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
