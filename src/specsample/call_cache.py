"""Eager calls replayed from a recording: a repeated call's host work without its Python.

An engine calls ``verify()`` / ``sample()`` once per step with inputs of the same shapes, the
same batch and the same options. Validating the inputs, building the row layout, choosing the
kernels and binding their arguments give the same result at every such step: only the
addresses of the input tensors and of the fresh outputs change. On an H200 host that Python
was 100-170 us per call, most of an eager step at small batch.

So each :class:`~specsample.params.SamplingBatch` keeps a small cache keyed by everything
that decides what a call does on the Triton backend (:func:`call_key`: the shapes, dtypes,
strides and alignments of the tensor arguments, the host ``num_draft_tokens``, the method,
the device, stream, thread and the settings that change launches). Per key:

1. the first call runs as usual (it may compile kernels and create scratch buffers);
2. the second and third run as usual while being recorded: every kernel launch (its compiled
   launcher, grid and arguments), every path count, and every tensor operation. A recording
   is kept only when the call was nothing but launches, allocations (``torch.empty`` /
   ``full`` / ``zeros``) and views, when every tensor a launch reads is an input (or a view
   of one), one of those fresh allocations, or a tensor that outlives the call (the
   batch's, the workspace's, the cached row layout; the entry keeps a reference), when each
   result is one of those allocations (or, where the caller allows it, a tensor that outlives
   the call, returned again by every replay: the workspace's error bits and sample()'s
   unused accepted counts), and when the two recordings agree;
3. later calls replay: the path counts (so :func:`specsample.paths.forbid` still raises
   before any work), the allocations made again, then each launch with the new input and
   output addresses. Path ``host.replay`` counts them.

A key whose recording fails is refused for good and runs as usual; the refusal is counted once as
``host.replay_refused.<reason>`` (for example ``op.aten._to_copy.default``: an input converted
inside the call). Never recorded (:func:`call_key` returns None): CPU tensors (the torch backend and
Triton's interpreter), another ``$SPECSAMPLE_BACKEND``, batches on the general path (PyTorch
processing: bans, logit_bias or penalties together with more than 32 top-n logprobs), calls
under CUDA-graph capture (a graph replays without host work anyway), host lists for tensors other
than ``num_draft_tokens``, and calls while Triton launch hooks (a profiler) are installed or inside
``triton_backend.general_path()``. Under :func:`specsample.paths.forbid`, a replayed call whose
paths are forbidden raises before any work; the usual path raises after building its plan, which for
``positions=None`` has already advanced the batch's counter.
:func:`disabled` turns replay off in a block; ``SPECSAMPLE_CALL_CACHE=0`` turns it off for
the process. Changing any attribute of the batch, or :func:`specsample.workspace.release`,
drops its entries; a batch tensor given new memory in place is found by the replay's check
of their addresses, and the key records again.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
import os
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import paths, workspace

# $SPECSAMPLE_CALL_CACHE=0 / false / off / no: never replay (read at import)
_ENV_ENABLED = os.environ.get("SPECSAMPLE_CALL_CACHE", "1").strip().lower() not in (
    "0", "false", "off", "no")
#: Keys kept per batch (a call with a new key drops the oldest when full).
MAX_KEYS = 16
_ENABLED = contextvars.ContextVar("specsample_call_cache", default=True)
_RECORDING: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar(
    "specsample_call_cache_recording", default=None)
_aten = torch.ops.aten
# allocations a replay makes again (with the recorded sizes, fill value, dtype and device)
_ALLOC_OPS = {_aten.empty.memory_format: torch.empty, _aten.full.default: torch.full,
              _aten.zeros.default: torch.zeros}
_ALLOC_KWARGS = {"dtype": None, "device": None, "pin_memory": False, "layout": torch.strided,
                 "memory_format": torch.contiguous_format}
_VIEW_OPS = frozenset({
    _aten.view.default, _aten.view.dtype, _aten.slice.Tensor, _aten.select.int,
    _aten.alias.default, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.default,
    _aten.expand.default, _aten.as_strided.default, _aten.detach.default,
})
_SEEN = "seen"  # a key's first call ran
_REFUSED = "refused"  # a key's recording failed: it runs as usual


class _Pending:
    """A key's first recording, waiting for the second."""

    __slots__ = ("entry",)

    def __init__(self, entry) -> None:
        self.entry = entry


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block (this thread or task), calls run as usual: no replay, no recording."""
    token = _ENABLED.set(False)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def recording() -> _Recording | None:
    """The recording in progress in this thread or task (``launch`` and ``paths`` add to it),
    or None."""
    return _RECORDING.get()


class _Recording:
    """What one call did: launches, path counts, tensor operations (see the module doc)."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []
        self.paths: list[tuple[str, int]] = []
        self.failure: str | None = None

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason

    def launch(self, run: Callable, grid: tuple[int, int, int], stream: int, function: int,
               head: tuple, args: tuple, values: list, pad: tuple) -> None:
        """One direct launch: ``run(*grid, stream, function, *head, *values, *pad)``, where
        ``values`` are the kernel's positional arguments with tensors as addresses and
        ``args`` the same arguments as given (tensors as tensors)."""
        self.launches.append((run, grid, stream, function, head, args, values, pad))


