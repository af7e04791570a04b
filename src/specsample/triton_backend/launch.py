"""Kernel launches without most of Triton's per-launch Python.

``kernel[grid](*args, **meta)`` runs Triton's ``JITFunction.run`` at every call: it binds and
specialises the arguments, builds the cache key as a string, compares every global the
kernel reads with its value at compile time (``tl.constexpr.__ne__``, a few Python calls
each), then calls the compiled kernel's launcher. Measured on an H200 that is about 70 us per
launch (cProfile share of an eager ``verify()`` at 406 us: 60% inside ``run``), most of an
eager call. ``launch(kernel)[grid](*args, **meta)`` does the same launch with Triton's own
binder (so the same specialisation, hence the same compiled kernel Triton would pick) and a
dict keyed by its result, then calls the launcher directly; the first launch of each
specialisation, and every launch in Triton's interpreter, go through ``kernel[grid]`` itself
(compilation, the compile guard's hooks, the cache). What it skips: the string key and the
check that the globals a kernel reads have not changed since it compiled (ours are module
constants that nothing reassigns). ``compile_pool.collect`` sets ``_COMPILED`` aside while it
lists variants, so that every launch then reaches its hook.
"""

from __future__ import annotations

from typing import Any

from triton import knobs
from triton.runtime.driver import driver

# (kernel, device, specialisation, options) -> compiled kernel
_COMPILED: dict[tuple, Any] = {}


class _Launch:
    __slots__ = ("kernel", "grid")

    def __init__(self, kernel: Any, grid: tuple[int, ...]) -> None:
        self.kernel = kernel
        self.grid = grid

    def __call__(self, *args: Any, **meta: Any) -> None:
        kernel, grid = self.kernel, self.grid
        if not hasattr(kernel, "device_caches"):  # Triton's interpreter
            kernel[grid](*args, **meta)
            return
        device = driver.active.get_current_device()
        binder = kernel.device_caches[device][4]
        bound, specialization, options = binder(*args, **meta)
        # (the meta values' types too: True == 1 == 1.0, but Triton keys them apart)
        key = (kernel, device, tuple(specialization), tuple(options.items()),
               tuple(map(type, meta.values())), knobs.runtime.debug,
               knobs.compilation.instrumentation_mode)
        compiled = _COMPILED.get(key)
        if compiled is None:
            compiled = kernel[grid](*args, **meta)  # compiles if needed, and launches
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            if compiled is not None:
                _COMPILED[key] = compiled
            return
        stream = driver.active.get_current_stream(device)
        values = bound.values()
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *values),
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)


class launch:
    """``launch(kernel)[grid](*args, **meta)``: ``kernel[grid](*args, **meta)`` through the
    compiled kernel's launcher once that specialisation has run (module docstring). ``grid``:
    a tuple of 1 to 3 ints. Errors are Triton's own (the first launch of a specialisation
    takes Triton's path)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: tuple[int, ...]) -> _Launch:
        return _Launch(self.kernel, grid)
