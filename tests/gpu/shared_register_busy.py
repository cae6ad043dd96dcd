"""What registering a GPU's shared swap staging file costs processes that are busy with the driver
(issue 17; docs/design/elastic-memory.md, "One staging pool per GPU"). On an H200, three PyTorch
jobs that each registered an 84 GiB shared file in the background took 14-46 s for it, finished
within the same millisecond, and meanwhile a 64 MiB registration of their own waited 35-39 s
(docs/benchmarks.md, twenty-fourth session). This probe separates the suspects:

- PROCS processes (each with its context, one after the other made) map one shared-memory file of
  TOTAL GiB (faulted once, as the agent allocates it) and register it with `cuMemHostRegister`
  (portable), either as one registration (`whole`) or one per SLAB MiB (`slabs`), while a busy
  thread in each keeps calling the driver: every 20 ms a 64 MiB `cuMemAlloc`/`cuMemFree`, every
  100 ms a `cuMemHostRegister`/`cuMemHostUnregister` of 64 MiB of its own (touched anonymous
  memory), timing each;
- phases, each on a fresh mapping: one process alone (whole, then slabs), then every process at
  once (whole, then slabs), then every process at once with slabs paced (a pause as long as
  each registration took, after each), then with a fixed 2 ms rest after each slab (whether a
  short gap is enough for the process's other calls to get the driver); `PHASES` picks some;
- per process and phase: the registration's time and rate, and the busy thread's worst and
  median times while it ran.

Prints one `RESULT {json}` line and a table. Never allocates managed memory; removes the file and
stops every process on any exit.

  python3 shared_register_busy.py [TOTAL_GIB=32] [PROCS=3] [SLAB_MIB=64] [PAGES=small|huge]

PAGES=huge faults the file through a mapping advised `MADV_HUGEPAGE` (shared memory gets
transparent huge pages only where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows:
`advise` or `always`; the probe prints it), so that registering pins 2 MiB pages; `small`
(the default) allocates it as the agent does (`fallocate`, 4 KiB pages).
"""
import ctypes
import json
import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time

from hostmem import (CU_MEMHOSTREGISTER_PORTABLE, GIB, MADV_HUGEPAGE, MAP_ANONYMOUS, MAP_PRIVATE, MIB,
                     PROT_RW, check, cuda, gather, libc, map_file, reported, stop)

PHASES = [  # name, who registers ("one": process 0 only; "all"), how
    ("alone-whole", "one", "whole"),
    ("alone-slabs", "one", "slabs"),
    ("all-whole", "all", "whole"),
    ("all-slabs", "all", "slabs"),
    ("all-slabs-paced", "all", "paced"),
    ("all-slabs-rest2ms", "all", "rest2ms"),
]
# PHASES="all-slabs all-slabs-rest2ms" (names above) runs only those, in this order.
if os.environ.get("PHASES"):
    _named = {p[0]: p for p in PHASES}
    _unknown = [n for n in os.environ["PHASES"].split() if n not in _named]
    if _unknown:
        sys.exit(f"unknown phase(s) {_unknown}; known: {list(_named)}")
    PHASES = [_named[n] for n in os.environ["PHASES"].split()]
BUSY_BYTES = 64 * MIB


