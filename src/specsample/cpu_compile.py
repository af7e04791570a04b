"""Compiled CPU code for the torch backend's hot functions (torch.compile, Inductor's C++).

On a CPU an eager PyTorch call costs a few microseconds of dispatch per tensor operation
whatever its size, and the torch backend's three-level draw (``torch_backend.draw_rows``)
is about 120 small operations per call: the Philox rounds of three noise levels, gathers and
arg-maxes. ``torch.compile`` turns such a function into one C++ loop nest that evaluates the
same integer arithmetic (the Philox words are bit for bit the same) and the same float64
keys, at a fifth of the time (0.06 ms instead of 0.3 ms for the draws of 5 rows at
V = 49,152, one thread).

:func:`call` runs a function compiled when every tensor argument is on the CPU and none
needs a gradient, and eagerly otherwise. The first compiled call of a function compiles it:
about 20-25 s on a 2-core machine with an empty cache, 3-4 s in a later process (Inductor
keeps its output on disk); the engine's warm-up call takes that cost out of the timings.
Shapes are dynamic (one compiled function for every batch size and vocabulary); a tensor
dimension of size 1 would be specialised by ``torch.compile``, so callers pad those.

Paths (``specsample.paths``), counted per call with the rows it handled:

* ``cpu.compiled.<name>``: the compiled function ran;
* ``cpu.eager.<name>``: compilation is switched off (:func:`disabled`, or the environment
  variable ``SPECSAMPLE_CPU_COMPILE=0`` read at import), or an argument needs a gradient
  (the torch backend passes detached tensors where no gradient can flow, as to its draws);
* ``cpu.compile_failed.<name>``: compiling failed (for example no C++ compiler on the
  machine); the call ran eagerly, a ``RuntimeWarning`` names the error once, and later calls
  of that function run eagerly (and count here). :func:`failures` lists the errors.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

from . import paths

#: ``SPECSAMPLE_CPU_COMPILE=0`` switches compilation off for the process (read at import).
ENABLED = os.environ.get("SPECSAMPLE_CPU_COMPILE", "1") != "0"

_off: contextvars.ContextVar[bool] = contextvars.ContextVar("specsample_cpu_compile_off",
                                                            default=False)
_lock = threading.Lock()
_compiled: dict[str, Callable] = {}
_failed: dict[str, str] = {}


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block (this thread or task), :func:`call` runs every function eagerly."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


def failures() -> dict[str, str]:
    """``{function name: the error its compilation raised}`` for this process."""
    with _lock:
        return dict(_failed)


def active(*tensors: torch.Tensor) -> bool:
    """True when :func:`call` with these tensor arguments would run compiled (or try to):
    all on the CPU, compilation on and never failed, no gradient needed. A caller whose
    eager alternative
    is cheaper than the eager run of the compiled function asks first."""
    return (ENABLED and not _off.get() and not _failed
            and all(t.device.type == "cpu" for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def _compiled_fn(name: str, fn: Callable) -> Callable:
    with _lock:
        c = _compiled.get(name)
        if c is None:
            c = _compiled[name] = torch.compile(fn, dynamic=True, fullgraph=True)
        return c


def call(name: str, fn: Callable, *args, rows: int):
    """``fn(*args)``, compiled on the CPU (see the module docstring); counts the path
    ``cpu.<compiled|eager|compile_failed>.<name>`` with ``rows`` rows. ``fn`` must be a pure
    function of its tensor arguments (the compiled and eager results are the same function),
    and the tensors must be on one device: only CPU calls are counted or compiled."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors[0].device.type != "cpu":
        return fn(*args)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not ENABLED or _off.get() or needs_grad:
        paths.record(f"cpu.eager.{name}", rows)
        return fn(*args)
    if name in _failed:
        paths.record(f"cpu.compile_failed.{name}", rows)
        return fn(*args)
    try:
        out = _compiled_fn(name, fn)(*args)
    except Exception as exc:  # noqa: BLE001 (any compiler error: the eager run decides)
        out = fn(*args)  # (an error of the function itself raises here, as it would eagerly)
        with _lock:
            _failed[name] = f"{type(exc).__name__}: {exc}"[:2000]
        warnings.warn(f"specsample: torch.compile of {name!r} failed, so it runs eagerly "
                      f"(slower; path cpu.compile_failed.{name}): {type(exc).__name__}: "
                      f"{str(exc)[:300]}", RuntimeWarning, stacklevel=2)
        paths.record(f"cpu.compile_failed.{name}", rows)
        return out
    paths.record(f"cpu.compiled.{name}", rows)
    return out
