"""Regressions found by review: bad / edge inputs on both backends (API.md guarantees 2 and 5)."""

import math

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingError, SamplingParams, sample, verify

V = 64
BACKENDS = ["torch", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", request.param)
    return request.param


def _batch(params, v=V, **kw):
    return SamplingBatch.from_params(params, vocab_size=v, **kw)


@pytest.mark.parametrize("kind", ["draft_logits", "draft_probs"])
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("bad_id", [V, 2**33 + 1, -2])
def test_bad_draft_id_with_draft_distribution_is_flagged_not_crash(backend, kind, method,
                                                                    bad_id):
    # A draft id outside [0, V) with a draft distribution crashed the torch backend
    # (IndexError / RuntimeError from gather) instead of flagging the request.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, V, generator=g)
    dl = torch.randn(3, V, generator=g)
    dist = {kind: dl if kind == "draft_logits" else torch.softmax(dl, -1)}
    d = torch.tensor([1, bad_id, 3])
    batch = _batch([SamplingParams(seed=1), SamplingParams(seed=2)])
    pos = torch.tensor([0, 10])
    out = verify(x, d, [2, 1], batch, positions=pos, method=method, strict=False, **dist)
    assert out.invalid.tolist() == [True, False]
    assert out.token_ids[0].tolist() == [-1, -1, -1]
    assert int(out.num_accepted[0]) == 0
    assert ((out.token_ids[1] >= -1) & (out.token_ids[1] < V)).all()
    with pytest.raises(specsample.SamplingError) as e:
        verify(x, d, [2, 1], batch, positions=pos, method=method, **dist)
    assert e.value.requests == [0]


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 1e-46])
@pytest.mark.parametrize("general", [False, True])
def test_subnormal_temperature_samples_the_tied_maxima(backend, temperature, general):
    # float32-subnormal temperatures gave NaN logits (torch: a non-maximal token or argmax;
    # Triton: a SamplingError on valid data); below 2**-149 the value rounded to 0 and the
    # request was silently decoded greedily (guarantee 2). Two tied maxima must both appear.
    x = torch.full((1, V), -5.0)
    x[0, 3] = x[0, 4] = 5.0
    seen = set()
    for seed in range(24):
        p = SamplingParams(temperature=temperature, seed=seed, top_k=8 if general else 0,
                           logprobs=1, logprobs_mode="processed")
        out = sample(x, _batch([p]), positions=torch.tensor([0]))
        seen.add(int(out.token_ids[0]))
        assert torch.isfinite(out.logprobs[0, 0])
    assert seen == {3, 4}


@pytest.mark.parametrize("temperature", [1e39, 1e300])
def test_huge_temperature_never_emits_an_impossible_token(backend, temperature):
    # A temperature above float32's range became +inf: -inf / inf = NaN made banned (-inf)
    # tokens sampleable (torch) or the request invalid (Triton).
    x = torch.full((2, V), -math.inf)
    x[:, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(2)]
    for step in range(8):
        out = sample(x, _batch(params), positions=torch.tensor([step, step]))
        assert out.token_ids.lt(4).all() and out.token_ids.ge(0).all()


def test_penalty_and_bias_outside_float32_range(backend):
    # repetition_penalty / logit_bias beyond float32's range became inf in the batch: a zero
    # logit times an inf penalty is NaN, which torch then emitted and Triton flagged.
    x = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    x[:, 3] = 0.0
    params = [SamplingParams(temperature=0.0, repetition_penalty=1e39),
              SamplingParams(seed=1, repetition_penalty=1e39, logit_bias={5: 1e39})]
    batch = _batch(params, output_token_ids=[[3, 4], [3, 4]])
    out = sample(x, batch, positions=torch.tensor([0, 0]))
    assert out.invalid.tolist() == [False, False]
    assert int(out.token_ids[0]) != 3  # 0 * penalty is 0, not NaN: token 3 is not the max
    assert int(out.token_ids[1]) == 5


