"""One training job of tests/gpu/memory_jobs.sh (issue 17: three jobs whose footprints add up to
1.5x the GPU's memory). A stack of square linear layers trained with Adam for a fixed number of
steps on seeded data, in deterministic mode, so that a run gives the same result alone, beside
others, or with its memory moved to host and back. Its footprint is set by the number of layers
(parameters, gradients and Adam's two moments: four copies of each weight). PyTorch's default
caching allocator (cudaMalloc: the path that borrows past a request). Never allocates managed
memory. Prints `RESULT {json}` last: the result digest, the steps, the seconds it ran, the most
memory PyTorch's allocator held, and the out-of-memory error if it got one.

  python3 memory_jobs.py FOOTPRINT_BYTES STEPS SEED
"""
import faulthandler
import hashlib
import json
import os
import signal
import sys
import time

# Set before torch initialises cuBLAS: deterministic GEMMs.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

WIDTH = 4096
BATCH = 512


def main():
    # `kill -USR1` prints every thread's Python stack (memory_jobs.sh does it to a job that
    # runs far longer than it did alone).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    footprint, steps, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(seed)
    # Four fp32 copies of each weight (the weight, its gradient, Adam's two moments), and the
    # three activations of a layer kept for the backward pass.
    per_layer = 4 * WIDTH * WIDTH * 4 + 3 * BATCH * WIDTH * 4
    layers = max(1, footprint // per_layer)
    result = {"layers": layers, "footprint": layers * per_layer, "steps": 0}
    began = time.monotonic()
    try:
        model = torch.nn.ModuleList(
            torch.nn.Linear(WIDTH, WIDTH, bias=False, device="cuda") for _ in range(layers)
        )
        torch.cuda.synchronize()
        # The script starts the next job once this one holds its weights (jobs arriving one after
        # another, each growing into its footprint at its first step).
        print("MODEL", flush=True)
        optimiser = torch.optim.Adam(model.parameters(), lr=1e-4)
        data = torch.Generator(device="cuda")
        data.manual_seed(seed)
        losses = []
        for step in range(steps):
            x = torch.randn(BATCH, WIDTH, device="cuda", generator=data)
            h = x
            for layer in model:
                # Residual and bounded: a deep stack neither vanishes nor blows up.
                h = h + 0.1 * torch.tanh(layer(h))
            loss = (h - x).pow(2).mean()
            optimiser.zero_grad(set_to_none=False)
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
            result["steps"] = step + 1
        digest = hashlib.sha256()
        for layer in model:
            digest.update(layer.weight.detach().double().sum().cpu().numpy().tobytes())
        digest.update(json.dumps(losses).encode())
        result["digest"] = digest.hexdigest()[:16]
        result["last_loss"] = losses[-1] if losses else None
    except torch.cuda.OutOfMemoryError as e:
        result["oom"] = str(e).splitlines()[0][:300]
    # What the caching allocator held at most (Adam's temporaries and cuBLAS's workspace
    # included): the script sets the jobs' limits from the alone runs' peaks.
    result["peak_reserved"] = torch.cuda.max_memory_reserved()
    result["seconds"] = round(time.monotonic() - began, 2)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
