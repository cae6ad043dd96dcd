"""The risks of one swap staging pool per GPU shared by its processes (issue 17; the design in
docs/design/elastic-memory.md, "Next: one staging pool per GPU"), measured before building it:

1. faulting a shared-memory file of TOTAL GiB once (as the agent would), on 8 threads;
2. PROCS processes mapping the whole file (MAP_SHARED) and registering it with
   `cuMemHostRegister` (portable), one after the other, in slabs of SLAB MiB: the rate per
   process, and whether a registration of pages another process registered costs the same;
3. whether registering counts against the GPU's memory (cuMemGetInfo's used memory before and
   after each registration, every context made before the first; and for 4 GiB of anonymous
   memory registered the same way, the staging of today);
4. copies through the shared pages: each process alone device-to-host and host-to-device, then
   two processes at once in opposite directions (an exchange), against the same copies through
   anonymous memory registered the same way in the same process (the staging of today);
5. the file is removed, every registration undone, every process stopped, on any exit.

Prints one `RESULT {json}` line and a table. Never allocates managed memory.

  python3 shared_staging.py [TOTAL_GIB=16] [PROCS=2] [SLAB_MIB=64]
"""
import ctypes
import json
import multiprocessing
import os
import signal
import sys
import time

from hostmem import (CU_MEMHOSTREGISTER_PORTABLE, GIB, MADV_HUGEPAGE, MAP_ANONYMOUS, MAP_PRIVATE, MIB,
                     PROT_RW, check, cuda, gather, libc, map_file, touch, reported, stop)

COPY_BYTES = 4 * GIB


def device_used(cu):
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
    return total.value - free.value


