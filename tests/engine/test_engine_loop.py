"""The generation loop on tiny random Llama models: routing, rollback, invariance, stopping."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import plain_greedy, tiny_llama

import specsample
from specsample.engine import NgramDrafter, SpeculativeEngine, make_drafter, ngram_lookup

REPEAT = [5, 9, 13, 17, 21, 25, 29, 33] * 3 + [5, 9, 13]


def run(model, drafter, prompts, params, *, k=4, max_new_tokens=24, method="token",
        draft_model=None, eos=()):
    engine = SpeculativeEngine(model, drafter, num_speculative_tokens=k, method=method,
                               draft_model=draft_model, eos_token_ids=list(eos))
    return engine.generate(prompts, params, max_new_tokens=max_new_tokens)


def ids(result):
    return [o.token_ids for o in result.outputs]


# ----------------------------------------------------------------------------- ngram lookup


def test_ngram_lookup_prefers_longest_and_most_recent():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix (5, 2, 3) never occurred before; (2, 3) most recently at index 5 -> next 7, 8, 5
    assert ngram_lookup(tokens, 3, max_n=3, min_n=1) == [7, 8, 5]
    assert ngram_lookup(tokens, 2, max_n=3, min_n=1) == [7, 8]
    assert ngram_lookup([1, 2, 3, 1, 2], 4, max_n=2, min_n=1) == [3, 1, 2]
    assert ngram_lookup([4, 5, 6], 4, max_n=3, min_n=1) == []
    assert ngram_lookup([4], 4, max_n=3, min_n=1) == []  # shorter than n
    assert ngram_lookup([7, 7], 3, max_n=3, min_n=1) == [7]
    assert ngram_lookup([1, 2, 1], 0, max_n=3, min_n=1) == []


def test_bad_arguments_are_named(target_model):
    with pytest.raises(ValueError, match="unknown drafter 'bogus'"):
        SpeculativeEngine(target_model, "bogus")
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0"):
        SpeculativeEngine(target_model, "ngram", num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="unknown method"):
        SpeculativeEngine(target_model, "ngram", method="tree")
    with pytest.raises(ValueError, match="needs a draft model"):
        make_drafter("model")
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(max_n=1, min_n=2)
    engine = SpeculativeEngine(target_model, "ngram")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []])
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 64]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate([[1]], [specsample.SamplingParams()] * 2)
    wide = tiny_llama(3, vocab_size=80)
    with pytest.raises(ValueError, match="wider than the target"):
        SpeculativeEngine(target_model, "model", draft_model=wide)


# ----------------------------------------------------------------------------- rollback


@pytest.mark.parametrize("drafter", ["ngram", "model", "none"])
def test_speculative_greedy_equals_plain_greedy(target_model, draft_model, drafter):
    """Cache rollback: greedy output with speculation equals full-recompute greedy decoding."""
    prompts = [REPEAT, [3, 1, 4, 1, 5, 9, 2, 6], [7]]
    params = specsample.SamplingParams(temperature=0.0)
    res = run(target_model, drafter, prompts, params, draft_model=draft_model,
              max_new_tokens=30)
    for prompt, out in zip(prompts, res.outputs, strict=True):
        assert out.token_ids == plain_greedy(target_model, prompt, 30)
        assert out.finish_reason == "length"
    if drafter != "none":
        total = res.stats.total
        assert total.drafted > 0
        assert total.accepted > 0  # the rollback path after partial acceptance ran too
        assert total.accepted < total.drafted


def test_draft_model_equal_to_target_accepts_everything(target_model):
    """A drafter identical to the target is accepted at every position (greedy)."""
    res = run(target_model, "model", [REPEAT], specsample.SamplingParams(temperature=0.0),
              draft_model=target_model, k=3, max_new_tokens=20)
    s = res.stats.total
    assert s.accepted == s.drafted > 0
    assert res.outputs[0].token_ids == plain_greedy(target_model, REPEAT, 20)


# ----------------------------------------------------------------------------- invariance


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", ["token", "block"])
def test_ngram_speculation_invariance(target_model, temperature, method):
    """Seeded requests: ngram speculation emits exactly the plain-decoding tokens."""
    prompts = [REPEAT, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 7, 7, 7], [11]]
    params = [specsample.SamplingParams(temperature=temperature, seed=100 + i)
              for i in range(len(prompts))]
    spec = run(target_model, "ngram", prompts, params, method=method, max_new_tokens=40)
    plain = run(target_model, "none", prompts, params, max_new_tokens=40)
    assert ids(spec) == ids(plain)
    assert spec.stats.total.drafted > 0
    # and reproducible: a second run gives the same tokens
    again = run(target_model, "ngram", prompts, params, method=method, max_new_tokens=40)
    assert ids(again) == ids(spec)


def test_seeded_request_independent_of_batch(target_model):
    """A seeded request's output does not depend on the other requests of the call."""
    p = specsample.SamplingParams(temperature=0.8, seed=5)
    alone = run(target_model, "ngram", [REPEAT], p)
    others = [specsample.SamplingParams(temperature=1.0, seed=9),
              p, specsample.SamplingParams(temperature=0.0)]
    mixed = run(target_model, "ngram", [[1, 2, 3], REPEAT, [4, 4]], others)
    assert mixed.outputs[1].token_ids == alone.outputs[0].token_ids


