"""Reusable scratch buffers: the CPU path's large temporaries, the Triton path's small ones.

On CPU every [rows, V] temporary of a call is a fresh allocation of up to tens of megabytes,
which the C allocator maps from the kernel and faults in page by page: at B = 8, K = 4,
V = 151,936 that cost more than the arithmetic (7,000 page faults, about 15 ms per verify on
one thread). :func:`buffer` hands out a per-thread buffer by name instead, grown when a call
needs more and kept for the next call, so a steady stream of calls touches no new memory.
Other devices allocate as usual (CUDA's caching allocator already reuses memory).

:func:`scratch` serves the Triton backend's per-call intermediates (split statistics, tile
sums, candidate buffers: a dozen small tensors per call). A ``torch.empty`` on CUDA costs
3-5 us of host time on an H200 host, a view 1-3 us; an eager call allocated 10-20 of them.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading

import torch

from . import paths

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


#: Cached shapes per thread and stream before that stream's cache starts over (each is a view
#: of its name's buffer).
SCRATCH_VIEWS = 4096
#: CUDA streams per thread whose buffers are kept: a call on one more drops the buffers of the
#: stream that was first seen longest ago (a caller making a new stream per call keeps a few
#: sets of buffers alive, not one per stream it ever used).
SCRATCH_STREAMS = 4


def stream_key(device: torch.device) -> tuple[torch.device, int | None]:
    """(device with its index, the current CUDA stream's handle) for a CUDA ``device``;
    (``device``, None) elsewhere: what per-stream caches key by."""
    if device.type != "cuda":
        return device, None
    device = _indexed(device)
    return device, torch._C._cuda_getCurrentRawStream(device.index)


@contextlib.contextmanager
def call(device: torch.device):
    """One call's block: this thread's :func:`scratch`, :func:`zeros` and :func:`counters` on
    ``device`` (and :func:`capturing`) use the capture state and the stream's caches looked up
    once at its start, instead of asking CUDA at every request (two to three driver queries,
    3-5 us of host time each time on an H200 host; an eager call makes a dozen requests). The
    block must not change the current device or stream or start a capture (``device`` is the
    current CUDA device, as every launch's tensors are), and a :func:`release` inside it takes
    effect after it. Blocks nest."""
    cap = _capturing_now(device)
    prev = _LOCAL.__dict__.get("call")
    _LOCAL.call = (device, cap, None if cap else _stream_cache(*stream_key(device)))
    try:
        yield
    finally:
        _LOCAL.call = prev


def _block(device: torch.device) -> tuple | None:
    """The enclosing :func:`call` block's (device, capturing, caches) when it is on
    ``device``, else None."""
    c = _LOCAL.__dict__.get("call")
    return c if c is not None and c[0] == device else None


def _capturing_now(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _state(device: torch.device) -> tuple[bool, tuple[dict, dict] | None]:
    """(whether the current stream captures a CUDA graph, its caches or None when it
    does): from the enclosing :func:`call` block on ``device``, else asked now."""
    c = _block(device)
    if c is not None:
        return c[1], c[2]
    if _capturing_now(device):
        return True, None
    return False, _stream_cache(*stream_key(device))


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA device's current stream captures a graph, for a CUDA
    ``device`` (False elsewhere): from the enclosing :func:`call` block on ``device``, else
    asked now."""
    c = _block(device)
    return c[1] if c is not None else _capturing_now(device)


def _stream_cache(device: torch.device, stream) -> tuple[dict, dict]:
    """(buffers by (name, dtype), views by (name, shape, dtype)) of this thread on ``device``
    and ``stream``. The first use of a CUDA stream outside capture also makes the device's
    capture memory if there is none yet (what :func:`zeros` and :func:`counters` hand out
    under capture, so that no fill is captured)."""
    caches = _LOCAL.__dict__.get("streams")
    if caches is None:
        caches = _LOCAL.streams = collections.OrderedDict()
    key = (device, stream)
    entry = caches.get(key)
    if entry is None:
        if device.type == "cuda" and device not in _CAPTURE_MEMORY:
            _capture_memory(device)
        entry = caches[key] = ({}, {})
        while len(caches) > SCRATCH_STREAMS:
            # (the allocator keeps the dropped memory for its stream until the kernels queued
            # on it have run)
            caches.popitem(last=False)
    return entry


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """A contiguous ``shape`` / ``dtype`` tensor on ``device`` with arbitrary contents, for
    intermediates that a call's kernels write and read before the call returns.

    The same tensor object every time this thread asks for the same (name, shape, dtype,
    device) on the same CUDA stream: a view of a per-name buffer that keeps the largest size
    asked for (each name its own buffer, so every such tensor starts on a 16-byte boundary,
    which Triton specialises pointers on). Kernels on one stream run in order, so the next
    call's kernels cannot overwrite what this call's still read; calls on another stream or
    thread get their own buffers (the buffers of :data:`SCRATCH_STREAMS` streams per thread
    are kept). While the current stream captures a CUDA graph: a new tensor (the graph's
    memory pool keeps it for the graph). So two live tensors of one call must use two names,
    and a result handed to the caller must never be one of these (the Triton backend's error
    bits are one: only the API reads them, right after the call).
    """
    cap, caches = _state(device)
    if cap:
        return torch.empty(shape, dtype=dtype, device=device)
    bufs, views = caches
    key = (name, shape, dtype)
    t = views.get(key)
    if t is not None:
        return t
    n = math.prod(shape)
    bkey = (name, dtype)
    buf = bufs.get(bkey)
    # (normal tensors and views even under torch.inference_mode(): see buffer())
    with torch.inference_mode(False):
        if buf is None or buf.numel() < n:
            # (dropping the old buffer's views; the allocator keeps its memory for this stream
            # until the kernels queued on it have run)
            buf = bufs[bkey] = torch.empty(max(n, 1), dtype=dtype, device=device)
            for k in [k for k in views if k[0] == name and k[2] == dtype]:
                del views[k]
        if len(views) >= SCRATCH_VIEWS:
            views.clear()
        t = views[key] = buf[:n].view(shape)
    return t


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor that kernels only read (placeholder ids), kept as :func:`scratch` keeps
    its tensors (per thread and CUDA stream: the fill is queued on the stream that reads it).
    Under CUDA-graph capture: a view of the device's capture zeros (made at the first use of
    a stream outside capture, :func:`_stream_cache`), so the graph holds no fill node for it.
    Never write it."""
    cap, caches = _state(device)
    if cap:
        mem = _CAPTURE_MEMORY.get(_indexed(device))
        n = math.prod(shape) * dtype.itemsize
        if mem is not None and n <= mem.zeros.numel():
            return mem.zeros[:n].view(dtype).view(shape)
        paths.record("workspace.capture_fill.zeros", 1)
        return torch.zeros(shape, dtype=dtype, device=device)
    return _kept_zeros(None, shape, dtype, device, caches)


def counters(name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An int32 tensor of zeros for counters that a kernel increments and sets back to 0
    before it ends (the launch after it finds zeros again): kept per thread and CUDA stream
    like :func:`zeros`. Under CUDA-graph capture: a slice of the device's capture counters
    that no other capture or eager call is given, zero when the graph first runs and left
    zero by every replay, so the graph holds no fill node for it (once they are used up, a
    new tensor zero-filled by the graph, counted as the path
    ``workspace.capture_fill.counters``)."""
    cap, caches = _state(device)
    if cap:
        got = _capture_counters(device, math.prod(shape))
        if got is not None:
            return got.view(shape)
        paths.record("workspace.capture_fill.counters", 1)
        return torch.zeros(shape, dtype=torch.int32, device=device)
    return _kept_zeros(("counters", name), shape, torch.int32, device, caches)


#: int32 counters per CUDA device that CUDA-graph captures take slices of (4 MiB; a captured
#: call at B = 256, K = 4 takes 1,536).
CAPTURE_COUNTERS = 1 << 20
#: Bytes of zeros per CUDA device that placeholders read under capture.
CAPTURE_ZEROS = 4096
_ALIGN = 4  # int32 per 16 bytes: every slice starts where Triton's pointer specialisation wants


class _CaptureMemory:
    """A device's capture zeros and counters, made outside any capture and never freed (a
    captured graph keeps reading them; :func:`release` leaves them)."""

    def __init__(self, device: torch.device):
        with torch.inference_mode(False):
            self.zeros = torch.zeros(CAPTURE_ZEROS, dtype=torch.uint8, device=device)
            self.counters = torch.zeros(CAPTURE_COUNTERS, dtype=torch.int32, device=device)
        if device.type == "cuda":
            # (a graph may be captured and replayed on another stream: the fills are done first)
            torch.cuda.current_stream(device).synchronize()
        self.used = 0


_CAPTURE_MEMORY: dict[torch.device, _CaptureMemory] = {}
_CAPTURE_LOCK = threading.Lock()


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _capture_memory(device: torch.device) -> None:
    """Make ``device``'s (indexed) capture memory unless it exists."""
    with _CAPTURE_LOCK:
        if device not in _CAPTURE_MEMORY:
            _CAPTURE_MEMORY[device] = _CaptureMemory(device)


def _capture_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """``n`` int32 zeros of ``device``'s capture counters that nothing else is given, or None
    when there is no room (or no capture memory: no call ran on the device outside capture)."""
    mem = _CAPTURE_MEMORY.get(_indexed(device))
    if mem is None:
        return None
    with _CAPTURE_LOCK:
        start = mem.used
        if start + n > mem.counters.numel():
            return None
        mem.used = start + -(-n // _ALIGN) * _ALIGN
    return mem.counters[start:start + n]


def _kept_zeros(name, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                caches: tuple[dict, dict]) -> torch.Tensor:
    _bufs, views = caches
    key = (name, shape, dtype)  # (scratch names are strings)
    t = views.get(key)
    if t is None:
        with torch.inference_mode(False):
            t = views[key] = torch.zeros(shape, dtype=dtype, device=device)
    return t


_ON_RELEASE: list = []


def on_release(fn) -> None:
    """Call ``fn()`` at every :func:`release` (``call_cache`` drops its entries, which hold
    buffers)."""
    _ON_RELEASE.append(fn)


def release() -> None:
    """Free this thread's buffers (they are allocated again on the next call), and drop the
    eager calls recorded with them (``specsample.call_cache``)."""
    for name in ("bufs", "streams"):
        _LOCAL.__dict__.pop(name, None)
    for fn in _ON_RELEASE:
        fn()
