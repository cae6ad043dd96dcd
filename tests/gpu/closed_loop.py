"""Workloads of tests/gpu/closed_loop.sh (issue 15: a latency guarantee that holds on workloads we
have not tuned for), plus the two helpers the script needs (`schedule`, `report`).

Latency tenants: one step, a synchronisation, then a sleep until the next period starts (a closed
loop that does not saturate the GPU). A step's latency runs from issuing it to the
synchronisation returning. RESULT per window: steps, p50_ms, p99_ms, p999_ms, max_ms, mean_ms.
  decoder  a CUDA-graph decoder step as inference servers run it: 16 attention-free blocks,
           2048 wide (gated token mixing 2048 -> 3x2048 -> 2048, SwiGLU MLP 5632), bf16,
           batch 4, captured in a torch.cuda.CUDAGraph and replayed, then torch.cuda.synchronize
           (1.6 GB of weights; ~1-1.5 ms alone on an H100); default period 3 ms
  eager    a ResNet-18-like CNN in plain torch.nn (conv/bn/relu blocks), batch 1, 224x224, fp16,
           eval, torch.no_grad(), eager launches, `.item()` of one logit at the end; period 6 ms
  bert     nn.TransformerEncoder of 6 nn.TransformerEncoderLayer (d_model 1024, 16 heads, ff
           4096), seq 128, batch 8, fp16, eval, torch.no_grad(), torch.cuda.synchronize; period 4 ms
Neighbours: launch back to back, at most DEPTH chunks queued (a CUDA event per chunk); RESULT per
window: work_per_s in `unit`, chunks, chunk_ms_p50 (GPU time of one chunk, from its events).
  gemm     bf16 8192^3 matmuls, 4 per chunk (compute bound)                    TFLOP/s
  train    a small transformer (4 layers, d 512, seq 256, batch 16) fwd+bwd+AdamW under bf16
           autocast: hundreds of small kernels per step                         steps/s
  stream   y.copy_(x) over two 3 GiB tensors (~2 ms per kernel, HBM bound), 4 per chunk   GB/s
           (bytes read + written)
  long     one bf16 16384^3 matmul per chunk (~12 ms, one kernel)              kernels/s
           (its length under sharing: chunk_ms_p50 = kernel_ms)
Every workload allocates at most ~7 GiB (stream), the decoder ~2 GiB, the rest < 2 GiB.

Two ways to run a workload:
  closed_loop.py WORKLOAD --start-at T [--window W] [--settle S]
      warm up, then run from T-S to T+W and measure inside [T, T+W] (T on time.monotonic(),
      common to all processes of a pair)
  closed_loop.py WORKLOAD --name ID --ready FILE --schedule FILE [--window W] [--settle S]
      warm up, touch the ready file, wait for the schedule (JSON, written by `schedule`), then
      run only in the windows whose `active` list names ID, idle in between, and exit after the
      schedule's last window (so that no process of the group ends during another's window).
Either way it prints exactly one line `RESULT {json}` at the end: the workload, torch and GPU,
and `windows` (tag -> that window's numbers); with --start-at also that window's numbers at the
top level. A failure prints `RESULT {"error": ...}` and exits 1.

  closed_loop.py schedule --out FILE --window W --settle S --gap G TAG=ID,ID ...
      writes the schedule: back-to-back windows, each preceded by `settle` seconds in which its
      processes already run (not measured) and separated by `gap` seconds of idleness; prints
      "TAG START_OFFSET_S" per window (offset from now).
  closed_loop.py report --logs DIR --pairs "lat:nb ..." --modes "..." [--limit 1.2]
      reads every RESULT under DIR/*/, writes DIR/results.tsv and DIR/table.txt, prints the table.
"""

import argparse
import json
import glob
import os
import re
import statistics
import sys
import time
import traceback
from collections import deque

# About twice each step's time alone, on an H100 and an H200 alike (the report's check wants 1.5-4x
# its alone p50): bert's old 2 ms was its own p50 on an H200 (back to back, so its tail queued and
# two alone windows of one run differed 1.7x at p99), eager's 5 ms was 1.35x its H100 p50.
LATENCY_PERIOD_MS = {"decoder": 3.0, "eager": 6.0, "bert": 4.0, "launches": 4.0}
# The `launches` probe: this many tiny kernels per step (its step time is launch cost).
LAUNCHES_PER_STEP = 400
NEIGHBOURS = ("gemm", "train", "stream", "long")
# Neighbour chunks queued on the GPU at once: keeps the GPU fed without queueing seconds of work.
DEPTH = 2
SCHEDULE_TIMEOUT_S = 300.0


