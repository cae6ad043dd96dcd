/*
 * A fake libcuda.so.1 for the NCCL plugin's same-host GPU path, on machines without a GPU.
 *
 * "Device memory" is host memory backed by a memfd, so it can travel to another process the way
 * cuMem allocations do (a file descriptor over SCM_RIGHTS) and be mapped there. Copies are
 * plain memcpy and complete at once; events and streams are tokens. Only the entry points the
 * plugin resolves (nccl-plugin/src/cuda.rs) are here, with the CUDA 12/13 prototypes reduced
 * to the argument types the plugin passes.
 *
 * Contexts: the calling thread's current context is the primary context (PRIMARY) until it
 * sets another; cuCtxCreate_v2 makes new ones (FAKE_CUDA_CTX_CREATE_FAIL=1: it refuses, out of
 * memory). Every cuMemcpyAsync is counted by whether it
 * ran in the primary context, so a test can check in which context the plugin copies.
 *
 * cuCtxGetDevice fails with FAKE_CUDA_NO_CONTEXT=1 (no current context); device 0 has a fixed
 * UUID.
 *
 * Host registration and stream memory operations: cuMemHostRegister_v2 records the range
 * (FAKE_CUDA_HOST_REGISTER_FAIL=1: it refuses) and hands out a device address that differs from
 * the host one, so a write through the host address is caught; cuStreamWriteValue64_v2 accepts
 * only device addresses inside a registered range, writes at once (FAKE_CUDA_DROP_VALUE_WRITES=1:
 * never), and is counted.
 *
 * Test-only entry points (not CUDA): fake_device_alloc(bytes) allocates "device memory" as
 * cuMem does, fake_device_alloc_legacy(bytes) as cudaMalloc does (no cuMem handle);
 * fake_cuda_stats(&primary, &other, &created) reads the counters; fake_cuda_writes() the number
 * of stream value writes.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef uint64_t CUdeviceptr;
typedef void *CUcontext;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_SUPPORTED 801

#define PRIMARY ((CUcontext)0x1000)
#define ALLOCATIONS 256
/* handles: an allocation of this process, or an imported descriptor */
#define HANDLE_ALLOCATION (1ull << 40)
#define HANDLE_IMPORTED (2ull << 40)

static struct {
  uint64_t base;
  size_t size;
  int fd;
  int legacy; /* a cudaMalloc allocation: no cuMem handle */
} allocations[ALLOCATIONS];
static atomic_int allocation_count;
static atomic_long copies_primary, copies_other, contexts_created;
static __thread CUcontext current;
static atomic_long value_writes;

/* registered host ranges; their device addresses are the host ones plus DEVMAP */
#define DEVMAP 0x100000000000ull
#define HOST_RANGES 256
static struct {
  _Atomic uint64_t base;
  _Atomic uint64_t size;
} host_ranges[HOST_RANGES];

static int find(uint64_t ptr) {
  int n = atomic_load(&allocation_count);
  for (int i = 0; i < n; i++)
    if (ptr >= allocations[i].base && ptr < allocations[i].base + allocations[i].size) return i;
  return -1;
}

void *fake_device_alloc(size_t bytes) {
  int i = atomic_fetch_add(&allocation_count, 1);
  if (i >= ALLOCATIONS) return NULL;
  int fd = memfd_create("fake-gpu", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) return NULL;
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return NULL;
  allocations[i].size = bytes;
  allocations[i].fd = fd;
  allocations[i].base = (uint64_t)(uintptr_t)p;
  return p;
}

/* "device memory" as cudaMalloc makes it (NCCL_CUMEM_ENABLE=0): no cuMem handle */
void *fake_device_alloc_legacy(size_t bytes) {
  void *p = fake_device_alloc(bytes);
  int i = p ? find((uint64_t)(uintptr_t)p) : -1;
  if (i >= 0) allocations[i].legacy = 1;
  return p;
}

