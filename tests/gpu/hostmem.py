"""What the host-memory probes share (host_staging_bench.py, pin_sizes.py, shared_staging.py,
shared_register_busy.py, exchange_probe.py):
libc's mapping calls typed for ctypes, their flags, the CUresult check, the driver with device 0's primary context (`cuda`), mapping a shared file
(`map_file`), touching pages from several threads (`touch`), and of probe processes: a failure
reported as a row (`reported`), gathering the results (`gather`), stopping them (`stop`). Imported
from the
scripts' own directory (`python3 tests/gpu/X.py` puts it on the path)."""
import ctypes
import os
import threading
import time

GIB = 1 << 30
MIB = 1 << 20
MAP_SHARED, MAP_PRIVATE, MAP_ANONYMOUS = 0x01, 0x02, 0x20
PROT_RW = 0x1 | 0x2
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
CU_MEMHOSTALLOC_PORTABLE = 1
CU_MEMHOSTREGISTER_PORTABLE = 1

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.memset.restype = ctypes.c_void_p
libc.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
libc.memmove.restype = ctypes.c_void_p


def check(rc, what):
    """Raises on a CUresult other than CUDA_SUCCESS."""
    if rc != 0:
        raise RuntimeError(f"{what}: CUresult {rc}")


def map_file(path, size):
    """The whole file at `path` mapped shared, read-write; raises OSError when mmap fails."""
    fd = os.open(path, os.O_RDWR)
    try:
        p = libc.mmap(None, size, PROT_RW, MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if p in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of the shared file")
    return p


def touch(p, size, threads=8):
    """Writes every page of `size` bytes at `p` (faults them in) from `threads` threads."""
    step = (size + threads - 1) // threads
    ts = [threading.Thread(target=libc.memset, args=(p + o, 1, min(step, size - o))) for o in range(0, size, step)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def gather(results, procs, count, seconds):
    """Up to `count` items from the multiprocessing queue `results` within `seconds`, sooner when
    every process of `procs` has ended."""
    deadline = time.monotonic() + seconds
    got = []
    while len(got) < count and time.monotonic() < deadline:
        try:
            got.append(results.get(timeout=1))
        except Exception:
            if not any(pr.is_alive() for pr in procs):
                break
    return got


def cuda():
    """The driver (libcuda.so.1) with the probes' calls typed, and device 0's primary context made
    current on this thread: (cu, ctx)."""
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    cu.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    cu.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    cu.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    cu.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
    cu.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    cu.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    ctx, dev = ctypes.c_void_p(), ctypes.c_int()
    check(cu.cuInit(0), "cuInit")
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return cu, ctx


def reported(run, index, *args):
    """A probe process's body, `run(index, *args)` (`args` ending with the barrier and the
    results queue): a failure is put in the results as its row and breaks the barrier, so the
    other processes stop too."""
    barrier, results = args[-2], args[-1]
    try:
        run(index, *args)
    except Exception as e:  # noqa: BLE001 - reported, not swallowed
        barrier.abort()
        results.put({"proc": index, "error": f"{type(e).__name__}: {e}"})


def stop(procs, path=None):
    """Every probe process of `procs` ended (each waited for 10 s, then killed) and the shared
    file at `path` removed: a probe's exit path on any outcome."""
    for pr in procs:
        pr.join(10)
        if pr.is_alive():
            pr.kill()
            pr.join(5)
    if path and os.path.exists(path):
        os.unlink(path)