def log(message):
    print(f"[{time.monotonic():.3f}] {message}", flush=True)


def sleep_until(t):
    d = t - time.monotonic()
    if d > 0:
        time.sleep(d)


def pick(values, q):
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else -1


# ---------------------------------------------------------------- latency tenants


def make_decoder(torch):
    import torch.nn.functional as F

    d, ff, layers, batch = 2048, 5632, 16, 4
    kw = dict(device="cuda", dtype=torch.bfloat16)

    def weight(out_features, in_features):
        return torch.randn(out_features, in_features, **kw) * in_features**-0.5

    blocks = [
        dict(
            n1=torch.ones(d, **kw),
            qkv=weight(3 * d, d),
            o=weight(d, d),
            n2=torch.ones(d, **kw),
            up=weight(2 * ff, d),
            down=weight(d, ff),
        )
        for _ in range(layers)
    ]

    def forward(x):
        for p in blocks:
            q, k, v = F.linear(F.rms_norm(x, (d,), p["n1"]), p["qkv"]).chunk(3, -1)
            x = x + F.linear(torch.sigmoid(q) * k * v, p["o"])
            g, u = F.linear(F.rms_norm(x, (d,), p["n2"]), p["up"]).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, p["down"])
        return x

    static_in = torch.randn(batch, d, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            forward(static_in)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = forward(static_in)
    torch.cuda.synchronize()
    params = sum(t.numel() for p in blocks for t in p.values())
    log(f"decoder: {layers} blocks, {params / 1e6:.0f}M bf16 parameters, batch {batch}, one CUDA graph")

    def step():
        graph.replay()
        torch.cuda.synchronize()

    step.keep = (graph, static_in, static_out, blocks)
    return step


def make_eager(torch):
    nn = torch.nn

    class Basic(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.short = None
            if stride != 1 or cin != cout:
                self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + (x if self.short is None else self.short(x)))

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Basic(cin, cout, stride), Basic(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
    model = nn.Sequential(*layers).to("cuda", torch.float16).eval()
    x = torch.randn(1, 3, 224, 224, device="cuda", dtype=torch.float16)
    log("eager: ResNet-18-like CNN, batch 1, 224x224, fp16, eager")

    def step():
        with torch.no_grad():
            model(x)[0, 0].item()

    step.keep = (model, x)
    return step


def make_bert(torch):
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).to("cuda", torch.float16).eval()
    x = torch.randn(8, 128, 1024, device="cuda", dtype=torch.float16)
    log("bert: 6 x TransformerEncoderLayer(1024, 16 heads, ff 4096), seq 128, batch 8, fp16, eager")

    def step():
        with torch.no_grad():
            model(x)
        torch.cuda.synchronize()

    step.keep = (model, x)
    return step


def make_launches(torch):
    x = torch.zeros(16, device="cuda")
    log(f"launches: {LAUNCHES_PER_STEP} tiny in-place adds, then one synchronisation (the launch path's cost)")

    def step():
        for _ in range(LAUNCHES_PER_STEP):
            x.add_(1.0)
        torch.cuda.synchronize()

    step.keep = (x,)
    return step


def run_latency(step, windows, args):
    period = args.period_ms / 1e3
    results = {}
    for w in windows:
        start, end = w["start"], w["start"] + args.window
        begin = start - args.settle
        late = max(0.0, time.monotonic() - begin)
        sleep_until(begin)
        samples = []
        gaps = 0
        following = time.monotonic()
        while True:
            t0 = time.monotonic()
            step()
            t1 = time.monotonic()
            if t0 >= start and t1 <= end:
                samples.append(((t1 - t0) * 1e3, t0 - start))
            if t1 >= end:
                break
            following += period
            if following < t1:
                # the step overran its period: the next one starts at once, no catch-up burst
                following = t1
                gaps += 1
            sleep_until(following)
        latencies = [ms for ms, _ in samples]
        seconds = {}
        for ms, at in samples:
            seconds.setdefault(int(at), []).append(ms)
        r = {
            "steps": len(samples),
            "p50_ms": pick(latencies, 0.5),
            "p99_ms": pick(latencies, 0.99),
            "p999_ms": pick(latencies, 0.999),
            "max_ms": pick(latencies, 1.0),
            "mean_ms": round(statistics.fmean(latencies), 3) if latencies else -1,
            "period_ms": args.period_ms,
            "overruns": gaps,
            "p99_per_second_ms": [pick(seconds[k], 0.99) for k in sorted(seconds)],
            # the window's second half: a pair that stays together longer than the controller
            # takes to learn it (the verdict stays on the whole window)
            "p99_late_ms": pick([ms for ms, at in samples if at >= args.window / 2], 0.99),
            "late_s": round(late, 3),
        }
        results[w["tag"]] = r
        log(f"{w['tag']}: {r['steps']} steps, p50 {r['p50_ms']} p99 {r['p99_ms']} p99.9 {r['p999_ms']} max {r['max_ms']} ms")
    return results


# ---------------------------------------------------------------- neighbours


def make_gemm(torch):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)

    def chunk():
        for _ in range(4):
            torch.matmul(a, b, out=c)

    chunk.keep = (a, b, c)
    return chunk, 4 * 2 * n**3 / 1e12, "TFLOP/s"


