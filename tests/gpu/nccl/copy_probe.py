"""What one GPU-to-GPU copy costs through the raw CUDA driver, the way libvgpu_nccl.so copies.

The plugin's same-host path moves each NCCL step (1 MiB at NCCL's defaults) with one
cuMemcpyAsync from the sender's GPU into the receiver's cuMem buffer, issued from a CUDA context
of the plugin's own on a stream of its own, and polls an event until it is done. Its close-time
log says a step's copy takes 33-57 us from hand-off to completion, while the bytes need ~4 us of
NVLink. ce_probe.py timed PyTorch's cross-device copy, whose own event waits add to every copy;
this probe calls the driver through ctypes, so the timed path holds only:
  issue (cuMemcpyAsync or cuLaunchKernel), cuEventRecord, cuEventQuery until done.

Rows, each per size (256 KiB, 1 MiB, 4 MiB, 16 MiB), GPU 0 copying into GPU 1's memory:
  ce/primary    copy engine, from GPU 0's primary context (where the application's work runs)
  ce/own        copy engine, from a context of its own on GPU 0 (the plugin's copy worker)
  sm/primary    an SM copy kernel (PTX, JIT-compiled by the driver), 16-byte loads and stores
  sm/own        the same kernel from the context of its own
  ce/pipelined  8 copies back to back on one stream, then one wait: per-copy cost once the
                fixed part overlaps
  ce/streams    1 MiB on each of 1, 2, 4, 8 streams at once: do copy engines run side by side?
Buffers are cuMem allocations (what NCCL uses by default), mapped for both GPUs.

Run on a machine with two GPUs (no PyTorch needed):
    python3 tests/gpu/nccl/copy_probe.py [--json out.jsonl] [--reps 300]
Prints a table last. Exits non-zero if a copy's data is wrong.
"""
import argparse
import ctypes
import json
import time

CU = ctypes.CDLL("libcuda.so.1")
NOT_READY = 600

# the copy kernel: dst[i] = src[i] for n16 16-byte elements, grid-stride loop
PTX = rb"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry vgpu_copy(
    .param .u64 p_dst,
    .param .u64 p_src,
    .param .u64 p_n16
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<5>;
    .reg .b64 %d<10>;
    .reg .b32 %v<4>;

    ld.param.u64 %d1, [p_dst];
    ld.param.u64 %d2, [p_src];
    ld.param.u64 %d3, [p_n16];
    cvta.to.global.u64 %d1, %d1;
    cvta.to.global.u64 %d2, %d2;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %d4, %r1, %r2;
    cvt.u64.u32 %d5, %r3;
    add.u64 %d4, %d4, %d5;
    mul.wide.u32 %d6, %r4, %r2;
LOOP:
    setp.ge.u64 %p1, %d4, %d3;
    @%p1 bra DONE;
    shl.b64 %d7, %d4, 4;
    add.u64 %d8, %d2, %d7;
    ld.global.nc.v4.u32 {%v0, %v1, %v2, %v3}, [%d8];
    add.u64 %d9, %d1, %d7;
    st.global.v4.u32 [%d9], {%v0, %v1, %v2, %v3};
    add.u64 %d4, %d4, %d6;
    bra LOOP;