def test_first_step_logits_bit_identical(target_model):
    """The premise of the invariance tests: float64 tiny model, 1-token and k+1-token forwards
    give bit-identical float32 rows."""
    from specsample.engine.cache import ModelCache

    big, small = ModelCache(target_model), ModelCache(target_model)
    big.forward(REPEAT[:-5])
    small.forward(REPEAT[:-5])
    rows = big.forward(REPEAT[-5:])
    singles = torch.cat([small.forward([t]) for t in REPEAT[-5:]])
    assert torch.equal(rows, singles)


# ----------------------------------------------------------------------------- routing


def test_routing_by_temperature(target_model, draft_model):
    """Mixed batch: temperature 0 requests decode greedily, temperature > 0 ones never do."""
    prompts = [REPEAT] * 6
    params = [specsample.SamplingParams(temperature=0.0, seed=1)] + [
        specsample.SamplingParams(temperature=1.0, seed=s) for s in range(5)]
    greedy = plain_greedy(target_model, REPEAT, 24)
    for drafter in ("ngram", "model", "none"):
        res = run(target_model, drafter, prompts, params, draft_model=draft_model)
        outs = ids(res)
        assert outs[0] == greedy, drafter
        assert all(o != greedy for o in outs[1:]), drafter
        # the sampled requests match plain seeded sampling (one-hot drafts) / differ from
        # each other (different seeds)
        assert len({tuple(o) for o in outs[1:]}) == 5
    paths = res.stats.paths
    assert "torch.sample" in paths or any("sample" in name for name in paths)


def test_unseeded_requests_draw_fresh_seeds(target_model):
    p = specsample.SamplingParams(temperature=1.0)
    a = run(target_model, "ngram", [REPEAT, REPEAT], p)
    assert a.outputs[0].token_ids != a.outputs[1].token_ids
    assert not a.outputs[0].user_seeded and a.outputs[0].params.seed is not None


# ----------------------------------------------------------------------------- stopping


@pytest.mark.parametrize("drafter", ["ngram", "none", "model"])
def test_eos_and_max_new_tokens(target_model, draft_model, drafter):
    greedy = plain_greedy(target_model, REPEAT, 30)
    eos = greedy[7]
    first = greedy.index(eos)
    params = specsample.SamplingParams(temperature=0.0)
    res = run(target_model, drafter, [REPEAT, REPEAT], params, draft_model=draft_model,
              eos=[eos], max_new_tokens=30)
    for out in res.outputs:
        assert out.token_ids == greedy[: first + 1]  # EOS included, nothing after it
        assert out.finish_reason == "stop"
    # max_new_tokens is exact even when a step would emit several tokens
    for n in (1, 2, 3, 5):
        res = run(target_model, drafter, [REPEAT], params, draft_model=draft_model,
                  max_new_tokens=n)
        assert res.outputs[0].token_ids == greedy[:n]
        assert res.outputs[0].finish_reason == "length"
        assert res.stats.total.emitted == n


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_prompt_shorter_than_n(target_model, draft_model, drafter):
    """One-token and two-token prompts (shorter than the ngram size) work and match plain."""
    prompts = [[5], [5, 9]]
    params = [specsample.SamplingParams(temperature=0.8, seed=3),
              specsample.SamplingParams(temperature=0.0)]
    spec = SpeculativeEngine(target_model, drafter, num_speculative_tokens=4,
                             draft_model=draft_model, ngram_max=4, ngram_min=3,
                             eos_token_ids=[]).generate(prompts, params, max_new_tokens=12)
    plain = run(target_model, "none", prompts, params, max_new_tokens=12)
    assert [len(o.token_ids) for o in spec.outputs] == [12, 12]
    assert spec.outputs[1].token_ids == plain.outputs[1].token_ids
    if drafter == "ngram":
        assert ids(spec) == ids(plain)


