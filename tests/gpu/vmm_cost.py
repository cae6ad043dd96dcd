#!/usr/bin/env python3
"""Issue 17 (elastic memory), the first risk of docs/design/elastic-memory.md: what a borrowed
allocation costs when the interposer backs it with the driver's virtual memory management
(cuMemAddressReserve + cuMemCreate + cuMemMap + cuMemSetAccess) instead of cuMemAlloc, and
whether a swap keeps an allocation's address and contents: copy out to pinned host memory,
unmap and release the physical memory, create and map new memory at the same address, copy
back, compare.

Raw driver calls through ctypes (no PyTorch), on GPU 0's primary context. Prints one table per
part; `--json` writes every number. Never allocates more than `--max-gib` (default 8) at once.
"""

import argparse
import ctypes
import json
import statistics
import time

CU = ctypes.CDLL("libcuda.so.1")
for name in ("cuMemAlloc_v2", "cuMemFree_v2", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2",
             "cuMemsetD32_v2", "cuMemGetInfo_v2"):
    getattr(CU, name)
CU.cuMemAddressReserve.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t,
                                   ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64]
CU.cuMemAddressFree.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
CU.cuMemCreate.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_uint64]
CU.cuMemRelease.argtypes = [ctypes.c_uint64]
CU.cuMemMap.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64,
                        ctypes.c_uint64]
CU.cuMemUnmap.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
CU.cuMemSetAccess.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
CU.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
CU.cuMemFree_v2.argtypes = [ctypes.c_uint64]
CU.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
CU.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
CU.cuMemsetD32_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t]
CU.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
CU.cuMemFreeHost.argtypes = [ctypes.c_void_p]
CU.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]


def ck(result, what):
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA error {result}")


class Prop(ctypes.Structure):
    """CUmemAllocationProp (cuda.h): pinned device memory on one GPU, no shareable handle."""
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("win32", ctypes.c_void_p), ("compression", ctypes.c_ubyte),
                ("gdr", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class Access(ctypes.Structure):
    """CUmemAccessDesc: read-write for one device."""
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


PROP = Prop(type=1, handle_types=0, loc_type=1, loc_id=0)
ACCESS = Access(1, 0, 3)


def granularity():
    gran = ctypes.c_size_t()
    ck(CU.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(PROP), 0),
       "cuMemGetAllocationGranularity")
    return gran.value


def physical(size):
    handle = ctypes.c_uint64()
    ck(CU.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(PROP), 0), "cuMemCreate")
    return handle.value


def map_at(address, size, handle):
    ck(CU.cuMemMap(address, size, 0, handle, 0), "cuMemMap")
    ck(CU.cuMemSetAccess(address, size, ctypes.byref(ACCESS), 1), "cuMemSetAccess")


def vmm_alloc(size):
    """What the interposer would do for a borrowed cuMemAlloc: (address, handle)."""
    address = ctypes.c_uint64()
    ck(CU.cuMemAddressReserve(ctypes.byref(address), size, 0, 0, 0), "cuMemAddressReserve")
    handle = physical(size)
    map_at(address.value, size, handle)
    return address.value, handle


def vmm_free(address, handle, size):
    ck(CU.cuMemUnmap(address, size), "cuMemUnmap")
    ck(CU.cuMemRelease(handle), "cuMemRelease")
    ck(CU.cuMemAddressFree(address, size), "cuMemAddressFree")


def plain_alloc(size):
    address = ctypes.c_uint64()
    ck(CU.cuMemAlloc_v2(ctypes.byref(address), size), "cuMemAlloc")
    return address.value


def timed(fn, reps):
    """Median and p90 in microseconds of `fn()` over `reps` calls (the first is a warm-up)."""
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.9) - 1]


