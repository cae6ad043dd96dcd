"""Workloads for tests/gpu/coverage.sh (issue 3, "Verified on a real GPU" item 5: CUDA graphs,
cudaMallocAsync, several streams, several processes per tenant, under libvgpu_cuda.so; the
cooperative kernels are tests/gpu/coop.cu).

Checked compute everywhere: fp32 4096^3 matmuls of small integers (|x| <= 4, so every sum is an
integer below 2^24 and fp32 is exact) compared elementwise with a float64 reference computed by
a different kernel; the number of differing elements is accumulated on the GPU.

  graph --start-at T --window W [--capture-mode global|thread_local|relaxed] [--check-only]
                                     a CUDA graph of 2 matmuls + their comparisons, captured
                                     with torch.cuda.graph (capture_error_mode as given); one
                                     replay checked from zeroed outputs (--check-only: stop
                                     there), then replays back to back (synchronizing after each)
                                     counted inside [T, T+W]; then 256 MiB chunks until OOM
  mallocasync                        (run with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)
                                     checked matmuls, 256 MiB chunks until OOM, then freed and
                                     checked matmuls again
  streams                            4 streams with their own inputs, 40 checked matmuls each,
                                     interleaved; then chunks until OOM
  mp --start-at T --window W --barrier DIR --procs N
                                     one of N processes of a tenant: eager checked matmuls
                                     counted inside [T, T+W], then chunks until OOM, all N hold
                                     their memory at a barrier (files in DIR) while the tenant's
                                     ledger is read, then exit
  schedstat --shm DIR                GPU time per tenant as the schedule file counts it (info)
  report --logs DIR                  reads the runs' logs and DIR/config.json, writes
                                     DIR/results.tsv (feature, correct, limit held, share,
                                     PASS/FAIL)

Each prints `RESULT {json}` last. T is time.monotonic() (CLOCK_MONOTONIC, common to processes).
"""

import argparse
import glob
import json
import os
import struct
import sys
import time

GIB = 1 << 30
MIB = 1 << 20
N = 4096
CHUNK_BYTES = 256 * MIB


def result(**fields):
    fields["pid"] = os.getpid()
    print("RESULT " + json.dumps(fields), flush=True)


