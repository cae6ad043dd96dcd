/*
 * The NVML types the fake NVML (fakenvml.c) and the probe (probe.c) both use, with nvml.h's
 * layouts (NVML itself is not installed where the tests run).
 */
#ifndef VGPU_TEST_NVML_LAYOUTS_H
#define VGPU_TEST_NVML_LAYOUTS_H

typedef int nvmlReturn_t;
typedef struct {
  unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
  unsigned int version;
  unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
typedef struct {
  unsigned int pid;
  unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;
typedef struct {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_v2_t;
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvml.h's v1 layout");
_Static_assert(sizeof(nvmlProcessInfo_v2_t) == 24, "nvml.h's v2 layout");

#endif