def alloc_costs(sizes, reps):
    rows = []
    for size in sizes:
        def plain():
            ck(CU.cuMemFree_v2(plain_alloc(size)), "cuMemFree")

        def vmm():
            address, handle = vmm_alloc(size)
            vmm_free(address, handle, size)

        def plain_alloc_only():
            address = plain_alloc(size)
            held.append(address)

        def vmm_alloc_only():
            held_vmm.append(vmm_alloc(size))

        held, held_vmm = [], []
        alloc_reps = max(3, min(reps, (4 << 30) // size))
        p_pair = timed(plain, reps)
        v_pair = timed(vmm, reps)
        p_alloc = timed(plain_alloc_only, alloc_reps)
        for address in held:
            ck(CU.cuMemFree_v2(address), "cuMemFree")
        v_alloc = timed(vmm_alloc_only, alloc_reps)
        for address, handle in held_vmm:
            vmm_free(address, handle, size)
        rows.append({"size_mib": size >> 20, "plain_alloc_free_us": p_pair,
                     "vmm_alloc_free_us": v_pair, "plain_alloc_us": p_alloc,
                     "vmm_alloc_us": v_alloc})
    return rows


def swap_round(size, host, pattern_word):
    """One swap of a `size` VMM allocation through pinned `host`: timings and whether the
    address and contents survived."""
    address, handle = vmm_alloc(size)
    words = size // 4
    ck(CU.cuMemsetD32_v2(address, pattern_word, words), "cuMemsetD32")
    # A distinct word every 1 MiB, so a chunk mapped at the wrong offset shows.
    marks = list(range(0, size, 1 << 20))
    for i, offset in enumerate(marks):
        word = ctypes.c_uint32(i * 2654435761 & 0xFFFFFFFF)
        ck(CU.cuMemcpyHtoD_v2(address + offset, ctypes.byref(word), 4), "mark")
    ck(CU.cuCtxSynchronize(), "sync")
    t0 = time.perf_counter()
    ck(CU.cuMemcpyDtoH_v2(host, address, size), "swap out copy")
    t1 = time.perf_counter()
    ck(CU.cuMemUnmap(address, size), "cuMemUnmap")
    ck(CU.cuMemRelease(handle), "cuMemRelease")
    t2 = time.perf_counter()
    free_now = ctypes.c_size_t()
    total = ctypes.c_size_t()
    ck(CU.cuMemGetInfo_v2(ctypes.byref(free_now), ctypes.byref(total)), "cuMemGetInfo")
    # Someone else could use the memory now; take new physical memory at the same address.
    handle = physical(size)
    map_at(address, size, handle)
    t3 = time.perf_counter()
    ck(CU.cuMemcpyHtoD_v2(address, host, size), "swap in copy")
    t4 = time.perf_counter()
    back = ctypes.create_string_buffer(size)
    ck(CU.cuMemcpyDtoH_v2(back, address, size), "read back")
    # ctypes.string_at takes an int size: compare in pieces below 2 GiB.
    piece = 256 << 20
    base = ctypes.addressof(back)
    same = all(ctypes.string_at(base + at, min(piece, size - at)) ==
               ctypes.string_at(host.value + at, min(piece, size - at))
               for at in range(0, size, piece))
    first_mark = int.from_bytes(ctypes.string_at(base, 4), "little")
    last = marks[-1]
    last_mark = int.from_bytes(ctypes.string_at(base + last, 4), "little")
    tail = int.from_bytes(ctypes.string_at(base + 4, 4), "little")
    intact = (same and first_mark == 0 and tail == pattern_word
              and last_mark == ((len(marks) - 1) * 2654435761 & 0xFFFFFFFF))
    vmm_free(address, handle, size)
    gb = size / 1e9
    return {"size_mib": size >> 20, "out_gbps": gb / (t1 - t0), "release_ms": (t2 - t1) * 1e3,
            "remap_ms": (t3 - t2) * 1e3, "in_gbps": gb / (t4 - t3), "same_address": True,
            "contents_intact": intact, "free_after_release_gib": free_now.value / 2**30}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default="")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--max-gib", type=float, default=8.0)
    args = parser.parse_args()
    ck(CU.cuInit(0), "cuInit")
    ctx = ctypes.c_void_p()
    ck(CU.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
    ck(CU.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    gran = granularity()
    limit = int(args.max_gib * 2**30)
    sizes = [s for s in (2 << 20, 8 << 20, 64 << 20, 512 << 20, 2 << 30) if s <= limit]
    costs = alloc_costs(sizes, args.reps)
    swap_sizes = [s for s in (64 << 20, 1 << 30, 4 << 30) if s <= limit // 2]
    host = ctypes.c_void_p()
    ck(CU.cuMemHostAlloc(ctypes.byref(host), max(swap_sizes), 0), "cuMemHostAlloc")
    swaps = [swap_round(size, host, 0x5EED0000 + i) for i, size in enumerate(swap_sizes)]
    ck(CU.cuMemFreeHost(host), "cuMemFreeHost")

    print(f"granularity {gran >> 20} MiB")
    print("| size | cuMemAlloc+Free p50/p90 us | VMM alloc+free p50/p90 us | cuMemAlloc p50 us | VMM alloc p50 us |")
    print("| --: | --: | --: | --: | --: |")
    for r in costs:
        print(f"| {r['size_mib']} MiB | {r['plain_alloc_free_us'][0]:.0f} / {r['plain_alloc_free_us'][1]:.0f} "
              f"| {r['vmm_alloc_free_us'][0]:.0f} / {r['vmm_alloc_free_us'][1]:.0f} "
              f"| {r['plain_alloc_us'][0]:.0f} | {r['vmm_alloc_us'][0]:.0f} |")
    print()
    print("| swapped | out GB/s (pinned) | unmap+release ms | create+map at same address ms | in GB/s | contents intact |")
    print("| --: | --: | --: | --: | --: | --- |")
    for r in swaps:
        print(f"| {r['size_mib']} MiB | {r['out_gbps']:.1f} | {r['release_ms']:.2f} | {r['remap_ms']:.2f} "
              f"| {r['in_gbps']:.1f} | {'yes' if r['contents_intact'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"granularity": gran, "costs": costs, "swaps": swaps}, f, indent=1)
    if not all(r["contents_intact"] for r in swaps):
        raise SystemExit("a swap lost contents")


if __name__ == "__main__":
    main()
