"""What the host-memory probes share (host_staging_bench.py, pin_sizes.py, shared_staging.py):
libc's mapping calls typed for ctypes, their flags, and the CUresult check. Imported from the
scripts' own directory (`python3 tests/gpu/X.py` puts it on the path)."""
import ctypes

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
