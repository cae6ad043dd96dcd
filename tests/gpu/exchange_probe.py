"""Why an exchange's taker copies slower than its giver (issue 17; docs/benchmarks.md, twenty-fifth
session: beside the giver's swap-out at 51.8 GB/s the taker's swap-in ran at about 37 GB/s, and at
55 alone after it, while torch moves 49+ GB/s each way at once in one process). Two processes on
GPU 0, TOTAL GiB each in chunks of CHUNK MiB, without vgpu:

- the giver holds its chunks VMM-backed (`cuMemCreate`, mapped) with pinned host staging for
  each; at go it queues their copies out back to back (an event after each) and, as each event
  completes, unmaps and releases the chunk and counts it free (a shared counter), as vgpu's
  swap-out does;
- the taker holds pinned host data for its chunks and an address range reserved for each; as
  each chunk is counted free it copies one in, in one of the modes:
  - `fresh`: creates and maps the chunk's physical memory only then, on a GPU filled beforehand
    (a ballast allocation), so that the memory is the giver's just released (what vgpu does);
  - `ready`: the memory created and mapped before go, the copies paced by the counter alike;
  - `keep`: as `ready`, and the giver keeps its chunks (counts them free without releasing):
    whether releasing memory slows the other direction's copies;
  - `free`: as `ready`, not paced: every copy queued at go (the two directions' ceiling between
    two processes).

The fake driver of the ABI tests (`LD_LIBRARY_PATH=target/tmp/abi`) runs it for its flow: its
processes do not share a device, so `fresh` reports that no memory came back.

Prints per mode the giver's and the taker's rates (bytes over the time from its first copy queued
to its last completed), the taker's waits for memory (`fresh`: cuMemCreate refused while the
driver had not released the giver's yet), then one `RESULT {json}` line. Never allocates managed
memory; every process is stopped on any exit, and its memory goes with it.

  python3 exchange_probe.py [TOTAL_GIB=16] [CHUNK_MIB=1024] [MODES="fresh ready keep free"]
"""
import ctypes
import json
import multiprocessing
import signal
import sys
import time
from ctypes import POINTER, byref, c_int, c_size_t, c_uint, c_uint64, c_ulonglong, c_void_p

from hostmem import GIB, MIB, check, cuda, gather, stop

NOT_READY, OUT_OF_MEMORY = 600, 2
MODES = ["fresh", "ready", "keep", "free"]


class Location(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", Location),
                ("win32HandleMetaData", c_void_p), ("allocFlags", ctypes.c_ubyte * 8)]


class Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", c_int)]


DEVICE_0 = Location(1, 0)  # CU_MEM_LOCATION_TYPE_DEVICE, ordinal 0
PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


def driver():
    cu, ctx = cuda()
    cu.cuMemCreate.argtypes = [POINTER(c_uint64), c_size_t, POINTER(Prop), c_ulonglong]
    cu.cuMemAddressReserve.argtypes = [POINTER(c_uint64), c_size_t, c_size_t, c_uint64, c_ulonglong]
    cu.cuMemMap.argtypes = [c_uint64, c_size_t, c_size_t, c_uint64, c_ulonglong]
    cu.cuMemSetAccess.argtypes = [c_uint64, c_size_t, POINTER(Access), c_size_t]
    cu.cuMemUnmap.argtypes = [c_uint64, c_size_t]
    cu.cuMemRelease.argtypes = [c_uint64]
    cu.cuMemHostAlloc.argtypes = [POINTER(c_void_p), c_size_t, c_uint]
    cu.cuEventCreate.argtypes = [POINTER(c_void_p), c_uint]
    cu.cuEventRecord.argtypes = [c_void_p, c_void_p]
    cu.cuEventQuery.argtypes = [c_void_p]
    return cu


def reserve(cu, chunk):
    p = c_uint64()
    check(cu.cuMemAddressReserve(byref(p), chunk, 0, 0, 0), "cuMemAddressReserve")
    return p.value


def create(cu, chunk):
    """Physical memory for a chunk; None while the driver has none (it is still releasing)."""
    h = c_uint64()
    rc = cu.cuMemCreate(byref(h), chunk, byref(Prop(type=PINNED, location=DEVICE_0)), 0)
    if rc == OUT_OF_MEMORY:
        return None
    check(rc, "cuMemCreate")
    return h.value


def map_at(cu, p, h, chunk):
    check(cu.cuMemMap(p, chunk, 0, h, 0), "cuMemMap")
    check(cu.cuMemSetAccess(p, chunk, byref(Access(DEVICE_0, READ_WRITE)), 1), "cuMemSetAccess")


def pinned(cu, chunk, fill):
    host = c_void_p()
    check(cu.cuMemHostAlloc(byref(host), chunk, 0), "cuMemHostAlloc")
    ctypes.memset(host.value, fill, chunk)
    return host.value


def stream(cu):
    s = c_void_p()
    check(cu.cuStreamCreate(byref(s), 1), "cuStreamCreate")  # non-blocking
    return s


def giver(n, chunk, mode, ready, go, freed, results):
    cu = driver()
    chunks = []
    for _ in range(n):
        p, h = reserve(cu, chunk), create(cu, chunk)
        if h is None:
            raise RuntimeError("the giver's chunks do not fit the GPU")
        map_at(cu, p, h, chunk)
        chunks.append((p, h, pinned(cu, chunk, 0)))
    s = stream(cu)
    ready.set()
    if not go.wait(300):
        return
    began = time.perf_counter()
    events = []
    for p, _, host in chunks:
        check(cu.cuMemcpyDtoHAsync_v2(host, p, chunk, s), "cuMemcpyDtoHAsync")
        e = c_void_p()
        check(cu.cuEventCreate(byref(e), 2), "cuEventCreate")  # no timing
        check(cu.cuEventRecord(e, s), "cuEventRecord")
        events.append(e)
    for i, (p, h, _) in enumerate(chunks):
        while (rc := cu.cuEventQuery(events[i])) == NOT_READY:
            time.sleep(20e-6)
        check(rc, "cuEventQuery")
        if mode != "keep":
            check(cu.cuMemUnmap(p, chunk), "cuMemUnmap")
            check(cu.cuMemRelease(h), "cuMemRelease")
        freed.value = i + 1
    took = time.perf_counter() - began
    results.put({"role": "giver", "seconds": took, "gbps": n * chunk / took / 1e9})


