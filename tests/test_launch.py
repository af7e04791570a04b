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
