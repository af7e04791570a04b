"""Path accounting: which implementation handled each call, and how many rows it took.

Every entry point records the path it ran under a stable name, for example
``"torch.verify.onehot"``, ``"triton.verify.fused"`` or ``"triton.sample.general"`` (the
FP32 general path that a processor beyond temperature needs). A benchmark or test can read the
counts, reset them, or forbid a path so that running it raises :class:`ForbiddenPathError`
instead of silently measuring code that was never meant to run.

Example::

    import specsample
    specsample.paths.reset()
    with specsample.paths.forbid("triton.verify.general", "torch.*"):
        specsample.verify(...)
    print(specsample.paths.counts())  # {"triton.verify.fused": {"calls": 1, "rows": 640}}
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_counts: dict[str, dict[str, int]] = {}
_forbidden: list[str] = []
# specsample.call_cache's recording in this thread or task: a list that every record joins
recording: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "specsample_paths_recording", default=None)


class ForbiddenPathError(RuntimeError):
    """Raised when a call would run a path that :func:`forbid` forbids."""


def record(name: str, rows: int, *, check: bool = True) -> None:
    """Count one call of path ``name`` that handled ``rows`` rows; raise if it is forbidden
    (``check=False``: count it all the same, for bookkeeping after a call's work, such as
    ``call_cache``'s refusals)."""
    record_many(((name, int(rows)),), check=check)


def record_many(entries: tuple[tuple[str, int], ...], *, check: bool = True) -> None:
    """:func:`record` of every (name, rows) in ``entries``, under one lock; raises before
    counting any of them if one is forbidden (a replayed call's counts: ``call_cache``)."""
    with _lock:
        for pattern in _forbidden if check else ():
            for name, _rows in entries:
                if fnmatch.fnmatchcase(name, pattern):
                    raise ForbiddenPathError(f"path {name!r} is forbidden (pattern {pattern!r})")
        for name, rows in entries:
            entry = _counts.get(name)
            if entry is None:
                entry = _counts[name] = {"calls": 0, "rows": 0}
            entry["calls"] += 1
            entry["rows"] += rows
    rec = recording.get()
    if rec is not None:
        rec.extend(entries)


def counts() -> dict[str, dict[str, int]]:
    """A copy of the counters: ``{path name: {"calls": int, "rows": int}}``."""
    with _lock:
        return {k: dict(v) for k, v in _counts.items()}


def reset() -> None:
    """Zero every counter."""
    with _lock:
        _counts.clear()


@contextlib.contextmanager
def forbid(*patterns: str) -> Iterator[None]:
    """Within the block, running a path matching any glob ``pattern`` raises ForbiddenPathError."""
    with _lock:
        _forbidden.extend(patterns)
    try:
        yield
    finally:
        with _lock:
            for p in patterns:
                _forbidden.remove(p)
