"""Compiled CPU code for the torch backend's hot functions (torch.compile, Inductor's C++).

On a CPU an eager PyTorch call costs a few microseconds of dispatch per tensor operation
whatever its size, and the torch backend's three-level draw is about 120 small operations per
call: the Philox rounds of three noise levels, gathers and arg-maxes, around the passes that
build the processed logits. ``torch.compile`` turns such a function into one C++ loop nest
that evaluates the same integer arithmetic (the Philox words are bit for bit the same) at a
fraction of the time (the draws of 5 rows at V = 49,152 on one thread: 0.06 ms instead of
0.3 ms). Its floating-point results may round differently from the eager run of the same
function (a log, a sum in another order: an ulp), as the backends do between them; the
torch backend therefore draws every sampled CPU row with one function
(``torch_backend.sample_processed``), so that no request's tokens depend on which other
requests share its batch.

:func:`call` runs a function compiled when its tensors are on the CPU, with gradients off
(the torch backend passes detached tensors: its compiled functions return token ids). The
first call of a variant compiles it: 20-45 s on a 2-core machine with an empty cache, 2-4 s
in a later process (Inductor keeps its output on disk); ``specsample.warmup(
device="cpu", vocab_size=V)`` and the engine's warm-up call take that cost out of the
timings. Shapes are dynamic: one compilation serves every batch size, and a vocabulary
falls in one of a few classes (below one tile of 2,048, a multiple of it, or neither). A
variant is a logits dtype together with the kind of tensor (inference tensors, made under
``torch.inference_mode``, or not) and the caller's flags (the torch backend's: whether the
rows' filter cuts split tie groups); each variant has its own compiled function, so a
process that mixes them does not run into torch.compile's limit of 8 recompilations per
function. Each costs 20-45 s on an empty Inductor cache on 2 cores.
A tensor dimension of size 1 would be specialised by ``torch.compile``: callers pad those.

Paths (``specsample.paths``), counted per call with the rows it handled:

* ``cpu.compiled.<name>``: the compiled function ran;
* ``cpu.eager.<name>``: compilation is switched off (:func:`disabled`, or the environment
  variable ``SPECSAMPLE_CPU_COMPILE=0`` read at import), or a tensor argument needs a
  gradient (never from the torch backend, which passes detached tensors);
* ``cpu.compile_failed.<name>``: compiling failed (for example no C++ compiler on the
  machine); the call ran eagerly, a ``RuntimeWarning`` names the error once per variant,
  and later calls of that variant run eagerly (and count here). :func:`failures` lists the
  errors.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import types
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.fx.experimental._config as _fx_config

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
    """``{function name[variant]: the error its compilation raised}`` for this process."""
    with _lock:
        return dict(_failed)


def _compiled_fn(key: str, fn: Callable) -> Callable:
    with _lock:
        c = _compiled.get(key)
        if c is None:
            # A copy of the function with its own code object: torch.compile keeps its
            # compiled variants, and its limit of recompilations (8), per code object, so each
            # variant key gets its own budget of shape classes.
            copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                      fn.__defaults__, fn.__closure__)
            c = _compiled[key] = torch.compile(copy, dynamic=True, fullgraph=True)
        return c


def call(name: str, fn: Callable, *args, rows: int, variant: tuple = ()):
    """``fn(*args)``, compiled on the CPU (see the module docstring); counts the path
    ``cpu.<compiled|eager|compile_failed>.<name>`` with ``rows`` rows. ``fn`` must be a pure
    function of its tensor arguments (the compiled and eager results are the same function),
    and the tensors must be on one device: only CPU calls are counted or compiled. The
    compiled run has gradients off. ``variant``: what the arguments' guards differ by between
    calls besides shapes (a dtype, inference tensors or not): each variant is compiled apart,
    so that a process mixing them does not exhaust torch.compile's recompilation limit."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors[0].device.type != "cpu":
        return fn(*args)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not ENABLED or _off.get() or needs_grad:
        paths.record(f"cpu.eager.{name}", rows)
        return fn(*args)
    key = name + "".join(f"[{v}]" for v in variant)
    if key in _failed:
        paths.record(f"cpu.compile_failed.{name}", rows)
        return fn(*args)
    duck = _fx_config.use_duck_shape
    try:
        # (no duck sizing: two arguments' dimensions that happen to be equal in the call that
        # compiles, e.g. 2 requests and 2 drafts, would get one symbol, and every later call
        # where they differ would compile again; the setting is read only when compiling)
        _fx_config.use_duck_shape = False
        with torch.no_grad():
            out = _compiled_fn(key, fn)(*args)
    except Exception as exc:  # noqa: BLE001 (any compiler error: the eager run decides)
        out = fn(*args)  # (an error of the function itself raises here, as it would eagerly)
        with _lock:
            _failed[key] = f"{type(exc).__name__}: {exc}"[:2000]
        warnings.warn(f"specsample: torch.compile of {key!r} failed, so it runs eagerly "
                      f"(slower; path cpu.compile_failed.{name}): {type(exc).__name__}: "
                      f"{str(exc)[:300]}", RuntimeWarning, stacklevel=2)
        paths.record(f"cpu.compile_failed.{name}", rows)
        return out
    finally:
        _fx_config.use_duck_shape = duck
    paths.record(f"cpu.compiled.{name}", rows)
    return out
