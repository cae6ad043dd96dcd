"""Workloads for tests/gpu/nvml_slice.sh, one per subcommand. Each prints one line
`RESULT <json>` (last), so the shell script can check it; everything else is log. The GPU is
named by NVML_UUID (the script reads it from nvidia-smi).

  track GIB           torch + pynvml in one process: NVML memory (v1 and v2) and
                      torch.cuda.mem_get_info at start, after a GIB GiB tensor, after freeing it
  nvml_only           pynvml alone (no CUDA in the process): the device's NVML memory
  footprint           what this process really holds on the GPU (NVML's per-process figure)
                      beyond what PyTorch reserved, after each stage: context, first kernel,
                      2 GiB + fill, cuBLAS matmul, cuDNN conv
  hold MIB            allocate MIB MiB, print HOLDING, sleep until killed; on an error print
                      its RESULT and exit 1
"""
import json
import os
import sys
import time

GIB = 1 << 30
MIB = 1 << 20


def result(**fields):
    fields["pid"] = os.getpid()
    print("RESULT " + json.dumps(fields), flush=True)


def error_fields(e):
    return {"ok": False, "error_type": type(e).__name__, "message": str(e).splitlines()[0][:400]}


def nvml_handle():
    import pynvml

    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByUUID(os.environ["NVML_UUID"].encode())


def nvml_memory(pynvml, handle):
    """NVML's memory figures, v1 and (if this pynvml has it) v2."""
    m = pynvml.nvmlDeviceGetMemoryInfo(handle)
    out = {"total": m.total, "free": m.free, "used": m.used}
    if hasattr(pynvml, "nvmlMemory_v2"):
        m2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        out.update(v2_total=m2.total, v2_reserved=m2.reserved, v2_free=m2.free, v2_used=m2.used)
    return out


def process_used(pynvml, handle):
    """This process's GPU memory as the driver counts it (not interposed), or None."""
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if p.pid == os.getpid():
            return p.usedGpuMemory
    return None


def track(gib):
    import torch

    free0, total0 = torch.cuda.mem_get_info()
    pynvml, handle = nvml_handle()
    start = nvml_memory(pynvml, handle)
    t = torch.empty(int(float(gib) * GIB), dtype=torch.uint8, device="cuda")
    t.fill_(1)
    torch.cuda.synchronize()
    free1, total1 = torch.cuda.mem_get_info()
    held = nvml_memory(pynvml, handle)
    del t
    torch.cuda.empty_cache()
    free2, _ = torch.cuda.mem_get_info()
    freed = nvml_memory(pynvml, handle)
    result(ok=True, torch_start=[free0, total0], torch_held=[free1, total1], torch_freed=free2,
           nvml_start=start, nvml_held=held, nvml_freed=freed,
           has_v2=hasattr(pynvml, "nvmlMemory_v2"))


def nvml_only():
    pynvml, handle = nvml_handle()
    result(ok=True, nvml=nvml_memory(pynvml, handle), cuda_loaded="libcuda" in open(
        "/proc/self/maps").read())


def footprint():
    import torch

    pynvml, handle = nvml_handle()
    device_before = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    stages = []

    def stage(name):
        torch.cuda.synchronize()
        used = process_used(pynvml, handle)
        reserved = torch.cuda.memory_reserved()
        stages.append({"stage": name, "process_used": used, "reserved": reserved,
                       "beyond_reserved": None if used is None else used - reserved,
                       "device_delta": pynvml.nvmlDeviceGetMemoryInfo(handle).used - device_before})

    torch.cuda.mem_get_info()
    stage("context")
    x = torch.ones(1024, device="cuda") + 1
    stage("first kernel")
    big = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    big.fill_(1)
    stage("2 GiB + fill")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    stage("cuBLAS matmul")
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda().half()
    conv(torch.randn(16, 64, 56, 56, device="cuda", dtype=torch.half)).sum().item()
    stage("cuDNN conv")
    del x, big, a, conv
    result(ok=True, stages=stages)


def hold(mib):
    try:
        import torch

        t = torch.empty(int(mib) * MIB, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        torch.cuda.synchronize()
    except Exception as e:  # a context or an allocation past the slice
        result(**error_fields(e))
        sys.exit(1)
    print("HOLDING", flush=True)
    while True:
        time.sleep(3600)


def main():
    command, args = sys.argv[1], sys.argv[2:]
    {"track": track, "nvml_only": nvml_only, "footprint": footprint, "hold": hold}[command](*args)


if __name__ == "__main__":
    main()
