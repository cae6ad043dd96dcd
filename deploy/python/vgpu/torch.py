"""Give cached GPU memory back to vgpu before it swaps (elastic memory, issue 17).

A tenant that borrows GPU memory past its request may be asked to give it back when another
tenant needs its own request. vgpu then swaps the borrower's memory to host memory (and back
later), which costs copies and pauses the borrower's kernels. Much of what PyTorch holds is its
caching allocator's free blocks, which it can simply release. This module runs one daemon thread
that polls the interposer (``libvgpu_cuda.so``, preloaded into the process) for what this process
is asked to give back, and then calls ``torch.cuda.empty_cache()`` (or a hook of yours) and says
it is done. The interposer credits the frees at once; what they do not cover is swapped after the
hint budget (``VGPU_MEMORY_HINT_MS``, 100 ms by default). Without a helper the swap starts at
once, so processes that do not call :func:`enable` pay nothing.

Usage::

    import vgpu.torch
    vgpu.torch.enable()                                 # empty_cache() when asked
    vgpu.torch.enable(on_want=lambda: llm.sleep(level=1))   # an engine's own pause hook
    vgpu.torch.mark_cold(expert_weights)                # given back first when memory is asked

:func:`mark_cold` needs no helper thread: it tells the interposer which of the process's borrowed
GPU memory to give back first (an engine's offloaded experts, a cache it will not read soon).

:func:`progress` counts the application's own units of work (training steps, tokens, requests)
for vgpu's redistribution of idle GPU capacity among best-effort tenants::

    for batch in loader:
        train_step(batch)
        vgpu.torch.progress()                           # one training step

Stdlib and torch only; torch is imported when the default hook first runs.
"""

import ctypes
import logging
import threading
import time
import warnings

__all__ = ["enable", "mark_cold", "progress", "POLL_INTERVAL_S"]

#: How often the helper asks the interposer (one load of a shared word when nothing is asked).
POLL_INTERVAL_S = 0.015

# The interposer's return codes (nodeagent/interposer/src/exports.rs, VGPU_HINT_* and
# VGPU_PROGRESS_*: 1 is "inactive" for the hints and "no schedule slot" for vgpu_progress).
_OK = 0
_INACTIVE = 1
_NO_SLOT = 1
#: The largest count one call of :func:`progress` takes (bit 63 of the interposer's word is a flag).
PROGRESS_MAX = (1 << 63) - 1

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_thread = None


class _Abi:
    """The functions libvgpu_cuda.so exports for hint helpers, typed once (``cold`` is None with
    an interposer older than ``vgpu_memory_cold``, ``progress`` with one older than
    ``vgpu_progress``)."""

    def __init__(self, process):
        self.register = process.vgpu_memory_hint_register
        self.register.argtypes = []
        self.register.restype = ctypes.c_int
        self.want = process.vgpu_memory_want
        self.want.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        self.want.restype = ctypes.c_int
        self.done = process.vgpu_memory_hint_done
        self.done.argtypes = [ctypes.c_uint64]
        self.done.restype = ctypes.c_int
        try:
            self.cold = process.vgpu_memory_cold
        except AttributeError:
            self.cold = None
        else:
            self.cold.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int,
                                  ctypes.POINTER(ctypes.c_uint64)]
            self.cold.restype = ctypes.c_int
        try:
            self.progress = process.vgpu_progress
        except AttributeError:
            self.progress = None
        else:
            self.progress.argtypes = [ctypes.c_uint64]
            self.progress.restype = ctypes.c_int

    @classmethod
    def load(cls):
        """The functions, if libvgpu_cuda.so is loaded in this process; else None."""
        try:
            return cls(ctypes.CDLL(None))
        except (OSError, AttributeError):
            return None


def _empty_cache():
    """The default hook: releases the caching allocator's free blocks; returns the bytes."""
    import torch

    devices = range(torch.cuda.device_count())
    before = sum(torch.cuda.memory_reserved(d) for d in devices)
    torch.cuda.empty_cache()
    after = sum(torch.cuda.memory_reserved(d) for d in devices)
    return max(0, before - after)


