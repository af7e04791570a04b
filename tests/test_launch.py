"""``triton_backend.launch``: the direct launcher gives Triton's own launch, one compiled
kernel per specialisation (Triton's binder decides it), and falls back to ``kernel[grid]`` in
the interpreter."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("specsample.triton_backend")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

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
            assert run.__name__ == "launch"  # (the C launcher, not CudaLauncher.__call__)
        else:
            assert head[1:] == (None, None, None)
