"""specsample.reference: the exact laws prove the algorithms exact; processing by hand examples.

``exact_step_law`` enumerates every draft sequence and integrates the verification randomness
analytically; composing it over steps must give the target's autoregressive law exactly (to
float64 rounding), for every draft kind, method and a spread of params. This is the algorithmic
proof of guarantee 1 for the reference (the backends are then tested against the reference).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specsample import SamplingBatch, SamplingParams, reference

V = 3
_gen = np.random.default_rng(1234)
TABLE = _gen.normal(size=(V + 1, V + 1, V)) * 1.6  # order-2 target: previous two tokens
QTABLE = _gen.normal(size=(V + 1, V)) * 1.2  # order-1 drafter
START = V  # "no token yet"


def target_fn(ctx):
    a = ctx[-2] if len(ctx) >= 2 else START
    b = ctx[-1] if ctx else START
    return TABLE[a, b]


def draft_logits_fn(ctx):
    return QTABLE[ctx[-1] if ctx else START][:2]  # V' = 2 < V


def draft_probs_fn(ctx):
    e = np.exp(QTABLE[ctx[-1] if ctx else START] * 0.7)
    return e / e.sum()


def onehot_ngram_fn(ctx):
    return int(np.argmax(QTABLE[ctx[-1] if ctx else START]))


def onehot_random_fn(ctx):
    return np.array([0.5, 0.2, 0.3])


DRAFTERS = [("onehot", onehot_ngram_fn), ("onehot", onehot_random_fn),
            ("logits", draft_logits_fn), ("probs", draft_probs_fn)]
PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=2),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.9, frequency_penalty=0.4, presence_penalty=0.3,
                   repetition_penalty=1.2, logit_bias={1: 0.5}),
    SamplingParams(temperature=0.0),
]


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(x, 0.0) - b.get(x, 0.0)) for x in set(a) | set(b))


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}")
@pytest.mark.parametrize("kind,draft_fn", DRAFTERS, ids=["ngram", "onehot-rand", "logits",
                                                         "probs"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_multistep_law_equals_target_law(params, kind, draft_fn, method):
    length = 3
    target = reference.exact_target_law(target_fn, params, length, prompt_token_ids=(0, 2))
    assert abs(sum(target.values()) - 1) < 1e-12
    for k in (1, 3):
        step = reference.exact_step_law(target_fn, draft_fn, k, params, method, kind,
                                        prompt_token_ids=(0, 2))
        assert abs(sum(step.values()) - 1) < 1e-12
        assert all(1 <= len(t) <= k + 1 and p >= 0 for t, p in step.items())
        multi = reference.exact_multistep_law(target_fn, draft_fn, k, params, method, kind,
                                              length, prompt_token_ids=(0, 2))
        assert _max_diff(multi, target) < 1e-12


def test_step_law_from_a_context_matches_target():
    params = SamplingParams(temperature=0.8, top_p=0.9)
    ctx = (2, 0, 1)
    target = reference.exact_target_law(target_fn, params, 2, context=ctx)
    multi = reference.exact_multistep_law(target_fn, draft_probs_fn, 2, params, "block",
                                          "probs", 2, context=ctx)
    assert _max_diff(multi, target) < 1e-12


def test_block_accepts_at_least_as_much_as_token():
    """Sun et al.: block verification's expected accepted length >= token-level's."""
    params = SamplingParams(temperature=1.0)
    for kind, fn in DRAFTERS[2:]:
        lens = {}
        for method in ("token", "block"):
            step = reference.exact_step_law(target_fn, fn, 4, params, method, kind)
            lens[method] = sum(p * len(t) for t, p in step.items())
        assert lens["block"] >= lens["token"] - 1e-12
        assert lens["block"] > lens["token"] + 1e-6 or kind == "onehot"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("broken", ["no_min", "h_is_rho"])
def test_exact_law_check_detects_a_broken_rule(monkeypatch, broken):
    """The identity above is not vacuous: a wrong block rule breaks it."""
    if broken == "no_min":
        monkeypatch.setattr(reference, "_rho_next",
                            lambda rho, p, q: rho * p / q if q > 0 else 1.0)
    else:
        monkeypatch.setattr(reference, "_h", lambda z, rho: rho)
    params = SamplingParams(temperature=1.0)
    target = reference.exact_target_law(target_fn, params, 3)
    multi = reference.exact_multistep_law(target_fn, draft_probs_fn, 3, params, "block",
                                          "probs", 3)
    assert _max_diff(multi, target) > 1e-4


# ---------------------------------------------------------------------------- processing


def test_processing_order_by_hand():
    raw = np.array([1.0, 2.0, 0.5, -1.0, 3.0])
    p = SamplingParams(temperature=0.5, logit_bias={3: 4.0}, repetition_penalty=2.0,
                       frequency_penalty=0.5, presence_penalty=0.25)
    row = reference.process_row(raw, p, prompt_token_ids=[0], output_token_ids=[4, 4, 2])
    z = np.array([1.0 / 2, 2.0, 0.5 / 2 - 0.5 - 0.25, 3.0, 3.0 / 2 - 1.0 - 0.25])
    np.testing.assert_allclose(row.z, (z - z.max()) / 0.5)
    np.testing.assert_allclose(row.probs.sum(), 1.0)


def test_filters_by_hand():
    raw = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))
    probs = reference.processed_probs(raw, SamplingParams(top_k=3))
    np.testing.assert_allclose(probs, np.array([0, 0.4, 0, 0.3, 0.15]) / 0.85)
    probs = reference.processed_probs(raw, SamplingParams(top_p=0.69))
    np.testing.assert_allclose(probs, np.array([0, 0.4, 0, 0.3, 0]) / 0.7)
    probs = reference.processed_probs(raw, SamplingParams(top_p=0.71))
    np.testing.assert_allclose(probs, np.array([0, 0.4, 0, 0.3, 0.15]) / 0.85)
    probs = reference.processed_probs(raw, SamplingParams(min_p=0.3))  # p >= 0.12
    np.testing.assert_allclose(probs, np.array([0, 0.4, 0, 0.3, 0.15]) / 0.85)
    # min_p -> top_k -> top_p, each on what the previous left
    probs = reference.processed_probs(raw, SamplingParams(min_p=0.3, top_k=2, top_p=0.5))
    np.testing.assert_allclose(probs, np.array([0, 1.0, 0, 0, 0]))
    # ties at a top_k boundary keep the lower ids
    probs = reference.processed_probs(np.zeros(4), SamplingParams(top_k=2))
    np.testing.assert_allclose(probs, [0.5, 0.5, 0, 0])
    # greedy rows ignore the filters (processed = temperature 1)
    probs = reference.processed_probs(raw, SamplingParams(temperature=0.0, top_k=1))
    np.testing.assert_allclose(probs, np.exp(raw) / np.exp(raw).sum())


def test_reference_sample_is_gumbel_max_exact():
    """Empirical frequencies of reference.sample over many seeds match processed_probs."""
    raw = torch.tensor([[0.3, -1.0, 1.2, 0.0]])
    params = SamplingParams(temperature=0.8, top_k=3, seed=0)
    p = reference.processed_probs(raw[0], params)
    counts = np.zeros(4)
    n = 4000
    for s in range(n):
        b = SamplingBatch.from_params([SamplingParams(temperature=0.8, top_k=3, seed=s)],
                                      vocab_size=4)
        counts[int(reference.sample(raw, b, torch.tensor([7])).token_ids[0])] += 1
    assert counts[1] == 0
    assert np.all(np.abs(counts / n - p) < 4 * np.sqrt(p * (1 - p) / n) + 1e-9)


def test_reference_outputs_layout():
    params = [SamplingParams(temperature=0.0, logprobs=2, seed=1),
              SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=1.0, seed=3, logprobs=1, logprobs_mode="processed")]
    b = SamplingBatch.from_params(params, vocab_size=4)
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0], [1.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0],
                           [math.nan, 0.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0]])
    # request 0: k=2 drafts [1, 2] (greedy, both accepted); request 1: k=2 with a NaN in its
    # last row but a placeholder at draft index 1 (that row is not read); request 2: k=0.
    out = reference.verify(logits, [1, 2, 3, -1], [2, 2, 0], b,
                           positions=torch.tensor([0, 0, 0]))
    assert out.token_ids[0].tolist() == [1, 2, 0]
    assert out.num_accepted.tolist()[0] == 2
    assert not bool(out.invalid.any())
    assert out.token_ids[1, 2] == -1 and out.num_accepted[1] <= 1
    assert out.logprobs.shape == (3, 3, 3)
    assert out.logprob_token_ids[0, :, 1].tolist() == [1, 2, 0]
    assert out.logprob_token_ids[2, 0, 2] == -1 and out.logprobs[2, 0, 2] == -math.inf
    assert out.logprob_token_ids[2, 1, 0] == -1  # not emitted
