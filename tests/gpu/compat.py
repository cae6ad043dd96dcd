"""Jobs of the compatibility suite (tests/gpu/compat.sh): real PyTorch (and cupy, JAX) work run
bare and inside a vgpu slice, each writing what it computed so that the runs can be compared.

    python compat.py JOB --out result.json [options]        # one job (rank 0 writes --out)
    torchrun --nproc_per_node=2 compat.py ddp --out r.json   # distributed jobs
    python compat.py compare REF GOT [--rtol R]              # exit 0 when GOT matches REF

Every job is deterministic where the library allows it (seeded data, deterministic algorithms):
its result holds the losses (as exact hex floats) and a SHA-256 of its final weights or outputs,
so two runs compare bit for bit; `--rtol` allows a stated tolerance for jobs whose reduction
order may differ (3 ranks). Progress lines (`STEP i loss`) go to stderr with a timestamp, and
SIGUSR1 dumps every thread's Python stack (faulthandler), so a stalled run can be diagnosed.
"""

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import sys
import time

faulthandler.register(signal.SIGUSR1, all_threads=True)
# Deterministic cuBLAS; must be set before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

T0 = time.time()
# A job whose library is not installed exits with this (the suite records SKIP).
SKIP_EXIT = 77


def say(*parts):
    # One write per line: the ranks share one log, and print() writes its pieces separately,
    # so two ranks' lines interleaved mid-line (and hid a rank's `STEP 5` from the harness).
    now = time.time()
    text = " ".join(str(p) for p in parts)
    line = f"[{now - T0:7.2f}s rank {os.environ.get('RANK', '-')} unix {now:.3f}] {text}\n"
    sys.stderr.flush()
    os.write(2, line.encode())


def write_result(path, result):
    if path is None:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)
    print("RESULT " + json.dumps(result), flush=True)


def digest_tensors(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# torch helpers


def torch_setup():
    import torch

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    return torch


def resnet18(torch, classes=10, image=32):
    """ResNet-18 (two BasicBlocks per stage); no torchvision needed."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = torch.relu(self.b1(self.c1(x)))
            y = self.b2(self.c2(y))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    if image >= 128:  # ImageNet-sized inputs: the usual 7x7/2 stem and a max pool
        layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    else:  # CIFAR-sized: a 3x3 stem without pooling
        layers = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def batch(torch, seed, n, device, shape=(3, 32, 32), classes=10):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *shape), generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x.to(device), y.to(device)


def dist_init(args, torch):
    import datetime

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if args.bare_nccl and args.backend == "nccl":
        # Bare NCCL refuses two ranks on one GPU of one host ("Duplicate GPU detected"); a host
        # identity per rank makes them talk over NCCL's own socket transport instead.
        os.environ["NCCL_HOSTID"] = f"compat-bare-{rank}"
    # one GPU: every rank on it (the slices case); several: rank i on GPU i mod count
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.pg_timeout))
    say(f"process group {args.backend} up, world {world}")
    return dist, rank, world


# ---------------------------------------------------------------------------------------------
# jobs


def job_ddp(args):
    """DDP training of ResNet-18 on synthetic data, every rank on the tenant's one GPU."""
    torch = torch_setup()
    dist, rank, world = dist_init(args, torch)
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = resnet18(torch, image=args.image).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[dev.index], bucket_cap_mb=args.bucket_mb, static_graph=args.static_graph
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    stamps = []
    start = time.time()
    for step in range(args.steps):
        x, y = batch(torch, 1000 * step + rank, args.batch, dev, shape=(3, args.image, args.image))
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).item())
        stamps.append(time.time())
        say(f"STEP {step} loss {losses[-1]:.6f}")
    torch.cuda.synchronize()
    seconds = time.time() - start
    weights = digest_tensors(list(model.state_dict().values()))
    dist.barrier()
    if rank == 0:
        write_result(args.out, result("ddp", losses, weights, seconds, world=world, **step_times(start, stamps)))
    dist.destroy_process_group()