def make_train(torch):
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.1, batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).to("cuda").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 256, 512, device="cuda")

    def chunk():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    chunk.keep = (model, opt, x)
    return chunk, 1.0, "steps/s"


def make_stream(torch):
    gib = 3
    numel = gib * 2**30 // 2
    x = torch.ones(numel, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)

    def chunk():
        for _ in range(4):
            y.copy_(x)

    chunk.keep = (x, y)
    return chunk, 4 * 2 * numel * 2 / 1e9, "GB/s"


def make_long(torch):
    n = 16384
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)

    def chunk():
        torch.matmul(a, b, out=c)

    chunk.keep = (a, b, c)
    return chunk, 1.0, "kernels/s"


def run_neighbour(torch, chunk, work, unit, windows, args):
    results = {}
    for w in windows:
        start, end = w["start"], w["start"] + args.window
        begin = start - args.settle
        late = max(0.0, time.monotonic() - begin)
        sleep_until(begin)
        pending = deque()
        counted = 0
        counted_late = 0
        lengths = []

        def retire():
            nonlocal counted, counted_late
            ev0, ev1 = pending.popleft()
            ev1.synchronize()
            t = time.monotonic()
            if start < t <= end:
                counted += 1
                counted_late += t > start + args.window / 2
                lengths.append(ev0.elapsed_time(ev1))

        while time.monotonic() < end:
            ev0 = torch.cuda.Event(enable_timing=True)
            ev1 = torch.cuda.Event(enable_timing=True)
            ev0.record()
            chunk()
            ev1.record()
            pending.append((ev0, ev1))
            while len(pending) > DEPTH:
                retire()
        while pending:
            retire()
        r = {
            "work_per_s": round(counted * work / args.window, 2),
            "work_per_s_late": round(counted_late * work / (args.window / 2), 2),
            "unit": unit,
            "chunks": counted,
            "chunk_ms_p50": pick(lengths, 0.5),
            "chunk_ms_max": pick(lengths, 1.0),
            "late_s": round(late, 3),
        }
        results[w["tag"]] = r
        log(f"{w['tag']}: {r['work_per_s']} {unit} ({counted} chunks, {r['chunk_ms_p50']} ms each)")
    return results


MAKERS = {
    "decoder": make_decoder,
    "eager": make_eager,
    "bert": make_bert,
    "launches": make_launches,
    "gemm": make_gemm,
    "train": make_train,
    "stream": make_stream,
    "long": make_long,
}


def windows_for(args):
    """The windows this process runs in, after the warm-up; the end of the whole schedule."""
    if args.start_at is not None:
        w = {"tag": args.tag, "start": args.start_at, "active": [args.name]}
        return [w], args.start_at + args.window
    with open(args.ready, "w") as f:
        f.write(f"{os.getpid()}\n")
    log("ready; waiting for the schedule")
    deadline = time.monotonic() + SCHEDULE_TIMEOUT_S
    while not os.path.exists(args.schedule):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no schedule {args.schedule} after {SCHEDULE_TIMEOUT_S:.0f} s")
        time.sleep(0.01)
    with open(args.schedule) as f:
        schedule = json.load(f)
    args.window = schedule["window"]
    args.settle = schedule["settle"]
    everything = schedule["windows"]
    mine = [w for w in everything if args.name in w["active"]]
    last = max((w["start"] for w in everything), default=time.monotonic()) + args.window
    log(f"schedule: {len(mine)} of {len(everything)} windows are mine")
    return mine, last


