"""``triton_backend.layout``: the row layout of a device ``num_draft_tokens`` from one launch,
the same tensors as ``plan._device_layout``'s PyTorch operations, bit for bit (interpreter on
CPU, the GPU under ``-m gpu``)."""

from __future__ import annotations

import importlib
import random

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams
from specsample import plan as plan_mod
from specsample.plan import _device_layout

pytest.importorskip("specsample.triton_backend")
layout = importlib.import_module("specsample.triton_backend.layout")

NAMES = "row_start draft_start row_req row_j draft_req draft_j k_given err".split()


def _cases():
    fixed = [
        ([1, 2, 0, 3], 3, None), ([0], 2, None), ([4], 3, None), ([0, 0, 0], 0, 0),
        ([1, 4, 0, 1], 3, None),  # one count above the width: that request alone
        ([1, 2, 0, 1], 3, 6), ([3, 3, 1, 1], 3, 6), ([-1, 3, 3, 1], 3, 6),  # the whole batch
        ([2**62, 2**62, -(2**63)], 3, 4),  # no overflow in the sums
        ([5] * 300, 5, None),  # more requests than one step of the loops
        ([600, 0, 1], 4, None),  # a request with more rows than one step of the scatter
    ]
    rnd = random.Random(0)
    for _ in range(12):
        n = rnd.randint(1, 600)
        ks = [rnd.randint(0, 6) for _ in range(n)]
        if rnd.random() < 0.4:
            ks[rnd.randrange(n)] = rnd.choice([-1, 9, 100])
        fixed.append((ks, 4, sum(max(0, x) for x in ks) + rnd.choice([0, 0, 1, -1])))
    return fixed


def _compare(ks, max_k, s, device):
    s = max(sum(ks) if s is None else s, 0)
    k = torch.tensor(ks, dtype=torch.int64, device=device)
    want = _device_layout(k, max_k, len(ks) + s, s)
    got = layout.device_layout(k, max_k, len(ks) + s, s)
    for name, w, g in zip(NAMES, want, got, strict=True):
        assert g.dtype == torch.int64 and g.is_contiguous()
        assert torch.equal(w, g), (ks[:12], name)
        assert g.data_ptr() % 16 == 0, name  # the reading kernels are specialised on it


@pytest.mark.parametrize("case", range(len(_cases())))
def test_layout_kernel_matches_the_torch_layout(case):
    _compare(*_cases()[case], "cpu")


def test_layout_kernel_power_check(monkeypatch):
    # A kernel that ignored a count above the width (laid out as if it fitted) must fail.
    ks = [1, 4, 0, 1]
    k = torch.tensor(ks)
    want = _device_layout(k, 3, 10, 6)
    wrong = layout.device_layout(k, 4, 10, 6)
    assert not all(torch.equal(w, g) for w, g in zip(want, wrong))


def test_triton_backend_builds_the_device_layout_with_the_kernel(monkeypatch):
    monkeypatch.setattr(plan_mod, "_is_device_tensor", lambda t: isinstance(t, torch.Tensor))
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    calls = []
    real = layout.device_layout

    def spy(*args):
        calls.append(args[1:])
        return real(*args)

    monkeypatch.setattr(layout, "device_layout", spy)
    batch = SamplingBatch.from_params([SamplingParams(seed=i) for i in range(3)], vocab_size=64)
    logits = torch.randn(3 + 4, 64, generator=torch.Generator().manual_seed(1))
    out = specsample.verify(logits, torch.tensor([1, 2, 3, 4]), torch.tensor([2, 0, 2]), batch,
                            positions=torch.arange(3), strict=False, max_num_draft_tokens=3)
    assert calls == [(3, 7, 4)] and out.token_ids.shape == (3, 4)
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")  # the torch backend keeps its own ops
    specsample.verify(logits, torch.tensor([1, 2, 3, 4]), torch.tensor([2, 0, 2]), batch,
                      positions=torch.arange(3), strict=False, max_num_draft_tokens=3)
    assert len(calls) == 1


