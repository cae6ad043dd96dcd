/* A fake NVML (libnvidia-ml.so.1) for testing libvgpu_cuda.so's NVML hooks without a GPU.
 *
 * FAKE_NVML_DEVICES (default 3) devices of FAKE_NVML_TOTAL_GIB (default 80) GiB, each with
 * FAKE_NVML_USED_MIB (default 3072) MiB used, of which 512 MiB are "reserved" in the v2 struct.
 * NVML numbers devices in another order than the fake driver (fakecuda.c): NVML device i has the
 * uuid of CUDA device N-1-i (N = FAKE_NVML_DEVICES), so with 3 NVML devices and the fake
 * driver's 2, NVML device 0 is a GPU that CUDA does not show, 1 is CUDA device 1 and 2 is CUDA
 * device 0. The uuids are fakecuda.c's: bytes a0..ae, then the CUDA ordinal.
 *
 * Process lists (nvmlDevice{Compute,Graphics,MPSCompute}RunningProcesses, unversioned with
 * nvmlProcessInfo_v1_t, _v2 and _v3 with nvmlProcessInfo_v2_t, as nvml.h declares them) are the
 * same on every device: FAKE_NVML_PROCESSES, FAKE_NVML_GRAPHICS_PROCESSES and
 * FAKE_NVML_MPS_PROCESSES, each "pid:bytes,pid:bytes,..." (default: none), where the pid "self"
 * is the calling process's. Entry i has gpuInstanceId i and computeInstanceId 100 + i, so that a
 * test can see those fields carried through. They follow NVML's convention: *infoCount too small
 * (or 0, with infos allowed to be NULL): NVML_ERROR_INSUFFICIENT_SIZE and *infoCount = the number
 * needed (NVML_SUCCESS and 0 for an empty list); otherwise the entries and their number.
 *
 * Built with -Wl,-Bsymbolic, like the fake driver, so that it never calls the interposer's
 * exports of its own names.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nvml_layouts.h"

typedef struct fake_device *nvmlDevice_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define MAX_DEVICES 16
#define MAX_PROCESSES 4096
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

/* The processes listed in `variable`: their number, at most MAX_PROCESSES. */
static unsigned int parse_processes(const char *variable, unsigned int *pids,
                                    unsigned long long *bytes) {
  const char *list = getenv(variable);
  unsigned int n = 0;
  while (list != NULL && *list != '\0' && n < MAX_PROCESSES) {
    char *end;
    if (strncmp(list, "self", 4) == 0) {
      pids[n] = (unsigned int)getpid();
      end = (char *)list + 4;
    } else {
      pids[n] = (unsigned int)strtoul(list, &end, 10);
    }
    bytes[n] = *end == ':' ? strtoull(end + 1, &end, 10) : 0;
    n++;
    list = strchr(end, ',');
    if (list != NULL) list++;
  }
  return n;
}

/* One process-list query, for either entry layout (`v2`: nvmlProcessInfo_v2_t). */
static nvmlReturn_t processes(const char *variable, nvmlDevice_t device, unsigned int *count,
                              void *infos, int v2) {
  static unsigned int pids[MAX_PROCESSES];
  static unsigned long long bytes[MAX_PROCESSES];
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  if (!valid(device) || count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  unsigned int n = parse_processes(variable, pids, bytes);
  if (*count < n) {
    *count = n;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  if (n > 0 && infos == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  for (unsigned int i = 0; i < n; i++) {
    if (v2) {
      nvmlProcessInfo_v2_t *entry = (nvmlProcessInfo_v2_t *)infos + i;
      entry->pid = pids[i];
      entry->usedGpuMemory = bytes[i];
      entry->gpuInstanceId = i;
      entry->computeInstanceId = 100 + i;
    } else {
      nvmlProcessInfo_v1_t *entry = (nvmlProcessInfo_v1_t *)infos + i;
      entry->pid = pids[i];
      entry->usedGpuMemory = bytes[i];
    }
  }
  *count = n;
  return NVML_SUCCESS;
}

#define PROCESS_LIST(name, variable, entry, v2)                                              \
  nvmlReturn_t name(nvmlDevice_t device, unsigned int *count, entry *infos) {               \
    return processes(variable, device, count, infos, v2);                                    \
  }
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses, "FAKE_NVML_PROCESSES", nvmlProcessInfo_v1_t, 0)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v2, "FAKE_NVML_PROCESSES", nvmlProcessInfo_v2_t, 1)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v3, "FAKE_NVML_PROCESSES", nvmlProcessInfo_v2_t, 1)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses, "FAKE_NVML_GRAPHICS_PROCESSES",
             nvmlProcessInfo_v1_t, 0)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, "FAKE_NVML_GRAPHICS_PROCESSES",
             nvmlProcessInfo_v2_t, 1)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, "FAKE_NVML_GRAPHICS_PROCESSES",
             nvmlProcessInfo_v2_t, 1)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses, "FAKE_NVML_MPS_PROCESSES",
             nvmlProcessInfo_v1_t, 0)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, "FAKE_NVML_MPS_PROCESSES",
             nvmlProcessInfo_v2_t, 1)
PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, "FAKE_NVML_MPS_PROCESSES",
             nvmlProcessInfo_v2_t, 1)