def test_num_draft_tokens_scalar_and_float_lists_raise_value_error():
    x = torch.randn(4, V)
    batch = _batch([SamplingParams(seed=1)])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        verify(x, torch.tensor([1, 2, 3]), 3, batch, positions=torch.tensor([0]))
    with pytest.raises(ValueError, match="draft_token_ids"):
        verify(x, [1.7, 2, 3], [3], batch, positions=torch.tensor([0]))
    with pytest.raises(ValueError, match="positions"):
        sample(x[:1], batch, positions=[0.5])


def test_tiny_min_p_is_not_clamped(backend):
    # log(min_p) was taken of min_p.clamp_min(1e-38): min_p = 1e-40 dropped tokens with
    # p / max p in [1e-40, 1e-38) (here e**-90 ~ 8e-40), which semantics.md keeps.
    x = torch.full((1, V), -math.inf)
    x[0, 0], x[0, 1] = 0.0, -90.0
    p = SamplingParams(seed=0, min_p=1e-40, logprobs=2, logprobs_mode="processed")
    out = sample(x, _batch([p]), positions=torch.tensor([0]))
    assert out.logprob_token_ids[0, 1:].tolist() == [0, 1]
    assert out.logprobs[0, 2].item() == pytest.approx(-90.0, abs=1e-3)


def test_numpy_integer_num_draft_tokens_and_negative_positions():
    import numpy as np

    batch = SamplingBatch.from_params([SamplingParams(temperature=0.5, seed=1)], vocab_size=8)
    logits = torch.randn(3, 8)
    out = specsample.verify(logits, [1, 2], [np.int64(2)], batch, positions=[0])
    assert out.token_ids.shape == (1, 3)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        specsample.verify(logits, [1, 2], [2], batch, positions=[-1])


def test_sample_and_verify_want_a_sampling_batch():
    # A list of SamplingParams raised AttributeError ('list' object has no attribute
    # 'num_requests') from sample(); the error must name `batch` and say how to build one.
    params = [SamplingParams(temperature=0.0)]
    with pytest.raises(ValueError, match=r"batch must be a SamplingBatch, got list; "
                                         r"build it with SamplingBatch\.from_params"):
        sample(torch.randn(1, V), params)
    with pytest.raises(ValueError, match=r"SamplingBatch\.from_params"):
        verify(torch.randn(1, V), [], [0], params)


@pytest.mark.parametrize("shape", [(3, V), (V,), (1, 2, V)])
def test_sample_shape_error_speaks_of_logits(shape):
    # sample() with the wrong row count reported target_logits and N + sum k (verify's terms).
    batch = _batch([SamplingParams(seed=1), SamplingParams(seed=2)])
    with pytest.raises(ValueError, match=r"^logits must be a 2-D tensor \[N, V\] with one row "
                                         r"per request \(N = 2 rows\), got shape \(") as e:
        sample(torch.randn(*shape), batch, positions=torch.tensor([0, 0]))
    assert "target_logits" not in str(e.value) and "sum k" not in str(e.value)


def test_penalty_overflow_is_not_reported_as_a_bad_raw_logit(backend):
    # A repetition penalty that overflows a finite logit (5 / 2**-126 > float32 max) was
    # reported as a "NaN or +inf target logit" although the raw logits were all finite.
    x = torch.zeros(2, V)
    x[:, 3] = 5.0
    params = [SamplingParams(seed=1, repetition_penalty=1e-38), SamplingParams(seed=2)]
    batch = _batch(params, prompt_token_ids=[[3], [3]])
    out = sample(x, batch, positions=torch.tensor([0, 0]), strict=False)
    assert out.invalid.tolist() == [True, False]
    with pytest.raises(specsample.SamplingError) as e:
        sample(x, batch, positions=torch.tensor([0, 0]))
    assert e.value.requests == [0]
    message = str(e.value)
    assert "logit_bias or penalties pushed a logit to NaN / +inf" in message
    assert "raw logits were finite" in message
    assert "target logit" not in message and "target row" not in message
    from specsample import torch_backend

    assert torch_backend.ERR_PROCESSED_OVERFLOW == 16
    assert torch_backend.ERR_PROCESSED_OVERFLOW in torch_backend.ERROR_NAMES