class _Ops(TorchDispatchMode):
    """Sees every tensor operation of the recorded call: keeps the fresh allocations
    (``torch.empty`` / ``full`` / ``zeros``: the tensor and how to make it again), fails the
    recording on anything but those and views."""

    def __init__(self, rec: _Recording) -> None:
        super().__init__()
        self.rec = rec
        self.allocs: list[torch.Tensor] = []
        self.specs: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        make = _ALLOC_OPS.get(func)
        if self.rec.failure is not None:
            return out  # (refused already: hold nothing)
        if make is not None:
            if any(k not in _ALLOC_KWARGS or (_ALLOC_KWARGS[k] is not None
                                              and v not in (None, _ALLOC_KWARGS[k]))
                   for k, v in kwargs.items()):
                self.rec.fail(f"alloc.{func}")
            self.allocs.append(out)
            if make is torch.empty:
                # (made again by torch.empty_strided, with the strides it got: 1 us less per
                # tensor than torch.empty on an H100 host)
                make, args = torch.empty_strided, (tuple(out.shape), out.stride())
            self.specs.append((make, tuple(tuple(a) if isinstance(a, list) else a
                                           for a in args), out.dtype, out.device))
        elif func not in _VIEW_OPS:
            self.rec.fail(f"op.{func}")
        return out


_launch_settings = None  # triton_backend.launch_settings, imported at the first CUDA call


def _sig(t: torch.Tensor) -> tuple:
    return t.shape, t.dtype, t.get_device(), t.stride(), t.data_ptr() & 15


# os.environ's own mapping on POSIX (bytes keys): a look-up without os.environ's encoding
_ENVIRON = getattr(os.environ, "_data", None) if os.name == "posix" else None


def _backend_env():
    if type(_ENVIRON) is dict:
        value = _ENVIRON.get(b"SPECSAMPLE_BACKEND")
        return None if value is None else value.decode(errors="replace")
    return os.environ.get("SPECSAMPLE_BACKEND")


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _current_stream(logits: torch.Tensor) -> int | None:
    """The current CUDA stream's handle when the current device is the logits' and the stream
    is not capturing a graph, else None."""
    index = logits.device.index
    if torch._C._cuda_getDevice() != index or torch._C._cuda_isCurrentStreamCapturing():
        return None
    return torch._C._cuda_getCurrentRawStream(index)


def call_key(op: str, logits, batch, draft_token_ids, num_draft_tokens, draft_logits,
             draft_probs, positions, method, max_num_draft_tokens) -> tuple | None:
    """(key, input tensors) of a call that may replay, or None (see the module doc). The key
    holds what decides the launches beyond the batch: every tensor argument's shape, dtype,
    device, strides and 16-byte alignment, the host ``num_draft_tokens`` (ints only), the
    method and ``max_num_draft_tokens`` (a ``str`` and None or an ``int``, else no key), the
    current device, stream and thread, ``$SPECSAMPLE_BACKEND`` and the Triton backend's
    launch settings (:func:`specsample.workspace.release` drops every entry instead).
    ``num_draft_tokens`` None: sample()'s all-zero counts."""
    if not (_ENV_ENABLED and _ENABLED.get()) or type(logits) is not torch.Tensor or (
            not _on_cuda(logits)) or batch.needs_general_path and not (
            batch.processing_in_kernels):
        # (the general path, whose recordings would fail anyway: not worth two of them;
        # bans, logit_bias and penalties otherwise are applied in the kernels and may replay)
        return None
    if type(method) is not str or type(max_num_draft_tokens) not in (int, type(None)):
        return None  # (validated, and refused if wrong, by the usual path)
    backend = _backend_env()
    if backend and backend.strip().lower() != "triton":
        return None
    stream = _current_stream(logits)
    if stream is None:
        return None
    global _launch_settings
    if _launch_settings is None:
        try:
            from .triton_backend import launch_settings as _launch_settings  # (on CUDA)
        except ImportError:  # (no triton: the torch backend, never replayed)
            return None
    settings = _launch_settings()
    if settings is None:
        return None
    inputs: list = [logits]
    key: list = [op, _sig(logits), method, max_num_draft_tokens, stream,
                 threading.get_ident(), backend, settings]
    if positions is None:
        key.append(None)  # (fresh positions: a launch that reads and advances the batch's)
    elif type(positions) is torch.Tensor:
        inputs.append(positions)
        key.append(_sig(positions))
    else:
        return None
    if draft_token_ids is not None:
        if type(draft_token_ids) is not torch.Tensor:
            return None
        inputs.append(draft_token_ids)
        key.append(_sig(draft_token_ids))
    if num_draft_tokens is not None:
        t = type(num_draft_tokens)
        if t is list or t is tuple:
            # (ints only, bool and numpy integers not: the usual path checks those; counting
            # the types by identity is 1.5x faster than a set of them at B = 256)
            if operator.countOf(map(type, num_draft_tokens), int) != len(num_draft_tokens):
                return None
            key.append(tuple(num_draft_tokens))
        elif t is torch.Tensor and _on_cuda(num_draft_tokens) and (
                max_num_draft_tokens is not None):
            inputs.append(num_draft_tokens)
            key.append(_sig(num_draft_tokens))
        else:
            return None
    for name, d in (("draft_logits", draft_logits), ("draft_probs", draft_probs)):
        if d is not None:
            if type(d) is not torch.Tensor:
                return None
            inputs.append(d)
            key += (name, _sig(d))
    return tuple(key), inputs


