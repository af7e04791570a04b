"""``triton_backend.launch``: the direct launcher gives Triton's own launch, one compiled
kernel per specialisation (Triton's binder decides it), and falls back to ``kernel[grid]`` in
the interpreter."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("specsample.triton_backend")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents  # noqa: E402

launch_module = importlib.import_module("specsample.triton_backend.launch")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _add_kernel(x_ptr, out_ptr, n, step, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, x + step, mask=offs < n)


def _run(x: torch.Tensor, step: float) -> torch.Tensor:
    out = torch.empty_like(x)
    launch_module.launch(_add_kernel)[(triton.cdiv(x.numel(), 64),)](x, out, x.numel(), step,
                                                                     BLOCK=64)
    return out


def test_results_on_aligned_and_unaligned_views():
    base = torch.arange(300, dtype=torch.float32, device=DEVICE)
    for _ in range(3):  # first launches take Triton's path, later ones the launcher
        for x in (base, base[1:], base[:16], base[3:19]):  # 16-byte aligned or not, n % 16
            torch.testing.assert_close(_run(x, 2.0), x + 2.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_compiled_kernel_per_specialisation():
    # An aligned and an unaligned pointer, n divisible by 16 or not: Triton specialises on
    # both, so the launcher must keep them apart (a kernel compiled for an aligned pointer
    # would read an unaligned one wrongly).
    base = torch.arange(300, dtype=torch.float32, device="cuda")
    for x in (base[:32], base[1:33], base[:37], base[1:38]):
        _run(x, 1.0)
    keys = [k for k in launch_module._COMPILED if k[0] is _add_kernel]
    assert len(keys) == 4
    for x in (base[:32], base[1:33], base[:37], base[1:38]):
        torch.testing.assert_close(_run(x, 1.0), x + 1.0)
    assert len([k for k in launch_module._COMPILED if k[0] is _add_kernel]) == 4


@triton.jit
def _mixed_kernel(x_ptr, y_ptr, n, m, scale, flag, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) * scale + n + m + flag)


def _binder_specialisations(arg_sets):
    """Triton's own binder (the one ``JITFunction.run`` builds for an sm_90 target) applied
    to each argument set: what it specialises on (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    # (a compiled-mode JITFunction, also when the suite runs Triton's interpreter)
    jit = JITFunction(getattr(_mixed_kernel, "fn", _mixed_kernel))
    binder = create_function_from_signature(jit.signature, jit.params,
                                            make_backend(GPUTarget("cuda", 90, 32)))
    return [tuple(binder(*a, BLOCK=16)[1]) for a in arg_sets]


def _arg_sets():
    ints = [0, 1, 2, 15, 16, 17, -1, -16, 2**31 - 16, 2**31, 2**31 + 3, -2**31, -2**31 - 16,
            2**63, 2**63 + 5]
    tensors = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        base = torch.zeros(64, dtype=dtype)
        tensors += [base[i:] for i in range(0, 17, 3)]
    sets = []
    for i, x in enumerate(tensors):
        for j, n in enumerate(ints):
            m = ints[(i + 2 * j) % len(ints)]
            y = tensors[(3 * i + j) % len(tensors)]
            sets.append((x, y, n, m, 0.5 + j, (i + j) % 2 == 0))
    return sets


def test_own_key_names_one_specialisation():
    sets = _arg_sets()
    specs = _binder_specialisations(sets)

    def groups(key):
        by_key: dict = {}
        for a, spec in zip(sets, specs):
            by_key.setdefault(key(a), set()).add(spec)
        return by_key

    own = groups(lambda a: launch_module.arg_key(a)[0])
    assert all(len(s) == 1 for s in own.values())
    assert len(own) > 50  # (the arguments do vary what Triton specialises on)
    # Power: keys that drop one property Triton specialises on merge specialisations.
    coarse = (
        lambda a: tuple(k[0] if isinstance(k, tuple) else k for k in launch_module.arg_key(a)[0]),
        lambda a: tuple(k if k not in (1, 2, 3) else 2 for k in launch_module.arg_key(a)[0]),
    )
    for key in coarse:
        assert any(len(s) > 1 for s in groups(key).values())


def test_own_key_values_are_addresses():
    x = torch.zeros(8)
    key, values = launch_module.arg_key((x[1:], 16, 2.0, None))
    assert values == [x[1:].data_ptr(), 16, 2.0, None]
    assert key == ((torch.float32,), 3, 0.5, None)
    assert launch_module.arg_key((object(),)) is None
    assert launch_module.arg_key((2**64,)) is None and launch_module.arg_key((-2**63 - 1,)) is None
    assert launch_module.arg_key((2**64 - 1, -2**63))[0] == (6, 5)


def test_constexprs_by_position_are_not_keyed():
    from triton.runtime.jit import JITFunction

    jit = JITFunction(getattr(_mixed_kernel, "fn", _mixed_kernel))
    assert launch_module._constexpr_tail(jit, 6) == 1  # BLOCK by keyword: keyed
    assert launch_module._constexpr_tail(jit, 7) is None  # BLOCK by position
    assert launch_module._constexpr_tail(jit, 5) is None  # flag by keyword


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_launch_hooks_still_run():
    # The direct launcher skips Triton's launch hooks only while none is installed.
    from triton import knobs

    seen = []
    x = torch.arange(64, dtype=torch.float32, device="cuda")
    for _ in range(2):
        _run(x, 1.0)  # (known to the launcher)
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        torch.testing.assert_close(_run(x, 3.0), x + 3.0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1
    _run(x, 1.0)
    assert len(seen) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_known_specialisations_launch_through_the_c_launcher():
    # On the Triton version it was checked against, a kernel without scratch memory is kept
    # with the C launcher that CudaLauncher.__call__ calls (launch._launcher), and its
    # direct launches give the same results.
    x = torch.arange(64, dtype=torch.float32, device="cuda")
    for step in (1.0, 2.0, 3.0):
        torch.testing.assert_close(_run(x, step), x + step)
    entries = [v for k, v in launch_module._COMPILED.items() if k[0] is _add_kernel]
    assert entries
    for run, _function, head, _pad in entries:
        if launch_module._C_LAUNCH_CHECKED:
            assert len(head) == 4 + 4  # (flags, two scratch pointers, metadata, hooks)
            assert head[1] is False  # (no launch_pdl: the kernel has no GDC, so no wait)
            assert run.__name__ == "launch"  # (the C launcher, not CudaLauncher.__call__)
        else:
            assert head[1:] == (None, None, None)


# Programmatic dependent launch: the kernels of the package that ``launch`` gives GDC.
PDL_MODULES = ["kernels", "filters", "logprobs", "tree", "layout", "penalties"]


def _package_kernels():
    for name in PDL_MODULES:
        mod = importlib.import_module(f"specsample.triton_backend.{name}")
        for k, v in vars(mod).items():
            if (k.endswith("_kernel") and hasattr(v, "arg_names")
                    and v.fn.__module__ == mod.__name__):
                yield f"{name}.{k}", v


def test_every_kernel_waits_for_the_prior_kernel_first():
    # A kernel launched with programmatic stream serialization may start while the kernel
    # before it still runs: its first statement must be the wait, before any load or store,
    # and GDC its last parameter (a constexpr the launcher sets by keyword).
    import ast
    import inspect
    import textwrap

    seen = []
    for name, kernel in _package_kernels():
        tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
        func = tree.body[0]
        assert func.args.args[-1].arg == "GDC", name
        body = func.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # (the docstring)
        first = body[0]
        assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                and ast.unparse(first.value) == "wait_for_prior_grid(GDC)"), (
            f"{name} starts with {ast.unparse(first)!r}")
        assert launch_module._takes_gdc(kernel), name
        seen.append(name)
    assert len(seen) >= 18, seen  # (every module's kernels were found)


@triton.jit
def _gdc_flag_kernel(out_ptr, GDC: tl.constexpr):
    launch_module.wait_for_prior_grid(GDC)
    tl.store(out_ptr, GDC)


def test_gdc_set_by_the_launcher():
    # The caller never passes GDC: the launcher sets it, true only on a GPU with
    # programmatic dependent launch (never in Triton's interpreter), and a kernel without the
    # parameter is launched as before (_add_kernel above).
    out = torch.full((1,), -1, dtype=torch.int32, device=DEVICE)
    want = DEVICE == "cuda" and launch_module.pdl_enabled(torch.cuda.current_device())
    for _ in range(3):  # (Triton's path, then the direct launcher)
        out.fill_(-1)
        launch_module.launch(_gdc_flag_kernel)[(1,)](out)
        assert out.item() == int(want)
    assert not launch_module._takes_gdc(_add_kernel)


def test_pdl_off_in_the_environment():
    # SPECSAMPLE_PDL=0 (or false / off / no), read at import: no programmatic dependent
    # launch, decided before any device is asked about (this machine may have none).
    head = "import importlib; m = importlib.import_module('specsample.triton_backend.launch'); "
    cases = [("0", "assert m.PDL is False and m.pdl_enabled(0) is False"),
             ("off", "assert m.PDL is False and m.pdl_enabled(0) is False"),
             ("No", "assert m.PDL is False and m.pdl_enabled(0) is False"),
             (None, "assert m.PDL is True")]
    for value, check in cases:
        env = {k: v for k, v in os.environ.items() if k != "SPECSAMPLE_PDL"}
        if value is not None:
            env["SPECSAMPLE_PDL"] = value
        run = subprocess.run([sys.executable, "-c", head + check], env=env,
                             capture_output=True, text=True)
        assert run.returncode == 0, (value, run.stderr[-2000:])


@triton.jit
def _slow_fill_kernel(out_ptr, n, value, ROUNDS: tl.constexpr, BLOCK: tl.constexpr,
                      GDC: tl.constexpr):
    launch_module.wait_for_prior_grid(GDC)
    if GDC:
        # (test only: the next kernel may launch at once, while these programs still run,
        # so that a copy that did not wait would read the old values)
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32) + value
    for _ in range(ROUNDS):  # (long enough that a kernel launched early would overlap it)
        acc = tl.sqrt(acc * acc)
    tl.store(out_ptr + offs, acc, mask=offs < n)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, GDC: tl.constexpr):
    launch_module.wait_for_prior_grid(GDC)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dependent_launches_read_what_the_prior_kernel_wrote():
    # A chain of programmatic dependent launches, eager and replayed from a CUDA graph: each
    # kernel reads what the one before it wrote (a race would show the previous value).
    if not launch_module.pdl_enabled(torch.cuda.current_device()):
        pytest.skip("no programmatic dependent launch on this GPU")
    n, block = 1 << 20, 1024
    a = torch.zeros(n, device="cuda")
    b = torch.zeros(n, device="cuda")
    grid = (triton.cdiv(n, block),)

    def step(v):
        launch_module.launch(_slow_fill_kernel)[grid](a, n, v, ROUNDS=200, BLOCK=block)
        launch_module.launch(_copy_kernel)[grid](a, b, n, BLOCK=block)
        launch_module.launch(_copy_kernel)[grid](b, a, n, BLOCK=block)

    for v in range(1, 6):
        step(float(v))
        assert torch.equal(a, torch.full_like(a, v + 2.0))
    # (the direct launches pass the C launcher's launch_pdl flag)
    entries = [v for k, v in launch_module._COMPILED.items() if k[0] is _copy_kernel]
    assert entries and all(head[1] is True for _run, _function, head, _pad in entries)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(1.0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(7.0)
    for _ in range(20):
        a.zero_()
        b.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(a, torch.full_like(a, 9.0))
