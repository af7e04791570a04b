"""The engine keeps one SamplingBatch across steps (append / select): the same tokens as
rebuilding the batch from the full history every step, with penalties, bad words, min_tokens
and requests that finish at different steps."""

from __future__ import annotations

import pytest
from engine_helpers import tiny_llama

import specsample
from specsample.engine import SpeculativeEngine

V = 40
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [1, 1, 2], [10, 11, 12, 13, 14]]
PARAMS = [
    specsample.SamplingParams(temperature=0.9, seed=1, presence_penalty=0.8,
                              frequency_penalty=0.5, repetition_penalty=1.4),
    specsample.SamplingParams(temperature=0.0, bad_words_token_ids=[[3], [19, 9], [12, 4, 25]],
                              min_tokens=6),
    specsample.SamplingParams(temperature=1.2, seed=3, min_tokens=4, stop_token_ids=[2],
                              top_k=8),
    specsample.SamplingParams(temperature=0.7, seed=4, logit_bias={9: 3.0},
                              repetition_penalty=0.7),
    specsample.SamplingParams(temperature=1.0, seed=5),
]


class RebuildingEngine(SpeculativeEngine):
    """The engine as it was: a fresh SamplingBatch from the full history every step."""

    def _step(self, core, active, batch, max_new_tokens, on_tokens):
        super()._step(core, active, None, max_new_tokens, on_tokens)
        return None


@pytest.fixture(scope="module")
def model():
    return tiny_llama(5, vocab_size=V, init=0.5)


@pytest.mark.parametrize("drafter", ["ngram", "model", "none"])
def test_persistent_batch_matches_rebuilding(model, drafter):
    kw = dict(num_speculative_tokens=3, eos_token_ids=[0, 2, 5],
              draft_model=model if drafter == "model" else None)
    new = SpeculativeEngine(model, drafter, **kw).generate(PROMPTS, PARAMS, max_new_tokens=14)
    old = RebuildingEngine(model, drafter, **kw).generate(PROMPTS, PARAMS, max_new_tokens=14)
    lengths = {len(o.token_ids) for o in new.outputs}
    assert len(lengths) > 1  # requests finished at different steps (select ran)
    for a, b in zip(new.outputs, old.outputs, strict=True):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