def workload(args):
    result = {"workload": args.workload, "name": args.name}
    try:
        import torch

        props = torch.cuda.get_device_properties(0)
        result.update(
            torch=torch.__version__,
            cuda=torch.version.cuda,
            device=props.name,
            sms=props.multi_processor_count,
        )
        env = {k: v for k, v in os.environ.items() if k.startswith(("VGPU_", "CUDA_MPS", "CUDA_VISIBLE"))}
        log(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {props.name}, "
            f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.1f} GiB; env {env}")
        t = time.monotonic()
        latency = args.workload in LATENCY_PERIOD_MS
        if latency:
            if args.period_ms <= 0:
                args.period_ms = LATENCY_PERIOD_MS[args.workload]
            step = MAKERS[args.workload](torch)
            times = []
            for _ in range(30):
                t0 = time.monotonic()
                step()
                times.append((time.monotonic() - t0) * 1e3)
            result["warmup_step_ms_p50"] = pick(times[10:], 0.5)
            log(f"warm-up: step p50 {result['warmup_step_ms_p50']} ms (other processes may be warming up too), "
                f"period {args.period_ms} ms")
        else:
            chunk, work, unit = MAKERS[args.workload](torch)
            for _ in range(3):
                chunk()
            torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        result["warmup_s"] = round(time.monotonic() - t, 2)
        result["allocated_gib"] = round(torch.cuda.memory_reserved() / 2**30, 2)
        log(f"warmed up in {result['warmup_s']} s; reserved {result['allocated_gib']} GiB, "
            f"GPU free {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
        windows, last = windows_for(args)
        if latency:
            result["windows"] = run_latency(step, windows, args)
        else:
            result["windows"] = run_neighbour(torch, chunk, work, unit, windows, args)
        if args.start_at is not None:
            result.update(result["windows"].get(args.tag, {}))
        # leave only after the group's last window: a context torn down in the middle of another
        # pair's window would disturb it
        sleep_until(last + 0.05)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    except Exception as e:  # one RESULT line on every path
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
        print("RESULT " + json.dumps(result), flush=True)
        return 1


# ---------------------------------------------------------------- helpers of the script


def schedule(args):
    windows = []
    t = time.monotonic() + args.lead + args.settle
    for spec in args.windows:
        tag, _, active = spec.partition("=")
        windows.append({"tag": tag, "start": t, "active": [a for a in active.split(",") if a]})
        t += args.window + args.gap + args.settle
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"window": args.window, "settle": args.settle, "windows": windows}, f, indent=1)
    os.replace(tmp, args.out)
    now = time.monotonic()
    for w in windows:
        print(f"{w['tag']} {w['start'] - now:.3f}")
    return 0


BASELINE_MAX_P99_OVER_P50 = 2.0
# The modes through vgpu whose pair rows get a verdict.
VGPU_MODES = ("vgpu", "vgpu-mps", "vgpu-mps-all")


def learnt_target_ms(logs, mode, lat, nb):
    """The latency tenant's target in force during a vgpu window (its `vgpuctl describe tenant`,
    taken during the window: TARGET in its Latency table), in ms; None when not found. The
    controller holds this target, learnt from the tenant's own steps: the p99 against it says
    how well the controller did, apart from how the tenant's alone windows moved."""
    units = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3}
    for path in glob.glob(os.path.join(logs, "*", f"describe.{mode}_{lat}_{nb}.txt")):
        try:
            text = open(path, errors="replace").read()
        except OSError:
            continue
        block = text.split(f"lat-{lat}\n", 1)[-1].split("\nName:", 1)[0]
        lines = block.split("Latency:\n", 1)[-1].splitlines()
        if len(lines) < 2 or "TARGET" not in lines[0]:
            continue
        cell = lines[1].split()[lines[0].split().index("TARGET")]
        match = re.fullmatch(r"([0-9.]+)(ns|us|µs|ms|s)", cell)
        if match:
            return float(match.group(1)) * units[match.group(2)]
    return None


def read_windows(logs):
    """Every window's result under LOGS/*/: (by tag: {"lat"|"nb": window}, machines, problems)."""
    by_tag = {}
    machine = set()
    problems = []
    for group in sorted(os.listdir(logs)):
        folder = os.path.join(logs, group)
        # the MPS daemons' own logs (mps-log, agent-mps-log) are no workload's
        if not os.path.isdir(folder) or group.endswith("mps-log"):
            continue
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".log"):
                continue
            lines = [l for l in open(os.path.join(folder, name), errors="replace") if l.startswith("RESULT ")]
            if not lines:
                problems.append(f"{group}/{name}: no RESULT line (killed or crashed before the end)")
                continue
            try:
                r = json.loads(lines[-1][len("RESULT "):])
            except ValueError:
                problems.append(f"{group}/{name}: unreadable RESULT")
                continue
            if "error" in r:
                problems.append(f"{group}/{name}: {r['error']}")
            if "device" in r:
                machine.add(f"{r['device']} ({r.get('sms')} SMs), torch {r.get('torch')}, CUDA {r.get('cuda')}")
            for tag, w in r.get("windows", {}).items():
                by_tag.setdefault(tag, {})["nb" if "work_per_s" in w else "lat"] = w
                if w.get("late_s", 0) > 0.2:
                    problems.append(f"{tag}: {r['workload']} started {w['late_s']} s late (its warm-up outran the schedule)")
                if w.get("steps") == 0 or w.get("chunks") == 0:
                    problems.append(f"{tag}: {r['workload']} measured nothing")
    return by_tag, machine, problems


