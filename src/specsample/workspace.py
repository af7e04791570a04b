"""Reusable scratch buffers for the CPU path.

On CPU every [rows, V] temporary of a call is a fresh allocation of up to tens of megabytes,
which the C allocator maps from the kernel and faults in page by page: at B = 8, K = 4,
V = 151,936 that cost more than the arithmetic (7,000 page faults, about 15 ms per verify on
one thread). :func:`buffer` hands out a per-thread buffer by name instead, grown when a call
needs more and kept for the next call, so a steady stream of calls touches no new memory.
Other devices allocate as usual (CUDA's caching allocator already reuses memory).
"""

from __future__ import annotations

import math
import threading

import torch

_LOCAL = threading.local()


def buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """A contiguous tensor of ``shape`` / ``dtype`` on ``device`` with arbitrary contents.

    On CPU it is a view of this thread's buffer ``name`` (so two live tensors must use two
    names, and a result handed to the caller must never be one of these views); the buffer
    keeps the largest size asked for. Elsewhere a new tensor. Callers write it with ``out=``,
    so their inputs must not require grad (detach them).
    """
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    bufs = _LOCAL.__dict__.setdefault("bufs", {})
    n = math.prod(shape)
    buf = bufs.get((name, dtype))
    if buf is None or buf.numel() < n:
        # A normal tensor even when the first call runs under torch.inference_mode(): an
        # inference tensor could not be written by a later call outside it.
        with torch.inference_mode(False):
            buf = bufs[(name, dtype)] = torch.empty(n, dtype=dtype)
    return buf[:n].view(shape)


def release() -> None:
    """Free this thread's buffers (they are allocated again on the next call)."""
    _LOCAL.__dict__.pop("bufs", None)
