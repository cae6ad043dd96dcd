"""Workloads of tests/gpu/fault_matrix.sh (issue 15, point 6: what a fatal fault of one tenant does
to the other, under each way of sharing a GPU).

  victim --out FILE --seconds S [--linger L]
        a latency tenant: a checked fp32 matmul chain (small integers: every result exact, compared
        with a float64 reference) synchronised every step, one step every 3 ms, for S seconds.
        The first CUDA error ends the stepping; the process then lingers L seconds with its
        broken context (as a server that catches the exception would) before it exits 1. Writes
        FILE (JSON: step end times and latencies, mismatches, the first error and when)
  faulter --mode illegal|kill --after A
        the tenant that faults: bf16 8192^3 matmuls back to back (work always queued); after A
        seconds, `illegal` launches a kernel that stores through a null pointer (driver API via
        ctypes) and synchronises; `kill` prints KILL_ME and keeps launching (the script sends
        SIGKILL, with kernels in flight)
  probe
        a new client after the fault: CUDA init, one checked matmul; prints the time it took or
        its error (MPS refuses new clients until every client of a faulted server has exited)
  analyze --logs DIR
        reads the runs in DIR and prints the table (and writes DIR/results.tsv)

Every subcommand prints `RESULT {json}` last. Times are time.time() (common to all processes).
"""

import argparse
import json
import os
import sys
import time

# The checked matmuls and the null-pointer store are isolation.py's (issue 3's fault tests).
from isolation import checked_setup, launch_illegal_store

PERIOD_S = 0.003


def emit(tag, **fields):
    fields.setdefault("pid", os.getpid())
    print(f"{tag} " + json.dumps(fields), flush=True)


