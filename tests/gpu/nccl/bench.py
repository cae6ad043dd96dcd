"""One NCCL job for the vgpu NCCL scripts: correctness on random data, then timed bandwidth.

Started by torchrun (one process per rank). Rank 0 appends one JSON line to --out.

Correctness: every rank fills its tensors with small random integers from a seed derived from its
rank, so every rank can compute the exact expected result of each collective (float32 sums of
integers below 2^24 are exact).

Timing: after --lead seconds of warm-up (so that two jobs started together overlap fully), the op
runs back to back for --seconds; each iteration is timed with CUDA events. Bus bandwidth follows
nccl-tests: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, broadcast and send/recv 1.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"]


def rand_ints(seed, n, device):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return torch.randint(-100, 100, (n,), generator=g, dtype=torch.int32).to(torch.float32).to(device)


def check(op, rank, world, dev, n):
    """Run `op` once on random data and compare with the exact expected result."""
    mine = rand_ints(1000 + rank, n, dev)
    if op == "all_reduce":
        t = mine.clone()
        dist.all_reduce(t)
        want = sum(rand_ints(1000 + r, n, dev) for r in range(world))
    elif op == "all_gather":
        out = torch.empty(n * world, device=dev)
        dist.all_gather_into_tensor(out, mine)
        t, want = out, torch.cat([rand_ints(1000 + r, n, dev) for r in range(world)])
    elif op == "reduce_scatter":
        big = rand_ints(2000 + rank, n * world, dev)
        t = torch.empty(n, device=dev)
        dist.reduce_scatter_tensor(t, big)
        want = sum(rand_ints(2000 + r, n * world, dev) for r in range(world))[rank * n:(rank + 1) * n]
    elif op == "broadcast":
        t = mine.clone()
        dist.broadcast(t, src=1 % world)
        want = rand_ints(1000 + 1 % world, n, dev)
    elif op == "send_recv":
        # a ring: each rank sends to rank+1 and receives from rank-1
        t = torch.empty(n, device=dev)
        ops = [dist.P2POp(dist.isend, mine, (rank + 1) % world),
               dist.P2POp(dist.irecv, t, (rank - 1) % world)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        want = rand_ints(1000 + (rank - 1) % world, n, dev)
    else:
        raise ValueError(op)
    torch.cuda.synchronize()
    return bool(torch.equal(t, want))


def timed(op, rank, world, dev, nbytes, lead, seconds, start_at=0.0):
    n = nbytes // 4
    if op == "all_reduce":
        x = torch.ones(n, device=dev)
        fn = lambda: dist.all_reduce(x)
        factor = 2 * (world - 1) / world
    elif op == "all_gather":
        x = torch.ones(n // world, device=dev)
        out = torch.empty(n // world * world, device=dev)
        fn = lambda: dist.all_gather_into_tensor(out, x)
        factor = (world - 1) / world
    elif op == "reduce_scatter":
        x = torch.ones(n // world * world, device=dev)
        out = torch.empty(n // world, device=dev)
        fn = lambda: dist.reduce_scatter_tensor(out, x)
        factor = (world - 1) / world
    elif op == "broadcast":
        x = torch.ones(n, device=dev)
        fn = lambda: dist.broadcast(x, src=0)
        factor = 1.0
    else:
        x = torch.ones(n, device=dev)
        y = torch.empty(n, device=dev)

        def fn():
            ops = [dist.P2POp(dist.isend, x, (rank + 1) % world),
                   dist.P2POp(dist.irecv, y, (rank - 1) % world)]
            for r in dist.batch_isend_irecv(ops):
                r.wait()
        factor = 1.0
    # warm up for `lead` seconds, or until `start_at` (wall clock) if that is later: two jobs
    # given the same start_at measure the same window even if one took longer to initialise
    end = max(time.time() + lead, start_at)
    while True:
        fn()
        torch.cuda.synchronize()
        flag = torch.tensor([1 if time.time() < end else 0], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 0:
            break
    times = []
    start = time.time()
    while True:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000.0)
        if len(times) % 4 == 0:
            flag = torch.tensor([1 if time.time() - start < seconds else 0], device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if flag.item() == 0:
                break
    wall = time.time() - start
    times.sort()
    iters = len(times)
    busbw = factor * nbytes * iters / wall / 1e9
    return {"iters": iters, "wall_s": wall, "start_unix": start, "busbw_gbs": busbw,
            "p50_ms": times[iters // 2] * 1e3, "p99_ms": times[min(iters - 1, int(iters * 0.99))] * 1e3}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--label", default="job")
    p.add_argument("--ops", default="all_reduce")
    p.add_argument("--check", default="", help="comma-separated ops to check for correctness")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--lead", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--start-at", type=float, default=0.0,
                   help="unix time at which the first timed op starts (after at least --lead of warm-up)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    ngpu = torch.cuda.device_count()
    gpu = int(os.environ.get("BENCH_GPU_OF_RANK", "").split(",")[local]) if os.environ.get("BENCH_GPU_OF_RANK") else local % ngpu
    torch.cuda.set_device(gpu)
    dev = torch.device("cuda", gpu)
    dist.init_process_group("nccl", device_id=dev)
    result = {"label": a.label, "world": world, "mib": a.mib, "checks": {}, "ops": {}}
    for op in [o for o in a.check.split(",") if o]:
        ok = check(op, rank, world, dev, 1 << 20)
        flag = torch.tensor([1 if ok else 0], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        result["checks"][op] = bool(flag.item() == 1)
    for i, op in enumerate(o for o in a.ops.split(",") if o):
        result["ops"][op] = timed(op, rank, world, dev, a.mib << 20, a.lead, a.seconds,
                                  a.start_at if i == 0 else 0.0)
    if rank == 0:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
