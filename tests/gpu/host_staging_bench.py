"""Where the swap's time goes on this machine (issue 17, "Swap at the speed of the link"): the cost
of each way to get host memory a GPU can copy into, and the copy rates, measured with the driver
API directly (no vgpu). The first reclaim on an H200 spent 3.2 s of 3.25 s pinning 6 GiB of fresh
staging (`cuMemHostAlloc`); this says which way out the machine allows:
  - pin_alloc        cuMemHostAlloc of SIZE (what the swap does today), and its free
  - touch_4k/thp     first touch of fresh anonymous memory (4 KiB pages / transparent huge pages)
                     by THREADS threads: what pageable staging costs to fault in
  - register_*       cuMemHostRegister of memory already touched, and of fresh memory
  - d2h/h2d_pinned   copies to and from pinned memory (the link's ceiling)
  - d2h_pageable     a copy to touched pageable memory (the driver stages it itself)
  - memmove          host-to-host copies by THREADS threads (a pinned bounce buffer drained to
                     pageable memory), into touched and into fresh memory
Prints one `RESULT {json}` line last and a table. Never allocates managed memory.

  python3 host_staging_bench.py [SIZE_GIB=4] [THREADS=1,4,8]
"""
import ctypes
import json
import sys
import threading
import time

import torch

from hostmem import (CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTREGISTER_PORTABLE, GIB, MADV_HUGEPAGE, MADV_NOHUGEPAGE,
                     MAP_ANONYMOUS, MAP_PRIVATE, PROT_RW, check, libc)

cu = ctypes.CDLL("libcuda.so.1")
for name, args in {
    "cuMemHostAlloc": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint],
    "cuMemFreeHost": [ctypes.c_void_p],
    "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostUnregister": [ctypes.c_void_p],
    "cuMemcpyDtoH_v2": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t],
    "cuMemcpyHtoD_v2": [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t],
}.items():
    getattr(cu, name).argtypes = args
    getattr(cu, name).restype = ctypes.c_int


def mapping(size, huge):
    p = libc.mmap(None, size, PROT_RW, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if p in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    libc.madvise(p, size, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    return p


def parallel(threads, size, work):
    """work(offset, length) on `threads` threads over [0, size); seconds taken."""
    step = (size + threads - 1) // threads
    pieces = [(o, min(step, size - o)) for o in range(0, size, step)]
    began = time.perf_counter()
    ts = [threading.Thread(target=work, args=piece) for piece in pieces]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - began


def timed(f):
    began = time.perf_counter()
    f()
    return time.perf_counter() - began


def main():
    size = int(float(sys.argv[1]) * GIB) if len(sys.argv) > 1 else 4 * GIB
    threads = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,4,8").split(",")]
    torch.cuda.init()
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    device.fill_(7)
    torch.cuda.synchronize()
    dptr = device.data_ptr()
    rows = {}

    def rate(name, seconds, note=""):
        rows[name] = {"seconds": round(seconds, 4), "gb_per_s": round(size / seconds / 1e9, 2), "note": note}

    # Pinning fresh memory, as the swap does today.
    host = ctypes.c_void_p()
    rate("pin_alloc", timed(lambda: check(cu.cuMemHostAlloc(ctypes.byref(host), size, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc")))
    rate("d2h_pinned", timed(lambda: check(cu.cuMemcpyDtoH_v2(host, dptr, size), "DtoH")))
    rate("h2d_pinned", timed(lambda: check(cu.cuMemcpyHtoD_v2(dptr, host, size), "HtoD")))
    rate("d2h_pinned_again", timed(lambda: check(cu.cuMemcpyDtoH_v2(host, dptr, size), "DtoH")))
    rate("pin_free", timed(lambda: check(cu.cuMemFreeHost(host), "cuMemFreeHost")))

    for huge in (False, True):
        kind = "thp" if huge else "4k"
        for n in threads:
            p = mapping(size, huge)
            rate(f"touch_{kind}_t{n}", parallel(n, size, lambda o, l: libc.memset(p + o, 1, l)))
            libc.munmap(p, size)
        # Registering memory already touched, and copies into it registered and not.
        p = mapping(size, huge)
        parallel(max(threads), size, lambda o, l: libc.memset(p + o, 1, l))
        rate(f"d2h_pageable_{kind}", timed(lambda: check(cu.cuMemcpyDtoH_v2(p, dptr, size), "DtoH pageable")))
        rate(f"register_touched_{kind}", timed(lambda: check(cu.cuMemHostRegister_v2(p, size, CU_MEMHOSTREGISTER_PORTABLE), "register")))
        rate(f"d2h_registered_{kind}", timed(lambda: check(cu.cuMemcpyDtoH_v2(p, dptr, size), "DtoH registered")))
        rate(f"unregister_{kind}", timed(lambda: check(cu.cuMemHostUnregister(p), "unregister")))
        libc.munmap(p, size)
        p = mapping(size, huge)
        rate(f"register_fresh_{kind}", timed(lambda: check(cu.cuMemHostRegister_v2(p, size, CU_MEMHOSTREGISTER_PORTABLE), "register fresh")))
        check(cu.cuMemHostUnregister(p), "unregister")
        libc.munmap(p, size)

    # Host-to-host copies (a bounce buffer drained into pageable memory), touched and fresh
    # destinations (transparent huge pages).
    src = mapping(size, True)
    parallel(max(threads), size, lambda o, l: libc.memset(src + o, 3, l))
    for n in threads:
        dst = mapping(size, True)
        rate(f"memmove_fresh_t{n}", parallel(n, size, lambda o, l: libc.memmove(dst + o, src + o, l)))
        rate(f"memmove_touched_t{n}", parallel(n, size, lambda o, l: libc.memmove(dst + o, src + o, l)))
        libc.munmap(dst, size)
    libc.munmap(src, size)

    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    print("RESULT " + json.dumps({"size_gib": size / GIB, "thp": thp, "rows": rows}), flush=True)
    print(f"\n{size / GIB:.1f} GiB each; transparent huge pages: {thp}")
    print("| step | seconds | GB/s |")
    print("| --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['seconds']} | {r['gb_per_s']} |")


if __name__ == "__main__":
    main()
