"""What a GPU-to-GPU copy engine copy costs, the way libvgpu_nccl.so's same-host path uses one.

The plugin moves each NCCL step (1 MiB at NCCL's defaults) with one cudaMemcpyAsync from the
sender's GPU into the receiver's, one stream per connection, and waits for it with an event. Its
close-time log says such a copy takes 35-60 us from hand-off to completion with 4 connections
and 140-240 us with 16. This probe separates the parts, with no NCCL in the way:
  latency   one copy at a time (issue, record, poll the event until done), per size
  streams   N streams each copying 1 MiB steps back to back: aggregate GB/s and per-copy time
  split     one 1 MiB step cut into k pieces on k streams: does it finish sooner?
  kernel    the same copy done by SMs instead (torch's cross-device copy with a bf16 -> fp16
            conversion runs as a kernel reading or writing the peer over NVLink): one at a time
            per size, against the copy engine through the same torch call

Run on a machine with two GPUs (peer access is enabled here; NCCL's cuMem buffers get the same):
    python3 tests/gpu/nccl/ce_probe.py [--json out.jsonl]
Prints a table last.
"""
import argparse
import json
import time

import torch


def wait(ev):
    # poll like the plugin's copy worker (cuEventQuery in a loop), not a blocking sync
    while not ev.query():
        pass


def timed(src, copy, reps=200):
    """p50 and p99 in us of `copy()` issued on a stream of src's GPU, polled until done."""
    s = torch.cuda.Stream(device=src.device)
    times = []
    for _ in range(reps):
        ev = torch.cuda.Event()
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            copy()
            ev.record(s)
        wait(ev)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


def latency(src, dst, size, reps=200):
    return timed(src, lambda: dst[:size].copy_(src[:size], non_blocking=True), reps)


def kernel_latency(src, dst, size, reps=200):
    """Like `latency`, with an SM copy: same bytes, but a dtype conversion forces a kernel."""
    a, b = src.view(torch.bfloat16), dst.view(torch.float16)
    n = size // 2
    return timed(src, lambda: b[:n].copy_(a[:n], non_blocking=True), reps)


def one_round(ss, src, dst, piece):
    """Copy piece i of `piece` bytes on stream i, all at once; seconds until every one is done."""
    evs = []
    t0 = time.perf_counter()
    for i, s in enumerate(ss):
        off = i * piece
        with torch.cuda.stream(s):
            dst[off:off + piece].copy_(src[off:off + piece], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(s)
        evs.append(ev)
    for ev in evs:
        wait(ev)
    return time.perf_counter() - t0


def streams(src, dst, n, step=1 << 20, seconds=1.0):
    ss = [torch.cuda.Stream(device=src.device) for _ in range(n)]
    copies = 0
    t0 = time.perf_counter()
    per = []
    while time.perf_counter() - t0 < seconds:
        per.append(one_round(ss, src, dst, step))
        copies += n
    wall = time.perf_counter() - t0
    per.sort()
    return copies * step / wall / 1e9, per[len(per) // 2] * 1e6


def split(src, dst, k, step=1 << 20, reps=200):
    ss = [torch.cuda.Stream(device=src.device) for _ in range(k)]
    times = sorted(one_round(ss, src, dst, step // k) for _ in range(reps))
    return times[len(times) // 2] * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="")
    a = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    for d in (0, 1):
        torch.cuda.set_device(d)
        torch.empty(1, device=d)
    # the sender's copy is issued on GPU 0 into GPU 1's memory, as the plugin does
    torch.cuda.set_device(0)
    total = 64 << 20
    src = torch.randint(0, 255, (total,), dtype=torch.uint8, device=0)
    dst = torch.zeros(total, dtype=torch.uint8, device=1)
    rows = []
    for size in (256 << 10, 1 << 20, 4 << 20, 16 << 20):
        p50, p99 = latency(src, dst, size)
        rows.append({"probe": "latency", "bytes": size, "p50_us": p50, "p99_us": p99,
                     "gbs": size / p50 / 1e3})
    for n in (1, 2, 4, 8, 16, 32):
        gbs, per = streams(src, dst, n)
        rows.append({"probe": "streams", "streams": n, "gbs": gbs, "round_p50_us": per})
    for k in (1, 2, 4, 8):
        rows.append({"probe": "split", "pieces": k, "p50_us": split(src, dst, k)})
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    if not torch.equal(dst[:16 << 20].cpu(), src[:16 << 20].cpu()):
        raise SystemExit("copied data differs")
    # after the data check: these overwrite dst with converted values
    for size in (256 << 10, 1 << 20, 4 << 20):
        p50, p99 = kernel_latency(src, dst, size)
        rows.append({"probe": "kernel", "bytes": size, "p50_us": p50, "p99_us": p99,
                     "gbs": size / p50 / 1e3})
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print("| probe | setting | median us | GB/s |")
    print("| --- | --- | --: | --: |")
    for r in rows:
        if r["probe"] == "latency":
            print(f"| one copy at a time | {r['bytes'] >> 10} KiB | {r['p50_us']:.1f} (p99 {r['p99_us']:.1f}) | {r['gbs']:.1f} |")
        elif r["probe"] == "streams":
            print(f"| 1 MiB per stream, back to back | {r['streams']} streams | {r['round_p50_us']:.1f} per round | {r['gbs']:.1f} |")
        elif r["probe"] == "kernel":
            print(f"| SM copy (kernel), one at a time | {r['bytes'] >> 10} KiB | {r['p50_us']:.1f} (p99 {r['p99_us']:.1f}) | {r['gbs']:.1f} |")
        else:
            print(f"| 1 MiB cut into pieces on streams | {r['pieces']} pieces | {r['p50_us']:.1f} | {(1 << 20) / r['p50_us'] / 1e3:.1f} |")


if __name__ == "__main__":
    main()
