"""positions=None and CUDA-graph safety (issue 14), on both backends (CPU).

Calls without positions key their noise by the batch's device-resident ``fresh_counter``
(``specsample.plan.fresh_positions``), advanced in place at every call, so repeated calls and
graph replays draw fresh noise; strict=True refuses to run inside CUDA-graph capture.
"""

import pytest
import torch
from scipy import stats

import specsample
from specsample import SamplingBatch, SamplingParams, plan, reference, sample, verify
from specsample.params import FRESH_PERIOD, FRESH_STRIDE

V = 64
BACKENDS = ["torch", "triton"]
CALLS = 100
ALPHA = 1e-3


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", request.param)
    return request.param


def _unseeded(n=1, v=V, **kw):
    torch.manual_seed(1234)  # the batch's seeds and counter start: fixed for the test
    return SamplingBatch.from_params([SamplingParams(**kw)] * n, vocab_size=v)


def _freeze_counter(monkeypatch):
    """Make every call read the counter without advancing it (the bug the tests must catch)."""
    original = plan.fresh_positions

    def frozen(batch, device=None):
        pos = original(batch, device)
        batch.fresh_counter.sub_(1)
        return pos

    monkeypatch.setattr(plan, "fresh_positions", frozen)
    # (the Triton backend makes them in one launch: triton_backend.layout.fresh_positions)
    try:
        from specsample.triton_backend import layout
    except ImportError:  # (no triton: the torch backend only)
        return
    kernel_made = layout.fresh_positions

    def frozen_kernel(batch):
        pos = kernel_made(batch)
        batch.fresh_counter.sub_(1)
        return pos

    monkeypatch.setattr(layout, "fresh_positions", frozen_kernel)