@pytest.mark.gpu
def test_layout_kernel_matches_the_torch_layout_on_gpu():
    for case in _cases():
        _compare(*case, "cuda")


def _output(gen, n, width, n_lp):
    lp = None if n_lp is None else torch.randn(n, width, n_lp, generator=gen)
    return specsample.VerifyOutput(
        token_ids=torch.randint(0, 50, (n, width), generator=gen),
        num_accepted=torch.randint(0, width, (n,), generator=gen),
        logprobs=lp,
        logprob_token_ids=None if lp is None else torch.randint(0, 50, (n, width, n_lp),
                                                                generator=gen),
        invalid=torch.rand(n, generator=gen) < 0.3)


def _mark_compare(n_lp, device):
    from specsample.api import _mark_layout_errors

    gen = torch.Generator().manual_seed(3 + (n_lp or 0))
    n, width = 37, 5
    out = _output(gen, n, width, n_lp)
    err = torch.randint(0, 16, (n,), generator=gen)
    layout_err = torch.where(torch.rand(n, generator=gen) < 0.4, 256, 0)
    out, err, layout_err = (
        type(out)(**{f: None if getattr(out, f) is None else getattr(out, f).to(device)
                     for f in ("token_ids", "num_accepted", "logprobs", "logprob_token_ids",
                               "invalid")}), err.to(device), layout_err.to(device))
    want, want_err = _mark_layout_errors(out, err, layout_err)  # (new tensors)
    got, got_err = layout.mark_layout_errors(out, err.clone(), layout_err)
    assert torch.equal(want_err, got_err)
    for f in ("token_ids", "num_accepted", "logprobs", "logprob_token_ids", "invalid"):
        w, g = getattr(want, f), getattr(got, f)
        assert (w is None) == (g is None), f
        if w is not None:
            assert torch.equal(w, g), f
    assert bool(layout_err.any()) and not torch.equal(want.token_ids, _output(
        torch.Generator().manual_seed(3 + (n_lp or 0)), n, width, n_lp).token_ids.to(device))


@pytest.mark.parametrize("n_lp", [None, 3])
def test_mark_kernel_matches_the_torch_marking(n_lp):
    _mark_compare(n_lp, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("n_lp", [None, 3])
def test_mark_kernel_matches_the_torch_marking_on_gpu(n_lp):
    _mark_compare(n_lp, "cuda")


def _fresh_cases(device):
    for n, start in ((1, 0), (3, 5), (300, 2**31 - 1), (257, 2**31 + 7), (2, 2**40 + 3)):
        batch = SamplingBatch.from_params([SamplingParams() for _ in range(n)], vocab_size=4,
                                          device=device)
        batch.fresh_counter.fill_(start)
        yield batch


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fresh_positions_kernel_matches_plan_fresh_positions(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for batch in _fresh_cases(device):
        twin = SamplingBatch.from_params(list(batch.params), vocab_size=4, device=device)
        twin.fresh_counter.copy_(batch.fresh_counter)
        for _ in range(2):  # (and the counter advances the same way)
            got = layout.fresh_positions(batch)
            want = plan_mod.fresh_positions(twin)
            assert got.dtype == torch.int64 and torch.equal(got, want)
            assert torch.equal(batch.fresh_counter, twin.fresh_counter)
    seeded = SamplingBatch.from_params([SamplingParams(seed=1)], vocab_size=4, device=device)
    with pytest.raises(ValueError, match="positions is required"):
        layout.fresh_positions(seeded)


def test_triton_backend_makes_fresh_positions_with_the_kernel(monkeypatch):
    calls = []
    real = layout.fresh_positions
    monkeypatch.setattr(layout, "fresh_positions", lambda b: calls.append(1) or real(b))
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    batch = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * 2, vocab_size=64)
    out = specsample.sample(torch.randn(2, 64), batch, strict=False)
    assert calls == [1] and out.token_ids.shape == (2,)
