"""What the host-memory probes share (host_staging_bench.py, pin_sizes.py, shared_staging.py,
shared_register_busy.py):
libc's mapping calls typed for ctypes, their flags, and the CUresult check. Imported from the
scripts' own directory (`python3 tests/gpu/X.py` puts it on the path)."""
import ctypes
import os

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
