"""Workloads for tests/gpu/interposer_memory.sh, one per subcommand. Each prints what it saw as
one line `RESULT <json>` (last), so the shell script can check it; everything else is log.

  meminfo                      torch.cuda.mem_get_info()
  alloc_one GIB                one tensor of GIB GiB; reports torch's error if it fails
  alloc_chunks CHUNK_MIB       allocate chunks until the first failure; reports the total
  hold GIB                     allocate GIB GiB, print HOLDING, sleep until killed
  matmul_loop SECONDS GIB      hold GIB GiB, then matmuls for SECONDS, checking every result
"""
import json
import os
import sys
import time

import torch

GIB = 1 << 30
MIB = 1 << 20


def result(**fields):
    fields["pid"] = os.getpid()
    print("RESULT " + json.dumps(fields), flush=True)


def error_fields(e):
    return {"ok": False, "error_type": type(e).__name__, "message": str(e).splitlines()[0][:400]}


def meminfo():
    free, total = torch.cuda.mem_get_info()
    result(ok=True, free=free, total=total)


def alloc_one(gib):
    try:
        t = torch.empty(int(float(gib) * GIB), dtype=torch.uint8, device="cuda")
        t.fill_(1)
        torch.cuda.synchronize()
        result(ok=True, bytes=t.numel())
    except Exception as e:  # torch.OutOfMemoryError expected past the limit
        result(**error_fields(e))


def alloc_chunks(chunk_mib):
    chunk = int(chunk_mib) * MIB
    held = []
    error = None
    while len(held) < 4096:
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except Exception as e:
            error = e
            break
    fields = {"allocated": len(held) * chunk, "chunks": len(held)}
    if error is not None:
        fields.update(error_fields(error))
        fields["ok"] = True
    else:
        fields["ok"] = False
    fields["reserved"] = torch.cuda.memory_reserved()
    result(**fields)


def hold(gib):
    t = torch.empty(int(float(gib) * GIB), dtype=torch.uint8, device="cuda")
    t.fill_(1)
    torch.cuda.synchronize()
    print("HOLDING", flush=True)
    while True:
        time.sleep(3600)


def matmul_loop(seconds, gib):
    ballast = torch.empty(int(float(gib) * GIB), dtype=torch.uint8, device="cuda")
    ballast.fill_(7)
    n = 4096
    g = torch.Generator(device="cpu").manual_seed(1)
    a = torch.randint(-4, 5, (n, n), generator=g, dtype=torch.float32)
    b = torch.randint(-4, 5, (n, n), generator=g, dtype=torch.float32)
    # Small integers: the fp32 products are exact, so every result must equal the reference.
    reference = (a.double() @ b.double()).float().cuda()
    a, b = a.cuda(), b.cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    print("RUNNING", flush=True)
    deadline = time.time() + float(seconds)
    iterations = mismatches = 0
    error = None
    try:
        while time.time() < deadline:
            c = a @ b
            if not torch.equal(c, reference):
                mismatches += 1
            iterations += 1
        torch.cuda.synchronize()
        if int(ballast[::MIB].min()) != 7:
            mismatches += 1
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    result(ok=error is None and mismatches == 0 and iterations > 0, iterations=iterations,
           mismatches=mismatches, error=error)


def main():
    command, args = sys.argv[1], sys.argv[2:]
    {"meminfo": meminfo, "alloc_one": alloc_one, "alloc_chunks": alloc_chunks, "hold": hold,
     "matmul_loop": matmul_loop}[command](*args)


if __name__ == "__main__":
    main()
