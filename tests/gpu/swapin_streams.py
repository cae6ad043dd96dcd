"""Does a swap-in read faster from host memory over several streams than over one, while the
driver is releasing another process's memory? (issue 17: swap-ins ran at 38-45 GB/s, against
50-53, when they ran right after another tenant freed tens of GiB; the copies themselves ran
slower, and the driver clears freed memory with the copy engines.)

    python3 tests/gpu/swapin_streams.py [TOTAL_GIB=8] [FREED_GIB=27] [ROUNDS=3] [STREAMS=1,2,4] [DELAYS_MS=0]

The process copies TOTAL_GIB from pinned host memory into device memory, 1 GiB chunks dealt
round robin to S streams, for each S in STREAMS, in two conditions: `quiet` (nothing else on
the GPU) and `freed` (a second process freed FREED_GIB of device memory just before the copies
start; with DELAYS_MS, also that many ms after the free: `freed+D`). ROUNDS rounds, the streams' order flipped each round. Prints one table last: GB/s per
condition and stream count, median and range over rounds.
"""

import statistics
import subprocess
import sys
import time

HELPER = r"""
import sys, torch
held = []
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "alloc":
        held = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(int(cmd[1]))]
        torch.cuda.synchronize()
    elif cmd[0] == "free":
        held = []
        torch.cuda.empty_cache()
    elif cmd[0] == "quit":
        break
    print("ok", flush=True)
"""


def main():
    import torch

    total = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    freed = int(sys.argv[2]) if len(sys.argv) > 2 else 27
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    counts = [int(s) for s in (sys.argv[4] if len(sys.argv) > 4 else "1,2,4").split(",")]
    delays = [int(s) for s in (sys.argv[5] if len(sys.argv) > 5 else "0").split(",")]
    chunk = 1 << 30
    host = [torch.empty(chunk, dtype=torch.uint8).pin_memory() for _ in range(total)]
    device = [torch.empty(chunk, dtype=torch.uint8, device="cuda") for _ in range(total)]
    streams = [torch.cuda.Stream() for _ in range(max(counts))]
    helper = subprocess.Popen([sys.executable, "-c", HELPER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def ask(command):
        helper.stdin.write(command + "\n")
        helper.stdin.flush()
        reply = helper.stdout.readline().strip()
        if reply != "ok":
            raise RuntimeError(f"helper: {command}: {reply!r}")

    def copy(count):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(total):
            with torch.cuda.stream(streams[i % count]):
                device[i].copy_(host[i], non_blocking=True)
        for stream in streams[:count]:
            stream.synchronize()
        return total * chunk / (time.perf_counter() - start) / 1e9

    results = {}
    try:
        copy(1)  # warm
        for r in range(rounds):
            order = counts if r % 2 == 0 else counts[::-1]
            for count in order:
                results.setdefault(("quiet", count), []).append(copy(count))
                for delay in delays:
                    ask(f"alloc {freed}")
                    ask("free")
                    time.sleep(delay / 1000)
                    condition = "freed" if delay == 0 else f"freed+{delay}ms"
                    results.setdefault((condition, count), []).append(copy(count))
                    print(f"round {r} streams {count} {condition}: "
                          f"{results[(condition, count)][-1]:.1f} GB/s", flush=True)
    finally:
        try:
            ask("quit")
        except Exception:
            pass
        helper.kill()
        helper.wait()
    print()
    print(f"| condition | streams | GB/s (median of {rounds}) | range |")
    print("| --- | --: | --: | --- |")
    for (condition, count), rates in sorted(results.items()):
        print(f"| {condition} | {count} | {statistics.median(rates):.1f} | "
              f"{min(rates):.1f}-{max(rates):.1f} |")


if __name__ == "__main__":
    main()
