"""Reads a closed_loop.sh run's agent trace (RUST_LOG=...,vgpu_agent::closed_loop::window=debug) and
prints, for every window of a vgpu group, what the controller did: the share of time at each
level, the latency tenant's targets during the window (each change with its time), its steps
and window p99s at the top level (Exclusive: nothing else launches, so a step there over the
target is the tenant's own or something the levers do not hold), and the neighbours' hold time.
The questions the twenty-third session answered by hand: where did a target come from, and did
the tenant meet it where nothing else ran.

  python3 tests/gpu/trace_summary.py OUT/closed_loop        # a run's folder, its .tgz, or a folder holding it
  python3 tests/gpu/trace_summary.py OUT/closed_loop --series vgpu-mps:decoder:gemm [--bin 0.25]

--series TAG prints that window as a time series instead, one row per BIN seconds: the levels
held (trace lines at each), the latency tenant's steps, the steps over its target counted in the
bin, and the worst window p99 in it (the thirtieth session's question: where in the window did
the controller probe a level that failed, and what did it cost).
"""
import json
import os
import re
import sys
import tarfile
import tempfile
from collections import Counter, defaultdict
from datetime import datetime, timezone

LINE = re.compile(
    r"^(\S+)Z DEBUG vgpu_agent::closed_loop::window: (\S+) level (\d+) neighbours (\w+) open (\S+) "
    r"paused ([\d.]+) ms bounded (\d+): (.*?); controller (.*)$"
)
TENANT = re.compile(r"(lat-[\w-]+): (\d+) steps p50 ([\d.]+) p99 ([\d.]+) ms")
TARGET = re.compile(r"(lat-[\w-]+) target ([\d.]+) violations (\d+)")


def seconds(stamp):
    """A trace line's UTC time as seconds since the epoch."""
    layout = "%Y-%m-%dT%H:%M:%S.%f" if "." in stamp else "%Y-%m-%dT%H:%M:%S"
    return datetime.strptime(stamp[:26], layout).replace(tzinfo=timezone.utc).timestamp()


def trace(folder):
    """Every window line of agent.log: (time, level, neighbours active, paused ms, {tenant: (steps,
    p99)}, {tenant: target ms})."""
    rows = []
    with open(os.path.join(folder, "agent.log"), errors="replace") as log:
        for line in log:
            m = LINE.match(line.strip())
            if not m:
                continue
            tenants = {t: (int(n), float(p99)) for t, n, _, p99 in TENANT.findall(m.group(8))}
            targets = {t: float(ms) for t, ms, _ in TARGET.findall(m.group(8))}
            rows.append((seconds(m.group(1)), int(m.group(3)), m.group(4) == "true", float(m.group(6)),
                         tenants, targets))
    return rows


def groups(folder):
    """The vgpu groups' schedules: (group, plan)."""
    found = []
    for group in sorted(os.listdir(folder)):
        schedule = os.path.join(folder, group, "schedule.json")
        if group.startswith("vgpu") and os.path.exists(schedule):
            with open(schedule) as f:
                found.append((group, json.load(f)))
    return found


LATENCY_WORKLOADS = ("decoder", "eager", "bert", "launches")


def anchor(rows, plan):
    """The agent's time of the group's first window with a latency tenant, less the schedule's
    offset of that window: the processes keep their context idle between windows, so the first
    trace line with steps of that tenant after a second without any is its window's settle."""
    for w in plan["windows"]:
        lats = [a for a in w["active"] if a in LATENCY_WORKLOADS]
        if not lats:
            continue
        name = f"lat-{lats[0]}"
        last = None
        for t, _, _, _, tenants, _ in rows:
            if tenants.get(name, (0, 0))[0] == 0:
                continue
            if last is not None and t - last >= 1.0:
                return t - (w["start"] - plan.get("settle", 0.75))
            last = t
        return None
    return None


VIOLATIONS = re.compile(r"(lat-[\w-]+) target [\d.]+ violations (\d+)")


