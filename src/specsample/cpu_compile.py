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
A tensor dimension of size 1 would be specialised by ``torch.compile``: callers pad those,
except the rows of a function called with ``pad`` (its tensors lead with the rows): such a
function is compiled with size-oblivious sizes (``backed_size_oblivious``), from a call of two
rows or more at the vocabulary size (a one-row call before that goes padded to two), and a
call of one row then runs
that same graph, so a row's result is the same alone as in a batch. A one-row call that
compiles a graph all the same (guards that refuse one row: Inductor guards some graphs, such
as the candidates' draw, on two rows or more; or a changed setting that the guards check,
such as the number of threads) drops that function's compiled form, which compiles again
from two rows, and its one-row calls at that vocabulary size go padded from then on (path
``cpu.one_row_padded.<name>``). The settings these calls make (duck sizing off,
size-oblivious sizes for row functions) are process-wide while a compiled call runs: the
calls run one at a time, under a lock, and a ``torch.compile`` of other code in another
thread at that moment compiles under them (and a compilation there, moving torch.compile's
count of graphs during a one-row call here, makes that call count as refused: slower, never
wrong).

Paths (``specsample.paths``), counted per call with the rows it handled:

* ``cpu.compiled.<name>``: the compiled function ran;
* ``cpu.eager.<name>``: compilation is switched off (:func:`disabled`, or the environment
  variable ``SPECSAMPLE_CPU_COMPILE=0`` read at import), or a tensor argument needs a
  gradient (never from the torch backend, which passes detached tensors);
* ``cpu.one_row_padded.<name>``: a one-row call that compiled a graph (see above), made
  again padded; that function's one-row calls at that vocabulary size are padded from then
  on;
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
_settings_lock = threading.Lock()
#: Whether this torch has size-oblivious sizes (without them one row always goes padded).
_OBLIVIOUS = hasattr(_fx_config, "backed_size_oblivious")
_many_rows: set[tuple[str, int]] = set()  # (function, V): called with two rows or more
_padded_rows: set[tuple[str, int]] = set()  # (function, V): one row goes padded


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


def _graphs() -> int:
    """How many graphs torch.compile has compiled in this process."""
    # (imported here: importing torch._dynamo imports triton, and on the Triton backend's CPU
    # route the library switches Triton's interpreter on only before triton is imported)
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _direct(key: str, fn: Callable, args: tuple, pad: Callable[[tuple], tuple]
            ) -> tuple[object, bool]:
    """(``fn(*args)`` of one row through the graph compiled for many, whether one row was
    refused). Should the call compile a graph (the guards refused one row, or something they
    check changed, such as the number of threads), that graph was traced from one row and
    later calls of more rows could pick it, and its sums could round otherwise: the
    function's compiled form is dropped (a new copy compiles from two rows), the call is made
    padded, and one row goes padded at this vocabulary size from then on."""
    graphs = _graphs()
    out = _compiled_fn(key, fn)(*args)
    if _graphs() == graphs:
        return out, False
    with _lock:
        _compiled.pop(key, None)
        _padded_rows.add((key, args[0].shape[1]))
    return _compiled_fn(key, fn)(*pad(args)), True  # (compiled from two rows)


def call(name: str, fn: Callable, *args, rows: int, variant: tuple = (),
         pad: Callable[[tuple], tuple] | None = None):
    """``fn(*args)``, compiled on the CPU (see the module docstring); counts the path
    ``cpu.<compiled|eager|compile_failed>.<name>`` with ``rows`` rows. ``fn`` must be a pure
    function of its tensor arguments (the compiled and eager results are the same function),
    and the tensors must be on one device: only CPU calls are counted or compiled. The
    compiled run has gradients off. ``variant``: what the arguments' guards differ by between
    calls besides shapes (a dtype, inference tensors or not): each variant is compiled apart,
    so that a process mixing them does not exhaust torch.compile's recompilation limit.
    ``pad``: given for a function whose leading arguments have ``rows`` as their first
    dimension and whose other dimensions do not change between calls (the caller marks the
    widths of 2-D arguments static; x's vocabulary stays dynamic): ``pad(args)`` repeats the
    one row of each leading argument to two, and the caller reads the first ``rows`` rows of
    the result (one-row calls go padded until the function has run with more rows at that
    vocabulary size, and where the compiled graph refuses one row: :func:`_direct`).
    Compiled calls run one at a time (the settings they make are process-wide)."""
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
    one_row = pad is not None and rows == 1
    size = (key, args[0].shape[1])
    direct = one_row and _OBLIVIOUS and size in _many_rows and size not in _padded_rows
    refused = False
    if one_row and not direct:
        args = pad(args)
    # (the settings are process-wide: one compiled call at a time, so that two threads never
    # restore each other's values)
    with _settings_lock:
        duck = _fx_config.use_duck_shape
        oblivious = _fx_config.backed_size_oblivious if _OBLIVIOUS else False
        try:
            # (no duck sizing: two arguments' dimensions that happen to be equal in the call
            # that compiles, e.g. 2 requests and 2 drafts, would get one symbol, and every
            # later call where they differ would compile again; size-oblivious sizes for row
            # functions: a graph compiled for many rows that also serves one; both are read
            # when compiling)
            _fx_config.use_duck_shape = False
            if _OBLIVIOUS:
                _fx_config.backed_size_oblivious = pad is not None
            with torch.no_grad():
                out, refused = _direct(key, fn, args, pad) if direct else (
                    _compiled_fn(key, fn)(*args), False)
            if pad is not None and not direct and size not in _many_rows:
                with _lock:  # (run with two rows or more: a graph for every row count)
                    _many_rows.add(size)
        except torch._dynamo.exc.RecompileError:
            raise  # (the caller's own torch._dynamo.config.error_on_recompile)
        except Exception as exc:  # noqa: BLE001 (any compiler error: the eager run decides)
            out = fn(*args)  # (an error of the function itself raises here, as eagerly)
            with _lock:
                _failed[key] = f"{type(exc).__name__}: {exc}"[:2000]
            warnings.warn(f"specsample: torch.compile of {key!r} failed, so it runs eagerly "
                          f"(slower; path cpu.compile_failed.{name}): {type(exc).__name__}: "
                          f"{str(exc)[:300]}", RuntimeWarning, stacklevel=2)
            paths.record(f"cpu.compile_failed.{name}", rows)
            return out
        finally:
            _fx_config.use_duck_shape = duck
            if _OBLIVIOUS:
                _fx_config.backed_size_oblivious = oblivious
    if refused:
        paths.record(f"cpu.one_row_padded.{name}", rows)
    paths.record(f"cpu.compiled.{name}", rows)
    return out
