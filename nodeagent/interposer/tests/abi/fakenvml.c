/* A fake NVML (libnvidia-ml.so.1) for testing libvgpu_cuda.so's NVML hooks without a GPU.
 *
 * FAKE_NVML_DEVICES (default 3) devices of FAKE_NVML_TOTAL_GIB (default 80) GiB, each with
 * FAKE_NVML_USED_MIB (default 3072) MiB used, of which 512 MiB are "reserved" in the v2 struct.
 * NVML numbers devices in another order than the fake driver (fakecuda.c): NVML device i has the
 * uuid of CUDA device N-1-i (N = FAKE_NVML_DEVICES), so with 3 NVML devices and the fake
 * driver's 2, NVML device 0 is a GPU that CUDA does not show, 1 is CUDA device 1 and 2 is CUDA
 * device 0. The uuids are fakecuda.c's: bytes a0..ae, then the CUDA ordinal.
 *
 * Built with -Wl,-Bsymbolic, like the fake driver, so that it never calls the interposer's
 * exports of its own names.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct fake_device *nvmlDevice_t;

typedef struct {
  unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
  unsigned int version;
  unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_MEMORY_V2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
#define MAX_DEVICES 16
#define MIB (1ULL << 20)

struct fake_device {
  int index;
};

static struct fake_device fake_devices[MAX_DEVICES];
static int initialised;

static int device_count(void) {
  const char *v = getenv("FAKE_NVML_DEVICES");
  int n = v ? atoi(v) : 3;
  return n < 1 ? 1 : (n > MAX_DEVICES ? MAX_DEVICES : n);
}

static unsigned long long env_or(const char *name, unsigned long long fallback) {
  const char *v = getenv(name);
  return v ? strtoull(v, NULL, 10) : fallback;
}

static int valid(nvmlDevice_t device) {
  return device != NULL && device >= fake_devices && device < fake_devices + device_count();
}

nvmlReturn_t nvmlInit_v2(void) {
  initialised = 1;
  return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }
nvmlReturn_t nvmlShutdown(void) {
  initialised = 0;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  *count = (unsigned int)device_count();
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  if (device == NULL || index >= (unsigned int)device_count()) return NVML_ERROR_INVALID_ARGUMENT;
  fake_devices[index].index = (int)index;
  *device = &fake_devices[index];
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  if (!valid(device) || uuid == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  char text[96];
  int cuda_ordinal = device_count() - 1 - device->index;
  snprintf(text, sizeof text, "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadae%02x", cuda_ordinal);
  if (length < strlen(text) + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
  memcpy(uuid, text, strlen(text) + 1);
  return NVML_SUCCESS;
}

static void figures(unsigned long long *total, unsigned long long *used) {
  *total = env_or("FAKE_NVML_TOTAL_GIB", 80) << 30;
  *used = env_or("FAKE_NVML_USED_MIB", 3072) * MIB;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  if (!valid(device) || memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  figures(&memory->total, &memory->used);
  memory->free = memory->total - memory->used;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  if (!valid(device) || memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  if (memory->version != NVML_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  unsigned long long used;
  figures(&memory->total, &used);
  memory->reserved = 512 * MIB;
  memory->used = used - memory->reserved;
  memory->free = memory->total - used;
  return NVML_SUCCESS;
}