def job_fsdp(args):
    """FSDP (full sharding) of a small transformer-like MLP stack, ranks on one GPU."""
    torch = torch_setup()
    dist, rank, world = dist_init(args, torch)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(
        *[nn.Sequential(nn.LayerNorm(512), nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)) for _ in range(4)],
        nn.Linear(512, 16),
    ).to(dev)
    fsdp = FSDP(model, device_id=dev, use_orig_params=True)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    losses = []
    start = time.time()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(args.batch, 512, generator=g).to(dev)
        y = torch.randint(0, 16, (args.batch,), generator=g).to(dev)
        loss = torch.nn.functional.cross_entropy(fsdp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).item())
        say(f"STEP {step} loss {losses[-1]:.6f}")
    with FSDP.summon_full_params(fsdp):
        weights = digest_tensors([p for p in fsdp.parameters()])
    torch.cuda.synchronize()
    seconds = time.time() - start
    dist.barrier()
    if rank == 0:
        write_result(args.out, result("fsdp", losses, weights, seconds, world=world))
    dist.destroy_process_group()


def train_single(args, torch, model, name, steps=None, shape=(3, 32, 32), step_fn=None):
    dev = torch.device("cuda", 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    start = time.time()
    for step in range(steps or args.steps):
        x, y = batch(torch, 1000 * step, args.batch, dev, shape=shape)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        say(f"STEP {step} loss {losses[-1]:.6f}")
    torch.cuda.synchronize()
    return losses, time.time() - start


def job_compile(args):
    """torch.compile (inductor: generated triton kernels) training a ResNet-18."""
    torch = torch_setup()
    torch.manual_seed(0)
    model = resnet18(torch).cuda()
    compiled = torch.compile(model)
    losses, seconds = train_single(args, torch, compiled, "compile")
    write_result(args.out, result("compile", losses, digest_tensors(list(model.state_dict().values())), seconds))


def job_graphs(args):
    """A CUDA graph captured by the application (torch.cuda.graph) of a whole training step,
    replayed with new inputs copied into its static buffers."""
    torch = torch_setup()
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # no momentum: capturable as is
    sx = torch.zeros(args.batch, 1024, device=dev)
    sy = torch.zeros(args.batch, dtype=torch.long, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as the docs require
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(sx), sy).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        sloss = torch.nn.functional.cross_entropy(model(sx), sy)
        sloss.backward()
        opt.step()
    losses = []
    start = time.time()
    for step in range(args.steps * 10):
        g = torch.Generator().manual_seed(step)
        sx.copy_(torch.randn(args.batch, 1024, generator=g))
        sy.copy_(torch.randint(0, 10, (args.batch,), generator=g))
        graph.replay()
        losses.append(sloss.item())
    seconds = time.time() - start
    say(f"{len(losses)} replays, last loss {losses[-1]:.6f}")
    write_result(args.out, result("graphs", losses, digest_tensors(list(model.parameters())), seconds))


def job_alloc(args):
    """Training under the allocator given in PYTORCH_CUDA_ALLOC_CONF (cudaMallocAsync,
    expandable segments), with tensors of changing sizes so the allocator grows and frees."""
    torch = torch_setup()
    torch.manual_seed(0)
    model = resnet18(torch).cuda()
    dev = torch.device("cuda", 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    start = time.time()
    for step in range(args.steps):
        n = args.batch * (1 + step % 4)  # 4 batch sizes: the allocator grows, frees, reuses
        x, y = batch(torch, 1000 * step, n, dev)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        big = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # 256 MiB, freed at once
        big.fill_(step % 251)
        del big
        losses.append(loss.item())
        say(f"STEP {step} loss {losses[-1]:.6f}")
    torch.cuda.synchronize()
    seconds = time.time() - start
    backend = torch.cuda.get_allocator_backend()
    write_result(
        args.out,
        result("alloc", losses, digest_tensors(list(model.state_dict().values())), seconds, allocator=backend),
    )


def job_generate(args):
    """A transformer decoder generating text with a KV cache: Hugging Face transformers with
    random weights when it is installed, else a small decoder written here with its own cache."""
    torch = torch_setup()
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    start = time.time()
    try:
        import transformers  # noqa: F401
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=6, n_head=8, n_embd=512, vocab_size=8192, n_positions=512)
        model = GPT2LMHeadModel(config).to(dev).eval()
        prompt = torch.randint(0, 8192, (4, 32), generator=torch.Generator().manual_seed(1)).to(dev)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=64, do_sample=False, use_cache=True, pad_token_id=0)
        impl = f"transformers {transformers.__version__}"
    except ImportError:
        out = tiny_decoder_generate(torch, dev)
        impl = "own decoder"
    torch.cuda.synchronize()
    seconds = time.time() - start
    tokens = out.cpu().tolist()
    say(f"generated with {impl}: {tokens[0][-8:]}")
    write_result(
        args.out,
        {"job": "generate", "losses": [], "weights": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
         "seconds": seconds, "impl": impl},
    )