def taker(n, chunk, mode, ready, go, freed, results):
    cu = driver()
    hosts = [pinned(cu, chunk, 7) for _ in range(n)]
    ranges = [reserve(cu, chunk) for _ in range(n)]
    if mode != "fresh":
        for p in ranges:
            map_at(cu, p, create(cu, chunk), chunk)
    s = stream(cu)
    ballast = None
    if mode == "fresh":
        # Fill the GPU (the giver's chunks are made): what this process creates after go can
        # only be what the giver releases.
        free, total = c_size_t(), c_size_t()
        check(cu.cuMemGetInfo_v2(byref(free), byref(total)), "cuMemGetInfo")
        ballast = c_uint64()
        check(cu.cuMemAlloc_v2(byref(ballast), max(0, free.value - chunk // 2)), "cuMemAlloc (ballast)")
    ready.set()
    if not go.wait(300):
        return
    first, waits, waited_s = None, 0, 0.0
    for i, (p, host) in enumerate(zip(ranges, hosts)):
        if mode != "free":
            while freed.value <= i:
                time.sleep(20e-6)
        if mode == "fresh":
            began = time.perf_counter()
            while (h := create(cu, chunk)) is None:
                waits += 1
                if time.perf_counter() - began > 5:
                    raise RuntimeError("no memory for the taker's chunk 5 s after the giver released one")
                time.sleep(50e-6)
            waited_s += time.perf_counter() - began
            map_at(cu, p, h, chunk)
        if first is None:
            first = time.perf_counter()
        check(cu.cuMemcpyHtoDAsync_v2(p, host, chunk, s), "cuMemcpyHtoDAsync")
    check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
    took = time.perf_counter() - first
    results.put({"role": "taker", "seconds": took, "gbps": n * chunk / took / 1e9, "memory_waits": waits,
                 "creating_s": round(waited_s, 4)})


def role(name, *args):
    """A process's body (`giver` or `taker`), its failure put in the results for the table."""
    results = args[-1]
    try:
        {"giver": giver, "taker": taker}[name](*args)
    except Exception as e:  # noqa: BLE001 - reported
        results.put({"role": name, "error": f"{type(e).__name__}: {e}"})


def run_mode(mode, n, chunk):
    ctx = multiprocessing.get_context("spawn")
    ready_g, go = ctx.Event(), ctx.Event()
    freed, results = ctx.Value("i", 0, lock=False), ctx.Queue()
    procs = [ctx.Process(target=role, args=("giver", n, chunk, mode, ready_g, go, freed, results), daemon=True)]
    procs[0].start()
    try:
        return exchange(procs, ctx, (n, chunk, mode), (ready_g, go, freed, results))
    finally:
        stop(procs)


def exchange(procs, ctx, shape, shared):
    (n, chunk, mode), (ready_g, go, freed, results) = shape, shared
    ready_t = ctx.Event()

    def wait_ready(event, proc, who):
        deadline = time.monotonic() + 300
        while not event.wait(1):
            if not proc.is_alive() or time.monotonic() > deadline:
                failed = gather(results, [proc], 1, 2)
                raise RuntimeError(failed[0]["error"] if failed else f"the {who} did not get ready")

    wait_ready(ready_g, procs[0], "giver")
    procs.append(ctx.Process(target=role, args=("taker", n, chunk, mode, ready_t, go, freed, results),
                             daemon=True))
    procs[1].start()
    wait_ready(ready_t, procs[1], "taker")
    go.set()
    return {r["role"]: r for r in gather(results, procs, 2, 120)}


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    total = int(float(sys.argv[1]) * GIB) if len(sys.argv) > 1 else 16 * GIB
    chunk = int(sys.argv[2]) * MIB if len(sys.argv) > 2 else GIB
    modes = sys.argv[3].split() if len(sys.argv) > 3 else MODES
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"unknown mode(s) {unknown}; known: {MODES}")
    n = max(1, total // chunk)
    rows = []
    for mode in modes:
        try:
            got = run_mode(mode, n, chunk)
            rows.append({"mode": mode, **{f"{role}_{k}": v for role, r in got.items() for k, v in r.items()
                                          if k != "role"}})
        except Exception as e:  # noqa: BLE001 - reported in the table, the next mode still runs
            rows.append({"mode": mode, "error": f"{type(e).__name__}: {e}"})
    print("RESULT " + json.dumps({"total_gib": n * chunk / GIB, "chunk_mib": chunk // MIB, "rows": rows}))
    print(f"{n} chunks of {chunk // MIB} MiB each way")
    print("| mode | giver out GB/s | taker in GB/s | taker's waits for memory | creating s |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | {r['error']} | | | |")
            continue
        rate = lambda role: r.get(f"{role}_error") or f"{r.get(f'{role}_gbps', 0):.1f}"  # noqa: E731
        print(f"| {r['mode']} | {rate('giver')} | {rate('taker')} | "
              f"{r.get('taker_memory_waits', '-')} | {r.get('taker_creating_s', '-')} |")


if __name__ == "__main__":
    main()
