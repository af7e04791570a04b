"""specsample.probs() (the processed distribution sample() draws from) and
sample(..., logits_index=...) (several requests reading one logits row), on every backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

import specsample
from specsample import SamplingBatch, SamplingError, SamplingParams, paths, reference

BACKENDS = ["torch", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", request.param)
    return request.param


V = 10
PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=0.9, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, logit_bias={2: 3.0}, frequency_penalty=0.7,
                   repetition_penalty=1.4),
    SamplingParams(temperature=1.1, allowed_token_ids=[0, 2, 4, 6, 8],
                   bad_words_token_ids=[[5, 4]], min_tokens=3, stop_token_ids=[0]),
    SamplingParams(temperature=0.0, bad_words_token_ids=[[7]]),
]
PROMPT = [5, 1]
OUTPUTS = [3, 7, 3]


def _logits(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(PARAMS), V, generator=g) * 2
    x[:, 7] += 4.0  # the greedy row's argmax is banned
    return x


def _batch(params=PARAMS) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.from_params(params, vocab_size=V, prompt_token_ids=[PROMPT] * n,
                                     output_token_ids=[OUTPUTS] * n, eos_token_ids=[9])


def test_probs_is_exported():
    assert specsample.probs is specsample.api.probs
    assert "probs" in specsample.__all__


def test_probs_equals_the_reference(backend):
    x = _logits()
    p = specsample.probs(x, _batch())
    assert p.dtype == torch.float32 and p.shape == (len(PARAMS), V)
    assert torch.allclose(p.sum(-1), torch.ones(len(PARAMS)), atol=1e-6)
    for i, params in enumerate(PARAMS):
        want = reference.processed_probs(
            x[i], params, prompt_token_ids=PROMPT, output_token_ids=OUTPUTS,
            context_token_ids=PROMPT + OUTPUTS, num_output_tokens=len(OUTPUTS),
            eos_token_ids=[9])
        if params.greedy:
            onehot = np.zeros(V)
            onehot[int(np.argmax(want))] = 1.0
            want = onehot
        np.testing.assert_allclose(p[i].numpy(), want, rtol=1e-5, atol=1e-7, err_msg=str(i))


def test_greedy_rows_are_one_hot_at_the_argmax(backend):
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 3.0, 4.0, 0.0]])
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3])]
    p = specsample.probs(x, SamplingBatch.from_params(params, vocab_size=4))
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]  # ties: lowest id


def test_invalid_rows_are_zero_or_raise(backend):
    x = torch.randn(3, 4)
    x[0, 1] = float("nan")
    params = [SamplingParams(), SamplingParams(allowed_token_ids=[1], bad_words_token_ids=[[1]]),
              SamplingParams()]
    batch = SamplingBatch.from_params(params, vocab_size=4)
    p = specsample.probs(x, batch, strict=False)
    assert not torch.isnan(p).any()
    assert p[:2].eq(0).all()
    assert torch.allclose(p[2], torch.softmax(x[2], -1))
    with pytest.raises(SamplingError, match="request 0"):
        specsample.probs(x, batch)


def test_probs_shape_errors():
    batch = SamplingBatch.from_params([SamplingParams()], vocab_size=4)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        specsample.probs(torch.zeros(2, 4), batch)
    with pytest.raises(ValueError, match="vocab_size"):
        specsample.probs(torch.zeros(1, 5), batch)


def _g_test(counts: np.ndarray, law: np.ndarray) -> float:
    """p-value of a G-test of ``counts`` against ``law``; the least likely bins are pooled
    until the pooled expected count reaches 5. A count where the law is 0 gives 0."""
    if counts[law == 0].any():
        return 0.0
    order = np.argsort(-law, kind="stable")
    exp = law[order] * counts.sum()
    obs = counts[order].astype(float)
    while exp[-1] < 5 and len(exp) > 1:
        exp[-2] += exp[-1]
        obs[-2] += obs[-1]
        exp, obs = exp[:-1], obs[:-1]
    assert len(exp) >= 3
    return float(stats.power_divergence(obs, exp, lambda_="log-likelihood").pvalue)


def _frequencies(params: SamplingParams, x: torch.Tensor, n: int) -> np.ndarray:
    """Token counts of n seeded requests sampling the single row ``x`` (via logits_index)."""
    batch = SamplingBatch.from_params(
        [SamplingParams(**{**params.__dict__, "seed": 1000 + i}) for i in range(n)],
        vocab_size=V, prompt_token_ids=[PROMPT] * n, output_token_ids=[OUTPUTS] * n,
        eos_token_ids=[9])
    tokens = specsample.sample(x[None], batch, positions=torch.full((n,), 7),
                               logits_index=torch.zeros(n, dtype=torch.int64)).token_ids
    return np.bincount(tokens.numpy(), minlength=V)


@pytest.mark.parametrize("which", [2, 4])
def test_sample_frequencies_match_probs(which):
    """sample() draws from probs(): a G-test on 4000 seeded draws (torch backend; the Triton
    backend emits the same tokens, test_logits_index_equals_the_gathered_rows)."""
    x = _logits(1)[which]
    law = specsample.probs(x[None], _batch([PARAMS[which]]))[0].double().numpy()
    counts = _frequencies(PARAMS[which], x, 4000)
    p = _g_test(counts, law / law.sum())
    assert p > 1e-3, f"G-test p = {p:.3g}"
    # power: the same test rejects the unprocessed softmax(x / T) as the law
    plain = torch.softmax(x.double() / PARAMS[which].temperature, -1).numpy()
    assert _g_test(counts, plain) < 1e-6


# --------------------------------------------------------------------------- logits_index


def test_logits_index_equals_the_gathered_rows(backend):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, V, generator=g)
    idx = torch.tensor([2, 0, 0, 2, 1, 0])
    n = idx.shape[0]
    params = [PARAMS[i % len(PARAMS)] for i in range(n)]
    params = [SamplingParams(**{**p.__dict__, "seed": 77 + i, "logprobs": 2})
              for i, p in enumerate(params)]
    batch = SamplingBatch.from_params(params, vocab_size=V, prompt_token_ids=[PROMPT] * n,
                                      output_token_ids=[OUTPUTS] * n)
    pos = torch.arange(n) + 10
    paths.reset()
    got = specsample.sample(x, batch, positions=pos, logits_index=idx)
    assert paths.counts()[f"{backend}.copy.logits_index"] == {"calls": 1, "rows": n}
    want = specsample.sample(x[idx], batch, positions=pos)
    assert torch.equal(got.token_ids, want.token_ids)
    assert torch.equal(got.logprob_token_ids, want.logprob_token_ids)
    assert torch.equal(got.logprobs, want.logprobs)
    # a list works too, and fewer rows than requests is the point
    again = specsample.sample(x, batch, positions=pos, logits_index=idx.tolist())
    assert torch.equal(again.token_ids, want.token_ids)


def test_logits_index_requests_keep_their_own_seeds(backend):
    n = 24
    x = torch.zeros(1, V)  # uniform: seeds must make the draws differ
    batch = SamplingBatch.from_params([SamplingParams(seed=i) for i in range(n)], vocab_size=V)
    idx = torch.zeros(n, dtype=torch.int64)
    pos = torch.zeros(n, dtype=torch.int64)
    tokens = specsample.sample(x, batch, positions=pos, logits_index=idx).token_ids
    assert len(set(tokens.tolist())) > 3
    one = SamplingBatch.from_params([SamplingParams(seed=5)], vocab_size=V)
    assert int(specsample.sample(x, one, positions=pos[:1]).token_ids[0]) == int(tokens[5])


@pytest.mark.parametrize("idx, match", [
    ([0, 3], r"\[0, 3\)"),
    ([0, -1], r"\[0, 3\)"),
    ([0], r"shape \[2\]"),
    ([[0, 1]], r"shape \[2\]"),
    (torch.tensor([0.0, 1.0]), "integer"),
    ("ab", "logits_index"),
])
def test_logits_index_errors(idx, match):
    batch = SamplingBatch.from_params([SamplingParams(), SamplingParams()], vocab_size=V)
    with pytest.raises(ValueError, match=match):
        specsample.sample(torch.zeros(3, V), batch, logits_index=idx)