def test_column0_of_a_request_without_logprobs_follows_its_own_mode(backend):
    # Column 0 of a request with logprobs=None and logprobs_mode="processed" came out raw when
    # the only request asking for logprobs was raw (it depended on the other requests).
    x = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([0, 0])
    quiet = SamplingParams(seed=2, top_k=3, logprobs_mode="processed")
    values = []
    for mode in ("raw", "processed"):
        batch = _batch([SamplingParams(seed=1, logprobs=0, logprobs_mode=mode), quiet])
        out = sample(x, batch, positions=pos)
        values.append(float(out.logprobs[1, 0]))
    p = torch.softmax(torch.where(x[1] >= x[1].topk(3).values[-1], x[1], -math.inf), -1)
    assert values[0] == values[1] == pytest.approx(math.log(float(p[out.token_ids[1]])),
                                                     abs=1e-5)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_top_n_ranked_by_logits_not_by_rounded_logprobs(backend, mode):
    # A logit 1e-7 above the rest rounds to the same float32 logprob as them: it must still
    # rank first (the tie rule applies to equal logits only).
    x = torch.zeros(1, V)
    x[0, 5] = 1e-7
    batch = _batch([SamplingParams(seed=1, logprobs=3, logprobs_mode=mode)])
    out = sample(x, batch, positions=torch.tensor([0]))
    assert out.logprob_token_ids[0, 1:].tolist() == [5, 0, 1]


def test_non_contiguous_draft_token_ids_read_as_given(monkeypatch):
    # The Triton kernels index draft_token_ids without a stride; a strided view was read as if
    # it were contiguous (the wrong drafts), unlike the torch backend.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, V, generator=g)
    drafts = x.argmax(-1)  # every draft the row's argmax: greedy requests accept them all
    buf = torch.full((6,), 7, dtype=torch.int64)
    buf[::2] = drafts[torch.tensor([0, 1, 3])]
    batch = _batch([SamplingParams(temperature=0.0)] * 2)
    outs = {}
    for name in BACKENDS:
        monkeypatch.setenv("SPECSAMPLE_BACKEND", name)
        outs[name] = verify(x, buf[::2], [2, 1], batch, positions=torch.tensor([0, 5]),
                            strict=False)
    assert outs["torch"].num_accepted.tolist() == [2, 1]
    assert torch.equal(outs["triton"].token_ids, outs["torch"].token_ids)


def test_draft_id_outside_the_vocabulary_with_a_penalty_is_flagged(backend):
    # A live draft id >= V with a penalty raised IndexError from the output counts (the id
    # indexed a [rows, V] tensor) instead of flagging the request (ERR_DRAFT_ID).
    v = 100
    batch = SamplingBatch.from_params(
        [SamplingParams(temperature=0.8, seed=1, presence_penalty=1.0),
         SamplingParams(temperature=0.8, seed=2, frequency_penalty=0.5)], vocab_size=v)
    logits = torch.randn(5, v)
    out = verify(logits, torch.tensor([v + 3, 1, 7]), [2, 1], batch, strict=False,
                 positions=torch.tensor([0, 4]))
    assert out.invalid.tolist() == [True, False]
    assert out.token_ids[0].tolist() == [-1, -1, -1] and 0 <= int(out.token_ids[1, 0]) < v
    with pytest.raises(SamplingError, match="draft id outside"):
        verify(logits, torch.tensor([v + 3, 1, 7]), [2, 1], batch, positions=torch.tensor([0, 4]))
