"""Exact law of the first tokens with a ``model`` drafter (statistical test, with a power check).

Tiny target and drafter (vocabulary 6, different random weights) at temperature 0.8: the joint
law of the first two generated tokens over many seeded requests must match the law computed from
the target's own softmax, p(x1) p(x2 | x1). A G-test at level 1e-3 (fixed seeds, so the outcome
is deterministic). The power check runs the same test on a deliberately wrong engine (a drafter
that picks its drafts greedily but reports its soft logits to verify(), a failure kind seen in
peer systems) and requires it to fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch
from engine_helpers import tiny_llama

import specsample
from specsample.engine import SpeculativeEngine
from specsample.engine.drafters import ModelDrafter

V = 6
T = 0.8
PROMPT = [1, 2, 3]
REQUESTS = 1500
ALPHA = 1e-3


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(10, vocab_size=V, init=0.2, hidden=16, layers=1)
    draft = tiny_llama(11, vocab_size=V, init=0.2, hidden=16, layers=1)
    return target, draft


@torch.inference_mode()
def exact_law(target) -> np.ndarray:
    """[V, V] joint law of the first two tokens from the target's softmax(logits / T)."""
    def probs(seq):
        z = target(torch.tensor([seq])).logits[0, -1].double()
        return torch.softmax(z / T, -1).numpy()

    p1 = probs(PROMPT)
    return np.stack([p1[a] * probs([*PROMPT, a]) for a in range(V)])


def g_test(counts: np.ndarray, law: np.ndarray) -> float:
    """p-value of a G-test of ``counts`` against ``law``, bins with expected < 5 merged."""
    counts = counts.ravel().astype(float)
    expected = law.ravel() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert (exp >= 5).all() and len(exp) >= 10
    return float(scipy.stats.power_divergence(obs, exp, lambda_="log-likelihood").pvalue)


def first_two_counts(target, draft, method: str) -> tuple[np.ndarray, dict]:
    engine = SpeculativeEngine(target, "model", draft_model=draft, num_speculative_tokens=2,
                               method=method, eos_token_ids=[])
    params = [specsample.SamplingParams(temperature=T, seed=1000 + i) for i in range(REQUESTS)]
    res = engine.generate([PROMPT] * REQUESTS, params, max_new_tokens=3)
    counts = np.zeros((V, V))
    for out in res.outputs:
        counts[out.token_ids[0], out.token_ids[1]] += 1
    return counts, res.stats.to_dict()


@pytest.mark.parametrize("method", ["token", "block"])
def test_model_drafter_first_tokens_exact(models, method):
    target, draft = models
    law = exact_law(target)
    counts, stats = first_two_counts(target, draft, method)
    # the drafter disagrees with the target often enough for rejection to matter
    assert 0.2 < stats["acceptance_rate"] < 0.9
    assert g_test(counts, law) > ALPHA


def test_power_greedy_drafter_with_soft_q_fails(models, monkeypatch):
    """The same test rejects a biased engine, so it can fail."""
    target, draft = models

    def greedy_sample(self, logits, ctx, position, j):
        return int(torch.argmax(logits))

    monkeypatch.setattr(ModelDrafter, "sample", greedy_sample)
    counts, _ = first_two_counts(target, draft, "token")
    assert g_test(counts, exact_law(target)) < ALPHA


def test_power_drafts_accepted_without_rejection_fails(models, monkeypatch):
    """The same test rejects an engine that accepts drafts without rejection: verify() is told
    the drafter's distribution was the target's own (q = p), so every draft is accepted."""
    target, draft = models
    real_verify = specsample.verify

    def accept_all(target_logits, draft_token_ids, num_draft_tokens, batch, **kwargs):
        rows, start = [], 0
        for k in list(num_draft_tokens):
            rows.extend(range(start, start + int(k)))
            start += int(k) + 1
        if kwargs.get("draft_logits") is not None:
            kwargs["draft_logits"] = target_logits[rows]
        return real_verify(target_logits, draft_token_ids, num_draft_tokens, batch, **kwargs)

    monkeypatch.setattr(specsample, "verify", accept_all)
    counts, stats = first_two_counts(target, draft, "token")
    assert stats["acceptance_rate"] > 0.99
    assert g_test(counts, exact_law(target)) < ALPHA
