"""Kernel launches without most of Triton's per-launch Python.

``kernel[grid](*args, **meta)`` runs Triton's ``JITFunction.run`` at every call: it binds and
specialises the arguments, builds the cache key as a string, compares every global the
kernel reads with its value at compile time (``tl.constexpr.__ne__``, a few Python calls
each), then calls the compiled kernel's launcher, which asks the driver about every tensor
argument (``data_ptr()`` and ``cuPointerGetAttribute``, one driver call per pointer). Measured
on an H200 host that is 30-70 us per launch, most of an eager call.

``launch(kernel)[grid](*args, **meta)`` does the same launch with a key of its own: per
argument, a tensor's dtype and whether its address is 16-byte aligned, an int's class (1,
divisible by 16 or not, 32 / 64-bit range), a bool's value, the type of anything else; plus
the meta-parameters. Those are the properties Triton's binder specialises on (a tensor's dtype
and alignment, an int's value 1, divisibility by 16 and range), so one key names one
specialisation, hence one compiled kernel, provided the meta-parameters (every constexpr) are
given by keyword: a launch that passes a constexpr by position, or leaves a runtime parameter
to a keyword, always takes Triton's path. The first launch of each key goes through
``kernel[grid]`` itself (binding, compilation if needed, the compile guard's hooks, the
cache); later ones call the compiled kernel's launcher directly with
the tensors' addresses as integers (no driver query per pointer), and without Triton's launch
hooks and their per-launch metadata when no hook is installed (Triton 3.6 calls its empty
default hook chain around every launch), and, for kernels that need no global or profile
scratch memory, straight into the C launcher (``_launcher``). Every launch in Triton's
interpreter goes through ``kernel[grid]``. What it skips: the string key, the driver's pointer
check (our callers validate devices), and the check that the globals a kernel reads have not
changed since it compiled (ours are module constants that nothing reassigns).
Programmatic dependent launch (sm_90 and later): every kernel of the single-device backend
(this package's modules; not ``specsample._distributed_kernels``, whose launches stay
ordinary) takes a ``GDC`` constexpr, which :class:`launch` sets (the caller never passes it),
and starts with :func:`wait_for_prior_grid`. On a CUDA GPU of compute capability 9 or more
GDC is true and the direct launches of kernels that need no scratch memory (all of ours) set
the C launcher's ``launch_pdl`` flag (programmatic stream serialization):
the kernel may be launched before the kernel ahead of it on the stream has finished, and
its programs wait (``griddepcontrol.wait``) until that kernel has finished and its writes are
visible, before any load or store. The launch of each kernel of a call overlaps the exit of
the one before it, eager and in a CUDA graph (0.1-1.5 us less per replay, 5-11 us less per
back-to-back eager call at B >= 8 on an H100: BENCHMARKS.md, "Programmatic dependent
launch"). A launch through Triton's path (the first of a specialisation, or one while
launch hooks are installed) is an ordinary launch; the wait is then a no-op.
Elsewhere (older GPUs, Triton's interpreter, another Triton version, ``SPECSAMPLE_PDL=0`` in
the environment) GDC is false and every launch an ordinary one: the same code otherwise.
``compile_pool.collect`` sets ``_COMPILED`` aside while it lists variants, so that every launch
then reaches its hook. While ``specsample.call_cache`` records a call, each direct launch is
added to the recording, and a launch that takes Triton's path fails it: every kernel a
``sample()`` / ``verify()`` call runs must be launched through :class:`launch`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_wait
from triton.runtime.driver import driver

from ..call_cache import recording

# (kernel, device, argument key, meta items, meta types, debug, instrumentation)
#   -> (launcher, function handle, launcher arguments before the kernel's, constexpr padding)
_COMPILED: dict[tuple, Any] = {}
# The Triton version whose CudaLauncher.__call__ argument order ``_launcher`` reproduces.
_C_LAUNCH_CHECKED = triton.__version__.split(".")[:2] == ["3", "6"]
_I32 = 1 << 31
_I64 = 1 << 63
_U64 = 1 << 64
_Tensor = torch.Tensor
# Programmatic dependent launch where the GPU has it (module docstring); SPECSAMPLE_PDL=0
# in the environment turns it off for the process (benchmarks compare both).
PDL = os.environ.get("SPECSAMPLE_PDL", "1").strip().lower() not in ("0", "false", "off", "no")
_PDL_DEVICES: dict[int, bool] = {}  # device index -> programmatic dependent launches there


@triton.jit
def wait_for_prior_grid(GDC: tl.constexpr):
    """The first statement of every kernel launched through :class:`launch`: with GDC, wait
    until the kernel before this one on the stream has finished and its memory operations are
    visible (PTX ``griddepcontrol.wait``). Nothing without GDC. (No early
    ``griddepcontrol.launch_dependents``: the next kernel launches as this one's programs
    exit; BENCHMARKS.md, "Programmatic dependent launch".)"""
    if GDC:
        gdc_wait()


def pdl_enabled(device: int) -> bool:
    """Whether launches on CUDA device ``device`` (an index, the current device) are
    programmatic dependent launches (the module docstring): :data:`PDL`, Triton's target for
    the device a CUDA one of compute capability 9.0 or more (what the kernels compile for),
    and the Triton version whose C launcher ``_launcher`` calls (``_C_LAUNCH_CHECKED``)."""
    on = _PDL_DEVICES.get(device)
    if on is None:
        on = False
        if PDL and _C_LAUNCH_CHECKED:
            target = driver.active.get_current_target()
            on = (target.backend == "cuda" and isinstance(target.arch, int)
                  and target.arch >= 90)
        _PDL_DEVICES[device] = on
    return on


def _takes_gdc(kernel: Any) -> bool:
    return "GDC" in getattr(kernel, "arg_names", ())


def _set_gdc(kernel: Any, meta: dict, on: bool) -> bool:
    """Set ``meta["GDC"] = on`` for a kernel that takes GDC; whether it was set and true.
    (Only on Triton's path and a launch key's first launch: a direct launch's compiled
    entry already has it.)"""
    if not _takes_gdc(kernel):
        return False
    meta["GDC"] = on
    return on


def arg_key(args: tuple) -> tuple[tuple, list] | None:
    """(key, launch values) of positional kernel arguments: the key as the module docstring
    says, the values with every tensor replaced by its address. None when an argument is of a
    kind the key does not cover (Triton's own path then decides)."""
    key: list = []
    values: list = []
    k, v = key.append, values.append
    for a in args:
        t = type(a)
        if t is _Tensor or (t is not int and isinstance(a, _Tensor)):
            p = a.data_ptr()
            v(p)
            k((a.dtype,) if p & 15 else a.dtype)  # (a tuple when not 16-byte aligned)
            continue
        v(a)
        if t is int:
            if not -_I64 <= a < _U64:
                return None  # (Triton raises for it: let it)
            k(1 if a == 1 else (2 if a & 15 else 3) if -_I32 <= a < _I32 else
              (4 if a & 15 else 5) if a < _I64 else (6 if a & 15 else 7))
        elif t is float:
            k(0.5)
        elif t is bool:
            k("T" if a else "F")
        elif a is None:
            k(None)
        else:
            return None
    return tuple(key), values


class _Launch:
    __slots__ = ("kernel", "grid")

    def __init__(self, kernel: Any, grid: tuple[int, ...]) -> None:
        self.kernel = kernel
        self.grid = grid

    def __call__(self, *args: Any, **meta: Any) -> None:
        kernel, grid = self.kernel, self.grid
        keyed = None
        rec = recording()
        gpu = hasattr(kernel, "device_caches")  # (else Triton's interpreter)
        if gpu and not (
                _hooked(knobs.runtime.launch_enter_hook)
                or _hooked(knobs.runtime.launch_exit_hook)):
            keyed = arg_key(args)  # (else Triton's interpreter, or launch hooks that read
        if keyed is None:          # the arguments as given)
            if rec is not None:
                rec.fail("launch.triton")
            _set_gdc(kernel, meta, gpu and pdl_enabled(driver.active.get_current_device()))
            kernel[grid](*args, **meta)
            return
        akey, values = keyed
        device = driver.active.get_current_device()
        # (the meta values' types too: True == 1 == 1.0, but Triton keys them apart; GDC, set
        # below on a miss, is decided by the kernel and the device, both in the key)
        key = (kernel, device, akey, tuple(meta.items()), tuple(map(type, meta.values())),
               knobs.runtime.debug, knobs.compilation.instrumentation_mode)
        entry = _COMPILED.get(key)
        if entry is None:
            if rec is not None:
                rec.fail("launch.first")
            gdc = _set_gdc(kernel, meta, pdl_enabled(device))
            compiled = kernel[grid](*args, **meta)  # compiles if needed, and launches
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            pad = _constexpr_tail(kernel, len(args))
            if compiled is not None and pad is not None:
                run, head = _launcher(compiled)
                if gdc and head[:2] == (False, False):
                    # the C launcher's launch_pdl flag (programmatic stream serialization),
                    # for a kernel that waits for its predecessor
                    head = (False, True, *head[2:])
                _COMPILED[key] = (run, compiled.function, (*head, compiled.packed_metadata,
                                                           None, None, None), (None,) * pad)
            return
        run, function, head, pad = entry
        stream = driver.active.get_current_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, stream, function, *head, *values, *pad)
        if rec is not None:
            rec.launch(run, (grid[0], g1, g2), stream, function, head, args, values, pad)