def enable(on_want=None, poll_interval_s=POLL_INTERVAL_S):
    """Starts the hint helper of this process (once; later calls return True and change nothing).

    ``on_want`` is called on the helper's thread when vgpu asks this process for memory back;
    it may return the bytes it freed (for the interposer's log). The default calls
    ``torch.cuda.empty_cache()``. For vLLM, pass ``lambda: llm.sleep(level=1)`` (the engine must
    be idle, and it serves again only after your ``llm.wake_up()``).

    Returns whether the helper runs: False, with a warning, when libvgpu_cuda.so is not loaded in
    this process (the program was not started by ``vgpu-agent exec`` or with ``LD_PRELOAD``).
    """
    global _thread
    if poll_interval_s <= 0:
        raise ValueError("poll_interval_s must be positive")
    with _lock:
        if _thread is not None:
            return True
        abi = _Abi.load()
        if abi is None:
            warnings.warn(
                "vgpu.torch.enable(): libvgpu_cuda.so is not loaded in this process (start it "
                "with `vgpu-agent exec` or LD_PRELOAD); no hint helper runs",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        if abi.register() == _INACTIVE:
            warnings.warn(
                "vgpu.torch.enable(): this process's GPU memory is never asked back (no vgpu "
                "tenant, no memory board, or VGPU_MEMORY_SWAP=0); the helper runs but "
                "will not be asked for anything",
                RuntimeWarning,
                stacklevel=2,
            )
        hook = _empty_cache if on_want is None else on_want
        _thread = threading.Thread(
            target=_run,
            args=(abi, hook, poll_interval_s),
            name="vgpu-memory-hints",
            daemon=True,
        )
        _thread.start()
        return True


def mark_cold(memory, nbytes=None, cold=True):
    """Says that GPU memory is cold (``cold=False`` takes it back): when other tenants need their
    memory, this process's borrowed memory there is given back (swapped to host memory) before
    the rest. Memory within the tenant's request is never taken, so marking it changes nothing.

    ``memory`` is a tensor (its whole storage is marked) or, with ``nbytes``, a device address.
    Returns the bytes of borrowed memory marked (0: none there). Returns 0 with a warning when
    libvgpu_cuda.so is not loaded, is too old, or this process's memory is never asked back.
    """
    if nbytes is None:
        storage = memory.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
    else:
        address = int(memory)
    if address < 0 or nbytes < 0:
        raise ValueError("the address and nbytes must not be negative")
    abi = _Abi.load()
    if abi is None or abi.cold is None:
        warnings.warn(
            "vgpu.torch.mark_cold(): libvgpu_cuda.so is not loaded in this process, or is older "
            "than vgpu_memory_cold; nothing is marked",
            RuntimeWarning,
            stacklevel=2,
        )
        return 0
    marked = ctypes.c_uint64(0)
    rc = abi.cold(address, nbytes, 1 if cold else 0, ctypes.byref(marked))
    if rc == _INACTIVE:
        warnings.warn(
            "vgpu.torch.mark_cold(): this process's GPU memory is never asked back (no vgpu "
            "tenant, no memory board, or VGPU_MEMORY_SWAP=0); nothing is marked",
            RuntimeWarning,
            stacklevel=2,
        )
        return 0
    if rc != _OK:
        raise RuntimeError(f"vgpu_memory_cold failed ({rc}); see the interposer's log line")
    return marked.value


_progress_abi = None
_progress_looked = False
_progress_warned = False


def progress(n=1):
    """Counts ``n`` units of this process's own progress: training steps, tokens, requests, in
    whatever unit the application counts its work. Call it as the work is done (once per step,
    or per batch of tokens); each call is one relaxed add per GPU in the interposer.

    vgpu gives idle GPU capacity to the best-effort tenants that turn it into the most work, and
    measures each tenant's work by its own rate over time, never against another tenant's units.
    Without this call a tenant's progress is counted in *steps*, the synchronisations that
    waited for work it launched (a training loop that logs its loss syncs once per step); from
    the first call on, only these units count for the whole tenant (``progress(0)`` says so
    without counting). Each process counts its own: a tenant's ranks on one GPU add up.

    Returns True when counted. Returns False when libvgpu_cuda.so is not loaded in this process
    or is older than ``vgpu_progress`` (with one warning), or when the process has no slot in a
    GPU's schedule yet: it is not a vgpu tenant with a compute share, or it has launched no
    kernel yet (it joins a GPU's schedule at its first launch there), so nothing is counted.
    Never raises for the interposer's sake (a failure there is warned about once). Raises
    ValueError for a count that is negative or above :data:`PROGRESS_MAX`.
    """
    global _progress_abi, _progress_looked, _progress_warned
    n = int(n)
    if n < 0 or n > PROGRESS_MAX:
        raise ValueError(f"progress counts 0..{PROGRESS_MAX} units, not {n}")
    if not _progress_looked:
        abi = _Abi.load()
        _progress_abi = abi.progress if abi is not None else None
        _progress_looked = True
    if _progress_abi is None:
        if not _progress_warned:
            _progress_warned = True
            warnings.warn(
                "vgpu.torch.progress(): libvgpu_cuda.so is not loaded in this process, or is "
                "older than vgpu_progress; progress is not counted",
                RuntimeWarning,
                stacklevel=2,
            )
        return False
    rc = _progress_abi(n)
    if rc not in (_OK, _NO_SLOT) and not _progress_warned:
        # An interposer bug (logged there) must not end the application's loop.
        _progress_warned = True
        warnings.warn(
            f"vgpu.torch.progress(): vgpu_progress failed ({rc}); see the interposer's log line",
            RuntimeWarning,
            stacklevel=2,
        )
    return rc == _OK


def _run(abi, hook, poll_interval_s):
    """The helper's loop: poll, and when asked run the hook once and say it is done."""
    want = ctypes.c_uint64(0)
    while True:
        if abi.want(ctypes.byref(want)) == _OK and want.value > 0:
            asked = want.value
            try:
                freed = int(hook() or 0)
            except Exception:  # the application's hook must not end the helper
                _log.exception("vgpu.torch: the on_want hook failed")
                freed = 0
            abi.done(max(0, freed))
            _log.info("vgpu asked for %d bytes back; the hook freed %d", asked, freed)
        time.sleep(poll_interval_s)