def tiny_decoder_generate(torch, dev, layers=4, width=512, heads=8, vocab=4096, new=64):
    nn = torch.nn
    torch.manual_seed(0)
    emb = nn.Embedding(vocab, width).to(dev)
    blocks = [nn.TransformerDecoderLayer(width, heads, 4 * width, batch_first=True).to(dev).eval() for _ in range(layers)]
    head = nn.Linear(width, vocab).to(dev)
    tokens = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(1)).to(dev)
    cache = None  # the cache: every layer's input of the tokens so far
    with torch.no_grad():
        for _ in range(new):
            x = emb(tokens[:, -1:] if cache is not None else tokens)
            cache = x if cache is None else torch.cat([cache, x], 1)
            h = cache
            for b in blocks:
                h = b(h, h)
            nxt = head(h[:, -1]).argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
    return tokens


def job_cupy(args):
    """cupy: allocation through its memory pool, an elementwise kernel, a raw CUDA kernel
    compiled at run time (NVRTC), a reduction and cuBLAS."""
    import cupy as cp

    start = time.time()
    x = cp.arange(1 << 24, dtype=cp.float32) / (1 << 20)
    y = cp.ElementwiseKernel("float32 x", "float32 y", "y = x * x + 1.0f", "sq")(x)
    raw = cp.RawKernel(
        r"""extern "C" __global__ void axpy(const float a, const float* x, float* y, int n) {
            int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = a * x[i] + y[i]; }""",
        "axpy",
    )
    n = x.size
    raw(((n + 255) // 256,), (256,), (cp.float32(0.5), x, y, cp.int32(n)))
    m = cp.random.RandomState(0).standard_normal((2048, 2048), dtype=cp.float32)
    p = m @ m.T
    cp.cuda.Stream.null.synchronize()
    pooled = cp.get_default_memory_pool().total_bytes()
    values = [float(y.sum()), float(p.trace()), float(cp.linalg.norm(p))]
    say(f"cupy {cp.__version__}: {values}, pool {pooled >> 20} MiB")
    write_result(
        args.out,
        {"job": "cupy", "losses": [v.hex() for v in values], "weights": hashlib.sha256(cp.asnumpy(y).tobytes()).hexdigest(),
         "seconds": time.time() - start},
    )


def job_jax(args):
    """JAX: its allocator preallocates a share of what the device reports (the slice inside
    vgpu), jit-compiled matmuls and a reduction."""
    import jax
    import jax.numpy as jnp

    start = time.time()
    devices = jax.devices()
    say(f"jax {jax.__version__}, devices {devices}")
    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (2048, 2048), dtype=jnp.float32)

    @jax.jit
    def f(m):
        return jnp.tanh(m @ m.T / 2048.0).sum(axis=0)

    out = f(a).block_until_ready()
    values = [float(out.sum()), float(out.max())]
    stats = devices[0].memory_stats() or {}
    say(f"jax: {values}, bytes_limit {stats.get('bytes_limit', 0) >> 20} MiB")
    import numpy as np

    write_result(
        args.out,
        {"job": "jax", "losses": [v.hex() for v in values], "weights": hashlib.sha256(np.asarray(out).tobytes()).hexdigest(),
         "seconds": time.time() - start, "bytes_limit": stats.get("bytes_limit", 0)},
    )


def job_oom(args):
    """Allocates 1 GiB tensors until the framework says out of memory; passes when that is a
    clean torch.OutOfMemoryError and the process can go on computing after freeing."""
    torch = torch_setup()
    held = []
    err = None
    start = time.time()
    free0, total0 = torch.cuda.mem_get_info()
    try:
        for _ in range(4096):
            held.append(torch.ones(1 << 28, device="cuda"))  # 1 GiB of fp32
    except torch.OutOfMemoryError as e:
        err = str(e).splitlines()[0][:300]
    got = len(held)
    held.clear()
    torch.cuda.empty_cache()
    z = (torch.ones(1024, 1024, device="cuda") @ torch.ones(1024, 1024, device="cuda")).sum().item()
    say(f"OOM after {got} GiB: {err}; then a matmul gives {z}")
    write_result(
        args.out,
        {"job": "oom", "losses": [], "weights": "", "seconds": time.time() - start, "gib_before_oom": got,
         "error": err, "after": z, "reported_total": total0, "reported_free": free0},
    )


def job_loop(args):
    """A neighbour: checked fp32 matmuls for --seconds; fails on a wrong result or CUDA error."""
    torch = torch_setup()
    a = torch.randn(2048, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ref = (a @ a).sum().item()
    start = time.time()
    n = 0
    bad = 0
    print("READY", flush=True)
    while time.time() - start < args.seconds:
        v = (a @ a).sum().item()
        bad += v != ref
        n += 1
    write_result(args.out, {"job": "loop", "losses": [], "weights": "", "seconds": time.time() - start,
                            "steps": n, "wrong": bad})


def step_times(start, stamps):
    """The first step (connections, warm-up) and the median of the others, in seconds."""
    if not stamps:
        return {}
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    return {"first_step_s": round(stamps[0] - start, 3), "step_median_s": round(gaps[len(gaps) // 2], 4) if gaps else None}


def result(job, losses, weights, seconds, **extra):
    return {"job": job, "losses": [float(v).hex() for v in losses], "weights": weights, "seconds": seconds, **extra}


def compare(ref_path, got_path, rtol):
    ref = json.load(open(ref_path))
    got = json.load(open(got_path))
    if rtol == 0:
        same = ref["losses"] == got["losses"] and ref["weights"] == got["weights"]
        print("identical" if same else "differ")
        return 0 if same else 1
    a = [float.fromhex(v) for v in ref["losses"]]
    b = [float.fromhex(v) for v in got["losses"]]
    if len(a) != len(b):
        print(f"differ: {len(a)} vs {len(b)} losses")
        return 1
    # a training job's first loss comes from the same weights and data before any reduction: it
    # must be exact
    if ref.get("job") in ("ddp", "fsdp") and a and a[0] != b[0]:
        print(f"differ: first loss {a[0]!r} vs {b[0]!r}")
        return 1
    worst = max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)), default=0.0)
    ok = worst <= rtol
    print(f"{'within' if ok else 'beyond'} rtol {rtol:g} (worst {worst:.2e})")
    return 0 if ok else 1


JOBS = {
    "ddp": job_ddp,
    "fsdp": job_fsdp,
    "compile": job_compile,
    "graphs": job_graphs,
    "alloc": job_alloc,
    "generate": job_generate,
    "cupy": job_cupy,
    "jax": job_jax,
    "oom": job_oom,
    "loop": job_loop,
}


def summary(path):
    """What the table says of a run: its seconds, and for stepped jobs the first and usual step."""
    r = json.load(open(path))
    text = f"{r['seconds']:.2f}s"
    if r.get("step_median_s"):
        text += f", first step {r['first_step_s']}s, then {r['step_median_s']}s a step"
    print(text)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "summary":
        summary(sys.argv[2])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        p = argparse.ArgumentParser()
        p.add_argument("cmd")
        p.add_argument("ref")
        p.add_argument("got")
        p.add_argument("--rtol", type=float, default=0.0)
        a = p.parse_args()
        sys.exit(compare(a.ref, a.got, a.rtol))
    p = argparse.ArgumentParser()
    p.add_argument("job", choices=sorted(JOBS))
    p.add_argument("--out")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image", type=int, default=32, help="image side of the CNN jobs (ddp)")
    p.add_argument("--backend", default="nccl")
    p.add_argument("--bare-nccl", action="store_true", help="a NCCL host identity per rank (bare runs)")
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--pg-timeout", type=float, default=300.0)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    say(f"job {args.job} pid {os.getpid()}")
    try:
        JOBS[args.job](args)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("cupy", "jax", "jaxlib"):
            print(f"SKIP: {e.name} is not installed", flush=True)
            sys.exit(SKIP_EXIT)
        raise
    say("done")


if __name__ == "__main__":
    main()
