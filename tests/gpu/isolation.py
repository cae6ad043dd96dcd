"""Workloads for tests/gpu/isolation.sh (fault isolation under libvgpu_cuda.so, issue 3).

  worker --times FILE --stop FILE [--gib G]
        a bystander tenant: holds G GiB, then checked fp32 matmuls (small integers, so every
        product is exact and must equal the float64 reference) until FILE --stop exists; writes
        the completion time of every checked iteration (and of every mismatch) to --times
  victim --mode illegal|abort|kill|none --limit BYTES [--gib G] [--after S]
        the tenant that crashes: first allocates its whole quota (BYTES) in one tensor (that is
        how the crash before it is shown to have been credited back), frees it, then holds G GiB
        and runs checked matmuls; after S seconds it waits for its own compute turn and then
          illegal: launches a kernel that stores through a null pointer (PTX loaded with the
                   driver API through ctypes; CUDA_ERROR_ILLEGAL_ADDRESS), then synchronizes
          abort:   queues matmuls and calls os.abort()
          kill:    keeps looping (the script's `killer` sends SIGKILL)
          none:    exits after the quota check
  killer --pid P --tenant NAME --shm DIR [--timeout S]
        waits until tenant NAME holds the turn on the GPU (read from the schedule file
        $DIR/<uuid>.compute) and then sends SIGKILL to P
  analyze --logs DIR --window S
        reads what the runs left in DIR and writes DIR/results.tsv

Every subcommand prints `RESULT {json}` last; markers (RUNNING, QUOTA, CRASH, FAULT, KILLED) are
one line each. Times are time.time() (wall clock, common to all processes); turn times in the
schedule file are CLOCK_MONOTONIC microseconds.
"""

import argparse
import ctypes
import glob
import json
import mmap
import os
import signal
import struct
import sys
import time

GIB = 1 << 30
N = 2048

# The schedule file's layout (nodeagent/interposer/src/compute.rs, version 1).
HEADER_BYTES = 80
TENANT_BYTES = 112
TENANTS = 32
OFF_QUANTUM_US = 20
OFF_TURN = 24
TENANT_NAME_OFF = 48
PHASE_LIVE = 3


def emit(tag, **fields):
    fields.setdefault("pid", os.getpid())
    print(f"{tag} " + json.dumps(fields), flush=True)


# ---------------------------------------------------------------- the schedule file


