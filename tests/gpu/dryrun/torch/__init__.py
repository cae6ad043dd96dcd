"""A stand-in for PyTorch's few calls that tests/gpu/elastic_memory.py makes, over the CUDA
driver API through ctypes (so through the preloaded interposer and the fake driver): a dry run of
the GPU script's logic on a machine without a GPU. Tensors hold no bytes; sums are remembered."""
import ctypes
import random
import types

_lib = ctypes.CDLL("libcuda.so.1")
_lib.cuInit(0)
_ctx = ctypes.c_void_p()
_lib.cuDevicePrimaryCtxRetain(ctypes.byref(_ctx), 0)
_lib.cuCtxSetCurrent(_ctx)

uint8 = "uint8"
int64 = "int64"
float32 = "float32"
bfloat16 = "bfloat16"
_BYTES = {uint8: 1, int64: 8, float32: 4, bfloat16: 2, None: 4}


def device(name):
    return name


class OutOfMemoryError(RuntimeError):
    pass


def _mem_get_info():
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    rc = _lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    assert rc == 0, rc
    return free.value, total.value


# A caching allocator's few rules: a freed tensor's block is kept (reserved, not allocated) and
# reused by an allocation of the same size; empty_cache() frees what is kept. Enough for the hint
# helper (deploy/python/vgpu/torch.py) to give cached blocks back through the interposer.
_cache = {}  # size -> [pointer, ...]
_allocated = 0


def _cached_bytes():
    return sum(size * len(pointers) for size, pointers in _cache.items())


def _empty_cache():
    for pointers in _cache.values():
        for pointer in pointers:
            _lib.cuMemFree_v2(ctypes.c_ulonglong(pointer))
    _cache.clear()


def _malloc(n):
    kept = _cache.get(n)
    if kept:
        return kept.pop()
    pointer = ctypes.c_ulonglong()
    rc = _lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(n))
    if rc == 2:
        # As PyTorch does: free the cache and try once more.
        _empty_cache()
        rc = _lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(n))
    if rc == 2:
        raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} bytes")
    if rc != 0:
        raise RuntimeError(f"cuMemAlloc_v2: {rc}")
    return pointer.value


def _launch():
    # One kernel of 1 microsecond on the legacy stream (through the interposer's launch hook).
    rc = _lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
    if rc != 0:
        raise RuntimeError(f"CUDA error: cuLaunchKernel {rc}")


def _synchronize():
    # Through the interposer's sync hook (a step of the tenant when it launched since).
    rc = _lib.cuCtxSynchronize()
    if rc != 0:
        raise RuntimeError(f"CUDA error: cuCtxSynchronize {rc}")


cuda = types.SimpleNamespace(
    OutOfMemoryError=OutOfMemoryError,
    mem_get_info=_mem_get_info,
    synchronize=_synchronize,
    empty_cache=_empty_cache,
    device_count=lambda: 1,
    memory_allocated=lambda device=None: _allocated,
    memory_reserved=lambda device=None: _allocated + _cached_bytes(),
)


class _Scalar:
    def __init__(self, value):
        self.value = value

    def item(self):
        return self.value


class Tensor:
    def __init__(self, n, total):
        global _allocated
        self.pointer, self.n, self.total = _malloc(n), n, total
        _allocated += n

    def numel(self):
        return self.n

    def untyped_storage(self):
        # Its allocation, as PyTorch's storage is (vgpu.torch.mark_cold marks it).
        return types.SimpleNamespace(data_ptr=lambda: self.pointer, nbytes=lambda: self.n)

    def __iadd__(self, other):
        _launch()
        return self

    def copy_(self, other):
        _launch()
        return self

    def sum(self, dtype=None):
        return _Scalar(self.total)

    def split(self, size):
        # One piece: its sum is the whole tensor's (elastic_memory.py sums in pieces).
        return [self]

    def __del__(self):
        global _allocated
        _allocated -= self.n
        _cache.setdefault(self.n, []).append(self.pointer)


def _elements(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def empty(*shape, dtype=None, device=None, **_):
    # elastic_memory.py passes bytes of uint8; redistribute.py shapes of other types
    return Tensor(_elements(shape) * _BYTES[dtype] if dtype else _elements(shape), 0)


def ones(*shape, dtype=None, device=None):
    return Tensor(_elements(shape) * _BYTES[dtype], _elements(shape))


def randn(*shape, dtype=None, device=None):
    return Tensor(_elements(shape) * _BYTES[dtype], 0)


def matmul(a, b, out=None):
    _launch()
    return out


def zeros(n, dtype=None, device=None):
    return Tensor(n * 8, 0)


def randint(low, high, shape, dtype=None, device=None):
    return Tensor(shape[0], random.randrange(1 << 40))
