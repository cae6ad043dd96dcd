"""Workloads of tests/gpu/redistribute.sh (issue 15, point 4: SMs among best-effort tenants).

    redistribute.py gemm|stream|hist|small --seconds S [--hint] [--sync-every N]
    redistribute.py report --logs DIR

gemm: bf16 8192^3 matmuls back to back (compute-bound). stream: a 1 GiB fp32 copy back to back
(HBM-bandwidth-bound, full grids: under MPS its blocks hold SMs they cannot use). hist: 2^26
fp32 values added into 4096 bins at random indices (`scatter_add_`, bound by the L2's atomics
rather than by the SMs its grid holds). small: eight 512-wide fp32 layers (matmuls) at batch 8, in
eager PyTorch (launch-bound: a few-us kernels, the GPU idle between them while Python launches the
next; the case where taking turns wastes the GPU, unlike the three above). All four
synchronise every N operations (a step, which the interposer counts as the tenant's progress),
or with --hint count their operations through vgpu.torch.progress instead. Each prints one line
`RESULT {json}`: the workload, the operations completed, and the cumulative count at every whole
second since its first operation (`marks`), so that the script can take the rate over any window.

report: reads DIR/*.log (RESULT lines) and DIR/plan.tsv (label, log, window start, window end
in seconds since the workload's start), prints the rates as a TSV for the shell script.
"""

import argparse
import json
import os
import sys
import time


def run(args):
    import torch

    device = torch.device("cuda")
    if args.workload == "gemm":
        n = 8192
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        c = torch.empty(n, n, device=device, dtype=torch.bfloat16)

        def op():
            torch.matmul(a, b, out=c)

    elif args.workload == "hist":
        n = 1 << 26
        generator = torch.Generator(device=device).manual_seed(0)
        index = torch.randint(0, 4096, (n,), device=device, generator=generator)
        values = torch.ones(n, device=device, dtype=torch.float32)
        bins = torch.zeros(4096, device=device, dtype=torch.float32)

        def op():
            bins.scatter_add_(0, index, values)

    elif args.workload == "small":
        weights = [torch.randn(512, 512, device=device) for _ in range(8)]
        outs = [torch.empty(8, 512, device=device) for _ in range(8)]
        x = torch.randn(8, 512, device=device)

        def op():
            h = x
            for w, out in zip(weights, outs):
                torch.matmul(h, w, out=out)
                h = out

    else:
        n = 1 << 28
        x = torch.ones(n, device=device, dtype=torch.float32)
        y = torch.empty(n, device=device, dtype=torch.float32)

        def op():
            y.copy_(x)

    progress = None
    if args.hint:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "python"))
        import vgpu.torch as helper

        progress = helper.progress
    for _ in range(4):
        op()
    torch.cuda.synchronize()
    start = time.monotonic()
    marks = []
    ops = 0
    hinted = 0
    while True:
        for _ in range(args.sync_every):
            op()
        torch.cuda.synchronize()
        ops += args.sync_every
        if progress is not None and progress(args.sync_every):
            hinted += args.sync_every
        now = time.monotonic()
        while start + len(marks) + 1 <= now:
            marks.append(ops)
        if now - start >= args.seconds:
            break
    result = {
        "workload": args.workload,
        "ops": ops,
        "seconds": time.monotonic() - start,
        "marks": marks,
        "hinted": hinted,
    }
    print("RESULT " + json.dumps(result), flush=True)


def rate(marks, start_s, end_s):
    """Operations per second between whole seconds start_s and end_s (clamped to the marks)."""
    end_s = min(end_s, len(marks))
    start_s = min(max(start_s, 0), end_s - 1) if end_s > 0 else 0
    if end_s <= start_s:
        return None
    before = marks[start_s - 1] if start_s > 0 else 0
    return (marks[end_s - 1] - before) / (end_s - start_s)


def report(args):
    for line in open(os.path.join(args.logs, "plan.tsv")):
        label, log, start_s, end_s = line.rstrip("\n").split("\t")
        path = os.path.join(args.logs, log)
        value = ""
        try:
            results = [l for l in open(path, errors="replace") if l.startswith("RESULT ")]
            marks = json.loads(results[-1][len("RESULT "):])["marks"]
            got = rate(marks, int(start_s), int(end_s))
            value = "" if got is None else f"{got:.3f}"
        except (OSError, IndexError, KeyError, ValueError):
            pass
        print(f"{label}\t{value}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("gemm", "stream", "hist", "small"):
        p = sub.add_parser(name)
        p.add_argument("--seconds", type=float, required=True)
        p.add_argument("--hint", action="store_true")
        p.add_argument("--sync-every", type=int, default=8)
        p.set_defaults(workload=name)
    p = sub.add_parser("report")
    p.add_argument("--logs", required=True)
    args = parser.parse_args()
    if args.command == "report":
        report(args)
    else:
        try:
            run(args)
        except Exception as e:  # one RESULT line on every path
            print("RESULT " + json.dumps({"error": repr(e)}), flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main()