def cost_report(args):
    """vgpu's own cost (modes cost, cost-mps): per workload and arm, the median over rounds of the
    window's p50/p99 (latency workloads) or work/s (neighbours), and the median and range over
    rounds of the ratio to the bare arm of the same round."""
    by_tag, machine, problems = read_windows(args.logs)
    # tag: MODE:rROUND-ARM:WORKLOAD
    runs = {}
    for tag, kinds in by_tag.items():
        parts = tag.split(":")
        if len(parts) != 3 or not parts[0].startswith("cost") or "-" not in parts[1]:
            continue
        mode, (rnd, arm), wl = parts[0], parts[1].split("-", 1), parts[2]
        w = kinds.get("lat") or kinds.get("nb")
        runs.setdefault((mode, wl), {}).setdefault(rnd, {})[arm] = w

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def f(v, nd=3):
        return "-" if v is None else f"{v:.{nd}f}"

    table = [
        "vgpu's own cost: each workload alone, bare and through vgpu by turns; medians over rounds, "
        "ratios to bare per round (median [min, max])",
        "machine: " + ("; ".join(sorted(machine)) or "unknown"),
        "",
        "| mode | workload | arm | rounds | p50 ms | p99 ms | work/s | p50 / bare | p99 / bare | work / bare |",
        "| --- | --- | --- | --: | --: | --: | --: | --- | --- | --- |",
    ]

    def spread(xs):
        xs = [x for x in xs if x is not None]
        return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]" if xs else "-"

    for (mode, wl), rounds in sorted(runs.items()):
        arms = sorted({a for r in rounds.values() for a in r}, key=lambda a: ("bare", "vgpu", "be").index(a)
                      if a in ("bare", "vgpu", "be") else 9)
        for arm in arms:
            ws = [r.get(arm) or {} for r in rounds.values()]
            bare = [r.get("bare") or {} for r in rounds.values()]

            def ratio(key, w, b):
                return w[key] / b[key] if w.get(key, -1) and w.get(key, -1) > 0 and b.get(key, -1) and b[key] > 0 else None

            table.append(
                f"| {mode} | {wl} | {arm} | {sum(1 for w in ws if w)} | {f(med(w.get('p50_ms') for w in ws))} | "
                f"{f(med(w.get('p99_ms') for w in ws))} | {f(med(w.get('work_per_s') for w in ws), 1)} | "
                + (" | ".join(spread([ratio(k, w, b) for w, b in zip(ws, bare)]) for k in ("p50_ms", "p99_ms", "work_per_s")))
                + " |"
            )
    if problems:
        table.append("")
        table += ["problem: " + p for p in problems]
    with open(os.path.join(args.logs, "cost.txt"), "w") as out:
        out.write("\n".join(table) + "\n")
    print("\n".join(table))
    return 0 if runs else 4


