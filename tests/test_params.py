"""SamplingParams validation (API.md table) and SamplingBatch.from_params errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from specsample import SamplingBatch, SamplingParams

BAD = [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "1"), ("temperature", True), ("temperature", None),
    pytest.param("temperature", 10**400, id="temperature-int-beyond-float"),
    pytest.param("logit_bias", {1: -(10**400)}, id="logit_bias-int-beyond-float"),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", "3"),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.01), ("top_p", math.nan),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", math.inf),
    ("seed", 1.0), ("seed", "7"), ("seed", True),
    ("presence_penalty", -2.01), ("presence_penalty", 2.5), ("presence_penalty", math.nan),
    ("frequency_penalty", -3.0), ("frequency_penalty", 2.01), ("frequency_penalty", math.inf),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
    ("repetition_penalty", math.inf),
    ("logit_bias", [(1, 2.0)]), ("logit_bias", {-1: 1.0}), ("logit_bias", {"a": 1.0}),
    ("logit_bias", {1: math.nan}), ("logit_bias", {1: math.inf}), ("logit_bias", {1: "x"}),
    ("logit_bias", {True: 1.0}),
    ("logprobs", -1), ("logprobs", 1.0), ("logprobs", True),
    ("logprobs_mode", "logits"), ("logprobs_mode", None),
]

GOOD = [
    ("temperature", 0.0), ("temperature", 1e-5), ("temperature", 100), ("top_k", -1),
    ("top_k", 0), ("top_k", 1), ("top_k", 10**9), ("top_p", 1e-9), ("top_p", 1.0),
    ("min_p", 0.0), ("min_p", 1.0), ("seed", -(2**70)), ("seed", 2**70),
    ("presence_penalty", -2.0), ("presence_penalty", 2), ("frequency_penalty", -2),
    ("repetition_penalty", 1e-3), ("logit_bias", {0: -100.0, 5: 3}), ("logit_bias", {}),
    ("logprobs", 0), ("logprobs", 20), ("logprobs_mode", "processed"),
]


@pytest.mark.parametrize("field,value", BAD)
def test_invalid_value_raises_naming_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", GOOD)
def test_valid_values_accepted(field, value):
    p = SamplingParams(**{field: value})
    assert getattr(p, field) == value


NUMPY_GOOD = [
    ("temperature", "float32", 0.5), ("temperature", "float64", 0.0), ("top_k", "int64", 5),
    ("top_k", "int32", -1), ("top_p", "float32", 0.75), ("min_p", "float16", 0.25),
    ("seed", "int64", -3), ("seed", "uint64", 2**64 - 1), ("presence_penalty", "float32", -1.5),
    ("frequency_penalty", "int64", 2), ("repetition_penalty", "float64", 1.25),
    ("logprobs", "int64", 3),
]


@pytest.mark.parametrize("field,dtype,value", NUMPY_GOOD)
def test_numpy_scalars_are_numbers_stored_as_python_numbers(field, dtype, value):
    np = pytest.importorskip("numpy")
    p = SamplingParams(**{field: np.dtype(dtype).type(value)})
    stored = getattr(p, field)
    assert type(stored) is (int if field in ("top_k", "seed", "logprobs") else float)
    assert stored == value


def test_numpy_logit_bias_keys_and_values():
    np = pytest.importorskip("numpy")
    p = SamplingParams(logit_bias={np.int64(3): np.float32(1.5), np.int32(7): np.int64(-2), 9: 4})
    assert p.logit_bias == {3: 1.5, 7: -2.0, 9: 4.0}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    batch = SamplingBatch.from_params([p], vocab_size=16)
    assert batch.bias_ids.tolist() == [3, 7, 9]


@pytest.mark.parametrize("field,value,match", [
    ("temperature", "bool", "temperature must be a real number"),
    ("top_k", "bool", "top_k must be an int"),
    ("top_k", "float64", "top_k must be an int"),
    ("seed", "float32", "seed must be an int"),
    ("logprobs", "bool", "logprobs must be an int"),
    ("temperature", "nan", "temperature must be finite"),
    ("logit_bias_key", "bool", "logit_bias key"),
    ("logit_bias_value", "bool", "logit_bias value for token 1"),
    ("logit_bias_value", "nan", "logit_bias value for token 1 must be finite"),
])
def test_numpy_non_numbers_still_rejected(field, value, match):
    np = pytest.importorskip("numpy")
    scalar = {"bool": np.bool_(True), "float64": np.float64(2.0), "float32": np.float32(2.0),
              "nan": np.float32("nan")}[value]
    if field == "logit_bias_key":
        kwargs = {"logit_bias": {scalar: 1.0}}
    elif field == "logit_bias_value":
        kwargs = {"logit_bias": {1: scalar}}
    else:
        kwargs = {field: scalar}
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (1.0, 0, 1.0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logit_bias is None and p.logprobs is None and p.logprobs_mode == "raw"
    assert not p.greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-30).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0


def test_from_params_builds_batch():
    ps = [SamplingParams(temperature=0.0, seed=3), SamplingParams(top_k=50, seed=2**64 + 1),
          SamplingParams(logit_bias={4: 1.5}, frequency_penalty=0.5, logprobs=2)]
    b = SamplingBatch.from_params(ps, vocab_size=10, output_token_ids=[[1], [2, 2], [3, 3, 3]])
    assert b.num_requests == 3 and b.vocab_size == 10
    assert b.top_k.tolist() == [0, 10, 0]  # clamped to V
    assert b.seed_lo.tolist()[:2] == [3, 1] and b.seed_hi.tolist()[:2] == [0, 0]
    assert b.any_greedy and b.any_sampled and b.needs_bias and b.needs_penalties
    assert b.max_logprobs == 2 and b.user_seeded
    assert b.output_ids.tolist() == [3, 3, 3]  # only penalised requests are recorded
    assert b.temperature.dtype == torch.float32


def test_unseeded_requests_get_fresh_seeds():
    torch.manual_seed(0)
    b1 = SamplingBatch.from_params([SamplingParams()] * 2, vocab_size=5)
    b2 = SamplingBatch.from_params([SamplingParams()] * 2, vocab_size=5)
    assert not b1.user_seeded
    assert b1.seed_lo.tolist() != b2.seed_lo.tolist()
    assert b1.seed_lo[0] != b1.seed_lo[1]


@pytest.mark.parametrize("kwargs,match", [
    (dict(params=[], vocab_size=5), "params"),
    (dict(params=[object()], vocab_size=5), r"params\[0\]"),
    (dict(params=[SamplingParams()], vocab_size=0), "vocab_size"),
    (dict(params=[SamplingParams()], vocab_size=2.0), "vocab_size"),
    (dict(params=[SamplingParams()], vocab_size=True), "vocab_size"),
    (dict(params=[SamplingParams(logit_bias={5: 1.0})], vocab_size=5), "logit_bias"),
    (dict(params=[SamplingParams()], vocab_size=5, prompt_token_ids=[[1], [2]]),
     "prompt_token_ids"),
    (dict(params=[SamplingParams()], vocab_size=5, output_token_ids=[[5]]), "output_token_ids"),
    (dict(params=[SamplingParams()], vocab_size=5, output_token_ids=[[-1]]), "output_token_ids"),
    (dict(params=[SamplingParams()], vocab_size=5, prompt_token_ids=[[7]]), "prompt_token_ids"),
])
def test_from_params_errors(kwargs, match):
    params = kwargs.pop("params")
    with pytest.raises(ValueError, match=match):
        SamplingBatch.from_params(params, **kwargs)


def test_needs_rank_filter_names_top_k_and_top_p_of_sampled_requests():
    def flags(*params):
        b = SamplingBatch.from_params(list(params), vocab_size=100)
        return b.needs_filter, b.needs_rank_filter

    assert flags(SamplingParams(min_p=0.1)) == (True, False)  # min_p's cut needs no search
    assert flags(SamplingParams(top_k=5)) == (True, True)
    assert flags(SamplingParams(top_p=0.9), SamplingParams()) == (True, True)
    assert flags(SamplingParams(top_k=100)) == (False, False)  # k >= V keeps every token
    assert flags(SamplingParams(temperature=0.0, top_k=5)) == (False, False)  # greedy
    merged = SamplingBatch.concat([SamplingBatch.from_params([SamplingParams()], vocab_size=100),
                                   SamplingBatch.from_params([SamplingParams(top_p=0.5)],
                                                             vocab_size=100)])
    assert merged.needs_rank_filter and not merged.select([0]).needs_rank_filter
