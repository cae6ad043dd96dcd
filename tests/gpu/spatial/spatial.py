"""Workloads for tests/gpu/spatial/run.sh (spatial partitioning feasibility, issue 3 "Guarantee").

  mlp --start-at T --window W [--stamp FILE]
      the latency tenant: 6-layer fp16 MLP (4096 wide), batch 8, one synchronized step every
      2 ms; p50/p99 step latency inside [T, T+W] (T on time.monotonic(), common to all
      processes). --burst-s B: steps only in the first B seconds of every 2B (a tenant that comes
      and goes). With --stamp it writes the time of its last step into FILE (8 bytes), the
      stand-in for the demand stamp a guaranteed tenant's interposer publishes.
  trainer --start-at T --window W [--green-sms N] [--stamp FILE] [--hold-ms H]
      the best-effort trainer: back-to-back bf16 8192^3 matmuls, TFLOP/s inside the window.
      --green-sms N: a green context of N SMs is made next to PyTorch's primary context
      (greenstream.so) and the matmuls (cuBLAS kernels of the primary context, primary-context
      memory) are issued on its stream: always, or with --stamp only while the stamp is
      fresher than H ms (the latency tenant is active), else on the ordinary stream.

Each prints one line `RESULT {json}` at the end.
"""

import argparse
import ctypes
import json
import mmap
import os
import struct
import time

import torch

N = 8192
CHUNK = 4


def open_stamp(path, create):
    if create:
        with open(path, "wb") as f:
            f.write(b"\0" * 8)
    fd = os.open(path, os.O_RDWR)
    return mmap.mmap(fd, 8)


def green_stream(sms):
    default = os.path.join(os.path.dirname(os.path.abspath(__file__)), "greenstream.so")
    lib = ctypes.CDLL(os.environ.get("GREENSTREAM_SO", default))
    handle = ctypes.c_ulonglong(0)
    got = ctypes.c_int(0)
    rc = lib.vgpu_green_stream(torch.cuda.current_device(), sms, ctypes.byref(handle), ctypes.byref(got))
    if rc != 0:
        raise RuntimeError(f"vgpu_green_stream: CUresult {rc}")
    return torch.cuda.ExternalStream(handle.value), got.value


def time_matmuls(stream, a, b, c, n=8):
    with torch.cuda.stream(stream):
        torch.matmul(a, b, out=c)
        stream.synchronize()
        t0 = time.monotonic()
        for _ in range(n):
            torch.matmul(a, b, out=c)
        stream.synchronize()
    return (time.monotonic() - t0) / n * 1e3


def trainer(args):
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(N, N, device="cuda", dtype=torch.bfloat16)
    full = torch.cuda.current_stream()
    result = {}
    green = None
    if args.green_sms:
        green, got = green_stream(args.green_sms)
        result["green_sms"] = got
        result["ms_per_matmul_full"] = round(time_matmuls(full, a, b, c), 3)
        result["ms_per_matmul_green"] = round(time_matmuls(green, a, b, c), 3)
        ref = torch.matmul(a[:256], b)  # same product on the full stream, for a correctness check
        with torch.cuda.stream(green):
            out = torch.matmul(a[:256], b)
            green.synchronize()
        result["green_matches_full"] = bool(torch.equal(ref, out))
    stamp = open_stamp(args.stamp, False) if args.stamp else None
    hold = args.hold_ms / 1e3
    end = args.start_at + args.window
    done = chunks = green_chunks = 0
    while True:
        use_green = green is not None
        if use_green and stamp is not None:
            use_green = time.monotonic() - struct.unpack_from("d", stamp, 0)[0] < hold
        stream = green if use_green else full
        with torch.cuda.stream(stream):
            for _ in range(CHUNK):
                torch.matmul(a, b, out=c)
        stream.synchronize()
        now = time.monotonic()
        if args.start_at <= now <= end:
            done += CHUNK
            chunks += 1
            green_chunks += use_green
        if now > end:
            break
    result["matmuls"] = done
    result["tflops"] = round(done * 2 * N**3 / args.window / 1e12, 1)
    result["green_chunk_fraction"] = round(green_chunks / chunks, 3) if chunks else 0
    print("RESULT " + json.dumps(result), flush=True)


def mlp(args):
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to("cuda", torch.float16).eval()
    x = torch.randn(8, 4096, device="cuda", dtype=torch.float16)
    stamp = open_stamp(args.stamp, not os.path.exists(args.stamp)) if args.stamp else None
    end = args.start_at + args.window
    samples = []
    with torch.no_grad():
        while True:
            t0 = time.monotonic()
            if args.burst_s and t0 >= args.start_at and int((t0 - args.start_at) / args.burst_s) % 2:
                # Idle phase of a bursty tenant: no steps, no stamp, until the next active phase.
                phase = int((t0 - args.start_at) / args.burst_s) + 1
                time.sleep(max(0.0, min(end, args.start_at + phase * args.burst_s) - t0))
                if time.monotonic() >= end:
                    break
                continue
            if stamp is not None:
                struct.pack_into("d", stamp, 0, t0)
            model(x)
            torch.cuda.synchronize()
            t1 = time.monotonic()
            if args.start_at <= t0 and t1 <= end:
                samples.append(((t1 - t0) * 1e3, t0 - args.start_at))
            if t1 > end:
                break
            pause = 0.002 - (time.monotonic() - t0)
            if pause > 0:
                time.sleep(pause)
    def pick(values, q):
        values = sorted(values)
        return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else -1

    latencies = [ms for ms, _ in samples]
    # the p99 of each second of the window, to tell a shifted run from a few bursts of slow steps
    seconds = {}
    for ms, at in samples:
        seconds.setdefault(int(at), []).append(ms)
    per_second = [pick(seconds[k], 0.99) for k in sorted(seconds)]
    result = {
        "steps": len(samples),
        "p50_ms": pick(latencies, 0.5),
        "p99_ms": pick(latencies, 0.99),
        "p999_ms": pick(latencies, 0.999),
        "max_ms": pick(latencies, 1.0),
        "p99_per_second_ms": per_second,
    }
    print("RESULT " + json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["mlp", "trainer"])
    parser.add_argument("--start-at", type=float, required=True)
    parser.add_argument("--window", type=float, default=8.0)
    parser.add_argument("--green-sms", type=int, default=0)
    parser.add_argument("--stamp", default="")
    parser.add_argument("--hold-ms", type=float, default=50.0)
    parser.add_argument("--burst-s", type=float, default=0.0)
    args = parser.parse_args()
    {"mlp": mlp, "trainer": trainer}[args.mode](args)


if __name__ == "__main__":
    main()