def first_line(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"


def victim(args):
    import torch

    ends, latencies, mismatches, error, error_t = [], [], 0, None, None
    try:
        a, b, reference = checked_setup(1)
        torch.cuda.synchronize()
    except Exception as e:
        emit("RESULT", ok=False, error=first_line(e), error_t=time.time(), started=False)
        return 1
    emit("READY", t=time.time())
    stop = time.time() + args.seconds
    next_t = time.time()
    while time.time() < stop:
        t0 = time.time()
        try:
            c = a @ b
            ok = torch.equal(c, reference)  # synchronises
        except Exception as e:
            error, error_t = first_line(e), time.time()
            emit("ERROR", error=error, t=error_t)
            break
        t1 = time.time()
        ends.append(t1)
        latencies.append(t1 - t0)
        mismatches += 0 if ok else 1
        next_t = max(next_t + PERIOD_S, t1)
        time.sleep(max(0.0, next_t - time.time()))
    if error is not None and args.linger > 0:
        time.sleep(args.linger)
    with open(args.out, "w") as f:
        json.dump({"ends": ends, "latencies": latencies, "mismatches": mismatches,
                   "error": error, "error_t": error_t}, f)
    emit("RESULT", ok=error is None and mismatches == 0, steps=len(ends), mismatches=mismatches,
         error=error, error_t=error_t)
    return 0 if error is None else 1


def faulter(args):
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    emit("READY", t=time.time())
    start = time.time()
    launched = 0
    while time.time() - start < args.after:
        c = a @ b
        launched += 1
        if launched % 8 == 0:
            torch.cuda.synchronize()
    if args.mode == "illegal":
        for _ in range(4):
            c = a @ b
        how = launch_illegal_store()
        emit("FAULT", t=time.time(), how=how)
        try:
            torch.cuda.synchronize()
            emit("RESULT", error=None)
        except Exception as e:
            emit("RESULT", error=first_line(e))
        os._exit(1)
    emit("KILL_ME", t=time.time())
    while True:  # kernels always queued until SIGKILL
        c = a @ b
        launched += 1
        if launched % 16 == 0:
            torch.cuda.synchronize()


def probe(_args):
    t0 = time.time()
    try:
        import torch

        a, b, reference = checked_setup(2)
        ok = torch.equal(a @ b, reference)
        emit("RESULT", ok=ok, seconds=round(time.time() - t0, 3), error=None)
        return 0
    except Exception as e:
        emit("RESULT", ok=False, seconds=round(time.time() - t0, 3), error=first_line(e))
        return 1


def read_result(path):
    try:
        lines = [l for l in open(path, errors="replace") if l.startswith("RESULT ")]
        return json.loads(lines[-1][len("RESULT "):]) if lines else None
    except (OSError, ValueError):
        return None


def marker(path, tag):
    try:
        for line in open(path, errors="replace"):
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
    except (OSError, ValueError):
        pass
    return None


def analyze(args):
    rows = []
    for run in sorted(os.listdir(args.logs)):
        folder = os.path.join(args.logs, run)
        if not os.path.isdir(folder) or ":" not in run:
            continue
        mode, fault = run.split(":", 1)
        fault_t = None
        m = marker(os.path.join(folder, "faulter.log"), "FAULT")
        if m:
            fault_t = m["t"]
        try:
            fault_t = fault_t or float(open(os.path.join(folder, "killed_at")).read())
        except (OSError, ValueError):
            pass
        data = {}
        try:
            data = json.load(open(os.path.join(folder, "victim.json")))
        except (OSError, ValueError):
            pass
        res = read_result(os.path.join(folder, "victim.log"))
        ends, lat = data.get("ends", []), data.get("latencies", [])
        if res is None:
            outcome = "HUNG/killed (no result)"
        elif res.get("error"):
            outcome = "died: " + res["error"][:70]
        elif res.get("mismatches"):
            outcome = f"WRONG RESULTS ({res['mismatches']})"
        else:
            outcome = "survived"
        after = [e for e in ends if fault_t and e > fault_t]
        worst = None
        if fault_t:
            around = [l for e, l in zip(ends, lat) if fault_t - 0.1 <= e <= fault_t + 2.0]
            worst = max(around) * 1000 if around else None
        alone = sorted(l for e, l in zip(ends, lat) if not fault_t or e < fault_t - 0.2)
        p50 = alone[len(alone) // 2] * 1000 if alone else None
        pr = read_result(os.path.join(folder, "probe.log"))
        probe_s = "-" if pr is None else (f"ok in {pr['seconds']} s" if pr.get("ok") else f"failed after {pr.get('seconds')} s: {(pr.get('error') or '')[:60]}")
        probe_after = None
        try:
            probe_after = float(open(os.path.join(folder, "probe_at")).read()) - fault_t if fault_t else None
        except (OSError, ValueError):
            pass
        pr2 = read_result(os.path.join(folder, "probe2.log"))
        probe2_s = "-" if pr2 is None else ("ok" if pr2.get("ok") else f"failed: {(pr2.get('error') or '')[:50]}")
        try:
            probe2_after = float(open(os.path.join(folder, "probe2_at")).read()) - fault_t if fault_t else None
        except (OSError, ValueError):
            probe2_after = None
        rows.append((mode, fault, outcome, len(after), p50, worst, probe_s, probe_after,
                     probe2_s, probe2_after))

    def f(v, nd=1):
        return "-" if v is None else f"{v:.{nd}f}"

    out = ["| mode | fault of the neighbour | victim | victim steps after | victim p50 before ms | worst step around ms | new client (started s after the fault) | later new client |",
           "| --- | --- | --- | --: | --: | --: | --- | --- |"]
    tsv = ["mode\tfault\tvictim\tsteps_after\tp50_ms\tworst_ms\tprobe\tprobe_after_s\tprobe2\tprobe2_after_s"]
    for row in rows:
        mode, fault, outcome, n_after, p50, worst, probe_s, probe_after, probe2_s, probe2_after = row
        out.append(f"| {mode} | {fault} | {outcome} | {n_after} | {f(p50, 2)} | {f(worst)} | {probe_s} ({f(probe_after)} s) | {probe2_s} ({f(probe2_after)} s) |")
        tsv.append("\t".join(str(x) for x in row))
    with open(os.path.join(args.logs, "results.tsv"), "w") as fh:
        fh.write("\n".join(tsv) + "\n")
    print("\n".join(out))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("victim")
    v.add_argument("--out", required=True)
    v.add_argument("--seconds", type=float, default=8.0)
    v.add_argument("--linger", type=float, default=5.0)
    fa = sub.add_parser("faulter")
    fa.add_argument("--mode", choices=["illegal", "kill"], required=True)
    fa.add_argument("--after", type=float, default=2.0)
    sub.add_parser("probe")
    an = sub.add_parser("analyze")
    an.add_argument("--logs", required=True)
    args = p.parse_args()
    return {"victim": victim, "faulter": faulter, "probe": probe, "analyze": analyze}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