def series(folder, begin, window, lat, bin_s):
    """One window's trace lines in bins of `bin_s` seconds: (start s, levels, steps, violations, worst p99)."""
    bins = {}
    with open(os.path.join(folder, "agent.log"), errors="replace") as log:
        for line in log:
            m = LINE.match(line.strip())
            if not m:
                continue
            t = seconds(m.group(1))
            if not begin <= t < begin + window:
                continue
            tenants = {n: (int(s), float(p)) for n, s, _, p in TENANT.findall(m.group(8))}
            counts = {n: int(v) for n, v in VIOLATIONS.findall(m.group(8))}
            b = bins.setdefault(int((t - begin) / bin_s), [Counter(), 0, [], 0.0])
            b[0][int(m.group(3))] += 1
            b[1] += tenants.get(lat, (0, 0.0))[0]
            if lat in counts:
                b[2].append(counts[lat])
            b[3] = max(b[3], tenants.get(lat, (0, 0.0))[1])
    rows = []
    for k in sorted(bins):
        levels, steps, violations, worst = bins[k]
        over = violations[-1] - violations[0] if violations else 0
        rows.append((k * bin_s, dict(sorted(levels.items())), steps, over, worst))
    return rows


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "."
    tag = None
    bin_s = 0.25
    if "--series" in sys.argv:
        tag = sys.argv[sys.argv.index("--series") + 1]
    if "--bin" in sys.argv:
        bin_s = float(sys.argv[sys.argv.index("--bin") + 1])
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "agent.log")):
        # closed_loop.sh packs its logs on a GPU machine: the archive inside the folder, or beside it
        for packed in (os.path.join(path, "closed_loop.tgz"), path.rstrip("/") + ".tgz"):
            if os.path.exists(packed):
                path = packed
                break
    if path.endswith((".tgz", ".tar.gz")):
        tmp = tempfile.mkdtemp()
        with tarfile.open(path) as tar:
            tar.extractall(tmp, filter="data")
        path = os.path.join(tmp, "closed_loop")
    rows = trace(path)
    if not rows:
        print(f"no closed-loop trace in {path}/agent.log (run with "
              "RUST_LOG=...,vgpu_agent::closed_loop::window=debug)")
        return 1
    top = max(level for _, level, *_ in rows)
    # The schedules' times are one machine's CLOCK_MONOTONIC and the trace's its wall clock: one
    # offset for every group, found from the group that ran first (a second group's anchor found
    # by the same search would land on the first group's windows again).
    offset = None
    for group, plan in sorted(groups(path), key=lambda g: min((w["start"] for w in g[1]["windows"]),
                                                              default=0)):
        if offset is None:
            offset = anchor(rows, plan)
        if offset is None:
            print(f"{group}: its latency tenants' windows are not in the trace")
            continue
        # the top of this group's ladder (an agent without MPS has no SM levels)
        span = [r for r in rows if offset + min(w["start"] for w in plan["windows"]) - 1 <= r[0]
                < offset + max(w["start"] for w in plan["windows"]) + plan["window"]]
        top = max((r[1] for r in span), default=top)
        if tag is not None:
            for w in plan["windows"]:
                if w["tag"] != tag:
                    continue
                lats = [a for a in w["active"] if a in LATENCY_WORKLOADS]
                lat = f"lat-{lats[0]}" if lats else ""
                print(f"== {tag}: bins of {bin_s} s (levels: trace lines at each)")
                print("| s | levels | steps | over the target | worst window p99 ms |")
                print("| --: | --- | --: | --: | --: |")
                for start, levels, steps, over, worst in series(path, offset + w["start"],
                                                                 plan["window"], lat, bin_s):
                    shown = " ".join(f"L{lv}:{n}" for lv, n in levels.items())
                    print(f"| {start:.2f} | {shown} | {steps} | {over} | {worst:.3f} |")
            continue
        print(f"== {group}: {len(plan['windows'])} windows of {plan['window']} s; levels 0-{top}")
        print("| window | time at each level | target ms (at s into the window) | at the top: "
              "steps, windows over the target | neighbours held (counted as a held launch goes) |")
        print("| --- | --- | --- | --- | --- |")
        for w in plan["windows"]:
            lats = [a for a in w["active"] if a in LATENCY_WORKLOADS]
            begin = offset + w["start"]
            inside = [r for r in rows if begin <= r[0] < begin + plan["window"]]
            if not inside:
                print(f"| {w['tag']} | no trace lines | | | |")
                continue
            levels = Counter(r[1] for r in inside)
            shares = " ".join(f"L{lv} {n * 100 // len(inside)}%" for lv, n in sorted(levels.items())
                              if n * 100 // len(inside))
            changes = defaultdict(list)
            for t, _, _, _, _, targets in inside:
                for name, ms in targets.items():
                    if name.removeprefix("lat-") in lats and (not changes[name] or changes[name][-1][1] != ms):
                        changes[name].append((t - begin, ms))
            target_text = "; ".join(
                ", ".join(f"{ms:.2f}@{at:.1f}" for at, ms in seen) for seen in changes.values())
            top_steps = top_over = 0
            for _, level, _, _, tenants, targets in inside:
                for name, (steps, p99) in tenants.items():
                    if level == top and steps and name.removeprefix("lat-") in lats:
                        top_steps += steps
                        top_over += 0 < targets.get(name, 0) < p99
            held = sum(r[3] for r in inside)
            print(f"| {w['tag']} | {shares} | {target_text} | {top_steps}, {top_over} | {held:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