def test_k_zero_and_stats(target_model):
    params = specsample.SamplingParams(temperature=0.0)
    res = run(target_model, "ngram", [REPEAT], params, k=0, max_new_tokens=10)
    assert res.outputs[0].token_ids == plain_greedy(target_model, REPEAT, 10)
    s = res.stats
    assert s.total.drafted == 0 and s.total.steps == 10 and s.steps == 10
    d = s.to_dict()
    for key in ("tokens_per_s", "acceptance_rate", "mean_accepted_length", "steps", "paths"):
        assert key in d
    assert d["mean_accepted_length"] == 1.0
    res = run(target_model, "ngram", [REPEAT], params, k=4, max_new_tokens=20)
    d = res.stats.to_dict()
    t = res.stats.total
    assert d["acceptance_rate"] == pytest.approx(t.accepted / t.drafted)
    assert d["mean_accepted_length"] == pytest.approx(1 + t.accepted / t.steps)
    assert sum(v["rows"] for k, v in d["paths"].items() if "verify" in k) > 0


def test_accepted_counts_only_emitted_drafts_when_eos_cuts_a_run(target_model):
    """Drafts accepted after an EOS are never emitted, so they are not counted as accepted."""
    greedy = plain_greedy(target_model, REPEAT, 12)
    eos = greedy[2]
    params = specsample.SamplingParams(temperature=0.0)
    res = run(target_model, "model", [REPEAT], params, draft_model=target_model, k=8,
              eos=[eos], max_new_tokens=12)
    s = res.stats.total
    assert res.outputs[0].token_ids == greedy[: greedy.index(eos) + 1]
    assert s.accepted <= s.emitted  # previously 8 accepted for 3 emitted


def test_ctrl_c_keeps_what_was_generated(target_model):
    # Ctrl-C in the step loop lost everything generated so far; GenerationInterrupted (a
    # KeyboardInterrupt) now carries the partial result.
    from specsample.engine import GenerationInterrupted

    seen = []

    def on_tokens(index, new_ids):
        seen.extend(new_ids)
        if len(seen) >= 5:
            raise KeyboardInterrupt

    engine = SpeculativeEngine(target_model, "ngram", num_speculative_tokens=4)
    params = specsample.SamplingParams(temperature=0.0)
    with pytest.raises(KeyboardInterrupt) as e:
        engine.generate([REPEAT], params, max_new_tokens=40, on_tokens=on_tokens)
    assert isinstance(e.value, GenerationInterrupted)
    out = e.value.result.outputs[0]
    assert out.finish_reason == "interrupted"
    assert out.token_ids == seen and len(seen) >= 5
    assert out.token_ids == ids(run(target_model, "none", [REPEAT], params,
                                    max_new_tokens=len(seen)))[0]
    stats = e.value.result.stats
    assert stats.steps >= 1 and stats.decode_s > 0
    assert 0 < stats.sampler_s <= stats.decode_s
    assert stats.to_dict()["sampler_share"] == stats.sampler_s / stats.decode_s
    assert out.stats.emitted == len(seen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_logits_reach_the_sampler_in_the_model_dtype(dtype):
    # No float32 copy of every row: bf16 / fp16 / float32 models hand over their own logits
    # (the Triton kernels read them as they are); float64 ones are cast to float32, the
    # widest dtype the sampler takes.
    from specsample.engine.cache import ModelCache

    model = tiny_llama(dtype=dtype)
    cache = ModelCache(model)
    rows = cache.forward([1, 2, 3])
    tree = cache.forward_tree([4, 5], [-1, 0], tree_start=3)
    want = torch.float32 if dtype == torch.float64 else dtype
    assert rows.dtype == want and tree.dtype == want
    assert rows.shape == (3, model.config.vocab_size)


@pytest.mark.parametrize("drafter", ["ngram", "model", "none"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_warm_up_sampler_runs_the_calls_a_decode_makes(target_model, draft_model, drafter,
                                                       top_p):
    """The warm-up's calls take the routes of the decode's own: one-hot verify() for the
    n-gram drafter, draft_logits (draft_probs with a filter) for a draft model, a step
    without drafts alone without a drafter, for one request and with num_requests=2 for
    two."""
    engine = SpeculativeEngine(target_model, drafter, num_speculative_tokens=3,
                               draft_model=draft_model if drafter == "model" else None)
    params = specsample.SamplingParams(temperature=0.8, top_p=top_p, seed=1)
    specsample.paths.reset()
    engine.warm_up_sampler(params, num_requests=2)
    counts = specsample.paths.counts()
    calls = {k: v["calls"] for k, v in counts.items() if k.startswith("torch.")}
    want = {"none": {"torch.verify.onehot": 2}, "ngram": {"torch.verify.onehot": 4},
            "model": {"torch.verify.onehot": 2,
                      "torch.verify." + ("draft_probs" if top_p < 1 else "draft_logits"): 2}}
    assert calls == want[drafter]
