"""The model drafter drafts from the request's filtered distribution (top_k / top_p / min_p)
and hands it to verify() as draft_probs; without filters it keeps draft_logits."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import tiny_llama

import specsample
from specsample.engine import SpeculativeEngine

V = 48
PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(3, vocab_size=V, init=0.6)


def _run(model, params):
    engine = SpeculativeEngine(model, "model", draft_model=model, num_speculative_tokens=3,
                               eos_token_ids=[])
    return engine.generate([PROMPT] * len(params), params, max_new_tokens=12)


@pytest.mark.parametrize("filters", [{"top_k": 3}, {"top_p": 0.7}, {"min_p": 0.2}])
def test_drafter_with_the_targets_weights_and_filters_is_always_accepted(model, filters):
    """Drafter = target (float64, so both score identically): q equals the filtered p, so every
    draft is accepted; a drafter sampling softmax(logits / T) would see some rejected."""
    params = [specsample.SamplingParams(temperature=1.2, seed=s, **filters) for s in range(6)]
    res = _run(model, params)
    stats = res.stats.to_dict()
    assert stats["acceptance_rate"] == 1.0
    assert "torch.verify.draft_probs" in stats["paths"]
    assert "torch.verify.draft_logits" not in stats["paths"]


def test_mixed_requests_send_every_distribution_as_draft_probs(model):
    params = [specsample.SamplingParams(temperature=1.2, seed=1, top_k=3),
              specsample.SamplingParams(temperature=1.2, seed=2),
              specsample.SamplingParams(temperature=0.0)]
    stats = _run(model, params).stats.to_dict()
    assert stats["acceptance_rate"] == 1.0
    assert "torch.verify.draft_logits" not in stats["paths"]


def test_without_filters_drafts_keep_draft_logits(model):
    params = [specsample.SamplingParams(temperature=1.2, seed=s) for s in range(3)]
    stats = _run(model, params).stats.to_dict()
    assert "torch.verify.draft_logits" in stats["paths"]
    assert "torch.verify.draft_probs" not in stats["paths"]


def test_min_tokens_bans_the_engines_eos(model):
    """The engine passes its EOS ids to the batch: min_tokens keeps them out of the first
    tokens (greedy target whose first token would be the EOS)."""
    with torch.inference_mode():
        first = int(model(torch.tensor([PROMPT])).logits[0, -1].argmax())
    engine = SpeculativeEngine(model, "ngram", num_speculative_tokens=2, eos_token_ids=[first])
    out = engine.generate([PROMPT], specsample.SamplingParams(temperature=0.0),
                          max_new_tokens=5).outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    out = engine.generate([PROMPT], specsample.SamplingParams(temperature=0.0, min_tokens=3),
                          max_new_tokens=5).outputs[0]
    assert first not in out.token_ids[:3]