def _launcher(compiled: Any) -> tuple[Any, tuple]:
    """(callable, the arguments it takes between the function handle and the kernel's
    launch metadata) for a compiled kernel. Triton 3.6's ``CudaLauncher.__call__`` builds
    two scratch allocations per launch, then calls its C launcher with the cooperative-grid
    and PDL flags and the two scratch pointers; for a kernel that needs neither scratch
    (sizes 0: all of ours) the C launcher is called directly with the flags and two Nones,
    which is the same call without 3-5 us of Python per launch. Only on the Triton minor
    version whose launcher this was checked against (``_C_LAUNCH_CHECKED``); anything else
    keeps ``compiled.run``."""
    run = compiled.run
    if not _C_LAUNCH_CHECKED:
        return run, ()
    try:
        if run.global_scratch_size == 0 and run.profile_scratch_size == 0:
            return run.launch, (run.launch_cooperative_grid, run.launch_pdl, None, None)
    except AttributeError:
        pass
    return run, ()


def _hooked(hook: Any) -> bool:
    """Whether a launch hook would do anything: Triton 3.6 installs an empty ``HookChain``
    by default (a profiler adds to it), and calls it around every launch it makes."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _constexpr_tail(kernel: Any, given: int) -> int | None:
    """How many parameters follow the ``given`` positional ones, when all of them are
    constexpr and none of the positional ones is (the launcher takes every parameter in order
    and ignores the constexpr values; the key does not tell constexpr values apart). None
    otherwise: that launch always takes Triton's path."""
    params = kernel.params
    if any(p.is_constexpr for p in params[:given]):
        return None
    rest = params[given:]
    return len(rest) if all(p.is_constexpr for p in rest) else None


class launch:
    """``launch(kernel)[grid](*args, **meta)``: ``kernel[grid](*args, **meta)`` through the
    compiled kernel's launcher once that specialisation has run (module docstring). ``grid``:
    a tuple of 1 to 3 ints. Runtime arguments by position, constexprs by keyword. The caller
    guarantees that every tensor argument is on the current CUDA device (the direct launch
    passes addresses, which the driver does not check). Errors are Triton's own (the first
    launch of a specialisation takes Triton's path)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: tuple[int, ...]) -> _Launch:
        return _Launch(self.kernel, grid)