DONE:
    ret;
}
"""


def ck(result, what):
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA error {result}")


class Prop(ctypes.Structure):
    """CUmemAllocationProp (cuda.h): pinned device memory, no shareable handle."""
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("win32", ctypes.c_void_p), ("compression", ctypes.c_ubyte),
                ("gdr", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class Access(ctypes.Structure):
    """CUmemAccessDesc: read-write for one device."""
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


def vmm_alloc(device, size, devices):
    """A cuMem allocation on `device`, mapped read-write for every device in `devices`."""
    prop = Prop(type=1, handle_types=0, loc_type=1, loc_id=device)
    gran = ctypes.c_size_t()
    ck(CU.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0), "granularity")
    size = (size + gran.value - 1) // gran.value * gran.value
    handle = ctypes.c_uint64()
    ck(CU.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                      ctypes.c_uint64(0)), "cuMemCreate")
    ptr = ctypes.c_uint64()
    ck(CU.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                              ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
    ck(CU.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_uint64(0)),
       "cuMemMap")
    descs = (Access * len(devices))(*[Access(1, d, 3) for d in devices])
    ck(CU.cuMemSetAccess(ptr, ctypes.c_size_t(size), descs, ctypes.c_size_t(len(devices))),
       "cuMemSetAccess")
    return ptr.value


class Ctx:
    """One context on GPU 0 with its streams, events and (if the PTX loads) the copy kernel."""

    def __init__(self, ctx, streams=8):
        self.ctx = ctx
        ck(CU.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.streams = []
        for _ in range(streams):
            s = ctypes.c_void_p()
            ck(CU.cuStreamCreate(ctypes.byref(s), 1), "cuStreamCreate")  # non-blocking
            self.streams.append(s)
        self.events = []
        for _ in range(16):
            e = ctypes.c_void_p()
            ck(CU.cuEventCreate(ctypes.byref(e), 2), "cuEventCreate")  # disable timing
            self.events.append(e)
        self.kernel = None
        self.kernel_error = ""
        module = ctypes.c_void_p()
        r = CU.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(PTX))
        if r != 0:
            self.kernel_error = f"PTX not loaded (CUDA error {r})"
            return
        fn = ctypes.c_void_p()
        r = CU.cuModuleGetFunction(ctypes.byref(fn), module, b"vgpu_copy")
        if r != 0:
            self.kernel_error = f"kernel not found (CUDA error {r})"
            return
        self.kernel = fn

    def copy(self, dst, src, size, stream, sm_ctas=0):
        if sm_ctas:
            n16 = size // 16
            args = [ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_uint64(n16)]
            params = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
            ck(CU.cuLaunchKernel(self.kernel, sm_ctas, 1, 1, 512, 1, 1, 0, stream, params, None),
               "cuLaunchKernel")
        else:
            ck(CU.cuMemcpyAsync(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(size),
                                stream), "cuMemcpyAsync")

    def wait(self, event):
        while True:
            r = CU.cuEventQuery(event)
            if r == 0:
                return
            if r != NOT_READY:
                ck(r, "cuEventQuery")


def one_at_a_time(c, dst, src, size, reps, sm_ctas=0):
    s, e = c.streams[0], c.events[0]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        c.copy(dst, src, size, s, sm_ctas)
        ck(CU.cuEventRecord(e, s), "cuEventRecord")
        c.wait(e)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


def pipelined(c, dst, src, size, reps, depth=8):
    s, e = c.streams[0], c.events[0]
    times = []
    for _ in range(reps // depth + 1):
        t0 = time.perf_counter()
        for i in range(depth):
            c.copy(dst + i * size, src + i * size, size, s)
        ck(CU.cuEventRecord(e, s), "cuEventRecord")
        c.wait(e)
        times.append((time.perf_counter() - t0) / depth)
    times.sort()
    return times[len(times) // 2] * 1e6


def streams_at_once(c, dst, src, size, n, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(n):
            c.copy(dst + i * size, src + i * size, size, c.streams[i])
            ck(CU.cuEventRecord(c.events[i], c.streams[i]), "cuEventRecord")
        for i in range(n):
            c.wait(c.events[i])
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def check(c, dst, src, pattern, sm_ctas):
    """Clear the destination, copy `pattern` (already at `src`) through this path, read it back."""
    size = len(pattern)
    ck(CU.cuCtxSetCurrent(c.ctx), "cuCtxSetCurrent")
    ck(CU.cuMemsetD8_v2(ctypes.c_uint64(dst), 0, ctypes.c_size_t(size)), "cuMemsetD8")
    ck(CU.cuCtxSynchronize(), "cuCtxSynchronize")
    c.copy(dst, src, size, c.streams[0], sm_ctas)
    ck(CU.cuEventRecord(c.events[0], c.streams[0]), "cuEventRecord")
    c.wait(c.events[0])
    back = (ctypes.c_ubyte * size)()
    ck(CU.cuMemcpyDtoH_v2(back, ctypes.c_uint64(dst), ctypes.c_size_t(size)), "cuMemcpyDtoH")
    return bytes(back) == pattern


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--ctas", type=int, default=32, help="CTAs of the SM copy kernel (512 threads each)")
    a = p.parse_args()
    ck(CU.cuInit(0), "cuInit")
    n = ctypes.c_int()
    ck(CU.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
    if n.value < 2:
        raise SystemExit("needs two GPUs")
    prim = []
    for d in (0, 1):
        ctx = ctypes.c_void_p()
        ck(CU.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d), "cuDevicePrimaryCtxRetain")
        prim.append(ctx)
    total = 128 << 20
    ck(CU.cuCtxSetCurrent(prim[1]), "cuCtxSetCurrent")
    dst = vmm_alloc(1, total, [0, 1])
    ck(CU.cuCtxSetCurrent(prim[0]), "cuCtxSetCurrent")
    src = vmm_alloc(0, total, [0, 1])
    pattern = bytes(range(256)) * ((16 << 20) // 256)
    host = ctypes.create_string_buffer(pattern, len(pattern))
    ck(CU.cuMemcpyHtoD_v2(ctypes.c_uint64(src), host, ctypes.c_size_t(len(pattern))), "cuMemcpyHtoD")
    contexts = {"primary": Ctx(prim[0])}
    own = ctypes.c_void_p()
    ck(CU.cuCtxCreate_v2(ctypes.byref(own), 0, 0), "cuCtxCreate")
    contexts["own"] = Ctx(own)
    rows = []
    sizes = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
    for name, c in contexts.items():
        ck(CU.cuCtxSetCurrent(c.ctx), "cuCtxSetCurrent")
        for mode in ("ce", "sm"):
            if mode == "sm" and c.kernel is None:
                rows.append({"probe": f"sm/{name}", "error": c.kernel_error})
                continue
            ctas = a.ctas if mode == "sm" else 0
            for size in sizes:
                one_at_a_time(c, dst, src, size, 20, ctas)  # warm-up
                p50, p99 = one_at_a_time(c, dst, src, size, a.reps, ctas)
                rows.append({"probe": f"{mode}/{name}", "bytes": size, "p50_us": p50, "p99_us": p99})
            if not check(c, dst, src, pattern, ctas):
                raise SystemExit(f"{mode}/{name}: copied data differs")
    c = contexts["own"]
    ck(CU.cuCtxSetCurrent(c.ctx), "cuCtxSetCurrent")
    for size in (1 << 20, 4 << 20):
        rows.append({"probe": "ce/pipelined", "bytes": size, "p50_us": pipelined(c, dst, src, size, a.reps)})
    for k in (1, 2, 4, 8):
        rows.append({"probe": "ce/streams", "streams": k, "bytes": 1 << 20,
                     "p50_us": streams_at_once(c, dst, src, 1 << 20, k, a.reps)})
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"| probe | setting | median us | p99 us | GB/s |  (SM kernel: {a.ctas} CTAs x 512 threads)")
    print("| --- | --- | --: | --: | --: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['probe']} | - | {r['error']} | | |")
        elif r["probe"] == "ce/streams":
            gbs = r["streams"] * r["bytes"] / r["p50_us"] / 1e3
            print(f"| {r['probe']} | {r['streams']} x 1 MiB at once | {r['p50_us']:.1f} | | {gbs:.1f} |")
        else:
            p99 = f"{r['p99_us']:.1f}" if "p99_us" in r else ""
            gbs = r["bytes"] / r["p50_us"] / 1e3
            print(f"| {r['probe']} | {r['bytes'] >> 10} KiB | {r['p50_us']:.1f} | {p99} | {gbs:.1f} |")


if __name__ == "__main__":
    main()