def short(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if str(e) else type(e).__name__


def pair(seed):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randint(-4, 5, (N, N), generator=g, dtype=torch.float32).cuda()
    b = torch.randint(-4, 5, (N, N), generator=g, dtype=torch.float32).cuda()
    reference = (a.double() @ b.double()).float()
    return a, b, reference


def ledger_used(device=0):
    """Bytes charged to this tenant on `device` by all its live processes (the interposer's
    ledger $VGPU_SHM_DIR/<tenant>.mem: 152-byte header, 256 slots of 144 bytes, used_bytes[16]
    at offset 16 of a slot)."""
    path = os.path.join(os.environ.get("VGPU_SHM_DIR", "/dev/shm/vgpu"),
                        os.environ.get("VGPU_TENANT", "") + ".mem")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    total = 0
    for i in range(256):
        base = 152 + i * 144
        pid = struct.unpack_from("<I", data, base)[0]
        if pid != 0:
            total += struct.unpack_from("<Q", data, base + 16 + 8 * device)[0]
    return total


def chunks_until_oom(limit_chunks=4096):
    """Allocates 256 MiB chunks until the first failure; returns (chunks, (error type, message))
    (not the exception: its traceback would keep the chunks alive after the caller drops them)."""
    import torch

    held, error = [], None
    while len(held) < limit_chunks:
        try:
            held.append(torch.empty(CHUNK_BYTES, dtype=torch.uint8, device="cuda"))
        except Exception as e:  # torch.OutOfMemoryError expected
            error = (type(e).__name__, short(e)[:200])
            break
    return held, error


def torch_bytes():
    """What torch holds from the driver: reserved by the caching allocator, or (cudaMallocAsync
    backend) in use in its pool."""
    import torch

    try:
        if "cudaMallocAsync" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            return torch.cuda.memory_allocated()
        return torch.cuda.memory_reserved()
    except Exception as e:  # stats not available with this backend: reported, not fatal
        print(f"torch memory stats: {short(e)}", flush=True)
        return None


def limit_fields(held, error):
    import torch

    torch.cuda.synchronize()
    return {
        "oom_type": error[0] if error is not None else None,
        "oom_message": error[1] if error is not None else None,
        "chunks": len(held),
        "torch_bytes_at_oom": torch_bytes(),
        "ledger_at_oom": ledger_used(),
        "mem_get_info": list(torch.cuda.mem_get_info()),
    }


# ---------------------------------------------------------------- graphs


def graph(args):
    import torch

    pairs = [pair(1), pair(2)]
    outs = [torch.empty(N, N, device="cuda") for _ in pairs]
    bad = torch.zeros((), dtype=torch.int64, device="cuda")

    def body():
        for (a, b, ref), c in zip(pairs, outs):
            torch.matmul(a, b, out=c)
            bad.add_((c != ref).sum())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, capture_error_mode=args.capture_mode):
            body()
        torch.cuda.synchronize()
    except Exception as e:
        result(ok=False, stage="capture", capture_mode=args.capture_mode, error=short(e))
        return
    bad.zero_()
    for c in outs:
        c.zero_()
    g.replay()
    torch.cuda.synchronize()
    first_ok = all(torch.equal(c, ref) for (_, _, ref), c in zip(pairs, outs)) and int(bad) == 0
    if args.check_only:
        result(ok=first_ok, stage="replay", capture_mode=args.capture_mode, first_replay_ok=first_ok)
        return
    ready = time.monotonic()
    end = args.start_at + args.window
    done = total = 0
    error = None
    try:
        while True:  # one replay (about 6 ms) per synchronize
            g.replay()
            torch.cuda.synchronize()
            total += 1
            now = time.monotonic()
            if args.start_at <= now <= end:
                done += 1
            if now > end:
                break
    except Exception as e:
        error = short(e)
    mismatches = int(bad)
    final_ok = all(torch.equal(c, ref) for (_, _, ref), c in zip(pairs, outs))
    held, oom = chunks_until_oom()
    fields = limit_fields(held, oom)
    del held
    result(ok=error is None and first_ok and final_ok and mismatches == 0, stage="window",
           capture_mode=args.capture_mode, first_replay_ok=first_ok,
           final_ok=final_ok, mismatched_elements=mismatches, replays_in_window=done,
           replays=total, late=ready > args.start_at, error=error, **fields)


# ---------------------------------------------------------------- cudaMallocAsync


def checked_rounds(pairs, outs, rounds):
    import torch

    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(rounds):
        for (a, b, ref), c in zip(pairs, outs):
            torch.matmul(a, b, out=c)
            bad.add_((c != ref).sum())
    torch.cuda.synchronize()
    return int(bad)


def mallocasync(args):
    import torch

    backend = torch.cuda.get_allocator_backend()
    pairs = [pair(1), pair(2)]
    outs = [torch.empty(N, N, device="cuda") for _ in pairs]
    before = checked_rounds(pairs, outs, 20)
    held, oom = chunks_until_oom()
    fields = limit_fields(held, oom)
    del held
    torch.cuda.synchronize()
    error = None
    try:
        again = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        again.fill_(1)
        del again
        after = checked_rounds(pairs, outs, 20)
    except Exception as e:
        error, after = short(e), -1
    result(ok=error is None and before == 0 and after == 0 and fields["oom_type"] is not None,
           backend=backend, mismatched_before=before, mismatched_after=after,
           realloc_error=error, **fields)


# ---------------------------------------------------------------- streams