def report(args):
    by_tag, machine, problems = read_windows(args.logs)

    pairs = [tuple(p.split(":")) for p in args.pairs.split()]
    modes = args.modes.split()
    lats = list(dict.fromkeys(l for l, _ in pairs))
    nbs = list(dict.fromkeys(n for _, n in pairs))
    limit = args.limit

    def lat_of(tag):
        return by_tag.get(tag, {}).get("lat")

    def nb_of(tag):
        return by_tag.get(tag, {}).get("nb")

    # A latency tenant's baseline: the quieter (lower p99) of its two alone windows (`alone` at the
    # start of the plain group, `alone2` at its end): a stricter target, never a looser one.
    def quieter(l):
        seen = [w for w in (lat_of(f"alone:{l}:-"), lat_of(f"alone2:{l}:-")) if w and w.get("p99_ms", -1) > 0]
        return min(seen, key=lambda w: w["p99_ms"]) if seen else None

    baseline = {l: quieter(l) for l in lats}
    alone_p99 = {l: (baseline[l] or {}).get("p99_ms") for l in lats}
    alone_work = {n: (nb_of(f"alone:-:{n}") or {}).get("work_per_s") for n in nbs}
    rounds = range(1, max(1, args.rounds) + 1)

    def tag_of(m, r, l, n):
        # round r > 1 of mode m is tagged m@r (closed_loop.sh's PAIR_ROUNDS)
        return f"{m}:{l}:{n}" if r == 1 else f"{m}@{r}:{l}:{n}"

    # each round's alone figures: round 1's baseline is the quieter of its two alone windows
    def alone_p99_in(l, r):
        return alone_p99[l] if r == 1 else (lat_of(tag_of("alone", r, l, "-")) or {}).get("p99_ms")

    def alone_work_in(n, r):
        return alone_work[n] if r == 1 else (nb_of(tag_of("alone", r, "-", n)) or {}).get("work_per_s")

    def ratio(a, b):
        return a / b if a is not None and b and a >= 0 else None

    def per_round(values):
        """The median of the rounds' ratios and their range (None without any)."""
        values = [v for v in values if v is not None]
        return (statistics.median(values), min(values), max(values)) if values else (None, None, None)

    def merged(windows):
        """One window of several rounds: the median of each figure, the steps added up."""
        windows = [w for w in windows if w]
        if len(windows) <= 1:
            return windows[0] if windows else None
        out = {"unit": windows[0].get("unit", ""), "period_ms": windows[0].get("period_ms"),
               "steps": sum(w.get("steps", 0) for w in windows)}
        for key in ("p50_ms", "p99_ms", "p999_ms", "max_ms", "p99_late_ms", "work_per_s", "work_per_s_late",
                    "chunk_ms_p50"):
            values = [w[key] for w in windows if isinstance(w.get(key), (int, float)) and w[key] >= 0]
            if values:
                out[key] = round(statistics.median(values), 3)
        return out

    spread = {}  # (latency, neighbour, mode): (p99 ratio range, work ratio range) over the rounds

    rows = []  # (latency, neighbour, mode, lat dict, nb dict, p99 ratio, work ratio, verdict)
    for l in lats:
        if "alone" in modes:
            w = lat_of(f"alone:{l}:-")
            rows.append((l, "-", "alone", w, None, ratio((w or {}).get("p99_ms"), alone_p99[l]), None, ""))
            w2 = lat_of(f"alone2:{l}:-")
            if w2:
                rows.append((l, "-", "alone again", w2, None, ratio(w2.get("p99_ms"), alone_p99[l]), None, ""))
            for r in rounds[1:]:
                w = lat_of(tag_of("alone", r, l, "-"))
                rows.append((l, "-", f"alone (round {r})", w, None, ratio((w or {}).get("p99_ms"), alone_p99[l]),
                             None, ""))
    for n in nbs:
        if "alone" in modes:
            w = nb_of(f"alone:-:{n}")
            rows.append(("-", n, "alone", None, w, None, ratio((w or {}).get("work_per_s"), alone_work[n]), ""))
            for r in rounds[1:]:
                w = nb_of(tag_of("alone", r, "-", n))
                rows.append(("-", n, f"alone (round {r})", None, w, None,
                             ratio((w or {}).get("work_per_s"), alone_work[n]), ""))
    # Alone through vgpu (vgpu-alone, vgpu-mps-alone): vgpu's own cost, against alone.
    for m in modes:
        if not m.endswith("-alone"):
            continue
        for l in lats:
            ws = [lat_of(tag_of(m, r, l, "-")) for r in rounds]
            pr = per_round([ratio((w or {}).get("p99_ms"), alone_p99_in(l, r)) for r, w in zip(rounds, ws)])
            spread[(l, "-", m)] = (pr, None)
            rows.append((l, "-", m, merged(ws), None, pr[0], None, ""))
        for n in nbs:
            ws = [nb_of(tag_of(m, r, "-", n)) for r in rounds]
            wr = per_round([ratio((w or {}).get("work_per_s"), alone_work_in(n, r)) for r, w in zip(rounds, ws)])
            spread[("-", n, m)] = (None, wr)
            rows.append(("-", n, m, None, merged(ws), None, wr[0], ""))
    summary = {m: {"pairs": 0, "p99_ok": 0, "work": [], "ok": 0} for m in modes if not m.endswith("alone")}
    for l, n in pairs:
        peers = {}
        for m in modes:
            if m.endswith("alone"):
                continue
            lws = [lat_of(tag_of(m, r, l, n)) for r in rounds]
            nws = [nb_of(tag_of(m, r, l, n)) for r in rounds]
            prs = per_round([ratio((w or {}).get("p99_ms"), alone_p99_in(l, r)) for r, w in zip(rounds, lws)])
            wrs = per_round([ratio((w or {}).get("work_per_s"), alone_work_in(n, r)) for r, w in zip(rounds, nws)])
            spread[(l, n, m)] = (prs, wrs)
            lw, nw = merged(lws), merged(nws)
            pr, wr = prs[0], wrs[0]
            peers[m] = (pr, (nw or {}).get("work_per_s"))
            rows.append([l, n, m, lw, nw, pr, wr, ""])
            s = summary[m]
            s["pairs"] += 1
            s["p99_ok"] += pr is not None and pr <= limit
            if wr is not None:
                s["work"].append(wr)
        # the verdict of the vgpu rows against the best peer that kept the p99
        best = [w for m, (pr, w) in peers.items() if m in ("plain", "mps", "mps50") and pr is not None and pr <= limit and w is not None]
        for row in rows:
            if row[0] == l and row[1] == n and row[2] in VGPU_MODES:
                pr, work = peers[row[2]]
                if alone_p99[l] is None:
                    row[7] = "? (no alone)"
                elif pr is None or work is None:
                    row[7] = "miss (no data)"
                elif pr <= limit and (not best or work >= max(best)):
                    row[7] = "ok"
                else:
                    row[7] = "miss"
                summary[row[2]]["ok"] += row[7] == "ok"

    def f(v, nd=3):
        return "-" if v is None or v == -1 else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))

    tsv = ["latency\tneighbour\tmode\tsteps\tp50_ms\tp99_ms\tp999_ms\tmax_ms\tp99_vs_alone\twork_per_s\tunit\twork_vs_alone\tchunk_ms_p50\tverdict\tp99_vs_target"]
    table = [
        f"closed loop: latency tenants next to neighbours on one GPU, window {args.window} s"
        + (f" (vgpu rows {args.vgpu_window} s)" if args.vgpu_window and args.vgpu_window != args.window else "")
        + "; verdict of a vgpu row: "
        f"ok when p99 <= {limit}x alone and the neighbour is at least as fast as the best of plain/mps/mps50 "
        f"that also kept p99 <= {limit}x",
        "machine: " + ("; ".join(sorted(machine)) or "unknown"),
        "",
        "| latency | neighbour | mode | p50 ms | p99 ms | p99 / alone | neighbour work | unit | work / alone | 2nd half: p99 / work | verdict | p99 / its target |",
        "| --- | --- | --- | --: | --: | --: | --: | --- | --: | --: | --- | --: |",
    ]
    held = {}  # per vgpu mode, each pair's p99 against the target in force
    for l, n, m, lw, nw, pr, wr, verdict in rows:
        lw, nw = lw or {}, nw or {}
        # the window's second half against the same alone figures: what a pair that stays
        # together past the controller's learning gets (informative; the verdict is the window's)
        late_pr = ratio(lw.get("p99_late_ms"), alone_p99.get(l)) if l != "-" else None
        late_wr = ratio(nw.get("work_per_s_late"), alone_work.get(n)) if n != "-" else None
        late = "-" if late_pr is None and late_wr is None else f"{f(late_pr, 2)} / {f(late_wr, 2)}"
        target = learnt_target_ms(args.logs, m, l, n) if m in VGPU_MODES else None
        vs_target = ratio(lw.get("p99_ms"), target)
        if vs_target is not None and n != "-":
            held.setdefault(m, []).append(vs_target)
        shown = "" if vs_target is None else f"{vs_target:.2f} ({target:.2f} ms)"

        def ranged(value, which):
            # with rounds, the median and the rounds' range
            rng = (spread.get((l, n, m)) or (None, None))[which]
            if len(rounds) > 1 and rng and rng[1] is not None:
                return f"{f(value, 2)} [{rng[1]:.2f}-{rng[2]:.2f}]"
            return f(value, 2)
        table.append(
            f"| {l} | {n} | {m} | {f(lw.get('p50_ms'))} | {f(lw.get('p99_ms'))} | {ranged(pr, 0)} | "
            f"{f(nw.get('work_per_s'), 1)} | {nw.get('unit', '')} | {ranged(wr, 1)} | {late} | {verdict} | {shown} |"
        )
        tsv.append("\t".join(f(v) if not isinstance(v, str) else v for v in (
            l, n, m, lw.get("steps"), lw.get("p50_ms"), lw.get("p99_ms"), lw.get("p999_ms"), lw.get("max_ms"),
            None if pr is None else round(pr, 3), nw.get("work_per_s"), nw.get("unit", ""),
            None if wr is None else round(wr, 3), nw.get("chunk_ms_p50"), verdict,
            None if vs_target is None else round(vs_target, 3))))
    table.append("")
    for l in lats:
        w = lat_of(f"alone:{l}:-")
        if w and w.get("p50_ms", -1) > 0 and not 1.5 <= w["period_ms"] / w["p50_ms"] <= 4:
            problems.append(f"{l}: period {w['period_ms']} ms is not ~2x its alone p50 {w['p50_ms']} ms: "
                            f"set PERIODS='{l}={max(0.5, round(2 * w['p50_ms'] * 4) / 4)}'")
    # A baseline with a p99 over twice its p50 alone was disturbed (another process, a throttled
    # clock): every ratio against it flatters the modes. Reported, and the run exits 5.
    disturbed = []
    for l in lats:
        w = baseline[l]
        if w and w.get("p50_ms", -1) > 0 and w.get("p99_ms", -1) > BASELINE_MAX_P99_OVER_P50 * w["p50_ms"]:
            disturbed.append(l)
            problems.append(f"{l}: DISTURBED BASELINE: alone p99 {w['p99_ms']} ms > {BASELINE_MAX_P99_OVER_P50}x its p50 "
                            f"{w['p50_ms']} ms; rerun on a quiet machine before comparing this run's ratios")
    for m, s in summary.items():
        work = s["work"]
        line = (f"mode {m}: p99 <= {limit}x alone in {s['p99_ok']}/{s['pairs']} pairs; neighbour "
                + (f"median {statistics.median(work):.2f}x alone (min {min(work):.2f}x)" if work else "no data"))
        if m in VGPU_MODES:
            line += f"; verdict ok in {s['ok']}/{s['pairs']}"
            if held.get(m):
                line += (f"; p99 within the target in force in {sum(v <= 1.0 for v in held[m])}/{len(held[m])} "
                         f"(worst {max(held[m]):.2f}x)")
        table.append(line)
    if problems:
        table.append("")
        table += ["problem: " + p for p in problems]
    with open(os.path.join(args.logs, "results.tsv"), "w") as out:
        out.write("\n".join(tsv) + "\n")
    with open(os.path.join(args.logs, "table.txt"), "w") as out:
        out.write("\n".join(table) + "\n")
    print("\n".join(table))
    # a pair's row lacking either side; the alone rows ("alone", "alone again", "vgpu-mps-alone")
    # have one side only
    missing = any(r[3] is None and r[4] is None for r in rows) or any(
        (r[3] is None or r[4] is None) and "alone" not in r[2] for r in rows)
    return 4 if missing else 5 if disturbed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in MAKERS:
        p = sub.add_parser(name)
        p.set_defaults(workload=name)
        p.add_argument("--name", default=name, help="this process in the schedule's `active` lists")
        p.add_argument("--start-at", type=float, default=None, help="one window from T (time.monotonic())")
        p.add_argument("--tag", default="window", help="the window's tag with --start-at")
        p.add_argument("--schedule", default="", help="the schedule file to wait for")
        p.add_argument("--ready", default="", help="touched once warmed up")
        p.add_argument("--window", type=float, default=8.0)
        p.add_argument("--settle", type=float, default=0.75, help="seconds run before the window, unmeasured")
        if name in LATENCY_PERIOD_MS:
            p.add_argument("--period-ms", type=float, default=0.0,
                           help=f"step period (default {LATENCY_PERIOD_MS[name]})")
    p = sub.add_parser("schedule")
    p.add_argument("--out", required=True)
    p.add_argument("--window", type=float, required=True)
    p.add_argument("--settle", type=float, required=True)
    p.add_argument("--gap", type=float, required=True)
    p.add_argument("--lead", type=float, default=0.5)
    p.add_argument("windows", nargs="*")
    p = sub.add_parser("cost-report")
    p.add_argument("--logs", required=True)
    p = sub.add_parser("report")
    p.add_argument("--logs", required=True)
    p.add_argument("--pairs", required=True)
    p.add_argument("--modes", required=True)
    p.add_argument("--window", type=float, default=0.0)
    p.add_argument("--vgpu-window", type=float, default=0.0)
    p.add_argument("--limit", type=float, default=1.2)
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of the matrix's windows (closed_loop.sh's PAIR_ROUNDS): ratios per round, medians")
    args = parser.parse_args()
    if args.command == "schedule":
        return schedule(args)
    if args.command == "report":
        return report(args)
    if args.command == "cost-report":
        return cost_report(args)
    if args.start_at is None and not (args.schedule and args.ready):
        parser.error("give --start-at, or --schedule and --ready")
    return workload(args)


if __name__ == "__main__":
    sys.exit(main())