class _Entry:
    """A replayable call: the outputs to allocate, the launches with the positions of their
    address arguments, the path counts, how the results map to the outputs, and the tensors
    the launches read that outlive the call (kept alive here)."""

    __slots__ = ("allocs", "launches", "paths", "results", "keep", "checks")

    def __init__(self, allocs, launches, paths_, results, keep, checks) -> None:
        self.allocs, self.launches, self.paths = allocs, launches, paths_
        self.results, self.keep, self.checks = results, keep, checks

    def still_valid(self) -> bool:
        """Whether the batch's tensors that the launches read, and the kept results, still
        have their addresses."""
        return all(t.data_ptr() == p for t, p in self.checks)

    def same_as(self, other: _Entry) -> bool:
        """Whether two recordings of one key describe the same replay."""
        return (self.allocs == other.allocs and self.paths == other.paths
                and self.results == other.results and self.launches == other.launches)


class _Kept:
    """A result that outlives the call: the same tensor at every replay (compared by its
    address, shape, strides and dtype)."""

    __slots__ = ("tensor", "sig")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.sig = (t.data_ptr(), t.shape, t.stride(), t.dtype)

    def __eq__(self, other) -> bool:
        return type(other) is _Kept and self.sig == other.sig


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _build_entry(rec: _Recording, ops: _Ops, inputs: list, batch, result: tuple,
                 rows: int, kept: tuple[int, ...]) -> _Entry | str:
    """The entry of a finished recording, or the reason it cannot replay. ``kept``: the
    positions in ``result`` that may hold a tensor outliving the call."""
    if rec.failure is not None:
        return rec.failure
    if not rec.launches:
        return "no_launch"
    allocs = ops.allocs
    sources = inputs + allocs  # (slot i: inputs first, then the allocations)
    # (storages without memory, address 0, are told apart by nothing and read by no kernel)
    storages = [s for s in map(_storage, sources) if s]
    fields = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)]
    owned = {_storage(v) for v in fields} - {0}
    if len(set(storages)) != len(storages) or owned & set(storages):
        return "shared_storage"  # (an address could not be told apart from another's)
    by_storage = {s: i for i, s in enumerate(map(_storage, sources)) if s}
    keep: list = []
    launches = []
    for run, grid, stream, function, head, args, values, pad in rec.launches:
        # (one argument list per launch: the launcher's head, the kernel's, the padding)
        full = [*head, *values, *pad]
        slots = []
        for pos, a in enumerate(args):
            if not isinstance(a, torch.Tensor) or not a.data_ptr():
                continue
            src = by_storage.get(_storage(a))
            if src is None:
                # Outlives the call: its memory stays valid while its storage is kept (even
                # if the tensor is given another storage; a batch's tensors are checked).
                keep.append(a.untyped_storage())
                continue
            slots.append((len(head) + pos, src, a.data_ptr() - sources[src].data_ptr()))
            full[len(head) + pos] = None
        launches.append((run, *grid, stream, function, tuple(slots), full))
    results = []
    for pos, t in enumerate(result):
        if t is None:
            results.append(None)
            continue
        for j, a in enumerate(allocs):
            if (t.data_ptr() == a.data_ptr() and t.shape == a.shape and t.dtype == a.dtype
                    and t.stride() == a.stride()):
                results.append(j)
                break
        else:
            if (pos not in kept or by_storage.get(_storage(t)) is not None
                    or _storage(t) in owned):
                # (a user-visible output must be fresh; no view of an input or allocation, no
                # batch tensor)
                return "result_not_fresh"
            # A backend-internal result that outlives the call (the workspace's error bits,
            # which the API reads right after the call): every replay returns it again (the
            # entry holds the tensor, and checks its address).
            results.append(_Kept(t))
    spec = tuple(ops.specs)
    counted = (*rec.paths, ("host.replay", rows))
    # The batch's tensors with their addresses, and the kept results: a replay checks them
    # (``t.data = ...`` or ``t.set_(...)`` gives a tensor new memory without setting the
    # batch's attribute; a kept result so moved would be returned with memory no launch
    # writes).
    read = {_storage(a) for lc in rec.launches for a in lc[5] if isinstance(a, torch.Tensor)}
    checks = tuple((v, v.data_ptr()) for v in fields if _storage(v) in read) + tuple(
        (r.tensor, r.tensor.data_ptr()) for r in results if type(r) is _Kept)
    return _Entry(spec, launches, counted, tuple(results), keep, checks)


