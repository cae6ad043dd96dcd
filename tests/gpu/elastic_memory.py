"""Tenant workloads for tests/gpu/elastic_memory.sh (elastic memory, issue 17), PyTorch's default
caching allocator (cudaMalloc, so cuMemAlloc_v2: the path that borrows VMM-backed). Never
allocates managed memory. Prints `RESULT {json}` last.

  grow TARGET_BYTES LIMIT_BYTES READY STOP WAIT_S [tick] [hint] [cold]
      holds 1 GiB tensors of random bytes until TARGET_BYTES are held (past the tenant's request),
      checksums them, tries once to go past LIMIT_BYTES (expected: refused), touches READY, waits
      (at most WAIT_S seconds) for STOP to exist, then checks the checksums again. With `tick`
      it launches a tiny kernel every 10 ms while it waits (a borrower that keeps working: the
      swap acts at its launches), counting the launches refused (held past the hold's bound).
      With `hint` it starts vgpu's hint helper (`vgpu.torch.enable()`, deploy/python) and then
      drops its second half of tensors before READY: PyTorch's caching allocator keeps their
      blocks (reserved, not allocated), which the helper gives back by `empty_cache()` when
      vgpu asks; only the first half is checksummed again. With `cold` it marks its second half
      of tensors cold (`vgpu.torch.mark_cold`) and reports their addresses (`cold_ptrs`) and the
      bytes marked: a reclaim must take those first.
      Options (swap_exchange.sh): `go=PATH` launches the tiny kernels (with `tick`) only once
      PATH exists, idle before; `more=BYTES` allocates BYTES more in one tensor after READY
      (past what the GPU has free: it waits in the GPU's line) and reports when it got it, once
      the file `more_go=PATH` exists if given.
  request BYTES [READY STOP WAIT_S]
      allocates BYTES in 1 GiB tensors and says how much it got, how long that took, and whether
      it got an out-of-memory error; with READY STOP WAIT_S it then touches READY and holds the
      memory until STOP exists (at most WAIT_S seconds).
  link GIB
      the host link's ceiling with pinned memory and torch copies: device to host, host to
      device, and both at once on two streams (GIB each way, 1 GiB copies).
  copies BYTES SECONDS
      the copy engines' own traffic, without vgpu: BYTES (in 1 GiB pieces) to pinned host memory
      and back, round after round for SECONDS, as a swap-out and its swap-in move them; reports
      when the rounds ran (CLOCK_MONOTONIC, as closed_loop.py's windows) and the rate. A latency
      tenant's seconds during them are the cost of the copy traffic alone, which the swap's may
      not exceed (issue 17's third check).
"""
import json
import pathlib
import sys
import time

import torch

GIB = 1 << 30


def info():
    free, total = torch.cuda.mem_get_info()
    return {"free": free, "total": total}


def checksum(tensor):
    # In 64 MiB pieces: a sum in int64 of the whole tensor makes an int64 copy of it first (8x
    # its size), which a tenant at its limit cannot allocate (the first GPU run died so).
    return sum(int(piece.sum(dtype=torch.int64).item()) for piece in tensor.split(1 << 26))