class Schedule:
    """Read-only view of $VGPU_SHM_DIR/<uuid>.compute."""

    def __init__(self, shm_dir):
        paths = glob.glob(os.path.join(shm_dir, "*.compute"))
        if not paths:
            raise FileNotFoundError(f"no schedule file in {shm_dir}")
        fd = os.open(paths[0], os.O_RDONLY)
        try:
            self.map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.path = paths[0]

    def u32(self, off):
        return struct.unpack_from("<I", self.map, off)[0]

    def u64(self, off):
        return struct.unpack_from("<Q", self.map, off)[0]

    def tenant_index(self, name):
        for i in range(TENANTS):
            base = HEADER_BYTES + i * TENANT_BYTES
            if self.u64(base) >> 32 != PHASE_LIVE:
                continue
            raw = bytes(self.map[base + TENANT_NAME_OFF : base + TENANT_BYTES]).rstrip(b"\0")
            if raw == name.encode():
                return i
        return None

    def turn(self):
        """(owner index, µs since the turn started, quantum µs)."""
        word = self.u64(OFF_TURN)
        owner, start_us = word >> 56, word & ((1 << 56) - 1)
        now_us = (time.monotonic_ns() // 1000) & ((1 << 56) - 1)
        return owner, now_us - start_us, self.u32(OFF_QUANTUM_US)

    def used_ns(self):
        out = {}
        for i in range(TENANTS):
            base = HEADER_BYTES + i * TENANT_BYTES
            if self.u64(base) >> 32 != PHASE_LIVE:
                continue
            name = bytes(self.map[base + TENANT_NAME_OFF : base + TENANT_BYTES]).rstrip(b"\0")
            out[name.decode(errors="replace")] = self.u64(base + 32)
        return out


def find_schedule(shm_dir, name, timeout=10.0):
    deadline = time.time() + timeout
    while True:
        try:
            sched = Schedule(shm_dir)
            index = sched.tenant_index(name)
            if index is not None:
                return sched, index
        except (FileNotFoundError, ValueError):
            pass
        if time.time() > deadline:
            return None, None
        time.sleep(0.01)


# ---------------------------------------------------------------- checked matmuls


def checked_setup(seed):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randint(-4, 5, (N, N), generator=g, dtype=torch.float32)
    b = torch.randint(-4, 5, (N, N), generator=g, dtype=torch.float32)
    # |entries| <= 4, N = 2048: every partial sum is an integer below 2^24, so fp32 is exact.
    reference = (a.double() @ b.double()).float().cuda()
    return a.cuda(), b.cuda(), reference


def worker(args):
    import torch

    ballast = torch.full((int(args.gib * GIB),), 7, dtype=torch.uint8, device="cuda")
    a, b, reference = checked_setup(1)
    torch.cuda.synchronize()
    emit("RUNNING")
    times, bad_times = [], []
    error = None
    deadline = time.time() + args.max_seconds
    try:
        while time.time() < deadline:
            c = a @ b
            ok = torch.equal(c, reference)  # synchronizes
            now = time.time()
            times.append(now)
            if not ok:
                bad_times.append(now)
            if len(times) % 64 == 0 and os.path.exists(args.stop):
                break
        if int(ballast[:: 1 << 20].min()) != 7:
            bad_times.append(time.time())
    except Exception as e:  # the run continues to report what it saw
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    with open(args.times, "w") as f:
        json.dump({"times": times, "mismatch_times": bad_times}, f)
    emit("RESULT", ok=error is None and not bad_times and len(times) > 0,
         iterations=len(times), mismatches=len(bad_times), error=error)


PTX_NULL_STORE = b"""
.version 8.0
.target sm_90
.address_size 64

.visible .entry null_store(
    .param .u64 null_store_param_0
)
{
    .reg .b32 %r<3>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [null_store_param_0];
    cvta.to.global.u64 %rd2, %rd1;
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd4, %rd2, %rd3;
    st.global.u32 [%rd4], %r1;
    ret;
}
\0"""


def launch_illegal_store():
    """Launches a kernel that stores through address 0 on the legacy default stream; returns
    how (driver API through ctypes, or CuPy if that fails)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
    cuda.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                         ctypes.c_char_p]
    cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    r = cuda.cuModuleLoadData(ctypes.byref(module), PTX_NULL_STORE)
    if r == 0:
        r = cuda.cuModuleGetFunction(ctypes.byref(function), module, b"null_store")
    if r == 0:
        pointer = ctypes.c_uint64(0)
        params = (ctypes.c_void_p * 1)(ctypes.addressof(pointer))
        r = cuda.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, None, params, None)
    if r == 0:
        return "ctypes cuLaunchKernel"
    print(f"driver API path failed with CUresult {r}; trying CuPy", flush=True)
    import cupy

    kernel = cupy.RawKernel(
        r'extern "C" __global__ void null_store(unsigned int* p) { p[threadIdx.x] = 1u; }',
        "null_store")
    kernel((1,), (32,), (cupy.uint64(0),))
    return f"cupy RawKernel (driver path CUresult {r})"


def victim(args):
    import torch

    # 1. The whole quota in one tensor: fails if a crashed predecessor was not credited back.
    t0 = time.time()
    free, total = torch.cuda.mem_get_info()
    quota_ok, error = False, None
    try:
        t = torch.empty(args.limit, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        torch.cuda.synchronize()
        quota_ok = True
        del t
    except Exception as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    torch.cuda.empty_cache()
    emit("QUOTA", ok=quota_ok, bytes=args.limit, free_before=free, total=total, t=time.time(),
         started=t0, error=error)
    if args.mode == "none":
        emit("RESULT", ok=quota_ok)
        return
    # 2. Hold memory and compute like a real tenant.
    ballast = torch.full((int(args.gib * GIB),), 3, dtype=torch.uint8, device="cuda")
    a, b, reference = checked_setup(2)
    torch.cuda.synchronize()
    emit("VICTIM_RUNNING", held=ballast.numel())
    shm = os.environ.get("VGPU_SHM_DIR", "/dev/shm/vgpu")
    tenant = os.environ.get("VGPU_TENANT", "")
    start, iterations, mismatches = time.time(), 0, 0
    while time.time() - start < args.after or args.mode == "kill":
        c = a @ b
        mismatches += 0 if torch.equal(c, reference) else 1
        iterations += 1
    emit("LOOPED", iterations=iterations, mismatches=mismatches)
    # 3. Crash inside its own turn, with work queued.
    sched, index = find_schedule(shm, tenant, timeout=2.0)
    in_turn, elapsed_us = False, None
    deadline = time.time() + 5.0
    while sched is not None and time.time() < deadline:
        c = a @ b  # gated: returns once it is our turn
        owner, elapsed_us, quantum_us = sched.turn()
        if owner == index and elapsed_us < quantum_us // 2:
            in_turn = True
            break
        torch.cuda.synchronize()
    for _ in range(4):
        c = a @ b
    if args.mode == "illegal":
        how = launch_illegal_store()
        for _ in range(2):
            c = a @ b
        emit("CRASH", mode=args.mode, t=time.time(), in_turn=in_turn, turn_elapsed_us=elapsed_us,
             how=how)
        try:
            torch.cuda.synchronize()
            emit("FAULT", error=None)
        except Exception as e:
            emit("FAULT", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        os._exit(1)
    if args.mode == "abort":
        emit("CRASH", mode=args.mode, t=time.time(), in_turn=in_turn, turn_elapsed_us=elapsed_us)
        os.abort()
    raise SystemExit(f"unknown mode {args.mode}")


def killer(args):
    sched, index = find_schedule(args.shm, args.tenant, timeout=args.timeout)
    in_turn, elapsed_us = False, None
    deadline = time.time() + args.timeout
    while sched is not None and time.time() < deadline:
        owner, elapsed_us, quantum_us = sched.turn()
        # Well inside the turn: its processes have launched work and hold the GPU.
        if owner == index and 1000 <= elapsed_us < quantum_us // 2:
            in_turn = True
            break
        time.sleep(0.0001)
    os.kill(args.pid, signal.SIGKILL)
    emit("KILLED", t=time.time(), target=args.pid, in_turn=in_turn, turn_elapsed_us=elapsed_us,
         schedule=sched.path if sched else None)


# ---------------------------------------------------------------- analysis (no GPU)


def read_markers(path):
    markers = {}
    try:
        with open(path, errors="replace") as f:
            for line in f:
                tag, _, rest = line.strip().partition(" ")
                if tag.isupper() and rest.startswith("{"):
                    try:
                        markers[tag] = json.loads(rest)
                    except json.JSONDecodeError:
                        pass
    except FileNotFoundError:
        pass
    return markers


def stall(times, crash, window, run_end):
    """Longest stretch without a completed iteration from the last completion before `crash`
    to crash + window (the stretch still open at the end of the window counts); and how many
    iterations completed in the window."""
    import bisect

    i = bisect.bisect_right(times, crash)
    end = min(crash + window, run_end)
    j = bisect.bisect_right(times, end)
    points = ([times[i - 1]] if i > 0 else [crash]) + times[i:j]
    gaps = [b - a for a, b in zip(points, points[1:])]
    gaps.append(end - points[-1])
    return max(gaps), j - i


def baseline_gap(times, crash, window):
    import bisect

    i = bisect.bisect_left(times, crash - window)
    j = bisect.bisect_right(times, crash)
    seg = times[i:j]
    return max((b - a for a, b in zip(seg, seg[1:])), default=float("nan"))


def analyze(args):
    d = args.logs
    bystanders = {}
    for name in ("a", "b"):
        try:
            with open(os.path.join(d, f"{name}_times.json")) as f:
                bystanders[name] = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            bystanders[name] = {"times": [], "mismatch_times": []}
        bystanders[name]["result"] = read_markers(os.path.join(d, f"tenant_{name}.log")).get(
            "RESULT", {})
    events = []
    with open(os.path.join(d, "events.tsv")) as f:
        for line in f:
            kind, rc, vlog, klog, nextlog = line.rstrip("\n").split("\t")
            events.append((kind, int(rc), vlog, klog, nextlog))
    rows = []
    bound_ms = args.bound * 1000
    for kind, rc, vlog, klog, nextlog in events:
        v = read_markers(os.path.join(d, vlog))
        k = read_markers(os.path.join(d, klog)) if klog != "-" else {}
        crash = (k.get("KILLED") or v.get("CRASH") or {}).get("t")
        in_turn = (k.get("KILLED") or v.get("CRASH") or {}).get("in_turn")
        if kind == "illegal":
            err = (v.get("FAULT") or {}).get("error") or ""
            crashed = "illegal memory access" in err
            how = f"CUDA_ERROR_ILLEGAL_ADDRESS seen: {crashed}, exit {rc}"
        elif kind == "abort":
            crashed = rc == 134
            how = f"exit {rc} (SIGABRT = 134)"
        else:
            crashed = rc == 137
            how = f"exit {rc} (SIGKILL = 137)"
        label = f"{kind}: {how}; in V's turn: {in_turn}"
        if crash is None:
            rows.append((label, "no crash time recorded", "-", "-", "FAIL"))
            continue
        correct, stalls, ok = [], [], crashed
        for name, data in bystanders.items():
            times = data["times"]
            run_end = times[-1] if times else crash
            worst, done = stall(times, crash, args.window, max(run_end, crash + args.window))
            before = baseline_gap(times, crash, args.window)
            bad_after = sum(1 for t in data["mismatch_times"] if t >= crash)
            later = sum(1 for t in times if t > crash + args.window)
            progressed = done > 0 and later > 0
            correct.append(f"{name.upper()}: {done} iters in {args.window:g} s, {bad_after} bad")
            stalls.append(f"{name.upper()} {worst * 1000:.0f} (before {before * 1000:.0f})")
            ok = ok and progressed and bad_after == 0 and worst * 1000 <= bound_ms
        q = read_markers(os.path.join(d, nextlog)).get("QUOTA", {})
        credited = bool(q.get("ok"))
        mem = (f"V' got {q.get('bytes', 0) / GIB:.0f} GiB (free {q.get('free_before', 0) / GIB:.2f})"
               f" {q.get('t', crash) - crash:.1f} s after" if credited
               else f"V' refused: {q.get('error')}")
        ok = ok and credited
        rows.append((label, "; ".join(correct), " / ".join(stalls), mem,
                     "PASS" if ok else "FAIL"))
    final = []
    for name, data in bystanders.items():
        r = data["result"]
        final.append(f"{name.upper()}: ok={r.get('ok')}, {r.get('iterations')} iters, "
                     f"{r.get('mismatches')} bad")
    all_ok = all(bool(data["result"].get("ok")) for data in bystanders.values())
    rows.append(("bystanders at the end (whole run)", "; ".join(final), "-", "-",
                 "PASS" if all_ok else "FAIL"))
    with open(os.path.join(d, "results.tsv"), "w") as f:
        for row in rows:
            f.write("\t".join(str(c).replace("\t", " ") for c in row) + "\n")
    emit("RESULT", ok=all(r[-1] == "PASS" for r in rows), rows=len(rows))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--times", required=True)
    w.add_argument("--stop", required=True)
    w.add_argument("--gib", type=float, default=2.0)
    w.add_argument("--max-seconds", type=float, default=240.0)
    v = sub.add_parser("victim")
    v.add_argument("--mode", choices=["illegal", "abort", "kill", "none"], required=True)
    v.add_argument("--limit", type=int, required=True)
    v.add_argument("--gib", type=float, default=4.0)
    v.add_argument("--after", type=float, default=1.5)
    k = sub.add_parser("killer")
    k.add_argument("--pid", type=int, required=True)
    k.add_argument("--tenant", required=True)
    k.add_argument("--shm", required=True)
    k.add_argument("--timeout", type=float, default=5.0)
    an = sub.add_parser("analyze")
    an.add_argument("--logs", required=True)
    an.add_argument("--window", type=float, default=3.0)
    an.add_argument("--bound", type=float, default=2.0)
    args = p.parse_args()
    {"worker": worker, "victim": victim, "killer": killer, "analyze": analyze}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