def _ones_pvalue(op: str) -> float:
    """p-value of a binomial test that token 1 has frequency 1/2 over repeated calls of one
    unseeded request on a uniform 2-token row, positions=None."""
    batch = _unseeded(v=2)
    if op == "sample":
        x = torch.zeros(1, 2)
        toks = [int(sample(x, batch).token_ids[0]) for _ in range(CALLS)]
    else:  # one draft (token 0): the first emitted token is uniform too
        x = torch.zeros(2, 2)
        toks = [int(verify(x, [0], [1], batch).token_ids[0, 0]) for _ in range(CALLS // 2)]
    return stats.binomtest(sum(toks), len(toks), 0.5).pvalue


@pytest.mark.parametrize("op", ["sample", "verify"])
def test_repeated_unseeded_calls_draw_fresh_noise(backend, op):
    assert _ones_pvalue(op) > ALPHA


@pytest.mark.parametrize("op", ["sample", "verify"])
def test_fresh_noise_test_rejects_a_counter_that_does_not_advance(backend, op, monkeypatch):
    # Power check of the test above: with the counter frozen every call reuses the noise of
    # the first, so one token is emitted every time and the binomial test rejects.
    _freeze_counter(monkeypatch)
    assert _ones_pvalue(op) < ALPHA


def test_counter_advances_by_one_per_call_without_positions(backend):
    batch = _unseeded(n=2)
    c0 = int(batch.fresh_counter)
    assert batch.fresh_counter.shape == (1,) and batch.fresh_counter.dtype == torch.int64
    assert 0 <= c0 < FRESH_PERIOD
    x = torch.randn(2, V)
    sample(x, batch)
    assert int(batch.fresh_counter) == c0 + 1
    verify(torch.randn(4, V), [1, 2], [1, 1], batch, method="block")
    assert int(batch.fresh_counter) == c0 + 2
    # explicit positions, a refused call and probs() leave it alone
    sample(x, batch, positions=[3, 4])
    verify(torch.randn(4, V), [1, 2], [1, 1], batch, positions=[3, 4])
    with pytest.raises(ValueError):
        verify(torch.randn(3, V), [1, 2], [1, 1], batch)
    specsample.probs(x, batch)
    assert int(batch.fresh_counter) == c0 + 2


@pytest.mark.parametrize("op", ["sample", "verify"])
def test_positions_none_is_the_documented_position(backend, op):
    # The call with positions=None draws exactly what positions 2**31 * (c mod 2**31) draw,
    # on both backends and in the reference (which reads and advances the same counter).
    batch = _unseeded(n=3, top_k=20)
    batch.fresh_counter.fill_(FRESH_PERIOD + 5)  # past one period: wraps to 5
    gen = torch.Generator().manual_seed(3)
    if op == "sample":
        x = torch.randn(3, V, generator=gen)

        def call(**kw):
            return sample(x, batch, strict=False, **kw).token_ids

        def ref():
            return reference.sample(x, batch).token_ids
    else:
        x = torch.randn(9, V, generator=gen)
        d = torch.randint(0, V, (6,), generator=gen)
        dl = torch.randn(6, V, generator=gen)

        def call(**kw):
            return verify(x, d, [2, 3, 1], batch, draft_logits=dl, strict=False, **kw).token_ids

        def ref():
            return reference.verify(x, d, [2, 3, 1], batch, draft_logits=dl).token_ids
    fresh = call()
    assert int(batch.fresh_counter) == FRESH_PERIOD + 6
    assert torch.equal(fresh, call(positions=[5 * FRESH_STRIDE] * 3))
    batch.fresh_counter.fill_(FRESH_PERIOD + 5)
    assert torch.equal(fresh, ref())
    assert int(batch.fresh_counter) == FRESH_PERIOD + 6


def test_fresh_positions_scheme():
    batch = _unseeded(n=4)
    batch.fresh_counter.fill_(FRESH_PERIOD - 1)
    top = plan.fresh_positions(batch)
    assert top.tolist() == [(FRESH_PERIOD - 1) * FRESH_STRIDE] * 4
    assert top.is_contiguous() and top.dtype == torch.int64
    assert int(top[0]) + 2**31 - 1 < 2**62  # any row offset j < 2**31 stays below 2**62
    assert plan.fresh_positions(batch).tolist() == [0] * 4  # wrapped
    assert plan.fresh_positions(batch).tolist() == [FRESH_STRIDE] * 4
    assert int(batch.fresh_counter) == FRESH_PERIOD + 2


def test_seeded_requests_keep_their_keys(backend):
    # Same tokens as before the counter existed (values recorded at the previous commit, where
    # positions=None drew torch.randint positions), and positions stay required.
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, V, generator=g)
    state = torch.random.get_rng_state()
    b = SamplingBatch.from_params([SamplingParams(seed=11),
                                   SamplingParams(seed=12, temperature=0.7),
                                   SamplingParams(seed=13, top_k=5)], vocab_size=V)
    assert torch.equal(torch.random.get_rng_state(), state)  # seeded: no global draw
    s = sample(x[:3], b, positions=[5, 2**40, 2**62 + 3])
    v = verify(x, [21, 9, 1, 4], [2, 2, 0], b, positions=[5, 100, 7])
    assert s.token_ids.tolist() == [21, 41, 55]
    assert v.token_ids.tolist() == [[21, 54, -1], [10, -1, -1], [57, -1, -1]]
    mixed = SamplingBatch.from_params([SamplingParams(seed=1), SamplingParams()], vocab_size=V)
    with pytest.raises(ValueError, match="positions is required"):
        sample(x[:2], mixed)
    with pytest.raises(ValueError, match="positions is required"):
        plan.fresh_positions(mixed)


def test_noncontiguous_positions_tensor(backend):
    # The Triton kernels index positions by request without a stride: a strided positions
    # tensor must be read as its values, not as the memory behind it.
    batch = SamplingBatch.from_params([SamplingParams(seed=s) for s in range(4)], vocab_size=V)
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    grid = torch.tensor([[10, 900], [20, 901], [30, 902], [40, 903]])
    strided = grid[:, 0]
    assert not strided.is_contiguous()
    assert torch.equal(sample(x, batch, positions=strided).token_ids,
                       sample(x, batch, positions=strided.contiguous()).token_ids)


def _pretend_capturing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_strict_inside_graph_capture_is_refused_before_any_work(backend, monkeypatch):
    batch = _unseeded(n=2)
    c0 = int(batch.fresh_counter)
    x = torch.randn(2, V)
    _pretend_capturing(monkeypatch)
    with pytest.raises(ValueError, match=r"sample\(strict=True\).*CUDA-graph capture.*"
                                         r"strict=False"):
        sample(x, batch)
    with pytest.raises(ValueError, match=r"verify\(strict=True\).*CUDA-graph capture.*"
                                         r"strict=False and read out.invalid"):
        verify(torch.randn(3, V), [1], [1, 0], batch)
    with pytest.raises(ValueError, match="capture"):
        specsample.probs(x, batch, strict=False)
    assert int(batch.fresh_counter) == c0  # raised before any work
    if backend == "triton":  # strict=False is not refused on the fused path
        assert sample(x, batch, strict=False).token_ids.shape == (2,)
        assert int(batch.fresh_counter) == c0 + 1
    else:  # the torch backend synchronises with the host: refused, with its reason
        with pytest.raises(ValueError, match="torch backend"):
            sample(x, batch, strict=False)


def test_strict_outside_capture_is_not_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    batch = _unseeded(n=2)
    assert sample(torch.randn(2, V), batch).token_ids.shape == (2,)


@pytest.mark.parametrize("case", ["general", "torch"])
def test_uncapturable_paths_refuse_inside_capture(monkeypatch, case):
    # The general path (bias / penalties / bans) and the torch backend synchronise with the
    # host: inside CUDA-graph capture they refuse with a clear error instead of a CUDA error.
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch" if case == "torch" else "triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    # (logit_bias and bans run in the kernels and capture, with top_k and logprobs too; with
    # more than 32 top-n logprobs it is the general path)
    extra = ({"logit_bias": {1: 0.5}, "top_k": 3, "bad_words_token_ids": [[2]], "logprobs": 33}
             if case == "general" else {})
    batch = SamplingBatch.from_params([SamplingParams(seed=1, **extra)], vocab_size=8)
    match = "general path" if case == "general" else "torch backend"
    with pytest.raises(ValueError, match=match):
        specsample.sample(torch.zeros(1, 8), batch, positions=torch.tensor([0]), strict=False)
