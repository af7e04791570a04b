"""Test configuration: Triton's interpreter on machines without CUDA.

The Triton backend's kernels run on CPU tensors through Triton's interpreter, which must be
switched on before triton is first imported; on a CUDA machine the kernels compile for real.
Two speed-ups of the interpreter for the suite (they change no result; see each function):
the language is patched once per launch, and the kernels' Philox words come from numpy.
The torch backend's CPU functions run uncompiled except in tests/test_cpu_compile.py.
PyTorch runs one intra-op thread per test process (and Inductor compiles in-process).
"""

import gc
import os
import sys

# One xdist worker per core (README's test command: -n auto): PyTorch's intra-op threads and
# Inductor's compile workers on top of that oversubscribe the cores (OpenMP threads spin
# between parallel regions); on a 2-core machine one thread per worker ran the torch
# backend's test files in 102 s instead of 153 s.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The torch backend's compiled CPU functions (specsample.cpu_compile) compile once per shape
# class, 15-25 s each on a 2-core machine: the suite runs their eager form (the same Python
# functions), and tests/test_cpu_compile.py switches compilation on and checks the compiled
# results against it (this process, and the CLI's subprocesses, read the variable).
os.environ.setdefault("SPECSAMPLE_CPU_COMPILE", "0")


def _patch_the_language_once_per_launch() -> None:
    """Triton 3.6's interpreter re-patches ``triton.language`` (``inspect.getmembers`` of
    four namespaces, about 1.5 ms) at every call of a ``@triton.jit`` helper from a kernel,
    although the launch has already patched the same module objects the same way and
    restores them when it ends. Our kernels call helpers tens of thousands of times per test
    file: this skips the repeated patch while the launch's own patches are in place (the
    helper's globals must see no language module the launch did not patch). A sampling
    call at V = 4000 took 28% less time. Where the interpreter lacks these internals, the
    suite runs as it is, only slower."""
    try:
        from triton.runtime import interpreter as ti
        real, scope_type, lang = ti._patch_lang, ti._LangPatchScope, ti.tl
        launch_code = ti.GridExecutor.__call__.__code__
    except (ImportError, AttributeError):
        return
    active = {}

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is lang or v is lang.core}

    def patch_lang(fn):
        if sys._getframe(1).f_code is launch_code:  # a launch: patch, and remember it
            scope = real(fn)
            active.update(scope=scope, langs=langs(fn))
            return scope
        scope = active.get("scope")
        seen = langs(fn)  # (none: the real patch raises, as it should)
        if scope is not None and scope._changes and seen and seen <= active["langs"]:
            return scope_type()  # a helper inside that launch: its patches are in place
        return real(fn)

    ti._patch_lang = patch_lang


def _philox_in_numpy() -> None:
    """In the interpreter the kernels' Philox4x32-10 (``kernels._philox_words01``: ten rounds
    of about eight Triton operations on a tile, each dispatched through the interpreter) took
    about half of every sampling test. Here it is ``rng._philox_numpy``, the function the
    torch backend draws with, on the same uint32 words: the tokens are the same bits either
    way, and ``tests/test_rng.py`` runs the Triton code itself (``PHILOX_JIT``) against it."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        from specsample import rng
        from specsample.triton_backend import kernels
    except ImportError:  # (no triton: its tests skip)
        return

    jit = kernels._philox_words01

    def philox_words01(c0, c1, c2, c3, k0, k1):
        words = (c0, c1, c2, c3, k0, k1)
        if any(w.dtype != tl.uint32 or w.shape != c0.shape for w in words):
            return jit(*words)  # (only uint32 words of one shape are the same bits in numpy)
        out = rng._philox_numpy(*(np.asarray(w.handle.data, dtype=np.uint64) for w in words))
        shape = np.shape(c0.handle.data)
        return tuple(tl.core.tensor(TensorHandle(np.asarray(o, dtype=np.uint32).reshape(shape),
                                                 tl.uint32), c.type)
                     for o, c in zip(out, (c0, c1)))

    philox_words01.jit = jit
    kernels._philox_words01 = philox_words01


def _builtins_patched_from_a_list() -> None:
    """Every launch, Triton 3.6's interpreter lists the members of five language namespaces
    (``inspect.getmembers``) to find their builtins and wraps each (about 900) in a new
    function bound to its builder; and ``_get_np_dtype`` builds a table of 17 dtypes at every
    load, store and cast. Here the wrappers are made once, before any launch (while nothing
    is patched), by the interpreter's own ``_patch_attr``, and each launch sets those same
    wrappers (restored as before when it ends); the dtype table is built once. Namespaces or
    builders other than those take the interpreter's own path."""
    class Recorder:  # (a patch scope that only notes what would be set)
        def __init__(self) -> None:
            self.wrappers: list = []

        def set_attr(self, obj, name, value) -> None:
            self.wrappers.append((name, value))

    try:
        import inspect

        import numpy as np
        from triton.runtime import interpreter as ti
        tl, builder = ti.tl, ti.interpreter_builder
        real_patch, real_np_dtype = ti._patch_builtin, ti._get_np_dtype
        prepared = {}
        for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
            rec = Recorder()
            for name, member in inspect.getmembers(pkg):
                if tl.core.is_builtin(member):
                    ti._patch_attr(pkg, name, member, builder, rec)
            prepared[id(pkg)] = (pkg, rec.wrappers)
    except (ImportError, AttributeError, TypeError):  # (another interpreter: as it is)
        return

    def patch_builtin(pkg, b, scope):
        entry = prepared.get(id(pkg))
        if b is not builder or entry is None or entry[0] is not pkg:
            return real_patch(pkg, b, scope)
        for name, wrapper in entry[1]:
            scope.set_attr(pkg, name, wrapper)

    pointer, block, u64 = tl.pointer_type, tl.block_type, np.dtype(np.uint64)
    table = {}

    def np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype
        if isinstance(element, pointer):
            return u64
        name = getattr(element, "name", None)
        found = table.get(name)
        if found is None:
            found = real_np_dtype(element)
            if type(name) is str:
                table[name] = found
        return found

    ti._patch_builtin, ti._get_np_dtype = patch_builtin, np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()
    _philox_in_numpy()
    _builtins_patched_from_a_list()

# Python's cyclic garbage collector: the interpreter and Inductor allocate millions of small
# objects, and each full collection walked every object the imports made (torch, triton,
# scipy). Those are set aside (gc.freeze) and collections run less often: GC time in an
# interpreter test went from about 5% to about 1.5%, and in a compilation from 7% to 2.5%.
# Reference counting frees what it did before; only cyclic garbage waits longer.
gc.freeze()
gc.set_threshold(20000, 20, 50)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