def grow(target, limit, ready, stop, wait_s, tick=False, hint=False, cold=False, go=None, more=0,
         more_go=None):
    result = {"info_start": info()}
    if hint or cold:
        # deploy/python holds the helper (a tenant copies it next to its program)
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "deploy" / "python"))
        import logging

        import vgpu.torch

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        if hint:
            result["hint_helper"] = vgpu.torch.enable()
    held, sums = [], []
    error = None
    try:
        while len(held) * GIB < target:
            tensor = torch.randint(0, 256, (GIB,), dtype=torch.uint8, device="cuda")
            held.append(tensor)
            sums.append(checksum(tensor))
    except torch.cuda.OutOfMemoryError as e:
        error = str(e).splitlines()[0]
    torch.cuda.synchronize()
    result["held_bytes"] = len(held) * GIB
    result["grow_error"] = error
    result["info_grown"] = info()
    # Past the limit: one allocation that would take the tenant over it.
    past = limit - len(held) * GIB + GIB
    try:
        extra = torch.empty(past, dtype=torch.uint8, device="cuda")
        result["past_limit"] = "granted"
        del extra
    except torch.cuda.OutOfMemoryError:
        result["past_limit"] = "refused"
    torch.cuda.empty_cache()
    if hint:
        # The second half goes to PyTorch's cache: reserved, not allocated (what the helper frees).
        keep = len(held) // 2
        tensor = None  # the growing loop's last tensor, which would stay allocated
        del held[keep:], sums[keep:]
        torch.cuda.synchronize()
        result["cached_bytes"] = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if cold:
        marked = held[len(held) // 2:]
        result["cold_marked_bytes"] = sum(vgpu.torch.mark_cold(t) for t in marked)
        result["cold_ptrs"] = [hex(t.untyped_storage().data_ptr()) for t in marked]
    result["info_held"] = info()
    counter = torch.zeros(1, dtype=torch.int64, device="cuda") if tick else None
    ticks, refused = 0, 0
    pathlib.Path(ready).touch()
    deadline = time.monotonic() + wait_s
    extra = None
    while more_go is not None and not pathlib.Path(more_go).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    if more:
        began = time.monotonic()
        try:
            extra = torch.empty(more, dtype=torch.uint8, device="cuda")
            result["more"] = "granted"
        except torch.cuda.OutOfMemoryError as e:
            result["more"] = "refused: " + str(e).splitlines()[0]
        result["more_seconds"] = round(time.monotonic() - began, 3)
    while not pathlib.Path(stop).exists() and time.monotonic() < deadline:
        if counter is None or (go is not None and not pathlib.Path(go).exists()):
            time.sleep(0.01)
            continue
        try:
            counter += 1
            ticks += 1
        except RuntimeError:
            refused += 1
        time.sleep(0.01)
    del extra
    result["stopped"] = pathlib.Path(stop).exists()
    result["ticks"] = ticks
    result["tick_refusals"] = refused
    result["checksums_ok"] = all(checksum(t) == s for t, s in zip(held, sums))
    result["tensors"] = len(held)
    if hint:
        result["reserved_end"] = torch.cuda.memory_reserved()
    print("RESULT " + json.dumps(result), flush=True)


def request(wanted, ready=None, stop=None, wait_s=0.0):
    result = {"info_start": info()}
    held = []
    error = None
    began = time.monotonic()
    try:
        while len(held) * GIB < wanted:
            held.append(torch.empty(min(GIB, wanted - len(held) * GIB), dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as e:
        error = str(e).splitlines()[0]
    torch.cuda.synchronize()
    result["seconds"] = round(time.monotonic() - began, 3)
    # when the allocation ran (CLOCK_MONOTONIC, as closed_loop.py's windows): a latency tenant's
    # seconds during the reclaim are told from the others by these
    result["t_begin"] = round(began, 3)
    result["t_end"] = round(time.monotonic(), 3)
    result["granted_bytes"] = sum(t.numel() for t in held)
    result["oom"] = error is not None
    result["error"] = error
    result["info_end"] = info()
    if ready is not None:
        print("RESULT " + json.dumps(result), flush=True)
        pathlib.Path(ready).touch()
        deadline = time.monotonic() + wait_s
        while not pathlib.Path(stop).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    print("RESULT " + json.dumps(result), flush=True)


def link(gib):
    """The host link's rates with pinned memory (GB/s): each way alone, then both at once."""
    n = max(1, gib)
    dev_out = [torch.randint(0, 256, (GIB,), dtype=torch.uint8, device="cuda") for _ in range(n)]
    dev_in = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in range(n)]
    host_out = [torch.empty(GIB, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    host_in = [torch.randint(0, 256, (GIB,), dtype=torch.uint8).pin_memory() for _ in range(n)]
    s_out, s_in = torch.cuda.Stream(), torch.cuda.Stream()

    def run(out, inn):
        torch.cuda.synchronize()
        began = time.monotonic()
        for i in range(n):
            if out:
                with torch.cuda.stream(s_out):
                    host_out[i].copy_(dev_out[i], non_blocking=True)
            if inn:
                with torch.cuda.stream(s_in):
                    dev_in[i].copy_(host_in[i], non_blocking=True)
        torch.cuda.synchronize()
        return time.monotonic() - began

    run(True, True)  # warm-up
    result = {"gib": n}
    t = run(True, False)
    result["d2h_gbps"] = round(n * GIB / t / 1e9, 1)
    t = run(False, True)
    result["h2d_gbps"] = round(n * GIB / t / 1e9, 1)
    t = run(True, True)
    result["both_gbps"] = round(2 * n * GIB / t / 1e9, 1)
    print("RESULT " + json.dumps(result), flush=True)


def copies(wanted, seconds):
    n = max(1, wanted // GIB)
    dev = [torch.randint(0, 256, (GIB,), dtype=torch.uint8, device="cuda") for _ in range(n)]
    host = [torch.empty(GIB, dtype=torch.uint8, pin_memory=True) for _ in range(n)]

    def round_trip():
        for d, h in zip(dev, host):
            h.copy_(d, non_blocking=True)
        for d, h in zip(dev, host):
            d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()

    round_trip()  # warm-up
    rounds = 0
    began = time.monotonic()
    while rounds == 0 or time.monotonic() - began < seconds:
        round_trip()
        rounds += 1
    ended = time.monotonic()
    print("RESULT " + json.dumps({
        "t_begin": round(began, 3), "t_end": round(ended, 3), "rounds": rounds, "gib_each_way": n,
        "gbps": round(2 * n * GIB * rounds / (ended - began) / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "grow":
        options = dict(a.split("=", 1) for a in sys.argv[7:] if "=" in a)
        flags = {a for a in sys.argv[7:] if "=" not in a}
        known, known_options = {"tick", "hint", "cold"}, {"go", "more", "more_go"}
        if flags - known or set(options) - known_options:
            sys.exit(f"unknown grow flags {sorted(flags - known)} or options {sorted(set(options) - known_options)}"
                     f" ({', '.join(sorted(known))}; {', '.join(sorted(known_options))}=...)")
        grow(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], float(sys.argv[6]),
             "tick" in flags, "hint" in flags, "cold" in flags, options.get("go"), int(options.get("more", 0)), options.get("more_go"))
    elif sys.argv[1] == "link":
        link(int(sys.argv[2]))
    elif sys.argv[1] == "copies":
        copies(int(sys.argv[2]), float(sys.argv[3]))
    elif sys.argv[1] == "request" and len(sys.argv) == 6:
        request(int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5]))
    elif sys.argv[1] == "request":
        request(int(sys.argv[2]))
    else:
        sys.exit(f"unknown mode {sys.argv[1]}")
