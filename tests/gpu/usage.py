"""A tenant workload for tests/gpu/usage.sh: holds GIB GiB of device memory and runs fp16 matmuls
for SECONDS seconds, then prints `RESULT {json}`. Touches READY once the memory is held."""
import json
import pathlib
import sys
import time

import torch

gib, seconds, ready = float(sys.argv[1]), float(sys.argv[2]), pathlib.Path(sys.argv[3])
held = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
a = torch.randn(4096, 4096, dtype=torch.float16, device="cuda")
b = torch.randn(4096, 4096, dtype=torch.float16, device="cuda")
torch.cuda.synchronize()
ready.touch()
start = time.monotonic()
iterations = 0
while time.monotonic() - start < seconds:
    c = a @ b
    iterations += 1
    if iterations % 50 == 0:
        torch.cuda.synchronize()
torch.cuda.synchronize()
elapsed = time.monotonic() - start
print("RESULT " + json.dumps({
    "held_bytes": held.numel(),
    "iterations": iterations,
    "loop_seconds": round(elapsed, 3),
    "allocated_bytes": torch.cuda.memory_allocated(),
    "ok": bool(torch.isfinite(c).all().item()),
}))