def streams(args):
    import torch

    streams = [torch.cuda.Stream() for _ in range(4)]
    pairs = [pair(10 + i) for i in range(4)]
    outs = [torch.empty(N, N, device="cuda") for _ in range(4)]
    bads = [torch.zeros((), dtype=torch.int64, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()  # inputs are ready before the side streams read them
    t0 = time.monotonic()
    for _ in range(args.rounds):
        for s, (a, b, ref), c, bad in zip(streams, pairs, outs, bads):
            with torch.cuda.stream(s):
                torch.matmul(a, b, out=c)
                bad.add_((c != ref).sum())
    torch.cuda.synchronize()
    seconds = time.monotonic() - t0
    mismatches = [int(b) for b in bads]
    final_ok = all(torch.equal(c, ref) for (_, _, ref), c in zip(pairs, outs))
    held, oom = chunks_until_oom()
    fields = limit_fields(held, oom)
    del held
    result(ok=final_ok and not any(mismatches), matmuls=4 * args.rounds,
           mismatched_per_stream=mismatches, final_ok=final_ok, seconds=round(seconds, 3),
           **fields)


# ---------------------------------------------------------------- several processes


def mp(args):
    import torch

    a, b, ref = pair(1)
    c = torch.empty(N, N, device="cuda")
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ready = time.monotonic()
    end = args.start_at + args.window
    done = 0
    while True:  # 2 matmuls (about 6 ms) per synchronize
        for _ in range(2):
            torch.matmul(a, b, out=c)
            bad.add_((c != ref).sum())
        torch.cuda.synchronize()
        now = time.monotonic()
        if args.start_at <= now <= end:
            done += 2
        if now > end:
            break
    mismatches = int(bad)
    # All N processes allocate at once, then hold until all have reached the barrier.
    held, oom = chunks_until_oom()
    fields = limit_fields(held, oom)
    os.makedirs(args.barrier, exist_ok=True)
    open(os.path.join(args.barrier, str(os.getpid())), "w").close()
    deadline = time.time() + 60
    while len(os.listdir(args.barrier)) < args.procs and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the others read the ledger while this process still holds its chunks
    fields["ledger_all_holding"] = ledger_used()
    fields["torch_bytes_holding"] = torch_bytes()
    result(ok=mismatches == 0, matmuls_in_window=done, mismatched_elements=mismatches,
           late=ready > args.start_at, **fields)
    time.sleep(1.0)
    del held


# ---------------------------------------------------------------- schedule statistics


def schedstat(args):
    paths = glob.glob(os.path.join(args.shm, "*.compute"))
    used = {}
    if paths:
        with open(paths[0], "rb") as f:
            data = f.read()
        for i in range(32):
            base = 80 + i * 112
            if struct.unpack_from("<Q", data, base)[0] >> 32 != 3:
                continue
            name = data[base + 48 : base + 112].rstrip(b"\0").decode(errors="replace")
            used[name] = struct.unpack_from("<Q", data, base + 32)[0]
    total = sum(used.values()) or 1
    result(ok=bool(used), used_ns=used,
           used_pct={k: round(100 * v / total, 1) for k, v in used.items()})


# ---------------------------------------------------------------- the table (no GPU)


def read_result(path):
    try:
        with open(path, errors="replace") as f:
            lines = [l for l in f if l.startswith("RESULT ")]
        return json.loads(lines[-1][len("RESULT "):]) if lines else {}
    except (OSError, json.JSONDecodeError):
        return {}


def gib(x):
    return f"{x / GIB:.2f}" if isinstance(x, (int, float)) else "?"


def report(args):
    d = args.logs
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    tol = cfg["tolerance_points"]
    rows = []

    def under(value, limit):
        return isinstance(value, (int, float)) and value <= limit

    def share_cell(mine, other, target):
        if not mine and not other:
            return "no work counted", False
        got = 100.0 * mine / (mine + other)
        return f"{got:.1f} (target {target}, {mine}:{other})", abs(got - target) <= tol

    def sched_cell(name):
        st = read_result(os.path.join(d, f"schedstat_{name}.log")).get("used_pct")
        return f"; schedule file: {st}" if st else ""

    # CUDA graph capture
    for name, what in (("gated", "gated launches (share 50)"),
                       ("ungated", "memory limit only, launches not gated")):
        r = read_result(os.path.join(d, f"graph_capture_{name}.log"))
        rows.append((
            f"CUDA graph capture, torch default capture_error_mode=global, {what}",
            f"{bool(r.get('ok'))}: stage {r.get('stage')}"
            f"{', first replay correct ' + str(r.get('first_replay_ok')) if r.get('stage') == 'replay' else ''}"
            f"{'; ' + str(r.get('error')) if r.get('error') else ''}",
            "-", "-", "PASS" if r.get("ok") else "FAIL"))

    # CUDA graphs
    lim = cfg["graph_limit"]
    hi, lo = (read_result(os.path.join(d, f"graph_{t}.log")) for t in ("g_hi", "g_lo"))
    correct = bool(hi.get("ok")) and bool(lo.get("ok"))
    held = all(r.get("oom_type") == "OutOfMemoryError" and under(r.get("torch_bytes_at_oom"), lim)
               and under(r.get("ledger_at_oom"), lim) for r in (hi, lo))
    share, share_ok = share_cell(hi.get("replays_in_window", 0), lo.get("replays_in_window", 0),
                                 cfg["graph_shares"][0])
    late = hi.get("late") or lo.get("late")
    rows.append((
        f"CUDA graphs, 70/30 replays (cuGraphLaunch; captured with capture_error_mode="
        f"{hi.get('capture_mode')})",
        f"{correct}: first replay from zeroed outputs {hi.get('first_replay_ok')}/"
        f"{lo.get('first_replay_ok')}, {hi.get('replays')}+{lo.get('replays')} replays, "
        f"{hi.get('mismatched_elements')}+{lo.get('mismatched_elements')} bad elements",
        f"{held}: OOM at {gib(hi.get('torch_bytes_at_oom'))}/{gib(lo.get('torch_bytes_at_oom'))}"
        f" GiB torch, ledger {gib(hi.get('ledger_at_oom'))}/{gib(lo.get('ledger_at_oom'))}"
        f" (limit {gib(lim)})",
        f"{share}{' LATE START' if late else ''}{sched_cell('graph')}",
        "PASS" if correct and held and share_ok and not late else "FAIL"))

    # cooperative kernels
    lim = cfg["coop_limit"]
    chk = read_result(os.path.join(d, "coop_check.log"))
    hi, lo = (read_result(os.path.join(d, f"coop_{t}.log")) for t in ("c_hi", "c_lo"))
    correct = bool(chk.get("ok")) and bool(hi.get("ok")) and bool(lo.get("ok"))
    held = (chk.get("total") == lim and under(chk.get("allocated"), lim)
            and chk.get("alloc_error") == "cudaErrorMemoryAllocation")
    share, share_ok = share_cell(hi.get("launches", 0), lo.get("launches", 0),
                                 cfg["coop_shares"][0])
    late = hi.get("late") or lo.get("late")
    rows.append((
        "cooperative kernels (grid.sync; cudaLaunchCooperativeKernel + cuLaunchCooperativeKernel)",
        f"{correct}: {chk.get('blocks')} blocks, bad elements runtime {chk.get('bad_runtime')} /"
        f" driver {chk.get('bad_driver')} / after OOM {chk.get('bad_after_oom')}"
        f"{'; ' + str(chk.get('error')) if chk.get('error') else ''}",
        f"{held}: cudaMemGetInfo total {gib(chk.get('total'))}, cudaMalloc got "
        f"{gib(chk.get('allocated'))} GiB then {chk.get('alloc_error')}",
        f"{share}, 4 x {hi.get('kernel_ms')} ms kernels per sync{' LATE START' if late else ''}"
        f"{sched_cell('coop')}",
        "PASS" if correct and held and share_ok and not late else "FAIL"))
    hi, lo = (read_result(os.path.join(d, f"coop_long_{t}.log")) for t in ("c_hi", "c_lo"))
    share, share_ok = share_cell(hi.get("launches", 0), lo.get("launches", 0),
                                 cfg["coop_shares"][0])
    late = hi.get("late") or lo.get("late")
    rows.append((
        "cooperative kernels, 70/30 with long synchronizes (4 x ~5 ms kernels per sync)",
        f"{bool(hi.get('ok')) and bool(lo.get('ok'))}", "-",
        f"{share}, 4 x {hi.get('kernel_ms')} ms kernels per sync{' LATE START' if late else ''}"
        f"{sched_cell('coop_long')}",
        "PASS" if share_ok and not late and hi.get("ok") and lo.get("ok") else "FAIL"))

    # cudaMallocAsync
    lim = cfg["async_limit"]
    r = read_result(os.path.join(d, "mallocasync.log"))
    correct = bool(r.get("ok")) and r.get("backend") == "cudaMallocAsync"
    held = (r.get("oom_type") == "OutOfMemoryError" and under(r.get("ledger_at_oom"), lim)
            and (r.get("torch_bytes_at_oom") is None or under(r.get("torch_bytes_at_oom"), lim)))
    rows.append((
        "cudaMallocAsync (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)",
        f"{correct}: backend {r.get('backend')}, bad elements before/after OOM "
        f"{r.get('mismatched_before')}/{r.get('mismatched_after')}"
        f"{'; ' + str(r.get('realloc_error')) if r.get('realloc_error') else ''}",
        f"{held}: {r.get('oom_type')} after {r.get('chunks')} chunks, pool in use "
        f"{gib(r.get('torch_bytes_at_oom'))} GiB, ledger {gib(r.get('ledger_at_oom'))} "
        f"(limit {gib(lim)})",
        "-",
        "PASS" if correct and held else "FAIL"))

    # several streams
    lim = cfg["streams_limit"]
    r = read_result(os.path.join(d, "streams.log"))
    correct = bool(r.get("ok"))
    held = (r.get("oom_type") == "OutOfMemoryError" and under(r.get("torch_bytes_at_oom"), lim)
            and under(r.get("ledger_at_oom"), lim))
    rows.append((
        "4 streams in one process",
        f"{correct}: {r.get('matmuls')} matmuls in {r.get('seconds')} s, bad elements per stream "
        f"{r.get('mismatched_per_stream')}",
        f"{held}: OOM at {gib(r.get('torch_bytes_at_oom'))} GiB torch, ledger "
        f"{gib(r.get('ledger_at_oom'))} (limit {gib(lim)})",
        "-",
        "PASS" if correct and held else "FAIL"))

    # several processes of one tenant
    lim = cfg["mp_limit"]
    xs = [read_result(os.path.join(d, f"mp_x{i}.log")) for i in range(cfg["mp_procs"])]
    y = read_result(os.path.join(d, "mp_y.log"))
    correct = all(r.get("ok") for r in xs) and bool(y.get("ok"))
    held_each = [r.get("torch_bytes_holding") for r in xs]
    total = sum(v for v in held_each if isinstance(v, (int, float)))
    ledger = max((r.get("ledger_all_holding") or 0) for r in xs) if xs else None
    held = (all(isinstance(v, (int, float)) for v in held_each) and total <= lim
            and under(ledger, lim) and all(r.get("oom_type") == "OutOfMemoryError" for r in xs))
    mine = sum(r.get("matmuls_in_window", 0) for r in xs)
    share, share_ok = share_cell(mine, y.get("matmuls_in_window", 0), cfg["mp_shares"][0])
    late = any(r.get("late") for r in xs) or y.get("late")
    rows.append((
        f"{cfg['mp_procs']} processes of one tenant (vs a 1-process tenant)",
        f"{correct}: bad elements {[r.get('mismatched_elements') for r in xs]} + "
        f"{y.get('mismatched_elements')}",
        f"{held}: together {gib(total)} GiB torch ({', '.join(gib(v) for v in held_each)}), "
        f"ledger {gib(ledger)}, all OOM: "
        f"{all(r.get('oom_type') == 'OutOfMemoryError' for r in xs)} (limit {gib(lim)})",
        f"{share}{' LATE START' if late else ''}{sched_cell('mp')}",
        "PASS" if correct and held and share_ok and not late else "FAIL"))

    with open(os.path.join(d, "results.tsv"), "w") as f:
        for row in rows:
            f.write("\t".join(str(c).replace("\t", " ") for c in row) + "\n")
    result(ok=all(r[-1] == "PASS" for r in rows))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("graph", "mp"):
        s = sub.add_parser(name)
        s.add_argument("--start-at", type=float, default=0.0)
        s.add_argument("--window", type=float, default=8.0)
        if name == "graph":
            s.add_argument("--capture-mode", choices=["global", "thread_local", "relaxed"],
                           default="global")
            s.add_argument("--check-only", action="store_true")
        if name == "mp":
            s.add_argument("--barrier", required=True)
            s.add_argument("--procs", type=int, required=True)
    sub.add_parser("mallocasync")
    s = sub.add_parser("streams")
    s.add_argument("--rounds", type=int, default=40)
    s = sub.add_parser("schedstat")
    s.add_argument("--shm", required=True)
    s = sub.add_parser("report")
    s.add_argument("--logs", required=True)
    args = p.parse_args()
    {"graph": graph, "mallocasync": mallocasync, "streams": streams, "mp": mp,
     "schedstat": schedstat, "report": report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
