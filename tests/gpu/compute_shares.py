"""Workloads for tests/gpu/compute_shares.sh (compute sharing by libvgpu_cuda.so).

  matmul --start-at T --window W   back-to-back bf16 8192^3 matmuls; counts those that complete
                                   inside [T, T+W] (T: time.monotonic(), i.e. CLOCK_MONOTONIC,
                                   common to every process) and prints TFLOP/s
  mlp --start-at T --window W      6-layer fp16 MLP (4096 wide), batch 8, one synchronized step
                                   every 2 ms; prints p50/p99 step latency inside the window
  hog --until T                    back-to-back bf16 8192^3 matmuls until T (no measurement)

Each prints one line `RESULT {json}` at the end.
"""

import argparse
import json
import time

import torch

N = 8192
CHUNK = 4


def matmul(args):
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(N, N, device="cuda", dtype=torch.bfloat16)
    end = args.start_at + args.window
    done = 0
    while True:
        for _ in range(CHUNK):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        now = time.monotonic()
        if args.start_at <= now <= end:
            done += CHUNK
        if now > end:
            break
    tflops = done * 2 * N**3 / args.window / 1e12
    print("RESULT " + json.dumps({"matmuls": done, "tflops": tflops}), flush=True)


def hog(args):
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(N, N, device="cuda", dtype=torch.bfloat16)
    done = 0
    while time.monotonic() < args.until:
        for _ in range(CHUNK):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        done += CHUNK
    print("RESULT " + json.dumps({"matmuls": done}), flush=True)


def mlp(args):
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to("cuda", torch.float16).eval()
    x = torch.randn(8, 4096, device="cuda", dtype=torch.float16)
    end = args.start_at + args.window
    samples = []
    with torch.no_grad():
        while True:
            t0 = time.monotonic()
            model(x)
            torch.cuda.synchronize()
            t1 = time.monotonic()
            if args.start_at <= t0 and t1 <= end:
                samples.append((t1 - t0) * 1e3)
            if t1 > end:
                break
            pause = 0.002 - (time.monotonic() - t0)
            if pause > 0:
                time.sleep(pause)
    samples.sort()
    pick = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))] if samples else -1
    print(
        "RESULT " + json.dumps({"steps": len(samples), "p50_ms": pick(0.5), "p99_ms": pick(0.99)}),
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["matmul", "mlp", "hog"])
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--until", type=float, default=0.0)
    args = parser.parse_args()
    {"matmul": matmul, "mlp": mlp, "hog": hog}[args.mode](args)


if __name__ == "__main__":
    main()
