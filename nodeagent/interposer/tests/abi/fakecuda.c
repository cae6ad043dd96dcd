/* A fake CUDA driver (libcuda.so.1) for testing libvgpu_cuda.so without a GPU.
 *
 * It implements the handful of driver entry points the interposer wraps, with the real driver's
 * signatures, over FAKE_CUDA_DEVICES (default 2) devices of FAKE_CUDA_TOTAL_GIB (default 80) GiB
 * each. No memory is allocated: pointers are made up and only sizes are tracked, per process.
 * Built with -Wl,-Bsymbolic so that its own references (cuGetProcAddress answers) point at its
 * functions even while the interposer, preloaded, exports the same names.
 *
 * FAKE_CUDA_GPA_THUNKS=1 makes cuGetProcAddress answer "cuMemAlloc" with a thunk instead of the
 * exported cuMemAlloc_v2, to exercise the interposer's by-name fallback.
 */
#include <pthread.h>
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
} records[MAX_RECORDS];

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
CUresult cuDriverGetVersion(int *version) { *version = 13000; return OK; }
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
  *handle = key;
  return OK;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle handle) { return give(handle); }

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
