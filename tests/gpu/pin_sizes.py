"""What pinning fresh swap staging costs by buffer size, idle and beside a busy GPU (issue 17):
inside three training jobs the interposer pinned 64 MiB staging buffers at 2.4-3.7 GB/s, against
14 GB/s for one 4 GiB buffer on an idle machine (host_staging_bench.py). For each buffer size, maps
TOTAL bytes as buffers of that size (anonymous, huge pages asked for), touches each buffer's pages
on up to 8 threads (a thread per 8 MiB at least, as `interposer::staging` does), registers each
with `cuMemHostRegister` (portable), then unregisters and unmaps them; times the touching and the
registering apart. `--busy` runs the same while another process keeps the GPU busy with bf16
matmuls and 1 GiB copies both ways; `--churn` while another allocates and frees device memory
in a loop. Prints one `RESULT {json}` line and a table. Never allocates
managed memory.

  python3 pin_sizes.py [TOTAL_GIB=2] [--busy] [--churn]
"""
import ctypes
import json
import multiprocessing
import os
import signal
import sys
import time

from hostmem import CU_MEMHOSTREGISTER_PORTABLE, GIB, MADV_HUGEPAGE, MAP_ANONYMOUS, MAP_PRIVATE, MIB, PROT_RW, libc, touch


def churn(stop):
    """Another process allocating and freeing device memory through the driver as fast as it can
    (64 MiB tensors, the cache emptied each time: `cuMemAlloc`/`cuMemFree`), as a job growing
    and a swap mapping chunks do."""
    import torch

    parent = os.getppid()
    while not stop.is_set() and os.getppid() == parent:
        held = [torch.empty(64 * MIB, dtype=torch.uint8, device="cuda") for _ in range(16)]
        del held
        torch.cuda.empty_cache()


def busy(stop):
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    dev = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    host = torch.empty(GIB, dtype=torch.uint8).pin_memory()
    side = torch.cuda.Stream()
    parent = os.getppid()
    while not stop.is_set() and os.getppid() == parent:
        with torch.cuda.stream(side):
            host.copy_(dev, non_blocking=True)
            dev.copy_(host, non_blocking=True)
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def measure(cu, total, size):
    n = total // size
    buffers, touch_s, register_s = [], 0.0, 0.0
    for _ in range(n):
        began = time.perf_counter()
        p = libc.mmap(None, size, PROT_RW, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        libc.madvise(p, size, MADV_HUGEPAGE)
        touch(p, size, max(1, min(8, size // (8 * MIB))))
        touched = time.perf_counter()
        rc = cu.cuMemHostRegister_v2(p, size, CU_MEMHOSTREGISTER_PORTABLE)
        if rc != 0:
            raise RuntimeError(f"cuMemHostRegister: CUresult {rc}")
        register_s += time.perf_counter() - touched
        touch_s += touched - began
        buffers.append(p)
    for p in buffers:
        cu.cuMemHostUnregister(p)
        libc.munmap(p, size)
    return {
        "buffer_mib": size // MIB,
        "buffers": n,
        "touch_gbps": round(total / touch_s / 1e9, 2),
        "register_gbps": round(total / register_s / 1e9, 2),
        "register_ms_per_buffer": round(register_s / n * 1e3, 2),
        "pin_gbps": round(total / (touch_s + register_s) / 1e9, 2),
    }


def main():
    # A `timeout` TERM unwinds through the `finally` below, which stops the other process; that
    # one also stops by itself once this one is gone.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    total = int(float(args[0]) * GIB) if args else 2 * GIB
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    ctx = ctypes.c_void_p()
    dev = ctypes.c_int()
    assert cu.cuInit(0) == 0
    assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    rows = []
    modes = ["idle"] + [m for m in ("busy", "churn") if f"--{m}" in sys.argv]
    for mode in modes:
        stop, proc = None, None
        if mode != "idle":
            ctx_mp = multiprocessing.get_context("spawn")
            stop = ctx_mp.Event()
            proc = ctx_mp.Process(target=busy if mode == "busy" else churn, args=(stop,))
            proc.start()
            time.sleep(5)  # its context and first matmuls (a warm-up, not a synchronisation)
        try:
            for size in (64 * MIB, 256 * MIB, GIB, 2 * GIB):
                if size <= total:
                    rows.append({"mode": mode, **measure(cu, total, size)})
        finally:
            if proc is not None:
                stop.set()
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    print("RESULT " + json.dumps(rows))
    print("| mode | buffer | buffers | touch GB/s | register GB/s | register ms per buffer | pinning GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['buffer_mib']} MiB | {r['buffers']} | {r['touch_gbps']} | {r['register_gbps']} | "
              f"{r['register_ms_per_buffer']} | {r['pin_gbps']} |")


if __name__ == "__main__":
    main()