def _replay(entry: _Entry, inputs: list) -> list:
    """Run ``entry`` on ``inputs``: the path counts, the outputs, the launches. Returns the
    results as the recorded call returned them (tensors or None)."""
    paths.record_many(entry.paths)
    allocs = [make(*args, dtype=dtype, device=dev) for make, args, dtype, dev in entry.allocs]
    ptrs = [t.data_ptr() for t in inputs]
    ptrs += [a.data_ptr() for a in allocs]
    for run, g0, g1, g2, stream, function, slots, full in entry.launches:
        values = full.copy()
        for pos, src, delta in slots:
            values[pos] = ptrs[src] + delta
        run(g0, g1, g2, stream, function, *values)
    return [None if j is None else allocs[j] if type(j) is int else j.tensor
            for j in entry.results]


_LOCK = threading.Lock()  # (dropping a batch's oldest key)
# id(batch) -> that batch's {key: state}; a batch's entry is dropped when it is collected
_CALLS: dict[int, dict] = {}
_WATCHED: set[int] = set()  # ids of the living batches with a finalizer that drops it


def _dead(i: int) -> None:
    _CALLS.pop(i, None)
    _WATCHED.discard(i)


def _entries(batch) -> dict:
    i = id(batch)
    calls = _CALLS.get(i)
    if calls is None:
        calls = _CALLS[i] = {}
        if i not in _WATCHED:
            _WATCHED.add(i)
            weakref.finalize(batch, _dead, i)
    return calls


def forget(batch) -> None:
    """Drop the entries of ``batch`` (``SamplingBatch`` calls it when an attribute changes)."""
    _CALLS.pop(id(batch), None)


workspace.on_release(_CALLS.clear)


def run(keyed: tuple | None, batch, call: Callable[[], tuple],
        kept: tuple[int, ...] = ()) -> tuple:
    """``call()`` (which returns a tuple of tensors or None), through the cache of ``batch``
    under ``keyed`` (:func:`call_key`'s result; None runs ``call`` as usual). ``kept``: the
    positions of results the caller reads before its next call and never hands on, which may
    be tensors that outlive the call (returned again by every replay); every other result
    must be a fresh allocation."""
    if keyed is None:
        return call()
    key, inputs = keyed
    rows = inputs[0].shape[0]
    calls = _entries(batch)
    state = calls.get(key)
    if type(state) is _Entry:
        if state.still_valid():
            return tuple(_replay(state, inputs))
        state = None  # (recorded again)
    elif type(state) is _Pending and not state.entry.still_valid():
        state = _SEEN  # (a batch tensor got new memory between the recordings: start over)
    if state is None:  # first call: it may compile and create buffers; recorded from the next
        with _LOCK:
            while len(calls) >= MAX_KEYS:
                calls.pop(next(iter(calls)), None)
            calls[key] = _SEEN
        return call()
    if state is _REFUSED:
        return call()
    rec = _Recording()
    ops = _Ops(rec)
    token, ptoken = _RECORDING.set(rec), paths.recording.set(rec.paths)
    try:
        with ops:
            result = call()
    finally:
        _RECORDING.reset(token)
        paths.recording.reset(ptoken)
    entry = _build_entry(rec, ops, inputs, batch, result, rows, kept)
    if type(entry) is str or (state is not _SEEN and not entry.same_as(state.entry)):
        calls[key] = _REFUSED
        paths.record(f"host.replay_refused.{entry if type(entry) is str else 'unstable'}",
                     rows, check=False)  # (the call's work is done: never raise here)
    else:  # (a first recording waits for a second one that agrees with it)
        calls[key] = _Pending(entry) if state is _SEEN else entry
    return result