def register(cu, p, size, slab):
    began = time.perf_counter()
    for o in range(0, size, slab):
        check(cu.cuMemHostRegister_v2(p + o, min(slab, size - o), CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister")
    return time.perf_counter() - began


def unregister(cu, p, size, slab):
    for o in range(0, size, slab):
        cu.cuMemHostUnregister(p + o)


def copies(cu, host, dev, stream, direction, nbytes, slab, each=False):
    """`nbytes` through `host` in slabs on `stream`, queued back to back, or with `each` one at a
    time (waiting for each before queueing the next); GB/s. A copy never spans two slabs: a copy
    across two registrations is refused (CUresult 1)."""
    began = time.perf_counter()
    for o in range(0, nbytes, slab):
        n = min(slab, nbytes - o)
        if direction == "out":
            check(cu.cuMemcpyDtoHAsync_v2(host + o, dev.value + o, n, stream), f"cuMemcpyDtoHAsync at {o >> 20} MiB")
        else:
            check(cu.cuMemcpyHtoDAsync_v2(dev.value + o, host + o, n, stream), f"cuMemcpyHtoDAsync at {o >> 20} MiB")
        if each:
            check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    return round(nbytes / (time.perf_counter() - began) / 1e9, 1)


def run_worker(index, path, total, slab, barrier, results):
    """One tenant process (under `hostmem.reported`): maps and registers the whole file, copies
    through its own part."""
    parent = os.getppid()
    cu, _ = cuda()
    p = map_file(path, total)
    # Every context made before any registration, and one registration at a time, so that the
    # GPU memory each one costs is its own (two at once showed +4.5 GiB in one process).
    barrier.wait(120)
    for turn in range(barrier.parties):
        if turn == index:
            used_before = device_used(cu)
            register_s = register(cu, p, total, slab)
            used_after = device_used(cu)
        barrier.wait(300)
    dev = ctypes.c_uint64()
    check(cu.cuMemAlloc_v2(ctypes.byref(dev), COPY_BYTES), "cuMemAlloc")
    stream = ctypes.c_void_p()
    check(cu.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
    part = p + index * COPY_BYTES % total
    row = {
        "proc": index,
        "register_gbps": round(total / register_s / 1e9, 1),
        "register_s": round(register_s, 2),
        "device_used_delta_mib": (used_after - used_before) // MIB,
    }
    barrier.wait(120)  # every process registered: the copies start
    if index == 0:
        row["alone_out_gbps"] = copies(cu, part, dev, stream, "out", COPY_BYTES, slab)
        row["alone_in_gbps"] = copies(cu, part, dev, stream, "in", COPY_BYTES, slab)
        # The staging of today, for the same copies: anonymous memory registered here.
        a = libc.mmap(None, COPY_BYTES, PROT_RW, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        libc.madvise(a, COPY_BYTES, MADV_HUGEPAGE)
        touch(a, COPY_BYTES)
        anon_before = device_used(cu)
        check(cu.cuMemHostRegister_v2(a, COPY_BYTES, CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister")
        row["anon_register_device_delta_mib"] = (device_used(cu) - anon_before) // MIB
        row["anon_out_gbps"] = copies(cu, a, dev, stream, "out", COPY_BYTES, slab)
        row["anon_in_gbps"] = copies(cu, a, dev, stream, "in", COPY_BYTES, slab)
        cu.cuMemHostUnregister(a)
        libc.munmap(a, COPY_BYTES)
    barrier.wait(120)  # process 0's alone copies done: both directions at once
    if os.getppid() != parent:
        return
    row["exchange_gbps"] = copies(cu, part, dev, stream, "out" if index == 0 else "in", COPY_BYTES, slab)
    row["exchange_dir"] = "out" if index == 0 else "in"
    # Who gets the link when one side queues its copies back to back and the other waits for each
    # before the next: vgpu's exchange ran 52 GB/s out against 42 in, the giver's copies queued
    # back to back, the taker's a piece at a time. Out queued against in one at a time, then the
    # other way round.
    for name, queued in (("uneven_out_queued", 0), ("uneven_in_queued", 1)):
        barrier.wait(120)
        row[name] = copies(cu, part, dev, stream, "out" if index == 0 else "in", COPY_BYTES, slab, each=index != queued)
    began = time.perf_counter()
    unregister(cu, p, total, slab)
    row["unregister_s"] = round(time.perf_counter() - began, 2)
    # Registered again: the pages are faulted and, in the other process, registered.
    row["reregister_gbps"] = round(total / register(cu, p, total, slab) / 1e9, 1)
    unregister(cu, p, total, slab)
    libc.munmap(p, total)
    cu.cuMemFree_v2(dev)
    results.put(row)


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    total = int(float(sys.argv[1]) * GIB) if len(sys.argv) > 1 else 16 * GIB
    procs_n = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    slab = int(sys.argv[3]) * MIB if len(sys.argv) > 3 else 64 * MIB
    assert total >= 2 * COPY_BYTES, "TOTAL_GIB must be at least 8"
    path = f"/dev/shm/vgpu-shared-staging-probe.{os.getpid()}"
    procs = []
    summary = {"total_gib": total // GIB, "procs": procs_n, "slab_mib": slab // MIB}
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, total)
        os.close(fd)
        p = map_file(path, total)
        began = time.perf_counter()
        touch(p, total)
        summary["fault_gbps"] = round(total / (time.perf_counter() - began) / 1e9, 1)
        libc.munmap(p, total)  # the pages stay: they belong to the file
        mp = multiprocessing.get_context("spawn")
        barrier, results = mp.Barrier(procs_n), mp.Queue()
        procs = [mp.Process(target=reported, args=(run_worker, i, path, total, slab, barrier, results)) for i in range(procs_n)]
        began = time.perf_counter()
        for pr in procs:
            pr.start()
        rows = gather(results, procs, procs_n, 300)
        summary["wall_s"] = round(time.perf_counter() - began, 1)
        summary["rows"] = sorted(rows, key=lambda r: r["proc"])
    finally:
        stop(procs, path)
    print("RESULT " + json.dumps(summary))
    print(f"shared file of {summary['total_gib']} GiB faulted at {summary.get('fault_gbps')} GB/s (8 threads)")
    print("| proc | register GB/s | device used + MiB | anon 4 GiB: device used + MiB | alone out | alone in | "
          "anon out | anon in | exchange | out queued, in one at a time | out one at a time, in queued | re-register GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in summary.get("rows", []):
        if "error" in r:
            print(f"| {r['proc']} | error: {r['error']} |")
            continue
        print(f"| {r['proc']} | {r['register_gbps']} | {r['device_used_delta_mib']} | "
              f"{r.get('anon_register_device_delta_mib', '')} | {r.get('alone_out_gbps', '')} | "
              f"{r.get('alone_in_gbps', '')} | {r.get('anon_out_gbps', '')} | {r.get('anon_in_gbps', '')} | "
              f"{r.get('exchange_dir')} {r.get('exchange_gbps')} | {r.get('uneven_out_queued')} | "
              f"{r.get('uneven_in_queued')} | {r.get('reregister_gbps')} |")


if __name__ == "__main__":
    main()