void fake_cuda_stats(long *primary, long *other, long *created) {
  *primary = atomic_load(&copies_primary);
  *other = atomic_load(&copies_other);
  *created = atomic_load(&contexts_created);
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
  *ctx = current ? current : PRIMARY;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext ctx) {
  current = ctx;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(int *device) {
  const char *none = getenv("FAKE_CUDA_NO_CONTEXT");
  if (none && none[0] == '1') return 201; /* CUDA_ERROR_INVALID_CONTEXT */
  *device = 0;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid_v2(unsigned char uuid[16], int device) {
  if (device != 0) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xa0 + i);
  return CUDA_SUCCESS;
}
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, int device) {
  (void)flags;
  if (device != 0) return CUDA_ERROR_INVALID_VALUE;
  const char *fail = getenv("FAKE_CUDA_CTX_CREATE_FAIL");
  if (fail && fail[0] == '1') return CUDA_ERROR_OUT_OF_MEMORY;
  long n = atomic_fetch_add(&contexts_created, 1);
  *ctx = (CUcontext)(uintptr_t)(0x2000 + 0x10 * n);
  current = *ctx;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int *n) {
  *n = 1;
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxGetState(int device, unsigned *flags, int *active) {
  *flags = 0;
  *active = device == 0;
  return CUDA_SUCCESS;
}
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
  switch (attribute) {
  case 1: *(CUcontext *)data = PRIMARY; return CUDA_SUCCESS;
  case 2: *(unsigned *)data = find(ptr) >= 0 ? 2 : 1; return CUDA_SUCCESS;
  case 9: *(int *)data = 0; return CUDA_SUCCESS;
  default: return CUDA_ERROR_INVALID_VALUE;
  }
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
  int i = find(ptr);
  if (i < 0) return CUDA_ERROR_INVALID_VALUE;
  *base = allocations[i].base;
  *size = allocations[i].size;
  return CUDA_SUCCESS;
}
CUresult cuMemRetainAllocationHandle(uint64_t *handle, void *ptr) {
  int i = find((uint64_t)(uintptr_t)ptr);
  if (i < 0 || allocations[i].legacy) return CUDA_ERROR_INVALID_VALUE;
  *handle = HANDLE_ALLOCATION | (uint64_t)i;
  return CUDA_SUCCESS;
}
CUresult cuMemRelease(uint64_t handle) {
  if (handle & HANDLE_IMPORTED) close((int)(handle & 0xffffffff));
  return CUDA_SUCCESS;
}
CUresult cuMemExportToShareableHandle(void *out, uint64_t handle, int type, unsigned long long flags) {
  (void)flags;
  if (type != 1 || !(handle & HANDLE_ALLOCATION)) return CUDA_ERROR_INVALID_VALUE;
  int fd = dup(allocations[handle & 0xffffffff].fd);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *(int *)out = fd;
  return CUDA_SUCCESS;
}
CUresult cuMemImportFromShareableHandle(uint64_t *handle, void *shareable, int type) {
  if (type != 1) return CUDA_ERROR_INVALID_VALUE;
  int fd = dup((int)(intptr_t)shareable);
  if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
  *handle = HANDLE_IMPORTED | (uint64_t)fd;
  return CUDA_SUCCESS;
}
CUresult cuMemAddressReserve(CUdeviceptr *va, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
  (void)align, (void)addr, (void)flags;
  void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  *va = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}