def busy(cu, ctx, stop, times):
    """The process's other driver work while the file registers: timed allocations and pins."""
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent (busy thread)")
    own = libc.mmap(None, BUSY_BYTES, PROT_RW, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    libc.madvise(own, BUSY_BYTES, MADV_HUGEPAGE)
    libc.memset(own, 1, BUSY_BYTES)
    dev = ctypes.c_uint64()
    next_pin = time.monotonic()
    while not stop.is_set():
        began = time.perf_counter()
        check(cu.cuMemAlloc_v2(ctypes.byref(dev), BUSY_BYTES), "cuMemAlloc")
        check(cu.cuMemFree_v2(dev), "cuMemFree")
        times["alloc"].append(time.perf_counter() - began)
        if time.monotonic() >= next_pin:
            began = time.perf_counter()
            check(cu.cuMemHostRegister_v2(own, BUSY_BYTES, CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister (own)")
            check(cu.cuMemHostUnregister(own), "cuMemHostUnregister (own)")
            times["pin"].append(time.perf_counter() - began)
            next_pin = time.monotonic() + 0.1
        stop.wait(0.02)
    libc.munmap(own, BUSY_BYTES)


def register(cu, p, total, slab, how):
    """The file registered whole or slab by slab (paced: a pause as long as each took); the
    registered (address, bytes) for undoing it."""
    if how == "whole":
        check(cu.cuMemHostRegister_v2(p, total, CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister (file)")
        return [(p, total)]
    done = []
    for o in range(0, total, slab):
        began = time.perf_counter()
        n = min(slab, total - o)
        check(cu.cuMemHostRegister_v2(p + o, n, CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister (slab)")
        done.append((p + o, n))
        if how == "paced":
            time.sleep(time.perf_counter() - began)
        elif how == "rest2ms":
            time.sleep(0.002)
    return done


def summary(samples):
    if not samples:
        return {"n": 0}
    ms = sorted(s * 1e3 for s in samples)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "max_ms": round(ms[-1], 1)}


def run_worker(index, path, total, slab, barrier, results):
    # Contexts one after the other: a context's start is not measured as a registration's cost.
    for turn in range(barrier.parties):
        if turn == index:
            cu, ctx = cuda()
        barrier.wait(120)
    rows = []
    for name, who, how in PHASES:
        barrier.wait(300)
        if who == "one" and index != 0:
            continue
        p = map_file(path, total)
        stop, times = threading.Event(), {"alloc": [], "pin": []}
        thread = threading.Thread(target=busy, args=(cu, ctx, stop, times), daemon=True)
        thread.start()
        time.sleep(0.3)  # the busy thread's own pace before the registration
        began = time.perf_counter()
        registered = register(cu, p, total, slab, how)
        took = time.perf_counter() - began
        stop.set()
        thread.join(60)
        for address, _ in registered:
            cu.cuMemHostUnregister(address)
        libc.munmap(p, total)
        rows.append({"phase": name, "proc": index, "register_s": round(took, 2),
                     "register_gbps": round(total / took / 1e9, 1), "alloc": summary(times["alloc"]),
                     "own_pin": summary(times["pin"])})
    results.put({"proc": index, "rows": rows})


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    total = int(float(sys.argv[1]) * GIB) if len(sys.argv) > 1 else 32 * GIB
    procs_n = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    slab = int(sys.argv[3]) * MIB if len(sys.argv) > 3 else 64 * MIB
    pages = sys.argv[4] if len(sys.argv) > 4 else "small"
    assert pages in ("small", "huge"), "PAGES is small or huge"
    path = f"/dev/shm/vgpu-shared-register-probe.{os.getpid()}"
    procs = []
    out = {"total_gib": total // GIB, "procs": procs_n, "slab_mib": slab // MIB, "pages": pages}
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            out["shmem_enabled"] = f.read().strip()
    except OSError as e:
        out["shmem_enabled"] = f"unreadable ({e})"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, total)
        began = time.perf_counter()
        if pages == "small":
            os.posix_fallocate(fd, 0, total)  # as the agent allocates it
            os.close(fd)
        else:
            os.close(fd)
            p = map_file(path, total)
            libc.madvise(p, total, MADV_HUGEPAGE)
            libc.memset(p, 1, total)
            libc.munmap(p, total)
        out["allocate_s"] = round(time.perf_counter() - began, 1)
        try:
            with open("/proc/meminfo") as f:
                out["shmem_huge_kib"] = next((int(line.split()[1]) for line in f if line.startswith("ShmemHugePages:")),
                                             None)
        except OSError:
            pass
        mp = multiprocessing.get_context("spawn")
        barrier, results = mp.Barrier(procs_n), mp.Queue()
        procs = [mp.Process(target=reported, args=(run_worker, i, path, total, slab, barrier, results)) for i in range(procs_n)]
        for pr in procs:
            pr.start()
        got = gather(results, procs, procs_n, 500)
        out["errors"] = [g for g in got if "error" in g]
        out["rows"] = sorted((r for g in got for r in g.get("rows", [])),
                             key=lambda r: ([p[0] for p in PHASES].index(r["phase"]), r["proc"]))
    finally:
        stop(procs, path)
    print("RESULT " + json.dumps(out))
    print(f"file of {out['total_gib']} GiB ({pages} pages; shmem_enabled {out['shmem_enabled']}; ShmemHugePages "
          f"{out.get('shmem_huge_kib')} KiB) allocated in {out.get('allocate_s')} s; {procs_n} processes; slabs of "
          f"{out['slab_mib']} MiB; errors: {out.get('errors') or 'none'}")
    print("| phase | proc | register s | GB/s | cuMemAlloc+Free p50 / max ms (n) | own 64 MiB pin p50 / max ms (n) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in out["rows"]:
        a, o = r["alloc"], r["own_pin"]
        print(f"| {r['phase']} | {r['proc']} | {r['register_s']} | {r['register_gbps']} | "
              f"{a.get('p50_ms')} / {a.get('max_ms')} ({a['n']}) | {o.get('p50_ms')} / {o.get('max_ms')} ({o['n']}) |")


if __name__ == "__main__":
    main()