CUresult cuMemAddressFree(CUdeviceptr va, size_t size) {
  return munmap((void *)(uintptr_t)va, size) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, uint64_t handle, unsigned long long flags) {
  (void)flags;
  if (!(handle & HANDLE_IMPORTED)) return CUDA_ERROR_NOT_SUPPORTED;
  void *p = mmap((void *)(uintptr_t)va, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                 (int)(handle & 0xffffffff), (off_t)offset);
  return p == MAP_FAILED ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
  void *p = mmap((void *)(uintptr_t)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  return p == MAP_FAILED ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const void *desc, size_t count) {
  (void)va, (void)size, (void)desc;
  return count == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
/* legacy IPC: this fake's allocations are all cuMem ones */
CUresult cuIpcGetMemHandle(void *handle, CUdeviceptr ptr) {
  (void)handle, (void)ptr;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *ptr, char handle[64], unsigned flags) {
  (void)ptr, (void)handle, (void)flags;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr ptr) {
  (void)ptr;
  return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuStreamCreate(void **stream, unsigned flags) {
  (void)flags;
  *stream = malloc(1);
  return CUDA_SUCCESS;
}
CUresult cuStreamDestroy_v2(void *stream) {
  free(stream);
  return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(void *stream) {
  (void)stream;
  return CUDA_SUCCESS;
}
CUresult cuEventCreate(void **event, unsigned flags) {
  (void)flags;
  *event = malloc(1);
  return CUDA_SUCCESS;
}
CUresult cuEventRecord(void *event, void *stream) {
  (void)event, (void)stream;
  return CUDA_SUCCESS;
}
CUresult cuEventQuery(void *event) {
  (void)event;
  return CUDA_SUCCESS;
}
CUresult cuEventDestroy_v2(void *event) {
  free(event);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
  (void)stream;
  if (current == NULL || current == PRIMARY)
    atomic_fetch_add(&copies_primary, 1);
  else
    atomic_fetch_add(&copies_other, 1);
  memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
  return CUDA_SUCCESS;
}
CUresult cuMemHostAlloc(void **p, size_t bytes, unsigned flags) {
  (void)flags;
  *p = malloc(bytes ? bytes : 1);
  return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuMemFreeHost(void *p) {
  free(p);
  return CUDA_SUCCESS;
}

CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned flags) {
  (void)flags;
  const char *fail = getenv("FAKE_CUDA_HOST_REGISTER_FAIL");
  if (fail && fail[0] == '1') return CUDA_ERROR_NOT_SUPPORTED;
  if (((uintptr_t)p & 4095) != 0 || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < HOST_RANGES; i++) {
    uint64_t expected = 0;
    if (atomic_compare_exchange_strong(&host_ranges[i].base, &expected, (uint64_t)(uintptr_t)p)) {
      atomic_store(&host_ranges[i].size, bytes);
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuMemHostUnregister(void *p) {
  for (int i = 0; i < HOST_RANGES; i++)
    if (atomic_load(&host_ranges[i].base) == (uint64_t)(uintptr_t)p) {
      atomic_store(&host_ranges[i].size, 0);
      atomic_store(&host_ranges[i].base, 0);
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_INVALID_VALUE;
}
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *dev, void *p, unsigned flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < HOST_RANGES; i++) {
    uint64_t base = atomic_load(&host_ranges[i].base);
    if (base && (uint64_t)(uintptr_t)p >= base &&
        (uint64_t)(uintptr_t)p < base + atomic_load(&host_ranges[i].size)) {
      *dev = (uint64_t)(uintptr_t)p + DEVMAP;
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_INVALID_VALUE;
}
CUresult cuStreamWriteValue64_v2(void *stream, CUdeviceptr addr, uint64_t value, unsigned flags) {
  (void)stream;
  if (flags != 0 || addr < DEVMAP || (addr & 7) != 0) return CUDA_ERROR_INVALID_VALUE;
  uint64_t host = addr - DEVMAP;
  for (int i = 0; i < HOST_RANGES; i++) {
    uint64_t base = atomic_load(&host_ranges[i].base);
    if (base && host >= base && host + 8 <= base + atomic_load(&host_ranges[i].size)) {
      /* the copies before it on the stream are done (they ran at once): publish, unless
       * FAKE_CUDA_DROP_VALUE_WRITES=1 (a write that never lands) */
      const char *drop = getenv("FAKE_CUDA_DROP_VALUE_WRITES");
      if (!(drop && drop[0] == '1'))
        atomic_store_explicit((_Atomic uint64_t *)(uintptr_t)host, value, memory_order_release);
      atomic_fetch_add(&value_writes, 1);
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_INVALID_VALUE;
}
CUresult cuStreamQuery(void *stream) {
  (void)stream;
  return CUDA_SUCCESS;
}
long fake_cuda_writes(void) { return atomic_load(&value_writes); }
